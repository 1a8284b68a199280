"""Reading a target's MTP heads from its own safetensors, which mlx-lm's loader leaves out of the model.

mlx-lm 0.32 drops each family's MTP tensors in `sanitize`; the files keep
them, under the names `layouts` gives. `load_mtp_head(directory, model)`
builds an `MTPHead` from them (`scan` tells whether a checkpoint has them
without reading an array):

- The stage's decoder layer is the family's own mlx-lm class, built like the
  target layer whose tensors have the same modules (`template`), and its
  tensors go through the family's own `sanitize` as that layer's would
  (experts stacked, MLA projections split, FP8 dequantized, norms shifted):
  every file tensor is handed to `sanitize` (lazily: mx.load reads nothing
  until evaluated) with the stage's tensors in place of that layer's, so
  the conversion is exactly the one the target's own layers went through.
- The stage's own norms are stored as the target's are: the same `sanitize`
  call reports what it adds to the final norm (a zero probe in its place:
  Qwen3.5 and Qwen3-Next store 1 + w, zero-centred), and it is added to them.
- Quantized tensors (`scales`) load as mlx-lm loads the target's
  (`infer_quant_config`: bits, group size and mode read from the shapes).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import infer_quant_config, load_config

from ..targets.families import final_norm, model_family, text_model
from .head import MTPHead, MTPStage
from .layouts import EMBEDDING_NORM, FINAL_NORM, HEAD, HIDDEN_NORM, LAYOUTS, NORMS, PROJECTION, layout_for
from .scan import MTPWeightsError, StageTensors

NO_MTP = "this checkpoint has no MTP weights; use one that keeps them"
PROBE_PREFIX = "mtp_"  # the stage's own tensors ride through sanitize as `layers.{k}.mtp_<role>.*`
LAYER = re.compile(r"^(.*?)layers\.(\d+)\.(.+)$")


def read_tensors(directory: Path) -> dict[str, mx.array]:
    """Every tensor of the checkpoint's model*.safetensors files (the files mlx-lm loads), unread."""
    weights: dict[str, mx.array] = {}
    for file in sorted(Path(directory).glob("model*.safetensors")):
        weights.update(mx.load(str(file)))
    return weights


def load_mtp_head(directory: Path, model: nn.Module, dtype: mx.Dtype | None = None) -> MTPHead:
    """The target's MTP heads from its checkpoint directory (an `MTPWeightsError` naming what is missing);
    floating weights cast to `dtype` (None: as stored)."""
    directory = Path(directory)
    family = model_family(model)
    layout = layout_for(family)
    if layout is None:
        families = ", ".join(sorted(LAYOUTS))
        raise MTPWeightsError(
            f"{directory}: {NO_MTP} (dflash-mlx reads the MTP heads of {families}; this is {family})."
        )
    count = layout.count(load_config(directory))
    if count < 1:
        raise MTPWeightsError(f"{directory}: {NO_MTP} (its config gives no {layout.count_field}).")
    weights = read_tensors(directory)
    layers = text_model(model).args.num_hidden_layers
    stages = [StageTensors(weights, layout, i, layers) for i in range(count)]
    for i, stage in enumerate(stages):
        if not stage.keys:
            raise MTPWeightsError(f"{directory}: {NO_MTP}.")
        if missing := stage.missing(layout):
            raise MTPWeightsError(f"{directory}: {NO_MTP} (MTP layer {i} lacks {', '.join(missing)}).")
    mtp_keys = set().union(*(s.keys for s in stages))
    prefix, k = template(weights, mtp_keys, stages[0], layers, directory)
    built = [_stage(model, weights, mtp_keys, s, prefix, k, directory) for s in stages]
    head = MTPHead(built, layout, family, k, make_prompt_cache(model)[k])
    if dtype is not None:
        head.set_dtype(dtype)
    mx.eval(head.parameters())
    return head


def target_layers(weights, mtp_keys: set, layers: int, directory: Path) -> tuple[str, dict[int, set[str]]]:
    """(file prefix, {index: tensor names after it}) of the target's decoder layers in a checkpoint."""
    found: dict[str, dict[int, set]] = {}
    for key in weights:
        m = LAYER.match(key)
        if key in mtp_keys or m is None or not (m.group(1) == "" or m.group(1).endswith(".")):
            continue
        found.setdefault(m.group(1), {}).setdefault(int(m.group(2)), set()).add(m.group(3))
    for prefix, by_layer in found.items():
        if sorted(by_layer) == list(range(layers)):
            return prefix, by_layer
    raise MTPWeightsError(f"{directory}: its tensors hold no {layers} decoder layers under one prefix.")


def template(weights: dict, mtp_keys: set, stage: StageTensors, layers: int, directory: Path) -> tuple[str, int]:
    """(file prefix, index) of the last target layer whose tensors have the modules of the stage's layer."""
    prefix, by_layer = target_layers(weights, mtp_keys, layers, directory)
    matches = [k for k, names in by_layer.items() if _modules(names) == _modules(stage.layer)]
    if not matches:
        raise MTPWeightsError(f"{directory}: the MTP layer's tensors match none of the target's decoder layers.")
    return prefix, max(matches)


def _modules(names) -> set[str]:
    return {name.rsplit(".", 1)[0] for name in names}


