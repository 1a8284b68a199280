"""An oracle proposer with a chosen acceptance pattern, for tests and benchmarks.

`OracleProposer` knows the target's true greedy continuation and proposes it
with one corruption per block, placed so that cycle k accepts exactly
`accept_pattern[k % len(pattern)]` drafts (capped by the block). It costs
nothing to run, so a benchmark with it measures the engine alone.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from .base import Proposal


class OracleProposer:
    name = "oracle"
    layer_ids: tuple[int, ...] = ()

    def __init__(
        self,
        continuation: Sequence[int],
        accept_pattern: Sequence[int],
        vocab_size: int,
        block_size: int = 16,
    ):
        """`continuation[i]` is the target's i-th generated token (0: the first)."""
        if not accept_pattern or min(accept_pattern) < 0:
            raise ValueError("accept_pattern must be a non-empty list of counts >= 0.")
        self.continuation = list(continuation)
        self.accept_pattern = list(accept_pattern)
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.prompt_len = 0
        self.cycle = 0
        self.history: list[tuple[int, int]] = []  # (position, drafts offered)

    def start(self, target, prompt: mx.array, reused: int = 0) -> None:
        self.prompt_len = prompt.size
        self.cycle = 0
        self.history = []

    def add_context(self, features: mx.array) -> None:
        pass

    def state(self) -> list:
        return []

    def propose(self, anchor: mx.array, position: int, count: int, *, sampling=None, key=None) -> Proposal:
        index = position - self.prompt_len + 1  # continuation index of the first draft
        truth = self.continuation[index : index + count]
        tokens = truth + [0] * (count - len(truth))
        keep = self.accept_pattern[self.cycle % len(self.accept_pattern)]
        if keep < count:
            tokens[keep] = (tokens[keep] + 1) % self.vocab_size
        self.cycle += 1
        self.history.append((position, count))
        return Proposal(tokens=mx.array(tokens, dtype=mx.int32))
