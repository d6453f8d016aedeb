#!/usr/bin/env bash
# GPU check of the distributed path (docs/distributed.md): NCCL with 2 ranks when there are 2+
# GPUs, else 1 rank with CUDA. Trains the built-in model for 3 rollouts with a save after each,
# resumes the same command for 2 more, and lists the checkpoints' digests.
# Usage: scripts/gpu_check.sh [OUT_DIR]   (needs the CUDA build of torch, see the README)
# Until this script has passed on a GPU machine, treat the NCCL path as untested
# (docs/distributed.md says so).
set -euo pipefail
OUT=${1:-/tmp/mileage_gpu_check}
PY=${PYTHON:-python}
GPUS=$($PY -c 'import torch; print(torch.cuda.device_count())')
if [ "$GPUS" -lt 1 ]; then echo "gpu_check: no CUDA device visible" >&2; exit 2; fi
NPROC=$(( GPUS >= 2 ? 2 : 1 ))
export CUBLAS_WORKSPACE_CONFIG=:4096:8
rm -rf "$OUT"
ARGS=(--rollout-batch-size 8 --n-samples-per-prompt 4 --global-batch-size 16 --eval-interval 0
      --num-threads 1 --save "$OUT/run" --load "$OUT/run" --save-interval 1)
$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
# a 1-GPU run must train on the GPU: the parameters, the batch and the optimizer state (and the
# reference's parameters, with a KL loss) are checked to live there; exit 1 if any is on the CPU
echo "== 1 rank, --device cuda: where the tensors live"
$PY scripts/gpu_devices.py --expect cuda -- "${ARGS[@]/$OUT\/run/$OUT/devices}" --num-rollout 1 \
    --device cuda --use-kl-loss --kl-loss-coef 0.01
echo "proved: one process trains on cuda (parameters, batch, optimizer state, reference)"
if [ "$NPROC" -ge 2 ]; then
  echo "== 2 ranks, NCCL: where each rank's shards live"
  $PY -m torch.distributed.run --nproc-per-node 2 --standalone scripts/gpu_devices.py \
      --expect cuda -- "${ARGS[@]/$OUT\/run/$OUT/devices2}" --num-rollout 1
  echo "proved: each torchrun rank trains its shards on its own GPU"
fi
echo "== $NPROC rank(s), NCCL if 2"
$PY -m torch.distributed.run --nproc-per-node "$NPROC" --standalone -m mileage train "${ARGS[@]}" --num-rollout 3
$PY -m torch.distributed.run --nproc-per-node "$NPROC" --standalone -m mileage train "${ARGS[@]}" --num-rollout 5
$PY -m mileage ckpt verify "$OUT/run"
$PY -m mileage ckpt ls "$OUT/run"
echo "proved: $NPROC rank(s) train, save and resume on the GPU"
echo "== packing (--use-dynamic-batch-size): packed against padded, then a packed run resumed"
$PY scripts/gpu_packing.py --device cuda --precision bf16
PARGS=("${ARGS[@]/$OUT\/run/$OUT/packed}" --use-dynamic-batch-size --max-tokens-per-gpu 64)
$PY -m torch.distributed.run --nproc-per-node "$NPROC" --standalone -m mileage train "${PARGS[@]}" --num-rollout 2
$PY -m torch.distributed.run --nproc-per-node "$NPROC" --standalone -m mileage train "${PARGS[@]}" --num-rollout 3
$PY -m mileage ckpt verify "$OUT/packed"
echo "proved: packed micro-batches match padded ones on the GPU (the kernel named above) and resume"
echo "== --fsdp-cpu-offload: shards on the host, checkpoints between offloaded and resident shards"
$PY -m torch.distributed.run --nproc-per-node "$NPROC" --standalone tests/offload_worker.py "$OUT/offload" | tee "$OUT/offload.log"
test "$(grep -c '^OK ' "$OUT/offload.log")" -eq 5
if [ "$NPROC" -ge 2 ]; then
  OARGS=("${ARGS[@]/$OUT\/run/$OUT/offloaded}" --fsdp-cpu-offload)
  $PY -m torch.distributed.run --nproc-per-node 2 --standalone -m mileage train "${OARGS[@]}" --num-rollout 2
  # the same checkpoint resumed without offload
  $PY -m torch.distributed.run --nproc-per-node 2 --standalone -m mileage train "${ARGS[@]/$OUT\/run/$OUT/offloaded}" --num-rollout 3
  $PY -m mileage ckpt verify "$OUT/offloaded"
