"""Cache-aware routing against round robin, on a multi-turn chat workload through SGLang's router.

``python -m scripts.bench_router_cache [--rounds 4] [--conversations 8] [--turns 4] [--system-words 300]
[-- SERVER FLAGS]`` starts two replicas behind the router with ``python -m scheduler.launch --dp-size 2 --router
sglang --router-policy cache_aware`` and a second router (``round_robin``) in front of the same two replicas. Each
round runs the same workload through each router in turn (which goes first alternates), the replicas' prefix caches
flushed before each: ``--conversations`` chats, each opened by one of two long system prompts (new ones each round),
that grow turn by turn (the model's answer, then the next question); a turn of every conversation is sent at once,
in an order shuffled per turn (the same for both policies: users do not answer in turn, and a fixed order would let
round robin send each conversation to the same replica every turn), streamed with ``stream_options.include_usage``,
then the next turn. Prints the CPU, one line per round and policy, and per policy: the prompt tokens the replicas
took from their prefix caches (the answers' ``usage.prompt_tokens_details.cached_tokens``, summed), the prompt
tokens, their share, and the median time to first token; then cache-aware's hit share, prompt tokens computed
and TTFT median over round robin's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from cpu_kernels.cpu_info import describe_cpu
from scheduler.testing.router import ReplicaSet, RouterProcess, router_installed

POLICIES = ("cache_aware", "round_robin")
SERVER_FLAGS = ("--max-running-requests", "16", "--max-seq-len", "1536")
QUESTIONS = (
    "Which three cities should a first visit to Italy include?",
    "How many days would you spend in each?",
    "What is the best way to travel between them?",
    "Which dishes should I try in each city?",
    "What should I pack for a trip in April?",
    "Give me one sentence to remember the trip by.",
)


@dataclass
class Tally:
    """One policy's figures over the rounds."""

    cached_tokens: int = 0
    prompt_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        self.cached_tokens += other.cached_tokens
        self.prompt_tokens += other.prompt_tokens
        self.ttfts += other.ttfts

    @property
    def hit_share(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)

    @property
    def num_computed(self) -> int:
        """Prompt tokens the replicas computed (not found in their prefix caches)."""
        return self.prompt_tokens - self.cached_tokens

    def describe(self) -> str:
        return (
            f"{self.cached_tokens} of {self.prompt_tokens} prompt tokens cached ({self.hit_share:.1%}; "
            f"{self.num_computed} computed), TTFT median "
            f"{statistics.median(self.ttfts) * 1e3:.0f} ms (n={len(self.ttfts)})"
        )


def system_prompt(tag: str, words: int) -> str:
    """A long instruction block, as a deployment's system prompt; ``tag`` makes it another prompt."""
    rules = " ".join(
        f"Rule {i}: answer briefly, name concrete places, and never invent prices." for i in range(words // 11)
    )
    return f"You are travel assistant {tag}. {rules}"


async def turn(
    http: httpx.AsyncClient, messages: list[dict[str, str]], max_tokens: int
) -> tuple[str, float, dict[str, Any]]:
    """One streamed chat turn: ``(answer, seconds to its first token, usage)``."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    started = time.perf_counter()
    first_token_s, text, usage = None, "", None
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"{response.status_code}: {response.text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(f"streamed error: {chunk['error']}")
            for choice in chunk.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    first_token_s = first_token_s or time.perf_counter() - started
                    text += choice["delta"]["content"]
            usage = chunk.get("usage") or usage
    if usage is None or first_token_s is None:
        raise RuntimeError(f"no usage or no token in the stream (usage {usage}, text {text!r})")
    return text, first_token_s, usage


async def workload(url: str, tag: str, seed: int, args: argparse.Namespace) -> Tally:
    """The conversations of one round through the router at ``url``: each turn of all of them at once, in an order
    drawn from ``seed``."""
    rng = random.Random(seed)
    systems = [system_prompt(f"{tag}-{i}", args.system_words) for i in range(2)]
    chats = [[{"role": "system", "content": systems[c % 2]}] for c in range(args.conversations)]
    tally = Tally()
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        for t in range(args.turns):
            for c, chat in enumerate(chats):
                chat.append({"role": "user", "content": f"(conversation {c}) {QUESTIONS[t % len(QUESTIONS)]}"})
            order = rng.sample(chats, len(chats))
            answers = await asyncio.gather(*(turn(http, chat, args.max_tokens) for chat in order))
            for chat, (text, ttft, usage) in zip(order, answers, strict=True):
                chat.append({"role": "assistant", "content": text})
                tally.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
                tally.prompt_tokens += usage["prompt_tokens"]
                tally.ttfts.append(ttft)
    return tally


def flush(replica_urls: list[str]) -> None:
    for url in replica_urls:
        response = httpx.post(f"{url}/flush_cache", timeout=60)
        if response.status_code != 200:
            raise RuntimeError(f"{url}/flush_cache: {response.status_code} {response.text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=32, help="of each answer")
    parser.add_argument("server_flags", nargs="*", help="extra flags for each replica (after --)")
    args = parser.parse_args()
    if not router_installed():
        raise SystemExit('SGLang\'s router is not installed: pip install -e ".[router]"')
    print(f"CPU: {describe_cpu()}, {os.cpu_count()} cores (shared with other work: rounds interleave)", flush=True)
    replicas = ReplicaSet(2, *SERVER_FLAGS, *args.server_flags, policy="cache_aware")
    round_robin: RouterProcess | None = None
    tallies = {policy: Tally() for policy in POLICIES}
    try:
        replicas.wait_for_workers(healthy=2)
        replica_urls = [replicas.current(i).url for i in range(2)]
        round_robin = RouterProcess(replica_urls, "round_robin")
        round_robin.wait_until_ready()
        urls = {"cache_aware": replicas.url, "round_robin": round_robin.url}
        asyncio.run(workload(replicas.url, "warm-up", 0, argparse.Namespace(**{**vars(args), "turns": 1})))
        for r in range(args.rounds):
            for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:
                flush(replica_urls)
                tally = asyncio.run(workload(urls[policy], f"{r}-{policy}", r, args))
                print(f"round {r} {policy}: {tally.describe()}", flush=True)
                tallies[policy].add(tally)
    finally:
        if round_robin is not None:
            round_robin.stop()
            round_robin.log_path.unlink(missing_ok=True)
        replicas.stop()
        replicas.log_path.unlink(missing_ok=True)
    for policy, tally in tallies.items():
        print(f"{policy}: {tally.describe()}")
    aware, robin = tallies["cache_aware"], tallies["round_robin"]
    print(
        f"cache_aware / round_robin: hit share {aware.hit_share / max(robin.hit_share, 1e-9):.2f}x, prompt tokens "
        f"computed {aware.num_computed / max(1, robin.num_computed):.2f}x, "
        "TTFT median "
        f"{statistics.median(aware.ttfts) / statistics.median(robin.ttfts):.2f}x ({args.conversations} conversations "
        f"x {args.turns} turns, {args.rounds} rounds, system prompts of {args.system_words} words)"
    )


if __name__ == "__main__":
    main()
