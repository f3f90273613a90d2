"""First request after a restart: the time to a ready grammar, cold (compiled) and after a restart (read from the
grammar disk cache), per backend and tokenizer, and the time to first token through a real scheduler started twice.

Constraints: a structural tag of each of ``--tools`` many tools (``<function=name>{json}</function>``, a JSON schema
each), as a tool-calling request sends (under ``auto``, xgrammar wins a small tag and llguidance a large one), and
per backend the ``--schemas`` largest held-out MaskBench schemas (in the shared data, not in ``tests/data``) it
compiles: the first cold phase tries them from the largest down and names those it refuses.

Each round starts a fresh process per phase (a restart is a new process): ``cold`` builds the backend on an empty
grammar cache dir and asks for every constraint in turn, timing each from ``get_cached_or_future_value`` to the
ready grammar (the compile, or the disk read), then waits for the disk writes; ``restart`` does the same on that
directory. The two phases alternate round by round, and the table gives medians, the cold/restart ratio, whether the
restart read the disk (``hit``; a grammar that serialises slower than it compiles is not written, so it compiles
again) and the entry's size. The server part starts ``python -m scheduler.launch`` on an empty grammar cache dir,
sends one unconstrained warm-up request and then each constraint once (timed to its first token), stops it, starts it
again on the same directory, and sends the same requests: TTFT cold and after the restart, side by side (medians
over the rounds, a new directory each round).

    python scripts/bench_grammar_disk_cache.py [--schemas 3] [--tools 100,10] [--rounds 2]
        [--backends xgrammar,llguidance,outlines,auto] [--tokenizers smollm2,qwen35] [--server-backends xgrammar,auto]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import TimeoutError as FutureTimeoutError
from pathlib import Path
from typing import Any

from cpu_kernels.cpu_info import describe_cpu
from scheduler.server_args import GrammarArgs, ModelArgs
from scheduler.testing.process import SchedulerProcess
from sglang_constrained.backends.base import BaseGrammarObject, InvalidGrammarObject
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.backends.registry import create_grammar_backend
from sglang_constrained.cache.disk import GrammarDiskCache, entry_digest
from sglang_constrained.constraint_spec import GrammarKey, make_grammar_key
from sglang_constrained.testing.benchmarking import FOLDERS, cpu_pressure
from sglang_constrained.testing.tokenizer_setups import load_tokenizer_setup

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path("shared") / "data" / "jsonschemabench" / "maskbench"
"""The shared data, beside the checkout (``../shared``) or beside the folder of worktrees (``../../shared``)."""
TEST_DATA = REPO / "tests" / "data" / "maskbench"
READY_TIMEOUT_S = 300.0
"""Also the compile deadline here: the machine is shared, and a cold compile of the largest constraints at 248k
tokens takes tens of seconds."""
SERVER_FLAGS = ("--max-running-requests", "4", "--max-seq-len", "512", "--grammar-compile-timeout", "300")
TTFT_BUDGET = 400
"""The TTFT requests' token budget: every measured constraint's shortest output fits in it (a budget too small for
it is refused up front); the stream is left at the first token."""
PHASES = ("cold", "restart")
KEY_KINDS = {"json_schema": "json", "structural_tag": "structural_tag"}
"""A request's constraint field -> the grammar key's kind."""


def held_out_data() -> Path:
    for root in (REPO.parent, REPO.parent.parent):
        if (root / SHARED_DATA).is_dir():
            return root / SHARED_DATA
    raise SystemExit(f"no {SHARED_DATA} beside the checkout: give --data")


def largest_held_out_schemas(data: Path, count: int) -> dict[str, Any]:
    """The ``count`` largest schemas (by JSON text) of ``data`` that the test data does not hold, by case name."""
    sized = []
    for folder in FOLDERS:
        for path in sorted((data / folder).glob("*.json")):
            if not (TEST_DATA / folder / path.name).exists():
                schema = json.loads(path.read_text(encoding="utf-8"))["schema"]
                sized.append((len(json.dumps(schema)), path.stem.split("---")[-1], schema))
    sized.sort(key=lambda item: -item[0])
    return {f"{name} ({size / 1000:.1f} kB)": schema for size, name, schema in sized[:count]}


def tool_schema(index: int) -> dict[str, Any]:
    """A tool's parameters, varied by index as a real tool set varies (enums, arrays, a nested object)."""
    properties: dict[str, Any] = {
        "query": {"type": "string"},
        "limit": {"type": "integer", "minimum": 1, "maximum": 100},
    }
    if index % 2:
        properties["mode"] = {"type": "string", "enum": ["fast", "exact", f"mode_{index}"]}
    if index % 3 == 0:
        properties["tags"] = {"type": "array", "items": {"type": "string"}, "maxItems": 5}
    if index % 5 == 0:
        properties["options"] = {
            "type": "object",
            "properties": {"verbose": {"type": "boolean"}, "depth": {"type": "integer"}},
            "required": ["verbose"],
            "additionalProperties": False,
        }
    return {"type": "object", "properties": properties, "required": ["query"], "additionalProperties": False}


