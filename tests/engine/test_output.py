"""engine/output.py: the Prefix view a streamed output carries (exact list behaviour, and a
snapshot that later appends do not change), and streamed vs finished outputs of one request."""

import pytest

from jaxinfer.engine.output import Prefix


def test_a_prefix_is_the_list_as_it_was_and_reads_like_one():
  items = [10, 11, 12, 13]
  view = Prefix(items, 1)
  items += [14, 15]  # the request goes on appending
  assert len(view) == 3 and list(view) == [11, 12, 13] and view == [11, 12, 13] and [11, 12, 13] == view
  assert view != [11, 12, 13, 14] and view != (11, 12) and view != "abc"
  assert (view[0], view[2], view[-1], view[-3]) == (11, 13, 13, 11)
  assert view[1:] == [12, 13] and view[:-1] == [11, 12] and view[::-1] == [13, 12, 11] and view[5:] == []
  with pytest.raises(IndexError):
    view[3]
  with pytest.raises(IndexError):
    view[-4]
  assert view + [1] == [11, 12, 13, 1] and repr(view) == "[11, 12, 13]" and 12 in view
  assert list(Prefix(items)) == [10, 11, 12, 13, 14, 15] and not Prefix([], 0)
  with pytest.raises(TypeError):
    hash(view)


def test_streamed_outputs_are_snapshots_and_the_final_one_holds_lists():
  """Each streamed output of a request keeps the ids and logprobs it had when it was made
  (views, not copies) while later steps append; the finished output's are plain lists."""
  from conftest import tiny_dir
  from jaxinfer import LLM, SamplingParams
  llm = LLM(tiny_dir("llama3"), max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32, warmup=False)
  outs = list(llm.stream([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True)))
  final = outs[-1]
  assert final.finished and type(final.token_ids) is list and type(final.logprobs) is list
  assert type(final.top_logprobs) is list and len(final.token_ids) == 6
  seen = 0
  for o in outs[:-1]:
    assert isinstance(o.token_ids, Prefix) and not o.finished
    seen += len(o.new_token_ids)
    assert len(o.token_ids) == len(o.logprobs) == len(o.top_logprobs) == seen
    assert o.token_ids == final.token_ids[:seen] and o.logprobs == final.logprobs[:seen]
  assert seen + len(final.new_token_ids) == 6
