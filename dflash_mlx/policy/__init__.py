"""How many rows each draft/verify cycle verifies: fixed, or chosen per cycle by cost and acceptance.

`base` is the interface the engine asks (`BlockPolicy`: `choose`, `observe`)
and the fixed policy; `estimate` keeps live per-position acceptance (and a
drafter's long-run history); `cost` holds the cost curve T(b); `calibration`
measures T(b) on this machine by running the engine and caches it on disk,
`fit` turns the measured rounds into the curve; `adaptive` picks argmax
E(b) / T(b), probing from b = 1. The package exports only the interface:
the engine imports it, and `calibration` runs the engine. Design: docs/adaptive.md.
"""

from .base import BlockPolicy, FixedBlock

__all__ = ["BlockPolicy", "FixedBlock"]
