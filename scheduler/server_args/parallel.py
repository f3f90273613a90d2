"""The parallel part of the settings: how many ranks or replicas serve, and the router in front of replicas."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.server_args.options import option

ROUTERS = ("sglang",)
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
"""SGLang's router's policies (``sglang_router.launch_router --policy``) for ``--router sglang``."""


@dataclass(frozen=True)
class ParallelArgs:
    """Tensor parallel ranks, data-parallel replicas (ranks under torchrun, or servers behind ``--router``)."""

    tp_size: int = option(
        1,
        "tensor parallel: split the model over this many ranks (torchrun --nproc-per-node N), each holding its share "
        "of the attention heads, MLP columns and vocabulary; 1 runs the whole model on every rank",
    )
    dp_size: int = option(
        1,
        "data-parallel replicas, one per rank under torchrun (the world size must equal it): each a whole model "
        "running its own batches; rank 0 routes each request to the least-loaded replica and compiles each grammar "
        "once for all. 1: every rank runs the same batch in lockstep. With --router: that many independent server "
        "processes behind the router",
    )
    router: str | None = option(
        None,
        "start --dp-size independent servers (each its own process: one that dies does not stop the others, and is "
        "restarted) and SGLang's router in front of them on --port (the router extra: "
        'pip install -e ".[router]")',
        choices=ROUTERS,
    )
    router_policy: str = option("cache_aware", choices=ROUTER_POLICIES)
    router_health_check_interval: int = option(
        5, "seconds between the router's health checks of each server (SGLang's router defaults to 60)"
    )
    worker_urls: tuple[str, ...] = option(
        (),
        "with --router: servers started elsewhere (other machines) that the router sends requests to as well",
        nargs="+",
    )

    def __post_init__(self) -> None:
        for name in ("tp_size", "dp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.router is not None and self.router not in ROUTERS:
            raise ValueError(f"--router must be one of {ROUTERS}")
        if self.router is None and self.worker_urls:
            raise ValueError("--worker-urls are servers for the router to join: give --router sglang")
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"--router-policy must be one of {ROUTER_POLICIES}")
        if self.router_health_check_interval <= 0:
            raise ValueError("--router-health-check-interval must be positive (seconds)")

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError unless the ranks launched fit the parallel layout: ``--tp-size N`` needs N ranks, each
        holding a shard of the model; ``--dp-size N`` needs N ranks, each a whole-model replica; the two do not combine
        yet. With both 1, any number of ranks each run the whole model in lockstep. With ``--router`` the launcher
        is one process starting ``--dp-size`` servers of its own (``scheduler.replicas``)."""
        if self.router is not None:
            if world_size != 1:
                raise ValueError(
                    f"--router {self.router} starts --dp-size independent servers itself: run it as one process, not "
                    f"under torchrun ({world_size} ranks were launched)"
                )
            if self.tp_size > 1:
                raise ValueError("--router with --tp-size: each replica would be a rank group; not supported yet")
            return
        if self.tp_size > 1 and self.dp_size > 1:
            raise ValueError(
                f"--tp-size {self.tp_size} with --dp-size {self.dp_size}: tensor and data parallelism do not combine "
                "yet; choose one"
            )
        if self.tp_size > 1 and self.tp_size != world_size:
            raise ValueError(
                f"--tp-size {self.tp_size} needs {self.tp_size} ranks, but {world_size} were launched: run "
                f"torchrun --nproc-per-node {self.tp_size} -m scheduler.launch --tp-size {self.tp_size} ..."
            )
        if self.dp_size > 1 and self.dp_size != world_size:
            raise ValueError(
                f"--dp-size {self.dp_size} needs exactly {self.dp_size} ranks (torchrun --nproc-per-node "
                f"{self.dp_size}), not {world_size}: each rank is one whole-model replica"
            )
