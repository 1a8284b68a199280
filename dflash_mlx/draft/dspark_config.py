"""Parsing a DSpark drafter's config.json, in every packaging published, into one `DSparkConfig`.

DSpark (DeepSpec, arXiv 2607.05147) is DFlash's drafter plus a low-rank Markov
head (the previous token's bias on each block row's logits) and a confidence
head. The same drafter ships in four packagings, told apart by their config:

- DeepSpec's own: the drafter's fields at the top level (`block_size`,
  `mask_token_id`, `target_layer_ids`, `markov_rank`, ...);
- vLLM speculators (`speculators_config` / `speculators_model_type`): the
  backbone nested in `transformer_layer_config`, the taps in
  `aux_hidden_state_layer_ids`, the proposal width in
  `proposal_methods[0].speculative_tokens`, optionally `draft_vocab_size`
  (a `d2t` table in the weights maps draft ids to target ids);
- SpecForge: a `dflash_config` tagged `projector_type: "dspark"`;
- Liquid's: an untagged `dflash_config` holding the taps, with "DSpark" in
  `architectures`.

Backbones: qwen3; qwen3_5-flavoured (gated `q_proj`, norm weights stored as
offsets from one, partial rotary); gemma4 (`k_eq_v`, `v_norm`, sandwich norms,
a logit softcap). Which block slot holds the first prediction
(`logits_start`) is derived as the reference (mlx-dspark 0.20.3) derives it:
0 means slot 0 (the anchor) predicts the first draft, 1 that it is a pure
anchor. Anything this package does not run is refused here, naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .config import DraftConfigError

PACKAGINGS = ("deepspec", "speculators", "specforge", "liquid")
BACKBONES = ("qwen3", "qwen3_5", "gemma4")
MARKOV_HEADS = ("vanilla",)
REQUIRED = (
    "hidden_size",
    "vocab_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "block_size",
    "mask_token_id",
    "target_layer_ids",
)
# DeepSpec fields that say a top-level config is a DSpark drafter
DSPARK_MARKERS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
UNSUPPORTED = {
    "log_snr_conditioning": "GIDD log-SNR conditioned drafters (PrismML Bonsai) are not supported",
}


class DSparkConfigError(DraftConfigError):
    """A DSpark drafter's config.json is missing a field, holds a bad value or asks for something unsupported."""


