"""Loading a drafter: DFlash (v1 or v2) or DSpark, from a local directory or a Hugging Face repo.

`load_draft` reads config.json + *.safetensors (nothing else is downloaded),
tells a DSpark config (any packaging, `draft.dspark_config`) from a DFlash
one, checks the tensor names and shapes against the modules the config
describes, optionally quantizes the drafter, and, given the target, checks the
pair. A DSpark checkpoint without `embed_tokens.weight` or `lm_head.weight`
uses the target's; a reduced draft vocabulary needs its `d2t` table.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..models.registry import is_repo_id

from .config import DraftConfig, DraftConfigError, parse_draft_config, read_raw_config
from .dflash2 import DFlash2DraftModel
from .dspark import DSparkDraftModel
from .dspark_config import DSparkConfig, is_dspark_config, parse_dspark_config
from .model import DFlashDraftModel
from .pairing import check_pair

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
# Early checkpoints carry copies of the target's embedding/head: the target's are used.
IGNORED_KEYS = ("embed_tokens.weight", "lm_head.weight")


DRAFTERS = (DFlashDraftModel, DSparkDraftModel)  # what `load_draft` returns


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


def read_safetensors(model_dir: Path) -> dict[str, mx.array]:
    """Every tensor of the directory's *.safetensors files."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise DraftWeightsError(f"{model_dir}: no *.safetensors files in the draft model directory.")
    weights: dict[str, mx.array] = {}
    for file in files:
        try:
            weights.update(mx.load(str(file)))
        except (RuntimeError, ValueError, OSError) as e:  # what MLX raises for unreadable files
            raise DraftWeightsError(f"{file}: cannot read the safetensors file ({e}).") from e
    return weights


def read_weights(model_dir: Path) -> dict[str, mx.array]:
    """A DFlash drafter's tensors (copies of the target's embedding and head left out)."""
    return {k: v for k, v in read_safetensors(model_dir).items() if k not in IGNORED_KEYS}


def load_checked(model: nn.Module, weights: dict[str, mx.array], source: str, what: str) -> None:
    """Load `weights` into `model`, refusing missing, unexpected or misshapen tensors (`what` names the model)."""
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {_few(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors {_few(unexpected)}")
        raise DraftWeightsError(f"{source}: the weights do not match {what}: {'; '.join(parts)}.")
    for key, value in weights.items():
        if value.shape != expected[key].shape:
            raise DraftWeightsError(
                f"{source}: tensor '{key}' has shape {tuple(value.shape)}, the config implies "
                f"{tuple(expected[key].shape)}."
            )
    model.load_weights(list(weights.items()))
    model.eval()


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
    load_checked(model, weights, source, f"a {config.architecture} with {config.num_hidden_layers} layers")
    return model


def build_dspark(config: DSparkConfig, weights: dict[str, mx.array], source: str) -> DSparkDraftModel:
    """A DSpark drafter for `config` with `weights`: its own embedding and head where the checkpoint has them
    (else the target's), a reduced vocabulary's `d2t` table, qwen3_5's offset norms made plain."""
    weights = dict(weights)
    d2t = weights.pop("d2t", None)
    weights.pop("t2d", None)  # the target-side membership mask: only trainers need it
    if config.draft_vocab_size and d2t is None:
        raise DraftWeightsError(
            f"{source}: the config declares draft_vocab_size {config.draft_vocab_size} but the weights have no "
            "'d2t' table mapping draft ids to target ids."
        )
    if d2t is not None and not config.draft_vocab_size:
        raise DraftWeightsError(
            f"{source}: the weights have a 'd2t' table but the config declares no draft_vocab_size."
        )
    own_head = "lm_head.weight" in weights
    if config.draft_vocab_size and not own_head:
        raise DraftWeightsError(
            f"{source}: a reduced draft vocabulary (draft_vocab_size {config.draft_vocab_size}) needs the "
            "drafter's own lm_head.weight, which the weights lack."
        )
    model = DSparkDraftModel(config, own_embedding="embed_tokens.weight" in weights, own_head=own_head)
    what = f"a {config.backbone} DSpark drafter ({config.packaging} packaging) with {config.num_hidden_layers} layers"
    load_checked(model, weights, source, what)
    if config.offset_norms:  # stored as offsets from one
        for _, module in model.named_modules():
            if isinstance(module, nn.RMSNorm):
                module.weight = module.weight + 1.0
    if d2t is not None:
        try:
            model.set_draft_map(np.array(d2t))
        except ValueError as e:
            raise DraftWeightsError(f"{source}: {e}.") from e
    return model


def read_drafter(model_dir: Path):
    """The drafter a directory holds, DFlash or DSpark (told apart by its config.json)."""
    file, raw = read_raw_config(model_dir)
    if is_dspark_config(raw):
        return build_dspark(parse_dspark_config(raw, source=str(file)), read_safetensors(model_dir), str(model_dir))
    return build_draft(parse_draft_config(raw, source=str(file)), read_weights(model_dir), str(model_dir))


def quantize_draft(model: nn.Module, bits: int, group_size: int = 64) -> None:
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
) -> DFlashDraftModel | DSparkDraftModel:
    """Load a DFlash or DSpark drafter; with `target_model`, check that the two fit together.

    `bits`/`group_size` quantize the drafter's linear layers after loading;
    `dtype` casts its floating-point weights (e.g. mx.float32 on a CPU).
    """
    model_dir = resolve_model_dir(path_or_repo)
    model = read_drafter(model_dir)
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
