"""What a loaded model is made of: its arrays and its quantized layers, read in one walk.

Every adaptive generation reads these (the block cap, the calibration key),
so they are read by walking the module tree once, directly: mlx's
`parameters()` and `named_modules()` build dictionaries of the whole tree and
cost about six times as much (0.26 ms against 0.04 ms on the bundled 6-layer
target), which a short reply on a small model notices.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class ModelFacts:
    parameters: int  # elements in all arrays
    float_dtypes: tuple[str, ...]  # sorted
    bits: int | None  # the smallest bit width among quantized layers, None if there are none


def read_facts(model: nn.Module) -> ModelFacts:
    """Count the arrays and find the quantized layers of `model` (an mlx Module)."""
    size, dtypes, bits = 0, set(), []
    stack: list = [model]
    while stack:
        node = stack.pop()
        if isinstance(node, mx.array):
            size += node.size
            if mx.issubdtype(node.dtype, mx.floating):
                dtypes.add(str(node.dtype))
        elif isinstance(node, dict):
            # mlx's quantized layers, and mlx-lm's (e.g. QuantizedSwitchLinear for MoE experts): plain
            # attributes bits and group_size (read from __dict__: a Module's failing getattr is slow)
            own = getattr(node, "__dict__", {})
            if "bits" in own and "group_size" in own:
                bits.append(own["bits"])
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return ModelFacts(size, tuple(sorted(dtypes)), min(bits) if bits else None)
