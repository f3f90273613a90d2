"""``python -m scheduler.launch --grammar-backend xgrammar``: load the model and serve until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Sequence
from types import FrameType

from scheduler.ipc import SchedulerIPC
from scheduler.model_runner import ModelRunner
from scheduler.scheduler import Scheduler
from scheduler.server_args import ServerArgs

logger = logging.getLogger("scheduler.launch")


def main(argv: Sequence[str] | None = None) -> int:
    server_args = ServerArgs.parse(argv)
    logging.basicConfig(
        level=server_args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    start = time.perf_counter()
    model_runner = ModelRunner(server_args)
    scheduler = Scheduler(server_args, model_runner)
    logger.info("loaded %s in %.1f s", server_args.model_name, time.perf_counter() - start)

    def request_stop(signum: int, _: FrameType | None) -> None:
        logger.info("received %s, shutting down", signal.Signals(signum).name)
        scheduler.stop()

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    ipc = SchedulerIPC(server_args.zmq_endpoint)
    try:
        scheduler.serve(ipc)
    finally:
        ipc.close()
        scheduler.shutdown()
    logger.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
