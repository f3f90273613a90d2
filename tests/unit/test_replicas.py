"""``--dp-size N --router sglang``: what each replica is started with, and the flags' checks."""

from __future__ import annotations

import pytest

from scheduler.replicas import replica_argv
from scheduler.server_args import parse_server_args


def test_each_replica_gets_every_flag_but_the_launchers_own() -> None:
    argv = [
        "--dp-size",
        "2",
        "--router=sglang",
        "--grammar-backend",
        "llguidance",
        "--port",
        "30000",
        "--worker-urls",
        "http://a:1",
        "http://b:2",
        "--max-seq-len=640",
        "--router-policy",
        "round_robin",
        "--zmq-port=1",
        "--disable-radix-cache",
    ]
    assert replica_argv(argv) == ["--grammar-backend", "llguidance", "--max-seq-len=640", "--disable-radix-cache"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--router", "sglang"], "--port"),
        (["--worker-urls", "http://a:1"], "--router sglang"),
        (["--router", "sglang", "--port", "1", "--router-health-check-interval", "0"], "must be positive"),
    ],
)
def test_router_flags_are_checked(argv: list[str], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_server_args(argv)


def test_the_router_launcher_is_one_process() -> None:
    args = parse_server_args(["--dp-size", "2", "--router", "sglang", "--port", "30000"])
    args.parallel.check_world_size(1)
    with pytest.raises(ValueError, match="not under torchrun"):
        args.parallel.check_world_size(2)
