"""DFlash 2 drafters in the real checkpoint format: a v1 drafter (`builders.make_draft`) plus the
grouped dynamic convolution and the candidate selector's weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .builders import _mx_dtype, _normal, make_draft
from .tokenizer import write_json


def draft2_weight_shapes(config: dict) -> dict:
    """Expected {key: shape} of the weights a DFlash 2 draft adds to v1's.

    Per layer N: ``layers.N.{attention,mlp}_conv.base_kernel`` [2, K, H] and
    ``...kernel_projection.weight`` [2 * K * (H // group), H]; plus the
    candidate selector's ``hidden_projection.weight`` [R, H] and the two
    codebooks [V, R], stored without a ``.weight`` suffix (spec 2).
    """
    h, v = config["hidden_size"], config["vocab_size"]
    d = config["dflash_config"]
    k, group, r = d["conv_kernel_size"], d["conv_group_size"], d["selector_rank"]
    if h % group:
        raise ValueError(f"hidden_size {h} is not a multiple of conv_group_size {group}")
    shapes = {}
    for i in range(config["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"layers.{i}.{conv}.base_kernel"] = (2, k, h)
            shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * k * (h // group), h)
    shapes.update(
        {
            "candidate_selector.hidden_projection.weight": (r, h),
            "candidate_selector.predecessor_codebook": (v, r),
            "candidate_selector.successor_codebook": (v, r),
        }
    )
    return shapes


def _draft2_init(seed: int, name: str, shape: Sequence[int]) -> np.ndarray:
    """Initialisation of the DFlash 2 tensors (see ``make_draft2``)."""
    if name.endswith("base_kernel"):  # [2, K, H]: tap 0 ~ 1, later taps ~ 0.3 / j
        w = _normal(seed, name, shape, 1.0)
        taps = np.array([0.05] + [0.3 / j for j in range(1, shape[1])], np.float32)
        w = w * taps[None, :, None]
        w[:, 0] += 1.0
        return w
    if name.endswith("kernel_projection.weight"):  # [2 K G, H]: D of std ~0.02
        return _normal(seed, name, shape, 0.02 * shape[-1] ** -0.5)
    if name.startswith("candidate_selector."):
        return _normal(seed, name, shape, 0.5)
    raise KeyError(name)


def make_draft2(
    out_dir: Path,
    target_dir: Path,
    *,
    num_layers: int = 2,
    target_layer_ids: Optional[Sequence[int]] = None,
    block_size: int = 16,
    seed: int = 1,
    dtype: str = "float32",
    sliding_window: int = 8,
    conv_kernel_size: int = 2,
    conv_group_size: int = 16,
    selector_rank: int = 8,
    selector_top_k: int = 4,
    output_multiplier: float = 0.19611613513818404,
    final_logit_softcapping: float = 20.0,
    rope_theta: float = 500000.0,
    **config_overrides,
) -> Path:
    """Write a DFlash 2 draft bound to the target in ``target_dir``.

    The layout of Muse-Glimmer-30B-DFlash2, scaled down: architectures
    ["DFlash2DraftModel"], is_causal false, every layer sliding (window
    ``sliding_window``), rope theta ``rope_theta`` at the top level, and in
    dflash_config the v2 fields conv_kernel_size, conv_group_size,
    selector_rank, selector_top_k next to mask_token_id, target_layer_ids,
    block_size, output_multiplier, final_logit_softcapping.

    The v1 weights are exactly ``make_draft``'s for the same ``seed`` (they
    depend only on seed, name and shape). The v2 tensors
    (``draft2_weight_shapes``): conv ``base_kernel`` tap 0 ~ 1 + N(0, 0.05^2),
    tap j >= 1 ~ N(0, (0.3 / j)^2), i.e. near identity plus a causal term;
    ``kernel_projection`` std 0.02 / sqrt(H) (dynamic kernel entries ~0.02 on
    normed inputs); selector projection and codebooks std 0.5, so the pairwise
    term is comparable to the draft logits. ``config_overrides`` are written
    verbatim at the top level of config.json, last (e.g.
    ``architectures=["DFlashDraftModel"]``).
    """
    out_dir = Path(out_dir)
    make_draft(
        out_dir,
        target_dir,
        num_layers=num_layers,
        target_layer_ids=target_layer_ids,
        block_size=block_size,
        schema="nested",
        seed=seed,
        dtype=dtype,
        layer_types=["sliding_attention"] * num_layers,
        sliding_window=sliding_window,
        is_causal=False,
        output_multiplier=output_multiplier,
        final_logit_softcapping=final_logit_softcapping,
    )
    with open(out_dir / "config.json") as f:
        config = json.load(f)
    config["architectures"] = ["DFlash2DraftModel"]
    config["rope_theta"] = rope_theta
    config["dflash_config"].update(
        conv_kernel_size=conv_kernel_size,
        conv_group_size=conv_group_size,
        selector_rank=selector_rank,
        selector_top_k=selector_top_k,
    )

    mdt = _mx_dtype(dtype)
    weights = dict(mx.load(str(out_dir / "model.safetensors")))
    for name, shape in draft2_weight_shapes(config).items():
        weights[name] = mx.array(_draft2_init(seed, name, shape)).astype(mdt)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "pt"})

    config.update(config_overrides)
    write_json(out_dir / "config.json", config)
    return out_dir
