"""What xgrammar's compiled grammars cost to send back from a compile process: per constraint (JSON schemas,
structural tags offering many tools, EBNF grammars of many rules), the grammar's measure (its rules times its
expression entries) before compiling and after (the compiled grammar's, ``GrammarMeasure.of_compiled``), the compile,
the serialised size, the serialisation's time and peak memory, and reading it back; beside what
``xgrammar_export_cost`` predicts from the measure the backend judges by (a schema's before its compile, any other
constraint's after it).

xgrammar 0.2.8 writes each rule's FSM with a copy of the whole grammar's FSM, so the serialised grammar grows with
rules x grammar size: quadratically in a schema's size. A compile process serialises what it compiled, so that is
where a large schema's compile spends its time and memory (the compile itself takes milliseconds). xgrammar's compile
merges rules (a structural tag's, an EBNF grammar's; a schema's barely), so a tag's measure before its compile
overstates its size several times.

Each constraint runs in a fresh process (the peak is that process's resident memory above what it held before the
compile), stopped past ``--stop-mib``; one whose prediction is past ``--stop-mib`` is not serialised.

    python -m scripts.calibrate_xgrammar_export [--tokenizer smollm2] [--stop-mib 6000] [--only tools]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from cpu_kernels.cpu_info import describe_cpu

REPO = Path(__file__).resolve().parents[1]


def required_strings(count: int, string_schema: dict[str, Any] | None = None) -> dict[str, Any]:
    names = [f"p{i}" for i in range(count)]
    return {
        "type": "object",
        "properties": {name: dict(string_schema or {"type": "string"}) for name in names},
        "required": names,
    }


def tools(count: int) -> dict[str, Any]:
    """A structural tag offering ``count`` tools in the Hermes style, each with three parameters of its own."""
    tags = []
    for i in range(count):
        parameters = {
            "type": "object",
            "properties": {
                f"city_{i}": {"type": "string"},
                f"days_{i}": {"type": "integer"},
                f"unit_{i}": {"enum": ["c", "f"]},
            },
            "required": [f"city_{i}", f"days_{i}"],
        }
        begin = f'<tool_call>{{"name": "tool_{i}", "arguments": '
        content = {"type": "json_schema", "json_schema": parameters}
        tags.append({"type": "tag", "begin": begin, "content": content, "end": "}</tool_call>"})
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags}}


def ebnf_alternatives(count: int) -> str:
    """An EBNF grammar of ``count`` alternative rules, each a keyword, a word and a number."""
    rules = ['root ::= item ("," item)*', "item ::= " + " | ".join(f"r{i}" for i in range(count))]
    rules += [f'r{i} ::= "key{i}=" [a-z]+ " " [0-9]{{1,3}}' for i in range(count)]
    return "\n".join(rules)


CASES: dict[str, tuple[str, Any]] = {
    "100 required strings": ("json", required_strings(100)),
    "300 required strings": ("json", required_strings(300)),
    "600 required strings": ("json", required_strings(600)),
    "1,000 required strings": ("json", required_strings(1000)),
    "300 optional integers": (
        "json",
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}},
    ),
    "200 date-time strings": ("json", required_strings(200, {"type": "string", "format": "date-time"})),
    "100 patterned strings": ("json", required_strings(100, {"type": "string", "pattern": "^[a-z]{2,8}-[0-9]{3}$"})),
    "20 objects of 30": (
        "json",
        {
            "type": "object",
            "properties": {f"o{j}": required_strings(30) for j in range(20)},
            "required": [f"o{j}" for j in range(20)],
        },
    ),
    "a tag of 25 tools": ("structural_tag", tools(25)),
    "a tag of 50 tools": ("structural_tag", tools(50)),
    "a tag of 100 tools": ("structural_tag", tools(100)),
    "a tag of 300 tools": ("structural_tag", tools(300)),
    "a tag of 500 tools": ("structural_tag", tools(500)),
    "EBNF of 300 rules": ("ebnf", ebnf_alternatives(300)),
    "EBNF of 1,000 rules": ("ebnf", ebnf_alternatives(1000)),
    "EBNF of 3,000 rules": ("ebnf", ebnf_alternatives(3000)),
}


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def measure_one(name: str, tokenizer: str, stop_mib: float) -> dict[str, Any]:
    """In this process: one schema's measure, compile, serialisation (time, size, peak memory) and read-back."""
    from scheduler.server_args import GrammarArgs, ModelArgs
    from sglang_constrained.backends.xgrammar.backend import XGrammarGrammarBackend
    from sglang_constrained.backends.xgrammar.export_cost import COMPILE_PROCESS_BASE_MIB, GrammarMeasure
    from sglang_constrained.backends.xgrammar.utf8 import well_formed_utf8_grammar
    from sglang_constrained.testing.tokenizer_setups import load_tokenizer_setup

    args = GrammarArgs(grammar_compile_timeout=600.0, grammar_compile_max_memory=None)
    setup = load_tokenizer_setup(tokenizer, ModelArgs().cache_path)
    backend = XGrammarGrammarBackend(
        args, setup.tokenizer, setup.vocab_size, setup.eos_token_ids, compile_in_processes=False
    )
    kind, spec = CASES[name]
    if kind == "json":
        grammar = backend.json_schema_grammar(json.dumps(backend.prepare_json_schema(spec)))
    elif kind == "structural_tag":
        grammar = backend.structural_tag_grammar(json.dumps(spec))
    else:
        grammar = backend.ebnf_grammar(spec)
    grammar = well_formed_utf8_grammar(grammar)
    measure = GrammarMeasure.of(grammar)
    base = resident_mib()
    peak = [base]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], resident_mib())
            if peak[0] - base > stop_mib:
                print(json.dumps({"name": name, "stopped_at_mib": round(peak[0] - base)}), flush=True)
                os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
    start = time.perf_counter()
    compiled = backend.compiler.compile_grammar(grammar)
    compile_s = time.perf_counter() - start
    compiled_measure = GrammarMeasure.of_compiled(compiled)
    judged = measure if kind == "json" or compiled_measure is None else compiled_measure
    prediction = judged.predicted_export()
    row = {
        "name": name,
        "measure": measure.product,
        "compiled_measure": compiled_measure.product if compiled_measure is not None else None,
        "compile_s": compile_s,
        "predicted_bytes": prediction.num_bytes,
        "predicted_peak_mib": prediction.peak_mib - COMPILE_PROCESS_BASE_MIB,
        "predicted_s": prediction.seconds,
    }
    if prediction.peak_mib - COMPILE_PROCESS_BASE_MIB > stop_mib:
        done.set()
        return row
    start = time.perf_counter()
    text = compiled.serialize_json()
    serialise_s = time.perf_counter() - start
    serialise_peak = peak[0] - base
    start = time.perf_counter()
    backend.deserialize_grammar(text)
    read_s = time.perf_counter() - start
    done.set()
    return {**row, "bytes": len(text), "serialise_s": serialise_s, "peak_mib": serialise_peak, "read_s": read_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default="smollm2")
    parser.add_argument("--stop-mib", type=float, default=6000.0)
    parser.add_argument("--only", default="", help="only the constraints whose name holds this text")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one, args.tokenizer, args.stop_mib)), flush=True)
        return
    print(f"CPU: {describe_cpu()}; tokenizer {args.tokenizer}")
    print("measure: rules x expression entries before the compile, and after (the compiled grammar's), in millions")
    print(
        "constraint               measure  compiled  compile s     MB  pred MB  serialise s  pred s  peak MiB  pred MiB"
        "  read s"
    )
    for name in [name for name in CASES if args.only in name]:
        command = [sys.executable, "-m", "scripts.calibrate_xgrammar_export", "--tokenizer", args.tokenizer]
        command += ["--stop-mib", str(args.stop_mib), "--one", name]
        output = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
        lines = [line for line in output.stdout.splitlines() if line.startswith("{")]
        if not lines:
            print(f"{name:24} failed: {output.stderr.strip().splitlines()[-1:]}")
            continue
        row = json.loads(lines[-1])
        if "stopped_at_mib" in row:
            print(f"{name:24} stopped past {row['stopped_at_mib']:,} MiB")
            continue
        compiled = f"{row['compiled_measure'] / 1e6:.1f}" if row["compiled_measure"] is not None else "-"
        head = f"{name:24} {row['measure'] / 1e6:>7.1f} {compiled:>9} {row['compile_s']:>10.2f}"
        predicted = (
            f"{row['predicted_bytes'] / 1e6:>8.0f}",
            f"{row['predicted_s']:>7.2f}",
            f"{row['predicted_peak_mib']:>9,.0f}",
        )
        if "bytes" not in row:
            print(
                f"{head} {'-':>6} {predicted[0]} {'-':>12} {predicted[1]} {'-':>9} {predicted[2]}  not serialised "
                "(predicted past --stop-mib)",
                flush=True,
            )
            continue
        print(
            f"{head} {row['bytes'] / 1e6:>6.0f} {predicted[0]} {row['serialise_s']:>12.2f} {predicted[1]} "
            f"{row['peak_mib']:>9,.0f} {predicted[2]} {row['read_s']:>7.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
