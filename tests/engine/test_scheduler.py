"""The scheduler without a model: exact page ids after admission, chunking under the token
budget, prefix-cache hits, preemption order, draft rollback, abort in every state.

`step` runs `schedule` and `update_from_output` as LLMEngine does, with the ids a runner
would return: a request whose step reaches its known tokens samples one (1000 + its length,
so every test knows it) after the drafts it accepted. Pages are 4 tokens; page 0 is
never handed out, so a pool of 9 pages has 8 usable ones, handed out in order."""

import numpy as np
import pytest

from jaxinfer.engine.kv_connector import KVConnector
from jaxinfer.engine.kv_manager import KVManager, hash_blocks
from jaxinfer.engine.scheduler import Request, Scheduler, Status
from jaxinfer.sampling import SamplingParams

PS = 4


def make(num_pages=9, budget=8, max_num_seqs=4, prefix=True, **kw) -> Scheduler:
  return Scheduler(KVManager(num_pages, PS, prefix), max_num_seqs, budget, **kw)


def request(rid: str, prompt, max_tokens=16, **kw) -> Request:
  return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **kw), seed=0)


def tokens(n, start=0):
  return list(range(start, start + n))


def step(s: Scheduler, accepted: dict[str, int] | None = None):
  """One step; returns [(request id, new tokens)] and the preempted ids."""
  out = s.schedule()
  # The sampled ids, as the runner returns them: a request that samples commits the drafts
  # it accepted and one token of its own (1000 + its length after them).
  k1 = max([len(d) for d in out.drafts], default=0) + 1
  ids = np.zeros((len(out.scheduled), k1), np.int32)
  committed = np.zeros(len(out.scheduled), np.int32)
  for i, (r, _) in enumerate(out.scheduled):
    if out.samples[i]:
      a = (accepted or {}).get(r.request_id, 0)
      run = out.drafts[i][:a] + [1000 + len(r.token_ids) + a]
      ids[i, :len(run)], committed[i] = run, len(run)
  s.update_from_output(out, ids, committed)
  for i, (r, _) in enumerate(out.scheduled):  # what the output processor commits
    r.token_ids += ids[i, :committed[i]].tolist()
    r.spec_token_ids = []
  return [(r.request_id, n) for r, n in out.scheduled], [r.request_id for r in out.preempted]


def add(s: Scheduler, *reqs: Request) -> list[Request]:
  for r in reqs:
    s.add(r)
  return list(reqs)


def test_admission_is_fcfs_under_the_budget_with_pages_in_order():
  s = make(budget=8)
  a, b, c = add(s, request("a", tokens(6)), request("b", tokens(5, 100)), request("c", tokens(3, 200)))
  assert step(s) == ([("a", 6), ("b", 2)], [])  # b's first chunk takes the 2 tokens left
  assert (s.kv.pages("a"), s.kv.pages("b"), s.kv.pages("c")) == ([1, 2], [3], [])
  assert (a.row, b.row, c.row) == (0, 1, None)
  assert [r.status for r in (a, b, c)] == [Status.RUNNING, Status.RUNNING, Status.WAITING]
  assert list(s.waiting) == [c] and s.running == [a, b]
  assert s.kv.num_free_pages == 5
  # The sequence limit holds whatever the budget.
  one = make(budget=64, max_num_seqs=1)
  add(one, request("a", tokens(6)), request("b", tokens(5, 100)))
  assert step(one) == ([("a", 6)], [])


def test_chunked_prefill_catches_up_under_the_budget_then_decodes_one_token():
  s = make(budget=8)
  a, b = add(s, request("a", tokens(6)), request("b", tokens(5, 100)))
  assert step(s) == ([("a", 6), ("b", 2)], [])
  assert a.token_ids[6:] == [1006] and b.token_ids[5:] == []  # a sampled; b is mid-prompt
  # Running requests first, oldest first: a's one token, then b's remaining 3.
  assert step(s) == ([("a", 1), ("b", 3)], [])
  assert (s.kv.pages("a"), s.kv.pages("b")) == ([1, 2], [3, 4])
  assert (a.output_token_ids, b.output_token_ids) == ([1006, 1007], [1005])
  assert step(s) == ([("a", 1), ("b", 1)], [])
  # One long prompt alone: chunks of 8, 8, 4, then one token per step; a page per 4 tokens.
  s = make(budget=8)
  c, = add(s, request("c", tokens(20)))
  pages = []
  for _ in range(4):
    assert step(s)[1] == []
    pages.append(list(s.kv.pages("c")))
  assert pages == [[1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]]
  assert c.num_computed == 21 and c.output_token_ids == [1020, 1021]


