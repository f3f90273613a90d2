"""The command line, written from the settings' fields: one argument group per part of ``ServerArgs``, one flag per
field that declares a ``Flag`` (``options.option``)."""

from __future__ import annotations

import argparse
import importlib
import types
import typing
from collections.abc import Sequence
from dataclasses import Field, fields
from typing import Any

from scheduler.server_args.args import PARTS, ServerArgs
from scheduler.server_args.environment import zmq_port_for
from scheduler.server_args.options import FLAG, flag_of

DESCRIPTION = "Server settings: one frozen dataclass holds every default; argparse and the environment table feed it."


def parse_server_args(argv: Sequence[str] | None = None) -> ServerArgs:
    """``python -m scheduler.launch``'s command line (``sys.argv`` when ``argv`` is None) as ``ServerArgs``."""
    parser = argparse.ArgumentParser(prog="python -m scheduler.launch", description=DESCRIPTION)
    add_server_args(parser)
    return server_args_from(parser.parse_args(argv))


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Add every flag of ``ServerArgs`` to ``parser``, a group per part; a setting two parts hold is one flag."""
    seen: set[str] = set()
    for title, part in PARTS.items():
        group = parser.add_argument_group(title)
        hints = typing.get_type_hints(part)
        for settings_field in fields(part):
            if FLAG in settings_field.metadata and settings_field.name not in seen:
                seen.add(settings_field.name)
                flag = flag_of(settings_field)
                group.add_argument(
                    flag.flag_name(settings_field.name), **_argparse_options(settings_field, hints[settings_field.name])
                )


def server_args_from(namespace: argparse.Namespace) -> ServerArgs:
    """Import every ``--import-module`` first, so that the backends they register are valid choices; a left-out
    ``--zmq-port`` is chosen here (``environment.zmq_port_for``)."""
    for module in namespace.import_modules:
        importlib.import_module(module)
    settings = {
        f.name: _as_field_value(getattr(namespace, f.name))
        for part in PARTS.values()
        for f in fields(part)
        if hasattr(namespace, f.name)
    }
    if settings["zmq_port"] is None:
        settings["zmq_port"] = zmq_port_for(namespace.host, namespace.port is not None)
    return ServerArgs.of(**settings)


def _argparse_options(settings_field: Field[Any], hint: Any) -> dict[str, Any]:
    """``add_argument``'s keywords for a field: a ``bool`` is ``store_true`` unless its flag names an action; a
    tuple is a list on the command line; ``int`` and ``float`` (or None) convert the text."""
    flag = flag_of(settings_field)
    options: dict[str, Any] = {"dest": settings_field.name, "help": flag.help_text()}
    if hint is bool and flag.action is None:
        return options | {"action": "store_true"}
    default: Any = None if flag.is_resolved_at_launch else settings_field.default
    options["default"] = list(default) if flag.action == "append" or flag.nargs else default
    scalar = flag.type or _scalar_type(hint)
    extra = {"action": flag.action, "choices": flag.choices, "type": scalar, "nargs": flag.nargs}
    return options | {key: value for key, value in extra.items() if value is not None}


def _scalar_type(hint: Any) -> type | None:
    """``int`` for ``int`` or ``int | None``, likewise ``float``; None (text as given) otherwise."""
    members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return next((member for member in members if member in (int, float)), None)


def _as_field_value(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value
