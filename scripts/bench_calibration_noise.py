"""How a busy machine bends the block-size calibration, and what the drafter's floor does about it.

Calibrates the bundled demo pair (or --model/--draft) repeatedly, first on a
quiet machine, then while a child process keeps part of one core busy (busy
for --busy-ms, idle for --idle-ms, in a loop), and prints per calibration
T(1), the ratios T(b) / T(1) the policy decides with, the drafter forwards
timed alone, whether the first curve broke the floor T(b) >= T(1) + D(b) / 2
(and was measured again), and how long it took. Each calibration writes to
a private cache directory.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python3 scripts/bench_calibration_noise.py --runs 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BUSY_LOOP = """
import sys, time
busy, idle = float(sys.argv[1]) / 1000, float(sys.argv[2]) / 1000
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(idle)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--runs", type=int, default=6, help="Calibrations per condition.")
    ap.add_argument("--busy-ms", type=float, default=30.0)
    ap.add_argument("--idle-ms", type=float, default=30.0)
    args = ap.parse_args()
    os.environ["DFLASH_MLX_CACHE_DIR"] = tempfile.mkdtemp(prefix="dflash-calibration-noise-")

    import dflash_mlx
    from dflash_mlx.models.block_size import default_block_size
    from dflash_mlx.policy.calibration import calibration_file, cost_curve
    from dflash_mlx.session import make_session

    model, _, draft = dflash_mlx.load(args.model, args.draft)
    session = make_session(model, draft)
    target, proposer = session.target, session.proposer
    largest = default_block_size(model, draft)
    cost_curve(target, proposer, largest, force=True)  # warm-up: kernels, allocations

    report = {}
    for condition in ("quiet", "busy"):
        child = None
        if condition == "busy":
            child = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(args.busy_ms), str(args.idle_ms)])
            time.sleep(0.3)
        rows = []
        try:
            for _ in range(args.runs):
                tic = time.perf_counter()
                curve = cost_curve(target, proposer, largest, force=True)
                took = time.perf_counter() - tic
                doc = json.loads(calibration_file(target, proposer, largest).read_text())
                t1 = curve.seconds[0]
                rows.append({"seconds": round(took, 2), "t1_ms": round(1000 * t1, 2),
                             "ratios": [round(t / t1, 2) for t in curve.seconds[1:]],
                             "draft_ms": {b: round(1000 * d, 2) for b, d in doc.get("draft_seconds", {}).items()},
                             "remeasured": doc.get("remeasured"), "plausible": doc.get("plausible")})  # fmt: skip
                print(condition, json.dumps(rows[-1]), flush=True)
        finally:
            if child is not None:
                child.kill()
                child.wait()
        second = [r["ratios"][0] for r in rows]
        report[condition] = {"T(2)/T(1)": [min(second), max(second)], "median": statistics.median(second),
                             "remeasured": sum(bool(r["remeasured"]) for r in rows), "runs": len(rows)}  # fmt: skip
    print(json.dumps(report))


if __name__ == "__main__":
    main()
