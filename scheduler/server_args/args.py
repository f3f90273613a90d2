"""``ServerArgs``: the server's settings as five frozen parts, each consumer taking the part it reads."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

from scheduler.server_args.grammar import GrammarArgs
from scheduler.server_args.model import ModelArgs
from scheduler.server_args.parallel import ParallelArgs
from scheduler.server_args.serving import ServingArgs
from scheduler.server_args.speculation import SpeculationArgs


@dataclass(frozen=True)
class ServerArgs:
    """Every server setting and its default, in parts: ``model`` (the model loader and runners take it), ``grammar``
    (the grammar library takes it), ``speculation``, ``serving`` and ``parallel``.

    ``ServerArgs.of(max_seq_len=256, grammar_backend="xgrammar")`` builds it from flat settings, each routed to the
    part that declares it; ``scheduler.server_args.cli`` builds it from the command line."""

    model: ModelArgs = field(default_factory=ModelArgs)
    grammar: GrammarArgs = field(default_factory=GrammarArgs)
    speculation: SpeculationArgs = field(default_factory=SpeculationArgs)
    serving: ServingArgs = field(default_factory=ServingArgs)
    parallel: ParallelArgs = field(default_factory=ParallelArgs)

    def __post_init__(self) -> None:
        """The checks that read two parts."""
        if self.model.model_runner == "llamacpp" and self.parallel.tp_size > 1:
            raise ValueError("--model-runner llamacpp runs the whole model on each rank: use --tp-size 1")
        if self.parallel.router is not None and self.serving.port is None:
            raise ValueError("--router sglang serves on --port: give it")
        if self.model.cache_dir != self.grammar.cache_dir:
            raise ValueError(
                f"--cache-dir is one setting: the model part has {self.model.cache_dir!r}, the grammar part "
                f"{self.grammar.cache_dir!r} (build both with ServerArgs.of)"
            )

    @classmethod
    def of(cls, **settings: Any) -> ServerArgs:
        """The settings ``settings`` (flat, as the flags' names with ``_``) and the defaults for the rest. A setting
        held by several parts (``cache_dir``) goes to each; TypeError for a name no part holds."""
        by_part: dict[str, dict[str, Any]] = {name: {} for name in PARTS}
        for name, value in settings.items():
            owners = [part for part, part_type in PARTS.items() if name in _field_names(part_type)]
            if not owners:
                raise TypeError(f"ServerArgs.of() got an unexpected setting {name!r}")
            for owner in owners:
                by_part[owner][name] = value
        return cls(**{part: part_type(**by_part[part]) for part, part_type in PARTS.items()})

    def settings(self) -> dict[str, Any]:
        """Every setting by its flat name, part by part (what ``/get_server_info`` reports)."""
        parts = [getattr(self, name) for name in PARTS]
        return {f.name: getattr(part, f.name) for part in parts for f in fields(part)}


def _field_names(part_type: type) -> set[str]:
    return {f.name for f in fields(part_type)}


PARTS: dict[str, type] = {f.name: get_type_hints(ServerArgs)[f.name] for f in fields(ServerArgs)}
"""The parts by name, in their order: ``{"model": ModelArgs, ...}``."""