@dataclass(frozen=True)
class DSparkConfig:
    packaging: str
    backbone: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # the drafter attention's head width (gemma4: its global_head_dim)
    vocab_size: int  # the target's vocabulary (the Markov head's previous tokens, the embedding)
    rms_norm_eps: float
    block_size: int  # the checkpoint's block: slots the backbone runs, anchor included
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    logits_start: int = 0  # the first slot whose logits are a draft (0: the anchor's slot predicts)
    num_target_layers: int | None = None
    draft_vocab_size: int | None = None  # a reduced head's width (with a `d2t` table)
    attention_bias: bool = False
    k_eq_v: bool = False  # gemma4: keys and values from one projection
    v_norm: bool = False  # gemma4: values RMS-normed without a scale
    gated_q: bool = False  # qwen3_5: q_proj emits [q, gate] per head
    offset_norms: bool = False  # qwen3_5: norm weights stored as offsets from one
    sandwich_norms: bool = False  # gemma4: pre/post feed-forward norms and a layer scalar
    activation: str = "silu"  # or "gelu_approx" (gemma4)
    rope_theta: float = 1_000_000.0
    rope_dims: int | None = None  # rotated dims (None: the whole head)
    rope_traditional: bool = False
    rope_scaling: dict | None = None  # mlx-lm's initialize_rope scaling_config
    attention_scale: float | None = None  # None: head_dim ** -0.5
    embed_scale: float = 1.0  # gemma4: sqrt(hidden_size)
    final_logit_softcapping: float | None = None
    causal: bool = False  # the block attends causally (DFlash-lineage heads)
    sliding_window: int | None = None
    attention_sink: bool = False  # a learned per-head sink logit
    markov_rank: int = 256
    confidence_head: bool = True
    confidence_with_markov: bool = True

    @property
    def max_drafts(self) -> int:
        """The most drafts one block gives (its slots past `logits_start`)."""
        return self.block_size - self.logits_start

    @property
    def out_vocab_size(self) -> int:
        """Width of the head and the Markov bias: the draft vocabulary."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale

    def layer_is_sliding(self, layer: int) -> bool:
        return self.sliding_window is not None

    def layer_is_causal(self, layer: int) -> bool:
        return self.causal


def is_dspark_config(raw: dict[str, Any]) -> bool:
    """Whether a config.json describes a DSpark drafter (in any packaging) rather than a DFlash one."""
    if "speculators_config" in raw or "speculators_model_type" in raw:
        return True
    nested = raw.get("dflash_config")
    if isinstance(nested, dict) and nested.get("projector_type") == "dspark":
        return True
    if any("dspark" in str(a).lower() for a in raw.get("architectures") or []):
        return True
    return any(k in raw for k in DSPARK_MARKERS) or any(k.startswith("dspark_") for k in raw)


def parse_dspark_config(raw: dict[str, Any], source: str = "config.json") -> DSparkConfig:
    """A validated `DSparkConfig` for a DSpark config.json of any packaging."""
    if not isinstance(raw, dict):
        raise DSparkConfigError(f"{source}: config.json must hold a JSON object.")
    flat, packaging = _deepspec_schema(dict(raw), source)
    for key, why in UNSUPPORTED.items():
        if flat.get(key):
            raise DSparkConfigError(f"{source}: '{key}' is set: {why}.")
    model_type = str(flat.get("model_type") or "")
    missing = [k for k in REQUIRED if k not in flat]
    if missing:
        raise DSparkConfigError(f"{source}: a DSpark drafter's config needs {missing} (packaging '{packaging}').")
    if "gemma4" in model_type:
        fields = _gemma4_fields(flat, source)
    elif "qwen3" in model_type:
        fields = _qwen3_fields(flat, packaging, source)
    else:
        raise DSparkConfigError(
            f"{source}: 'model_type' is {model_type!r}; the DSpark backbones that run here: qwen3, qwen3_5, "
            "gemma4 (gemma4_text)."
        )
    return _finish(flat, packaging, fields, source)


# -- packagings ---------------------------------------------------------------------------------


def _deepspec_schema(c: dict, source: str) -> tuple[dict, str]:
    """The config in DeepSpec's own field names, and its packaging."""
    if "speculators_config" in c or "speculators_model_type" in c:
        return _from_speculators(c, source), "speculators"
    if "block_size" not in c and any(k.startswith("dspark_") for k in c):
        raise DSparkConfigError(
            f"{source}: this is a target model with an embedded DSpark drafter (dspark_* fields), not a "
            "standalone drafter checkpoint."
        )
    nested = c.get("dflash_config") or {}
    if not isinstance(nested, dict):
        raise DSparkConfigError(f"{source}: 'dflash_config' must be an object.")
    architectures = " ".join(str(a) for a in c.get("architectures") or [])
    packaging = "deepspec"
    if nested.get("projector_type") == "dspark":
        packaging, hoisted = "specforge", ("target_layer_ids", "mask_token_id")
    elif "DSpark" in architectures and "target_layer_ids" not in c and nested.get("target_layer_ids") is not None:
        packaging, hoisted = "liquid", ("target_layer_ids", "mask_token_id", "num_target_layers")
    else:
        hoisted = ()
    for key in hoisted:
        if key not in c and nested.get(key) is not None:
            c[key] = nested[key]
    if hoisted:
        c.setdefault("logits_start", 0)
    if c.get("draft_vocab_size") is not None and c.get("draft_vocab_size") == c.get("vocab_size"):
        c["draft_vocab_size"] = None
    return c, packaging


