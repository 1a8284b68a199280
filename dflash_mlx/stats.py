"""Acceptance statistics of one or more generations, from the response stream.

`RunStats` consumes `DFlashResponse`s (or plain mlx-lm `GenerationResponse`s)
as they arrive and keeps what the terminal app and the benchmark report:
tokens, draft/verify cycles, the histogram of tokens committed per cycle
(1..block size), the blocks verified (chosen per cycle when adaptive),
per-position acceptance, the tokens from each source (an accepted lookup
draft, an accepted drafter draft, the target's own pick), timing with the prefill excluded,
prefill speed and peak memory. Times come from the caller's clock so that the
baseline (mlx-lm's own decoding) and DFlash are measured the same way.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RunStats:
    block_size: int | None = None  # the fixed block, or the adaptive policy's largest
    adaptive: bool = False
    tokens: int = 0
    drafted: int = 0  # tokens that were accepted drafts
    generations: int = 0
    prompt_tokens: int = 0
    cycles: int = 0
    histogram: Counter = field(default_factory=Counter)  # tokens per cycle -> cycles
    accepted_at: Counter = field(default_factory=Counter)  # draft position (0-based) -> cycles accepting it
    blocks: Counter = field(default_factory=Counter)  # block verified -> cycles
    sources: Counter = field(default_factory=Counter)  # "lookup" / "dflash" / "target" -> tokens
    prefill_time: float = 0.0
    decode_time: float = 0.0
    peak_memory_gb: float = 0.0
    _start: float | None = None
    _first: float | None = None
    _drafted_in_cycle: int = 0
    _last: float = 0.0

    def begin(self) -> None:
        """Call right before asking for the first token of a generation."""
        self._start = time.perf_counter()
        self._first = None
        self._drafted_in_cycle = 0

    def add(self, response) -> None:
        now = time.perf_counter()
        if self._first is None:
            self._first = now
            self.prefill_time += now - (self._start if self._start is not None else now)
            self.prompt_tokens += response.prompt_tokens
            self.generations += 1
        else:
            self.decode_time += now - self._last
        self._last = now
        self.tokens += 1
        self.peak_memory_gb = max(self.peak_memory_gb, response.peak_memory)
        from_draft = bool(getattr(response, "from_draft", False))
        source = getattr(response, "source", None)
        if source is not None:
            self.sources[source] += 1
        self.drafted += from_draft
        self._drafted_in_cycle += from_draft
        size = getattr(response, "cycle_tokens", None)
        if size is not None:
            self.cycles += 1
            self.histogram[size] += 1
            block = getattr(response, "cycle_block_size", None)
            if block is not None:
                self.blocks[block] += 1
            for position in range(self._drafted_in_cycle):
                self.accepted_at[position] += 1
            self._drafted_in_cycle = 0

    def merge(self, other: RunStats) -> None:
        self.tokens += other.tokens
        self.drafted += other.drafted
        self.generations += other.generations
        self.prompt_tokens += other.prompt_tokens
        self.cycles += other.cycles
        self.histogram.update(other.histogram)
        self.accepted_at.update(other.accepted_at)
        self.blocks.update(other.blocks)
        self.sources.update(other.sources)
        self.prefill_time += other.prefill_time
        self.decode_time += other.decode_time
        self.peak_memory_gb = max(self.peak_memory_gb, other.peak_memory_gb)

    @property
    def decoded(self) -> int:
        """Tokens after the first of each generation (the first one comes from the prefill)."""
        return self.tokens - self.generations

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens committed per draft/verify cycle (None before the first cycle)."""
        if not self.cycles:
            return None
        return sum(k * v for k, v in self.histogram.items()) / self.cycles

    @property
    def mean_block_size(self) -> float | None:
        """Mean rows verified per cycle (None before the first cycle)."""
        n = sum(self.blocks.values())
        return sum(k * v for k, v in self.blocks.items()) / n if n else None

    def sources_dict(self) -> dict[str, int]:
        """Tokens per source: "lookup" (copied from the context), the drafter's ("dflash", or a proposer's
        own name such as "dspark"), "target" (the target's own picks): lookup and target always, "dflash"
        unless another drafter drafted, any other that drafted."""
        if not self.sources:
            return {}
        others = sorted(set(self.sources) - {"lookup", "dflash", "target"})
        drafters = ["dflash"] if "dflash" in self.sources or not others else []
        names = ["lookup", *drafters, *others, "target"]
        return {k: self.sources.get(k, 0) for k in names}

    def sources_line(self) -> str:
        """The sources' shares, e.g. "lookup 41%, dflash 22%, target 37%" ("" without sources)."""
        total = sum(self.sources.values())
        return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in self.sources_dict().items()) if total else ""

    def blocks_dict(self) -> dict[str, int]:
        """Cycles per block verified, ascending (the blocks an adaptive run chose)."""
        return {str(k): self.blocks[k] for k in sorted(self.blocks)}

    @property
    def tps(self) -> float:
        """Decode speed: tokens after the first over the time after the first (prefill excluded)."""
        return self.decoded / self.decode_time if self.decode_time > 0 else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_time if self.prefill_time > 0 else 0.0

    def histogram_dict(self) -> dict[str, int]:
        top = max([self.block_size or 0, *self.histogram])
        return {str(k): self.histogram.get(k, 0) for k in range(1, top + 1)}

    def per_position_acceptance(self) -> list[float]:
        """Per draft position: the share of the cycles that offered it which accepted it."""
        b = max([self.block_size or 1, *self.histogram, *self.blocks])
        offered = [
            sum(v for k, v in self.blocks.items() if k > i) if self.blocks else self.cycles for i in range(b - 1)
        ]
        return [self.accepted_at.get(i, 0) / n if n else 0.0 for i, n in enumerate(offered)]
