"""Logits parity with Hugging Face transformers (goldens from scripts/make_goldens.py)."""

import numpy as np
import pytest

from conftest import FAMILIES, golden


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_float32(tiny_llms, family):
  g = golden(family)
  logits = tiny_llms[family].logits(g["token_ids"].tolist())
  assert logits.shape == g["logits"].shape and logits.dtype == np.float32
  np.testing.assert_allclose(logits, g["logits"], atol=1e-4, rtol=0)


def test_families_exercise_their_distinguishing_features(tiny_llms):
  cfgs = {f: llm.config for f, llm in tiny_llms.items()}
  assert cfgs["llama3"].rope_scaling.kind == "llama3"
  assert cfgs["llama3"].num_heads // cfgs["llama3"].num_kv_heads == 4  # GQA
  assert cfgs["mistral"].sliding_window == 8  # shorter than the 24 golden tokens
  assert cfgs["qwen2"].attention_bias
  assert cfgs["qwen3"].qk_norm and cfgs["qwen3"].head_dim * cfgs["qwen3"].num_heads != cfgs["qwen3"].hidden_size
  assert cfgs["smollm2"].tie_word_embeddings and "lm_head" not in tiny_llms["smollm2"].runner.params


def test_bfloat16_logits_stay_close(tiny_llms):
  from jaxinfer import LLM
  from conftest import tiny_dir
  g = golden("llama3")
  logits = LLM(tiny_dir("llama3"), dtype="bfloat16", max_model_len=64, warmup=False).logits(g["token_ids"].tolist())
  assert np.abs(logits - g["logits"]).max() < 0.15
  assert (logits.argmax(-1) == g["logits"].argmax(-1)).mean() >= 0.9
