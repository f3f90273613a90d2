"""The embedded model as the GGUF files people download, and decode on them: our runner beside llama.cpp.

    python scripts/quantize_model.py [--types Q4_K_M Q6_K] [--out DIR] [--measure] [--rounds 3] [--steps 32]

Makes each ``--types`` file from the embedded SmolLM2-135M-Instruct GGUF with llama.cpp's own quantizer
(``llama_cpp.llama_model_quantize`` from the ``llamacpp`` extra, ``allow_requantize``: the embedded file is Q4_1, so
these hold its weights quantised again; their formats and speed are what they show, not quality against the
original float weights) and prints each file's tensor types: SmolLM2's 576-wide rows are not whole k-quant
super-blocks of 256, so llama.cpp falls back on Q5_0 or Q8_0 for most of its tensors, as in real files of small
models.

``--measure`` then times a decode step at B = 1 on the embedded file and on each made one: per round one process per
file and engine (the engines take turns going first), ours (``ModelRunner`` on the file, ``--weight-dtype auto``) and
llama.cpp's (``Llama.eval`` of one token), both after a 100-token prompt on ``torch.get_num_threads()`` threads. It
prints the medians over rounds of each process's median step, the bytes our step streams (its packed weights), its
bandwidth bound (those bytes over the rate at which the kernels stream a 268 MB float32 weight at one row) and each
process's peak resident memory (before that weight); with the CPU model and flags, and the CPU pressure after each
round (the machine may be shared: the engines' rounds are interleaved, read the ratios). The stream rate is measured
in our process, one stream before each decode step, and the step over its bound is each process's median step over
the bytes at its median rate: this machine's memory rate moved 1.4x within minutes, so a rate measured apart from
the steps made the ratio move with it (1.68x and 2.59x in two runs of the same code, AMD EPYC Zen 3).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from cpu_kernels.cpu_info import describe_cpu
from scheduler.server_args import ModelArgs
from sglang_constrained.testing.benchmarking import cpu_pressure
from sglang_constrained.tokenizer.loading import embedded_model_path

TYPES = ("Q4_K_M", "Q6_K", "Q5_K_M", "Q4_0", "Q5_0", "Q5_1", "Q8_0")
"""The file types this script makes (llama.cpp's ``LLAMA_FTYPE_MOSTLY_<type>``)."""

OURS = """
import json, resource, statistics, sys, time, torch
from cpu_kernels import ops, packed_weights
from scheduler.model.runner import ModelRunner
from scheduler.server_args import ModelArgs, ServerArgs

path, steps = sys.argv[1], int(sys.argv[2])
runner = ModelRunner(ModelArgs(model_path=path, max_running_requests=4, disable_radix_cache=True))
tokens = [(i * 7919) % 40000 + 100 for i in range(100)]
seq = runner.kv.admit(tokens, steps + 8)
runner.prefill([seq], [tokens])
runner.decode([seq], [4])
peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
weight = packed_weights.pack_dense(torch.randn(16384, 4096) * 0.01)
x = torch.randn(1, 4096)
times, rates = [], []
for step in range(steps):
    started = time.perf_counter()
    ops.matmul(x, weight)
    rates.append(weight.nbytes / (time.perf_counter() - started))
    started = time.perf_counter()
    runner.decode([seq], [5 + step])
    times.append(time.perf_counter() - started)
print(json.dumps({
    "step": statistics.median(times),
    "bandwidth": statistics.median(rates),
    "streamed": runner.model.num_streamed_bytes,
    "formats": runner.model.weight_formats,
    "peak_rss": peak_rss,
}))
"""

LLAMA_CPP = """
import json, resource, statistics, sys, time, torch
import llama_cpp

path, steps = sys.argv[1], int(sys.argv[2])
threads = torch.get_num_threads()
llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
llm.eval([(i * 7919) % 40000 + 100 for i in range(100)])
times = []
for step in range(steps):
    started = time.perf_counter()
    llm.eval([5 + step])
    times.append(time.perf_counter() - started)
peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"step": statistics.median(times), "peak_rss": peak_rss}))
"""


def quantize(source: Path, target: Path, file_type: str, threads: int) -> None:
    """``source`` requantised to ``file_type`` by llama.cpp at ``target``."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.allow_requantize = True
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize to {file_type} failed with status {status}")


def tensor_types(path: Path) -> str:
    """The file's tensor types, counted, e.g. ``Q5_0 x166, F32 x61``."""
    from scheduler.model.gguf_file import read_gguf_file

    counts = collections.Counter(tensor.tensor_type.name for tensor in read_gguf_file(path).tensors)
    return ", ".join(f"{name} x{count}" for name, count in counts.most_common())


def run(code: str, path: Path | None = None, steps: int = 0) -> dict[str, float | str]:
    here = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", code, str(path), str(steps)],
        cwd=here,
        env={**os.environ, "PYTHONPATH": str(here)},
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"measuring {path} failed:\n{result.stderr[-3000:]}")
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", choices=TYPES, default=["Q4_K_M", "Q6_K"])
    parser.add_argument("--out", type=Path, default=ModelArgs().cache_path / "quantized", help="where files go")
    parser.add_argument("--measure", action="store_true", help="time decode steps, ours and llama.cpp's")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per process")
    args = parser.parse_args()
    source = embedded_model_path()
    args.out.mkdir(parents=True, exist_ok=True)
    files = [source]
    for file_type in args.types:
        target = args.out / f"{source.stem.rsplit('.', 1)[0]}.{file_type}.gguf"
        if not target.is_file():
            quantize(source, target, file_type, os.cpu_count() or 1)
        files.append(target)
    for path in files:
        print(f"{path.name}: {path.stat().st_size / 1e6:.1f} MB; {tensor_types(path)}")
    if not args.measure:
        return
    figures: dict[tuple[str, str], list[dict[str, float | str]]] = collections.defaultdict(list)
    pressures = [cpu_pressure()]
    for round_index in range(args.rounds):
        for path in files:
            engines = [("ours", OURS), ("llama.cpp", LLAMA_CPP)]
            for engine, code in engines if round_index % 2 == 0 else engines[::-1]:
                figures[path.name, engine].append(run(code, path, args.steps))
        pressures.append(cpu_pressure())
    print(f"CPU {describe_cpu()}; decode B=1 after a 100-token prompt, medians of {args.rounds} rounds")
    shown = ", ".join("-" if p is None else f"{p:.2f}" for p in pressures)
    print(f"CPU pressure (PSI some avg60) at the start and after each round: {shown}")
    for path in files:
        ours, theirs = figures[path.name, "ours"], figures[path.name, "llama.cpp"]
        step, peer_step = (statistics.median(float(run["step"]) for run in runs) for runs in (ours, theirs))
        rss, peer_rss = (statistics.median(float(run["peak_rss"]) for run in runs) / 1e6 for runs in (ours, theirs))
        streamed = float(ours[0]["streamed"])
        bandwidth = statistics.median(float(run["bandwidth"]) for run in ours)
        over_bound = statistics.median(float(run["step"]) * float(run["bandwidth"]) / streamed for run in ours)
        print(
            f"{path.name}: ours {step * 1e3:.2f} ms ({streamed / 1e6:.1f} MB streamed, {streamed / step / 1e9:.1f}"
            f" GB/s; the kernels stream {bandwidth / 1e9:.1f} GB/s beside it: bound {streamed / bandwidth * 1e3:.2f}"
            f" ms, the step {over_bound:.2f}x it;"
            f" {ours[0]['formats']}), llama.cpp {peer_step * 1e3:.2f} ms; llama.cpp/ours {peer_step / step:.2f};"
            f" peak RSS ours {rss:.0f} MB, llama.cpp {peer_rss:.0f} MB"
        )


if __name__ == "__main__":
    main()
