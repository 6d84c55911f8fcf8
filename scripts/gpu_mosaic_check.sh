#!/usr/bin/env bash
# The Mosaic GPU ragged attention kernels on a lent sm_90 GPU (H100 / H200, jax >= 0.11), in one
# short run (< 4 min in all); logs and JSON go to $OUT (default /tmp/gpu-mosaic-check):
#   1. tests/pallas_kernels/test_ragged_paged_attention_mgpu.py compiled (tests/conftest.py:
#      interpret mode is off on a GPU), each test's verdict in pytest-mosaic.log as it finishes;
#      then the MLA kernel's, test_ragged_paged_mla_mgpu.py, into pytest-mosaic-mla.log;
#   2. jaxinfer bench mosaic: decode at the Llama-3-8B heads (Hq 32, Hkv 8, D 128, bf16),
#      B x kv_len in {64 x 2048, 256 x 1024, 128 x 4096}, pages of 16 and 64 tokens, the Mosaic
#      kernel ('mosaic': one warpgroup; 'mosaic_ws': plus a producer warpgroup) against the
#      Triton one ('pallas'), as K/V bytes read / time and % of the copy bandwidth measured in
#      the same run, and dot_product_attention (cuDNN) on the same K/V stored densely; then
#      4 x 16k keys with and without split-KV (kv_splits 8); then an fp8 KV cache (64 x 2048,
#      16-token pages; the bench docstring has its expected outcome); then the Mosaic kernel's stages /
#      pages per step / warp specialization on 64 x 2048 at 16-token pages; last, MLA decode at
#      DeepSeek-V3's widths, bf16 and fp8 (the first cut by the time limit) -> mosaic.json
#      (rewritten after every case).
# Expected (written before any GPU run; the reasoning is in jaxinfer/bench/mosaic.py's docstring):
#   tests: all pass, or a compile error that interpret mode and the sm_90 lowering test cannot
#   see (Mosaic GPU's passes, ptxas) -- then every test fails the same way and the bench rows
#   carry the error.
#   'mosaic': 55-75% of copy bandwidth at 16-token pages, 65-85% at 64-token pages;
#   'mosaic_ws' 5-15 points above 'mosaic'; Triton as measured before: ~66% at 16, 46-50% at 64
#   (H200, benchmarks/results/kernels-nvidia-h200-2026-11-27.json); at 4 x 16k keys <= 30%
#   without splits for every kernel, 55-80% for the Mosaic kernel split 8 ways.
# Timing: tests ~60 s (24 compiled tests, a compile or two each) and the MLA kernel's ~40 s
# (18 compiled), bench ~80 s (~30 compiled kernels, 7 references); limits 80 s + 60 s + 90 s,
# so the whole run stays under 4 minutes. The MLA kernel has never run on a GPU: its tests
# may all fail alike on a compile error that interpret mode and the lowering test cannot see.
#
#   OUT=$OUT bash scripts/gpu_mosaic_check.sh                   # on the GPU machine
#   SMOKE=1 PY=/work/venv312/bin/python bash scripts/gpu_mosaic_check.sh   # CPU, interpret mode
set -u
OUT=${OUT:-/tmp/gpu-mosaic-check}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
section() { echo; echo "=== $1 ($(date +%T))"; }

section "device"
if [ -z "${SMOKE:-}" ]; then
  nvidia-smi --query-gpu=name,compute_cap,memory.total,clocks.max.sm,driver_version --format=csv \
    | tee "$OUT/nvidia-smi.txt"
fi
"$PY" -c "import sys, jax, jaxlib; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())" 2>&1 \
  | tail -1 | tee "$OUT/versions.txt"
git rev-parse --short HEAD 2>/dev/null | tee "$OUT/commit.txt"

section "Mosaic kernel tests, compiled"
TESTS=tests/pallas_kernels/test_ragged_paged_attention_mgpu.py
SELECT=()
# Smoke: two tests in interpret mode (the whole file takes ~6 min on a CPU).
[ -n "${SMOKE:-}" ] && SELECT=(-k "test_decode_batches and 16-32-8-128 or test_null_page")
timeout -k 5 "${TESTS_S:-80}" "$PY" -m pytest -v -ra -p no:cacheprovider -o addopts="" --tb=short \
  "$TESTS" "${SELECT[@]}" > "$OUT/pytest-mosaic.log" 2>&1
echo "rc=$?"; grep -cE " PASSED" "$OUT/pytest-mosaic.log"
grep -E " FAILED| ERROR|passed|failed|^E " "$OUT/pytest-mosaic.log" | head -n 30

section "Mosaic MLA kernel tests, compiled"
MLA_SELECT=()
[ -n "${SMOKE:-}" ] && MLA_SELECT=(-k "test_deepseek_v3_widths")
timeout -k 5 "${MLA_TESTS_S:-60}" "$PY" -m pytest -v -ra -p no:cacheprovider -o addopts="" --tb=short \
  tests/pallas_kernels/test_ragged_paged_mla_mgpu.py "${MLA_SELECT[@]}" > "$OUT/pytest-mosaic-mla.log" 2>&1
echo "rc=$?"; grep -cE " PASSED" "$OUT/pytest-mosaic-mla.log"
grep -E " FAILED| ERROR|passed|failed|^E " "$OUT/pytest-mosaic-mla.log" | head -n 30

section "jaxinfer bench mosaic: Mosaic vs Triton decode"
# Smoke: interpret mode takes ~1 s a call, so one timed run per case and a longer limit.
if [ -n "${SMOKE:-}" ]; then BENCH_LIMIT=${BENCH_S:-300}; REPS_N=${REPS:-1}
else BENCH_LIMIT=${BENCH_S:-90}; REPS_N=${REPS:-10}; fi
timeout -k 5 "$BENCH_LIMIT" "$PY" -m jaxinfer bench mosaic ${SMOKE:+--smoke} --reps "$REPS_N" \
  --out "$OUT/mosaic.json" > "$OUT/bench-mosaic.log" 2>&1
echo "rc=$?"; tail -n 20 "$OUT/bench-mosaic.log"
section "done"
