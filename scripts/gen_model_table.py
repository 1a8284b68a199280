#!/usr/bin/env python3
"""Regenerate README.md's supported-models table from models.toml.

Rewrites the text between ``<!-- models:start -->`` and ``<!-- models:end -->``
(atomic write: temp file + os.replace). ``--check`` writes nothing and exits 1
when README.md is out of date. Loads dflash_mlx/models/registry.py by file path, so
neither MLX nor the package needs to be importable.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START = "<!-- models:start -->"
END = "<!-- models:end -->"


def _registry_module():
    path = ROOT / "dflash_mlx" / "models" / "registry.py"
    spec = importlib.util.spec_from_file_location("_dflash_mlx_registry", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_table(models_toml: Path) -> str:
    """The Markdown table (no markers) for the entries of ``models_toml``."""
    entries = _registry_module().load_registry(models_toml)
    lines = [
        "| name | target | also matches (MLX conversions, unverified) | drafter | family | block | kind "
        "| publisher | reasoning | notes |",
        "|---|---|---|---|---|---:|---|---|---|---|",
    ]
    for e in entries:
        also = "<br>".join(f"`{m}`" for m in e.mlx_targets)
        where = " (bundled)" if e.bundled else ""
        reasoning = ""
        if e.reasoning:
            levels = "on/off" if e.reasoning == "enable_thinking" else "/".join(e.reasoning_values)
            default = f", default {e.reasoning_default}" if e.reasoning_default else ""
            reasoning = f"`{e.reasoning}` {levels}{default}"
        notes = "; ".join(n for n in (e.notes, e.memory_note and f"**{e.memory_note}**") if n)
        lines.append(
            f"| `{e.name}` | `{e.target}`{where} | {also} | `{e.draft}`{where} | {e.family or ''} | {e.block_size} "
            f"| {e.kind} | {e.publisher or ''} | {reasoning} | {_cell(notes)} |"
        )
    return "\n".join(lines)


def updated_readme(readme: str, table: str) -> str:
    """``readme`` with the text between the markers replaced by ``table``."""
    start, end = readme.find(START), readme.find(END)
    if start < 0 or end < 0 or end < start:
        raise SystemExit(f"README.md: markers {START} ... {END} not found")
    head = readme[: start + len(START)]
    return f"{head}\n{table}\n{readme[end:]}"


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
        os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md is out of date")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--models", type=Path, default=ROOT / "models.toml")
    args = parser.parse_args(argv)

    try:
        table = render_table(args.models)
    except ValueError as exc:  # RegistryError: names the file, entry and field
        print(f"error: {exc}", file=sys.stderr)
        return 2
    current = args.readme.read_text(encoding="utf-8")
    wanted = updated_readme(current, table)
    if current == wanted:
        print(f"{args.readme.name}: models table is up to date")
        return 0
    if args.check:
        print(
            f"{args.readme.name}: models table is out of date; run `python scripts/gen_model_table.py`",
            file=sys.stderr,
        )
        return 1
    _write_atomic(args.readme, wanted)
    print(f"{args.readme.name}: models table regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
