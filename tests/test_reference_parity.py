"""Numerical parity of our drafter with the upstream MLX reference (spec section 11).

The reference (PyPI `dflash==0.1.0`) runs in a subprocess: while generating it
patches mlx-lm classes, and the product must never import it. Both sides load
the same random checkpoint, through the reference's own loader (a Hugging Face
repo id resolved from a local, offline hub cache), and draft the same blocks
from the same context features over several cycles.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import load_draft
from dflash_mlx.targets.adapter import TargetAdapter
from helpers import MASK_ID

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("dflash") is None,
    reason="the upstream reference is not installed (pip install --no-deps dflash==0.1.0)",
)

REPO_ID = "dflash-test/draft"
# (context rows, block size) per cycle: the first context is longer than the
# sliding window used below, later ones are what a cycle commits.
CYCLES = [(40, 8), (3, 8), (8, 8), (1, 4), (2, 8)]

# Upstream loads the draft by repo id (from a fake offline hub cache) and binds it to
# the target; argv: target dir, inputs .npz, output .npz.
REFERENCE_PREAMBLE = textwrap.dedent(
    """
    import sys, numpy as np, mlx.core as mx
    from mlx_lm import load
    from dflash.model_mlx import load_draft
    target_dir, inputs, out = sys.argv[1:4]
    model, _ = load(target_dir)
    draft = load_draft("{repo}")
    draft.bind(model)
    cache = draft.make_cache()
    data = np.load(inputs)
    """
)

REFERENCE_SCRIPT = (
    REFERENCE_PREAMBLE
    + textwrap.dedent(
        """
    results, history = {{}}, []
    for i in range(int(data["cycles"])):
        block = mx.array(data[f"block{{i}}"])[None]
        hidden = mx.array(data[f"hidden{{i}}"])[None]
        history.append(hidden)
        logits = draft(block, hidden, cache, logits_start=1)
        results[f"incremental{{i}}"] = np.array(logits[0].astype(mx.float32))
        # The same cycle from a fresh cache holding the whole history at once.
        logits = draft(block, mx.concatenate(history, axis=1), draft.make_cache(), logits_start=1)
        results[f"oneshot{{i}}"] = np.array(logits[0].astype(mx.float32))
    np.savez(out, **results)
    """
    )
).format(repo=REPO_ID)


def fake_hub_cache(root: Path, repo_id: str, model_dir: Path) -> Path:
    """Lay out `model_dir` as huggingface_hub's cache holds a downloaded repo."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    revision = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    shutil.copytree(model_dir, repo / "snapshots" / revision)
    return root


def make_inputs(path: Path, feature_width: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    cycles, arrays = [], {"cycles": len(CYCLES)}
    for i, (rows, block) in enumerate(CYCLES):
        hidden = rng.normal(0, 1, (rows, feature_width)).astype(np.float32)
        ids = np.array([int(rng.integers(10, 500))] + [MASK_ID] * (block - 1), dtype=np.int32)
        arrays[f"hidden{i}"], arrays[f"block{i}"] = hidden, ids
        cycles.append((ids, hidden))
    np.savez(path, **arrays)
    return cycles


def our_logits(target_dir: Path, draft_dir: Path, cycles) -> list[np.ndarray]:
    from mlx_lm import load

    model, _ = load(str(target_dir))
    draft = load_draft(draft_dir, model)
    target = TargetAdapter(model, draft.config.target_layer_ids)
    cache = draft.make_cache()
    out = []
    for ids, hidden in cycles:
        draft.extend_context(mx.array(hidden)[None], cache)
        logits = draft(mx.array(ids)[None], cache, target)
        out.append(np.array(logits[0].astype(mx.float32)))
    return out


def hub_env(hub: Path) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub), HF_HOME=str(hub.parent / "hf-home"))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    return env


DRAFT_VARIANTS = {
    "plain": {},
    "scaled-capped": dict(
        input_embedding_scale=0.5,
        output_multiplier=0.25,
        final_logit_softcapping=3.0,
        rope_in_parameters=True,
        schema="flat",
    ),
    "sliding-causal": dict(
        num_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=16,
    ),
    "all-sliding-bidirectional": dict(
        layer_types=["sliding_attention", "sliding_attention"],
        sliding_window=12,
        is_causal=False,
    ),
    "forced-causal": dict(is_causal=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(DRAFT_VARIANTS))
def test_draft_logits_match_reference(variant, tiny_target, tiny_draft, tmp_path):
    target_dir = tiny_target("qwen3")
    draft_dir = tiny_draft(target_dir, **DRAFT_VARIANTS[variant])
    config = json.loads((draft_dir / "config.json").read_text())
    width = len(config["dflash_config"]["target_layer_ids"]) * config["hidden_size"]
    cycles = make_inputs(tmp_path / "inputs.npz", width)
    hub = fake_hub_cache(tmp_path / "hub", REPO_ID, draft_dir)
    subprocess.run(
        [
            sys.executable,
            "-c",
            REFERENCE_SCRIPT,
            str(target_dir),
            str(tmp_path / "inputs.npz"),
            str(tmp_path / "ref.npz"),
        ],
        check=True,
        env=hub_env(hub),
        capture_output=True,
        text=True,
        timeout=300,
    )
    reference = np.load(tmp_path / "ref.npz")
    ours = our_logits(target_dir, draft_dir, cycles)
    sliding = "sliding_attention" in (config.get("layer_types") or [])
    for i, logits in enumerate(ours):
        kinds = ["oneshot"]
        # Upstream's sliding layers keep context in mlx-lm's RotatingKVCache; once it
        # is full, a one-row update (a cycle that accepted no draft) leaves it in ring
        # order while the mask assumes temporal order, hiding the newest context row.
        # We follow the spec (visible iff query_pos - key_pos < window), which is what
        # upstream computes from a fresh cache: compare with that from then on.
        if not sliding or all(rows > 1 for rows, _ in CYCLES[1 : i + 1]):
            kinds.append("incremental")
        for kind in kinds:
            expected = reference[f"{kind}{i}"]
            assert logits.shape == expected.shape
            diff = float(np.max(np.abs(logits - expected)))
            assert diff <= 1e-4, f"cycle {i} vs upstream {kind}: max abs diff {diff}"
            assert (logits.argmax(-1) == expected.argmax(-1)).all(), f"cycle {i}: proposals differ"


@pytest.mark.slow
def test_load_draft_from_hub_repo_id(tiny_target, tiny_draft, tmp_path):
    """Our loader resolves a repo id through huggingface_hub (offline cache here)."""
    target_dir = tiny_target("qwen3")
    draft_dir = tiny_draft(target_dir)
    hub = fake_hub_cache(tmp_path / "hub", REPO_ID, draft_dir)
    script = textwrap.dedent(
        f"""
        from mlx_lm import load
        from dflash_mlx import load_draft
        model, _ = load({str(target_dir)!r})
        draft = load_draft({REPO_ID!r}, model)
        print(draft.config.block_size, draft.config.mask_token_id)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=hub_env(hub), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    block_size = json.loads((draft_dir / "config.json").read_text())["dflash_config"]["block_size"]
    assert result.stdout.split() == [str(block_size), str(MASK_ID)]
