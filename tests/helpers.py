"""Test helpers: drive an engine by hand; write GGUF files the way llama.cpp's converter does;
load a script from scripts/."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file


def with_trained_head(tmp_path_factory) -> Path:
  """A copy of the tiny llama3 with the MTP head trained for it beside it (tests/data/mtp/llama3:
  `python scripts/train_mtp.py --model <a copy of tests/data/tiny/llama3> --minutes 2`, see its
  train.json: first-draft accuracy 0.34 on its held-out continuations). In the engine about
  15-20% of its k = 3 drafts are accepted on chats, so verification accepts a varying number
  of drafts, as with a real model's head."""
  import shutil
  from conftest import DATA, tiny_dir
  d = tmp_path_factory.mktemp("trained-head") / "llama3"
  shutil.copytree(tiny_dir("llama3"), d)
  for f in ("mtp_head.safetensors", "mtp_head.json"):
    shutil.copy(DATA / "mtp" / "llama3" / f, d / f)
  return d


def widen_heads(src: Path, dst: Path, head_dim: int = 64) -> Path:
  """A copy of the tiny HF llama-family model in `src` with every attention head widened to
  `head_dim`, computing the same function: the same ids as transformers' goldens for `src`.

  For kernels that take only wider heads (the Mosaic GPU kernel: D a multiple of 64) on
  the tiny models' fixtures (d = 16). Each head's d dims go to dims r * i (i < d / 2) and
  r * (i - d / 2) + D / 2 of D = r * d, the rest zero: RoPE's rotate-half pairs dim i with
  i + d / 2 at frequency theta^(-2i / d), and dims r * i and r * i + D / 2 of D get the same
  pair and the same frequency (llama3 scaling is a function of the frequency). q is scaled
  by sqrt(r), so that q . k * D^-0.5 equals the old q . k * d^-0.5 (r a power of 4: exact).
  """
  import shutil
  from safetensors.numpy import save_file
  shutil.copytree(src, dst)
  cfg = json.loads((src / "config.json").read_text())
  d, H, K, D = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim
  r = D // d
  assert D % d == 0 and d % 2 == 0 and round(np.sqrt(r)) ** 2 == r, (d, D)
  dims = np.array([r * i if i < d // 2 else r * (i - d // 2) + D // 2 for i in range(d)])

  def heads(w, n, scale=1):  # [n * d, F] -> [n * D, F]
    out = np.zeros((n * D,) + w.shape[1:], w.dtype)
    for h in range(n):
      out[h * D + dims] = w[h * d:(h + 1) * d] * scale
    return out

  w = load_file(src / "model.safetensors")
  for name in w:
    if name.endswith("q_proj.weight"):
      w[name] = heads(w[name], H, round(np.sqrt(r)))
    elif name.endswith(("k_proj.weight", "v_proj.weight")):
      w[name] = heads(w[name], K)
    elif name.endswith("o_proj.weight"):
      w[name] = np.ascontiguousarray(heads(w[name].T, H).T)
  save_file(w, dst / "model.safetensors")
  (dst / "config.json").write_text(json.dumps(dict(cfg, head_dim=D)))
  return dst


class FailingTokenizer:
  """An engine's tokenizer whose detokenizers made while `armed` raise RuntimeError('boom')
  when pushed their `fail_at`-th token: the requests added meanwhile fail in postprocessing
  (as with a broken vocabulary), the others decode as before. Set as `engine.tokenizer`
  (the engine makes each request's detokenizer from it when the request is added)."""

  def __init__(self, tokenizer, fail_at: int = 1):
    self.tokenizer, self.fail_at, self.armed = tokenizer, fail_at, False

  def __getattr__(self, name):
    return getattr(self.tokenizer, name)

  def detokenizer(self):
    detok = self.tokenizer.detokenizer()
    if not self.armed:
      return detok
    fail_at, push = self.fail_at, detok.push

    def failing_push(token_id):
      if len(detok.ids) + 1 == fail_at:
        raise RuntimeError("boom")
      return push(token_id)

    detok.push = failing_push
    return detok


def run_engine(engine, prompts, params, max_steps=10_000):
  """Drives the engine step by step; returns the final outputs in order and the running
  count after each step."""
  for i, (p, sp) in enumerate(zip(prompts, params)):
    engine.add_request(f"r{i}", p, sp)
  final, running = {}, []
  for _ in range(max_steps):
    if not engine.has_unfinished():
      break
    for out in engine.step():
      if out.finished:
        final[out.request_id] = out
    running.append(engine.stats()["running"])
  return [final[f"r{i}"] for i in range(len(prompts))], running


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp's `permute` (HF half-split rows -> interleaved pairs)."""
  return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
  if hf in HF_TO_GGUF:
    return HF_TO_GGUF[hf]
  parts = hf.split(".")
  return f"blk.{parts[2]}." + LAYER[".".join(parts[3:])]


def write_llama_gguf(hf_dir: Path, out: Path, qtype=gguf.GGMLQuantizationType.F32,
                     tokenizer: dict | None = None) -> Path:
  """A llama-architecture GGUF of an HF llama dir; 2-D weights stored as `qtype`."""
  cfg = json.loads((hf_dir / "config.json").read_text())
  tensors = {}
  for f in sorted(hf_dir.glob("*.safetensors")):
    tensors.update(load_file(f))
  w = gguf.GGUFWriter(str(out), "llama")
  w.add_block_count(cfg["num_hidden_layers"])
  w.add_context_length(cfg["max_position_embeddings"])
  w.add_embedding_length(cfg["hidden_size"])
  w.add_feed_forward_length(cfg["intermediate_size"])
  w.add_head_count(cfg["num_attention_heads"])
  w.add_head_count_kv(cfg["num_key_value_heads"])
  w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
  w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
  w.add_vocab_size(cfg["vocab_size"])
  w.add_name("tiny-llama")
  if tokenizer:
    w.add_tokenizer_model(tokenizer["model"])
    w.add_token_list(tokenizer["tokens"])
    w.add_token_types(tokenizer["types"])
    if "scores" in tokenizer:
      w.add_token_scores(tokenizer["scores"])
    w.add_bos_token_id(tokenizer["bos"])
    w.add_eos_token_id(tokenizer["eos"])
  for name, t in tensors.items():
    t = t.astype(np.float32)
    if name.endswith("q_proj.weight"):
      t = permute_rope_rows(t, cfg["num_attention_heads"])
    elif name.endswith("k_proj.weight"):
      t = permute_rope_rows(t, cfg["num_key_value_heads"])
    if t.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
      if qtype == gguf.GGMLQuantizationType.F16:
        w.add_tensor(gguf_name(name), t.astype(np.float16))
      elif qtype == gguf.GGMLQuantizationType.IQ4_NL:  # no quantizer in gguf-py: random blocks
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.random.default_rng(0).integers(0, 255, (t.shape[0], t.shape[1] // block * size), np.uint8)
        w.add_tensor(gguf_name(name), raw, raw_dtype=qtype)
      else:
        w.add_tensor(gguf_name(name), gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    else:
      w.add_tensor(gguf_name(name), t)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return out


def lower_for_cuda(fn, *avals) -> str:
  """The StableHLO text of fn lowered for CUDA (its pallas_calls as Triton custom calls).
  Its tests are marked `triton_lowering` (tests/conftest.py skips them, counted, where this
  jax cannot lower for CUDA)."""
  import jax
  lowered = jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert "triton" in text  # the pallas_call became a Triton custom call
  return text


def load_script(name: str):
  """scripts/<name>.py as a module, loaded from its path (scripts/ is not a package, and the
  tests edit no sys.path); registered in sys.modules, where dataclasses look their module up."""
  spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module