def tools_tag(num_tools: int) -> dict[str, Any]:
    tags = [
        {
            "begin": f"<function=tool_{index:03d}>",
            "content": {"type": "json_schema", "json_schema": tool_schema(index)},
            "end": "</function>",
        }
        for index in range(num_tools)
    ]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<function="], "tags": tags}}


def candidates(options: argparse.Namespace) -> dict[str, tuple[str, Any]]:
    """Name -> (the request's constraint field, spec): the tool tag, then held-out schemas from the largest down."""
    chosen: dict[str, tuple[str, Any]] = {
        f"{count}-tool structural tag": ("structural_tag", tools_tag(count)) for count in options.tools
    }
    for name, schema in largest_held_out_schemas(options.data, options.candidates).items():
        chosen[name] = ("json_schema", schema)
    return chosen


def run_phase(spec: dict[str, Any]) -> dict[str, Any]:
    """One process's phase: build the backend on the cache dir, time each constraint to a ready grammar. With
    ``want``, JSON schemas are tried in order until that many compiled (the refused ones are recorded too)."""
    setup = load_tokenizer_setup(spec["tokenizer"], ModelArgs().cache_path)
    args = GrammarArgs(grammar_backend=spec["backend"], grammar_compile_timeout=READY_TIMEOUT_S)
    disk_cache = GrammarDiskCache(Path(spec["directory"]), args.grammar_disk_cache_max_bytes)
    started = time.perf_counter()
    backend = create_grammar_backend(
        args, setup.tokenizer, setup.vocab_size, setup.eos_token_ids, disk_cache=disk_cache
    )
    assert backend is not None
    backend.wait_until_ready()
    results: dict[str, Any] = {"build_s": time.perf_counter() - started, "constraints": {}}
    num_schemas_ready = 0
    try:
        for name, (field, constraint) in spec["constraints"].items():
            if field == "json_schema" and num_schemas_ready == spec.get("want"):
                break
            key = make_grammar_key(KEY_KINDS[field], constraint)
            outcome = time_to_ready(backend, key)
            if "ready_s" in outcome:
                num_schemas_ready += field == "json_schema"
                disk_cache.flush()
                entry = disk_cache.directory / f"{entry_digest(backend.compile_identity(), key)}.grammar"
                outcome["entry_bytes"] = entry.stat().st_size if entry.exists() else 0
            results["constraints"][name] = outcome
    finally:
        backend.shutdown()
    return results


