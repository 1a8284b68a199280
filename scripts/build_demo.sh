#!/usr/bin/env bash
# Build the bundled demo pair (dflash_mlx/demo/): a small qwen3 target trained
# from scratch on GSM8K train, and a DFlash drafter trained for it with
# `dflash-mlx train` on the target's own answers. Each step resumes where it
# stopped; WORK keeps checkpoints and caches (not part of the repository).
#
#   WORK=/work/demo_build bash scripts/build_demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/dflash-demo}
TARGET_EPOCHS=${TARGET_EPOCHS:-2.3}
DRAFT_STEPS=${DRAFT_STEPS:-1200}
DRAFT_PROMPTS=${DRAFT_PROMPTS:-2000}
if [ "$(uname -s)" = Linux ] && [ -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ]; then
  export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
fi
mkdir -p "$WORK"

# 1. Tokenizer (byte-level BPE, ChatML specials, a dedicated <|mask|>) and target.
[ -e "$WORK/tokenizer/tokenizer.json" ] || python3 scripts/build_demo_target.py tokenizer --work "$WORK"
python3 scripts/build_demo_target.py train --work "$WORK" --epochs "$TARGET_EPOCHS"
python3 scripts/build_demo_target.py export --work "$WORK" --out "$WORK/target"

# 2. Drafter prompts: GSM8K train questions in the benchmark's prompt format.
python3 - "$WORK/draft_prompts.jsonl" "$DRAFT_PROMPTS" <<'PY'
import json, sys
from pathlib import Path
from dflash_mlx.datasets import GSM8K_FORMAT
rows = [json.loads(l) for l in Path("../shared/datasets/gsm8k_train.jsonl").read_text().splitlines()]
out = Path(sys.argv[1]); n = int(sys.argv[2])
out.write_text("".join(json.dumps({"messages": [{"role": "user", "content": GSM8K_FORMAT.format(question=r["question"])}]}) + "\n" for r in rows[:n]))
PY

# 3. The drafter: the target regenerates the answers, then DFlash training.
python3 -m dflash_mlx train --model "$WORK/target" --data "$WORK/draft_prompts.jsonl" \
  --out "$WORK/draft" --steps "$DRAFT_STEPS" --block-size 8 --draft-layers 2 --max-tokens 256 \
  --max-length 512 --batch-size 16 --anchors-per-seq 16 --lr 6e-4 --holdout 32 --val-max-tokens 192 \
  --gen-batch-size 64 --target-dtype float32 --save-dtype bfloat16 --save-every 200 \
  $([ -e "$WORK/draft/work/checkpoints" ] && echo --resume)

# 4. Package both (bfloat16) with the dataset licence.
rm -rf dflash_mlx/demo/target dflash_mlx/demo/draft
mkdir -p dflash_mlx/demo
cp -r "$WORK/target" dflash_mlx/demo/target
mkdir -p dflash_mlx/demo/draft
cp "$WORK/draft/config.json" "$WORK/draft/model.safetensors" dflash_mlx/demo/draft/
cp ../shared/datasets/LICENSE.gsm8k dflash_mlx/demo/LICENSE.gsm8k
du -sh dflash_mlx/demo
