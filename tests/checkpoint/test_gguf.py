"""GGUF import: names, llama.cpp's q/k permutation, dequantization, embedded vocabularies."""

import gguf
import jax
import numpy as np
import pytest

from conftest import golden, tiny_dir
from helpers import permute_rope_rows, write_llama_gguf
from jaxinfer import LLM
from jaxinfer.checkpoint import import_model
from jaxinfer.checkpoint.gguf import unpermute_rope_rows
from jaxinfer.tokenizer import Tokenizer

Q = gguf.GGMLQuantizationType


def test_unpermute_inverts_llama_cpp_permute():
  w = np.random.default_rng(0).normal(size=(3 * 8, 5)).astype(np.float32)
  np.testing.assert_array_equal(unpermute_rope_rows(permute_rope_rows(w, 3), 3), w)
  assert not np.array_equal(permute_rope_rows(w, 3), w)


@pytest.mark.parametrize("family", ["smollm2", "llama2"])  # tied + GQA, untied + MHA
def test_float32_gguf_matches_transformers(tmp_path, family):
  path = write_llama_gguf(tiny_dir(family), tmp_path / "m.gguf")
  g = golden(family)
  llm = LLM(path, max_model_len=64, warmup=False)
  assert llm.config.tie_word_embeddings == (family == "smollm2")
  np.testing.assert_allclose(llm.logits(g["token_ids"].tolist()), g["logits"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype,atol", [(Q.F16, 5e-3), (Q.BF16, 0.2), (Q.Q8_0, 0.2)])
def test_quantized_gguf_logits_close_to_float(tmp_path, qtype, atol):
  path = write_llama_gguf(tiny_dir("smollm2"), tmp_path / "m.gguf", qtype)
  g = golden("smollm2")
  logits = LLM(path, max_model_len=64, warmup=False).logits(g["token_ids"].tolist())
  np.testing.assert_allclose(logits, g["logits"], atol=atol, rtol=0)


@pytest.mark.parametrize("qtype,max_rel", [(Q.Q8_0, 0.01), (Q.Q5_0, 0.08), (Q.Q5_1, 0.06), (Q.Q4_0, 0.15), (Q.Q4_1, 0.12)])
def test_quantized_gguf_weights_land_in_place(tmp_path, qtype, max_rel):
  # A wrong layout or permutation gives relative errors ~1.4; quantization noise stays small.
  path = write_llama_gguf(tiny_dir("smollm2"), tmp_path / "m.gguf", qtype)
  ours = jax.tree.leaves(import_model(path).weights)
  ref = jax.tree.leaves(import_model(tiny_dir("smollm2")).weights)
  for a, b in zip(ours, ref):
    assert a.shape == b.shape
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < max_rel


def test_llama_sentencepiece_vocab_in_gguf_encodes_like_the_original(tmp_path):
  original = Tokenizer.from_hf_dir(tiny_dir("mistral"))
  sp = original.backend
  n = sp.get_piece_size()
  vocab = dict(model="llama", tokens=[sp.id_to_piece(i) for i in range(n)],
               scores=[sp.get_score(i) for i in range(n)],
               types=[1 + (sp.is_unknown(i)) + 2 * sp.is_control(i) + 5 * sp.is_byte(i) for i in range(n)],
               bos=1, eos=2)
  path = write_llama_gguf(tiny_dir("smollm2"), tmp_path / "m.gguf", tokenizer=vocab)
  tok = LLM(path, max_model_len=64, warmup=False).tokenizer
  assert tok.bos_id == 1 and tok.eos_ids == (2,)
  for text in ["Hello world! 12345", "naïve café 🙂", "  two spaces\tand\nnew line"]:
    assert tok.encode(text) == original.encode(text), text
    assert tok.decode(tok.encode(text)) == text
