#!/usr/bin/env bash
# GPU smoke run: the demo model on a small synthetic log, trained under NCCL by torchrun on
# every GPU of this machine (at most 8), resumed on one GPU fewer (a world-size change),
# then exported and evaluated. Exits non-zero at the first failure; prints where its files
# are. Run it from the repository root after the README's install, on a machine with CUDA:
#
#   bash scripts/gpu_smoke.sh                 # all GPUs (2 or more for the NCCL exchange)
#   NPROC=2 STEPS=200 bash scripts/gpu_smoke.sh
#
# What it checks: the store's rows on each rank's GPU (sparse.device follows the trainer),
# its metadata over gloo and its rows and gradients over NCCL in one process group
# ("cpu:gloo,cuda:nccl"), DDP and FSDP2 on the dense model, bf16 autocast, checkpoints that
# resume on another world size, and an artifact that evaluates.
set -euo pipefail

GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -lt 1 ]; then
  echo "gpu_smoke: no CUDA device here (torch.cuda.device_count() is 0)" >&2
  exit 2
fi
NPROC=${NPROC:-$(( GPUS < 8 ? GPUS : 8 ))}
STEPS=${STEPS:-100}
OUT=${OUT:-$(mktemp -d -t genrec-gpu-smoke-XXXXXX)}
echo "gpu_smoke: $NPROC rank(s) on $GPUS GPU(s), $STEPS steps, files in $OUT"

genrec synth --out "$OUT/logs" --users 20000 --items 20000 --events 400000 --seed 0
genrec prepare --logs "$OUT/logs" --out "$OUT/data" --config configs/demo.toml

train() {  # train NPROC PARALLEL MAX_STEPS
  torchrun --nproc-per-node "$1" --master-port "${MASTER_PORT:-29511}" -m genrec.scripts.cli train \
    --config configs/demo.toml --set data.path="$OUT/data" --set train.out_dir="$OUT/run" \
    --set train.dense_parallel="$2" --set train.max_steps="$3" --set train.checkpoint_every="$(( STEPS / 2 ))"
}
train "$NPROC" ddp "$(( STEPS / 2 ))"
if [ "$NPROC" -gt 1 ]; then
  train "$(( NPROC - 1 ))" fsdp2 "$STEPS"   # resumes the DDP checkpoint on one rank fewer
else
  train 1 fsdp2 "$STEPS"
fi
genrec export --checkpoint "$OUT/run" --out "$OUT/artifact" --dtype int8
genrec eval --checkpoint "$OUT/run" --data "$OUT/data" --out "$OUT/report"
echo "gpu_smoke: passed; report in $OUT/report/report.md"
