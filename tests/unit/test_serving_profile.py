"""``bench_serving.py --profile`` reports a loop turn by parts, each found in the profile by its file and function
name: a part whose function was renamed or moved would print 0 s without a word. Each part must name one function
that exists, in the module named, and the only one of that name in its file."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from scripts.bench_serving import STEP_PARTS


@pytest.mark.parametrize(("label", "module_name", "qualname"), STEP_PARTS, ids=[part[0] for part in STEP_PARTS])
def test_each_profiled_part_names_one_real_function(label: str, module_name: str, qualname: str) -> None:
    target: object = importlib.import_module(module_name)
    for name in qualname.split("."):
        assert hasattr(target, name), f"{label}: {module_name} has no {qualname}"
        target = getattr(target, name)
    assert inspect.isfunction(target), f"{label}: {module_name}.{qualname} is not a function"
    source = Path(inspect.getfile(target))
    assert source.as_posix().endswith(module_name.replace(".", "/") + ".py"), f"{label}: defined in {source}"
    name = qualname.rsplit(".", 1)[-1]
    definitions = [
        node
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name
    ]
    assert len(definitions) == 1, f"{label}: {len(definitions)} functions named {name} in {source}"
