"""The wheel a user installs with `pip install jaxinfer` (not `pip install -e`): it must carry
every file the CPU kernels are compiled from, or every such user silently gets the slower XLA
fallback for int8 / int4 / fp8 weights on CPU."""

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
