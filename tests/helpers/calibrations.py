"""A cost curve written into the calibration cache, for tests whose point needs blocks to pay.

`cheap_blocks_cache` is the curve in a private cache for the length of a block (a module's fixture).

On this CPU the bundled pair in bfloat16 (as mlx-lm's loader leaves it) costs
T(8) ~ 5 T(1): no block beats plain decoding, so the adaptive block rightly
never drafts. Tests that show the plugin drafting write the curve of a machine
where verifying a block costs little more than one token (a Mac's shape) with
the calibration's own key and `"learns": false`, so the curve is what the
policy reads and the loop's own timing does not correct it. The tiny test
pairs' drafting likewise depends on how this machine's calibration turns out
under load; tests whose point is that drafts are accepted use this curve.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import pytest

from dflash_mlx.models.block_size import default_block_size
from dflash_mlx.policy import calibration
from dflash_mlx.policy.calibration import calibration_key, file_for, grid_for
from dflash_mlx.session import make_session
from dflash_mlx.utils.io import write_json_atomic


def write_cheap_blocks_curve(model, draft, per_token: float = 0.02) -> str:
    """Cache T(b) = T(1) * (1 + per_token * (b - 1)) for (`model`, `draft`) in the current
    $DFLASH_MLX_CACHE_DIR; return the file's path."""
    session = make_session(model, draft)
    max_block = default_block_size(model, draft)
    grid = grid_for(max_block)
    key = calibration_key(session.target, session.proposer, max_block)
    path = file_for(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    seconds = [0.005 * (1 + per_token * (b - 1)) for b in grid]
    doc = {"key": key, "rows": [1], "blocks": grid, "seconds": [seconds], "learns": False, "source": "measured"}
    write_json_atomic(path, json.loads(json.dumps(doc, default=str)))  # (as the calibration writes its own)
    forget_curve(path)
    return str(path)


def forget_curve(path) -> None:
    """Drop this process's in-memory copy of the curve cached at `path` (its name is the key's digest),
    so the next lookup reads the file: before a test that wrote one, and after it."""
    calibration.forget(Path(path).stem)


@contextmanager
def cheap_blocks_cache(cache_dir, model, draft):
    """A calibration cache in `cache_dir` ($DFLASH_MLX_CACHE_DIR while the block runs, for this process and
    the subprocesses it starts) holding the cheap-blocks curve for (`model`, `draft`): what the adaptive
    block chooses then depends on acceptance alone, not on this machine's load. Yields the curve's file."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DFLASH_MLX_CACHE_DIR", str(cache_dir))
        path = write_cheap_blocks_curve(model, draft)
        try:
            yield path
        finally:
            forget_curve(path)