def test_prefix_hits_share_full_blocks_and_leave_a_token_to_compute():
  s = make(budget=16)
  a, = add(s, request("a", tokens(9)))
  assert step(s) == ([("a", 9)], [])  # blocks 0..3 (page 1) and 4..7 (page 2) are cached
  s.finish(a, "length")  # page 3 goes back to the free list; 1 and 2 stay cached
  b, c, d = add(s, request("b", tokens(8) + [50, 51]), request("c", tokens(8)),
                request("d", tokens(8) + [60], prompt_logprobs=1))
  assert step(s) == ([("b", 2), ("c", 4), ("d", 9)], [])
  assert s.kv.pages("b") == [1, 2, 4] and (b.num_cached_tokens, b.num_computed) == (8, 10)
  # c's prompt is exactly two blocks: the second is recomputed, for its last token's logits.
  assert s.kv.pages("c") == [1, 5] and c.num_cached_tokens == 4
  # Prompt logprobs need every prompt token computed: d skips the cache.
  assert s.kv.pages("d") == [6, 7, 8] and d.num_cached_tokens == 0
  assert [s.kv.ref_count(p) for p in range(1, 9)] == [2, 1, 0, 1, 1, 1, 1, 1]
  assert (s.kv.queried_tokens, s.kv.hit_tokens) == (9 + 10 + 8, 8 + 4)


def test_preemption_takes_the_newest_running_request_and_it_recomputes_later():
  s = make(num_pages=5, budget=16, prefix=False)  # pages 1..4
  a, b, c = add(s, request("a", tokens(4)), request("b", tokens(4, 100)), request("c", tokens(4, 200)))
  assert step(s) == ([("a", 4), ("b", 4), ("c", 4)], [])
  assert [s.kv.pages(r) for r in "abc"] == [[1], [2], [3]]
  c.spec_token_ids = [7, 7]
  # a takes the last free page; b needs one more: c, the newest, gives its page back.
  assert step(s) == ([("a", 1), ("b", 1)], ["c"])
  assert [s.kv.pages(r) for r in "abc"] == [[1, 4], [2, 3], []]
  assert (c.status, c.num_computed, c.row, c.spec_token_ids, c.num_preemptions) == (Status.WAITING, 0, None, [], 1)
  assert c.output_token_ids == [1004] and list(s.waiting) == [c] and s.num_preemptions == 1
  assert step(s) == ([("a", 1), ("b", 1)], [])  # c needs 2 pages; none is free
  s.finish(a, "length")  # frees a's pages, tail first
  assert step(s) == ([("b", 1), ("c", 5)], [])  # c recomputes its prompt and its kept output
  assert s.kv.pages("c") == [4, 1] and c.row == 0 and c.num_cached_tokens == 0


def test_a_rows_tenancy_moves_on_whenever_it_is_taken_or_freed():
  """`row_gen` and each step's rows and their tenancy (what the output processor keys its
  row arrays by): preemption and finish free a row, admission takes one, each a bump."""
  s = make(num_pages=5, budget=16, prefix=False)
  a, b, c = add(s, request("a", tokens(4)), request("b", tokens(4, 100)), request("c", tokens(4, 200)))
  out = s.schedule()
  assert out.rows.tolist() == [0, 1, 2] and out.row_gens.tolist() == [1, 1, 1]
  s.update_from_output(out, np.array([[5], [6], [7]]), np.ones(3, np.int32))
  for r, t in zip((a, b, c), (5, 6, 7)):
    r.token_ids.append(t)
  assert step(s) == ([("a", 1), ("b", 1)], ["c"])  # c's row 2 is freed
  assert s.row_gen.tolist() == [1, 1, 2, 0]
  s.finish(a, "stop")  # row 0 too
  s.finish(b, "stop")  # and row 1, freed last
  out = s.schedule()  # c comes back on row 1
  assert [r.request_id for r, _ in out.scheduled] == ["c"]
  assert out.rows.tolist() == [1] and out.row_gens.tolist() == [3] and s.row_gen.tolist() == [2, 3, 2, 0]


