"""KV-aware routing: which worker should run a request, given what each has cached.

Each worker publishes the blocks that enter and leave its prefix cache
(`KVEvent`s, numbered per worker). `KVIndex` folds them into one table,
block hash -> the set of workers holding it (a bitmask over worker slots),
so the cached prefix of a request on every worker at once is found by
bisecting the request's chain of block hashes for where its holder set
changes (`KVIndex.runs`): a few dict probes per request, not one per block.

`KVRouter` scores each live worker with Dynamo's cost

    cost(w) = overlap_weight * prefill_blocks_not_cached(w) + decode_blocks(w)
              + request_weight * active_requests(w)

(decode_blocks: the KV blocks of the requests it is running) and picks the
argmin at temperature 0, or samples softmax(-cost / (temperature * spread))
otherwise, spread being the max - min cost, so the temperature does not
depend on the request's size.

At temperature 0 no [W] cost is built: the held runs split the slots into
levels of equal overlap (the holders of run j but not of run j + 1, and the
slots holding nothing), a level's cheapest slots are its least loaded ones,
and those are found from a list of the slots kept sorted by load (or, for a
level of a few slots, by visiting its bits). See `KVRouter.select`.

    router = KVRouter(RouterConfig(block_size=16))
    router.add_worker("w0"); router.add_worker("w1")
    router.index.apply("w0", seq=1, events=[...])          # from the worker's event stream
    choice = router.select(hash_blocks(prompt_ids, 16))   # .worker, .slot, .overlap_blocks
    router.started(choice.worker, blocks=len(prompt_ids) // 16 + 1)
    ...
    router.finished(choice.worker, blocks=...)

Legend: W worker slots, N blocks of the request.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from jaxinfer.engine.kv_manager import KVEvent


class SequenceGap(Exception):
  """A worker's event stream skipped numbers: the index must resync from a snapshot."""


