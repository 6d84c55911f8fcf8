#!/usr/bin/env bash
# The checks only a GPU can make, in one short run (a lent H100 / H200: see docs/ARCHITECTURE.md,
# "GPU"). Each section has its own time limit, so one that hangs does not cost the others;
# logs and JSON go to $OUT (default /tmp/gpu-check).
#   1. the Pallas kernels' tests, compiled (tests/conftest.py: PALLAS_INTERPRET is off on a GPU);
#   2. jaxinfer bench offline --gpu: a Llama-3-8B-shaped model, bf16 vs fp8 weights (KVS=auto,fp8 adds
#      an fp8 KV cache), batch-1 decode against the bandwidth roofline and 256-prompt
#      throughput, the compiled HLO of one fp8 / bf16 linear (is a full-precision weight copy
#      written?), and with PROFILE=1 a traced batch-1 run (GPU busy vs wall time per step);
#   3. jaxinfer bench kernels: the attention kernels against the copy / matmul ceilings.
# Budget: on an H200 the four bench_offline rows compile side by side in about two minutes and
# the whole takes a few; each test file tens of seconds (each case compiles its kernel).
# The GPU image has jax 0.11 and no network: wheels it lacks (llguidance, gguf) travel in .whl/:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_31_x86_64 -d .whl llguidance==1.9.1 gguf==0.19.0
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
section() { echo; echo "=== $1 ($(date +%T))"; }

section "device"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1
git rev-parse --short HEAD 2>/dev/null | tee "$OUT/commit.txt"

section "Pallas kernel tests, compiled"
# -v: each test's verdict is in the log as it finishes, even if the time limit cuts the run.
timeout -k 5 "${OPS_TESTS_S:-60}" python3 -m pytest -v -p no:cacheprovider -o addopts="" --tb=short \
  tests/test_ops.py -k "pallas or quantized" > "$OUT/pytest-ops.log" 2>&1
echo "rc=$?"; grep -cE " PASSED" "$OUT/pytest-ops.log"; grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest-ops.log" | tail -n 8
# The ragged kernel's file stops at its first failure, so its traceback is in the log however
# the time limit falls; the other kernels' files run whole.
timeout -k 5 "${RAGGED_TESTS_S:-90}" python3 -m pytest -v -x -p no:cacheprovider -o addopts="" --tb=short \
  tests/pallas_kernels/test_ragged_paged_attention.py > "$OUT/pytest-ragged.log" 2>&1
echo "rc=$?"; grep -cE " PASSED" "$OUT/pytest-ragged.log"; grep -E " FAILED| ERROR|passed|failed|Error|^E " "$OUT/pytest-ragged.log" | tail -n 25
timeout -k 5 "${TESTS_S:-120}" python3 -m pytest -v -p no:cacheprovider -o addopts="" --tb=short \
  -m "not gpu and not triton_lowering" \
  tests/pallas_kernels/test_spec_accept.py tests/pallas_kernels/test_flash_attention.py \
  tests/pallas_kernels/test_ragged_paged_mla.py > "$OUT/pytest-kernels.log" 2>&1
echo "rc=$?"; grep -cE " PASSED" "$OUT/pytest-kernels.log"; grep -E " FAILED| ERROR|passed|failed" "$OUT/pytest-kernels.log" | tail -n 12
# The tests marked gpu / triton_lowering (pyproject.toml): CI skips them, counted in its summary line.
timeout -k 5 "${MARKED_TESTS_S:-120}" python3 -m pytest -v -p no:cacheprovider -o addopts="" --tb=short \
  -m "gpu or triton_lowering" tests/pallas_kernels > "$OUT/pytest-marked.log" 2>&1
echo "rc=$?"; grep -cE " PASSED" "$OUT/pytest-marked.log"; grep -E " FAILED| ERROR|passed|failed|not run" "$OUT/pytest-marked.log" | tail -n 12

section "jaxinfer bench offline --gpu"
mkdir -p "$OUT/hlo"
timeout -k 5 "${OFFLINE_S:-240}" python3 -m jaxinfer bench offline --gpu --concurrent-compile ${PROFILE:+--profile} \
  --attention-impls pallas --gpu-formats "${FORMATS:-bf16,fp8}" --kv-cache-dtypes "${KVS:-auto}" \
  --num-prompts 256 --kv-cache-gb 9 --timeout "${OFFLINE_S:-240}" \
  --hlo-dir "$OUT/hlo" --out "$OUT/offline-gpu.json" > "$OUT/offline.log" 2>&1
echo "rc=$?"; tail -n 12 "$OUT/offline.log"
pkill -f -- "--gpu-worker" 2>/dev/null; sleep 1
(cd "$OUT/hlo" && tar czf ../hlo.tgz . 2>/dev/null) && rm -rf "$OUT/hlo"

if [ "${KERNELS_S:-90}" != 0 ]; then
  section "jaxinfer bench kernels"
  timeout -k 5 "${KERNELS_S:-90}" python3 -m jaxinfer bench kernels --gpu --reps 5 --sections "${SECTIONS:-decode,prefill}" \
    --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
  echo "rc=$?"; tail -n 25 "$OUT/kernels.log"
fi
section "done"
