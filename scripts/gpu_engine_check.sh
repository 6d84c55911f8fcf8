#!/usr/bin/env bash
# The engine core's GPU rows (issue 37) in one short run on a lent H100 / H200; logs and JSON go
# to $OUT (default /tmp/gpu-engine-check):
#   jaxinfer bench offline --gpu: a Llama-3-8B-shaped model (random bf16 weights), the Pallas (Triton)
#   attention, batch-1 decode against the bandwidth roofline (weights + the KV a token reads,
#   over a copy bandwidth measured in the same run) and 256 prompts x 128/128, at the GPU's
#   backend-sized step budget (8192 tokens), with a traced batch-1 run (GPU busy vs wall time
#   per step: the host time the device waits for).
# What it checks: the step waits on no lax.cond predicate and launches n + 1 while n runs, so
# batch 1 should approach the device time per token (the weights' bytes over the copy
# bandwidth, plus launch gaps), and 256 prompts should take fewer, larger steps with the host's
# work overlapped. The baseline and the latest run: docs/performance.md, "offline-gpu-*".
#   OUT=$OUT bash scripts/gpu_engine_check.sh          # on the GPU machine (wheels in .whl/, see gpu_check.sh)
#   SMOKE=1 bash scripts/gpu_engine_check.sh           # CPU, tiny shapes
set -u
OUT=${OUT:-/tmp/gpu-engine-check}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null && [ -z "${SMOKE:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
echo "=== jaxinfer bench offline --gpu ($(date +%T))"
if [ -n "${SMOKE:-}" ]; then
  timeout -k 5 "${OFFLINE_S:-600}" "$PY" -m jaxinfer bench offline --gpu --smoke --attention-impls xla \
    --max-num-batched-tokens 64 --out "$OUT/offline-gpu.json" > "$OUT/offline.log" 2>&1
else
  timeout -k 5 "${OFFLINE_S:-300}" "$PY" -m jaxinfer bench offline --gpu --profile "${PROFILE:-all}" --attention-impls pallas \
    --gpu-formats bf16 --kv-cache-dtypes auto --num-prompts 256 --max-num-batched-tokens 8192 --kv-cache-gb 16 \
    --timeout "${OFFLINE_S:-300}" --out "$OUT/offline-gpu.json" > "$OUT/offline.log" 2>&1
fi
echo "rc=$?"; tail -n 12 "$OUT/offline.log"
pkill -f -- "--gpu-worker" 2>/dev/null
