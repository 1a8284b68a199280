"""Family lists and the per-family target configs (``target_config``).

``FAMILIES`` are the base decoder families (llama / qwen2 / qwen3 / qwen3_moe /
mistral); ``HYBRID_FAMILIES`` mix Gated-DeltaNet and attention layers,
``SLIDING_FAMILIES`` sliding-window and full-attention layers.

The extra families (mlx-lm 0.32), 4 layers, hidden 64, vocab 512:

- qwen3_5 / qwen3_5_moe: config.json is {model_type, architectures,
  text_config: {model_type "<family>_text", ...}}; mlx-lm's Model wraps a
  ``language_model`` (``model.model`` is a property to its inner model) and
  weight names start with ``language_model.`` (its sanitize keeps them).
  Layers [GDN, attention] * 2 via full_attention_interval=2; caches
  [ArraysCache, KVCache] * 2. A_log stays float32 in bfloat16 checkpoints
  (mlx-lm's cast_predicate). MoE: 4 experts, top 2, plus a gated shared expert.
- qwen3_next: flat config, same layer/cache pattern, MoE in every layer.
  Its sanitize adds 1 to norm weights only for HF-format (per-expert) files,
  so these mlx-format files round-trip unchanged.
- llama_sliding: model_type "llama" with layer_types [sliding, full] * 2.
- gemma3_text: flat; sliding_window_pattern=2 ([sliding, full] * 2); its
  RMSNorm scales by 1 + weight; embeddings are multiplied by sqrt(hidden).
  Tied: the checkpoint has no lm_head (its sanitize then ties).
- gemma4: model_type "gemma4" with text_config (model_type "gemma4_text");
  Model wraps ``language_model`` and has no ``model`` attribute. Logits are
  soft-capped at 30; embeddings scaled by sqrt(hidden); full layers use
  head_dim 32 with proportional partial rope. No KV sharing and no per-layer
  inputs unless overridden (num_kv_shared_layers, hidden_size_per_layer_input).
- gpt_oss: layer_types [sliding, full] * 2, attention sinks, biases, 4
  experts top 2, yarn rope; always an untied lm_head.

Sliding layers use RotatingKVCache(max_size=sliding_window). Unquantized
bfloat16 qwen3_moe / qwen3_5_moe / qwen3_next / gpt_oss cannot run on the mlx
CPU backend (GatherMM is float32-only); their quantized variants can.
"""

from __future__ import annotations

from typing import Optional

from .tokenizer import BOS_ID, EOS_ID, PAD_ID, TINY_VOCAB

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral")
# Linear-attention (Gated DeltaNet) layers mixed with full-attention layers:
# their prompt caches hold ArraysCache (GDN) and KVCache (attention) entries.
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# Sliding-window layers (RotatingKVCache, window ``sliding_window``, default
# 8) alternating with full-attention layers (KVCache).
SLIDING_FAMILIES = ("llama_sliding", "gemma3_text", "gemma4", "gpt_oss")
EXTRA_FAMILIES = HYBRID_FAMILIES + SLIDING_FAMILIES
ALL_FAMILIES = FAMILIES + EXTRA_FAMILIES
# Families whose experts run through gather_mm: on the mlx CPU backend the
# unquantized kernel is float32-only, so unquantized bfloat16 cannot run there.
MOE_FAMILIES = ("qwen3_moe", "qwen3_5_moe", "qwen3_next", "gpt_oss")
# Families whose config.json nests the text model under ``text_config``.
NESTED_FAMILIES = ("qwen3_5", "qwen3_5_moe", "gemma4")
DEFAULT_SLIDING_WINDOW = 8

_TARGET_DEFAULTS = dict(
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=4096,
)
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mistral": "MistralForCausalLM",
}


def target_config(
    family: str,
    *,
    dtype: str = "float32",
    num_layers: int = 4,
    hidden_size: int = 64,
    tie_word_embeddings: bool = False,
    add_bos: bool = False,
    sliding_window: Optional[int] = None,
    **overrides,
) -> dict:
    """The config.json dict ``make_target`` writes (before quantization).

    For ``NESTED_FAMILIES`` the text model's settings (and ``overrides``) sit
    under ``text_config``; the top level holds model_type, architectures,
    vocab size, tying, token ids and torch_dtype.
    """
    if family not in ALL_FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {ALL_FAMILIES}")
    if family in EXTRA_FAMILIES:
        return _extra_config(
            family,
            dtype=dtype,
            num_layers=num_layers,
            hidden_size=hidden_size,
            tie_word_embeddings=tie_word_embeddings,
            add_bos=add_bos,
            sliding_window=sliding_window,
            overrides=overrides,
        )
    cfg = dict(
        _TARGET_DEFAULTS,
        model_type=family,
        architectures=[_ARCHITECTURES[family]],
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        vocab_size=TINY_VOCAB,
        tie_word_embeddings=tie_word_embeddings,
        torch_dtype=dtype,
        hidden_act="silu",
        bos_token_id=BOS_ID if add_bos else None,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    cfg["head_dim"] = hidden_size // cfg["num_attention_heads"]
    if family in ("llama", "mistral"):
        cfg.update(attention_bias=False, mlp_bias=False)
    if family == "mistral":
        cfg["sliding_window"] = None
    if family == "qwen3_moe":
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
        cfg.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    if sliding_window is not None:
        cfg["sliding_window"] = sliding_window
    cfg.update(overrides)
    if family == "qwen2" and cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]:
        raise ValueError("qwen2 in mlx-lm needs head_dim == hidden_size // heads")
    return cfg


