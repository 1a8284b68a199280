"""Builders of tiny on-disk models from random weights (no network).

- ``make_target``: an mlx-lm model directory of any family in
  ``ALL_FAMILIES`` (see families.py); float32 or bfloat16, optionally 4/8-bit
  affine or mxfp4.
- ``make_draft``: a DFlash v1 draft checkpoint in the real format (spec 2).
- ``make_draft2``: a DFlash 2 draft (spec 2 and 4): the v1 weights of
  ``make_draft`` plus grouped dynamic convs and the candidate selector.
- ``draft_weight_shapes`` / ``draft2_weight_shapes``: the expected tensors;
  ``derive_target_layer_ids``: the spec's default target layers.

Weights are random, determined by ``seed`` and each tensor's name (NumPy
PCG64), so builds are identical across runs and machines. Target heads are
scaled for clear greedy margins (top-1 minus top-2 logit: 5th percentile
~0.1 in float32), which the speculative-equals-greedy tests rely on.
"""

from __future__ import annotations

import contextlib
import io
import json
import zlib
from pathlib import Path
from typing import Iterable, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .families import EXTRA_FAMILIES, target_config
from .tokenizer import MASK_ID, make_tokenizer, write_json

# Standard deviation of the target's output logits. Large enough for clear
# greedy margins, small enough that softmax is not one-hot at temperature 1.
_LOGIT_STD = 8.0
_TIED_MLP_GAIN = 4.0


