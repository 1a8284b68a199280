"""The package's shape, checked over its source with `ast` (nothing is imported).

- no import circle among dflash_mlx's modules, counting every import a module
  can run: at module level, inside functions (a late import is still a
  dependency), and the parent packages an import runs first (``from
  .policy.base import x`` runs ``policy/__init__``); only
  ``if __name__ == "__main__":`` blocks, which run as a script, do not count;
- no product module over 500 lines, counted as `ruff format` lays it out;
- no function over 80 lines in the decode loops (`engine`, `planner`, `batch/`):
  named steps, not closures over shared locals;
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
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _runnable(body):
    """Every node of `body` that can run when the module is imported or its functions called:
    all of it but ``if __name__ == "__main__":`` blocks."""
    for node in body:
        if isinstance(node, ast.If) and "__name__" in (test := ast.unparse(node.test)) and "__main__" in test:
            yield from _runnable(node.orelse)
            continue
        yield from ast.walk(node)


def _with_parents(module: str) -> list[str]:
    """`module` and the packages importing it runs first (`a.b.c`: `a.b`, `a`)."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def imports(name: str) -> set[str]:
    """dflash_mlx modules that importing `name`, or calling its functions, imports."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in _runnable(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            found.update(m for a in node.names for m in _with_parents(a.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.update(_with_parents(source))
            found.update(f"{source}.{a.name}" for a in node.names)  # `from . import submodule`
    # a module's own packages are running already when it runs (they are not imports of it)
    return {m for m in found if m in MODULES and m != name and not name.startswith(m + ".")}


GRAPH = {name: imports(name) for name in MODULES}


def test_there_is_no_import_circle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                circle = path[path.index(nxt) :] + [nxt]
                pytest.fail("import circle: " + " -> ".join(circle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)


def test_the_checker_sees_imports():
    """The graph is not empty by accident: known edges are in it, late and parent-package ones too."""
    assert "dflash_mlx.engine" in GRAPH["dflash_mlx.generation"]
    assert "dflash_mlx.targets.rollback" in GRAPH["dflash_mlx.engine"]
    assert "dflash_mlx.cli.openblas" in GRAPH["dflash_mlx.cli"]
    assert "dflash_mlx.mlx_lm.cli" in GRAPH["dflash_mlx.__main__"]  # imported inside main()
    assert "dflash_mlx.policy" in GRAPH["dflash_mlx.engine"]  # `from .policy.base import ...` runs it


def formatted_lines(path: Path) -> int:
    """The module's length as `ruff format` lays it out (hand-packed lines count as unpacked)."""
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--stdin-filename", str(path), "-"],
        input=path.read_text(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    return len(run.stdout.splitlines())


def test_no_product_module_is_over_500_formatted_lines():
    long = {str(path): n for path in MODULES.values() if (n := formatted_lines(path)) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} formatted lines (split the concern): {long}"


def test_module_length_counts_formatted_lines(tmp_path):
    packed = tmp_path / "packed.py"
    packed.write_text("def f(a, b): return a; b\n")
    assert formatted_lines(packed) > 2


MAX_FUNCTION_LINES = 80
LOOPS = ["dflash_mlx.engine", "dflash_mlx.planner"] + [n for n in MODULES if n.startswith("dflash_mlx.batch.")]


def long_functions(path: Path) -> dict[str, int]:
    """Functions (methods and nested ones included) of a module over MAX_FUNCTION_LINES lines."""
    tree = ast.parse(path.read_text())
    return {
        node.name: n
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES
    }


def test_no_function_in_the_decode_loops_is_over_80_lines():
    assert "dflash_mlx.batch.engine" in LOOPS
    long = {name: found for name in LOOPS if (found := long_functions(MODULES[name]))}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {long}"


def test_the_function_length_check_counts_nested_functions(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    source = tmp_path / "nested.py"
    source.write_text(f"def outer():\n    def inner():\n{body}\n    return inner\n")
    assert set(long_functions(source)) == {"outer", "inner"}


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


@pytest.mark.slow
def test_importing_the_package_and_the_cli_entry_point_is_cheap():
    """The console script re-executes itself before it imports MLX: the package root and
    `dflash_mlx.cli` import neither MLX nor mlx-lm nor the commands."""
    run = _run(
        [
            "-c",
            "import sys, dflash_mlx, dflash_mlx.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'typer')))",
        ]
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


@pytest.mark.slow
def test_python_m_dflash_mlx_generate_runs_without_a_double_import():
    run = _run(["-W", "error::RuntimeWarning", "-m", "dflash_mlx.generate", "--help"])
    assert run.returncode == 0, run.stderr
    assert "--draft-model" in run.stdout and "found in sys.modules" not in run.stderr


@pytest.mark.slow
def test_importing_the_generate_entry_point_keeps_the_package_function():
    """`dflash_mlx.generate` is the library's function even after ``import dflash_mlx.generate``
    (the module behind ``python -m dflash_mlx.generate``)."""
    run = _run(
        [
            "-c",
            "import dflash_mlx, dflash_mlx.generate, dflash_mlx.generation as g; "
            "from dflash_mlx import generate; "
            "print(dflash_mlx.generate is g.generate is generate)",
        ]
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "True"
