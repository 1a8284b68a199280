"""How many rows each draft/verify cycle verifies: fixed, or chosen per cycle by cost and acceptance.

`base` is the interface the engine asks (`BlockPolicy`: `choose`, `observe`)
and the fixed policy; `estimate` keeps live per-position acceptance; `cost`
is the cost model (a calibrated table T(B, b) as a prior, kept true by the
cycles the engine times); `calibration` measures and caches it (one request's
curve here, the batch's through `batch.calibration`), `fit` turns measured
rounds into a curve; `adaptive` picks argmax E(b) / T(b), probing from b = 1,
re-timing other blocks while drafting, and carrying a drafter's history. The
package exports only the interface: the engine imports it, and `calibration`
runs the engine. Design: docs/adaptive.md.
"""

from .base import BlockPolicy, FixedBlock

__all__ = ["BlockPolicy", "FixedBlock"]
