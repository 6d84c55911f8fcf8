"""Shared fixtures. 8 fake CPU devices so sharding tests run anywhere (set before jax loads).

XLA's CPU backend compiles with LLVM's cheapest pipeline here: compiling is ~70% of a
cold-cache test (66 s vs 18 s warm for the 16 concurrent goldens), and level 0 cut three
such tests by 17-30% with the same results. Kernels and numerics are XLA's either way;
what the tests check does not depend on LLVM's loop optimizations. The caller's own
XLA_FLAGS follow it (subprocesses the tests start inherit both)."""

import os

os.environ["XLA_FLAGS"] = ("--xla_backend_optimization_level=0 " + os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

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
  from jaxinfer import LLM
  return LLM(default_checkpoint, warmup=False)


@pytest.fixture(scope="session")
def tiny_llms():
  """One LLM per tiny family, loaded once. A 64-token step budget: 7 step buckets to
  compile per family instead of 10 (CI compiles each once, cold)."""
  from jaxinfer import LLM
  return {f: LLM(tiny_dir(f), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, warmup=False)
          for f in FAMILIES}

