"""Every third-party import is declared, in the group where it is used; nothing works through another's dependency.

deptry runs twice, because the project has two kinds of code with different promises:

1. the packages a user installs (``sglang_constrained``, ``scheduler``, ``triton_ops``, ``cpu_kernels``, without
   their ``testing`` subpackages) may import runtime dependencies only (and the extras in ``OPTIONAL_RUNTIME``): a
   test-only import there is an error (DEP004), and so is a runtime dependency nothing imports (DEP002);
2. the tests, the scripts and the ``testing`` subpackages may import anything the project declares, in any group;
   a test or lint dependency nothing imports and no check runs is an error.

Either pass fails on an import that is not declared (DEP001) or arrives only through another package (DEP003).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("sglang_constrained", "scheduler", "triton_ops", "cpu_kernels")
TESTING = ("sglang_constrained/testing", "scheduler/testing")
TOOLING = ("tests", "scripts", *TESTING)
NOT_IMPORTED = {
    "accelerate": "transformers needs it to read GGUF files",
    "torch-npu": "the NPU path uses plain torch once torch-npu is loaded by the user",
    "tiktoken": "transformers converts Qwen3.5's tiktoken vocabulary with it",
    "ruff": "a check in .ci/run",
    "mypy": "a check in .ci/run",
    "import-linter": "a check in .ci/run",
    "deptry": "this check",
    "sglang-router": "run as a process (python -m sglang_router.launch_router), never imported",
}


OPTIONAL_RUNTIME = {"llamacpp": "the llama.cpp model runner (--model-runner llamacpp) imports it when chosen"}
"""Extras the installed packages may import: features a user opts into, not tooling."""


def main() -> int:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = [_name(requirement) for requirement in project["dependencies"]]
    groups = ",".join(group for group in project["optional-dependencies"] if group not in OPTIONAL_RUNTIME)
    not_imported = "|".join(NOT_IMPORTED)
    library = _deptry(
        *LIBRARY,
        "--extend-exclude",
        "|".join(TESTING),
        "--optional-dependencies-dev-groups",
        groups,
        "--per-rule-ignores",
        f"DEP002={not_imported}",
    )
    unused_by_tooling = "|".join([*runtime, *NOT_IMPORTED])
    tooling = _deptry(
        *[path for path in TOOLING if (ROOT / path).is_dir()],
        "--exclude",
        r"tests/data",
        "--per-rule-ignores",
        f"DEP002={unused_by_tooling}",
    )
    return library or tooling


def _deptry(*args: str) -> int:
    command = [sys.executable, "-m", "deptry", *args]
    print("$", " ".join(command), flush=True)
    return subprocess.run(command, cwd=ROOT, check=False).returncode


def _name(requirement: str) -> str:
    """The distribution name of a PEP 508 requirement string."""
    for separator in "<>=!~;[ ":
        requirement = requirement.split(separator, 1)[0]
    return requirement


if __name__ == "__main__":
    sys.exit(main())
