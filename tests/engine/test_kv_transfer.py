"""The disaggregation seam without a network: page export / import between two
runners, the scheduler's waiting-for-remote-KV and held states, and two
engines handing one request from prefill to decode."""

import dataclasses

import numpy as np
import pytest

from conftest import tiny_dir
from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.kv_connector import KVConnector, KVLayout, KVTransferError
from jaxinfer.engine.kv_manager import KVManager
from jaxinfer.engine.kv_transfer import MAX_TRANSFER_PAGES
from jaxinfer.engine.scheduler import Request, Scheduler, Status

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, warmup=False)


class RemoteAll(KVConnector):
  """Every fresh request's prompt (past local cache hits) comes from elsewhere; records calls."""

  def __init__(self):
    self.allocs, self.finished = [], []

  def get_num_new_matched_tokens(self, req, num_computed):
    return req.num_prompt_tokens - num_computed

  def update_state_after_alloc(self, req, pages, num_external_tokens):
    self.allocs.append((req.request_id, list(pages), req.num_computed, num_external_tokens))

  def request_finished(self, req):
    self.finished.append(req.request_id)
    return False


@pytest.fixture(scope="module")
def pair():
  """Two engines over the same model: a producer and a consumer with different pool sizes."""
  return LLM(tiny_dir("llama3"), **ENGINE), LLM(tiny_dir("llama3"), num_pages=150, **ENGINE)


def randomize_cache(runner, seed):
  import jax
  rng = np.random.default_rng(seed)
  runner.cache = jax.device_put([{n: rng.standard_normal(a.shape).astype(np.float32) for n, a in layer.items()}
                                 for layer in runner.cache], jax.devices()[0])


def test_export_import_round_trip_is_bit_exact_across_page_ids_and_pool_sizes(pair):
  a, b = pair[0].engine.runner, pair[1].engine.runner
  assert a.num_pages != b.num_pages
  randomize_cache(a, 0)
  b.reset_state()
  src = list(range(120, 120 - (MAX_TRANSFER_PAGES + 6), -1))  # 70 pages: two programs (64 + 8)
  dst = list(range(b.num_pages - 1, b.num_pages - 1 - len(src), -1))
  got = a.export_pages(src)
  assert len(got) == 2 and got[0]["k"].shape == (len(src), 16, 1, 16) and got[0]["k"].dtype == np.float32
  b.import_pages(dst, got)
  host_a, host_b = [np.asarray(x) for x in _flat(a.cache)], [np.asarray(x) for x in _flat(b.cache)]
  for xa, xb in zip(host_a, host_b):
    np.testing.assert_array_equal(xb[dst], xa[src])  # bit-exact, page by page
    untouched = np.setdiff1d(np.arange(1, b.num_pages), dst)
    assert not xb[untouched].any()  # nothing else written (padding went to page 0 only)
  assert b.export_pages([])[0]["v"].shape == (0, 16, 1, 16)
  # Bounded programs: one per power-of-two bucket used, within max_programs.
  assert {p for p in a._programs if p[0] == "export"} == {("export", 64), ("export", 8)}


def _flat(cache):
  return [layer[n] for layer in cache for n in sorted(layer)]


def test_import_refuses_mismatches_naming_what_differs(pair):
  b = pair[1].engine.runner
  good = b.export_pages([1, 2])
  before = [np.asarray(x).copy() for x in _flat(b.cache)]

  def bad(fn):
    return [{n: fn(n, a) for n, a in layer.items()} for layer in good]

  cases = [
      ([1, 2, 3], good, "page count is 2, expected 3"),
      ([1, 2], bad(lambda n, a: a.astype(np.float16)), "dtype is float16, this cache holds float32"),
      # Another worker's page size is fine (its tokens are re-chunked), but not more tokens than pages.
      ([1, 2], bad(lambda n, a: np.concatenate([a, a], 1)), "2 pages of 32 tokens fill 4 pages of 16, expected 2"),
      ([1, 2], bad(lambda n, a: np.concatenate([a, a], 2)), "num_kv_heads is 2, expected 1"),
      ([1, 2], bad(lambda n, a: a[..., :8]), "head_dim is 8, expected 16"),
      ([1, 2], good[:1], "num_layers: the transfer has 1 layers, this model has 2"),
      ([1, 2], [{"k": layer["k"]} for layer in good], r"arrays \['k'\], this cache \['k', 'v'\]"),
      ([0, 2], good, r"page ids \[0\] are outside \[1, 150\)"),
      ([2, 2], good, r"page ids repeat"),
      ([1, 150], good, r"page ids \[150\] are outside"),
  ]
  for ids, arrays, message in cases:
    with pytest.raises(KVTransferError, match=message):
      b.import_pages(ids, arrays)
  for x, y in zip(before, _flat(b.cache)):
    np.testing.assert_array_equal(x, np.asarray(y))  # a refused import wrote nothing


