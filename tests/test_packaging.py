"""The wheel a user installs with `pip install jaxinfer` (not `pip install -e`): it must carry
every file the CPU kernels are compiled from, or every such user silently gets the slower XLA
fallback for int8 / int4 / fp8 weights on CPU. And installed as a user installs it (a fresh
Python 3.12 venv, dependencies from the package index) it runs the kernels and answers the
quickstart question."""

import importlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import jax
import pytest

from conftest import FUSION_EMITTERS_OFF

# The module, not the function cpu_kernels re-exports under the same name.
int8_matmul_module = importlib.import_module("cpu_kernels.int8_matmul")

REPO = Path(__file__).resolve().parents[1]
# What the wheel is built from: pyproject.toml's packages.find and its readme. Copied, so that
# the build's build/ and *.egg-info never touch the checkout (another test run may be using it).
BUILD_INPUTS = ("pyproject.toml", "README.md", "jaxinfer", "pallas_kernels", "cpu_kernels")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
  src = tmp_path_factory.mktemp("src")
  for name in BUILD_INPUTS:
    if (REPO / name).is_dir():
      shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    else:
      shutil.copy2(REPO / name, src / name)
  out = tmp_path_factory.mktemp("wheel")
  # --no-build-isolation: the build uses this environment's setuptools, so it needs no network.
  done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                         "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  (whl,) = out.glob("jaxinfer-*.whl")
  return whl


def _kernel_includes(names: set[str], read) -> dict[str, set[str]]:
  """{file under cpu_kernels/: the quoted #includes it names}, for every .cc and what they
  include in turn (a header's includes count too)."""
  todo = sorted(n for n in names if n.startswith("cpu_kernels/") and n.endswith(".cc"))
  found: dict[str, set[str]] = {}
  while todo:
    name = todo.pop()
    if name in found or name not in names:
      continue
    found[name] = set(INCLUDE.findall(read(name)))
    todo += [f"cpu_kernels/{inc}" for inc in found[name]]
  return found


def test_the_wheel_carries_every_file_the_cpu_kernels_include(wheel):
  with zipfile.ZipFile(wheel) as z:
    names = set(z.namelist())
    includes = _kernel_includes(names, lambda n: z.read(n).decode())
  assert {"cpu_kernels/int8_matmul.cc", "cpu_kernels/attention.cc"} <= set(includes)
  ffi_dir = Path(jax.ffi.include_dir())
  # Each quoted include resolves beside the source (then it must be in the wheel) or in jax's
  # FFI headers (the -I the build passes); anything else is a file the wheel forgot.
  missing = {f"{src} includes {inc}" for src, incs in includes.items() for inc in incs
             if f"cpu_kernels/{inc}" not in names and not (ffi_dir / inc).is_file()}
  assert not missing, f"{wheel.name} lacks: {sorted(missing)}"
  # And the files the build hashes and compiles (SOURCES + HEADERS) are all there.
  built_from = {f"cpu_kernels/{p.name}" for p in int8_matmul_module.SOURCES + int8_matmul_module.HEADERS}
  assert built_from <= names, sorted(built_from - names)


def _x86_with_avx2_fma_f16c() -> bool:
  try:
    flags = next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).split()
  except (OSError, StopIteration):
    return False
  return {"avx2", "fma", "f16c"} <= set(flags) and shutil.which("g++") is not None


# An installed wheel is its files unpacked into site-packages (it is pure Python: no build step
# runs at install). Unpacked ahead of the checkout on sys.path, with an empty kernel cache, the
# import and the compile can only use what the wheel holds.
KERNEL_FROM_WHEEL = """
import sys
import jax, jax.numpy as jnp, numpy as np
import cpu_kernels
assert cpu_kernels.__file__.startswith(sys.argv[1]), cpu_kernels.__file__
assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
rng = np.random.default_rng(0)
x = rng.standard_normal((5, 200)).astype(np.float32)
q = rng.integers(-127, 128, (33, 200)).astype(np.int8)
got = np.asarray(jax.jit(cpu_kernels.int8_matmul)(jnp.asarray(x), jnp.asarray(q)))
np.testing.assert_array_equal(got, cpu_kernels.int8_matmul_reference(x, q))
print("kernel ok", cpu_kernels.isa())
"""


