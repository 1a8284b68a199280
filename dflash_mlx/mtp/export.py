"""Writing trained MTP heads into a copy of their target's checkpoint, under the family's own names.

`write_mtp_checkpoint(source, out, head, model)` makes `out` the target's
checkpoint (every file of `source`, hard-linked where the file system allows,
else copied) with the heads' tensors in `model-mtp.safetensors` (the MTP
tensors `source` had are left out of its shards, its safetensors index and
config count updated), so the heads load as a real checkpoint's do, by
`checkpoint.load_mtp_head` and by other runtimes reading the family's names.
The decoder layer's tensors are written in the layout of the target's own
layer in `source` (the inverse of what the family's sanitize does: experts
one tensor each where its layers store them so, MLA's `kv_b_proj` whole,
Qwen3.5 MoE's fused experts, norms less what sanitize adds); the heads are
read back and compared before the call returns, so a layout this module
does not invert is an error, never a silent mismatch. Every file is written
atomically (`utils.io`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..targets.families import text_model
from ..utils.io import replace_atomically, save_safetensors_atomic, write_json_atomic
from .checkpoint import MTPWeightsError, as_layer, load_mtp_head, read_tensors, target_layers
from .head import MTPHead
from .layouts import HEAD, NORMS, PROJECTION
from .scan import StageTensors

MTP_FILE = "model-mtp.safetensors"
INDEX = "model.safetensors.index.json"


def write_mtp_checkpoint(source: Path, out: Path, head: MTPHead, model: nn.Module, dtype=mx.float32) -> None:
    """`out` := the checkpoint in `source` with `head`'s stages as its MTP tensors (floating ones in `dtype`)."""
    source, out = Path(source), Path(out)
    weights = read_tensors(source)
    config = json.loads((source / "config.json").read_text())
    layout, layers = head.layout, text_model(model).args.num_hidden_layers
    count = max(layout.count(config), len(head.stages))
    old = set().union(*(StageTensors(weights, layout, i, layers).keys for i in range(count)))
    prefix, by_layer = target_layers(weights, old, layers, source)
    shift = as_layer(model, weights, old, prefix, head.template, {}, source)[1]
    tensors: dict[str, mx.array] = {}
    for i, stage in enumerate(head.stages):
        tensors.update(_stage_tensors(stage, layout, i, layers, by_layer[head.template], shift, dtype))
        if HEAD in layout.names and stage.get("head") is None:  # a family whose stages have their own head
            tensors.update(_target_head(weights, layout.stage_root(i, layers) + layout.names[HEAD]))
    if out.resolve() == source.resolve():
        raise MTPWeightsError(f"{out}: the heads go into a copy of the checkpoint, not into {source} itself.")
    out.mkdir(parents=True, exist_ok=True)
    _copy_checkpoint(source, out, old)
    save_safetensors_atomic(out / MTP_FILE, tensors, {"format": "pt"})
    _update_index(source, out, old, tensors)
    config.get("text_config", config)[layout.count_field] = len(head.stages)
    write_json_atomic(out / "config.json", config)
    _check_round_trip(out, head, model, dtype)


def _stage_tensors(stage, layout, i: int, layers: int, template: set[str], shift: float, dtype) -> dict:
    """Stage i's tensors under the family's names, its layer in the layout of the target's (`template`: the names
    of the target layer it is built like)."""
    own_root, layer_root = layout.stage_root(i, layers), layout.layer_root(i, layers)
    out = {}
    for role in (PROJECTION, *NORMS, HEAD):
        module = stage.get(role)
        if module is None:
            continue
        for name, value in tree_flatten(module.parameters()):
            value = value - shift if role in NORMS else value
            out[f"{own_root}{layout.names[role]}.{name}"] = value.astype(dtype)
    layer = dict(tree_flatten(stage.layer.parameters()))
    for name, value in _file_layout(layer, template, shift).items():
        out[layer_root + name] = value.astype(dtype) if mx.issubdtype(value.dtype, mx.floating) else value
    return out


