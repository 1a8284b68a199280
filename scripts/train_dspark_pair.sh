#!/usr/bin/env bash
# Train two drafters of the same size for the bundled demo target, the same way
# (the same GSM8K train prompts, steps, block and backbone): a DFlash drafter
# and a DSpark drafter (`dflash-mlx train --arch dspark`: the same backbone plus
# a Markov and a confidence head). `dflash-mlx bench` then compares them on the
# same prompts (docs/benchmarks.md gives the commands). Each run resumes where
# it stopped; WORK keeps both runs (not part of the repository).
#
#   WORK=/tmp/dflash-dspark-pair bash scripts/train_dspark_pair.sh
#
# Settings (environment): STEPS (1200, as the bundled drafter), PROMPTS (2000),
# MARKOV_RANK (64), GSM8K_TRAIN (the GSM8K train split, JSONL with "question").
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/dflash-dspark-pair}
STEPS=${STEPS:-1200}
PROMPTS=${PROMPTS:-2000}
MARKOV_RANK=${MARKOV_RANK:-64}
GSM8K_TRAIN=${GSM8K_TRAIN:-../shared/datasets/gsm8k_train.jsonl}
MAX_TOKENS=${MAX_TOKENS:-256}
HOLDOUT=${HOLDOUT:-32}
if [ "$(uname -s)" = Linux ] && [ -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ]; then
  export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
fi
mkdir -p "$WORK"
TARGET=$(python3 -c 'from dflash_mlx.models.registry import lookup; print(lookup("demo").target_path())')

# 1. Prompts: GSM8K train questions in the benchmark's prompt format (as scripts/build_demo.sh).
python3 - "$GSM8K_TRAIN" "$WORK/prompts.jsonl" "$PROMPTS" <<'PY'
import json, sys
from pathlib import Path
from dflash_mlx.datasets import GSM8K_FORMAT
rows = [json.loads(l) for l in Path(sys.argv[1]).read_text().splitlines()]
out, n = Path(sys.argv[2]), int(sys.argv[3])
out.write_text("".join(json.dumps({"messages": [{"role": "user", "content": GSM8K_FORMAT.format(question=r["question"])}]}) + "\n" for r in rows[:n]))
PY

# 2. Both drafters, the same options (the responses the target regenerates are cached once and shared).
for ARCH in dflash dspark; do
  EXTRA=()
  [ "$ARCH" = dspark ] && EXTRA+=(--markov-rank "$MARKOV_RANK")
  [ -e "$WORK/$ARCH/work/checkpoints" ] && EXTRA+=(--resume)
  python3 -m dflash_mlx train --arch "$ARCH" --model "$TARGET" --data "$WORK/prompts.jsonl" \
    --out "$WORK/$ARCH" --responses "$WORK/responses.jsonl" --steps "$STEPS" --block-size 8 --draft-layers 2 \
    --max-tokens "$MAX_TOKENS" --max-length 512 --batch-size 16 --anchors-per-seq 16 --lr 6e-4 \
    --holdout "$HOLDOUT" --val-max-tokens 192 --gen-batch-size 64 --target-dtype float32 --save-every 200 \
    --seed 0 ${EXTRA[@]+"${EXTRA[@]}"}
done
echo "Drafters: $WORK/dflash $WORK/dspark (held-out acceptance in each training_report.json)"