def time_to_ready(backend: GrammarPipeline, key: GrammarKey) -> dict[str, Any]:
    """``{"ready_s", "hit", "chosen"}`` from asking the backend to the ready grammar, or ``{"failure"}``."""
    start = time.perf_counter()
    value, _ = backend.get_cached_or_future_value(key)
    try:
        grammar = value if isinstance(value, BaseGrammarObject) else value.result(timeout=READY_TIMEOUT_S)
    except FutureTimeoutError:
        return {"failure": f"not ready in {READY_TIMEOUT_S:g} s"}
    except Exception as e:
        return {"failure": str(e)[:80]}
    seconds = time.perf_counter() - start
    if isinstance(grammar, InvalidGrammarObject):
        return {"failure": grammar.error_message[:80]}
    assert grammar.grammar_stats is not None
    stats = grammar.grammar_stats
    return {"ready_s": seconds, "hit": stats.is_disk_cache_hit, "chosen": stats.chosen_backend}


def phase_in_new_process(spec: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--phase"], input=json.dumps(spec), capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {spec['backend']} phase failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def bench_backends(
    options: argparse.Namespace, offered: dict[str, tuple[str, Any]]
) -> dict[tuple[str, str], dict[str, tuple[str, Any]]]:
    """Print the table; returns the constraints measured per (tokenizer, backend): the tag and the ``--schemas``
    largest schemas the backend compiled in the first cold phase (the larger ones it refused are named)."""
    print("\n## Time to a ready grammar, cold vs after a restart (medians; a fresh process per phase)")
    print(
        f"{'tokenizer':9} {'backend':10} {'constraint':32} {'cold s':>8} {'restart s':>9} {'cold/restart':>12} "
        f"{'hit':>4} {'entry MB':>8}"
    )
    measured = {}
    for tokenizer in options.tokenizers:
        for backend in options.backends:
            runs: dict[str, list[dict[str, Any]]] = {phase: [] for phase in PHASES}
            spec: dict[str, Any] = {"tokenizer": tokenizer, "backend": backend, "want": options.schemas}
            for _ in range(options.rounds):
                with tempfile.TemporaryDirectory(prefix="grammar-disk-bench-") as directory:
                    for phase in PHASES:
                        if "constraints" not in spec:  # the first cold phase picks the schemas
                            runs[phase].append(
                                phase_in_new_process({**spec, "directory": directory, "constraints": offered})
                            )
                            tried = runs[phase][0]["constraints"]
                            ready = [name for name, outcome in tried.items() if "ready_s" in outcome]
                            spec = {**spec, "want": None, "constraints": {name: offered[name] for name in ready}}
                            refused = [name.split()[0] for name in tried if name not in ready]
                            continue
                        runs[phase].append(phase_in_new_process({**spec, "directory": directory}))
            builds = [statistics.median(run["build_s"] for run in runs[phase]) for phase in PHASES]
            print(f"{tokenizer:9} {backend:10} {'(backend build)':32} {builds[0]:8.2f} {builds[1]:9.2f}")
            for name in spec["constraints"]:
                print_row(tokenizer, backend, name, [[run["constraints"][name] for run in runs[p]] for p in PHASES])
            if refused:
                print(f"{'':20} not compiled (larger, or the tag): {', '.join(refused)}")
            measured[(tokenizer, backend)] = spec["constraints"]
    return measured


def print_row(tokenizer: str, backend: str, name: str, outcomes: list[list[dict[str, Any]]]) -> None:
    cold, restart = outcomes
    if any("failure" in outcome for outcome in cold + restart):
        failure = next(outcome["failure"] for outcome in cold + restart if "failure" in outcome)
        print(f"{tokenizer:9} {backend:10} {name[:32]:32} {'-':>8} {'-':>9} {'-':>12}  {failure}")
        return
    cold_s = statistics.median(outcome["ready_s"] for outcome in cold)
    restart_s = statistics.median(outcome["ready_s"] for outcome in restart)
    hits = sum(outcome["hit"] for outcome in restart)
    size = max(outcome["entry_bytes"] for outcome in cold + restart) / 1e6
    chosen = f" ({cold[0]['chosen']})" if cold[0]["chosen"] else ""
    print(
        f"{tokenizer:9} {backend:10} {name[:32]:32} {cold_s:8.3f} {restart_s:9.3f} {cold_s / restart_s:11.1f}x "
        f"{hits}/{len(restart)} {size:8.2f}{chosen}"
    )


