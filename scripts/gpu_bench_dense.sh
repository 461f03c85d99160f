#!/usr/bin/env bash
# GPU benchmark of the HSTU Triton kernel: HSTU (Triton) against the SDPA Transformer, fwd +
# bwd in bf16 at 1,024 / 4,096 / 8,192 tokens per row, and the kernel's deviation from the
# fp64 reference. Run from the repository root after the README's install with the [gpu]
# extra, on a machine with CUDA:
#
#   bash scripts/gpu_bench_dense.sh                  # JSON to runs/bench-dense-cuda.json
#   QUICK=--quick bash scripts/gpu_bench_dense.sh    # 1,024 and 4,096 only, 5 rounds
set -euo pipefail
OUT=${OUT:-runs/bench-dense-cuda.json}
mkdir -p "$(dirname "$OUT")"
GENREC_BENCH_DEVICE=cuda genrec bench dense ${QUICK:-} --allow-noisy --json "$OUT"
echo "gpu_bench_dense: figures in $OUT"
