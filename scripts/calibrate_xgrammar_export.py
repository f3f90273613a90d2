"""What xgrammar's compiled grammars cost to send back from a compile process: per schema, the grammar's measure
(its rules times its expression entries, before compiling), the compile, the serialised size, the serialisation's
time and peak memory, and reading it back; beside what ``xgrammar_export_cost`` predicts from the measure alone.

xgrammar 0.2.8 writes each rule's FSM with a copy of the whole grammar's FSM, so the serialised grammar grows with
rules x grammar size: quadratically in a schema's size. A compile process serialises what it compiled, so that is
where a large schema's compile spends its time and memory (the compile itself takes milliseconds).

Each schema runs in a fresh process (the peak is that process's resident memory above what it held before the
compile), stopped past ``--stop-mib``.

    python -m scripts.calibrate_xgrammar_export [--tokenizer smollm2] [--stop-mib 6000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from triton_ops.cpu_info import describe_cpu

REPO = Path(__file__).resolve().parents[1]


def required_strings(count: int, string_schema: dict[str, Any] | None = None) -> dict[str, Any]:
    names = [f"p{i}" for i in range(count)]
    return {
        "type": "object",
        "properties": {name: dict(string_schema or {"type": "string"}) for name in names},
        "required": names,
    }


CASES: dict[str, dict[str, Any]] = {
    "100 required strings": required_strings(100),
    "300 required strings": required_strings(300),
    "600 required strings": required_strings(600),
    "1,000 required strings": required_strings(1000),
    "300 optional integers": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}},
    "200 date-time strings": required_strings(200, {"type": "string", "format": "date-time"}),
    "100 patterned strings": required_strings(100, {"type": "string", "pattern": "^[a-z]{2,8}-[0-9]{3}$"}),
    "20 objects of 30": {
        "type": "object",
        "properties": {f"o{j}": required_strings(30) for j in range(20)},
        "required": [f"o{j}" for j in range(20)],
    },
}


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def measure_one(name: str, tokenizer: str, stop_mib: float) -> dict[str, Any]:
    """In this process: one schema's measure, compile, serialisation (time, size, peak memory) and read-back."""
    from scheduler.server_args import ServerArgs
    from sglang_constrained.testing.tokenizer_setups import load_tokenizer_setup
    from sglang_constrained.xgrammar_backend import XGrammarGrammarBackend
    from sglang_constrained.xgrammar_export_cost import COMPILE_PROCESS_BASE_MIB, GrammarMeasure
    from sglang_constrained.xgrammar_utf8 import well_formed_utf8_grammar

    args = replace(ServerArgs(), grammar_compile_timeout=600.0, grammar_compile_max_memory=None)
    setup = load_tokenizer_setup(tokenizer, args.cache_path)
    backend = XGrammarGrammarBackend(
        args, setup.tokenizer, setup.vocab_size, setup.eos_token_ids, compile_in_processes=False
    )
    schema_text = json.dumps(backend.prepare_json_schema(CASES[name]))
    grammar = well_formed_utf8_grammar(backend.json_schema_grammar(schema_text))
    measure = GrammarMeasure.of(grammar)
    prediction = measure.predicted_export()
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
    start = time.perf_counter()
    text = compiled.serialize_json()
    serialise_s = time.perf_counter() - start
    serialise_peak = peak[0] - base
    start = time.perf_counter()
    backend.deserialize_grammar(text)
    read_s = time.perf_counter() - start
    done.set()
    return {
        "name": name,
        "measure": measure.product,
        "compile_s": compile_s,
        "bytes": len(text),
        "serialise_s": serialise_s,
        "peak_mib": serialise_peak,
        "read_s": read_s,
        "predicted_bytes": prediction.num_bytes,
        "predicted_peak_mib": prediction.peak_mib - COMPILE_PROCESS_BASE_MIB,
        "predicted_s": prediction.seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default="smollm2")
    parser.add_argument("--stop-mib", type=float, default=6000.0)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one, args.tokenizer, args.stop_mib)), flush=True)
        return
    print(f"CPU: {describe_cpu()}; tokenizer {args.tokenizer}")
    print(
        "schema                   rules x exprs  compile s   MB  pred MB  serialise s  pred s  peak MiB  pred MiB"
        "  read s"
    )
    for name in CASES:
        command = [
            sys.executable,
            "-m",
            "scripts.calibrate_xgrammar_export",
            "--tokenizer",
            args.tokenizer,
            "--stop-mib",
            str(args.stop_mib),
        ]
        output = subprocess.run([*command, "--one", name], cwd=REPO, capture_output=True, text=True, check=False)
        lines = [line for line in output.stdout.splitlines() if line.startswith("{")]
        if not lines:
            print(f"{name:24} failed: {output.stderr.strip().splitlines()[-1:]}")
            continue
        row = json.loads(lines[-1])
        if "stopped_at_mib" in row:
            print(f"{name:24} stopped past {row['stopped_at_mib']:,} MiB")
            continue
        print(
            f"{name:24} {row['measure']:>13,} {row['compile_s']:>10.2f} {row['bytes'] / 1e6:>5.0f} "
            f"{row['predicted_bytes'] / 1e6:>8.0f} {row['serialise_s']:>12.2f} {row['predicted_s']:>7.2f} "
            f"{row['peak_mib']:>9,.0f} {row['predicted_peak_mib']:>9,.0f} {row['read_s']:>7.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
