"""The tree is formatted by `ruff format` and lints clean, as pyproject.toml configures them.

`ruff` is pinned in the test extra (a formatter's output changes between
releases), so this runs the same formatter everywhere; `.pre-commit-config.yaml`
runs it before each commit. Hand-packing lines to keep a module short is not
needed: `test_architecture` counts formatted lines.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ("dflash_mlx", "tests", "scripts")
MAX_FMT_SKIPS = 10  # markers left where a table reads better than the formatter's layout
MARKERS = ("fmt" + ": skip", "fmt" + ": off")  # (spelled apart: this file is not one of them)


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_tree_is_formatted():
    run = ruff("format", "--check", *TREES)
    assert run.returncode == 0, f"run `ruff format {' '.join(TREES)}`:\n{run.stdout}{run.stderr}"


def test_the_tree_lints_clean():
    run = ruff("check", *TREES)
    assert run.returncode == 0, run.stdout + run.stderr


def test_few_lines_escape_the_formatter():
    marked = [
        f"{path.relative_to(ROOT)}:{n}"
        for tree in TREES
        for path in sorted((ROOT / tree).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if any(marker in line for marker in MARKERS)
    ]
    assert len(marked) <= MAX_FMT_SKIPS, f"{len(marked)} lines escape the formatter: {marked}"
