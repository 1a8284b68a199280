"""Per-family target knowledge, in one place.

mlx-lm builds each family's attention masks and embeddings inside its model's
`__call__`; to capture hidden states and record Gated DeltaNet inputs without
patching anything, `dflash_mlx.targets.adapter` runs the layers itself and asks the
family here for: the per-layer masks (from the layer pattern and the caches),
the input embedding (with the family's own scaling), which layers are
linear-attention (Gated DeltaNet) layers, any transform the target applies to
its logits, or, for stacks that thread extra state between layers (Gemma 4),
the whole layer loop; and, for tensor sharding (`dflash_mlx.sharding`), what
a family's mlx-lm `shard()` splits across ranks (`shard_problem`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask


def _one_mask(inner, h, cache) -> list:
    """llama/qwen/mistral stacks: one causal mask for every layer."""
    return [create_attention_mask(h, cache[0])] * len(inner.layers)


def _llama_masks(inner, h, cache) -> list:
    """llama (and mistral) configs may mix sliding and full layers."""
    if getattr(inner, "swa_idx", None) is None:
        return _one_mask(inner, h, cache)
    full = create_attention_mask(h, cache[inner.fa_idx])
    sliding = create_attention_mask(h, cache[inner.swa_idx], window_size=inner.sliding_window)
    return [sliding if layer.use_sliding else full for layer in inner.layers]


def _gpt_oss_masks(inner, h, cache) -> list:
    full = create_attention_mask(h, cache[inner.ga_idx])
    sliding = create_attention_mask(h, cache[inner.swa_idx], window_size=inner.window_size)
    return [full if t == "full_attention" else sliding for t in inner.layer_types]


def _gemma3_global(inner, i: int) -> bool:
    pattern = inner.sliding_window_pattern
    return i % pattern == pattern - 1


def _gemma3_masks(inner, h, cache) -> list:
    pattern = inner.sliding_window_pattern
    full = create_attention_mask(h, cache[pattern - 1])
    sliding = create_attention_mask(h, cache[0], window_size=inner.window_size) if pattern > 1 else None
    return [full if _gemma3_global(inner, i) else sliding for i in range(len(inner.layers))]


def _gemma3_embed(inner, ids):
    h = inner.embed_tokens(ids)
    return h * mx.array(inner.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)


def _hybrid_masks(inner, h, cache) -> list:
    full = create_attention_mask(h, cache[inner.fa_idx]) if inner.fa_idx is not None else None
    ssm = create_ssm_mask(h, cache[inner.ssm_idx]) if inner.ssm_idx is not None else None
    return [ssm if layer.is_linear else full for layer in inner.layers]


def _plain_embed(inner, ids):
    return inner.embed_tokens(ids)


def _no_linear_layers(inner) -> set[int]:
    return set()


def _linear_layers(inner) -> set[int]:
    return {i for i, layer in enumerate(inner.layers) if getattr(layer, "is_linear", False)}


def _gemma4_run(inner, ids, cache, on_layer) -> mx.array:
    """Gemma 4 text stack: per-layer input embeddings and KV-shared layers."""
    embeddings = inner.embed_tokens(ids)
    h = embeddings * inner.embed_scale
    n = len(inner.layers)
    per_layer = [None] * n
    if inner.hidden_size_per_layer_input:
        projected = inner._project_per_layer_inputs(h, inner._get_per_layer_inputs(ids, embeddings))
        per_layer = [projected[:, :, i, :] for i in range(n)]
    cache = list(cache) + [None] * (n - len(cache))  # KV-shared layers own no cache
    masks = inner._make_masks(h, cache)
    shared = [(None, None)] * n
    for i, (layer, c, mask, source) in enumerate(zip(inner.layers, cache, masks, inner.previous_kvs)):
        kvs, offset = shared[source]
        h, kvs, offset = layer(h, mask, c, per_layer_input=per_layer[i], shared_kv=kvs, offset=offset)
        shared[i] = (kvs, offset)
        on_layer(i, h)
    return h


def _gemma4_softcap(text, logits):
    cap = getattr(text, "final_logit_softcapping", None)
    return logits if cap is None else mx.tanh(logits / cap) * cap


def _no_softcap(text, logits):
    return logits


@dataclass(frozen=True)
class Family:
    """How to run one mlx-lm model family layer by layer.

    Most families use the generic loop in `dflash_mlx.targets.adapter` with `masks` and
    `embed`; a family whose stack threads extra state between layers supplies
    its own `run(inner, ids, cache, on_layer) -> last hidden state`.
    """

    masks: Callable[[nn.Module, mx.array, list], list] | None = None
    embed: Callable[[nn.Module, mx.array], mx.array] = _plain_embed
    linear_layers: Callable[[nn.Module], set[int]] = _no_linear_layers
    run: Callable | None = None
    final_logits: Callable = _no_softcap  # the target's own post-head transform


FAMILIES: dict[str, Family] = {
    "llama": Family(_llama_masks),
    "mistral": Family(_llama_masks),
    "qwen2": Family(_one_mask),
    "qwen3": Family(_one_mask),
    "qwen3_moe": Family(_one_mask),
    "qwen3_5": Family(_hybrid_masks, linear_layers=_linear_layers),
    "qwen3_5_moe": Family(_hybrid_masks, linear_layers=_linear_layers),
    "qwen3_next": Family(_hybrid_masks, linear_layers=_linear_layers),
    "gemma3_text": Family(_gemma3_masks, embed=_gemma3_embed),
    "gpt_oss": Family(_gpt_oss_masks),
    "gemma4": Family(run=_gemma4_run, final_logits=_gemma4_softcap),
    "gemma4_text": Family(run=_gemma4_run, final_logits=_gemma4_softcap),
}


def model_family(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    return getattr(model, "model_type", None) or getattr(args, "model_type", "unknown")


def batch_problem(model: nn.Module) -> str | None:
    """Why a batch (`dflash_mlx.batch`) cannot decode this target's rows together, or None."""
    family = FAMILIES.get(model_family(model))
    if family is not None and family.run is not None:
        return f"batched decoding does not support the {model_family(model)} family yet (its own layer loop)"
    return None


