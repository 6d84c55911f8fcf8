"""Shared fixtures. 8 fake CPU devices so sharding tests run anywhere (set before jax loads).

XLA's CPU backend compiles with LLVM's cheapest pipeline here: compiling is ~70% of a
cold-cache test (66 s vs 18 s warm for the 16 concurrent goldens), and level 0 cut three
such tests by 17-30% with the same results. Its fusions are emitted by XLA's elemental IR
emitters rather than the MLIR fusion emitters (--xla_cpu_use_fusion_emitters=false): the
tiny llama3's 33-program warm-up compiles in half the CPU time, with logits and sampled
ids bit for bit the same, and the tiny-model test files measured take 31-42% less CPU
(benchmarks/results/test-suite-xla-flags-2026-11-28.json; the real SmolLM2's steps run
slower that way, and its files are the suite's few). Kernels and numerics are XLA's either
way; what the tests check does not depend on LLVM's loop optimizations. A test that reads
a compiled program (HLO text, memory analysis) compiles it with USER_XLA, the options a
user's XLA has. The caller's own XLA_FLAGS follow these (subprocesses the tests start
inherit them all)."""

import os
from importlib.metadata import version

# jaxlib 0.11's XLA has no such flag (an XLA aborts on a flag it does not know): there the
# suite compiles with the fusion emitters, and test_packaging's Python 3.12 venv, whose pip
# resolves jax >= 0.11, runs without it (it inherits the rest).
FUSION_EMITTERS_OFF = ("--xla_cpu_use_fusion_emitters=false"
                       if tuple(map(int, version("jaxlib").split(".")[:2])) < (0, 11) else "")
os.environ["XLA_FLAGS"] = " ".join(f for f in ("--xla_backend_optimization_level=0", FUSION_EMITTERS_OFF,
                                             os.environ.get("XLA_FLAGS", "").strip(),
                                             "--xla_force_host_platform_device_count=8") if f)
# Per-compile options (`jax.jit(f).lower(...).compile(compiler_options=USER_XLA)`) that undo
# FUSION_EMITTERS_OFF for one program: which fusions XLA forms, and so what a compiled
# program's text and temporaries show, follows the emitter (under the flag a bfloat16
# weight's float32 copy is a bare convert, not the `fusion` the quantization tests look for).
USER_XLA = {"xla_cpu_use_fusion_emitters": True} if FUSION_EMITTERS_OFF else {}
# The persistent compilation cache on from the start (in the engine's own directory) for
# every program however quick to compile: the engine's default keeps only those over 0.5 s,
# and with the fusion emitters off most of a tiny model's programs compile faster than that,
# while the suite's engines and its server and router processes compile the same ones over
# and over (test_router_disagg: 84.9 -> 61.4 s of CPU, benchmarks/results/
# test-suite-xla-flags-2026-11-28.json). A cache directory set in the environment is one the
# engine leaves as it is ("the user configured it"); subprocesses inherit both.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ.get(
    "JAXINFER_COMPILATION_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jaxinfer", "xla")))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax  # noqa: E402

DATA = Path(__file__).parent / "data"
# The Pallas kernels' tests run them compiled where a GPU is (the device check in
# scripts/gpu_check.sh), in interpret mode everywhere else (CI).
ON_GPU = jax.default_backend() == "gpu"
PALLAS_INTERPRET = not ON_GPU
PALLAS_IMPL = "pallas" if ON_GPU else "pallas_interpret"  # jaxinfer.ops' name for the same choice
FAMILIES = ("llama2", "llama3", "mistral", "qwen2", "qwen3", "smollm2")


# ---- GPU-only tests: marked, and counted in the summary where they cannot run ----------------
# `gpu`: needs a GPU. `triton_lowering`: lowers Pallas kernels to Triton for CUDA, which jax 0.10
# does without a GPU and jax 0.11 only with one. Where they cannot run they are skipped at
# collection with the reason (-ra lists each), and the summary ends with one line counting
# them; scripts/gpu_check.sh runs both on a GPU (-m "gpu or triton_lowering").
_NOT_RUN = pytest.StashKey[dict]()


def _cuda_lowering_unavailable() -> str | None:
  """Why this process cannot lower a Pallas kernel for CUDA, or None when it can."""
  if ON_GPU:
    return None
  import jax.numpy as jnp
  from jax.experimental import pallas as pl

  from pallas_kernels._compat import triton_compiler_params

  def add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

  x = jax.ShapeDtypeStruct((16,), jnp.float32)
  call = pl.pallas_call(add_one, out_shape=x, compiler_params=triton_compiler_params(4, 1))
  try:
    jax.jit(call).trace(x).lower(lowering_platforms=("cuda",))
  except RuntimeError as e:
    if "GPU" not in str(e):
      raise
    return f"jax {jax.__version__} lowers Triton only with a GPU present ({str(e).splitlines()[0][:120]})"
  return None


