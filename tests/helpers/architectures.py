"""Tiny random targets of any mlx-lm architecture, built from a config dict, and a drafter of the right shape.

``ARCHITECTURES`` (architectures.json) holds one small config per mlx-lm model type: those of mlx-lm
0.32's ``test_all_models`` table (tests/test_models.py) with the vocabulary set to the tiny tokenizer's and
the few large ones shrunk, plus the families with published drafters the table lacks (kimi_k25,
muse_glimmer, glm_moe_dsa); deepseek_v32 and glm_moe_dsa index 8 keys, so their sparse path runs past 8
tokens. ``build_target(model_type)`` is mlx-lm's own model class for it with random weights (by each
parameter's role, heads scaled for clear greedy margins as ``builders.make_target`` does), computed in
float32; ``arch_pair(model_type, root)`` adds the tiny tokenizer and a random DFlash drafter reading two
of its layers.
"""

from __future__ import annotations

import functools
import re
import importlib
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .builders import _LOGIT_STD, _extra_init, make_draft
from .tokenizer import make_tokenizer

ARCHITECTURES: dict[str, dict] = json.loads((Path(__file__).parent / "architectures.json").read_text())
_HEADS = ("lm_head.weight", "output.weight")


def build_target(model_type: str, seed: int = 0):
    """mlx-lm's model for ``ARCHITECTURES[model_type]`` with random float32 weights."""
    config = ARCHITECTURES[model_type]
    arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    hidden = _hidden_size(model)
    head_std = _LOGIT_STD / hidden**0.5
    tied = not any(name.endswith(_HEADS) for name in params)
    norms = [
        n
        for n, p in params.items()
        if n.endswith("norm.weight") and p.shape == (hidden,) and not re.search(r"\.\d+\.", n)
    ]
    final_norm = norms[-1] if norms else None
    weights = []
    for name, p in params.items():
        if not mx.issubdtype(p.dtype, mx.floating) or p.ndim == 0:
            weights.append((name, p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p))
            continue
        role = "lm_head.weight" if name.endswith(_HEADS) else name  # llama4_text calls its head `output`
        w = _extra_init(model_type, seed, role, p.shape, head_std, hidden)
        if tied and p.shape == _embedding_shape(model):  # the embedding is the head too
            w = w * head_std / w.std()
        elif tied and name == final_norm:  # else the input token's own embedding wins the argmax
            w = -w
        weights.append((name, mx.array(w)))
    model.load_weights(weights, strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model


def _embedding_shape(model) -> tuple[int, int]:
    from dflash_mlx.targets.adapter import embedding_shape, token_embedding

    return embedding_shape(token_embedding(model))


def _hidden_size(model) -> int:
    return _embedding_shape(model)[1]


@functools.lru_cache(maxsize=None)
def arch_pair(model_type: str, root: Path, target_layer_ids: tuple[int, ...] | None = None):
    """(model, tokenizer, drafter) for ``model_type``; the drafter reads two layers (1 and n-2 by default)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from dflash_mlx import load_draft

    model = build_target(model_type)
    vocab, hidden = _embedding_shape(model)
    n = len(model.layers)
    ids = target_layer_ids or (min(1, n - 1), max(n - 2, 0))
    facts = root / model_type / "target"  # what the drafter builder reads of its target
    facts.mkdir(parents=True, exist_ok=True)
    (facts / "config.json").write_text(
        json.dumps(
            dict(
                hidden_size=hidden,
                num_hidden_layers=n,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                intermediate_size=2 * hidden,
                vocab_size=vocab,
                rope_theta=10000.0,
            )
        )
    )
    make_tokenizer(facts)
    draft = make_draft(root / model_type / "draft", facts, target_layer_ids=list(ids), block_size=8)
    return model, load_tokenizer(facts), load_draft(str(draft), model)
