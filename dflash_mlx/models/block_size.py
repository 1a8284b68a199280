"""The default block size: the drafter's own, capped at 5 for low-bit models.

A quantized matmul's cost grows quickly with the number of rows it processes
(on Apple GPUs the 4-bit kernels are tuned for one row), so verifying 16 rows
of a 4-bit target costs much more than 16 rows of a bf16 one, while acceptance
falls with depth. Community measurements on Macs found blocks of 3-5 faster
than 16 by 20-30% when either model is 4-bit or lower. A caller's explicit
`block_size` always wins, up to the drafter's own block (`check_block_size`: a
DFlash drafter is trained to draft that many positions, and a wider verify
only costs memory).
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
    return capped_block_size(widest_block(draft), target, draft)


def widest_block(draft) -> int:
    """The widest block a drafter verifies, anchor included: its own block (a DFlash drafter is
    trained to draft block_size - 1 tokens after an anchor; a Proposer says what it drafts)."""
    return getattr(draft, "block_size", None) or draft.config.block_size


def check_block_size(size, draft, name: str = "block_size") -> None:
    """A ValueError unless `size` (None: the default) is an integer block the drafter can verify."""
    if size is None:
        return
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {size!r}.")
    if draft is not None and size > widest_block(draft):
        widest = widest_block(draft)
        raise ValueError(
            f"{name} must be at most {widest}, the drafter's block (it drafts at most {widest - 1} "
            f"tokens per cycle), got {size}."
        )
