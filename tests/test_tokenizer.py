"""Tokenizers against transformers' encodings, chat templates, incremental detokenization."""

import json

import pytest

from conftest import DATA, tiny_dir
from jaxinfer.errors import InvalidRequestError, TokenizerError
from jaxinfer.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.mark.parametrize("family,backend", [("llama3", "tokenizer.json"), ("mistral", "sentencepiece")])
def test_encode_decode_and_chat_match_transformers(family, backend):
  g = json.loads((DATA / "golden" / f"{family}_tokenizer.json").read_text())
  tok = Tokenizer.from_hf_dir(tiny_dir(family))
  assert (backend == "sentencepiece") == tok._is_spm
  for text, ids, decoded in zip(g["texts"], g["encoded"], g["decoded"]):
    if text.startswith(" ") and tok._is_spm:
      # transformers' converted Llama tokenizer drops one of several leading spaces
      # (its decode gives back one space fewer); the sentencepiece library is the
      # reference for its own format, and it round-trips.
      assert tok.encode(text) == [tok.bos_id] + tok.backend.encode(text)
      assert tok.decode(tok.encode(text)) == text
      continue
    assert tok.encode(text) == ids, text
    assert tok.decode(ids) == decoded
  assert tok.encode_chat(g["chat_messages"]) == g["chat_ids"]


def test_hf_dir_without_tokenizer_files_has_none():
  assert Tokenizer.from_hf_dir(tiny_dir("qwen2")) is None


def test_gguf_gpt2_vocab_splits_digits_for_smollm():
  tokens = ["a", "b", "1", "2", "12", "<|end|>"]
  tok = Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
                             "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 3],
                             "tokenizer.ggml.merges": ["1 2"], "tokenizer.ggml.pre": "smollm",
                             "tokenizer.ggml.eos_token_id": 5})
  assert tok.encode("12") == [2, 3]  # digits never merge under the smollm pre-tokenizer
  assert tok.encode("ab<|end|>") == [0, 1, 5]
  assert tok.eos_ids == (5,)


def test_unknown_gguf_tokenizer_model():
  with pytest.raises(TokenizerError, match=r"GGUF tokenizer model 'rwkv' is not supported"):
    Tokenizer.from_gguf({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]})


@pytest.mark.parametrize("family", ["llama3", "mistral"])
def test_incremental_detokenizer_never_splits_a_character(family):
  tok = Tokenizer.from_hf_dir(tiny_dir(family))
  text = "naïve café 🚀 ü and 日本 🙂🙂 text"  # 🚀 and 日本 are byte-fallback pieces in both
  ids = tok.encode(text, add_special_tokens=False)
  # The emoji really is spread over several tokens in both vocabularies.
  assert len(ids) > len(text.split())
  detok = IncrementalDetokenizer(tok)
  deltas = [detok.push(i) for i in ids]
  assert "".join(deltas) == tok.decode(ids) == text
  assert not any("\ufffd" in d for d in deltas)
  assert any(d == "" for d in deltas)  # some tokens were held back mid-character


def test_chat_template_errors():
  tok = Tokenizer.from_hf_dir(tiny_dir("llama3"))
  with pytest.raises(InvalidRequestError, match=r"messages\[0\] must be a dict with string 'role' and 'content'"):
    tok.apply_chat_template([{"role": "user"}])
  with pytest.raises(InvalidRequestError, match=r"messages must be a non-empty list"):
    tok.apply_chat_template([])
  tok.chat_template = "{{ raise_exception('only user turns') }}"
  tok._template = None
  with pytest.raises(InvalidRequestError, match=r"the chat template rejected them: only user turns"):
    tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_save_and_load_round_trip(tmp_path):
  for family in ("llama3", "mistral"):
    tok = Tokenizer.from_hf_dir(tiny_dir(family))
    tok.save(tmp_path / family)
    back = Tokenizer.load(tmp_path / family)
    assert back.encode("Hello world 🙂") == tok.encode("Hello world 🙂")
    assert (back.bos_id, back.eos_ids, back.chat_template) == (tok.bos_id, tok.eos_ids, tok.chat_template)


def test_malformed_tokenizer_json(tmp_path):
  (tmp_path / "tokenizer.json").write_text("{}")
  with pytest.raises(TokenizerError, match=r"tokenizer.json: not a valid tokenizer.json"):
    Tokenizer.from_hf_dir(tmp_path)