def derive_target_layer_ids(num_draft_layers: int, num_target_layers: int) -> list:
    """Target layers a draft reads when its config gives none (spec section 2).

    n = 1 -> [N // 2]; else round(1 + i * (N - 4) / (n - 1)) for i < n, i.e.
    evenly from layer 1 to layer N - 3. For N < 4 the rule leaves the valid
    range, so ids are clamped to [0, N - 1] (duplicates are possible there and
    for N = 4).
    """
    n, big_n = int(num_draft_layers), int(num_target_layers)
    if n < 1 or big_n < 1:
        raise ValueError("need at least one draft layer and one target layer")
    if n == 1:
        return [big_n // 2]
    ids = [round(1 + i * (big_n - 4) / (n - 1)) for i in range(n)]
    return [min(max(int(i), 0), big_n - 1) for i in ids]


# ------------------------------------------------------------ random weights


def _normal(seed: int, name: str, shape: Sequence[int], std: float) -> np.ndarray:
    """N(0, std^2) from a stream that depends only on (seed, tensor name)."""
    rng = np.random.default_rng([int(seed), zlib.crc32(name.encode())])
    return (rng.standard_normal(tuple(shape)) * std).astype(np.float32)


def _init_tensor(seed: int, name: str, shape: Sequence[int], head_std: float) -> np.ndarray:
    """Initialisation by role, read from the parameter's name and shape."""
    if name.endswith("norm.weight"):
        return 1.0 + _normal(seed, name, shape, 0.05)
    if name.endswith(".bias"):
        return _normal(seed, name, shape, 0.02)
    if name.endswith("embed_tokens.weight"):
        return _normal(seed, name, shape, 1.0)
    if name.endswith("lm_head.weight"):
        return _normal(seed, name, shape, head_std)
    return _normal(seed, name, shape, shape[-1] ** -0.5)  # N(0, 1 / fan_in)


def _mx_dtype(dtype: str):
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    return getattr(mx, dtype)


def _uniform(seed: int, name: str, shape: Sequence[int], low: float, high: float) -> np.ndarray:
    rng = np.random.default_rng([int(seed), zlib.crc32(name.encode()), 1])
    return rng.uniform(low, high, tuple(shape)).astype(np.float32)


def _extra_init(
    family: str, seed: int, name: str, shape: Sequence[int], head_std: float, hidden_size: int
) -> np.ndarray:
    """Initialisation of the EXTRA_FAMILIES (the base families keep theirs)."""
    gemma = family in ("gemma3_text", "gemma4")
    if name.endswith("A_log"):  # GDN decay rates A in [1, 16], as mlx-lm's init
        return np.log(_uniform(seed, name, shape, 1.0, 16.0))
    if name.endswith("dt_bias"):
        return 1.0 + _normal(seed, name, shape, 0.1)
    if name.endswith("conv1d.weight"):  # depthwise [C, kernel, 1]: fan_in = kernel
        return _normal(seed, name, shape, shape[1] ** -0.5)
    if name.endswith("layer_scalar"):
        return np.ones(shape, np.float32)
    if name.endswith(("router.scale", "per_expert_scale")):
        return 1.0 + _normal(seed, name, shape, 0.05)
    if name.endswith("sinks"):
        return _normal(seed, name, shape, 1.0)
    if family == "gemma3_text" and name.endswith("norm.weight"):
        # gemma3's RMSNorm scales by 1 + weight. Its post-attention norm lifts
        # the (smooth, context-averaged) attention output to full size; at
        # gain 1 that drowns the current token and greedy decoding repeats
        # tokens, so that norm gets gain ~0.5.
        offset = -0.5 if name.endswith("post_attention_layernorm.weight") else 0.0
        return offset + _normal(seed, name, shape, 0.05)
    if gemma and name.endswith("embed_tokens.weight"):
        # The model multiplies embeddings by sqrt(hidden_size); tied or not,
        # the scaled input embedding is then ~N(0, 1) like the other families'.
        return _normal(seed, name, shape, hidden_size**-0.5)
    return _init_tensor(seed, name, shape, head_std)


def make_target(
    out_dir: Path,
    family: str,
    *,
    dtype: str = "float32",
    num_layers: int = 4,
    hidden_size: int = 64,
    seed: int = 0,
    quantize_bits: Optional[int] = None,
    quantize_group_size: int = 32,
    quantize_mode: str = "affine",
    tie_word_embeddings: bool = False,
    add_bos: bool = False,
    sliding_window: Optional[int] = None,
    **overrides,
) -> Path:
    """Write a random mlx-lm model of ``family`` to ``out_dir`` and return it.

    ``family`` is one of ``ALL_FAMILIES``. ``overrides`` go into config.json
    (under ``text_config`` for ``NESTED_FAMILIES``) and so into the mlx-lm
    ModelArgs, e.g. ``layer_types``/``sliding_window`` for a llama with
    sliding layers (``"llama_sliding"`` is that llama with [sliding, full]
    * 2 layers and window 8). ``sliding_window`` sets the window of the
    SLIDING_FAMILIES (default 8). ``add_bos`` selects the BOS tokenizer
    variant. ``quantize_mode`` is mlx-lm's ("affine", or "mxfp4" with 4 bits
    and group size 32). Unquantized bfloat16 MoE_FAMILIES load but cannot run on mlx CPU
    (GatherMM is float32-only).
    """
    from mlx_lm.utils import _get_classes, quantize_model, save_config

    if quantize_bits not in (None, 4, 8):
        raise ValueError("quantize_bits must be None, 4 or 8")
    mdt = _mx_dtype(dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = target_config(
        family,
        dtype=dtype,
        num_layers=num_layers,
        hidden_size=hidden_size,
        tie_word_embeddings=tie_word_embeddings,
        add_bos=add_bos,
        sliding_window=sliding_window,
        **overrides,
    )
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    text = config.get("text_config", config)
    extra = family in EXTRA_FAMILIES
    gemma = family in ("gemma3_text", "gemma4")
    if family == "gemma3_text" and tie_word_embeddings:
        model.tie_word_embeddings = True  # what its sanitize does without lm_head
        model.pop("lm_head")

    # Logits are head @ rmsnorm(h) with |rmsnorm(h)| ~ sqrt(H): a head std of
    # _LOGIT_STD / sqrt(H) gives logits of std ~ _LOGIT_STD. A tied embedding
    # is the head too, so it gets the same scale. Tied heads also get a
    # negated final norm and a louder MLP: otherwise the input token's own
    # embedding, still present in the residual stream, wins the argmax and
    # greedy decoding sticks to one token.
    head_std = _LOGIT_STD / text["hidden_size"] ** 0.5
    cast = getattr(model, "cast_predicate", None) or (lambda _: True)
    weights = {}
    for name, param in tree_flatten(model.parameters()):
        if extra:
            w = _extra_init(family, seed, name, param.shape, head_std, text["hidden_size"])
        else:
            w = _init_tensor(seed, name, param.shape, head_std)
        if tie_word_embeddings and gemma:
            # The input embedding is scaled up by sqrt(H): keep it small
            # (see _extra_init) and put the logit scale in the final norm.
            # Rows of std H^-0.5 give logits of std ~ |final norm scale|.
            if name.endswith("model.norm.weight"):
                if family == "gemma3_text":  # effective scale 1 + weight
                    w = -_LOGIT_STD * (1.0 + w) - 1.0
                else:
                    w = -_LOGIT_STD * w
        elif tie_word_embeddings:
            if name.endswith("embed_tokens.weight"):
                w = w * head_std
            elif name.endswith("model.norm.weight"):
                w = -w
            elif name.endswith("down_proj.weight"):
                w = w * _TIED_MLP_GAIN
        # Like mlx_lm.convert: parameters the model asks to keep (the GDN A_log)
        # stay float32 in a bfloat16 checkpoint.
        weights[name] = mx.array(w).astype(mdt if cast(name) else mx.float32)
    model.load_weights(list(weights.items()), strict=True)

    if quantize_bits is not None:
        with contextlib.redirect_stdout(io.StringIO()):  # silence its [INFO]
            model, config = quantize_model(model, config, quantize_group_size, quantize_bits, mode=quantize_mode)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_config(config, out_dir / "config.json")
    make_tokenizer(out_dir, add_bos=add_bos)
    return out_dir


# ------------------------------------------------------------------- draft


def draft_weight_shapes(config: dict) -> dict:
    """Expected {key: shape} of a v1 draft checkpoint's own weights."""
    h = config["hidden_size"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    hd, inter = config["head_dim"], config["intermediate_size"]
    n_ids = len(config["dflash_config"]["target_layer_ids"])
    per_layer = {
        "input_layernorm": (h,),
        "post_attention_layernorm": (h,),
        "mlp.gate_proj": (inter, h),
        "mlp.up_proj": (inter, h),
        "mlp.down_proj": (h, inter),
        "self_attn.q_proj": (nh * hd, h),
        "self_attn.k_proj": (nkv * hd, h),
        "self_attn.v_proj": (nkv * hd, h),
        "self_attn.o_proj": (h, nh * hd),
        "self_attn.q_norm": (hd,),
        "self_attn.k_norm": (hd,),
    }
    shapes = {
        f"layers.{i}.{key}.weight": shape
        for i in range(config["num_hidden_layers"])
        for key, shape in per_layer.items()
    }
    shapes.update({"fc.weight": (h, n_ids * h), "hidden_norm.weight": (h,), "norm.weight": (h,)})
    return shapes


def make_draft(
    out_dir: Path,
    target_dir: Path,
    *,
    num_layers: int = 2,
    target_layer_ids: Optional[Sequence[int]] = None,
    block_size: int = 16,
    schema: str = "nested",
    seed: int = 1,
    dtype: str = "float32",
    layer_types: Optional[Sequence[str]] = None,
    sliding_window: Optional[int] = None,
    is_causal: Optional[bool] = None,
    input_embedding_scale: Optional[float] = None,
    output_multiplier: Optional[float] = None,
    final_logit_softcapping: Optional[float] = None,
    rope_in_parameters: bool = False,
    extra_keys: Iterable[str] = (),
    **config_overrides,
) -> Path:
    """Write a DFlash v1 draft bound to the target in ``target_dir``.

    Head shapes, vocab, eps and rope theta are taken from the target config
    (its ``text_config`` when it has one).
    ``schema`` is "nested" (block_size in dflash_config) or "flat" (top level);
    weights do not depend on it. ``extra_keys`` (e.g. "embed_tokens.weight",
    "lm_head.weight") adds random [vocab, hidden] tensors that loaders must
    ignore; the other weights are unchanged by them. ``config_overrides`` are
    written verbatim at the top level of config.json, last.
    """
    if schema not in ("nested", "flat"):
        raise ValueError("schema must be 'nested' or 'flat'")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(Path(target_dir) / "config.json") as f:
        tcfg = json.load(f)
    tcfg = tcfg.get("text_config", tcfg)  # qwen3_5 / gemma4 nest the text model
    n_target = tcfg["num_hidden_layers"]
    if target_layer_ids is None:
        target_layer_ids = derive_target_layer_ids(num_layers, n_target)
    h = tcfg["hidden_size"]
    theta = tcfg.get("rope_theta", 10000.0)

    dflash = {"mask_token_id": MASK_ID, "target_layer_ids": [int(i) for i in target_layer_ids]}
    optional = dict(
        input_embedding_scale=input_embedding_scale,
        output_multiplier=output_multiplier,
        final_logit_softcapping=final_logit_softcapping,
    )
    dflash.update({k: v for k, v in optional.items() if v is not None})
    config = dict(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        hidden_size=h,
        num_hidden_layers=num_layers,
        num_attention_heads=tcfg["num_attention_heads"],
        num_key_value_heads=tcfg["num_key_value_heads"],
        head_dim=tcfg.get("head_dim") or h // tcfg["num_attention_heads"],
        intermediate_size=tcfg["intermediate_size"],
        vocab_size=tcfg["vocab_size"],
        rms_norm_eps=tcfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=tcfg.get("max_position_embeddings", 4096),
        num_target_layers=n_target,
        tie_word_embeddings=bool(tcfg.get("tie_word_embeddings", False)),
        attention_bias=False,
        hidden_act="silu",
        torch_dtype=dtype,
    )
    if rope_in_parameters:
        config["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    else:
        config["rope_theta"] = theta
    optional = dict(layer_types=layer_types, sliding_window=sliding_window, is_causal=is_causal)
    config.update({k: v for k, v in optional.items() if v is not None})
    (dflash if schema == "nested" else config)["block_size"] = block_size
    config["dflash_config"] = dflash

    mdt = _mx_dtype(dtype)
    weights = {
        name: mx.array(_init_tensor(seed, name, shape, 0.0)).astype(mdt)
        for name, shape in draft_weight_shapes(config).items()
    }
    for name in extra_keys:
        shape = (tcfg["vocab_size"], h)
        weights[name] = mx.array(_normal(seed, name, shape, 1.0)).astype(mdt)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "pt"})

    config.update(config_overrides)
    write_json(out_dir / "config.json", config)
    return out_dir