def first_token_s(server: SchedulerProcess, sampling_params: dict[str, Any]) -> float:
    """Seconds from sending a one-token request to its first token."""
    prompt = [{"role": "user", "content": "Answer with a tool call or a JSON object."}]
    with server.client() as client:
        sent = time.perf_counter()
        params = {"max_new_tokens": TTFT_BUDGET, **sampling_params}
        for chunk in client.generate_stream(messages=prompt, sampling_params=params):
            if chunk.finish_reason is not None and chunk.finish_reason.type == "abort":
                raise RuntimeError(f"the request failed: {chunk.finish_reason.message}")
            if chunk.token_ids:
                return time.perf_counter() - sent
    raise RuntimeError("no token came back")


def bench_server(backend: str, chosen: dict[str, tuple[str, Any]], rounds: int) -> None:
    """Per round: a server on an empty grammar cache dir, then one started again on it; TTFT medians."""
    print(f"\n## TTFT through python -m scheduler.launch --grammar-backend {backend}, cold vs after a restart")
    print(f"{'constraint':40} {'cold s':>8} {'restart s':>9} {'cold/restart':>12}")
    ttft: dict[str, dict[str, list[float]]] = {name: {phase: [] for phase in PHASES} for name in chosen}
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="grammar-disk-bench-") as directory:
            for phase in PHASES:
                server = SchedulerProcess(*SERVER_FLAGS, "--grammar-backend", backend, "--grammar-cache-dir", directory)
                try:
                    server.wait_until_ready()
                    first_token_s(server, {"temperature": 0})  # warm-up: the first forward's one-time costs
                    for name, (field, constraint) in chosen.items():
                        ttft[name][phase].append(first_token_s(server, {"temperature": 0, field: constraint}))
                finally:
                    server.stop()
                    server.log_path.unlink(missing_ok=True)
    for name, times in ttft.items():
        cold_s, restart_s = (statistics.median(times[phase]) for phase in PHASES)
        print(f"{name[:40]:40} {cold_s:8.3f} {restart_s:9.3f} {cold_s / restart_s:11.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", action="store_true", help=argparse.SUPPRESS)  # its spec on stdin
    parser.add_argument(
        "--data", type=Path, help="the MaskBench folders (default: the shared data beside the checkout)"
    )
    parser.add_argument(
        "--schemas", type=int, default=3, help="per backend, how many of the largest held-out schemas it compiles"
    )
    parser.add_argument("--candidates", type=int, default=40, help="the largest held-out schemas offered")
    parser.add_argument(
        "--tools",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[100, 10],
        help="a structural tag of each of these many tools (under auto, xgrammar wins the small one)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--backends", type=lambda text: text.split(","), default=["xgrammar", "llguidance", "outlines", "auto"]
    )
    parser.add_argument("--tokenizers", type=lambda text: text.split(","), default=["smollm2", "qwen35"])
    parser.add_argument(
        "--server-backends", type=lambda text: [n for n in text.split(",") if n], default=["xgrammar", "auto"]
    )
    options = parser.parse_args()
    if options.phase:
        print(json.dumps(run_phase(json.load(sys.stdin))))
        return
    print(f"CPU: {describe_cpu()}")
    pressure = cpu_pressure()
    print(f"CPU pressure (share of the last minute a task waited for a core): {pressure}")
    options.data = options.data or held_out_data()
    measured = bench_backends(options, candidates(options))
    for backend in options.server_backends:
        if ("smollm2", backend) not in measured:
            print(f"\nno TTFT for {backend}: the server runs SmolLM2, so measure smollm2 and {backend} first")
            continue
        bench_server(backend, measured[("smollm2", backend)], options.rounds)
    print(f"\nCPU pressure at the end: {cpu_pressure()}")


if __name__ == "__main__":
    main()
