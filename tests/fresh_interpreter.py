"""A program run in a fresh interpreter of its own, for tests of what a process owns once (its main module, its
fork server). Light on purpose: a test module of compile processes imports it, and each compile child imports that
test module again to find its compile function."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_python_in(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python *args`` in ``folder``, importing from it and from the repository; it must exit with 0."""
    done = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=folder,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(REPO_ROOT)])},
    )
    assert done.returncode == 0, done.stderr
    return done
