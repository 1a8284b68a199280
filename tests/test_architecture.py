"""The package's shape, checked over its source with `ast` (nothing is imported).

- no import circle among dflash_mlx's modules (module-level imports; imports
  inside functions and ``if __name__ == "__main__":`` blocks are deliberate
  late bindings and do not count);
- no product module over 400 lines;
- every module in the package root is used by more than one sub-package (or
  by the root itself): machinery only one sub-package needs lives in it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dflash_mlx"
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _top_level(body):
    """Statements run at import: the module body, into top-level if/try blocks (not `__main__` ones)."""
    for node in body:
        if isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if "__name__" in test and "__main__" in test:
                continue
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                yield from _top_level(block)
        else:
            yield node


def imports(name: str) -> set[str]:
    """dflash_mlx modules `name` imports at module level."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in _top_level(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.add(source)
            found.update(f"{source}.{a.name}" for a in node.names)  # `from . import submodule`
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports(name) for name in MODULES}


def test_there_is_no_import_circle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                circle = path[path.index(nxt):] + [nxt]
                pytest.fail("import circle: " + " -> ".join(circle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)


def test_the_checker_sees_imports():
    """The graph is not empty by accident: known edges are in it."""
    assert "dflash_mlx.engine" in GRAPH["dflash_mlx.generation"]
    assert "dflash_mlx.targets.rollback" in GRAPH["dflash_mlx.engine"]
    assert "dflash_mlx.cli.openblas" in GRAPH["dflash_mlx.cli"]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_product_module_is_over_400_lines(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name]} has {lines} lines (at most {MAX_LINES})"


def _home(name: str) -> str:
    """The sub-package a module belongs to, or "<root>" for the package root's own modules."""
    parts = name.split(".")
    is_package = MODULES[name].name == "__init__.py"
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and is_package) else "<root>"


def test_root_modules_serve_more_than_one_sub_package():
    root = [n for n in MODULES if _home(n) == "<root>" and n.rsplit(".", 1)[-1] not in ("dflash_mlx", "__main__")]
    users: dict[str, set[str]] = defaultdict(set)
    for importer, targets in GRAPH.items():
        for target in targets:
            users[target].add(_home(importer))
    lonely = {n: sorted(users[n]) for n in root if len(users[n]) < 2 and users[n] != {"<root>"}}
    # an entry point nobody imports (python -m dflash_mlx.generate) is not machinery
    lonely.pop("dflash_mlx.generate", None)
    assert not lonely, f"root modules used by one sub-package only (move them into it): {lonely}"


def _run(code_or_args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, DFLASH_MLX_NO_REEXEC="1")
    return subprocess.run([sys.executable, *code_or_args], capture_output=True, text=True, timeout=300, env=env)


def test_importing_the_package_and_the_cli_entry_point_is_cheap():
    """The console script re-executes itself before it imports MLX: the package root and
    `dflash_mlx.cli` import neither MLX nor mlx-lm nor the commands."""
    run = _run(["-c", "import sys, dflash_mlx, dflash_mlx.cli; "
                      "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'typer')))"])
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_python_m_dflash_mlx_generate_runs_without_a_double_import():
    run = _run(["-W", "error::RuntimeWarning", "-m", "dflash_mlx.generate", "--help"])
    assert run.returncode == 0, run.stderr
    assert "--draft-model" in run.stdout and "found in sys.modules" not in run.stderr
