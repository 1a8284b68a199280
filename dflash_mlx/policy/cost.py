"""The cost curve T(b): seconds per draft/verify cycle at block b, calibrated (and optionally refined).

A calibration measures T at a few blocks (`grid`); blocks in between are
interpolated linearly, blocks past the last point extrapolated from the last
two. `observe` refines it from the loop's own cycle times (a per-block
exponential average of measured / calibrated, and an overall one for blocks
not run yet), which only a policy with `refine` set uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RATIO_SMOOTHING = 0.15  # weight of the newest measurement
MIN_SAMPLES = 3  # measurements of a block before its own ratio replaces the overall one
RATIO_BOUNDS = (0.25, 4.0)  # one measurement cannot move the curve further (a GC pause, a page fault)


@dataclass
class CostCurve:
    grid: list[int]  # blocks measured, ascending, starting at 1
    seconds: list[float]  # T at each grid block
    _ratio: dict[int, float] = field(default_factory=dict)
    _samples: dict[int, int] = field(default_factory=dict)
    _overall: float = 1.0
    _overall_samples: int = 0

    def __post_init__(self) -> None:
        if not self.grid or len(self.grid) != len(self.seconds):
            raise ValueError("A cost curve needs one time per grid block.")
        if self.grid[0] != 1 or any(b >= c for b, c in zip(self.grid, self.grid[1:])):
            raise ValueError(f"The grid must start at 1 and ascend, got {self.grid}.")
        if any(not (t > 0) for t in self.seconds):
            raise ValueError(f"Cycle times must be positive, got {self.seconds}.")

    def calibrated(self, b: int) -> float:
        grid, sec = self.grid, self.seconds
        if b <= grid[0] or len(grid) == 1:
            return sec[0] if b <= grid[0] else sec[0] * b / grid[0]
        for i in range(1, len(grid)):
            if b <= grid[i]:
                lo, hi = grid[i - 1], grid[i]
                return sec[i - 1] + (sec[i] - sec[i - 1]) * (b - lo) / (hi - lo)
        slope = max(0.0, (sec[-1] - sec[-2]) / (grid[-1] - grid[-2]))
        return sec[-1] + slope * (b - grid[-1])

    def __call__(self, b: int) -> float:
        ratio = self._ratio[b] if self._samples.get(b, 0) >= MIN_SAMPLES else self._overall
        return self.calibrated(b) * ratio

    def observe(self, b: int, seconds: float) -> None:
        lo, hi = RATIO_BOUNDS
        r = min(hi, max(lo, seconds / self.calibrated(b)))
        n = self._samples.get(b, 0)
        self._ratio[b] = r if n == 0 else self._ratio[b] + RATIO_SMOOTHING * (r - self._ratio[b])
        self._samples[b] = n + 1
        self._overall = r if self._overall_samples == 0 else self._overall + RATIO_SMOOTHING * (r - self._overall)
        self._overall_samples += 1

    def fresh(self) -> CostCurve:
        """The same calibration without online refinements (one per generation)."""
        return CostCurve(list(self.grid), list(self.seconds))
