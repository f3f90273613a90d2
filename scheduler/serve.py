"""Serve until SIGINT/SIGTERM, as ``python -m scheduler.launch`` asks (see ``scheduler.launch``): load the model and
the grammar backend, open the sockets on the leading rank, run the loop, and shut down.

Under ``torchrun --nproc-per-node N`` every rank runs the loop and rank 0 owns the sockets; with ``--tp-size N``
each rank holds a shard of the model, with ``--dp-size N`` each rank is a replica serving the requests rank 0
routes to it.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING

import torch

from cpu_kernels import library
from scheduler.distributed import (
    DistributedContext,
    RankFailureError,
    destroy_distributed,
    init_distributed,
    tensor_parallel_group,
)
from scheduler.ipc import SchedulerIPC
from scheduler.model.llamacpp_runner import LlamaCppModelRunner
from scheduler.model.runner import ModelRunner
from scheduler.model.runner_contract import BaseModelRunner
from scheduler.scheduler import Scheduler
from scheduler.server_args import WORLD_SIZE, ServerArgs, ServingArgs
from scheduler.startup_heap import freeze_startup_heap, return_freed_memory

if TYPE_CHECKING:
    from scheduler.http.server import HttpFrontend

logger = logging.getLogger("scheduler.launch")  # the launcher's log lines, as operators and tests know them


def serve(server_args: ServerArgs) -> int:
    """Serve with ``server_args`` (already checked against the world size); returns the process's exit code. The
    whole ``server_args``: the model runner, the scheduler and the HTTP frontend each take their parts from it."""
    dist = init_distributed(WORLD_SIZE.get())
    _configure_logging(server_args.serving, dist)
    is_leader = dist is None or dist.is_leader
    # The HTTP frontend starts first, so that its own start (imports, tokenizer) overlaps the model's loading;
    # meanwhile its requests wait for the scheduler (and /health answers 503).
    http_frontend = _start_http_frontend(server_args) if is_leader and server_args.serving.port is not None else None
    try:
        scheduler = _load(server_args, dist)
    except BaseException:
        if http_frontend is not None:
            http_frontend.stop()
        raise
    # The cores go to the model's kernels; torch's own ops between forwards (sampling, logprobs) run on one thread,
    # whose OpenMP team would otherwise spin after each op on the very cores the next forward needs.
    library.set_kernel_threads(torch.get_num_threads())
    torch.set_num_threads(1)
    if dist is not None:
        dist.share_memory()
    logger.info("model kernels on %d threads, torch's own ops on 1", library.kernel_threads())

    def request_stop(signum: int, _: FrameType | None) -> None:
        logger.info("received %s, shutting down", signal.Signals(signum).name)
        scheduler.stop()

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    ipc = SchedulerIPC(server_args.serving.zmq_endpoint) if is_leader else None
    frontend_exit_codes: list[int] = []

    def frontend_died(exit_code: int) -> None:
        logger.error("the HTTP frontend exited with code %d: stopping, the server has no way in without it", exit_code)
        frontend_exit_codes.append(exit_code)
        scheduler.stop()

    if http_frontend is not None:
        http_frontend.on_unexpected_exit(frontend_died)
    logger.info(
        "%d objects of the start left out of garbage collections, %.0f MiB it freed returned to the system",
        freeze_startup_heap(),
        return_freed_memory() / 2**20,
    )
    exit_code = 0
    try:
        scheduler.serve(ipc)
    except RankFailureError as e:
        logger.error("%s; stopping this rank (the launcher stops the others)", e)
        exit_code = 1
    finally:
        scheduler.shutdown(ipc)  # answers live requests with an abort through ipc, so before ipc.close()
        if ipc is not None:
            ipc.close()
        if http_frontend is not None:
            http_frontend.stop()
    if frontend_exit_codes:
        exit_code = 1
    if exit_code == 0:
        destroy_distributed(dist)
    logger.info("stopped")
    return exit_code


def _load(server_args: ServerArgs, dist: DistributedContext | None) -> Scheduler:
    start = time.perf_counter()
    model_runner: BaseModelRunner = (
        LlamaCppModelRunner(server_args.model)
        if server_args.model.model_runner == "llamacpp"
        else ModelRunner(server_args.model, tp=tensor_parallel_group(dist, server_args.parallel.tp_size))
    )
    scheduler = Scheduler(server_args, model_runner, dist)
    logger.info("loaded %s in %.1f s", server_args.model.model_name, time.perf_counter() - start)
    return scheduler


def _start_http_frontend(server_args: ServerArgs) -> HttpFrontend:
    """Imported here: a server without ``--port`` need not import the frontend's web stack."""
    from scheduler.http.server import start_http_frontend

    return start_http_frontend(server_args)


def _configure_logging(serving: ServingArgs, dist: DistributedContext | None) -> None:
    rank = f"[rank {dist.rank}] " if dist is not None else ""
    logging.basicConfig(
        level=serving.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {rank}%(name)s: %(message)s",
        stream=sys.stderr,
    )
