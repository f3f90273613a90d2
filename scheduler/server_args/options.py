"""How a settings field declares its command-line flag: ``option(default, help, ...)`` is a dataclass field whose
metadata holds a ``Flag``, from which ``cli`` writes the argparse argument."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import Field, dataclass, field
from typing import Any

from scheduler.server_args.environment import CACHE_DIR

FLAG = "flag"
"""The metadata key of a field's ``Flag``."""


@dataclass(frozen=True)
class Flag:
    """A field's command-line flag. By default ``--field-name``, its type the field's (``int``, ``float``, ``str``;
    a ``bool`` field is ``store_true``), its default the field's, no choices, no help."""

    help: str | Callable[[], str] | None = None
    """Shown by ``--help``; a function when the text names what is registered at start-up."""
    name: str | None = None
    choices: Sequence[str] | None = None
    action: str | type[argparse.Action] | None = None
    type: Callable[[str], Any] | None = None
    nargs: str | None = None
    is_resolved_at_launch: bool = False
    """Left out on the command line, the flag is None and the launch chooses the value (``--zmq-port``)."""

    def flag_name(self, field_name: str) -> str:
        return self.name or f"--{field_name.replace('_', '-')}"

    def help_text(self) -> str | None:
        return self.help() if callable(self.help) else self.help


def option(default: Any, help: str | Callable[[], str] | None = None, **flag: Any) -> Any:
    """A settings field with default ``default`` and the command-line flag ``Flag(help, **flag)``."""
    return field(default=default, metadata={FLAG: Flag(help, **flag)})


def cache_dir_option() -> Any:
    """``--cache-dir``: one setting, held by each part with files to cache (``ServerArgs`` checks they agree)."""
    return option(None, f"default: ${CACHE_DIR.name} or {CACHE_DIR.default}")


def flag_of(settings_field: Field[Any]) -> Flag:
    flag: Flag = settings_field.metadata[FLAG]
    return flag


def comma_separated(text: str) -> tuple[str, ...]:
    """``a, b,c`` -> ``("a", "b", "c")``."""
    return tuple(part.strip() for part in text.split(",") if part.strip())
