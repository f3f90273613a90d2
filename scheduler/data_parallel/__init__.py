"""Data-parallel replicas (``--dp-size``): the per-turn exchange between them (``replica``, this rank's turn
transport) and rank 0's routing of requests and answers (``replica_router``); the grammars rank 0 compiles for them
are ``scheduler.shared_grammars``."""

from scheduler.data_parallel.replica import DataParallelReplica

__all__ = ["DataParallelReplica"]
