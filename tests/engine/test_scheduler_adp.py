"""Attention-DP balance without a model: the scheduler holds back prefill on a data rank
planned above the level the other ranks run (DPBalanceConfig), never a decode row, never
into an empty step, and never one request past `timeout` steps.

Four data ranks, pages of 4 tokens, a step budget of 64 tokens (16 a rank). `step` settles
a step as LLMEngine does: a request whose step reaches its known tokens samples one."""

import copy

import numpy as np
import pytest

from jaxinfer.engine.kv_manager import KVManager
from jaxinfer.engine.scheduler import DPBalanceConfig, Request, Scheduler
from jaxinfer.errors import InvalidRequestError
from jaxinfer.sampling import SamplingParams


def make(timeout=3, hold=True, max_num_seqs=16) -> Scheduler:
  kv = KVManager(num_pages=4 * 40, page_size=4, num_shards=4, enable_prefix_caching=False)
  return Scheduler(kv, max_num_seqs, 64, dp_balance=DPBalanceConfig(hold_prefill=hold, timeout=timeout))


def request(rid: str, n: int, start: int, max_tokens: int = 50) -> Request:
  return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens), seed=0)


def step(s: Scheduler) -> list[tuple[str, int]]:
  out = s.schedule()
  ids = np.array([[500 + len(r.token_ids)] for r, _ in out.scheduled], np.int32).reshape(-1, 1)
  s.update_from_output(out, ids, np.array(out.samples, np.int32))
  for (r, _), sampled, row in zip(out.scheduled, out.samples, ids):
    r.token_ids += row.tolist() if sampled else []
  return [(r.request_id, n) for r, n in out.scheduled]


def decoding(s: Scheduler) -> list[Request]:
  """a, b, c, d on ranks 0-3 (equal loads: the lowest index first), each past its 3-token
  prompt and decoding: one token a rank a step."""
  reqs = [request(r, 3, 100 * i) for i, r in enumerate("abcd")]
  for r in reqs:
    s.add(r)
  assert step(s) == [(r, 3) for r in "abcd"] and s.rank_tokens == [3, 3, 3, 3]  # even: nothing held
  assert [s.kv.request_shard(r) for r in "abcd"] == [0, 1, 2, 3]
  return reqs


def test_each_rank_is_cut_to_the_level_the_least_busy_rank_runs():
  s = make(timeout=3)
  decoding(s)
  for rid, n, start in [("long", 40, 1000), ("m1", 6, 2000), ("m2", 9, 3000), ("m3", 7, 4000)]:
    s.add(request(rid, n, start))
  # Planned: rank 0 a's token + long's 15 (its share), rank 1 b + m1's 6, rank 2 c + m2's 9,
  # rank 3 d + m3's 7: [16, 7, 10, 8]. Rank 1 runs 7, so ranks 0, 2, 3 are cut to 7; their
  # decode rows stay, their prefill gives way.
  assert step(s) == [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("long", 6), ("m1", 6), ("m2", 6), ("m3", 6)]
  assert s.rank_tokens == [7, 7, 7, 7]
  held = {r.request_id: r.num_held_steps for r in s.running}
  assert held == {"a": 0, "b": 0, "c": 0, "d": 0, "long": 1, "m1": 0, "m2": 1, "m3": 1}
  # m1 has sampled and decodes; m3's last prompt token is a one-token row (never held, like a
  # decode row); every rank runs 2 whatever happens, so long and m2 run 1 each.
  assert step(s) == [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("long", 1), ("m1", 1), ("m2", 1), ("m3", 1)]
  assert s.rank_tokens == [2, 2, 2, 2]
  assert [r.num_held_steps for r in s.running[4:]] == [2, 0, 2, 1]


def test_a_rank_cuts_its_newest_request_first():
  s = make(timeout=3)
  decoding(s)
  for rid, n, start in [("p", 10, 1000), ("q", 10, 2000), ("r", 10, 3000), ("s", 10, 4000), ("t", 3, 5000)]:
    s.add(request(rid, n, start))
  # p..s go to ranks 0..3 (1 + 10 each), t to rank 0 (tied at 11: the lowest index), which plans
  # a + p + t = 14 against 11 elsewhere: t, admitted last, gives way whole; p runs all 10.
  assert step(s) == [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("p", 10), ("q", 10), ("r", 10), ("s", 10)]
  t = s.running[-1]
  assert (t.request_id, s.kv.request_shard("t"), t.num_computed, t.num_held_steps) == ("t", 0, 0, 1)
  assert s.rank_tokens == [11, 11, 11, 11]