class KVIndex:
  """block hash -> bitmask of the worker slots whose prefix cache holds it."""

  def __init__(self):
    self._holders: dict[int, int] = {}
    self._slots: dict[str, int] = {}
    self._names: list[str | None] = []
    self._held: list[set[int]] = []  # per slot: its hashes (to drop a dead worker's entries)
    self._seq: list[int] = []

  # ---- workers ----------------------------------------------------------------------

  @property
  def num_slots(self) -> int:
    return len(self._names)

  def slot(self, worker: str) -> int:
    try:
      return self._slots[worker]
    except KeyError:
      raise KeyError(f"unknown worker {worker!r}") from None

  def slot_or_none(self, worker: str) -> int | None:
    return self._slots.get(worker)

  def name(self, slot: int) -> str:
    return self._names[slot]

  def add_worker(self, worker: str) -> int:
    """A slot for `worker` (a freed slot is reused, so W stays the live count)."""
    if worker in self._slots:
      raise ValueError(f"worker {worker!r} is already indexed")
    try:
      slot = self._names.index(None)
    except ValueError:
      slot = len(self._names)
      self._names.append(None)
      self._held.append(set())
      self._seq.append(0)
    self._names[slot] = worker
    self._slots[worker] = slot
    self._seq[slot] = 0
    return slot

  def remove_worker(self, worker: str) -> None:
    slot = self._slots.pop(worker)
    self._forget(slot)
    self._names[slot] = None

  def _forget(self, slot: int) -> None:
    clear = ~(1 << slot)
    for h in self._held[slot]:
      mask = self._holders[h] & clear
      if mask:
        self._holders[h] = mask
      else:
        del self._holders[h]
    self._held[slot] = set()

  # ---- events -----------------------------------------------------------------------

  def apply(self, worker: str, seq: int, events: Iterable[KVEvent]) -> None:
    """Folds in the worker's batch number `seq` (1, 2, ...). Raises SequenceGap if a
    batch was missed; then nothing is applied and `load_snapshot` must follow."""
    slot = self.slot(worker)
    if seq != self._seq[slot] + 1:
      raise SequenceGap(f"worker {worker!r}: expected event batch {self._seq[slot] + 1}, got {seq}")
    bit = 1 << slot
    held = self._held[slot]
    holders = self._holders
    for e in events:
      if e.kind == "stored":
        holders[e.block_hash] = holders.get(e.block_hash, 0) | bit
        held.add(e.block_hash)
      elif e.kind == "removed":
        if e.block_hash in held:
          held.discard(e.block_hash)
          mask = holders[e.block_hash] & ~bit
          if mask:
            holders[e.block_hash] = mask
          else:
            del holders[e.block_hash]
      else:
        raise ValueError(f"worker {worker!r}: unknown KV event kind {e.kind!r}")
    self._seq[slot] = seq

  def load_snapshot(self, worker: str, seq: int, block_hashes: Iterable[int]) -> None:
    """Replaces what the index knows of `worker` by its full cache as of batch `seq`."""
    slot = self.slot(worker)
    self._forget(slot)
    bit = 1 << slot
    held = self._held[slot]
    for h in block_hashes:
      self._holders[h] = self._holders.get(h, 0) | bit
      held.add(h)
    self._seq[slot] = seq

  def holds(self, worker: str) -> set[int]:
    return set(self._held[self.slot(worker)])

  # ---- queries ----------------------------------------------------------------------

  def runs(self, block_hashes: Sequence[int]) -> list[tuple[int, int]]:
    """[(blocks, holder mask)]: the request's leading held blocks as runs of equal
    holders, in chain order, masks nonzero and shrinking (each within the previous).

    Workers lose a chain from its end (KVManager frees a request's tail
    blocks first, so they are evicted before the prefix they hang off; the
    index sees each worker's events in order), so the holder set can only
    shrink along the chain, and equal holders at both ends of a stretch mean
    equal holders all along it. So each run's end is a binary search (the
    blocks holding exactly the run's set come first, then none does again):
    O(runs x log N) probes instead of N, in a loop of plain ints (a stack of
    stretches cost 15% more at 512 workers). At 512 workers the index holds
    up to ~2M hashes and a probe is mostly cache misses (~0.5 us on a random
    key), so probing every block was the decision's main cost: ~40 us p50
    for a prompt of ~85 blocks (map + Counter over them), against ~1.5 runs
    per request in `jaxinfer bench router-sim`'s trace.

    A worker that held a block without its parent (KVManager, and an LRU
    cache that touches a chain tail first, never do) could be counted or
    missed by the bisection: the overlap is a prediction, and the worker's
    own lookup decides what it reuses.
    """
    n = len(block_hashes)
    if n == 0:
      return []
    get = self._holders.get
    mask = get(block_hashes[0], 0)
    if not mask:
      return []  # nobody holds block 0, so nobody holds anything after it
    last = get(block_hashes[n - 1], 0) if n > 1 else mask
    out = []
    at = 0  # the run starting here has holders `mask`
    while True:
      if mask == last:  # it reaches the end of the chain
        out.append((n - at, mask))
        return out
      # The run's last block: a plain binary search for the last block holding exactly
      # `mask` (true up to it, false after: the set only shrinks, never comes back).
      lo, hi = at, n - 1  # mask(lo) == mask, mask(hi) != mask
      while hi - lo > 1:
        mid = (lo + hi) >> 1
        if get(block_hashes[mid], 0) == mask:
          lo = mid
        else:
          hi = mid
      out.append((hi - at, mask))
      at = hi
      mask = get(block_hashes[hi], 0)
      if not mask:
        return out  # nobody holds block hi, nor (a chain) anything after it

  def overlap(self, block_hashes: Sequence[int]) -> np.ndarray:
    """[W] int32: how many leading blocks of the request each worker slot holds."""
    return _weighted_bits(self.runs(block_hashes), self.num_slots)


