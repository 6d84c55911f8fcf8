"""Attention data parallelism, host side: the KV pool split into data shards, each request on
one shard (the lowest predicted load, prefix hits counted), the step's token budget split
per shard, preemption within a shard; and
an engine on a (data=2, model=2) mesh whose requests' pages stay on their shard's devices."""

import numpy as np
import pytest

from conftest import tiny_dir
from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.kv_manager import KVManager
from jaxinfer.engine.scheduler import DPBalanceConfig, Request, Scheduler, rank_by_load, split_budget
from jaxinfer.serving.metrics import Metrics
from jaxinfer.sharding import make_mesh


def test_shards_own_contiguous_pages_and_allocate_only_there():
  kv = KVManager(num_pages=8, page_size=4, num_shards=2)  # shard 0: pages 1-3, shard 1: pages 5-7
  assert [kv.num_free_pages_in(s) for s in (0, 1)] == [3, 3] and kv.num_free_pages == 6
  assert kv.is_padding_page(0) and kv.is_padding_page(4) and not kv.is_padding_page(5)
  assert kv.allocate("a", 6, shard=1) == [5, 6] and kv.request_shard("a") == 1
  assert kv.allocate("b", 3, shard=0) == [1]
  assert kv.allocate("a", 9) == [5, 6, 7]  # later allocations stay on the request's shard
  assert not kv.can_allocate("a", 13) and kv.num_free_pages_in(0) == 2  # shard 0's pages do not help
  with pytest.raises(RuntimeError, match="need 1, have 0 on shard 1"):
    kv.allocate("a", 13)
  kv.free("a")
  assert kv.request_shard("a") is None and kv.allocate("c", 4, shard=1) == [7]  # tail pages freed first
  assert kv.usage == pytest.approx(1 - 4 / 6)


def test_prefix_hits_only_on_the_request_shard():
  kv = KVManager(num_pages=8, page_size=4, num_shards=2)
  tokens = list(range(1, 10))  # 2 full blocks + 1
  kv.allocate("a", 9, shard=1)
  kv.cache_blocks("a", tokens, 9)
  assert kv.lookup(tokens, shard=0) == [] and kv.lookup(tokens, shard=1) == [5, 6]
  # The longest hit outranks the load; with no hit anywhere, the least loaded shard first.
  assert kv.rank_shards(tokens, loads=[0, 100]) == [1, 0]
  assert kv.rank_shards([9, 9, 9, 9, 9], loads=[5, 2]) == [1, 0]
  assert kv.rank_shards(tokens, loads=[0, 100], use_cache=False) == [0, 1]
  with pytest.raises(ValueError, match=r"not all on 'b''s shard 0"):
    kv.allocate("b", 9, cached=[5, 6], shard=0)
  # A request on shard 0 computes the same blocks again; its copies are not published.
  kv.allocate("b", 9, shard=0)
  kv.cache_blocks("b", tokens, 9)
  assert [e.kind for e in kv.drain_events()] == ["stored", "stored"]
  assert kv.lookup(tokens, shard=0) == []


# The placement and budget rules alone: the hold (tests/engine/test_scheduler_adp.py) would cut
# the chunks these tests follow.
NO_HOLD = DPBalanceConfig(hold_prefill=False)


def _req(rid, n):
  return Request(rid, list(range(100 + n, 100 + 2 * n)), SamplingParams(max_tokens=4), seed=0)


def test_scheduler_balances_running_tokens_and_preempts_within_a_shard():
  kv = KVManager(num_pages=12, page_size=4, num_shards=2, enable_prefix_caching=False)  # 5 pages a shard
  s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, dp_balance=NO_HOLD)
  reqs = [_req("r10", 10), _req("r3", 3), _req("r5", 5), _req("r4", 4)]
  for r in reqs:
    s.add(r)
  first = s.schedule()
  # Predicted load: the rank's tokens still to compute (all of them, before the step runs)
  # plus the new request's. r10 -> 0 (0+10 vs 0+10: lowest index); r3 -> 1 (10+3 vs 0+3);
  # r5 -> 1 (15 vs 3+5); r4 -> 1 (14 vs 8+4).
  assert [kv.request_shard(r.request_id) for r in reqs] == [0, 1, 1, 1]
  # Planned, the step's tokens count as computed: each sequence has its next token left.
  assert s.shard_loads() == [1, 3]
  assert s.rank_tokens == [10, 12] and s.rank_imbalance == pytest.approx(12 / 11)
  assert kv.pages("r10") == [1, 2, 3] and kv.pages("r3") == [7] and kv.pages("r5") == [8, 9]
  assert kv.pages("r4") == [10]
  # Shard 1 has one page left (11); r3, r5 and r4 each grow into a new page: r4, the newest
  # on shard 1, is preempted (r10 on shard 0 is not touched, though shard 0 has pages).
  s.update_from_output(first)  # (no ids: nothing more is computed; the samples are no longer in flight)
  for r in reqs:
    r.token_ids += [1] * (4 - len(r.token_ids) % 4 + 1)  # one token into a new page (r4: two)
  r4 = reqs[3]
  out = s.schedule()
  assert out.preempted == [r4] and kv.pages("r4") == []
  assert kv.pages("r3") == [7, 11] and kv.pages("r5") == [8, 9, 10]  # r4's page went to r5
  assert kv.pages("r10") == [1, 2, 3, 4]


