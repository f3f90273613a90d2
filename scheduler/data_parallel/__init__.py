"""Data-parallel replicas (``--dp-size``): the per-turn exchange between them (``replica``, this rank's turn
transport), rank 0's routing of requests and answers (``replica_router``), and grammars compiled once on rank 0 and
shared (``shared_grammars``)."""

from scheduler.data_parallel.replica import DataParallelReplica

__all__ = ["DataParallelReplica"]