def _holder_rows(runs: list[tuple[int, int]], W: int) -> np.ndarray:
  """[len(runs), W] bool: which slots hold each run."""
  nbytes = (W + 7) // 8
  raw = np.frombuffer(b"".join(m.to_bytes(nbytes, "little") for _, m in runs), np.uint8)
  return np.unpackbits(raw.reshape(len(runs), nbytes), axis=1, count=W, bitorder="little").view(bool)


def _weighted_bits(runs: list[tuple[int, int]], W: int) -> np.ndarray:
  """[W] int32: sum over runs of blocks * (slot in mask)."""
  if not runs:
    return np.zeros(W, np.int32)
  return np.fromiter((b for b, _ in runs), np.int32, len(runs)) @ _holder_rows(runs, W).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class RouterConfig:
  """Cost weights (see the module docstring) and the page size the workers hash with."""

  block_size: int = 16
  overlap_weight: float = 1.0
  request_weight: float = 0.0
  temperature: float = 0.0

  def __post_init__(self):
    if self.block_size < 1:
      raise ValueError(f"block_size must be >= 1, got {self.block_size}")
    for name in ("overlap_weight", "request_weight", "temperature"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")


_ROW_CACHE = 4096  # holder rows cached per router (4096 x 512 slots x 8 bytes = 16 MiB at most)
# A level of at most this many slots is searched by visiting its bits; a larger one by walking
# the slots in load order until one of its members (expected W / size steps).
_VISIT_BITS = 24
_INF = float("inf")
_NO_SLOTS = frozenset()


class Choice(NamedTuple):  # a NamedTuple: built once per request, on the hot path
  worker: str
  slot: int
  overlap_blocks: int  # leading blocks the chosen worker holds (the predicted hit)


class KVRouter:
  """Picks a worker per request from the index and each worker's load."""

  def __init__(self, config: RouterConfig = RouterConfig(), seed: int = 0):
    self.config = config
    self.index = KVIndex()
    self._dead = np.zeros(0, np.float64)  # 0 for a live slot, inf otherwise (added to its cost)
    self.active_blocks = np.zeros(0, np.float64)
    self.active_requests = np.zeros(0, np.float64)
    # [W] the part of the cost that does not depend on the request: active_blocks + dead +
    # request_weight * active_requests, kept in step slot by slot (one numpy call less per request).
    self._load = np.zeros(0, np.float64)
    # The same load as Python floats, and (load, slot) for every slot sorted: select at
    # temperature 0 reads these instead of building a [W] cost (numpy calls on a cache the
    # rest of the router has evicted cost ~5 us each; a level's minimum is a few steps here).
    self._loads: list[float] = []
    self._by_load: list[tuple[float, int]] = []
    self._names = self.index._names  # slot -> worker (shared, not copied: the index renames slots)
    self._bits: list[int] = []  # slot -> 1 << slot (one big-int op per membership test, not two)
    # holder mask -> [W] negated 0/1 float64 row: the holder sets of hot prefixes (a system prompt's,
    # a conversation's worker) repeat across requests, and unpacking one costs more than its use.
    self._rows: dict[int, np.ndarray] = {}
    self._rows_width = 0
    self._rng = np.random.default_rng(seed)

  def add_worker(self, worker: str) -> None:
    slot = self.index.add_worker(worker)
    if slot == len(self._dead):
      self._dead = np.append(self._dead, 0.0)
      self.active_blocks = np.append(self.active_blocks, 0.0)
      self.active_requests = np.append(self.active_requests, 0.0)
      self._load = np.append(self._load, 0.0)
      self._loads.append(0.0)
      bisect.insort(self._by_load, (0.0, slot))
      self._bits.append(1 << slot)
    self.active_blocks[slot] = self.active_requests[slot] = 0.0
    self._set_live(slot, True)

  def _set_live(self, slot: int, alive: bool) -> None:
    self._dead[slot] = 0.0 if alive else np.inf
    self._update_load(slot)

  def _update_load(self, s: int) -> None:
    new = float(self.active_blocks[s] + self._dead[s] + self.config.request_weight * self.active_requests[s])
    old = self._loads[s]
    self._load[s] = self._loads[s] = new
    by_load = self._by_load
    del by_load[bisect.bisect_left(by_load, (old, s))]
    bisect.insort(by_load, (new, s))

  def remove_worker(self, worker: str) -> None:
    """A dead or drained worker: forgotten by the index, never chosen."""
    slot = self.index.slot(worker)
    self.index.remove_worker(worker)
    self._set_live(slot, False)

  def set_alive(self, worker: str, alive: bool) -> None:
    """Health checks: an unhealthy worker keeps its index entries but gets no requests."""
    self._set_live(self.index.slot(worker), alive)

  @property
  def workers(self) -> list[str]:
    """The live workers (derived from the slots' cost penalty: 0 when live)."""
    return [self.index.name(s) for s in np.flatnonzero(self._dead == 0)]

  def _cost(self, block_hashes: Sequence[int], num_blocks: int | None,
            exclude: Iterable[str]) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """([W] cost, the request's held runs). The runs' blocks come off their holders' cost
    through cached negated 0/1 rows, one multiply per run and two adds: no [W] overlap
    array, no unpacking of a holder set already seen, no masked ufunc (4x slower than a
    plain one). Each numpy call here costs more than its 512 additions, so they are few."""
    w = self.config.overlap_weight
    runs = self.index.runs(block_hashes)
    n = len(block_hashes) if num_blocks is None else num_blocks
    if runs and w:
      rows = self._negated_rows(runs)
      cost = rows[0] * (w * runs[0][0])  # -w * blocks where held, a fresh array
      for (blocks, _), row in zip(runs[1:], rows[1:]):
        cost += row * (w * blocks)
      cost += self._load  # +inf for dead slots
      cost += w * n
    else:
      cost = self._load + w * n
    for worker in exclude:
      slot = self.index.slot_or_none(worker)
      if slot is not None:
        cost[slot] = np.inf
    return cost, runs

  def _negated_rows(self, runs: list[tuple[int, int]]) -> list[np.ndarray]:
    """Per run, [W] float64: -1.0 where the slot holds it, else -0.0 (cached by holder mask)."""
    W = len(self._load)
    cache = self._rows
    if self._rows_width != W:  # a slot was added: every cached row is too short
      cache.clear()
      self._rows_width = W
    out = []
    for _, mask in runs:
      row = cache.get(mask)
      if row is None:
        if len(cache) >= _ROW_CACHE:
          cache.clear()
        row = cache[mask] = -_holder_rows([(0, mask)], W)[0].astype(np.float64)
      out.append(row)
    return out

  def costs(self, block_hashes: Sequence[int], num_blocks: int | None = None,
            exclude: Iterable[str] = ()) -> tuple[np.ndarray, np.ndarray]:
    """([W] cost, [W] overlap) for a request whose prompt has these full-block
    hashes (`num_blocks`: its block count including a partial last one); the
    workers in `exclude` (e.g. ones that refused this request) cost inf."""
    cost, runs = self._cost(block_hashes, num_blocks, exclude)
    return cost, _weighted_bits(runs, len(cost))

  def select(self, block_hashes: Sequence[int], num_blocks: int | None = None,
             exclude: Iterable[str] = ()) -> Choice:
    """The cheapest live worker not in `exclude` (LookupError if there is none).

    At temperature 0: slot s in level j (holding runs 0..j of the request, not
    run j + 1) costs (x_j + load[s]) + w * n, x_j = -w * (blocks of runs 0..j)
    summed in run order, and a slot holding nothing load[s] + w * n: the same
    float operations, in the same order, as `costs` (so the same ties), done
    only for the few slots that can be a level's cheapest. Ties go to a random
    one of them, drawn as from `costs`'s tied slots in slot order."""
    if self.config.temperature:
      return self._sample(block_hashes, num_blocks, exclude)
    w = self.config.overlap_weight
    runs = self.index.runs(block_hashes)
    wn = w * (len(block_hashes) if num_blocks is None else num_blocks)
    excluded = _NO_SLOTS
    if exclude:
      excluded = {s for s in map(self.index.slot_or_none, exclude) if s is not None}
    everyone = (1 << len(self._loads)) - 1
    overlap = 0  # of the cheapest level so far
    if runs and w:
      best, ties = self._cheapest(everyone & ~runs[0][1], 0.0, wn, excluded)
      x, held, last = 0.0, 0, len(runs) - 1
      for j, (blocks, mask) in enumerate(runs):
        x = -(w * blocks) if j == 0 else x + -(w * blocks)
        held += blocks
        c, slots = self._cheapest(mask & ~runs[j + 1][1] if j < last else mask, x, wn, excluded)
        if c < best:
          best, ties, overlap = c, slots, held
        elif c == best and slots:
          ties = ties + slots
          overlap = -1  # tied across levels: looked up for the slot drawn
    else:
      best, ties = self._cheapest(everyone, 0.0, wn, excluded)
    if best == _INF:
      raise LookupError("no live worker to route to")
    # Ties (e.g. an idle cluster and a new prefix) go to a random one of
    # them: always the first would pile every cold request on one worker.
    if len(ties) > 1:
      ties.sort()
      slot = ties[int(self._rng.integers(len(ties)))]
    else:
      slot = ties[0]
    if overlap < 0:
      overlap = sum(blocks for blocks, holders in runs if holders >> slot & 1)
    return Choice(self._names[slot], slot, overlap)

  def _cheapest(self, members: int, x: float, wn: float,
                excluded: Iterable[int]) -> tuple[float, list[int]]:
    """(cost, slots): the cheapest of the slots in bitmask `members` and every slot tied
    with it, slot s costing (x + load[s]) + wn (inf and [] if none is live)."""
    best, slots = _INF, []
    if members.bit_count() <= _VISIT_BITS:
      loads = self._loads
      while members:
        low = members & -members
        members ^= low
        s = low.bit_length() - 1
        if s in excluded:
          continue
        c = (x + loads[s]) + wn
        if c < best:
          best, slots = c, [s]
        elif c == best and c != _INF:
          slots.append(s)
      return best, slots
    # Cost is non-decreasing in load, so the members tied for the cheapest are
    # the first ones met in load order: stop at the first dearer one.
    bit = self._bits
    for load, s in self._by_load:
      if load == _INF:
        break  # dead slots sort last
      if not members & bit[s] or s in excluded:
        continue
      c = (x + load) + wn
      if c < best:
        best, slots = c, [s]
      elif c == best:
        slots.append(s)
      else:
        break
    return best, slots

  def _sample(self, block_hashes: Sequence[int], num_blocks: int | None,
              exclude: Iterable[str]) -> Choice:
    """Temperature > 0: a slot drawn from softmax(-cost / (temperature * spread))."""
    cost, runs = self._cost(block_hashes, num_blocks, exclude)
    live = np.isfinite(cost)
    if not live.any():
      raise LookupError("no live worker to route to")
    spread = max(float(cost[live].max() - cost[live].min()), 1e-9)
    logits = np.where(live, -(cost - cost[live].min()) / (spread * self.config.temperature), -np.inf)
    p = np.exp(logits - logits.max())
    slot = int(self._rng.choice(len(p), p=p / p.sum()))
    overlap = sum(blocks for blocks, holders in runs if holders >> slot & 1)
    return Choice(self.index.name(slot), slot, overlap)

  def started(self, worker: str, blocks: float) -> None:
    s = self.index.slot(worker)
    self.active_blocks[s] += blocks
    self.active_requests[s] += 1
    self._update_load(s)

  def finished(self, worker: str, blocks: float) -> None:
    s = self.index.slot(worker)
    self.active_blocks[s] = max(0.0, self.active_blocks[s] - blocks)
    self.active_requests[s] = max(0.0, self.active_requests[s] - 1)
    self._update_load(s)