@pytest.mark.skipif(not _x86_with_avx2_fma_f16c(), reason="the CPU kernels are x86-64 AVX2/FMA/F16C with g++ only")
def test_the_cpu_kernels_build_and_run_from_the_unpacked_wheel(wheel, tmp_path):
  site = tmp_path / "site"
  with zipfile.ZipFile(wheel) as z:
    z.extractall(site)
  env = {**os.environ, "PYTHONPATH": str(site), "JAXINFER_CACHE": str(tmp_path / "cache"),
         "JAXINFER_CPU_KERNELS": "1", "JAX_PLATFORMS": "cpu"}
  done = subprocess.run([sys.executable, "-c", KERNEL_FROM_WHEEL, str(site)], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
  assert "kernel ok" in done.stdout


# --- The wheel installed as a user installs it: a fresh Python 3.12 virtual environment, its
# dependencies resolved by pip (so jax is the newest that Python 3.12 gets, >= 0.11, the jax the
# GPU machines run, where the suite itself runs under 3.11 / jax 0.10).

PYTHON312_ENV = "JAXINFER_TEST_PYTHON312"


def _python312() -> str:
  """A Python 3.12 interpreter that runs: $JAXINFER_TEST_PYTHON312, python3.12 on PATH, or a
  pyenv / system install. A pyenv shim on PATH may exist and still refuse to run, so each
  candidate is asked for its version."""
  candidates = [os.environ.get(PYTHON312_ENV), shutil.which("python3.12"),
                *sorted(map(str, Path.home().glob(".pyenv/versions/3.12*/bin/python3.12")), reverse=True),
                "/usr/bin/python3.12", "/usr/local/bin/python3.12"]
  for exe in filter(None, candidates):
    try:
      done = subprocess.run([exe, "-c", "import sys, venv; print(sys.version_info[:2])"],
                            capture_output=True, text=True, timeout=60)
    except OSError:
      continue
    if done.returncode == 0 and done.stdout.strip() == "(3, 12)":
      return exe
  # A skip that -ra prints with its reason (counted, never a silent pass): a machine without
  # Python 3.12 cannot run it, and failing there would block every submission.
  pytest.skip(f"no working Python 3.12 found (tried {[c for c in candidates if c]}): install one "
              f"(e.g. `pyenv install 3.12`) or set {PYTHON312_ENV}=/path/to/python3.12")


@pytest.fixture(scope="module")
def wheel_venv(wheel, tmp_path_factory) -> Path:
  """A fresh Python 3.12 venv with the wheel and its dependencies installed by pip, as a user's."""
  venv = tmp_path_factory.mktemp("venv312") / "venv"
  made = subprocess.run([_python312(), "-m", "venv", str(venv)], capture_output=True, text=True, timeout=120)
  assert made.returncode == 0, made.stderr[-3000:]
  # The checkout's own PYTHONPATH must not leak into the install or the runs below.
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  # --no-compile: pip would byte-compile every installed module (jax, jaxlib, scipy, ...), half
  # the install's CPU here (30.7 -> 15.6 s); the runs below compile what they import, as
  # Python does with any module that has no .pyc. What is installed is the same.
  done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                         "--no-compile", str(wheel)], capture_output=True, text=True, timeout=600, env=env)
  assert done.returncode == 0, "pip install of the wheel (needs the package index):\n" + done.stderr[-3000:]
  return venv


@pytest.fixture(scope="module")
def venv_cache(tmp_path_factory) -> Path:
  """The venv's own JAXINFER_CACHE, empty but for the default model's GGUF (shared with the
  checkout). Shared by the venv's tests: the C++ kernels the first of them builds from the
  wheel's sources (~9 s of g++ here) serve the next, as they would a user's second run."""
  from jaxinfer.default_model import default_gguf_path

  cache = tmp_path_factory.mktemp("venv-cache")
  gguf = default_gguf_path()  # the real download, cached as on any first use (tests/test_default_model.py)
  (cache / gguf.name).symlink_to(gguf)
  return cache