def _alternating(num_layers: int, interval: int, other: str, full="full_attention") -> list:
    """``other`` layers with a full-attention layer every ``interval``-th layer."""
    return [full if (i + 1) % interval == 0 else other for i in range(num_layers)]


def _extra_config(
    family,
    *,
    dtype,
    num_layers,
    hidden_size,
    tie_word_embeddings,
    add_bos,
    sliding_window,
    overrides,
) -> dict:
    if family in HYBRID_FAMILIES and sliding_window is not None:
        raise ValueError(f"{family} has no sliding-window layers")
    if family == "gpt_oss" and tie_word_embeddings:
        raise ValueError("gpt_oss in mlx-lm always has an untied lm_head")
    window = DEFAULT_SLIDING_WINDOW if sliding_window is None else int(sliding_window)
    ids = dict(bos_token_id=BOS_ID if add_bos else None, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    text = dict(
        _TARGET_DEFAULTS,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        vocab_size=TINY_VOCAB,
        tie_word_embeddings=tie_word_embeddings,
        **ids,
    )
    text["head_dim"] = hidden_size // text["num_attention_heads"]
    top = None  # the outer config of nested families

    if family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        text.update(
            hidden_act="silu",
            attention_bias=False,
            full_attention_interval=2,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_num_value_heads=4,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
        )
        if family != "qwen3_5":
            text.update(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=64,
                shared_expert_intermediate_size=64,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                norm_topk_prob=True,
            )
        if family == "qwen3_next":
            text.update(
                model_type="qwen3_next",
                architectures=["Qwen3NextForCausalLM"],
                partial_rotary_factor=0.25,
                torch_dtype=dtype,
            )
        else:
            text["model_type"] = family + "_text"
            text["rope_parameters"] = dict(
                rope_type="default",
                rope_theta=text.pop("rope_theta"),
                partial_rotary_factor=0.25,
                mrope_section=[11, 11, 10],
                mrope_interleaved=True,
            )
            arch = "Qwen3_5MoeForConditionalGeneration" if "moe" in family else None
            arch = arch or "Qwen3_5ForConditionalGeneration"
            top = dict(model_type=family, architectures=[arch])
    elif family == "llama_sliding":
        text.update(
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            torch_dtype=dtype,
        )
    elif family == "gemma3_text":
        text.update(
            model_type="gemma3_text",
            architectures=["Gemma3ForCausalLM"],
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=text["head_dim"],
            rope_local_base_freq=10000.0,
            sliding_window_pattern=2,
            torch_dtype=dtype,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
        )
    elif family == "gemma4":
        text.update(
            model_type="gemma4_text",
            hidden_activation="gelu_pytorch_tanh",
            global_head_dim=2 * text["head_dim"],
            num_global_key_value_heads=None,
            num_kv_shared_layers=0,
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=TINY_VOCAB,
            attention_k_eq_v=False,
            use_double_wide_mlp=False,
            enable_moe_block=False,
            final_logit_softcapping=30.0,
            sliding_window_pattern=2,
            rope_parameters={
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
                "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0, "rope_type": "default"},
            },
        )
        text.pop("rope_theta")
        top = dict(model_type="gemma4", architectures=["Gemma4ForConditionalGeneration"])
    elif family == "gpt_oss":
        text.update(
            model_type="gpt_oss",
            architectures=["GptOssForCausalLM"],
            torch_dtype=dtype,
            num_local_experts=4,
            num_experts_per_tok=2,
            experts_per_token=2,
            intermediate_size=64,
            attention_bias=True,
            swiglu_limit=7.0,
            rope_theta=150000.0,
            initial_context_length=4096,
            hidden_act="silu",
            rope_scaling={
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },
        )
    if family in SLIDING_FAMILIES:
        text["sliding_window"] = window
    text.update(overrides)
    if family in SLIDING_FAMILIES and "layer_types" not in overrides:
        # [sliding, full] * n; gemma3 in mlx-lm reads only sliding_window_pattern.
        interval = text.get("sliding_window_pattern", 2)
        text["layer_types"] = _alternating(num_layers, interval, "sliding_attention")
    if family in HYBRID_FAMILIES and "layer_types" not in overrides:
        # Informational (as in HF configs): mlx-lm reads full_attention_interval.
        interval = text["full_attention_interval"]
        text["layer_types"] = _alternating(num_layers, interval, "linear_attention")
    if top is None:
        return text
    top.update(
        text_config=text,
        vocab_size=text["vocab_size"],
        torch_dtype=dtype,
        tie_word_embeddings=text["tie_word_embeddings"],
        **ids,
    )
    return top