fi
echo "proved: FSDP2 CPU offload holds less GPU memory (the MiB above), trains like resident shards, and checkpoints move between the two"

# Rollout servers on the GPU, when their packages are installed in this Python (SGLANG_PYTHON /
# VLLM_PYTHON may name other environments). Written for a GPU machine; not run yet.
MODEL=$($PY -c 'from mileage.rollout.builtin_model import builtin_model_dir; print(builtin_model_dir("addition"))')
SPY=${SGLANG_PYTHON:-$PY}
if $SPY -c 'import sglang' 2>/dev/null; then
  echo "== SGLang on the GPU (--enable-deterministic-inference): disk sync, then broadcast in buckets"
  PORT=30017
  $SPY -m sglang.launch_server --model-path "$MODEL" --port "$PORT" --skip-tokenizer-init \
      --enable-deterministic-inference --mem-fraction-static 0.3 > "$OUT/sglang.log" 2>&1 &
  SPID=$!
  trap 'kill $SPID 2>/dev/null || true' EXIT
  for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 2; done
  SARGS=(--rollout-engine sglang --rollout-url "http://127.0.0.1:$PORT" --num-rollout 2
         --rollout-batch-size 8 --n-samples-per-prompt 4 --eval-interval 0 --num-threads 1)
  $PY -m mileage train "${SARGS[@]}" --save "$OUT/sglang_disk"
  $PY -m mileage train "${SARGS[@]}" --save "$OUT/sglang_bcast" --rollout-weight-sync broadcast \
      --update-weight-buffer-size 4000000 | tee "$OUT/sglang_bcast.log"
  grep -q "weights by broadcast in [2-9][0-9]* bucket" "$OUT/sglang_bcast.log"
  $PY -m mileage plot "$OUT/sglang_disk" >/dev/null
  grep -o '"logprob_abs_diff": [0-9.e-]*' "$OUT/sglang_disk/metrics.jsonl" "$OUT/sglang_bcast/metrics.jsonl"
  kill "$SPID"; trap - EXIT
  echo "proved: SGLang honours seeds (the run was not refused), loads weights from disk and by broadcast in buckets"
else
  echo "== SGLang not installed in $SPY: skipped"
fi
VPY=${VLLM_PYTHON:-$PY}
if $VPY -c 'import vllm' 2>/dev/null; then
  echo "== vLLM launched by mileage on the GPU (no CPU-only launch flags)"
  $PY -m mileage train --rollout-engine vllm --vllm-python "$VPY" --num-rollout 2 \
      --rollout-batch-size 8 --n-samples-per-prompt 4 --eval-interval 0 --num-threads 1 \
      --save "$OUT/vllm" --vllm-args "--gpu-memory-utilization 0.3"
  echo "proved: vLLM on the GPU reloads the trained weights each rollout"
  echo "== vLLM colocated in the trainer's process, asleep while training runs (--offload-rollout)"
  # needs mileage in $VPY too (docs/engines.md: pip install --no-deps -e . into the vLLM env)
  CARGS=(--rollout-engine vllm --colocate --offload-rollout --rollout-batch-size 8
         --n-samples-per-prompt 4 --eval-interval 0 --num-threads 1 --save "$OUT/colocate"
         --load "$OUT/colocate" --vllm-args "--gpu-memory-utilization 0.3")
  $VPY -m mileage train "${CARGS[@]}" --num-rollout 2 | tee "$OUT/colocate.log"
  $VPY -m mileage train "${CARGS[@]}" --num-rollout 3 | tee -a "$OUT/colocate.log"
  # mem_get_info before and after the first sleep and wake of each launch: sleep frees memory
  grep "colocated vLLM asleep: GPU memory free" "$OUT/colocate.log"
  grep "colocated vLLM awake: GPU memory free" "$OUT/colocate.log"
  grep "colocated vLLM asleep" "$OUT/colocate.log" | awk '{ if ($(NF-1) + 0 <= $(NF-3) + 0) exit 1 }'
  grep -o '"logprob_abs_diff": [0-9.e-]*' "$OUT/colocate/metrics.jsonl"
  $PY -m mileage ckpt verify "$OUT/colocate"
  echo "proved: colocated vLLM on the GPU releases its memory while training runs (the GiB above), takes the weights in memory, and resumes"
else
  echo "== vLLM not installed in $VPY: skipped"
fi
echo "gpu_check: OK"
