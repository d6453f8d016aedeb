#!/usr/bin/env bash
# The recipe of docs/recipe.md: GRPO on SmolLM2-135M-Instruct with a reasoning-gym task (1-2 digit
# addition, graded by the task's own scorer), on CPU. Prints the wall time, the reward of the first
# and last rollouts and the held-out score before and after, and draws the metrics plot.
#
#   scripts/recipe_gym_arithmetic.sh [OUT_DIR]        (default runs/recipe)
#   THREADS=2 ROLLOUTS=20 LR=1e-5 TEMP=1.0 LEN=16 scripts/recipe_gym_arithmetic.sh   (the defaults)
#   LORA=16 scripts/recipe_gym_arithmetic.sh runs/recipe-lora   (a rank-16 adapter on every linear
#                                  layer, alpha 2 x rank; LR then defaults to 1e-4, see docs/recipe.md)
#
# Rerunning the same command after a kill resumes exactly; on a finished run it only reports.
set -euo pipefail
OUT=${1:-runs/recipe}
THREADS=${THREADS:-2}
ROLLOUTS=${ROLLOUTS:-20}
LORA=${LORA:-0}
if [ "$LORA" -gt 0 ]; then
  # an adapter's update is low-rank and starts at zero: it takes a larger step than full weights
  LR=${LR:-1e-4}
  ADAPTER=(--lora-rank "$LORA" --lora-alpha "$((2 * LORA))" --target-modules all-linear)
else
  LR=${LR:-1e-5}
  ADAPTER=()
fi
TEMP=${TEMP:-1.0}
LEN=${LEN:-16}
PY=${PY:-python}
HF=$($PY -m mileage smollm2 | tail -n 1)

TASK='gym:basic_arithmetic?size=2000&seed=1&min_digits=1&max_digits=2&max_terms=2&operators=+'
TASK+='&allow_parentheses=false&allow_negation=false&instruction=Reply with only the number.'

mkdir -p "$(dirname "$OUT")"
start=$(date +%s)
$PY -m mileage train --hf-checkpoint "$HF" --prompt-data "$TASK" --apply-chat-template \
  --num-rollout "$ROLLOUTS" --rollout-batch-size 8 --n-samples-per-prompt 8 \
  --rollout-max-response-len "$LEN" --rollout-temperature "$TEMP" --lr "$LR" \
  --eval-interval 10 --num-threads "$THREADS" "${ADAPTER[@]}" \
  --save "$OUT" --load "$OUT" --save-interval 10 --save-keep-last 1 2>&1 | tee -a "$OUT.log"
end=$(date +%s)
echo "wall time of this invocation: $((end - start)) s"

$PY -m mileage plot "$OUT"
$PY - "$OUT" <<'EOF'
import json, sys
records = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")]
before = [r["eval_accuracy"] for r in records if r["rollout_id"] == -1]
records = [r for r in records if r["rollout_id"] >= 0]  # -1: the evaluation before training
first, last = records[:5], records[-5:]
mean = lambda rs, key: sum(r[key] for r in rs) / len(rs)
print(f"rollouts {len(records)}; reward (mean of 5 rollouts) first {mean(first, 'reward_mean'):.3f}"
      f" -> last {mean(last, 'reward_mean'):.3f}; exact answers {mean(first, 'accuracy'):.3f}"
      f" -> {mean(last, 'accuracy'):.3f}")
evals = [(r["rollout_id"], r["eval_accuracy"]) for r in records if r.get("eval_accuracy") is not None]
print("held-out score before training:", ", ".join(f"{a:.3f}" for a in before) or "not recorded")
print("held-out score after rollout:", ", ".join(f"{i}: {a:.3f}" for i, a in evals))
EOF