def test_layout_mismatch_names_every_field():
  ours = KVLayout(2, 16, 1, 16, "float32")
  ours.check_matches(KVLayout(2, 16, 1, 16, "float32"))
  with pytest.raises(KVTransferError, match=r"page_size: ours 16, prefill worker's 32; dtype: ours "
                                            r"'float32', prefill worker's 'bfloat16'"):
    ours.check_matches(KVLayout(2, 32, 1, 16, "bfloat16"), "prefill worker")
  assert ours.page_bytes == 2 * 2 * 16 * 1 * 16 * 4


def test_scheduler_parks_remote_requests_with_pages_and_holds_finished_ones():
  kv = KVManager(num_pages=10, page_size=4)
  conn = RemoteAll()
  s = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=8, connector=conn)
  r = Request("r", list(range(1, 11)), SamplingParams(), seed=0)  # 10 tokens: 3 pages
  s.add(r)
  out = s.schedule()
  assert out.scheduled == [] and r.status is Status.WAITING_FOR_REMOTE_KV
  assert conn.allocs == [("r", [1, 2, 3], 0, 10)] and kv.pages("r") == [1, 2, 3]
  assert s.num_seqs == 1 and s.has_unfinished()
  assert s.schedule().scheduled == []  # nothing to compute until the KV is in
  r.token_ids.append(42)  # the remote first token, committed by the engine
  s.kv_arrived(r)
  assert r.status is Status.RUNNING and r.num_computed == 10
  out = s.schedule()
  assert out.scheduled == [(r, 1)] and kv.pages("r") == [1, 2, 3]  # token 10 fits page 3
  s.finish(r, "abort")  # (its pages go back, tail first: 4..9, then 3, 2, 1)
  # A request that waits for KV and is aborted: pages back, connector told.
  q = Request("q", [7] * 5, SamplingParams(), seed=0)
  s.add(q)
  s.schedule()
  assert kv.pages("q") == [4, 5] and q.status is Status.WAITING_FOR_REMOTE_KV
  s.finish(q, "abort")
  assert kv.pages("q") == [] and conn.finished == ["r", "q"] and not s.waiting_for_kv
  # hold_kv: pages outlive the request until release_held.
  s.connector = None
  h = Request("h", [3] * 6, SamplingParams(), seed=0, hold_kv=True)
  s.add(h)
  s.schedule()  # its whole prompt: 6 tokens computed
  s.finish(h, "length")
  assert h.status is Status.FINISHED and s.held == {"h": h} and kv.pages("h") == [6, 7]  # FIFO: 4, 5 went to the back
  assert kv.num_free_pages == 9 - 2
  assert s.release_held("h") and not s.release_held("h")
  assert kv.pages("h") == [] and kv.num_free_pages == 9


def test_two_engines_hand_a_request_from_prefill_to_decode(pair):
  """Producer prefills to the first token (pages held), consumer imports them and decodes:
  the same tokens and logprobs as one engine, greedy and seeded; a second request whose
  prefix the consumer has cached imports only the missing pages."""
  prod, cons = pair[0].engine, pair[1].engine
  prod.runner.reset_state()
  cons.runner.reset_state()
  conn = RemoteAll()
  cons.set_kv_connector(conn)
  ref = LLM(tiny_dir("llama3"), **ENGINE)
  prompt = list(range(5, 45))  # 40 tokens: 3 pages of 16
  cases = [("g1", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)),
           ("s1", prompt[:37] + [9, 9, 9], SamplingParams(temperature=0.9, seed=5, max_tokens=12,
                                                            ignore_eos=True, logprobs=2))]
  try:
    for rid, ids, sp in cases:
      want = ref.generate([ids], sp)[0]
      cons.add_request(rid, ids, sp)
      assert cons.step() == []
      (_, pages, cached, remote), = [a for a in conn.allocs if a[0] == rid]
      skip = cached // 16
      prod.add_request(rid, ids, dataclasses.replace(sp, max_tokens=1), hold_kv=True)
      while prod.has_unfinished():
        outs = prod.step()
      first = outs[-1]
      assert rid in prod.scheduler.held
      arrays = prod.export_kv(rid, skip, len(prod.kv.pages(rid)) - skip)
      cons.import_kv(rid, skip, arrays)
      cons.finish_remote_kv(rid, first.token_ids[0], first.logprobs[0], first.top_logprobs[0])
      assert prod.release_kv(rid) and prod.kv.num_free_pages == prod.kv.num_pages - 1
      got = []
      while cons.has_unfinished():
        got += cons.step()
      assert got[0].new_token_ids == first.token_ids  # the imported first token is streamed first
      assert got[-1].token_ids == want.token_ids
      np.testing.assert_allclose(got[-1].logprobs, want.logprobs, atol=1e-5)
      assert got[-1].top_logprobs[0] == pytest.approx(want.top_logprobs[0], abs=1e-5)
    # The second prompt shares 2 full pages with the first: only its third page came over.
    assert [(a[2], a[3]) for a in conn.allocs] == [(0, 40), (32, 8)]
    assert cons.kv.num_free_pages == cons.kv.num_pages - 1
  finally:
    cons.set_kv_connector(None)