def _from_speculators(c: dict, source: str) -> dict:
    """vLLM speculators' schema renamed to DeepSpec's (the tensor names are already DeepSpec's)."""
    spec = c.get("speculators_config") or {}
    algorithm = c.get("speculators_model_type") or spec.get("algorithm")
    if algorithm != "dspark":
        raise DSparkConfigError(
            f"{source}: 'speculators_model_type' is {algorithm!r}: only speculators 'dspark' drafters are read as "
            "DSpark drafters."
        )
    layer = c.get("transformer_layer_config")
    taps = c.get("aux_hidden_state_layer_ids")
    for key, value in (("transformer_layer_config", layer), ("aux_hidden_state_layer_ids", taps)):
        if not value:
            raise DSparkConfigError(f"{source}: a speculators 'dspark' config needs '{key}'.")
    if not isinstance(layer, dict):
        raise DSparkConfigError(f"{source}: 'transformer_layer_config' must be an object.")
    absent = [k for k in REQUIRED[:5] if k not in layer]
    if absent:
        raise DSparkConfigError(f"{source}: 'transformer_layer_config' lacks {absent}.")
    heads, vocab = layer["num_attention_heads"], layer["vocab_size"]
    draft_vocab = c.get("draft_vocab_size")
    rope = dict(layer.get("rope_parameters") or {})
    if "rope_theta" not in rope and "rope_theta" in layer:
        rope["rope_theta"] = layer["rope_theta"]
    out = {k: layer[k] for k in REQUIRED[:5]}
    out.update(
        model_type=layer.get("model_type", "qwen3"),
        draft_vocab_size=draft_vocab if draft_vocab and draft_vocab != vocab else None,
        num_key_value_heads=layer.get("num_key_value_heads", heads),
        head_dim=layer.get("head_dim", layer["hidden_size"] // heads),
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        attention_bias=layer.get("attention_bias", False),
        rope_parameters=rope,
        target_layer_ids=list(taps),
    )
    for key in (
        "block_size",
        "mask_token_id",
        *DSPARK_MARKERS,
        "final_logit_softcapping",
        "logits_start",
    ):
        if key in c:
            out[key] = c[key]
    types = layer.get("layer_types") or []
    if "sliding_attention" in types and layer.get("use_sliding_window") and layer.get("sliding_window"):
        out["sliding_window"] = int(layer["sliding_window"])
        out["dflash_query_causal"] = not bool(c.get("sliding_window_non_causal", False))
    if c.get("attention_sink_bias"):
        out["attention_sink_bias"] = True
    if "logits_start" not in out:
        out["logits_start"] = _speculators_logits_start(c, out.get("block_size"))
    return out


def _speculators_logits_start(c: dict, block: Any) -> int:
    """A speculators head's first predicting slot: the block minus its declared proposal width (a head that
    reserves the anchor slot proposes block - 1), else `sample_from_anchor` where given, else 1 (the heads
    that predate that field reserve the anchor)."""
    methods = (c.get("speculators_config") or {}).get("proposal_methods") or []
    tokens = methods[0].get("speculative_tokens") if methods and isinstance(methods[0], dict) else None
    if isinstance(tokens, int) and isinstance(block, int) and tokens and 0 <= block - tokens < block:
        return block - tokens
    if isinstance(c.get("sample_from_anchor"), bool):
        return 0 if c["sample_from_anchor"] else 1
    return 1


# -- backbones ----------------------------------------------------------------------------------


def _qwen3_fields(c: dict, packaging: str, source: str) -> dict:
    rope = c.get("rope_parameters") or {}
    head_dim = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    gated = bool(c.get("enable_qwen35_gated_q_proj", False))
    offset = c.get("model_type") == "qwen3_5"
    # partial rotary only on the qwen3_5-native heads: elsewhere the field is the target's, copied into the
    # drafter's config, and the drafter ropes its whole head
    rope_dims = int(head_dim * float(rope.get("partial_rotary_factor", 1.0))) if gated or offset else head_dim
    nested = c.get("dflash_config") or {}
    causal = bool(c.get("dflash_query_causal", False) or nested.get("causal", False))
    sink = bool(c.get("attention_sink_bias", False))
    window = None
    if causal or sink or nested:
        window = c.get("sliding_window") or (nested.get("swa_window_size") if nested.get("use_swa") else None)
    scaling = None
    if packaging == "specforge" and rope.get("rope_type") == "yarn" and rope.get("factor"):
        scaling = {"rope_type": "yarn", "factor": float(rope["factor"])}
        for key in ("beta_fast", "beta_slow"):
            if key in rope:
                scaling[key] = float(rope[key])
        if "original_max_position_embeddings" in rope:
            scaling["original_max_position_embeddings"] = int(rope["original_max_position_embeddings"])
    if "logits_start" in c:
        start = c["logits_start"]
    elif "sample_from_anchor" in c:
        start = 0 if c["sample_from_anchor"] else 1
    else:
        start = 0
    return dict(
        backbone="qwen3_5" if gated or offset else "qwen3",
        head_dim=head_dim,
        num_key_value_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
        gated_q=gated,
        offset_norms=offset,
        rope_theta=rope.get("rope_theta", c.get("rope_theta", 1_000_000.0)),
        rope_dims=rope_dims if rope_dims != head_dim else None,
        rope_traditional=not bool(c["rope_is_neox_style"]) if "rope_is_neox_style" in c else False,
        rope_scaling=scaling,
        causal=causal,
        sliding_window=_window(window, source),
        attention_sink=sink,
        final_logit_softcapping=c.get("final_logit_softcapping"),
        logits_start=start,
    )


def _gemma4_fields(c: dict, source: str) -> dict:
    rope = (c.get("rope_parameters") or {}).get("full_attention") or {}
    k_eq_v = bool(c.get("attention_k_eq_v", True))
    heads = c.get("num_global_key_value_heads", 1) if k_eq_v else c.get("num_key_value_heads", 8)
    return dict(
        backbone="gemma4",
        head_dim=int(c.get("global_head_dim", 512)),
        num_key_value_heads=heads,
        k_eq_v=k_eq_v,
        v_norm=True,
        sandwich_norms=True,
        activation="gelu_approx",
        rope_theta=rope.get("rope_theta", 1_000_000.0),
        rope_scaling={
            "rope_type": rope.get("rope_type", "proportional"),
            "partial_rotary_factor": rope.get("partial_rotary_factor", 0.25),
        },
        attention_scale=1.0,
        embed_scale=math.sqrt(float(c["hidden_size"])),
        final_logit_softcapping=c.get("final_logit_softcapping", 30.0),
        logits_start=c.get("logits_start", 0),
    )


def _window(value: Any, source: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise DSparkConfigError(f"{source}: 'sliding_window' must be an integer >= 2, got {value!r}.")
    return value


# -- checks -------------------------------------------------------------------------------------


def _finish(c: dict, packaging: str, fields: dict, source: str) -> DSparkConfig:
    def integer(name: str, value: Any, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise DSparkConfigError(f"{source}: '{name}' must be an integer >= {minimum}, got {value!r}.")
        return value

    markov = c.get("markov_head_type", "vanilla")
    if markov not in MARKOV_HEADS:
        raise DSparkConfigError(
            f"{source}: 'markov_head_type' is {markov!r}; the Markov heads run here: {', '.join(MARKOV_HEADS)}."
        )
    vocab = integer("vocab_size", c["vocab_size"], 1)
    block = integer("block_size", c["block_size"], 1)
    start = integer("logits_start", fields.pop("logits_start"), 0)
    if start >= block:
        raise DSparkConfigError(f"{source}: 'logits_start' is {start}, but the block has {block} slots.")
    ids = c["target_layer_ids"]
    if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise DSparkConfigError(f"{source}: 'target_layer_ids' must be a non-empty list of layer indices >= 0.")
    mask = integer("mask_token_id", c["mask_token_id"], 0)
    if mask >= vocab:
        raise DSparkConfigError(f"{source}: 'mask_token_id' {mask} is outside the vocabulary ({vocab}).")
    draft_vocab = c.get("draft_vocab_size")
    if draft_vocab is not None:
        draft_vocab = integer("draft_vocab_size", draft_vocab, 1)
    softcap = fields.pop("final_logit_softcapping")
    return DSparkConfig(
        packaging=packaging,
        hidden_size=integer("hidden_size", c["hidden_size"], 1),
        num_hidden_layers=integer("num_hidden_layers", c["num_hidden_layers"], 1),
        intermediate_size=integer("intermediate_size", c["intermediate_size"], 1),
        num_attention_heads=integer("num_attention_heads", c["num_attention_heads"], 1),
        vocab_size=vocab,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        block_size=block,
        mask_token_id=mask,
        target_layer_ids=tuple(ids),
        logits_start=start,
        num_target_layers=c.get("num_target_layers") if packaging != "speculators" else None,
        draft_vocab_size=draft_vocab,
        attention_bias=bool(c.get("attention_bias", False)),
        final_logit_softcapping=float(softcap) if softcap else None,
        markov_rank=integer("markov_rank", c.get("markov_rank", 256), 0),
        confidence_head=bool(c.get("enable_confidence_head", True)),
        confidence_with_markov=bool(c.get("confidence_head_with_markov", True)),
        **fields,
    )
