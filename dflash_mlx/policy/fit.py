"""Turning noisy cycle times into a cost curve T(b): robust levels, monotone, affine past b = 1.

`fitted_curve` takes a calibration's rounds x blocks table (one line of a
cost table): a median polish of its logarithms (`polished`: a round's drift
cancels), made non-decreasing (`non_decreasing`), a least-squares line from
b = 2 on unless it misses a point by more than AFFINE_TOLERANCE
(`affine_past_one`). `instability` says how much the shape rests on any one
round (a busy machine's rounds disagree). Why: docs/adaptive.md.
"""

from __future__ import annotations

import math
import statistics

POLISH_SWEEPS = 6
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


def instability(grid: list[int], table: list[list[float]]) -> float:
    """How much the fitted curve's shape rests on any one round of a rounds x blocks table: the largest
    change of a block's T(b) / T(1) when one round is left out (a busy machine's rounds disagree, and a
    moment's stall in one round does not count, as the fit's medians ignore it). 0 for one round."""
    if len(table) < 2 or len(grid) < 2:
        return 0.0
    whole = fitted_curve(grid, table)
    worst = 0.0
    for r in range(len(table)):
        part = fitted_curve(grid, table[:r] + table[r + 1 :])
        worst = max(worst, max(abs(math.log(p / part[0]) - math.log(w / whole[0])) for p, w in zip(part, whole)))
    return math.exp(worst) - 1.0
