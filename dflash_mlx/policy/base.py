"""The block-size policy interface the engine asks once per cycle, and the fixed policy.

Before each draft/verify the engine calls `choose(limit)` (limit: the most
rows allowed, e.g. by max_tokens) and after the cycle's host sync
`observe(block_size, accepted, seconds)`: the drafts the target accepted (None
when a stop token cut the cycle) and the cycle's cost on the engine's side:
building and queueing it, waiting for its verdict and taking it in, not the
caller's work between cycles (None where it is not the cycle's alone, e.g.
the first cycle, queued with the prefill). b = 1 is plain decoding.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable


@runtime_checkable
class BlockPolicy(Protocol):
    max_block: int  # the largest block it may choose

    def choose(self, limit: int) -> int: ...  # 1 <= b <= min(limit, max_block)

    def observe(self, block_size: int, accepted: int | None, seconds: float | None) -> None: ...


class FixedBlock:
    """Always the same block (capped by the limit)."""

    def __init__(self, block_size: int):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be >= 1 (an integer), got {block_size!r}.")
        self.max_block = block_size

    def choose(self, limit: int) -> int:
        return max(1, min(self.max_block, limit))

    def observe(self, block_size: int, accepted: int | None, seconds: float | None) -> None:
        pass


class ScheduledBlocks:
    """A given sequence of blocks (the calibration's), recording each cycle's seconds. `then`, when
    given, is asked once for the rest of the schedule when the given one runs out (it sees the
    seconds recorded so far; its blocks must not exceed the given ones)."""

    def __init__(self, schedule: list[int], then: Callable[[list[tuple[int, float | None]]], list[int]] | None = None):
        self.schedule = list(schedule)
        self.max_block = max(self.schedule)
        self.seconds: list[tuple[int, float | None]] = []  # (block, seconds) in cycle order
        self._next = 0
        self._then = then

    @property
    def done(self) -> bool:
        return len(self.seconds) >= len(self.schedule)

    def choose(self, limit: int) -> int:
        if self._next >= len(self.schedule) and self._then is not None:
            more, self._then = self._then(list(self.seconds)), None
            self.schedule += [min(b, self.max_block) for b in more]
        b = self.schedule[min(self._next, len(self.schedule) - 1)]
        self._next += 1
        return max(1, min(b, limit))

    def observe(self, block_size: int, accepted: int | None, seconds: float | None) -> None:
        self.seconds.append((block_size, seconds))