def test_a_lone_prefill_is_held_for_timeout_steps_then_runs_its_share():
  """Ranks 1-3 only decode, so rank 0's long prompt is held back entirely (its 15 tokens
  would pad three ranks running one token each) for exactly `timeout` steps; then it is
  released and never held again: its first token comes `timeout` steps later than without
  the hold, and no later."""
  first_token = {}
  for hold in (True, False):
    s = make(timeout=3, hold=hold)
    decoding(s)
    long = request("long", 40, 1000)
    s.add(long)
    plans = []
    for i in range(7):
      plans.append(step(s))
      if long.output_token_ids and hold not in first_token:
        first_token[hold] = i
    decode = [("a", 1), ("b", 1), ("c", 1), ("d", 1)]
    chunks = [15, 15, 10, 1]  # the 40-token prompt in 16-token shares after a's token, then decode
    if hold:
      assert plans[:3] == [decode] * 3 and long.num_held_steps == 3
      assert plans[3:] == [decode + [("long", n)] for n in chunks]
    else:
      assert plans[:4] == [decode + [("long", n)] for n in chunks] and long.num_held_steps == 0
  assert first_token == {False: 2, True: 5}  # (the step that runs its last prompt token: 10 of them)


def test_decode_rows_are_never_held_and_a_step_is_never_emptied():
  s = make(timeout=5)
  a, b, c, d = decoding(s)
  s.finish(b, "abort"), s.finish(c, "abort"), s.finish(d, "abort")
  s.add(request("p", 30, 1000))  # rank 1 (load 0), the others idle
  # Ranks 2 and 3 run nothing: the level is 1 (a's decode row, which stays); p's 16 on rank 1
  # are cut to 1 too: rank 1 runs as much as the busiest decode rows.
  assert step(s) == [("a", 1), ("p", 1)] and s.rank_tokens == [1, 1, 0, 0]
  s.finish(a, "abort")
  # Nothing but p's prefill: holding it would leave the step empty (and an idle engine
  # sleeps until the next command), so it runs.
  assert step(s) == [("p", 16)] and s.rank_tokens == [0, 16, 0, 0]
  assert s.running[0].num_held_steps == 1


def test_a_hold_with_timeout_zero_or_turned_off_changes_nothing():
  for cfg in (dict(timeout=0), dict(hold=False)):
    s = make(**cfg)
    decoding(s)
    s.add(request("long", 40, 1000))
    assert step(s)[-1] == ("long", 15)


def test_config_is_checked():
  with pytest.raises(InvalidRequestError, match=r"dp_balance.timeout must be an int >= 0 \(steps\), got -1"):
    DPBalanceConfig(timeout=-1)
  with pytest.raises(InvalidRequestError, match="timeout must be an int"):
    DPBalanceConfig(timeout=2.5)
  with pytest.raises(InvalidRequestError, match="hold_prefill must be a bool, got 1"):
    DPBalanceConfig(hold_prefill=1)
  with pytest.raises(InvalidRequestError, match=r"unknown dp_balance option\(s\) \['timeout_iters'\]"):
    DPBalanceConfig.parse({"timeout_iters": 3})
  with pytest.raises(InvalidRequestError, match="dp_balance must be a dict or DPBalanceConfig, got int"):
    DPBalanceConfig.parse(3)
  assert DPBalanceConfig.parse(None) == DPBalanceConfig() == DPBalanceConfig(hold_prefill=True, timeout=4)
  assert DPBalanceConfig.parse({"timeout": 2}) == DPBalanceConfig(timeout=2)


def test_on_a_random_trace_the_hold_cuts_only_prefill_and_no_request_past_the_timeout():
  """Seeded arrivals of 1-100-token prompts on 4 ranks. Every step, against the plan the same
  state gets with the hold off (a copy): each decode row (one token to compute, drafts none
  here) runs as planned, prefill chunks run as planned or less, nothing else is added; and no
  request is held in more than `timeout` steps. The trace drains (nothing starves)."""
  rng = np.random.default_rng(0)
  timeout = 4
  s = make(timeout=timeout, max_num_seqs=64)
  reqs = [request(f"r{i}", int(rng.integers(1, 101)), 1000 * i, int(rng.integers(1, 20))) for i in range(120)]
  arrivals = np.sort(rng.integers(0, 150, len(reqs)))
  pending, cut_steps, t = list(zip(arrivals, reqs))[::-1], 0, 0
  while pending or s.has_unfinished():
    while pending and pending[-1][0] <= t:
      s.add(pending.pop()[1])
    free = copy.deepcopy(s)
    free.dp_balance = DPBalanceConfig(hold_prefill=False)
    decode = {r.request_id for r in free.running if r.num_uncomputed == 1}
    planned = dict((r.request_id, n) for r, n in free.schedule().scheduled)
    plan = dict(step(s))
    assert plan.keys() <= planned.keys()
    assert all(plan.get(rid) == n if rid in decode else plan.get(rid, 0) <= n for rid, n in planned.items())
    cut_steps += plan != planned
    assert max((r.num_held_steps for r in s.running), default=0) <= timeout
    for r in list(s.running):
      if len(r.output_token_ids) >= r.params.max_tokens:
        s.finish(r, "length")
    t += 1
    assert t < 2000, "the trace did not drain"
  assert all(r.finish_reason == "length" for r in reqs)
  assert cut_steps == 80 and max(r.num_held_steps for r in reqs) == timeout  # the hold acted, and the bound bound
