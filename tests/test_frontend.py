"""The request front door: a request is checked where it enters, once, in the words every
entry (LLM, servers, router) shares."""

import pytest

from conftest import tiny_dir
from jaxinfer import LLM, SamplingParams
from jaxinfer.errors import InvalidRequestError
from jaxinfer.frontend import Frontend, ValidRequest


@pytest.fixture(scope="module")
def llm():
  return LLM(tiny_dir("llama3"), max_num_seqs=4, max_num_batched_tokens=32, warmup=False, max_model_len=64)


def test_a_weightless_frontend_refuses_what_the_engine_refuses_in_the_same_words(llm):
  front = Frontend.load(tiny_dir("llama3"))
  front.max_model_len = llm.max_model_len  # a router takes its workers' context
  V = llm.config.vocab_size
  for ids, params in [([], SamplingParams()), ([1, V], SamplingParams()), ([1, True], SamplingParams()),
                      ([1] * 60, SamplingParams(max_tokens=8))]:
    with pytest.raises(InvalidRequestError) as engine_says:
      llm.engine.add_request("x", ids, params)
    with pytest.raises(InvalidRequestError) as front_says:
      front.validate(ids, params)
    assert str(front_says.value) == str(engine_says.value)
  assert llm.engine.num_unfinished == 0


def test_a_request_is_validated_once_on_its_way_to_the_engine(llm, monkeypatch):
  checked = []
  real = Frontend.check_token_ids
  monkeypatch.setattr(Frontend, "check_token_ids", lambda self, ids: checked.append(list(ids)) or real(self, ids))
  out = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
  assert [len(o.token_ids) for o in out] == [2, 2]
  assert checked == [[1, 2, 3], [4, 5]]  # LLM's check; the engine took the ValidRequests as they were
  # Another frontend's request (a router's: its max_model_len may not be this engine's) is checked again.
  other = Frontend.load(tiny_dir("llama3")).validate([7, 8], SamplingParams(max_tokens=100))
  checked.clear()
  with pytest.raises(InvalidRequestError, match="exceeds max_model_len=64"):
    llm.engine.add_request("y", other)
  assert checked == [[7, 8]]
  mine = llm.frontend.validate([7, 8], SamplingParams(max_tokens=2))
  assert isinstance(mine, ValidRequest) and llm.frontend.validate(mine, mine.params) is mine
  with pytest.raises(InvalidRequestError, match="carries its own sampling params"):
    llm.engine.add_request("z", mine, SamplingParams(max_tokens=3))
