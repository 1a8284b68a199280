"""Atomic file writes: a temporary file beside the target, renamed over it.

A reader never sees a half-written file, and a failed write leaves nothing
behind (the temporary file is removed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx


def replace_atomically(path: Path, write: Callable[[Path], None], suffix: str = ".tmp") -> None:
    """Call `write(tmp)` for a temporary path beside `path`, then rename it over `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}{suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write `obj` as indented JSON, atomically."""
    replace_atomically(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8"))


def write_text_atomic(path: Path, text: str) -> None:
    replace_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def save_safetensors_atomic(path: Path, arrays: dict[str, mx.array], metadata: dict | None = None) -> None:
    """`mx.save_safetensors`, atomically (the temporary name keeps the .safetensors suffix MLX needs)."""
    replace_atomically(
        path, lambda tmp: mx.save_safetensors(str(tmp), arrays, metadata=metadata or {}), suffix=".tmp.safetensors"
    )