def test_budgets_split_evenly_and_ranks_rank_by_predicted_load():
  assert split_budget(10, 4) == [3, 3, 2, 2] and split_budget(8, 1) == [8]
  with pytest.raises(ValueError, match="cannot give each of 4 data ranks one"):
    split_budget(3, 4)
  with pytest.raises(ValueError, match=r"a step budget of 3 tokens \(max_num_batched_tokens\) cannot give each of 4"):
    Scheduler(KVManager(num_pages=16, page_size=4, num_shards=4), max_num_seqs=4, max_num_batched_tokens=3)
  # Rank 2's prefix hit makes it the cheapest though it is among the busiest; ties: lowest index.
  assert rank_by_load([100, 90, 100, 90], [64, 64, 16, 64]) == [2, 1, 3, 0]  # 164, 154, 116, 154
  assert rank_by_load([5, 5], [3, 3]) == [0, 1]
  with pytest.raises(ValueError, match="3 rank loads but 2"):
    rank_by_load([1, 2, 3], [1, 2])


def _step(s: Scheduler):
  """Plans a step and settles it as the engine would: a request whose step reaches its known
  tokens samples one (500 + its length)."""
  out = s.schedule()
  ids = np.array([[500 + len(r.token_ids)] for r, _ in out.scheduled], np.int32).reshape(-1, 1)
  s.update_from_output(out, ids, np.array(out.samples, np.int32))
  for (r, _), sampled, row in zip(out.scheduled, out.samples, ids):
    r.token_ids += row.tolist() if sampled else []
  return out


def test_a_prefix_hit_counts_as_load_saved_not_as_first_choice():
  """A request whose prefix is cached on a busy rank goes there only while the hit
  outweighs the load; KVManager.rank_shards (the older rule) always takes the hit."""
  kv = KVManager(num_pages=80, page_size=4, num_shards=2)  # 39 pages a shard
  s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=32, dp_balance=NO_HOLD)  # 16 tokens a rank
  shared = list(range(1, 33))  # 8 full blocks
  first = Request("first", shared + [7], SamplingParams(max_tokens=50), seed=0)
  s.add(first)
  for _ in range(3):  # 16 + 16 + 1 prompt tokens, then its first token is sampled
    _step(s)
  assert len(first.token_ids) == 34 and first.num_computed == 33  # rank 0 holds the 8 blocks
  assert s.shard_loads() == [1, 0] and kv.hit_pages_per_shard(shared + [9]) == [8, 0]
  s.add(Request("bulk", shared + list(range(100, 161)), SamplingParams(max_tokens=50), seed=0))
  _step(s)
  assert kv.request_shard("bulk") == 0  # 1 + 61 (its hit saves 32) vs 0 + 93
  assert s.shard_loads() == [1 + 46, 0]  # first's next token; bulk's 61 less the 15 this step ran
  s.add(Request("hit1", shared + [9], SamplingParams(max_tokens=4), seed=0))
  _step(s)
  assert kv.request_shard("hit1") == 1  # 47 + 1 vs 0 + 33: the hit loses to the load
  assert kv.rank_shards(shared + [9], [47, 0]) == [0, 1]  # the older rule would take it
  while s.running[1].num_uncomputed > 1:  # bulk prefills on
    _step(s)
  assert s.shard_loads() == [2, 1]
  s.add(Request("hit2", shared + [10], SamplingParams(max_tokens=4), seed=0))
  _step(s)
  assert kv.request_shard("hit2") == 0  # 2 + 1 vs 1 + 33: now the hit wins, its pages shared
  assert kv.pages("hit2")[:8] == kv.pages("first")[:8]


