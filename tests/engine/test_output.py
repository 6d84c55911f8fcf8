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


def _requests(specs):
  """Requests with output state: each spec is (max_tokens, stop_token_ids, stream, logprobs)."""
  from jaxinfer.engine.output import OutputProcessor
  from jaxinfer.engine.scheduler import Request
  from jaxinfer.sampling import SamplingParams
  outputs = OutputProcessor(None, eos_ids=[2], num_rows=len(specs))
  reqs = []
  for i, (max_tokens, stop, stream, logprobs) in enumerate(specs):
    req = Request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=max_tokens, stop_token_ids=stop, logprobs=logprobs), 0)
    outputs.start(req, stream=stream)
    reqs.append(req)
  return outputs, reqs


def test_commit_plain_commits_the_plain_rows_and_leaves_the_rest_in_order():
  """One step over six rows: rows 0 and 5 take their token at once; the others are left to
  `commit`, each for its own reason (a stop id, max_tokens reached, streamed, top logprobs)."""
  import numpy as np
  outputs, reqs = _requests([(10, [], False, None), (10, [9], False, None), (1, [], False, None),
                             (10, [], True, None), (10, [], False, 1), (10, [], False, None)])
  rows = np.array([3, 0, 1, 2, 4, 5])  # sampler rows need not follow the step's order
  gens = np.array([1, 1, 1, 1, 1, 1])
  ids = np.array([[40], [9], [41], [42], [43], [2 + 42]], np.int32)
  logprobs = -np.arange(6, dtype=np.float32)[:, None]
  slow = outputs.commit_plain(reqs, rows, gens, np.ones(6, np.int64), ids, logprobs, np.ones(6, np.int32))
  assert slow.tolist() == [1, 2, 3, 4]
  assert reqs[0].output_token_ids == [40] and reqs[0].output.logprobs == [-0.0]
  assert reqs[5].output_token_ids == [44] and reqs[5].output.logprobs == [-5.0]
  assert all(r.output_token_ids == [] for r in reqs[1:5]) and outputs.num_generated_tokens == 2
  # The next step: row 0 of request 0 takes one more; an EOS (id 2) is left to commit.
  ids = np.array([[50], [9], [41], [42], [43], [2]], np.int32)
  slow = outputs.commit_plain(reqs, rows, gens, np.ones(6, np.int64), ids, logprobs, np.ones(6, np.int32))
  assert slow.tolist() == [1, 2, 3, 4, 5] and reqs[0].output_token_ids == [40, 50]


def test_commit_plain_leaves_a_row_its_request_no_longer_holds_and_multi_token_rows():
  """A row freed or re-taken since the step ran (its tenancy moved on), a row that commits
  two tokens, a prefill chunk's row (none) and a row the caller marks ineligible are not
  committed here; a row whose commit went the per-request way counts its request's tokens
  again (else it would miss max_tokens)."""
  import numpy as np
  outputs, reqs = _requests([(10, [], False, None)] * 4)
  rows, gens = np.arange(4), np.array([1, 1, 1, 1])
  ids = np.array([[40, 41]] * 4, np.int32)
  lps = np.zeros((4, 2), np.float32)
  one = np.ones(4, np.int32)
  lens = lambda: [len(r.output_token_ids) for r in reqs]
  assert outputs.commit_plain(reqs, rows, gens, gens, ids, lps, one).tolist() == []  # every row bound
  now = np.array([1, 2, 1, 1])  # row 1 changed hands after the step
  assert outputs.commit_plain(reqs, rows, gens, now, ids, lps, np.array([1, 1, 2, 0])).tolist() == [1, 2, 3]
  assert lens() == [2, 1, 1, 1]
  reqs[2].token_ids += [40] * 8  # row 2's two tokens (and more) committed per request: 9 of its 10
  assert outputs.commit_plain(reqs, rows, gens, now, ids, lps, one,
                              eligible=np.array([True, True, True, False])).tolist() == [1, 2, 3]
  assert lens() == [3, 1, 9, 1]
  assert outputs.commit_plain(reqs, rows, gens, now, ids, lps, one, eligible=False).tolist() == [0, 1, 2, 3]
  reqs[0].token_ids += [40] * 6  # committed per request in that step: 9 of its 10
  assert outputs.commit_plain(reqs, rows, gens, gens, ids, lps, one).tolist() == [0, 2]
  assert lens() == [9, 2, 9, 2]


def test_commit_plain_equals_committing_each_request():
  """Random steps over plain, streamed, stop-id and short requests: commit_plain, then
  `commit` for the rows it leaves, gives every request the ids, logprobs and finish reasons
  that `commit` alone gives, and re-counts a row after `commit` took its tokens."""
  import numpy as np
  rng = np.random.default_rng(0)
  specs = [(int(rng.integers(1, 12)), [int(rng.integers(3, 9))] if rng.random() < 0.5 else [], bool(rng.random() < 0.3),
            None) for _ in range(12)]
  fast, a = _requests(specs)
  ref, b = _requests(specs)
  rows, gens, now = np.arange(12), np.ones(12, np.int64), np.ones(12, np.int64)
  done_a, done_b = {}, {}
  tops = np.zeros((12, 2, 1))
  for _ in range(14):
    counts = rng.integers(0, 3, 12).astype(np.int32)  # 0: a prefill chunk; 2: an accepted draft
    ids = rng.integers(3, 12, (12, 2)).astype(np.int32)
    lps = rng.standard_normal((12, 2)).astype(np.float32)
    live = np.array([i not in done_a for i in range(12)])
    slow = fast.commit_plain(a, rows, gens, np.where(live, now, 2), ids, lps, counts)
    for i in slow.tolist():
      if live[i] and counts[i]:
        reason = fast.commit(a[i], ids[i].tolist(), lps[i].tolist(), tops, tops, int(counts[i]), 0, i)
        if reason:
          done_a[i] = reason
    for i in range(12):
      if i not in done_b and counts[i]:
        reason = ref.commit(b[i], ids[i].tolist(), lps[i].tolist(), tops, tops, int(counts[i]), 0, i)
        if reason:
          done_b[i] = reason
  assert done_a == done_b and len(done_a) >= 6
  assert [r.token_ids for r in a] == [r.token_ids for r in b]
  assert [r.output.logprobs for r in a] == [r.output.logprobs for r in b]
  assert fast.num_generated_tokens == ref.num_generated_tokens


def test_commit_plain_reads_the_controls_of_the_request_now_on_the_row():
  """Row 0 passes from a request with room for ten tokens to one with room for one: the new
  tenant's first token ends it ('length'), so it is left to `commit`, not taken with the
  old tenant's limit."""
  import numpy as np
  outputs, (a, b) = _requests([(10, [], False, None), (1, [], False, None)])
  one, ids, lps = np.ones(1, np.int32), np.array([[40]], np.int32), np.zeros((1, 1), np.float32)
  assert outputs.commit_plain([a], np.array([0]), np.array([1]), np.array([1, 0]), ids, lps, one).tolist() == []
  assert outputs.commit_plain([b], np.array([0]), np.array([2]), np.array([2, 0]), ids, lps, one).tolist() == [0]
  assert a.output_token_ids == [40] and b.output_token_ids == []
