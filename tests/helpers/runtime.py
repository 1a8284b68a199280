"""Running the tiny models: ``load_pair`` (loaded once per directory pair) and ``greedy_with_margins``."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np


def greedy_with_margins(model, prompt_ids, n):
    """n greedy tokens and the top-1 minus top-2 logit gap at each step."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt_ids)[None], cache=cache)[0, -1]
    tokens, gaps = [], []
    for _ in range(n):
        row = np.array(logits.astype(mx.float32))
        top2 = np.sort(row)[-2:]
        tokens.append(int(row.argmax()))
        gaps.append(float(top2[1] - top2[0]))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
    return tokens, np.array(gaps)


@functools.lru_cache(maxsize=None)
def load_pair(target_dir, draft_dir=None):
    """(model, tokenizer, drafter or None), loaded once per directory pair; share read-only."""
    from mlx_lm import load

    from dflash_mlx import load_draft

    model, tokenizer = load(str(target_dir))
    return model, tokenizer, (load_draft(draft_dir, model) if draft_dir else None)