def _path_of(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def as_layer(model, weights, mtp_keys, prefix: str, k: int, given: dict, directory: Path) -> tuple[dict, float]:
    """Tensors `given` under target layer k's file names, through the family's sanitize with every other tensor of
    the checkpoint in place (the MTP tensors and layer k's own left out): ({name in layer k: tensor}, what the
    sanitize adds to a norm, read off a zero final norm)."""
    file_layer = f"{prefix}layers.{k}."
    tensors = {key: v for key, v in weights.items() if key not in mtp_keys and not key.startswith(file_layer)}
    tensors.update(given)
    norm_key = f"{prefix}norm.weight"
    if norm_key not in weights:
        raise MTPWeightsError(f"{directory}: no {norm_key} (the target's final norm) beside its layers.")
    tensors[norm_key] = mx.zeros_like(weights[norm_key])
    sanitized = model.sanitize(tensors) if hasattr(model, "sanitize") else tensors
    layer_path = _path_of(model, model.layers[k]) + "."
    mine = {key[len(layer_path) :]: v for key, v in sanitized.items() if key.startswith(layer_path)}
    shift = sanitized[_path_of(model, final_norm(model)) + ".weight"]
    if not bool(mx.all(shift == shift[0]).item()):
        raise MTPWeightsError(f"{directory}: cannot tell how the family's sanitize stores norms.")
    return mine, float(shift[0].item())


def _stage(model, weights, mtp_keys, stage: StageTensors, prefix: str, k: int, directory: Path) -> MTPStage:
    """One stage: its tensors through the family's sanitize as target layer k's, then its modules."""
    file_layer = f"{prefix}layers.{k}."
    given = {file_layer + rest: weights[key] for rest, key in stage.layer.items()}
    for role, params in stage.roles.items():
        given.update({f"{file_layer}{PROBE_PREFIX}{role}.{p}": weights[key] for p, key in params.items()})
    mine, shift = as_layer(model, weights, mtp_keys, prefix, k, given, directory)
    own = {n: v for n, v in mine.items() if n.startswith(PROBE_PREFIX)}
    layer_weights = {n: v for n, v in mine.items() if not n.startswith(PROBE_PREFIX)}
    roles = {}
    for role in stage.roles:
        key = PROBE_PREFIX + role + "."
        roles[role] = {n[len(key) :]: v for n, v in own.items() if n.startswith(key)}
    args = text_model(model).args
    hidden, vocab, eps = args.hidden_size, args.vocab_size, args.rms_norm_eps
    norms = {}
    for role in NORMS:
        norm = nn.RMSNorm(hidden, eps=eps)
        norm.weight = (roles[role]["weight"] + shift).astype(roles[role]["weight"].dtype)
        norms[role] = norm
    return MTPStage(
        projection=_linear(roles[PROJECTION], 2 * hidden, hidden, directory),
        embedding_norm=norms[EMBEDDING_NORM],
        hidden_norm=norms[HIDDEN_NORM],
        layer=_layer(model, k, layer_weights, directory),
        final_norm=norms[FINAL_NORM],
        head=_linear(roles[HEAD], hidden, vocab, directory) if HEAD in roles else None,
    )


def _quantized_like(module: nn.Module, weights: dict) -> nn.Module:
    """`module` quantized where `weights` hold scales, as mlx-lm's loader quantizes (shapes give bits, group
    size and mode)."""

    def predicate(path: str, m: nn.Module):
        if not hasattr(m, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, m, weights)

    nn.quantize(module, class_predicate=predicate)
    return module


def _linear(params: dict, inputs: int, outputs: int, directory: Path) -> nn.Module:
    wrapper = nn.Module()
    wrapper.linear = nn.Linear(inputs, outputs, bias="bias" in params)
    weights = {f"linear.{p}": v for p, v in params.items()}
    _quantized_like(wrapper, weights)
    _load(wrapper, weights, directory, "an MTP projection or head")
    return wrapper.linear


def new_layer(model: nn.Module, k: int) -> nn.Module:
    """A fresh decoder layer of the target's own class, built as the family builds layer k (mlx-lm's init)."""
    cls = type(model.layers[k])
    args = text_model(model).args
    return cls(args, k) if len(inspect.signature(cls).parameters) >= 2 else cls(args)


def _layer(model: nn.Module, k: int, weights: dict, directory: Path) -> nn.Module:
    layer = new_layer(model, k)
    _quantized_like(layer, weights)
    _load(layer, weights, directory, "the MTP decoder layer")
    return layer


def _load(module: nn.Module, weights: dict, directory: Path, what: str) -> None:
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise MTPWeightsError(f"{directory}: {what} does not match the target's ({e}).") from e


def mtp_template(model: nn.Module) -> int:
    """The target layer a new head's decoder layer is built like: the last full-attention one (every family's
    MTP layer is; hybrid targets mark their linear-attention layers `is_linear`)."""
    return max(i for i, layer in enumerate(model.layers) if not getattr(layer, "is_linear", False))


def new_mtp_head(model: nn.Module, stages: int = 1) -> MTPHead:
    """Untrained MTP heads for a target of a family with a layout (mlx-lm's initialisation), to train."""
    family = model_family(model)
    layout = layout_for(family)
    if layout is None:
        raise MTPWeightsError(f"the {family} family has no MTP layout (dflash-mlx knows {', '.join(sorted(LAYOUTS))}).")
    k = mtp_template(model)
    args = text_model(model).args
    hidden, eps = args.hidden_size, args.rms_norm_eps
    built = [
        MTPStage(
            projection=nn.Linear(2 * hidden, hidden, bias=False),
            embedding_norm=nn.RMSNorm(hidden, eps=eps),
            hidden_norm=nn.RMSNorm(hidden, eps=eps),
            layer=new_layer(model, k),
            final_norm=nn.RMSNorm(hidden, eps=eps),
        )
        for _ in range(stages)
    ]
    return MTPHead(built, layout, family, k, make_prompt_cache(model)[k])
