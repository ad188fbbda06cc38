#!/usr/bin/env bash
# Launch `shardtrain train` on this node with torchrun (one process per GPU, or NGPU CPU processes with gloo).
#
#   NGPU=8 PIPELINE=librispeech_base scripts/run_train.sh --data s3://b/ls/train --val-data s3://b/ls/dev \
#       --out /ckpt/ls --max-steps 150000 --set train.grad_accum_steps=2
#   NGPU=2 scripts/run_train.sh --data shards/train --val-data shards/dev --out runs/tiny --max-steps 600   # CPU
#
# Env: NGPU (processes on this node; default: number of GPUs, or 1 without CUDA), PIPELINE (default tiny_cpu),
# MAX_RESTARTS (torchrun restarts after a failure; the run resumes from its last checkpoint; default 3),
# NNODES / NODE_RANK / RDZV_ENDPOINT for several nodes (default: one node, --standalone).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
if [ -z "${NGPU:-}" ]; then
  NGPU=$("$PY" -c 'import torch; print(max(torch.cuda.device_count(), 1))')
fi
PIPELINE="${PIPELINE:-tiny_cpu}"
MAX_RESTARTS="${MAX_RESTARTS:-3}"
if [ -n "${RDZV_ENDPOINT:-}" ]; then
  RDZV=(--nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT"
        --rdzv-id "${RDZV_ID:-shardtrain}")
else
  RDZV=(--standalone)
fi
exec "$PY" -m torch.distributed.run "${RDZV[@]}" --nproc-per-node "$NGPU" --max-restarts "$MAX_RESTARTS" \
  -m shardtrain train --pipeline "$PIPELINE" "$@"
