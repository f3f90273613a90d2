"""Gathers through a shared mapping (``scheduler.model.shm_gather``) over real gloo ranks (torch.multiprocessing):
the tensor-parallel sums the same as gloo's, bit for bit, in a long run of calls of every size around a slot's; the
turn's objects (``DistributedContext``) as they were sent, a long one over gloo; and a clear error, not a hang, when
a peer's process ends.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cpu_kernels import library
from scheduler.distributed import DistributedContext
from scheduler.model.shm_gather import SLOT_BYTES as DEFAULT_SLOT_BYTES
from scheduler.model.shm_gather import SharedMemoryGather
from scheduler.model.tensor_parallel import TensorParallelGroup
from scheduler.server_args import ModelArgs
from scheduler.testing.process import free_port

pytestmark = pytest.mark.multirank

SLOT_BYTES = 4096
"""Small, so that the run crosses a slot's size with small tensors: 1,024 float32 values fit, 1,025 go over gloo."""
ROW_WIDTHS = (1, 7, 256, 1024, 1025, 3000)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CALLS = 150
LARGER_THAN_A_SLOT = DEFAULT_SLOT_BYTES + 1
"""A pickled object this long goes over gloo (every rank alike, as the longest decides)."""


def call_input(call: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s tensor at call ``call``: any rank can draw any rank's."""
    generator = torch.Generator().manual_seed(1000 * call + rank)
    rows, width = 1 + call % 3, ROW_WIDTHS[call % len(ROW_WIDTHS)]
    return torch.randn(rows, width, generator=generator).to(DTYPES[call % len(DTYPES)])


def compare(rank: int, size: int, group: object) -> dict[str, int]:
    """Each call's all_reduce and gather_columns against what they must be (every rank's tensor drawn here, added
    in rank order as gloo's gathers were): how many calls differed, and how many went through the mapping."""
    shared = SharedMemoryGather.open(rank, size, group, slot_bytes=SLOT_BYTES)
    assert shared is not None
    tp = TensorParallelGroup(rank, size, group, shared)
    differing, through_mapping = 0, 0
    for call in range(CALLS):
        inputs = [call_input(call, r) for r in range(size)]
        total = inputs[0].clone()
        for piece in inputs[1:]:
            total += piece
        widths = [inputs[0].shape[1] - r for r in range(size)]
        columns = torch.cat([piece[:, :width] for piece, width in zip(inputs, widths, strict=True)], dim=1)
        x = inputs[rank]
        through_mapping += x.numel() * x.element_size() <= SLOT_BYTES
        same = torch.equal(tp.all_reduce(x.clone()), total)
        same &= torch.equal(tp.gather_columns(x[:, : widths[rank]], widths), columns)
        differing += not same
    return {"differing": differing, "through_mapping": through_mapping}


def run_rank(rank: int, size: int, port: int, out: Path) -> None:
    """The comparison on all three ranks, then on ranks 0 and 1 alone; then the last rank ends after a new mapping
    is made, and the others' next gather must fail, naming it, instead of waiting."""
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    torch.set_num_threads(1)
    library.load(ModelArgs().kernel_build_path)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    pair = dist.new_group([0, 1])
    result: dict[str, object] = {"three": compare(rank, size, dist.group.WORLD)}
    if rank < 2:
        result["two"] = compare(rank, 2, pair)
    context = DistributedContext(rank, size, dist.group.WORLD)
    context.share_memory()
    result["objects"] = (
        context.shared is not None,
        context.all_gather({"rank": rank, "blob": bytes(range(rank + 1)) * 1000}),
        context.all_gather(b"x" * (LARGER_THAN_A_SLOT if rank == 1 else 3)),
        context.broadcast_from_leader("from rank 0" if rank == 0 else None),
        context.broadcast_tokens([5, None, 7] if rank == 0 else [0, 0, 0]),
    )
    shared = SharedMemoryGather.open(rank, size, dist.group.WORLD)
    assert shared is not None
    if rank == size - 1:
        os._exit(0)
    started = time.monotonic()
    try:
        shared.all_gather(torch.ones(4))
        result["peer_gone"] = "no error"
    except RuntimeError as e:
        result["peer_gone"] = str(e)
    result["seconds"] = time.monotonic() - started
    torch.save(result, out / f"{rank}")


def test_gathers_through_the_mapping_give_gloos_bytes_and_a_lost_peer_an_error(tmp_path: Path) -> None:
    """Three ranks share two cores: a waiting rank must give its core up for the others to get there. A group of
    its own, as no server's or other test's can be: it ends one of its ranks; the comparisons share it (starting a
    group costs seconds)."""
    size = 3
    mp.start_processes(run_rank, args=(size, free_port(), tmp_path), nprocs=size, start_method="forkserver")
    results = [torch.load(tmp_path / f"{rank}") for rank in range(size - 1)]
    for result in results:
        for ranks in ("three", "two"):
            assert result[ranks]["differing"] == 0, (ranks, result)
            assert 0 < result[ranks]["through_mapping"] < CALLS, "both paths ran"
        shared, gathered, large, leaders, tokens = result["objects"]
        assert shared
        assert gathered == [{"rank": r, "blob": bytes(range(r + 1)) * 1000} for r in range(size)]
        assert large == [b"x" * 3, b"x" * LARGER_THAN_A_SLOT, b"x" * 3]
        assert leaders == "from rank 0" and tokens == [5, None, 7]
        assert result["peer_gone"].startswith(f"rank {size - 1} is gone"), result
        assert result["seconds"] < 5
