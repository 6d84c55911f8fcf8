"""The KV-aware router's index and cost, against real KVManagers and brute force."""

import numpy as np
import pytest

from jaxinfer.engine.kv_manager import KVEvent, KVManager, hash_block, hash_blocks
from jaxinfer.serving.kv_router import KVIndex, KVRouter, RouterConfig, SequenceGap

PS = 4


def test_hash_blocks_is_the_chain_of_hash_block():
  rng = np.random.default_rng(0)
  toks = [int(t) for t in rng.integers(0, 50_000, 37)]
  chain, parent = [], None
  for i in range(37 // PS):
    parent = hash_block(parent, toks[i * PS:(i + 1) * PS])
    chain.append(parent)
  assert hash_blocks(toks, PS) == chain
  assert hash_blocks(np.asarray(toks), PS, num_blocks=3) == chain[:3]
  assert hash_blocks(toks[2 * PS:], PS, parent=chain[1]) == chain[2:]


def _run(kv: KVManager, rid: str, toks: list[int]) -> None:
  cached = kv.lookup(toks)
  kv.allocate(rid, len(toks), cached)
  kv.cache_blocks(rid, toks, len(toks))
  kv.free(rid)


def test_overlap_equals_each_workers_own_prefix_lookup():
  """Three real KV managers serve different prompts (with evictions); the index fed by
  their events predicts, for new prompts, exactly the blocks each manager's lookup finds."""
  rng = np.random.default_rng(1)
  system = [int(t) for t in rng.integers(0, 1000, 6 * PS)]
  managers = {f"w{i}": KVManager(num_pages=14, page_size=PS) for i in range(3)}
  index = KVIndex()
  seqs = {}
  for name in managers:
    index.add_worker(name)
    seqs[name] = 0
  prompts = []
  for i in range(30):
    cut = int(rng.integers(0, len(system)))
    p = system[:cut] + [int(t) for t in rng.integers(0, 1000, int(rng.integers(1, 3 * PS)))]
    prompts.append(p)
    name = f"w{int(rng.integers(0, 3))}"
    _run(managers[name], f"r{i}", p)
    seqs[name] += 1
    index.apply(name, seqs[name], managers[name].drain_events())
  for p in prompts[-10:] + [system + [1, 2, 3]]:
    hashes = hash_blocks(p, PS, num_blocks=(len(p) - 1) // PS)  # as lookup: one token left to compute
    got = index.overlap(hashes)
    for name, kv in managers.items():
      assert got[index.slot(name)] == len(kv.lookup(p)), name


def test_overlap_matches_brute_force_on_chains_held_from_their_start():
  """Workers hold a prefix of the chain (they lose chains from the end); the bisecting
  walk must find each one's depth exactly, including with more than 64 slots."""
  rng = np.random.default_rng(2)
  index = KVIndex()
  W, N = 70, 300
  depth = rng.integers(0, N + 1, W)
  depth[:20] = rng.choice([0, 7, 150, N], 20)  # many workers sharing a few depths (a system prompt)
  for w in range(W):
    index.add_worker(f"w{w}")
    index.apply(f"w{w}", 1, [KVEvent("stored", 1000 + b) for b in range(depth[w])])
  chain = [1000 + b for b in range(N)]
  np.testing.assert_array_equal(index.overlap(chain), depth)
  np.testing.assert_array_equal(index.overlap(chain[:10]), np.minimum(depth, 10))
  assert index.overlap([]).tolist() == [0] * W


def test_events_are_numbered_a_gap_is_refused_and_a_snapshot_resyncs():
  index = KVIndex()
  index.add_worker("a")
  index.apply("a", 1, [KVEvent("stored", 1), KVEvent("stored", 2)])
  with pytest.raises(SequenceGap, match="expected event batch 2, got 3"):
    index.apply("a", 3, [KVEvent("removed", 1)])
  assert index.holds("a") == {1, 2}  # nothing of the refused batch applied
  index.load_snapshot("a", 3, [2, 5])
  assert index.holds("a") == {2, 5}
  index.apply("a", 4, [KVEvent("removed", 2), KVEvent("removed", 99)])  # 99: never stored
  assert index.overlap([5]).tolist() == [1] and index.overlap([2]).tolist() == [0]
  with pytest.raises(ValueError, match="unknown KV event kind"):
    index.apply("a", 5, [KVEvent("moved", 5)])


def test_a_removed_worker_disappears_from_the_index_and_its_slot_is_reused():
  index = KVIndex()
  for name in ("a", "b"):
    index.add_worker(name)
    index.apply(name, 1, [KVEvent("stored", 7)])
  index.remove_worker("a")
  assert index.add_worker("c") == 0
  assert index.overlap([7]).tolist() == [0, 1]  # c starts empty; b still holds 7
  with pytest.raises(KeyError, match="unknown worker 'a'"):
    index.slot("a")


def _router(**kw) -> KVRouter:
  r = KVRouter(RouterConfig(block_size=PS, **kw))
  for name in ("a", "b", "c"):
    r.add_worker(name)
  return r


def test_cost_trades_cached_prefix_against_load():
  r = _router()
  r.index.apply("b", 1, [KVEvent("stored", h) for h in (1, 2, 3)])
  assert r.select([1, 2, 3, 4]).worker == "b"  # b only prefills 1 block, the others 4
  r.started("b", blocks=5)  # b is busy: 1 + 5 > 4 + 0
  choice = r.select([1, 2, 3, 4])
  assert choice.worker in ("a", "c") and choice.overlap_blocks == 0
  np.testing.assert_array_equal(r.costs([1, 2, 3, 4])[0], [4, 6, 4])
  r.finished("b", blocks=5)
  r.set_alive("b", False)
  assert r.select([1, 2, 3, 4]).worker != "b"
  weighted = _router(overlap_weight=2.0, request_weight=10.0)
  weighted.index.apply("a", 1, [KVEvent("stored", 1)])
  weighted.started("a", blocks=0)
  np.testing.assert_array_equal(weighted.costs([1, 2])[0], [2 * 1 + 10, 4, 4])


def test_ties_spread_and_temperature_samples_by_cost():
  r = _router()
  picks = {r.select([9]).worker for _ in range(60)}
  assert picks == {"a", "b", "c"}  # an idle cluster: cold requests do not pile onto slot 0
  hot = _router(temperature=0.5)
  hot.index.apply("a", 1, [KVEvent("stored", h) for h in range(10)])
  counts = {"a": 0, "b": 0, "c": 0}
  for _ in range(400):
    counts[hot.select(list(range(10))).worker] += 1
  # costs 0, 10, 10 -> logits 0, -2, -2: P(a) = 1 / (1 + 2 e^-2) = 0.787
  assert 0.70 < counts["a"] / 400 < 0.87
  with pytest.raises(LookupError, match="no live worker"):
    r.select([9], exclude=["a", "b", "c"])
  r.index.apply("a", 1, [KVEvent("stored", 9)])
  assert r.select([9, 10]).worker == "a"
  excluded = r.select([9, 10], exclude=["a", "nobody"])  # a refused this request: the next best
  assert excluded.worker in ("b", "c") and r.costs([9, 10], exclude=["a"])[0][0] == np.inf
  with pytest.raises(LookupError, match="no live worker"):
    dead = KVRouter()
    dead.add_worker("x")
    dead.set_alive("x", False)
    dead.select([1])


class _LRUWorker:
  """A prefix cache of block hashes that evicts least recently used blocks and touches a
  chain tail first (as KVManager frees a request's blocks), so parents outlive children."""

  def __init__(self, capacity: int):
    self.capacity, self.cache, self.seq = capacity, {}, 0

  def store(self, chain: list[int]) -> list[KVEvent]:
    events = []
    for h in reversed(chain):
      if h in self.cache:
        self.cache[h] = self.cache.pop(h)  # most recent last
      else:
        self.cache[h] = None
        events.append(KVEvent("stored", h))
    while len(self.cache) > self.capacity:
      old = next(iter(self.cache))
      del self.cache[old]
      events.append(KVEvent("removed", old))
    return events


def _leading(chain: list[int], held: set[int]) -> int:
  n = 0
  while n < len(chain) and chain[n] in held:
    n += 1
  return n


def _reference_select(cost: np.ndarray, rng: np.random.Generator) -> int:
  """The straightforward choice: argmin over every slot's cost, ties drawn uniformly in slot order."""
  ties = np.flatnonzero(cost == cost.min())
  return int(ties[rng.integers(len(ties))]) if len(ties) > 1 else int(ties[0])


@pytest.mark.parametrize("request_weight", [0.5, 0.0])
def test_bisected_overlap_and_choice_equal_a_per_worker_walk_on_a_random_multi_turn_trace(request_weight):
  """70 LRU workers (masks past 64 bits) serve multi-turn conversations over shared system
  prompts, their events reaching the index in late batches. For every request the index's
  runs and overlap, and the router's costs and choice, equal those computed by walking each
  worker's held set block by block (what its own prefix lookup does); the choice is the
  one an argmin over that [W] cost makes, ties drawn by the same generator (request_weight
  0 makes ties common: equal block loads), some workers excluded or dead on the way."""
  rng = np.random.default_rng(5)
  W = 70
  workers = [_LRUWorker(int(rng.integers(20, 200))) for _ in range(W)]
  router = KVRouter(RouterConfig(block_size=PS, request_weight=request_weight), seed=3)
  ref_rng = np.random.default_rng(3)
  for w in range(W):
    router.add_worker(f"w{w}")
  systems = [hash_blocks([int(t) for t in rng.integers(0, 1000, int(rng.integers(4, 40)) * PS)], PS)
             for _ in range(5)]
  convs = [list(systems[int(rng.integers(0, 5))]) for _ in range(40)]
  pending: list[tuple[int, int, list[KVEvent]]] = []  # (worker, seq, events) not yet seen by the index
  multi_run = ties = 0
  dead = [4, 41]
  for d in dead:
    router.set_alive(f"w{d}", False)
  for step in range(1500):
    c = int(rng.integers(0, len(convs)))
    turn = [int(t) for t in rng.integers(0, 1000, int(rng.integers(1, 8)) * PS)]
    chain = convs[c] = convs[c] + hash_blocks(turn, PS, parent=convs[c][-1])
    lookup = chain[:len(chain) - int(rng.integers(0, 3))]
    held = [router.index.holds(f"w{w}") for w in range(W)]
    want = np.array([_leading(lookup, h) for h in held])
    runs = router.index.runs(lookup)
    assert sum(b for b, _ in runs) == want.max()
    multi_run += len(runs) > 1
    np.testing.assert_array_equal(router.index.overlap(lookup), want)
    exclude = [f"w{int(e)}" for e in rng.integers(0, W, 3)] if step % 7 == 0 else []
    cost, _ = router.costs(lookup, exclude=exclude)
    want_cost = router.active_blocks + request_weight * router.active_requests + len(lookup) - want
    want_cost[[router.index.slot(e) for e in exclude]] = np.inf
    want_cost[dead] = np.inf
    np.testing.assert_allclose(cost, want_cost)
    choice = router.select(lookup, exclude=exclude)
    assert choice.slot == _reference_select(want_cost, ref_rng) and choice.overlap_blocks == want[choice.slot]
    ties += np.count_nonzero(want_cost == want_cost.min()) > 1
    router.started(choice.worker, blocks=len(lookup))
    if step % 3 == 0:
      router.finished(choice.worker, blocks=len(lookup))
    wk = workers[choice.slot]
    wk.seq += 1
    pending.append((choice.slot, wk.seq, wk.store(chain)))
    # A random prefix of the pending batches arrives (each worker's in order).
    arrived = int(rng.integers(0, len(pending) + 1))
    for w, seq, events in pending[:arrived]:
      router.index.apply(f"w{w}", seq, events)
    del pending[:arrived]
    if rng.random() < 0.2:  # a conversation ends, another starts
      convs[c] = list(systems[int(rng.integers(0, 5))])
  assert multi_run > 100  # the trace exercised held prefixes with several holder sets
  assert ties > 20  # and choices among tied slots
