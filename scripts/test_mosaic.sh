#!/usr/bin/env bash
# The Mosaic GPU tests (`pytest -m mosaic`: pallas_kernels' *_mgpu kernels in GPU interpret mode
# on the CPU, and what runs them) under Python 3.12 with jax 0.11, in a second venv beside the
# main one. The README's test command runs this after the main suite (which runs under the jax
# that Python 3.11 resolves, 0.10, where these tests are skipped with the reason).
#
# Why a second Python: Mosaic GPU's interpret mode needs jax >= 0.11, which pip installs for
# Python 3.12 only. Why jax 0.11.2 exactly: it is what the lent GPU machines run, and the
# interpret mode's API has moved between releases (MOSAIC_JAX overrides it).
#
# A machine without Python 3.12 fails here, loudly (exit 1): these tests are never skipped in
# silence. JAXINFER_TEST_PYTHON312=/path/to/python3.12 names the interpreter (as for
# tests/test_packaging.py); otherwise it is looked for as python3.12 on PATH, then through pyenv
# (`pyenv which python3.12`, any 3.12.x among `pyenv versions`, ~/.pyenv/versions/3.12*).
# The venv is MOSAIC_VENV (default .venv312), made once and re-synced each run.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MOSAIC_VENV:-.venv312}
jax_req=${MOSAIC_JAX:-jax==0.11.2}

is_312() { [ -n "$1" ] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }

find_python312() {
  local c v root
  # A pyenv shim named python3.12 may be on PATH and still fail ("command not found" when 3.12
  # is not the active version): every candidate is run before it is taken.
  for c in "${JAXINFER_TEST_PYTHON312:-}" "$(command -v python3.12 || true)" \
           "$(pyenv which python3.12 2>/dev/null || true)"; do
    if is_312 "$c"; then echo "$c"; return 0; fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    root=$(pyenv root)
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -t. -k3 -n -r); do
      c="$root/versions/$v/bin/python3.12"
      if is_312 "$c"; then echo "$c"; return 0; fi
    done
  fi
  for c in "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do  # pyenv installed but not on PATH
    if is_312 "$c"; then echo "$c"; return 0; fi
  done
  return 1
}

if ! py=$(find_python312); then
  echo "scripts/test_mosaic.sh: FAILED: no working Python 3.12 found (looked at \$JAXINFER_TEST_PYTHON312," \
       "python3.12 on PATH, 'pyenv which python3.12', 'pyenv versions' and ~/.pyenv/versions). The Mosaic GPU" \
       "tests need jax >= 0.11, which needs Python 3.12: install it (pyenv install 3.12) or set" \
       "JAXINFER_TEST_PYTHON312=/path/to/python3.12." >&2
  exit 1
fi
echo "scripts/test_mosaic.sh: Python 3.12 at $py, venv $venv, $jax_req"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/pip" install -q -e ".[test]" "$jax_req"
if ! "$venv/bin/python" -c '
import sys, jax
from pallas_kernels.ragged_paged_attention_mgpu import MOSAIC_AVAILABLE
sys.exit(0 if MOSAIC_AVAILABLE else f"jax {jax.__version__} has no Mosaic GPU interpret mode")'; then
  echo "scripts/test_mosaic.sh: FAILED: $venv cannot run Mosaic GPU in interpret mode (above)" >&2
  exit 1
fi
start=$(date +%s)
rc=0
"$venv/bin/python" -m pytest -q -m mosaic -n 2 --dist loadfile || rc=$?
echo "scripts/test_mosaic.sh: pytest -m mosaic (Python 3.12, $("$venv/bin/python" -c 'import jax; print("jax", jax.__version__)')) ran $(( $(date +%s) - start )) s, exit $rc"
exit $rc