def test_each_rank_gets_its_share_of_the_step_budget():
  """A long prompt on rank 0 takes rank 0's 8 tokens a step, not the whole 16: rank 1's
  requests run in the same steps."""
  kv = KVManager(num_pages=42, page_size=4, num_shards=2, enable_prefix_caching=False)
  s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=16, dp_balance=NO_HOLD)
  long, a, b = _req("long", 40), _req("a", 5), _req("b", 6)
  for r in (long, a, b):
    s.add(r)
  out = _step(s)
  # long -> 0 (tie); a -> 1 (80+5 vs 5); b -> 1 (80+6 vs 10+6): rank 1's 8 tokens: a's 5, b's 3.
  assert [(r.request_id, n) for r, n in out.scheduled] == [("long", 8), ("a", 5), ("b", 3)]
  assert s.rank_tokens == [8, 8] and s.rank_imbalance == 1.0
  out = s.schedule()
  assert [(r.request_id, n) for r, n in out.scheduled] == [("long", 8), ("a", 1), ("b", 3)]
  assert s.rank_tokens == [8, 4] and s.rank_imbalance == pytest.approx(8 / 6)


def test_engine_places_each_request_on_one_data_shard():
  mesh = make_mesh(data=2, model=2)
  opts = dict(max_model_len=64, max_num_seqs=4, warmup=False)
  llm = LLM(tiny_dir("qwen3"), mesh=mesh, sharding_rules={"pages": "data"}, dp_balance={"timeout": 1}, **opts)
  eng = llm.engine
  assert eng.kv.num_shards == 2 and eng.kv.shard_pages * 2 == eng.runner.num_pages
  assert eng.scheduler.dp_balance == DPBalanceConfig(timeout=1)
  prompts = [list(range(1, 30)), [5, 17, 200, 3], list(range(40, 52)), [7, 8, 9]]
  sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
  for i, p in enumerate(prompts):
    eng.add_request(f"q{i}", p, sp)
  eng.step()
  shards = [eng.kv.request_shard(f"q{i}") for i in range(4)]
  assert shards == [0, 1, 1, 1]  # 29 tokens on shard 0 outweigh 4 + 12 + 3 on shard 1
  # (The outputs below equal one device's, the hold's cut chunks included.)
  # The step's tokens per data rank and their imbalance: a stat and a Prometheus gauge. The
  # hold (DPBalanceConfig, on by default) cut shard 0's 29 prompt tokens to shard 1's 19.
  stats = eng.stats()
  assert stats["dp_rank_tokens"] == [19, 19] and stats["dp_rank_imbalance"] == 1.0
  q0 = eng.scheduler.running[0]
  assert q0.num_held_steps == 1 and q0.num_computed == 19
  eng.step()  # its timeout spent, q0 runs its last 10 though shard 1 only decodes
  assert q0.num_held_steps == 1 and q0.num_computed == 29 and eng.stats()["dp_rank_tokens"] == [10, 3]
  metrics = Metrics()
  metrics.set_engine_stats(stats)
  text = metrics.exposition().decode()
  assert 'jaxinfer_dp_rank_tokens{rank="1"} 19.0' in text
  assert "jaxinfer_dp_rank_imbalance_ratio 1.0" in text
  for i, shard in enumerate(shards):
    assert {eng.kv.shard_of(p) for p in eng.kv.pages(f"q{i}")} == {shard}
  outs = {}
  while eng.has_unfinished():
    outs.update({o.request_id: o for o in eng.step() if o.finished})
  ref = LLM(tiny_dir("qwen3"), **opts)
  want = ref.generate(prompts, sp)
  assert [outs[f"q{i}"].token_ids for i in range(4)] == [w.token_ids for w in want]
  # Prompt logprobs come back per token in scheduled order from both shards' blocks.
  lp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1, logprobs=1)
  got, exp = llm.generate(prompts[:2], lp), ref.generate(prompts[:2], lp)
  for g, e in zip(got, exp):
    assert g.token_ids == e.token_ids and len(g.prompt_logprobs) == len(e.prompt_logprobs)
    for a, b in zip(g.prompt_logprobs[1:], e.prompt_logprobs[1:]):
      assert a.keys() == b.keys() and np.allclose(list(a.values()), list(b.values()), atol=1e-5)
  with pytest.raises(Exception, match=r"padding pages"):
    eng.runner.export_pages([eng.kv.shard_pages])