def test_the_newest_request_preempts_itself_rather_than_an_older_one():
  s = make(num_pages=4, budget=16, prefix=False)  # pages 1..3
  a, b = add(s, request("a", tokens(7)), request("b", tokens(4, 100)))
  assert step(s) == ([("a", 7), ("b", 4)], [])
  assert step(s) == ([("a", 1)], ["b"])  # a's 8 tokens fit its 2 pages; b's 5th needs a 4th page
  assert (s.kv.pages("a"), s.kv.pages("b"), s.running, list(s.waiting)) == ([1, 2], [], [a], [b])


def test_a_step_that_preempts_admits_nobody():
  s = make(num_pages=6, budget=6, prefix=False)  # pages 1..5
  a, b = add(s, request("a", tokens(3)), request("b", tokens(3, 100)))
  assert step(s) == ([("a", 3), ("b", 3)], [])
  c, = add(s, request("c", tokens(8, 200)))
  assert step(s) == ([("a", 1), ("b", 1), ("c", 4)], [])
  # a and b take the last two pages; c's second chunk finds none and c preempts itself.
  # Its page would take its first chunk again at once: not in the step that preempted it.
  assert step(s) == ([("a", 1), ("b", 1)], ["c"])
  assert (s.kv.pages("a"), s.kv.pages("b"), s.kv.num_free_pages, list(s.waiting)) == ([1, 4], [2, 5], 1, [c])
  assert step(s) == ([("a", 1), ("b", 1), ("c", 4)], []) and s.kv.pages("c") == [3]


def test_rejected_drafts_keep_their_pages_but_are_never_computed_or_cached():
  s = make(budget=8)
  a, = add(s, request("a", tokens(7)))
  assert step(s) == ([("a", 7)], [])
  a.spec_token_ids = [500, 501, 502]
  # Caught up: its newest token plus 3 drafts; pages for all 11 positions.
  assert step(s, accepted={"a": 1}) == ([("a", 4)], [])
  assert s.kv.pages("a") == [1, 2, 3]
  assert a.token_ids[7:] == [1007, 500, 1009] and (a.num_computed, a.num_uncomputed) == (9, 1)
  # Blocks 0 and 1 are final; block 2 (positions 8..11) held rejected drafts and is not cached.
  assert s.kv.cached_hashes() == set(hash_blocks(a.token_ids, PS)[:2])
  assert step(s) == ([("a", 1)], []) and s.kv.pages("a") == [1, 2, 3]
  # Drafts only within the budget, and only after a caught-up request's newest token.
  s = make(budget=3)
  a, = add(s, request("a", tokens(4)))
  step(s)
  b, = add(s, request("b", tokens(6, 100)))
  a.spec_token_ids, b.spec_token_ids = [500, 501, 502], [600]
  out = s.schedule()
  assert [(r.request_id, n, r.spec_token_ids) for r, n in out.scheduled] == [("a", 3, [500, 501])]
  s = make(budget=8)
  a, b = add(s, request("a", tokens(12)), request("b", tokens(4, 100)))
  step(s)  # a mid-prompt: 8 of 12
  a.spec_token_ids = [500]
  out = s.schedule()
  assert [(r.request_id, n, r.spec_token_ids) for r, n in out.scheduled] == [("a", 4, []), ("b", 4, [])]


class HalfRemote(KVConnector):
  """The first 8 prompt tokens of a request named 'remote*' come from another worker."""

  def __init__(self):
    self.allocated, self.finished = [], []

  def get_num_new_matched_tokens(self, req, num_computed):
    return 8 if req.request_id.startswith("remote") else 0

  def update_state_after_alloc(self, req, pages, num_external_tokens):
    self.allocated.append((req.request_id, list(pages), num_external_tokens))

  def request_finished(self, req):
    self.finished.append(req.request_id)
    return False


