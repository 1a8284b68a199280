"""How many rows each draft/verify cycle verifies: fixed, or chosen per cycle by cost and acceptance.

`base` is the interface the engine asks (`BlockPolicy`: `choose`, `observe`)
and the fixed policy; `estimate` keeps live per-position acceptance; `cost`
is the cost model (a calibrated table T(B, b), scaled per source by the
cycles the engine times); `calibration` measures and caches the table (one
request's curve here, the batch's through `batch.calibration`), `fit` turns
measured rounds into a curve; `choice` is the rule over sources (plain
decoding, a drafter, span sources: each an entry with its acceptance and its
cost) and the one probe schedule they all go through; `adaptive` is one
generation's policy on it, carrying a drafter's history. The package exports
only the interface: the engine imports it, and `calibration` runs the engine.
Design: docs/adaptive.md.
"""

from .base import BlockPolicy, FixedBlock

__all__ = ["BlockPolicy", "FixedBlock"]
