"""The engine on a DeepSeek-shaped model with MLA attention forced through the Mosaic GPU
kernel (pallas_kernels.ragged_paged_mla_mgpu, GPU interpret mode on the CPU).

The tiny DeepSeek fixture's latent (r 32) and rope key (R 8) are narrower than the kernel
takes (r a multiple of 64, R of 16), and no widening keeps its function (the latent's RMSNorm
and yarn's rounded correction range depend on the widths), so transformers' goldens do not
apply: `widen_mla` re-draws the attention weights at r 64 / R 16 and the Mosaic run must give
the XLA path's greedy ids on the same model.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import tiny_dir
from helpers import run_engine
from jaxinfer import LLM, SamplingParams

pytestmark = pytest.mark.mosaic


def widen_mla(src: Path, dst: Path, kv_lora_rank: int, rope_dim: int, seed: int = 0) -> Path:
  """A copy of the HF DeepSeek-V3 model in `src` with latent width kv_lora_rank and rope width
  rope_dim: every tensor whose shape depends on them drawn anew (normal / sqrt(fan-in), norms
  1), the rest kept. Not the same function: for comparing two paths on one model."""
  shutil.copytree(src, dst)
  cfg = json.loads((src / "config.json").read_text())
  cfg.update(kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope_dim, head_dim=rope_dim,
             qk_head_dim=cfg["qk_nope_head_dim"] + rope_dim)
  H, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
  q_in = cfg["q_lora_rank"] or cfg["hidden_size"]
  shapes = {"kv_a_proj_with_mqa.weight": (kv_lora_rank + rope_dim, cfg["hidden_size"]),
            "kv_a_layernorm.weight": (kv_lora_rank,),
            "kv_b_proj.weight": (H * (nope + v), kv_lora_rank),
            "q_b_proj.weight": (H * (nope + rope_dim), q_in)}
  rng = np.random.default_rng(seed)
  w = load_file(src / "model.safetensors")
  for name in w:
    suffix = next((s for s in shapes if name.endswith("self_attn." + s)), None)
    if suffix is not None:
      shape = shapes[suffix]
      new = np.ones(shape) if len(shape) == 1 else rng.normal(size=shape) / np.sqrt(shape[1])
      w[name] = new.astype(w[name].dtype)
  save_file(w, dst / "model.safetensors")
  (dst / "config.json").write_text(json.dumps(cfg))
  return dst


def test_greedy_ids_through_the_mosaic_mla_kernel_equal_the_xla_path(tmp_path, monkeypatch):
  """Two prompts (7 tokens, and 70: chunked prefill under a 64-token budget beside the
  other's decode), 6 greedy tokens each, a bf16 latent cache (the kernel's dtype): the Mosaic
  kernel's ids == the XLA path's. Interpret mode costs seconds a step, so the batch is small."""
  from pallas_kernels import ragged_paged_mla_mgpu as mgpu
  if not mgpu.MOSAIC_AVAILABLE:
    pytest.skip("Mosaic GPU interpret mode needs jax >= 0.11 (Python 3.12 venv)")
  calls = []
  kernel = mgpu.ragged_paged_mla_mgpu
  # Counted as the step is traced: the ops dispatch took this kernel, not the Triton fallback.
  monkeypatch.setattr(mgpu, "ragged_paged_mla_mgpu", lambda *a, **k: calls.append(1) or kernel(*a, **k))
  model = widen_mla(tiny_dir("deepseek_v3"), tmp_path / "deepseek_v3", kv_lora_rank=64, rope_dim=16)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(2, 300, size=n).tolist() for n in (7, 70)]
  params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * len(prompts)
  ids = {}
  for impl in ("xla", "mosaic_interpret"):
    llm = LLM(model, max_num_seqs=16, max_num_batched_tokens=64, warmup=False, attention_impl=impl,
              kv_cache_dtype="bfloat16")
    assert llm.runner.attention_impl == impl
    outs, _ = run_engine(llm.engine, prompts, params)
    ids[impl] = [out.token_ids for out in outs]
  assert calls
  assert ids["mosaic_interpret"] == ids["xla"]
  assert len({tuple(i) for i in ids["xla"]}) == 2  # the two prompts' continuations differ
