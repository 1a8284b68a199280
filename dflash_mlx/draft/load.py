"""Loading a DFlash (v1 or v2) drafter: local directory or Hugging Face repo, weights, quantization.

`load_draft` reads config.json + *.safetensors (nothing else is downloaded),
checks the tensor names and shapes against the modules the config describes,
optionally quantizes the drafter, and, given the target, checks the pair.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..models.registry import is_repo_id
from .config import DraftConfig, DraftConfigError, read_draft_config
from .dflash2 import DFlash2DraftModel
from .model import DFlashDraftModel
from .pairing import check_pair

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
# Early checkpoints carry copies of the target's embedding/head: the target's are used.
IGNORED_KEYS = ("embed_tokens.weight", "lm_head.weight")


class DraftWeightsError(ValueError):
    """A draft checkpoint's safetensors do not match its config."""


def resolve_model_dir(
    path_or_repo: str | Path, what: str = "draft model", allow_patterns: list[str] | None = None
) -> Path:
    """A local directory as is; otherwise a Hugging Face repo id, downloaded (the files matching
    `allow_patterns`, by default json + safetensors)."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"The {what} path {path} is not a directory.")
        return path
    repo = str(path_or_repo)
    if not is_repo_id(repo):
        raise FileNotFoundError(
            f"The {what} '{repo}' is neither an existing directory nor a Hugging Face repo id of the form 'org/name'."
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, allow_patterns=allow_patterns or ["*.json", "*.safetensors"]))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        raise FileNotFoundError(f"Could not download the {what} '{repo}' from Hugging Face: {e}") from e


def read_weights(model_dir: Path) -> dict[str, mx.array]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise DraftWeightsError(f"{model_dir}: no *.safetensors files in the draft model directory.")
    weights: dict[str, mx.array] = {}
    for file in files:
        try:
            weights.update(mx.load(str(file)))
        except (RuntimeError, ValueError, OSError) as e:  # what MLX raises for unreadable files
            raise DraftWeightsError(f"{file}: cannot read the safetensors file ({e}).") from e
    return {k: v for k, v in weights.items() if k not in IGNORED_KEYS}


def build_draft(config: DraftConfig, weights: dict[str, mx.array], source: str) -> DFlashDraftModel:
    """Instantiate the drafter for `config` and load `weights`, checking names and shapes."""
    if config.is_dflash2:
        missing = [
            f
            for f in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
            if getattr(config, f) <= 0
        ]
        if missing:
            raise DraftConfigError(
                f"{source}: a DFlash2DraftModel needs dflash_config fields {missing} (positive integers)."
            )
        weights = dict(weights)
        for name in CODEBOOKS:  # stored as bare tables, without the `.weight` suffix
            if name in weights:
                weights[name + ".weight"] = weights.pop(name)
    model = (DFlash2DraftModel if config.is_dflash2 else DFlashDraftModel)(config)
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {_few(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors {_few(unexpected)}")
        raise DraftWeightsError(
            f"{source}: the weights do not match a {config.architecture} with "
            f"{config.num_hidden_layers} layers: {'; '.join(parts)}."
        )
    for key, value in weights.items():
        if value.shape != expected[key].shape:
            raise DraftWeightsError(
                f"{source}: tensor '{key}' has shape {tuple(value.shape)}, the config implies "
                f"{tuple(expected[key].shape)}."
            )
    model.load_weights(list(weights.items()))
    model.eval()
    return model


def quantize_draft(model: DFlashDraftModel, bits: int, group_size: int = 64) -> None:
    """Quantize every linear layer whose input width is a multiple of `group_size`."""
    if bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"Draft quantization bits must be one of 2, 3, 4, 5, 6, 8, got {bits}.")
    nn.quantize(
        model,
        group_size=group_size,
        bits=bits,
        class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % group_size == 0,
    )


def load_draft(
    path_or_repo: str | Path,
    target_model: nn.Module | None = None,
    *,
    bits: int | None = None,
    group_size: int = 64,
    dtype: mx.Dtype | None = None,
    target_name: str | None = None,
) -> DFlashDraftModel:
    """Load a DFlash drafter; with `target_model`, check that the two fit together.

    `bits`/`group_size` quantize the drafter's linear layers after loading;
    `dtype` casts its floating-point weights (e.g. mx.float32 on a CPU).
    """
    model_dir = resolve_model_dir(path_or_repo)
    config = read_draft_config(model_dir)
    model = build_draft(config, read_weights(model_dir), str(model_dir))
    if dtype is not None:
        model.set_dtype(dtype)
    if bits is not None:
        quantize_draft(model, bits, group_size)
    mx.eval(model.parameters())
    model.source = str(path_or_repo)
    if target_model is not None:
        check_pair(model, target_model, draft_name=str(path_or_repo), target_name=target_name)
    return model


def _few(keys: list[str], limit: int = 6) -> str:
    shown = ", ".join(keys[:limit])
    return f"[{shown}{', ...' if len(keys) > limit else ''}] ({len(keys)} in all)"