def test_abort_in_every_state_frees_pages_and_rows():
  conn = HalfRemote()
  s = make(budget=8, max_num_seqs=3, connector=conn)
  run, remote, held, wait = add(s, request("run", tokens(4)), request("remote", tokens(10, 100)),
                                request("held", tokens(4, 200)), request("wait", tokens(4, 300)))
  held.hold_kv = True
  # remote waits for its KV with pages for its 8 remote tokens (no budget); wait gets no sequence slot.
  assert step(s) == ([("run", 4), ("held", 4)], [])
  assert conn.allocated == [("remote", [2, 3], 8)]
  assert [r.status for r in (run, remote, held, wait)] == [Status.RUNNING, Status.WAITING_FOR_REMOTE_KV,
                                                           Status.RUNNING, Status.WAITING]
  assert (s.kv.pages("run"), s.kv.pages("held"), s.num_seqs) == ([1], [4], 3)
  s.finish(wait, "abort")
  assert list(s.waiting) == [] and s.kv.num_free_pages == 4
  s.finish(remote, "abort")
  assert s.waiting_for_kv == {} and s.kv.pages("remote") == [] and s.kv.num_free_pages == 6
  with pytest.raises(ValueError, match="request 'remote' is not waiting for remote KV"):
    s.kv_arrived(remote)
  s.finish(run, "abort")
  assert s.kv.num_free_pages == 7
  s.finish(held, "length")  # hold_kv: finished, its page kept for a transfer
  assert (held.status, s.kv.pages("held"), list(s.held), s.kv.num_free_pages) == (Status.FINISHED, [4], ["held"], 7)
  assert s.release_held("held") and not s.release_held("held")
  assert s.kv.num_free_pages == 8 and not s.has_unfinished() and s.num_seqs == 0
  assert [r.finish_reason for r in (run, remote, held, wait)] == ["abort", "abort", "length", "abort"]
  assert conn.finished == ["wait", "remote", "run", "held"]
  # Every sequence slot is free again: three new requests run at once, in rows 0..2.
  new = add(s, *(request(f"n{i}", tokens(2, 10 * i)) for i in range(4)))
  assert step(s) == ([("n0", 2), ("n1", 2), ("n2", 2)], [])
  assert sorted(r.row for r in new[:3]) == [0, 1, 2]


def test_remote_kv_arrival_counts_the_remote_tokens_as_computed():
  s = make(budget=8, connector=HalfRemote())
  r, = add(s, request("remote", tokens(10, 100)))
  assert step(s) == ([], []) and r.num_computed == 0 and r.num_remote_tokens == 8
  s.kv_arrived(r)
  assert (r.status, r.num_computed, s.running) == (Status.RUNNING, 8, [r])
  # Its imported blocks (8 tokens, pages 1 and 2) are in the prefix cache from now on.
  assert s.kv.lookup(tokens(10, 100), record=False) == [1, 2]
  assert step(s) == ([("remote", 2)], []) and s.kv.pages("remote") == [1, 2, 3]
  assert r.row == 0 and s.row_gen.tolist() == [1, 0, 0, 0]  # taken while its KV came


def test_ending_a_request_that_waits_for_its_kv_frees_its_row_with_a_new_tenancy():
  s = make(budget=8, connector=HalfRemote())
  r, = add(s, request("remote", tokens(10, 100)))
  step(s)
  assert r.row == 0 and s.row_gen.tolist() == [1, 0, 0, 0]
  s.finish(r, "abort")
  assert r.row is None and s.row_gen.tolist() == [2, 0, 0, 0]


def test_schedule_counts_a_step_in_flight_and_update_from_output_settles_it():
  s = make(budget=8)
  a, b = add(s, request("a", tokens(6)), request("b", tokens(12, 100)))
  out = s.schedule()  # a's whole prompt samples; b's first 2 tokens are a chunk
  assert (out.starts, out.samples, out.drafts) == ([0, 0], [True, False], [[], []])
  assert (a.num_computed, a.num_inflight, b.num_computed, b.num_inflight) == (6, 1, 2, 0)
  assert a.num_uncomputed == 1  # its next step feeds the token in flight
  s.update_from_output(out)  # the step failed: nothing more is computed, nothing in flight
  assert (a.num_computed, a.num_inflight, b.num_computed) == (6, 0, 2)
  a.token_ids.append(7)
  a.spec_token_ids = [8, 9]
  out = s.schedule()
  assert (out.starts, out.samples, out.drafts) == ([6, 2], [True, False], [[8, 9], []])
  assert (a.num_computed, a.num_inflight, a.num_inflight_drafts) == (7, 1, 2)
  ids = np.array([[8, 5, 0], [0, 0, 0]], np.int32)
  assert s.update_from_output(out, ids, np.array([2, 0])) == [[8], []]
  assert (a.num_computed, a.num_inflight, a.num_inflight_drafts, b.num_computed) == (8, 0, 0, 7)
  # a's first two blocks (8 known tokens with the accepted draft) and b's first are final: cached.
  assert s.kv.cached_hashes() == set(hash_blocks(a.token_ids + [8], PS)[:2] + hash_blocks(b.token_ids, PS)[:1])