def _file_layout(layer: dict, template: set[str], shift: float) -> dict:
    """A decoder layer's parameters (mlx-lm's layout) in the layout `template`'s names show."""
    out = {}
    for name, value in layer.items():
        head, _, tail = name.partition(".switch_mlp.")
        if tail and f"{head}.experts.gate_up_proj" in template:  # Qwen3.5 MoE: fused experts
            if tail.startswith("down_proj."):
                out[f"{head}.experts.down_proj"] = value
            elif tail.startswith("gate_proj."):
                up = layer[f"{head}.switch_mlp.up_proj.weight"]
                out[f"{head}.experts.gate_up_proj"] = mx.concatenate([value, up], axis=-2)
        elif tail and any(n.startswith(f"{head}.experts.0.") for n in template):  # one tensor per expert
            for e in range(value.shape[0]):
                out[f"{head}.experts.{e}.{tail}"] = value[e]
        elif name.endswith("self_attn.embed_q.weight") and "self_attn.kv_b_proj.weight" in template:
            wv = layer[name.replace("embed_q", "unembed_out")]
            kv = mx.concatenate([value.swapaxes(-1, -2), wv], axis=1)
            out[name.replace("embed_q", "kv_b_proj")] = kv.reshape(-1, kv.shape[-1])
        elif name.endswith("self_attn.unembed_out.weight") and "self_attn.kv_b_proj.weight" in template:
            continue
        elif tail:
            out[name] = value
        else:
            out[name] = value - shift if value.ndim == 1 and name.endswith("norm.weight") else value
    return out


def _target_head(weights: dict, name: str) -> dict:
    """A copy of the target's own output head's tensors under `name` (a family whose stages carry a head)."""
    found = {k: v for k, v in weights.items() if k.split(".")[-2:-1] == ["lm_head"]}
    if not found:
        raise MTPWeightsError("the checkpoint has no lm_head to give the MTP stage as its head.")
    return {f"{name}.{k.rsplit('.', 1)[1]}": v for k, v in found.items()}


def _link_or_copy(src: Path, dst: Path) -> None:
    def write(tmp: Path) -> None:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copy2(src, tmp)

    replace_atomically(dst, write, suffix=".tmp" + "".join(src.suffixes[-1:]))


def _copy_checkpoint(source: Path, out: Path, old: set[str]) -> None:
    """Every file of `source` into `out`: shards holding MTP tensors rewritten without them."""
    for src in sorted(p for p in source.iterdir() if p.is_file() and not p.name.startswith(".")):
        if src.name in (MTP_FILE, "config.json", INDEX):
            continue
        if src.suffix == ".safetensors":
            tensors = mx.load(str(src))
            if old & set(tensors):
                kept = {k: v for k, v in tensors.items() if k not in old}
                save_safetensors_atomic(out / src.name, kept, {"format": "pt"})
                continue
        _link_or_copy(src, out / src.name)


def _update_index(source: Path, out: Path, old: set[str], tensors: dict) -> None:
    """`source`'s safetensors index (where it has one) in `out`: old MTP entries out, the new file's in."""
    if not (source / INDEX).exists():
        return
    index = json.loads((source / INDEX).read_text())
    weight_map = {k: v for k, v in index.get("weight_map", {}).items() if k not in old}
    weight_map.update({k: MTP_FILE for k in tensors})
    write_json_atomic(out / INDEX, dict(index, weight_map=weight_map))


def _check_round_trip(out: Path, head: MTPHead, model: nn.Module, dtype) -> None:
    """Read the written heads back as a checkpoint's and compare them with `head` (in `dtype`)."""
    loaded = load_mtp_head(out, model)
    # a 16-bit float rounds w and w - 1 (a zero-centred norm) apart by up to two units in its 8th bit
    rtol = 1e-5 if dtype == mx.float32 else 2**-7
    for i, (want, got) in enumerate(zip(head.stages, loaded.stages)):
        wanted, read = dict(tree_flatten(want.parameters())), dict(tree_flatten(got.parameters()))
        for name, value in wanted.items():
            back = read.get(name)
            expected = value.astype(dtype).astype(mx.float32)
            ok = back is not None and mx.allclose(back.astype(mx.float32), expected, rtol=rtol, atol=rtol).item()
            if not ok:
                raise MTPWeightsError(f"{out}: MTP stage {i}'s {name} did not read back as written.")