def test_pack_shards_puts_each_shard_in_its_own_block_with_local_pages():
  from jaxinfer.engine.runner import ScheduledSeq, pack_shards
  sp = SamplingParams(temperature=0)
  # Shard pages = 10: pages 11, 12 are shard 1's local pages 1, 2; page 3 is shard 0's.
  seqs = [ScheduledSeq(0, [7, 8, 9], 0, 3, [11], sp, 0),          # shard 1: 3 prefill tokens
          ScheduledSeq(1, [5] * 6, 5, 1, [3, 4], sp, 0),         # shard 0: a decode at position 5
          ScheduledSeq(2, [1] * 17, 16, 1, [11, 12], sp, 0)]     # shard 1 again (shares page 11: fine here)
  batch, (seq_rows, token_rows) = pack_shards(seqs, [1, 0, 1], 2, 10, T=4, S=2, k=0, pages_per_seq=3,
                                              page_size=16, scratch_row=9, vocab_size=32)
  np.testing.assert_array_equal(batch.tokens, [5, 0, 0, 0, 7, 8, 9, 1])
  np.testing.assert_array_equal(batch.positions, [5, 0, 0, 0, 0, 1, 2, 16])
  # Slots are shard-local: shard 0's decode at page 3 offset 5; shard 1's at local pages 1, 2.
  np.testing.assert_array_equal(batch.paged.slot_mapping, [3 * 16 + 5, 0, 0, 0, 16, 17, 18, 2 * 16])
  np.testing.assert_array_equal(batch.paged.page_indices, [[3, 4, 0], [0, 0, 0], [1, 0, 0], [1, 2, 0]])
  np.testing.assert_array_equal(batch.paged.cu_q_lens, [0, 1, 1, 0, 3, 4])
  np.testing.assert_array_equal(batch.paged.num_seqs, [1, 2])
  np.testing.assert_array_equal(batch.logits_indices, [0, 0, 4 + 2, 4 + 3])  # global hidden rows
  np.testing.assert_array_equal(seq_rows, [2, 0, 3])  # result rows back in scheduled order
  np.testing.assert_array_equal(token_rows, [4, 5, 6, 0, 7])


def test_deepseek_mla_latent_pages_split_by_data_with_wide_expert_parallelism():
  """DeepSeek-V3 (MLA: one latent per token, no head axis) on (data=2, expert=2, model=2):
  latent pages split over data, experts over (data, expert); golden logits, one-device greedy."""
  from conftest import golden
  mesh = make_mesh(data=2, expert=2, model=2)
  opts = dict(max_model_len=64, max_num_seqs=4, warmup=False)
  llm = LLM(tiny_dir("deepseek_v3"), mesh=mesh, sharding_rules={"pages": "data", "experts": ("data", "expert")},
            **opts)
  latent = llm.runner.cache[0]["latent"]
  cfg = llm.config
  N = llm.runner.num_pages
  assert latent.shape == (N, 16, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
  assert latent.addressable_shards[0].data.shape == (N // 2, 16, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
  g = golden("deepseek_v3")
  np.testing.assert_allclose(llm.logits(g["token_ids"].tolist()), g["logits"], atol=1e-4, rtol=0)
  prompts = [[5, 17, 200, 3], list(range(1, 30))]
  sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
  want = LLM(tiny_dir("deepseek_v3"), **opts).generate(prompts, sp)
  assert [o.token_ids for o in llm.generate(prompts, sp)] == [o.token_ids for o in want]


def test_cli_flags_turn_on_attention_dp_and_set_the_hold():
  """`--attention-dp --mesh 2,1,1` splits the KV pool over two data ranks (and without a data
  axis to split over is an error); `--dp-balance-timeout` sets the hold, 0 turns it off."""
  from jaxinfer.cli import _engine_options, _load_llm, build_parser
  from jaxinfer.errors import InvalidRequestError
  parse = build_parser().parse_args
  assert "dp_balance" not in _engine_options(parse(["serve"]))
  assert _engine_options(parse(["serve", "--dp-balance-timeout", "2"]))["dp_balance"] == {"timeout": 2}
  assert _engine_options(parse(["serve", "--dp-balance-timeout", "0"]))["dp_balance"] == {"hold_prefill": False}
  with pytest.raises(InvalidRequestError, match="--attention-dp splits the KV pool over the mesh's data axis"):
    _load_llm(parse(["serve", "--model", str(tiny_dir("llama3")), "--attention-dp", "--mesh", "1,1,2"]))
  llm = _load_llm(parse(["serve", "--model", str(tiny_dir("llama3")), "--attention-dp", "--mesh", "2,1,1",
                         "--dp-balance-timeout", "3", "--max-model-len", "128"]), warmup=False)
  assert llm.engine.kv.num_shards == 2 and llm.engine.scheduler.dp_balance == DPBalanceConfig(timeout=3)
