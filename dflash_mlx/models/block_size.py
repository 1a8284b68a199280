"""The default block size: the drafter's own, capped at 5 for low-bit models.

A quantized matmul's cost grows quickly with the number of rows it processes
(on Apple GPUs the 4-bit kernels are tuned for one row), so verifying 16 rows
of a 4-bit target costs much more than 16 rows of a bf16 one, while acceptance
falls with depth. Community measurements on Macs found blocks of 3-5 faster
than 16 by 20-30% when either model is 4-bit or lower. A caller's explicit
`block_size` always wins.
"""

from __future__ import annotations

import mlx.nn as nn

from .facts import read_facts

QUANTIZED_BLOCK_CAP = 5
LOW_BITS = 4


def min_quantized_bits(model: nn.Module | None) -> int | None:
    """The smallest bit width among the model's quantized layers, or None."""
    if model is None or not isinstance(model, nn.Module):
        return None
    return read_facts(model).bits


def capped_block_size(size: int, target: nn.Module, draft) -> int:
    """`size`, capped at QUANTIZED_BLOCK_CAP when the target or the drafter is <= 4-bit."""
    low = [b for b in (min_quantized_bits(target), min_quantized_bits(draft)) if b is not None]
    if low and min(low) <= LOW_BITS:
        size = min(size, QUANTIZED_BLOCK_CAP)
    return size


def default_block_size(target: nn.Module, draft) -> int:
    """The drafter's configured block size, capped when either side is <= 4-bit."""
    return capped_block_size(getattr(draft, "block_size", None) or draft.config.block_size, target, draft)
