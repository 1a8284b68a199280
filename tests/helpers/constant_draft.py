"""A tiny DFlash drafter checkpoint that always proposes one chosen token.

Random tiny drafters are (rightly) almost never accepted, so tests that must
see drafted tokens (``from_draft``) through the public, path-based API need a
drafter whose proposals the target sometimes takes. This one is a real v1
checkpoint (``make_draft``) edited so that every layer is the
identity (``o_proj`` and ``down_proj`` zero) and its final norm's weight maps
the mask token's normalized embedding onto the target's output row of
``token``: every drafted position proposes ``token``. Against a target whose
greedy continuation repeats ``token``, whole runs of drafts are accepted.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np

from .builders import make_draft
from .tokenizer import MASK_ID


def make_constant_draft(out_dir: Path, target_dir: Path, token: int) -> Path:
    """Write the drafter to `out_dir` (qwen3-style float32 untied targets only)."""
    from mlx_lm import load

    make_draft(out_dir, target_dir, target_layer_ids=[1, 2])
    model, _ = load(str(target_dir))
    eps = json.loads((Path(target_dir) / "config.json").read_text()).get("rms_norm_eps", 1e-6)
    x = np.array(model.model.embed_tokens.weight[MASK_ID], dtype=np.float64)
    normed = x / np.sqrt(np.mean(x * x) + eps)
    row = np.array(model.lm_head.weight[token], dtype=np.float64)
    path = Path(out_dir) / "model.safetensors"
    weights = dict(mx.load(str(path)))
    for name in list(weights):
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    weights["norm.weight"] = mx.array((row / normed).astype(np.float32))
    mx.save_safetensors(str(path), weights, metadata={"format": "pt"})
    return Path(out_dir)


def repeated_token(target_dir: Path, prompt: str, max_tokens: int = 60) -> int:
    """The token the target's greedy continuation of `prompt` repeats most (plain mlx-lm)."""
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(target_dir))
    tokens = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)]
    return Counter(tokens).most_common(1)[0][0]