# ---- xdist: the longest files first -------------------------------------------------------
# The README runs the suite as `-n 2 --dist loadfile`: a worker runs whole files, taking the
# next one when it is done. xdist's own order is by number of tests, which puts the slowest
# files last (the one-test notebook, the four-test wheel install, the six SmolLM2 goldens):
# one worker then runs them while the other idles. Handed out longest first (by the
# per-file seconds of a full run, tests/data/file_durations.json), the short files fill the
# end instead. Each file's tests keep their order (some files end with the test that kills
# a worker).
FILE_DURATIONS = DATA / "file_durations.json"
SECONDS_PER_UNLISTED_TEST = 2.0  # the suite's mean: ~1800 s over ~900 tests


def pytest_configure(config):
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False  # xdist: hand files out in the order collected


def _longest_files_first(items) -> None:
  seconds = json.loads(FILE_DURATIONS.read_text())["seconds"]
  by_file: dict[str, list] = {}
  for item in items:
    by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
  estimate = lambda f: max(seconds.get(f, 0.0), SECONDS_PER_UNLISTED_TEST * len(by_file[f]))
  items[:] = [item for f in sorted(by_file, key=estimate, reverse=True) for item in by_file[f]]


def pytest_collection_modifyitems(config, items):
  if hasattr(config, "workerinput"):  # an xdist worker: the controller schedules files in this order
    _longest_files_first(items)
  reasons = {"gpu": None if ON_GPU else f"no GPU (JAX backend {jax.default_backend()!r})"}
  not_run = {}
  for item in items:
    for marker in ("gpu", "triton_lowering"):
      if item.get_closest_marker(marker) is None:
        continue
      if marker not in reasons:
        reasons[marker] = _cuda_lowering_unavailable()
      if reasons[marker] is not None:
        item.add_marker(pytest.mark.skip(reason=f"{marker}: {reasons[marker]}"))
        not_run.setdefault(marker, []).append(item.nodeid)
  config.stash[_NOT_RUN] = {m: (len(ids), reasons[m]) for m, ids in not_run.items()}


def _file_seconds(terminalreporter) -> dict[str, float]:
  """{test file: seconds of its setups, calls and teardowns} for this run."""
  seconds: dict[str, float] = {}
  for reports in terminalreporter.stats.values():
    for r in reports:
      if isinstance(r, pytest.TestReport):
        f = r.nodeid.split("::")[0]
        seconds[f] = seconds.get(f, 0.0) + r.duration
  return seconds


def pytest_terminal_summary(terminalreporter, exitstatus, config):
  seconds = _file_seconds(terminalreporter)
  if len(seconds) > 1:
    slowest = sorted(seconds.items(), key=lambda kv: -kv[1])[:15]
    terminalreporter.write_line("slowest files: " + ", ".join(f"{f} {s:.0f} s" for f, s in slowest))
  out = os.environ.get("JAXINFER_WRITE_FILE_DURATIONS")  # refreshes tests/data/file_durations.json
  if out:
    run = " ".join(config.invocation_params.args)
    Path(out).write_text(json.dumps({"source": f"per-file seconds of `pytest {run}` (tests/conftest.py)",
                                     "seconds": {f: round(s, 1) for f, s in sorted(seconds.items())}},
                                    indent=1) + "\n")
  for marker, (n, reason) in config.stash.get(_NOT_RUN, {}).items():
    terminalreporter.write_line(f"{n} {marker}-marked tests not run: {reason} (scripts/gpu_check.sh runs "
                                f"them on a GPU)", yellow=True, bold=True)


def tiny_dir(family: str) -> Path:
  return DATA / "tiny" / family


def golden(family: str):
  return np.load(DATA / "golden" / f"{family}.npz", allow_pickle=False)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
  """The tiny llama3 with its context stretched to 4096 positions, so that long
  requests outlive the cancellations, deadlines and kills the serving tests aim at them."""
  import shutil
  d = tmp_path_factory.mktemp("tiny-long") / "llama3"
  shutil.copytree(tiny_dir("llama3"), d)
  cfg = json.loads((d / "config.json").read_text())
  cfg["max_position_embeddings"] = 4096
  (d / "config.json").write_text(json.dumps(cfg))
  return d


@pytest.fixture(scope="session")
def smollm_golden():
  return json.loads((DATA / "golden" / "smollm2-135m.json").read_text())


@pytest.fixture(scope="session")
def default_checkpoint():
  """The embedded default model, downloaded and converted on first use (as a user would)."""
  from jaxinfer.default_model import default_checkpoint
  return default_checkpoint()


@pytest.fixture(scope="session")
def smollm(default_checkpoint):
  """The default model with its 30 layers scanned: its programs compile in a fraction of the
  unrolled time (benchmarks/results/layers-scan-2026-11-28.json), most of a cold run of its
  goldens; scanned and unrolled logits are equal bit for bit (tests/models/test_scan.py), and
  the notebook and test_default_model run it unrolled, as CPU users do."""
  from jaxinfer import LLM
  return LLM(default_checkpoint, warmup=False, scan_layers=True)


@pytest.fixture(scope="session")
def tiny_llms():
  """One LLM per tiny family, loaded once. A 64-token step budget: 7 step buckets to
  compile per family instead of 10 (CI compiles each once, cold)."""
  from jaxinfer import LLM
  return {f: LLM(tiny_dir(f), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, warmup=False)
          for f in FAMILIES}

