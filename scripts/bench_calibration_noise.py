"""How a busy machine bends the block-size calibration, and what the drafter's floor does about it.

Calibrates the bundled demo pair (or --model/--draft) repeatedly, first on a
quiet machine, then while a child process keeps part of one core busy (busy
for --busy-ms, idle for --idle-ms, in a loop), and prints per calibration
T(1), the ratios T(b) / T(1) the policy decides with, the drafter forwards
timed alone, whether the first curve broke the floor T(b) >= T(1) + D(b) / 2
(and was measured again), and how long it took; then per condition the
spread of T(max) / T(1) (median, quartiles, range, sd / mean), where
plain decoding stands against the largest block. Each calibration writes to
a private cache directory.

`--stretches "6,2 12,3"` compares stretch lengths (cycles per plain stretch,
per drafting block's stretch: `calibration.STRETCH`, `DRAFT_STRETCH`): every
run calibrates once with each, in a new random order, so the machine's drift
hits them alike.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python3 scripts/bench_calibration_noise.py --runs 6
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
    ap.add_argument("--stretches", default=None,
                    help='Stretch lengths to compare, "PLAIN,DRAFT ..." (default: the calibration\'s own).')
    ap.add_argument("--conditions", default="quiet,busy", help="Which of quiet,busy to run.")
    args = ap.parse_args()
    pairs = args.stretches.split() if args.stretches else []
    stretches = [tuple(int(n) for n in pair.split(",")) for pair in pairs] or [None]
    if any(s is not None and (len(s) != 2 or min(s) < 2) for s in stretches):
        ap.error('--stretches: pairs of integers >= 2, e.g. "6,2 12,3"')
    os.environ["DFLASH_MLX_CACHE_DIR"] = tempfile.mkdtemp(prefix="dflash-calibration-noise-")

    import dflash_mlx
    from dflash_mlx.models.block_size import default_block_size
    from dflash_mlx.policy import calibration
    from dflash_mlx.policy.calibration import calibration_file, cost_curve
    from dflash_mlx.session import make_session

    model, _, draft = dflash_mlx.load(args.model, args.draft)
    session = make_session(model, draft)
    target, proposer = session.target, session.proposer
    largest = default_block_size(model, draft)
    cost_curve(target, proposer, largest, force=True)  # warm-up: kernels, allocations

    own = (calibration.STRETCH[1], calibration.DRAFT_STRETCH)

    def use(stretch) -> str:
        plain, drafting = stretch or own
        calibration.STRETCH, calibration.DRAFT_STRETCH = {1: plain}, drafting  # (this benchmark only)
        return f"{plain},{drafting}"

    report, order = {}, list(stretches)
    for condition in args.conditions.split(","):
        child = None
        if condition == "busy":
            child = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(args.busy_ms), str(args.idle_ms)])
            time.sleep(0.3)
        rows: dict[str, list[dict]] = {use(st): [] for st in stretches}
        try:
            for _ in range(args.runs):
                random.shuffle(order)
                for stretch in order:
                    name = use(stretch)
                    tic = time.perf_counter()
                    curve = cost_curve(target, proposer, largest, force=True)
                    took = time.perf_counter() - tic
                    doc = json.loads(calibration_file(target, proposer, largest).read_text())
                    t1 = curve.seconds[0]
                    drafts = {b: round(1000 * d, 2) for b, d in doc.get("draft_seconds", {}).items()}
                    row = {"seconds": round(took, 2), "t1_ms": round(1000 * t1, 2),
                           "ratios": [round(t / t1, 2) for t in curve.seconds[1:]], "draft_ms": drafts,
                           "remeasured": doc.get("remeasured"), "plausible": doc.get("plausible")}  # fmt: skip
                    rows[name].append(row)
                    print(condition, name, json.dumps(rows[name][-1]), flush=True)
        finally:
            if child is not None:
                child.kill()
                child.wait()
        for name, runs in rows.items():
            second = [r["ratios"][0] for r in runs]
            last = [r["ratios"][-1] for r in runs]
            quartiles = statistics.quantiles(last, n=4) if len(last) > 1 else [last[0]] * 3
            report[f"{condition} {name}" if args.stretches else condition] = {
                "T(2)/T(1)": [min(second), max(second)], "median": round(statistics.median(second), 2),
                "T(max)/T(1)": {"median": round(statistics.median(last), 2), "range": [min(last), max(last)],
                                "quartiles": [round(quartiles[0], 2), round(quartiles[2], 2)],
                                "sd/mean": round(statistics.pstdev(last) / statistics.mean(last), 3)},
                "seconds": round(statistics.median(r["seconds"] for r in runs), 2),
                "remeasured": sum(bool(r["remeasured"]) for r in runs), "runs": len(runs)}  # fmt: skip
    use(None)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