def _venv_env(venv: Path, cache: Path, tmp_path: Path) -> dict[str, str]:
  """The venv's environment, run from an empty directory so that nothing of the checkout is
  importable; its own kernel cache (`venv_cache`), checkpoints under the test's tmp_path."""
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "JAXINFER_CPU_KERNELS")}
  # The venv's jax is another XLA, which would abort on the suite's flag that only jaxlib < 0.11 knows.
  xla_flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f != FUSION_EMITTERS_OFF)
  return {**env, "XLA_FLAGS": xla_flags, "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", "JAX_PLATFORMS": "cpu",
          "JAXINFER_CACHE": str(cache), "JAXINFER_CHECKPOINTS": str(tmp_path / "checkpoints")}


# The engine's int8 matmul (jaxinfer.quant.int8_matmul), not cpu_kernels' wrapper: the kernel is
# the path only if the jitted program holds its custom call (XLA's split_int8_matmul otherwise).
INT8_THROUGH_THE_KERNEL = """
import sys
import jax, jax.numpy as jnp, numpy as np
import cpu_kernels
from jaxinfer import quant
assert sys.version_info[:2] == (3, 12), sys.version
assert tuple(map(int, jax.__version__.split(".")[:2])) >= (0, 11), jax.__version__
assert cpu_kernels.__file__.startswith(sys.prefix), cpu_kernels.__file__
assert quant.use_cpu_kernels(), cpu_kernels.unavailable_reason()
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((5, 200)).astype(np.float32))
q = jnp.asarray(rng.integers(-127, 128, (33, 200)).astype(np.int8))
step = jax.jit(quant.int8_matmul)
assert "custom_call @jaxinfer_int8_matmul(" in step.lower(x, q).as_text(), "no custom call: the XLA fallback ran"
np.testing.assert_array_equal(np.asarray(step(x, q)), cpu_kernels.int8_matmul_reference(np.asarray(x), np.asarray(q)))
print("kernel ok", jax.__version__, cpu_kernels.isa())
"""

FALLBACK_WARNING = "run through XLA (slower)"  # cpu_kernels.int8_matmul._load's one warning line


@pytest.mark.slow
@pytest.mark.skipif(not _x86_with_avx2_fma_f16c(), reason="the CPU kernels are x86-64 AVX2/FMA/F16C with g++ only")
def test_the_wheel_in_a_fresh_python312_venv_runs_int8_through_the_cpu_kernel(wheel_venv, venv_cache, tmp_path):
  """Slow (over 30 s on two busy cores, most of it its setup's pip install into the fresh
  venv, which the next test shares, then the kernels' g++ build): the install is what a
  user runs, and what the test is about."""
  done = subprocess.run([str(wheel_venv / "bin" / "python"), "-c", INT8_THROUGH_THE_KERNEL], cwd=tmp_path,
                        env=_venv_env(wheel_venv, venv_cache, tmp_path), capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
  assert "kernel ok" in done.stdout and FALLBACK_WARNING not in done.stderr


@pytest.mark.slow
def test_jaxinfer_generate_from_the_wheel_answers_the_quickstart_question(wheel_venv, venv_cache, tmp_path):
  """The README's first quickstart command from the installed wheel (its console script, under
  Python 3.12 and the jax it resolves): the default model converted by that install from the
  cached GGUF, then answered. Slow: ~40 s on 2 busy cores, most of it the conversion."""
  done = subprocess.run([str(wheel_venv / "bin" / "jaxinfer"), "generate", "What is the capital of France?"],
                        cwd=tmp_path, env=_venv_env(wheel_venv, venv_cache, tmp_path), capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
  assert "Paris" in done.stdout, done.stdout
  if _x86_with_avx2_fma_f16c():  # the int4 default model's matmuls ran through the kernels too
    assert FALLBACK_WARNING not in done.stderr, done.stderr[-2000:]
