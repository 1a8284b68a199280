"""Parsing a DFlash draft checkpoint's config.json into one typed `DraftConfig`.

Both schemas seen in real checkpoints are accepted: `block_size` inside
`dflash_config` or at the top level, `rope_theta` at the top level or inside
`rope_parameters` (transformers 5 style), scaling in `rope_scaling` or
`rope_parameters`. Every problem raises `DraftConfigError` naming the file and
the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

V1_ARCHITECTURE = "DFlashDraftModel"
V2_ARCHITECTURE = "DFlash2DraftModel"
LAYER_TYPES = ("full_attention", "sliding_attention")
DEFAULT_BLOCK_SIZE = 16
DEFAULT_ROPE_THETA = 10000.0


class DraftConfigError(ValueError):
    """A draft checkpoint's config.json is missing a field or holds a bad value."""


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    block_size: int = DEFAULT_BLOCK_SIZE
    num_target_layers: int | None = None
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    is_causal: bool | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    architecture: str = V1_ARCHITECTURE
    # DFlash 2 only (0 when absent).
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @property
    def is_dflash2(self) -> bool:
        return self.architecture == V2_ARCHITECTURE

    def layer_is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    def layer_is_causal(self, layer: int) -> bool:
        """Causal inside the block: forced by `is_causal`, else iff the layer slides."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_is_sliding(layer)


def derive_target_layer_ids(num_draft_layers: int, num_target_layers: int) -> tuple[int, ...]:
    """Upstream's rule when a config gives no ids: spread from layer 1 to layer N-3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    last = max(num_target_layers - 1, 0)
    return tuple(min(max(int(round(1 + i * span / (num_draft_layers - 1))), 0), last) for i in range(num_draft_layers))


def read_raw_config(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """(config.json's path, its JSON object) for `<dir>/config.json` or a config.json path."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise DraftConfigError(f"{file}: no config.json found for the draft model.")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise DraftConfigError(f"{file}: config.json is not valid JSON ({e}).") from e
    if not isinstance(raw, dict):
        raise DraftConfigError(f"{file}: config.json must hold a JSON object.")
    return file, raw


def read_draft_config(path: str | Path) -> DraftConfig:
    """Read and parse `<dir>/config.json` (or a config.json path)."""
    file, raw = read_raw_config(path)
    return parse_draft_config(raw, source=str(file))


def parse_draft_config(raw: dict[str, Any], source: str = "config.json") -> DraftConfig:
    """Turn a draft config dict into a validated `DraftConfig`."""
    fields = _Fields(raw, source)
    dflash = raw.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise DraftConfigError(f"{source}: 'dflash_config' must be an object.")

    architectures = raw.get("architectures") or [V1_ARCHITECTURE]
    known = [a for a in architectures if a in (V1_ARCHITECTURE, V2_ARCHITECTURE)]
    if not known:
        raise DraftConfigError(
            f"{source}: 'architectures' is {architectures}; expected ['{V1_ARCHITECTURE}'] or ['{V2_ARCHITECTURE}']."
        )

    num_layers = fields.int("num_hidden_layers", minimum=1)
    hidden = fields.int("hidden_size", minimum=1)
    heads = fields.int("num_attention_heads", minimum=1)
    rope = raw.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_scaling = raw.get("rope_scaling") or (rope if rope_type != "default" else None)
    rope_theta = raw.get("rope_theta", rope.get("rope_theta", DEFAULT_ROPE_THETA))

    if "mask_token_id" not in dflash:
        raise DraftConfigError(f"{source}: 'dflash_config.mask_token_id' is required.")
    ids = dflash.get("target_layer_ids")
    if ids is None:
        if raw.get("num_target_layers") is None:
            raise DraftConfigError(
                f"{source}: 'dflash_config.target_layer_ids' is missing and there is no "
                "'num_target_layers' to derive it from."
            )
        ids = derive_target_layer_ids(num_layers, int(raw["num_target_layers"]))
    if (
        not isinstance(ids, (list, tuple))
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
    ):
        raise DraftConfigError(
            f"{source}: 'dflash_config.target_layer_ids' must be a non-empty list of layer indices >= 0, got {ids!r}."
        )

    layer_types = tuple(raw.get("layer_types") or ("full_attention",) * num_layers)
    if len(layer_types) != num_layers:
        raise DraftConfigError(
            f"{source}: 'layer_types' has {len(layer_types)} entries but 'num_hidden_layers' is {num_layers}."
        )
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise DraftConfigError(f"{source}: 'layer_types' holds {unknown}; expected only {list(LAYER_TYPES)}.")
    sliding_window = raw.get("sliding_window")
    if "sliding_attention" in layer_types:
        if not isinstance(sliding_window, int) or sliding_window < 2:
            raise DraftConfigError(
                f"{source}: 'sliding_window' must be an integer >= 2 when a layer is "
                f"'sliding_attention', got {sliding_window!r}."
            )

    block_size = dflash.get("block_size", raw.get("block_size", DEFAULT_BLOCK_SIZE))
    if not isinstance(block_size, int) or block_size < 1:
        raise DraftConfigError(f"{source}: 'block_size' must be an integer >= 1, got {block_size!r}.")
    is_causal = raw.get("is_causal")
    if is_causal is not None and not isinstance(is_causal, bool):
        raise DraftConfigError(f"{source}: 'is_causal' must be true, false or null, got {is_causal!r}.")
    softcap = dflash.get("final_logit_softcapping", raw.get("final_logit_softcapping"))

    vocab = fields.int("vocab_size", minimum=1)
    mask_id = _int(dflash["mask_token_id"], "dflash_config.mask_token_id", source)
    if mask_id >= vocab:
        raise DraftConfigError(
            f"{source}: 'dflash_config.mask_token_id' is {mask_id}, outside the draft's "
            f"vocabulary of {vocab} ('vocab_size')."
        )
    head_dim = raw.get("head_dim") or hidden // heads
    return DraftConfig(
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=fields.int("num_key_value_heads", default=heads, minimum=1),
        head_dim=int(head_dim),
        intermediate_size=fields.int("intermediate_size", minimum=1),
        vocab_size=vocab,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=fields.int("max_position_embeddings", default=32768),
        mask_token_id=mask_id,
        target_layer_ids=tuple(ids),
        block_size=block_size,
        num_target_layers=raw.get("num_target_layers"),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        layer_types=layer_types,
        sliding_window=sliding_window,
        is_causal=is_causal,
        input_embedding_scale=float(dflash.get("input_embedding_scale", 1.0)),
        output_multiplier=float(dflash.get("output_multiplier", 1.0)),
        final_logit_softcapping=float(softcap) if softcap else None,
        architecture=known[0],
        conv_kernel_size=int(dflash.get("conv_kernel_size", 0)),
        conv_group_size=int(dflash.get("conv_group_size", 0)),
        selector_rank=int(dflash.get("selector_rank", 0)),
        selector_top_k=int(dflash.get("selector_top_k", 0)),
    )


def _int(value: Any, name: str, source: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DraftConfigError(f"{source}: '{name}' must be an integer >= {minimum}, got {value!r}.")
    return value


class _Fields:
    """Typed access to required and optional integer fields of one config."""

    def __init__(self, raw: dict[str, Any], source: str):
        self.raw, self.source = raw, source

    def int(self, name: str, default: int | None = None, minimum: int = 0) -> int:
        if name not in self.raw or self.raw[name] is None:
            if default is None:
                raise DraftConfigError(f"{self.source}: '{name}' is required.")
            return default
        return _int(self.raw[name], name, self.source, minimum)