def test_import_outside_the_remote_pages_and_unknown_requests_are_refused(pair):
  cons = pair[1].engine
  conn = RemoteAll()
  cons.set_kv_connector(conn)
  try:
    cons.add_request("x", list(range(1, 21)), SamplingParams(max_tokens=4))  # 2 pages
    cons.step()
    arrays = cons.runner.export_pages([1, 2, 3])
    with pytest.raises(KVTransferError, match=r"pages \[0, 3\) are not among the pages its remote "
                                              r"tokens fill, \[0, 2\)"):
      cons.import_kv("x", 0, arrays)
    with pytest.raises(KVTransferError, match="'nope' is not waiting for remote KV"):
      cons.import_kv("nope", 0, arrays)
    with pytest.raises(KVTransferError, match="must send the first token"):
      cons.finish_remote_kv("x")
    cons.abort("x")
    assert cons.kv.num_free_pages == cons.kv.num_pages - 1 and not cons.has_unfinished()
    with pytest.raises(KVTransferError, match="'x' holds no KV pages"):
      cons.export_kv("x", 0, 1)
  finally:
    cons.set_kv_connector(None)


def test_pages_of_another_page_size_land_in_ours_bit_exact(pair):
  """A 16-token-page producer's pages re-chunked into an 8-token-page consumer, through
  import_pages (page-major) and export_tokens / import_tokens (token-major, mid-page start)."""
  a = pair[0].engine.runner
  b = LLM(tiny_dir("llama3"), page_size=8, num_pages=40, **ENGINE).engine.runner
  randomize_cache(a, 3)
  src = [5, 9, 2]  # 48 tokens
  dst = [11, 3, 20, 7, 30, 12]  # 6 pages of 8
  b.import_pages(dst, a.export_pages(src))
  for xa, xb in zip(_flat(a.cache), _flat(b.cache)):
    tokens_a = np.asarray(xa)[src].reshape(48, 1, 16)
    np.testing.assert_array_equal(np.asarray(xb)[dst].reshape(48, 1, 16), tokens_a)
  # Tokens [20, 43) of the producer's sequence into consumer positions [20, 43): page 2 of
  # the consumer (tokens 16..23) is written from its offset 4 on, the rest of it kept.
  b.reset_state()
  runs = a.export_tokens(src, 20, 23)
  assert runs[0]["k"].shape == (23, 1, 16)
  b.import_tokens(dst, 20, runs)
  for xa, xb in zip(_flat(a.cache), _flat(b.cache)):
    tokens_a = np.asarray(xa)[src].reshape(48, 1, 16)
    tokens_b = np.asarray(xb)[dst].reshape(48, 1, 16)
    np.testing.assert_array_equal(tokens_b[20:43], tokens_a[20:43])
    assert not tokens_b[:20].any() and not tokens_b[43:].any()
  with pytest.raises(KVTransferError, match=r"tokens \[40, 63\) are outside the 6 pages of 8 tokens"):
    b.import_tokens(dst, 40, runs)


def test_engines_with_different_page_sizes_hand_a_request_over(pair):
  """Prefill on 16-token pages, decode on 8-token pages, through the token-major engine seam:
  the same greedy tokens and logprobs as one engine."""
  prod = pair[0].engine
  prod.runner.reset_state()
  cons = LLM(tiny_dir("llama3"), page_size=8, **ENGINE).engine
  conn = RemoteAll()
  cons.set_kv_connector(conn)
  ref = LLM(tiny_dir("llama3"), **ENGINE)
  prompt = list(range(7, 44))  # 37 tokens: 3 pages of 16 there, 5 pages of 8 here
  sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
  want = ref.generate([prompt], sp)[0]
  cons.add_request("x", prompt, sp)
  assert cons.step() == [] and len(cons.kv.pages("x")) == 5
  prod.add_request("x", prompt, dataclasses.replace(sp, max_tokens=1), hold_kv=True)
  while prod.has_unfinished():
    outs = prod.step()
  first = outs[-1]
  # Two transfers, split mid-page on both sides (token 21: page 1 of 16, page 2 of 8).
  for lo, hi in ((0, 21), (21, 37)):
    cons.import_kv_tokens("x", lo, prod.export_kv_tokens("x", lo, hi - lo))
  with pytest.raises(KVTransferError, match=r"tokens \[30, 40\) are not among its remote tokens \[0, 37\)"):
    cons.import_kv_tokens("x", 30, prod.export_kv_tokens("x", 30, 10))
  cons.finish_remote_kv("x", first.token_ids[0], first.logprobs[0], first.top_logprobs[0])
  prod.release_kv("x")
  got = []
  while cons.has_unfinished():
    got += cons.step()
  assert got[-1].token_ids == want.token_ids
  np.testing.assert_allclose(got[-1].logprobs, want.logprobs, atol=1e-5)
