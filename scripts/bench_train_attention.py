"""Peak MLX memory of one training step at long sequences: all anchors at once vs in groups.

One `StepRunner.loss_and_grads` (forward and backward, no optimizer) on 8
random sequences of `--length` tokens of a random 2-layer hidden-64 qwen3
target (tests/helpers, 512-token vocabulary, so the logits are small),
with a fresh 5-layer drafter at block 16 and 32 anchors per sequence. The
drafter's attention keeps batch x heads x (anchors x block) x (length +
anchors x block) probabilities per layer for the backward pass; `--anchor-chunk`
processes the anchors in groups. Prints the peak and the loss (equal for both).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python3 scripts/bench_train_attention.py --length 4000 --anchor-chunk 32
    ... --anchor-chunk 0   # 0: the default (groups sized for ~1 GB of attention probabilities)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=4000)
    parser.add_argument("--anchor-chunk", type=int, default=0, help="0: automatic")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    import mlx.core as mx
    import mlx_lm
    import numpy as np
    import helpers as tm

    from dflash_mlx.targets.adapter import TargetAdapter
    from dflash_mlx.train.batches import Sequence, make_batch, sample_anchors
    from dflash_mlx.train.features import target_features
    from dflash_mlx.train.new_drafter import drafter_config, new_drafter
    from dflash_mlx.train.options import TrainOptions
    from dflash_mlx.train.step import StepRunner

    with tempfile.TemporaryDirectory() as tmp:
        model = mlx_lm.load(str(tm.make_target(Path(tmp) / "t", "qwen3", num_layers=2, hidden_size=64)))[0]
    config = drafter_config(model, num_layers=5, block_size=16, mask_token_id=tm.MASK_ID, target_layer_ids=[0, 1])
    mx.random.seed(0)
    drafter, target = new_drafter(config), TargetAdapter(model, (0, 1))
    rng = np.random.default_rng(0)
    seqs = [Sequence(tuple(int(t) for t in rng.integers(5, 500, args.length)), 100) for _ in range(8)]
    batch = make_batch(seqs, [sample_anchors(rng, s, 32) for s in seqs], 16, tm.MASK_ID)
    features = target_features(target, batch.ids, 512)
    mx.eval(features)
    options = TrainOptions(model="t", data="d", out="o", block_size=16, anchor_chunk=args.anchor_chunk or None)
    runner = StepRunner(drafter, target, None, None, options)
    mx.reset_peak_memory()
    tic = time.perf_counter()
    loss, _, grads = runner.loss_and_grads(features, batch)
    mx.eval(loss, grads)
    shown = args.anchor_chunk or "auto"
    print(
        f"length {args.length}, anchor chunk {shown}: peak {mx.get_peak_memory() / 1e9:.2f} GB, "
        f"loss {loss.item():.6f}, {time.perf_counter() - tic:.1f} s"
    )


if __name__ == "__main__":
    main()
