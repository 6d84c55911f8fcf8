"""The real embedded model against transformers: prompt ids, greedy ids, logits."""

import numpy as np
import pytest

from conftest import DATA
from jaxinfer import SamplingParams

pytestmark = pytest.mark.slow


def test_chat_prompt_token_ids_match_transformers(smollm, smollm_golden):
  for record in smollm_golden["records"]:
    _, ids = smollm.encode_prompt([{"role": "user", "content": record["prompt"]}])
    assert ids == record["prompt_ids"]


def test_greedy_ids_identical_to_transformers(smollm, smollm_golden):
  records = smollm_golden["records"]
  chats = [[{"role": "user", "content": r["prompt"]}] for r in records]
  outputs = smollm.generate(chats, SamplingParams(temperature=0.0, max_tokens=32))
  for out, record in zip(outputs, records):
    assert out.token_ids == record["greedy_ids"], record["prompt"]
    assert out.text == record["text"]
  assert "Paris" in outputs[0].text


def test_logits_match_transformers(smollm):
  g = np.load(DATA / "golden" / "smollm2-135m.npz", allow_pickle=False)
  logits = smollm.logits(g["token_ids"].tolist())
  assert logits.shape == (len(g["token_ids"]), 49152)
  np.testing.assert_array_equal(logits.argmax(-1), g["argmax"])
  # 30 float32 layers in a different summation order than torch: |logits| ~ 20,
  # differences ~1e-4 (5e-6 relative).
  np.testing.assert_allclose(logits[:, g["vocab_cols"]], g["logits_cols"], atol=5e-4, rtol=0)
  np.testing.assert_allclose(logits[-1], g["last_logits"], atol=5e-4, rtol=0)