def text_model(model: nn.Module) -> nn.Module:
    """The module holding `.model` (embedding, layers, norm) and the output head."""
    return getattr(model, "language_model", model)


def context_length(model) -> int | None:
    """The target's context in tokens, or None if its config gives none.

    Its config's max_position_embeddings, or what a RoPE scaling extends it to
    (factor x original_max_position_embeddings, as YaRN configs give).
    """
    args = getattr(text_model(model), "args", None)
    lengths = [getattr(args, "max_position_embeddings", None)]
    scaling = getattr(args, "rope_scaling", None)
    if isinstance(scaling, dict):
        factor, original = scaling.get("factor"), scaling.get("original_max_position_embeddings")
        if isinstance(factor, (int, float)) and isinstance(original, int):
            lengths.append(int(factor * original))
    lengths = [n for n in lengths if isinstance(n, int) and n > 0]
    return max(lengths) if lengths else None


# Config fields a tensor shard splits across ranks: each must be a multiple of the group size
# (mlx-lm's shard() floors head counts, which would silently compute with the wrong shapes).
SHARDED_FIELDS = (
    "num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
    "shared_expert_intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
)
REPEATS_KV_HEADS = {"qwen3_5", "qwen3_5_moe"}  # their shard() repeats KV heads when there are fewer than ranks


def shard_problem(model: nn.Module, ranks: int) -> str | None:
    """Why `model` cannot be tensor-sharded over `ranks` ranks by mlx-lm, or None."""
    family = model_family(model)
    if not callable(getattr(model, "shard", None)):
        return f"mlx-lm cannot tensor-shard the '{family}' family (its model has no shard())."
    args = getattr(text_model(model), "args", None)
    problems = []
    for name in SHARDED_FIELDS:
        value = getattr(args, name, None)
        if not isinstance(value, int) or value <= 0 or value % ranks == 0:
            continue
        if name == "num_key_value_heads" and family in REPEATS_KV_HEADS and ranks % value == 0:
            continue
        problems.append(f"{name} = {value}")
    if family in REPEATS_KV_HEADS and not getattr(args, "tie_word_embeddings", True):
        vocab = getattr(args, "vocab_size", 0)
        if vocab % ranks:
            problems.append(f"vocab_size = {vocab}")
    if problems:
        return f"{', '.join(problems)} not divisible by the {ranks} ranks of the group."
    return None
