"""Whether a checkpoint holds MTP weights, from its config and tensor names alone (no array is read).

A local directory's names come from its safetensors headers; a Hugging Face
repo's from the Hub's metadata (its config.json and the safetensors index),
so a target without a registered drafter is judged before anything large
is downloaded. `StageTensors` finds stage i's tensors by name (`layouts`),
for `checkpoint` too.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterable

from .layouts import HEAD, MTPLayout, layout_for


class MTPWeightsError(ValueError):
    """A checkpoint's MTP tensors cannot be used (the message names the directory and what is wrong)."""


def under(names: Iterable[str], root: str) -> dict[str, str]:
    """{name after `root`: full name} of the names under `root` (at a name boundary, under any prefix)."""
    found = {}
    for key in names:
        i = key.find(root)
        while i > 0 and key[i - 1] != ".":
            i = key.find(root, i + 1)
        if i >= 0:
            found[key[i + len(root) :]] = key
    return found


class StageTensors:
    """Stage i's tensors in a checkpoint: its own by role ({role: {param: name}}) and its decoder layer's."""

    def __init__(self, names: Iterable[str], layout: MTPLayout, stage: int, layers: int):
        names = list(names)
        own = under(names, layout.stage_root(stage, layers))
        self.roles: dict[str, dict[str, str]] = {}
        for role, name in layout.names.items():
            params = {rest[len(name) + 1 :]: key for rest, key in own.items() if rest.startswith(name + ".")}
            if params:
                self.roles[role] = params
        skip = tuple(name + "." for name in (*layout.names.values(), *layout.ignored))
        layer = under(names, layout.layer_root(stage, layers))
        self.layer = {rest: key for rest, key in layer.items() if not rest.startswith(skip)}
        self.keys = set(own.values()) | set(layer.values())

    def missing(self, layout: MTPLayout) -> list[str]:
        """What the stage lacks (empty: it is whole)."""
        lacks = [name for role, name in layout.names.items() if role != HEAD and role not in self.roles]
        return lacks + ([] if self.layer else ["its decoder layer"])


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def stage_count(config: dict, names: Iterable[str]) -> int:
    """How many whole MTP stages `names` hold for a checkpoint with `config` (0: none, or an unknown family)."""
    layout = layout_for(str(config.get("model_type")))
    count = layout.count(config) if layout is not None else 0
    layers = text_config(config).get("num_hidden_layers")
    if count < 1 or not isinstance(layers, int):
        return 0
    names = list(names)
    whole = all(not StageTensors(names, layout, i, layers).missing(layout) for i in range(count))
    return count if whole else 0


def safetensors_names(directory: Path) -> list[str]:
    """The tensor names in a directory's model*.safetensors headers (the files mlx-lm loads)."""
    names: list[str] = []
    for file in sorted(Path(directory).glob("model*.safetensors")):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        names += [k for k in header if k != "__metadata__"]
    return names


def has_mtp_weights(target: str) -> bool:
    """Whether a local model directory or a Hub repo holds whole MTP stages (False when it cannot be told:
    no such repo, no network)."""
    path = Path(target).expanduser()
    try:
        if path.is_dir():
            config = json.loads((path / "config.json").read_text())
            return stage_count(config, safetensors_names(path)) > 0
        from huggingface_hub import get_safetensors_metadata, hf_hub_download

        config = json.loads(Path(hf_hub_download(target, "config.json")).read_text())
        return stage_count(config, get_safetensors_metadata(target).weight_map) > 0
    except (OSError, ValueError, KeyError, struct.error):  # no such repo, no network, not a checkpoint
        return False
