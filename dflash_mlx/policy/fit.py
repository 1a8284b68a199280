"""Turning noisy cycle times into a cost curve T(b): robust levels, monotone, affine past b = 1.

`fitted_curve` takes the calibration's rounds x blocks table: a median polish
of its logarithms (`polished`: a round's drift cancels), made non-decreasing
(`non_decreasing`), a least-squares line from b = 2 on unless it misses a
point by more than AFFINE_TOLERANCE (`affine_past_one`). `plausible` and
`with_floor` hold the curve to the physical floor T(b) >= T(1) + D(b), D(b)
the drafter forward timed alone (a busy machine breaks it). Why: docs/adaptive.md.
"""

from __future__ import annotations

import math
import statistics

POLISH_SWEEPS = 6
FLOOR_MARGIN = 0.5  # share of a drafter forward a block must cost over a plain step to be plausible
AFFINE_TOLERANCE = 0.2  # largest relative miss of the line before the measured shape is kept


def polished(table: list[list[float]]) -> list[float]:
    """Per-column levels of a rounds x blocks table of seconds (median polish of the logarithms),
    at the level of the median round."""
    logs = [[math.log(t) for t in row] for row in table]
    rows, cols = len(logs), len(logs[0])
    round_effect, block_effect = [0.0] * rows, [0.0] * cols
    for _ in range(POLISH_SWEEPS):
        for i in range(rows):
            m = statistics.median(logs[i])
            round_effect[i] += m
            logs[i] = [x - m for x in logs[i]]
        for j in range(cols):
            m = statistics.median(logs[i][j] for i in range(rows))
            block_effect[j] += m
            for i in range(rows):
                logs[i][j] -= m
    level = statistics.median(round_effect)
    return [math.exp(level + e) for e in block_effect]


def non_decreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [m for m, n in blocks for _ in range(n)]


def affine_past_one(grid: list[int], seconds: list[float]) -> list[float]:
    """`seconds` with the blocks >= 2 replaced by their least-squares line (slope >= 0), unless the line
    misses one of them by more than AFFINE_TOLERANCE; needs three blocks >= 2."""
    pairs = [(b, t) for b, t in zip(grid, seconds) if b >= 2]
    if len(pairs) < 3:
        return list(seconds)
    mean_b = sum(b for b, _ in pairs) / len(pairs)
    mean_t = sum(t for _, t in pairs) / len(pairs)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in pairs) / sum((b - mean_b) ** 2 for b, _ in pairs)
    slope = max(0.0, slope)
    line = {b: mean_t + slope * (b - mean_b) for b, _ in pairs}
    if any(abs(line[b] - t) > AFFINE_TOLERANCE * t for b, t in pairs):
        return list(seconds)
    return [line.get(b, t) for b, t in zip(grid, seconds)]


def fitted_curve(grid: list[int], table: list[list[float]]) -> list[float]:
    """The cost curve from a rounds x blocks table: polished, non-decreasing, affine past b = 1."""
    return non_decreasing(affine_past_one(grid, non_decreasing(polished(table))))


def draft_floor(grid: list[int], blocks: list[int], seconds: list[float]) -> list[float]:
    """D(b) at every grid block from drafter forwards timed at `blocks` (ascending, >= 2): 0 at b = 1,
    linear in b between the timed blocks (a forward's rows grow with b), flat beyond them."""
    out = []
    for b in grid:
        if b < 2 or not blocks:
            out.append(0.0)
            continue
        b = min(max(b, blocks[0]), blocks[-1])
        i = next(i for i, timed in enumerate(blocks) if b <= timed)
        if i == 0:
            out.append(seconds[0])
        else:
            lo, hi = blocks[i - 1], blocks[i]
            out.append(seconds[i - 1] + (seconds[i] - seconds[i - 1]) * (b - lo) / (hi - lo))
    return out


def plausible(seconds: list[float], floor: list[float]) -> bool:
    """Whether every block costs at least FLOOR_MARGIN of its drafter forward more than a plain step."""
    return all(t - seconds[0] >= FLOOR_MARGIN * d for t, d in zip(seconds[1:], floor[1:]))


def with_floor(seconds: list[float], floor: list[float]) -> list[float]:
    """`seconds` lifted to T(1) + D(b) where below it, and to the largest smaller block's time (a noisy
    D must not make a larger block look cheaper)."""
    out = [seconds[0]]
    for t, d in zip(seconds[1:], floor[1:]):
        out.append(max(t, seconds[0] + d, out[-1]))
    return out
