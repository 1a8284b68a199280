#!/usr/bin/env bash
# The MTP benchmark (docs/benchmarks.md): a target's own trained MTP heads against a DFlash drafter of the
# same target, with `dflash-mlx bench`. The target is the demo target's size and training (GSM8K train,
# scripts/build_demo_target.py) in MiMo's architecture, whose checkpoints keep MTP heads; its DFlash drafter
# is trained as the demo's (`dflash-mlx train`), its heads with `dflash-mlx train --arch mtp` on the same
# prompts (written into a copy of the target: $WORK/target-mtp). Then both legs on the same prompts.
# Each step resumes or is skipped when its output exists; WORK keeps everything.
#
#   WORK=/tmp/dflash-mtp-bench bash scripts/build_mtp_bench.sh
#
# A tiny smoke run (minutes, numbers meaningless):
#   WORK=/tmp/mtp-smoke TARGET_EPOCHS=0.02 DRAFT_STEPS=20 MTP_STEPS=20 DRAFT_PROMPTS=64 NUM_PROMPTS=2 \
#     MAX_TOKENS=32 bash scripts/build_mtp_bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/dflash-mtp-bench}
TARGET_EPOCHS=${TARGET_EPOCHS:-2.3}
DRAFT_STEPS=${DRAFT_STEPS:-1200}
MTP_STEPS=${MTP_STEPS:-1200}
DRAFT_PROMPTS=${DRAFT_PROMPTS:-2000}
NUM_PROMPTS=${NUM_PROMPTS:-20}
MAX_TOKENS=${MAX_TOKENS:-192}
export GSM8K_TRAIN=${GSM8K_TRAIN:-$(cd .. && pwd)/shared/datasets/gsm8k_train.jsonl}
if [ "$(uname -s)" = Linux ] && [ -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ]; then
  export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
fi
mkdir -p "$WORK"

# 1. The target: the demo's tokenizer, size and data, MiMo's architecture.
[ -e "$WORK/tokenizer/tokenizer.json" ] || python3 scripts/build_demo_target.py tokenizer --work "$WORK"
python3 scripts/build_demo_target.py train --work "$WORK" --epochs "$TARGET_EPOCHS" --family mimo
[ -e "$WORK/target/config.json" ] || python3 scripts/build_demo_target.py export --work "$WORK" --out "$WORK/target" --family mimo

# 2. Prompts: GSM8K train questions in the benchmark's format.
python3 - "$WORK/prompts.jsonl" "$DRAFT_PROMPTS" <<'PY'
import json, os, sys
from pathlib import Path
from dflash_mlx.datasets import GSM8K_FORMAT
rows = [json.loads(l) for l in Path(os.environ["GSM8K_TRAIN"]).read_text().splitlines()]
out = Path(sys.argv[1]); n = int(sys.argv[2])
out.write_text("".join(json.dumps({"messages": [{"role": "user", "content": GSM8K_FORMAT.format(question=r["question"])}]}) + "\n" for r in rows[:n]))
PY

# 3. The DFlash drafter (as the demo's), and the target's MTP heads on the same prompts.
[ -e "$WORK/draft/training_report.json" ] || python3 -m dflash_mlx train --model "$WORK/target" \
  --data "$WORK/prompts.jsonl" --out "$WORK/draft" --steps "$DRAFT_STEPS" --block-size 8 --draft-layers 2 \
  --max-tokens 256 --max-length 512 --batch-size 16 --anchors-per-seq 16 --lr 6e-4 --holdout 32 \
  --val-max-tokens 192 --gen-batch-size 64 --target-dtype float32 --save-every 200 \
  $([ -e "$WORK/draft/work/checkpoints" ] && echo --resume)
[ -e "$WORK/target-mtp/training_report.json" ] || python3 -m dflash_mlx train --arch mtp --model "$WORK/target" \
  --data "$WORK/prompts.jsonl" --out "$WORK/target-mtp" --steps "$MTP_STEPS" --block-size 3 --max-tokens 256 \
  --max-length 512 --batch-size 16 --lr 6e-4 --holdout 32 --val-max-tokens 192 --gen-batch-size 64 \
  --target-dtype float32 --responses "$WORK/draft/work/responses.jsonl"

# 4. Both legs against mlx-lm on the same prompts and target (the heads' copy holds the target's weights).
dflash-mlx bench --model "$WORK/target-mtp" --draft "$WORK/draft" --dataset gsm8k --num-prompts "$NUM_PROMPTS" \
  --max-tokens "$MAX_TOKENS" -b auto -b 4 --lookup off --out "$WORK/bench-dflash.json"
dflash-mlx bench --model "$WORK/target-mtp" --draft mtp --dataset gsm8k --num-prompts "$NUM_PROMPTS" \
  --max-tokens "$MAX_TOKENS" -b auto -b 3 --lookup off --out "$WORK/bench-mtp.json"
