"""Training checkpoints and the final drafter directory, all written atomically.

A checkpoint is a directory `step-XXXXXXXX/` holding the drafter's weights
(`drafter.safetensors`), the optimizer state (`optimizer.safetensors`: AdamW
moments, its step counter and learning rate) and `state.json` (step, data
position, options, the drafter's config.json). It is written under a temporary
name and renamed into place, so a crash never leaves a half checkpoint that
`latest_checkpoint` would pick. The final output is a drafter in the real
checkpoint format (config.json with `dflash_config` + model.safetensors; spec
section 2) that `dflash_mlx.load_draft` reads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from ..utils.io import save_safetensors_atomic, write_json_atomic

STEP_DIR = re.compile(r"^step-(\d{8})$")
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


class CheckpointError(ValueError):
    """A checkpoint cannot be read or does not match this run."""


def _save_safetensors_atomic(path: Path, arrays: dict[str, mx.array], metadata=None) -> None:
    save_safetensors_atomic(path, arrays, metadata)


def checkpoint_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / "state.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def save_checkpoint(root: Path, step: int, drafter: nn.Module, optimizer, state: dict[str, Any], keep: int = 2) -> Path:
    """Write checkpoint `step` atomically; keep only the `keep` most recent ones."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(root, step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    mx.save_safetensors(str(tmp / "drafter.safetensors"), dict(tree_flatten(drafter.parameters())))
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    (tmp / "state.json").write_text(json.dumps(dict(state, step=step), indent=2) + "\n")
    if final.exists():  # the same step saved again (e.g. a stop followed by the end)
        old = root / f".old-{final.name}-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    older = list_checkpoints(root)[:-keep] if keep > 0 else []
    for _, path in older:
        shutil.rmtree(path, ignore_errors=True)
    return final


def read_checkpoint_state(path: Path) -> dict[str, Any]:
    """The state.json of checkpoint `path` (step, options, data position...)."""
    try:
        return json.loads((Path(path) / "state.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read the checkpoint's state.json ({e}).") from e


def load_checkpoint(path: Path, drafter: nn.Module, optimizer) -> dict[str, Any]:
    """Restore weights and optimizer state from checkpoint `path`; return its state.json."""
    path = Path(path)
    state = read_checkpoint_state(path)
    try:
        weights = mx.load(str(path / "drafter.safetensors"))
        opt_state = mx.load(str(path / "optimizer.safetensors"))
    except (OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: cannot read the checkpoint ({e}).") from e
    try:
        drafter.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise CheckpointError(f"{path}: the drafter weights do not match this drafter ({e}).") from e
    optimizer.state = tree_unflatten(list(opt_state.items()))
    return state


def export_drafter(out_dir: Path, drafter: nn.Module, config: dict[str, Any], dtype: str = "float32") -> None:
    """Write config.json + model.safetensors (weights cast to `dtype`) into `out_dir`."""
    if dtype not in DTYPES:
        raise ValueError(f"--save-dtype must be one of {sorted(DTYPES)}, got {dtype!r}.")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(DTYPES[dtype]) for k, v in tree_flatten(drafter.parameters())}
    _save_safetensors_atomic(out_dir / "model.safetensors", weights, {"format": "mlx"})
    write_json_atomic(out_dir / "config.json", dict(config, torch_dtype=dtype))
