"""Builders for tiny on-disk models used by the test suite (no network).

- ``make_tokenizer``: byte-level BPE (``tokenizers``), exactly ``TINY_VOCAB``
  entries, ChatML template; loads with ``AutoTokenizer`` and ``mlx_lm.load``.
- ``make_target``: an mlx-lm model directory for llama / qwen2 / qwen3 /
  qwen3_moe / mistral (``FAMILIES``), the hybrid Gated-DeltaNet families
  qwen3_5 / qwen3_5_moe / qwen3_next (``HYBRID_FAMILIES``) and the
  sliding-window families llama_sliding / gemma3_text / gemma4 / gpt_oss
  (``SLIDING_FAMILIES``); float32 or bfloat16, optionally 4/8-bit affine.
- ``make_draft``: a DFlash v1 draft checkpoint in the real format (spec 2).
- ``make_draft2``: a DFlash 2 draft (spec 2 and 4): the v1 weights of
  ``make_draft`` plus grouped dynamic convs and the candidate selector.

Weights are random, determined by ``seed`` and each tensor's name (NumPy
PCG64), so builds are identical across runs and machines. Target heads are
scaled for clear greedy margins (top-1 minus top-2 logit: 5th percentile
~0.1 in float32), which the speculative-equals-greedy tests rely on.

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

import contextlib
import functools
import io
import json
import zlib
from pathlib import Path
from typing import Iterable, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

TINY_VOCAB = 512

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
MASK_TOKEN = "<|mask|>"
BOS_TOKEN = "<s>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, MASK_TOKEN, BOS_TOKEN)

# Special tokens take the first ids, in the order above. ``<s>`` is in every
# vocabulary (so ids never shift), but it is only declared as BOS and prepended
# by the post-processor when ``make_tokenizer(..., add_bos=True)``.
EOS_ID, IM_START_ID, IM_END_ID, MASK_ID, BOS_ID = range(len(SPECIAL_TOKENS))
PAD_ID = EOS_ID

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

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Fixed training text for the BPE merges (original prose; do not edit, the
# token ids of every tiny model depend on it).
_CORPUS = """\
The river ran past the old mill and under the stone bridge near the market.
Every morning the baker opened the shop at six and sold warm bread to the town.
A small robot named Pico liked to count things: one, two, three, four, five.
It counted the birds on the roof, the cars on the road and the stars at night.
When the rain came, the children played inside and built towers out of boxes.
Their teacher asked them to write a short story about a journey to the sea.
Some of them wrote about ships, others about trains, and one about a flying fish.
The weather today is cold and windy, but tomorrow it should be sunny and warm.
Please remember to bring your notebook, a pencil and a bottle of water.
In the garden there are apples, pears, plums and a row of bright yellow flowers.
The library is open from nine in the morning until eight in the evening.
Numbers such as 12, 345 and 6789 appear in tables, lists and simple programs.
def add(a, b): return a + b  # a tiny function that adds two numbers
for i in range(10): print(i * i)
Question: what is the capital of the country? Answer: the city by the river.
She said that the meeting would start at ten and finish before lunch time.
He walked to the station, bought a ticket and waited for the next train home.
Good models predict the next word; better models also explain their answers.
The cat sat on the warm window and watched the people walking in the street.
We measured the length, the width and the height of each box in centimeters.
"""

_TARGET_DEFAULTS = dict(
    num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
    rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
)  # fmt: skip
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "mistral": "MistralForCausalLM",
}  # fmt: skip

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


# ---------------------------------------------------------------- tokenizer


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB, min_frequency=1, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != TINY_VOCAB:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} entries")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def make_tokenizer(out_dir: Path, *, add_bos: bool = False) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json.

    ``add_bos=True`` declares ``<s>`` (id ``BOS_ID``) as BOS, prepends it when
    encoding with special tokens, and starts the chat template with it.
    """
    from tokenizers import processors

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A" if add_bos else "$A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B" if add_bos else "$A $B",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    tok.save(str(out_dir / "tokenizer.json"))

    specials = dict(bos_token=BOS_TOKEN if add_bos else None, eos_token=EOS_TOKEN,
                    pad_token=EOS_TOKEN, unk_token=None, mask_token=MASK_TOKEN)
    config = dict(
        specials,
        tokenizer_class="PreTrainedTokenizerFast",
        add_bos_token=add_bos,
        add_eos_token=False,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=("{{ bos_token }}" if add_bos else "") + CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    smap = {k: v for k, v in specials.items() if v is not None}
    smap["additional_special_tokens"] = [IM_START_TOKEN, IM_END_TOKEN]
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", smap)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


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


# ------------------------------------------------------------------ target


def target_config(
    family: str, *, dtype: str = "float32", num_layers: int = 4, hidden_size: int = 64,
    tie_word_embeddings: bool = False, add_bos: bool = False,
    sliding_window: Optional[int] = None, **overrides,
) -> dict:  # fmt: skip
    """The config.json dict ``make_target`` writes (before quantization).

    For ``NESTED_FAMILIES`` the text model's settings (and ``overrides``) sit
    under ``text_config``; the top level holds model_type, architectures,
    vocab size, tying, token ids and torch_dtype.
    """
    if family not in ALL_FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {ALL_FAMILIES}")
    if family in EXTRA_FAMILIES:
        return _extra_config(
            family, dtype=dtype, num_layers=num_layers, hidden_size=hidden_size,
            tie_word_embeddings=tie_word_embeddings, add_bos=add_bos,
            sliding_window=sliding_window, overrides=overrides,
        )  # fmt: skip
    cfg = dict(
        _TARGET_DEFAULTS, model_type=family, architectures=[_ARCHITECTURES[family]],
        hidden_size=hidden_size, num_hidden_layers=num_layers, vocab_size=TINY_VOCAB,
        tie_word_embeddings=tie_word_embeddings, torch_dtype=dtype, hidden_act="silu",
        bos_token_id=BOS_ID if add_bos else None, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )  # fmt: skip
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
    family, *, dtype, num_layers, hidden_size, tie_word_embeddings, add_bos,
    sliding_window, overrides,
) -> dict:  # fmt: skip
    if family in HYBRID_FAMILIES and sliding_window is not None:
        raise ValueError(f"{family} has no sliding-window layers")
    if family == "gpt_oss" and tie_word_embeddings:
        raise ValueError("gpt_oss in mlx-lm always has an untied lm_head")
    window = DEFAULT_SLIDING_WINDOW if sliding_window is None else int(sliding_window)
    ids = dict(bos_token_id=BOS_ID if add_bos else None, eos_token_id=EOS_ID,
               pad_token_id=PAD_ID)  # fmt: skip
    text = dict(
        _TARGET_DEFAULTS, hidden_size=hidden_size, num_hidden_layers=num_layers,
        vocab_size=TINY_VOCAB, tie_word_embeddings=tie_word_embeddings, **ids,
    )  # fmt: skip
    text["head_dim"] = hidden_size // text["num_attention_heads"]
    top = None  # the outer config of nested families

    if family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        text.update(
            hidden_act="silu", attention_bias=False, full_attention_interval=2,
            linear_num_key_heads=2, linear_key_head_dim=16,
            linear_num_value_heads=4, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        )  # fmt: skip
        if family != "qwen3_5":
            text.update(
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                shared_expert_intermediate_size=64, decoder_sparse_step=1,
                mlp_only_layers=[], norm_topk_prob=True,
            )  # fmt: skip
        if family == "qwen3_next":
            text.update(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"],
                        partial_rotary_factor=0.25, torch_dtype=dtype)  # fmt: skip
        else:
            text["model_type"] = family + "_text"
            text["rope_parameters"] = dict(
                rope_type="default", rope_theta=text.pop("rope_theta"),
                partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
                mrope_interleaved=True,
            )  # fmt: skip
            arch = "Qwen3_5MoeForConditionalGeneration" if "moe" in family else None
            arch = arch or "Qwen3_5ForConditionalGeneration"
            top = dict(model_type=family, architectures=[arch])
    elif family == "llama_sliding":
        text.update(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
                    attention_bias=False, mlp_bias=False, torch_dtype=dtype)  # fmt: skip
    elif family == "gemma3_text":
        text.update(
            model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
            hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=text["head_dim"],
            rope_local_base_freq=10000.0, sliding_window_pattern=2, torch_dtype=dtype,
            final_logit_softcapping=None, attn_logit_softcapping=None,
        )  # fmt: skip
    elif family == "gemma4":
        text.update(
            model_type="gemma4_text", hidden_activation="gelu_pytorch_tanh",
            global_head_dim=2 * text["head_dim"], num_global_key_value_heads=None,
            num_kv_shared_layers=0, hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=TINY_VOCAB, attention_k_eq_v=False,
            use_double_wide_mlp=False, enable_moe_block=False,
            final_logit_softcapping=30.0, sliding_window_pattern=2,
            rope_parameters={
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                   "rope_type": "proportional"},
                "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0,
                                      "rope_type": "default"},
            },
        )  # fmt: skip
        text.pop("rope_theta")
        top = dict(model_type="gemma4", architectures=["Gemma4ForConditionalGeneration"])
    elif family == "gpt_oss":
        text.update(
            model_type="gpt_oss", architectures=["GptOssForCausalLM"], torch_dtype=dtype,
            num_local_experts=4, num_experts_per_tok=2, experts_per_token=2,
            intermediate_size=64, attention_bias=True, swiglu_limit=7.0,
            rope_theta=150000.0, initial_context_length=4096, hidden_act="silu",
            rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                          "beta_slow": 1.0, "truncate": False,
                          "original_max_position_embeddings": 4096},
        )  # fmt: skip
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
    top.update(text_config=text, vocab_size=text["vocab_size"], torch_dtype=dtype,
               tie_word_embeddings=text["tie_word_embeddings"], **ids)  # fmt: skip
    return top


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
        family, dtype=dtype, num_layers=num_layers, hidden_size=hidden_size,
        tie_word_embeddings=tie_word_embeddings, add_bos=add_bos,
        sliding_window=sliding_window, **overrides,
    )  # fmt: skip
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
            model, config = quantize_model(
                model, config, quantize_group_size, quantize_bits, mode=quantize_mode
            )
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
        "input_layernorm": (h,), "post_attention_layernorm": (h,),
        "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter),
        "self_attn.q_proj": (nh * hd, h), "self_attn.k_proj": (nkv * hd, h),
        "self_attn.v_proj": (nkv * hd, h), "self_attn.o_proj": (h, nh * hd),
        "self_attn.q_norm": (hd,), "self_attn.k_norm": (hd,),
    }  # fmt: skip
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
    optional = dict(input_embedding_scale=input_embedding_scale,
                    output_multiplier=output_multiplier,
                    final_logit_softcapping=final_logit_softcapping)  # fmt: skip
    dflash.update({k: v for k, v in optional.items() if v is not None})
    config = dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=h,
        num_hidden_layers=num_layers, num_attention_heads=tcfg["num_attention_heads"],
        num_key_value_heads=tcfg["num_key_value_heads"],
        head_dim=tcfg.get("head_dim") or h // tcfg["num_attention_heads"],
        intermediate_size=tcfg["intermediate_size"], vocab_size=tcfg["vocab_size"],
        rms_norm_eps=tcfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=tcfg.get("max_position_embeddings", 4096),
        num_target_layers=n_target,
        tie_word_embeddings=bool(tcfg.get("tie_word_embeddings", False)),
        attention_bias=False, hidden_act="silu", torch_dtype=dtype,
    )  # fmt: skip
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
    _write_json(out_dir / "config.json", config)
    return out_dir


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
    shapes.update({
        "candidate_selector.hidden_projection.weight": (r, h),
        "candidate_selector.predecessor_codebook": (v, r),
        "candidate_selector.successor_codebook": (v, r),
    })  # fmt: skip
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
        out_dir, target_dir, num_layers=num_layers, target_layer_ids=target_layer_ids,
        block_size=block_size, schema="nested", seed=seed, dtype=dtype,
        layer_types=["sliding_attention"] * num_layers, sliding_window=sliding_window,
        is_causal=False, output_multiplier=output_multiplier,
        final_logit_softcapping=final_logit_softcapping,
    )  # fmt: skip
    with open(out_dir / "config.json") as f:
        config = json.load(f)
    config["architectures"] = ["DFlash2DraftModel"]
    config["rope_theta"] = rope_theta
    config["dflash_config"].update(
        conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
        selector_rank=selector_rank, selector_top_k=selector_top_k,
    )  # fmt: skip

    mdt = _mx_dtype(dtype)
    weights = dict(mx.load(str(out_dir / "model.safetensors")))
    for name, shape in draft2_weight_shapes(config).items():
        weights[name] = mx.array(_draft2_init(seed, name, shape)).astype(mdt)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "pt"})

    config.update(config_overrides)
    _write_json(out_dir / "config.json", config)
    return out_dir


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
