"""Which requests run in the next step, and how many new tokens each gets.

There is no prefill phase and no decode phase: each running request's
computed tokens catch up with its known tokens (prompt + output so far).
A request with many tokens to compute gets a chunk of the per-step token
budget; one that is caught up gets 1 (its newest sampled token), plus its
speculative drafts when it has some (lookahead slots: pages are allocated
for them; the engine takes back the rejected ones by not counting them as
computed). All kinds share one ragged step.

Passes, in order, each small:
  1. running requests, oldest first: grow their pages for this step's
     tokens; when the pool is dry, preempt the newest running request
     (its pages go back; it is recomputed later, prefix cache permitting);
  2. waiting requests, FCFS, while sequences, budget and pages allow
     (skipped in a step that preempted: the pool is tight);
  3. under attention DP, the hold: prefill planned on a data rank above what
     the others run is held back to a later step (`_hold_back`).

Attention data parallelism (a KVManager with num_shards > 1, one shard per
data rank): a new request goes to the rank whose predicted load is lowest
once it is there (`rank_by_load`: `shard_loads` plus the request's own
tokens to compute on that rank, its prefix hit there subtracted); its pages
all come from there, and when that rank's pages run dry the newest request
*on that rank* is preempted (freeing another rank's pages would not help).
The step's token budget is split over the ranks (`split_budget`): the ranks
run in lockstep, each padded to the busiest one's tokens, so a rank's long
prefill must not take the whole budget and leave the others idle. Nor its
share, when the others have less to run: pass 3 cuts each rank's prefill to
the level the least busy rank runs (or the busiest rank's decode rows, which
are never held), for at most `DPBalanceConfig.timeout` steps per request.

Disaggregation (engine/kv_connector.py): when a connector says a new
request's prompt KV comes from another worker, pass 2 allocates its pages
and parks it in `waiting_for_kv` (it holds a sequence slot and its pages,
costs no budget, is never preempted) until `kv_arrived`. A request added
with `hold_kv` (the producer side) keeps its pages past `finish`, in `held`,
until `release_held`.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Any, Mapping, Sequence

import numpy as np

from jaxinfer.config import from_options
from jaxinfer.engine.kv_connector import KVConnector
from jaxinfer.engine.kv_manager import KVManager
from jaxinfer.errors import InvalidRequestError
from jaxinfer.sampling import SamplingParams


class Status(enum.Enum):
  WAITING = "waiting"
  WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # pages allocated; their KV is being imported
  RUNNING = "running"
  FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
  """A request's host-side state. token_ids = prompt + output so far."""

  request_id: str
  prompt_token_ids: list[int]
  params: SamplingParams
  seed: int
  prompt: str | None = None
  token_ids: list[int] = dataclasses.field(default_factory=list)
  num_computed: int = 0  # tokens whose KV is in the cache
  num_cached_tokens: int = 0  # of those, taken from the prefix cache at admission
  num_preemptions: int = 0
  status: Status = Status.WAITING
  row: int | None = None  # sampler-history row while running
  needs_history: bool = False  # the row must be (re)loaded before the next step
  spec_token_ids: list[int] = dataclasses.field(default_factory=list)  # drafts for the next step
  num_inflight: int = 0  # async scheduling: tokens sampled by dispatched steps, not yet in token_ids
  # Async scheduling: drafts verified by dispatched steps; as many more tokens may already be
  # computed (the device knows how many), so the next step's pages allow for them.
  num_inflight_drafts: int = 0
  finish_reason: str | None = None
  num_held_steps: int = 0  # attention-DP balance: steps whose chunk of its prefill was held back
  num_remote_tokens: int = 0  # prompt tokens whose KV another worker computed (disaggregation)
  num_remote_cached_tokens: int = 0  # of the prompt, what that worker took from its own prefix cache
  hold_kv: bool = False  # producer side: pages outlive the request until released
  kv_source: str | None = None  # consumer side: the worker its prompt KV must come from (a router's pick)
  output: Any = None  # the engine's per-request output state

  def __post_init__(self):
    self.token_ids = list(self.prompt_token_ids)

  @property
  def num_prompt_tokens(self) -> int:
    return len(self.prompt_token_ids)

  @property
  def output_token_ids(self) -> list[int]:
    return self.token_ids[self.num_prompt_tokens:]

  @property
  def num_output_tokens(self) -> int:
    return len(self.token_ids) - len(self.prompt_token_ids)

  @property
  def num_uncomputed(self) -> int:
    return len(self.token_ids) + self.num_inflight - self.num_computed

  @property
  def last_token_inflight(self) -> bool:
    """Its next step can only finish the request (max_tokens is reached by the tokens in
    flight); if one of them is a stop token instead, the postprocess ends it anyway."""
    return bool(self.num_inflight) and self.num_output_tokens + self.num_inflight >= self.params.max_tokens


def split_budget(total: int, num_ranks: int) -> list[int]:
  """Per-rank token budgets of a step: `total` split as evenly as integers go (the
  first `total % num_ranks` ranks get one more), so no rank's tokens exceed the mean
  by more than one."""
  if num_ranks < 1 or total < num_ranks:
    raise ValueError(f"a step budget of {total} tokens (max_num_batched_tokens) cannot give each of "
                     f"{num_ranks} data ranks one")
  return [total // num_ranks + (r < total % num_ranks) for r in range(num_ranks)]


def imbalance(tokens: Sequence[int]) -> float:
  """max / mean of per-rank tokens (1.0: even), 0.0 when there are none."""
  total = sum(tokens)
  return max(tokens) * len(tokens) / total if total else 0.0


def rank_by_load(loads: Sequence[int], new_tokens: Sequence[int]) -> list[int]:
  """Data ranks for a new request, best first: the lowest predicted load once it is
  there (loads[r], the rank's running and still-to-prefill tokens, plus new_tokens[r],
  the request's tokens to compute on r: fewer where its prefix is cached), then the
  lowest index."""
  if len(loads) != len(new_tokens):
    raise ValueError(f"{len(loads)} rank loads but {len(new_tokens)} per-rank token counts")
  return sorted(range(len(loads)), key=lambda r: (loads[r] + new_tokens[r], r))


@dataclasses.dataclass(frozen=True)
class DPBalanceConfig:
  """Attention-DP balance (`Scheduler._hold_back`): a data rank's prefill is held back to the
  level the other ranks run in the step, for at most `timeout` steps per request.

  `hold_prefill` turns it on. It is on by default: on `jaxinfer bench adp-sim`'s trace it
  takes the per-step max / mean tokens to about 1.0 at every load and cuts the lockstep
  ranks' padded work, for about one step more time to first token (the figures:
  benchmarks/results/adp-sim-*.json, docs/ARCHITECTURE.md); a lone prompt beside ranks that
  only decode, nothing arriving, waits the whole timeout for nothing. `timeout`: the steps in
  which one request's prefill may be held back, in all; past them it is never held again
  (nothing starves). A longer wait buys little more balance on that trace, and each held
  step is a step later."""

  hold_prefill: bool = True
  timeout: int = 4

  def __post_init__(self):
    if not isinstance(self.hold_prefill, bool):
      raise InvalidRequestError(f"dp_balance.hold_prefill must be a bool, got {self.hold_prefill!r}")
    if isinstance(self.timeout, bool) or not isinstance(self.timeout, int) or self.timeout < 0:
      raise InvalidRequestError(f"dp_balance.timeout must be an int >= 0 (steps), got {self.timeout!r}")

  @classmethod
  def parse(cls, value: "DPBalanceConfig | dict | None") -> "DPBalanceConfig":
    """None (the defaults), a DPBalanceConfig, or a dict of its fields (LLM(dp_balance=...))."""
    if value is None:
      return cls()
    if isinstance(value, DPBalanceConfig):
      return value
    if not isinstance(value, Mapping):
      raise InvalidRequestError(f"dp_balance must be a dict or DPBalanceConfig, got {type(value).__name__}")
    return from_options(cls, value, "dp_balance")


@dataclasses.dataclass
class StepBudget:
  """The tokens a step may still schedule, per data rank (one entry without attention DP)."""

  left: list[int]

  def of(self, rank: int) -> int:
    return self.left[rank]

  def take(self, rank: int, n: int) -> None:
    self.left[rank] -= n

  def __bool__(self) -> bool:
    return any(n > 0 for n in self.left)


@dataclasses.dataclass
class SchedulerOutput:
  """A step's plan. `schedule` has already counted its committed tokens as computed (their KV
  is written by the step); `update_from_output` settles the rest once the step's ids are back."""

  scheduled: list[tuple[Request, int]]  # (request, new tokens this step, drafts included), in batch order
  preempted: list[Request]
  starts: list[int] = dataclasses.field(default_factory=list)  # each request's num_computed before the step
  drafts: list[list[int]] = dataclasses.field(default_factory=list)  # the drafts each verifies
  # Each request's step ends at its known tokens, so it samples (else: a prefill chunk).
  samples: list[bool] = dataclasses.field(default_factory=list)
  # Each request's sampler row and that row's tenancy (`Scheduler.row_gen`) when scheduled.
  rows: Any = None  # [S] int
  row_gens: Any = None  # [S] int

  @property
  def num_tokens(self) -> int:
    return sum(n for _, n in self.scheduled)


class Scheduler:
  """FCFS continuous batching under a sequence limit and a token budget."""

  def __init__(self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int,
               connector: KVConnector | None = None, max_model_len: int | None = None,
               dp_balance: DPBalanceConfig | None = None):
    self.kv = kv
    self.dp_balance = DPBalanceConfig.parse(dp_balance)
    self.max_model_len = max_model_len  # no sequence's pages go past it
    self.connector = connector
    self.max_num_seqs = max_num_seqs
    self.max_num_batched_tokens = max_num_batched_tokens
    split_budget(max_num_batched_tokens, kv.num_shards)  # each data rank needs a token a step
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []
    self.waiting_for_kv: dict[str, Request] = {}
    self.held: dict[str, Request] = {}  # finished, pages kept for a transfer (hold_kv)
    self._free_rows = list(range(max_num_seqs - 1, -1, -1))
    # Each sampler row's tenancy, bumped whenever the row is taken or freed: a host array keyed
    # by row (the output processor's, `RowControls`) tells from it, for a whole step at once,
    # which rows still hold the request the step ran for.
    self.row_gen = np.zeros(max_num_seqs, np.int64)
    self.num_preemptions = 0
    self.rank_tokens = [0] * kv.num_shards  # tokens the last step scheduled on each data rank

  def add(self, req: Request) -> None:
    self.waiting.append(req)

  def has_unfinished(self) -> bool:
    return bool(self.waiting or self.running or self.waiting_for_kv)

  @property
  def num_seqs(self) -> int:
    """Sequences holding a sampler row: running ones and those waiting for their KV."""
    return len(self.running) + len(self.waiting_for_kv)

  # ---- one step -------------------------------------------------------------------

  def schedule(self) -> SchedulerOutput:
    """The next step: who runs, how many tokens each, and who was preempted for it. Its
    committed tokens count as computed from here on; its samples as in flight."""
    out = SchedulerOutput([], [])
    budget = self.step_budget()
    self._schedule_running(out, budget)
    if not out.preempted:
      self._schedule_waiting(out, budget)
    sharded = self.kv.num_shards > 1
    if sharded and self.dp_balance.hold_prefill:
      self._hold_back(out)
    self.rank_tokens = [0] * self.kv.num_shards
    starts, all_drafts, all_samples, rows = out.starts, out.drafts, out.samples, []
    for req, n in out.scheduled:
      rows.append(req.row)
      if sharded:
        self.rank_tokens[self.kv.request_shard(req.request_id)] += n
      drafts = req.spec_token_ids
      committed = n - len(drafts)
      # A caught-up request's one token may be the one the step in flight samples (async).
      samples = req.num_computed + committed >= len(req.token_ids)
      starts.append(req.num_computed)
      all_drafts.append(drafts)
      all_samples.append(samples)
      req.num_computed += committed
      if samples:
        req.num_inflight += 1
      if drafts:
        req.num_inflight_drafts += len(drafts)
    if not sharded:
      self.rank_tokens[0] = out.num_tokens
    out.rows = np.array(rows, np.int64)
    out.row_gens = self.row_gen[out.rows]
    return out

  def update_from_output(self, out: SchedulerOutput, ids: Any = None, num_committed: Any = None) -> list[list[int]]:
    """Settles a step that `schedule` planned, once its sampled ids [S, k + 1] and each
    sequence's committed count [S] (arrays or lists) are on the host (None: the step failed). Its samples are
    no longer in flight; of a running request, the drafts the step accepted become computed
    and the blocks its known tokens complete are cached (rejected drafts' KV stays in the
    pages past num_computed: overwritten later, never cached). Returns each request's
    accepted drafts; the output processor commits them and the token after them."""
    accepted_all = []
    failed = num_committed is None
    cache_blocks, running = self.kv.cache_blocks, Status.RUNNING
    for i, (req, _) in enumerate(out.scheduled):
      if out.samples[i]:
        req.num_inflight -= 1
      drafts = out.drafts[i]
      if drafts:
        req.num_inflight_drafts -= len(drafts)
      c = 0 if failed else num_committed[i]
      accepted = [int(t) for t in ids[i][:c - 1]] if c > 1 else []
      accepted_all.append(accepted)
      if failed or req.status is not running:
        continue  # failed, ended or preempted meanwhile: nothing of it is computed
      known = req.token_ids
      if accepted:
        req.num_computed += len(accepted)
        known = known + accepted
      # Under async scheduling num_computed may count a token still in flight.
      cache_blocks(req.request_id, known, min(req.num_computed, len(known)))
    return accepted_all

  @property
  def rank_imbalance(self) -> float:
    """The last step's busiest data rank's scheduled tokens over the mean (1.0: even;
    0.0: nothing scheduled)."""
    return imbalance(self.rank_tokens)

  def step_budget(self) -> StepBudget:
    """max_num_batched_tokens, split over the data ranks (`split_budget`)."""
    return StepBudget(split_budget(self.max_num_batched_tokens, self.kv.num_shards))

  def shard_loads(self) -> list[int]:
    """Each data rank's predicted load: the tokens its sequences (running or waiting for
    their KV) have left to compute, i.e. one per decoding sequence plus every prompt's
    rest still to prefill (a remote prompt's KV is not computed here)."""
    loads = [0] * self.kv.num_shards
    for req in self.running:
      loads[self.kv.request_shard(req.request_id) or 0] += req.num_uncomputed
    for req in self.waiting_for_kv.values():
      loads[self.kv.request_shard(req.request_id) or 0] += max(1, req.num_uncomputed - req.num_remote_tokens)
    return loads

  def rank_shards(self, req: Request, use_cache: bool) -> list[int]:
    """Data ranks for a new request, best first (`rank_by_load`: its tokens to compute
    on a rank are its prompt less its prefix hit there)."""
    hits = self.kv.hit_pages_per_shard(req.token_ids) if use_cache else [0] * self.kv.num_shards
    new = [len(req.token_ids) - h * self.kv.page_size for h in hits]
    return rank_by_load(self.shard_loads(), new)

  def _place(self, req: Request, budget: StepBudget) -> tuple[int, list[int]]:
    """(shard, prefix-hit pages there) for a request about to be admitted: of the shards
    ranked by `rank_shards`, those with budget left in this step first (a rank whose share
    is spent would leave the request waiting while another computes nothing), the first
    whose pool can take its first chunk."""
    # Prompt logprobs need every prompt token computed, so such requests skip the cache.
    use_cache = req.params.prompt_logprobs is None
    if self.kv.num_shards == 1:
      return 0, self.kv.lookup(req.token_ids) if use_cache else []
    ranked = sorted(self.rank_shards(req, use_cache), key=lambda r: budget.of(r) <= 0)
    fits = ranked[0]
    for shard in ranked:
      cached = self.kv.lookup(req.token_ids, shard, record=False) if use_cache else []
      if self.kv.can_allocate(req.request_id, (len(cached) + 1) * self.kv.page_size, cached, shard):
        fits = shard
        break
    return fits, self.kv.lookup(req.token_ids, fits) if use_cache else []

  def _schedule_running(self, out: SchedulerOutput, budget: StepBudget) -> None:
    kv, max_len, left = self.kv, self.max_model_len, budget.left
    sharded = kv.num_shards > 1  # (else one rank: its budget read and spent in place)
    i = 0
    while i < len(self.running) and (left[0] > 0 if not sharded else budget):
      req = self.running[i]
      rank = (kv.request_shard(req.request_id) or 0) if sharded else 0
      b = budget.of(rank) if sharded else left[0]
      if b <= 0 or (req.num_inflight and req.last_token_inflight):
        i += 1
        continue
      u = req.num_uncomputed
      n = min(u, b)
      if req.spec_token_ids:
        # Drafts only follow a caught-up request's last token, as far as the budget goes.
        req.spec_token_ids = req.spec_token_ids[:b - n] if n == u == 1 else []
        n += len(req.spec_token_ids)
      # Tokens computed by the step in flight beyond num_computed (accepted drafts) push
      # this step's on; none goes past max_model_len (runner._feed sends those to no page).
      need = req.num_computed + n + req.num_inflight_drafts
      if max_len and need > max_len:
        need = max_len
      if not kv.holds(req.request_id, need):  # (most decode steps fit their pages)
        while not kv.can_allocate(req.request_id, need):
          shard = kv.request_shard(req.request_id)
          victim = next(r for r in reversed(self.running) if kv.request_shard(r.request_id) == shard)
          self._preempt(victim)
          out.preempted.append(victim)
          if victim is req:
            break
        if req.status is not Status.RUNNING:
          break  # preempted itself: nobody after it is running either
        kv.allocate(req.request_id, need)
      out.scheduled.append((req, n))
      if sharded:
        budget.take(rank, n)
      else:
        left[0] -= n
      i += 1

  def _schedule_waiting(self, out: SchedulerOutput, budget: StepBudget) -> None:
    while self.waiting and budget and self.num_seqs < self.max_num_seqs:
      req = self.waiting[0]
      if req.num_inflight:
        break  # preempted while a step of its ran: recomputed once that step's token is known
      shard, cached = self._place(req, budget)
      computed = len(cached) * self.kv.page_size
      # Only a fresh request's KV may come from elsewhere; once it has output (a remote
      # request after its import, then preempted) it is recomputed here like any other.
      remote = (self.connector.get_num_new_matched_tokens(req, computed)
                if self.connector is not None and not req.output_token_ids else 0)
      if remote:
        if not self._admit_remote(req, cached, computed, remote, shard):
          break
        continue
      if budget.of(shard) <= 0:
        break  # FCFS: it waits for its rank's next step (a later request must not overtake it)
      n = min(len(req.token_ids) - computed, budget.of(shard))
      if not self.kv.can_allocate(req.request_id, computed + n, cached, shard):
        break
      self.kv.allocate(req.request_id, computed + n, cached, shard)
      self.waiting.popleft()
      req.num_computed = req.num_cached_tokens = computed
      req.status = Status.RUNNING
      self._take_row(req)
      req.needs_history = req.params.uses_penalties
      self.running.append(req)
      out.scheduled.append((req, n))
      budget.take(shard, n)

  def _hold_back(self, out: SchedulerOutput) -> None:
    """Pass 3 under attention DP: cuts the prefill chunks of ranks planned above the level
    below, newest request first, so that no rank's prefill makes the others wait in lockstep
    (TensorRT-LLM's attention-DP balance holds a rank's context requests until the other
    ranks have some too, for at most a timeout in steps; this holds tokens, not requests:
    a rank runs its prefill up to what the others run). A cut request runs its held tokens
    in a later step, where new requests, placed on the least loaded ranks meanwhile, give
    the others work to match; its pages for them stay allocated (it needs them next).

    Never held: a request with one token left to compute (a decode row, its drafts with it,
    or a prompt's last token: holding it would stall a stream to save a token a rank; a
    prefill chunk that the budget left at one token can be held), a request already held in
    `timeout` steps (the bound on its wait), and any step that the cut would leave empty
    (nothing else would run, so waiting only idles every rank, and an idle engine sleeps
    until the next command)."""
    cfg, shard_of, num_ranks = self.dp_balance, self.kv.request_shard, self.kv.num_shards
    tokens, fixed = [0] * num_ranks, [0] * num_ranks
    holdable: list[list[int]] = [[] for _ in range(num_ranks)]  # per rank: rows, in batch order
    for i, (req, n) in enumerate(out.scheduled):
      rank = shard_of(req.request_id)
      tokens[rank] += n
      if req.num_uncomputed > 1 and req.num_held_steps < cfg.timeout:
        holdable[rank].append(i)
      else:
        fixed[rank] += n
    # The level: the step costs every rank the busiest rank's decode rows anyway, and every
    # rank runs at least what the least busy one runs; up to the larger of the two a rank
    # pads no other, above it every token it runs is one the others wait through.
    level = max(max(fixed), min(tokens))
    if level >= max(tokens) or not any(min(t, max(f, level)) for t, f in zip(tokens, fixed)):
      return
    cut = {}
    for rank in range(num_ranks):
      excess = tokens[rank] - max(fixed[rank], level)
      for i in reversed(holdable[rank]):
        if excess <= 0:
          break
        req, n = out.scheduled[i]
        cut[i] = n - min(n, excess)
        excess -= n - cut[i]
    for i in cut:
      out.scheduled[i][0].num_held_steps += 1
    out.scheduled[:] = [(req, cut.get(i, n)) for i, (req, n) in enumerate(out.scheduled) if cut.get(i, n)]

  def _admit_remote(self, req: Request, cached: list[int], computed: int, remote: int, shard: int = 0) -> bool:
    """Pages for the cached and the remote tokens; the request waits for its KV (no budget)."""
    if computed + remote > len(req.token_ids):
      raise ValueError(f"the connector claims {remote} remote tokens for {req.request_id!r} after "
                       f"{computed} cached ones, but it has only {len(req.token_ids)} tokens")
    if not self.kv.can_allocate(req.request_id, computed + remote, cached, shard):
      return False
    pages = self.kv.allocate(req.request_id, computed + remote, cached, shard)
    self.waiting.popleft()
    req.num_computed = req.num_cached_tokens = computed
    req.num_remote_tokens = remote
    req.status = Status.WAITING_FOR_REMOTE_KV
    self._take_row(req)
    self.waiting_for_kv[req.request_id] = req
    self.connector.update_state_after_alloc(req, list(pages), remote)
    return True

  def kv_arrived(self, req: Request) -> None:
    """The remote tokens' KV is in the request's pages: it runs from the next step on, and
    its imported blocks (final prompt KV) go into the prefix cache for later requests."""
    if self.waiting_for_kv.pop(req.request_id, None) is not req:
      raise ValueError(f"request {req.request_id!r} is not waiting for remote KV")
    req.num_computed += req.num_remote_tokens
    req.status = Status.RUNNING
    req.needs_history = req.params.uses_penalties
    self.running.append(req)
    self.kv.cache_blocks(req.request_id, req.token_ids, req.num_computed)

  def release_held(self, request_id: str) -> bool:
    """Frees a finished request's held pages; False if it held none."""
    if self.held.pop(request_id, None) is None:
      return False
    self.kv.free(request_id)
    return True

  # ---- state changes ----------------------------------------------------------------

  def _preempt(self, req: Request) -> None:
    """Back to the front of the queue; recomputed from its tokens (outputs kept)."""
    self.running.remove(req)
    req.spec_token_ids = []
    self._release(req)
    req.status = Status.WAITING
    req.num_computed = 0
    req.num_preemptions += 1
    self.num_preemptions += 1
    self.waiting.appendleft(req)

  def finish(self, req: Request, reason: str) -> None:
    """Ends a request wherever it is; its pages are free at once, unless the
    connector or `hold_kv` keeps them (then `release_held` frees them)."""
    delay = self.connector.request_finished(req) if self.connector is not None else False
    delay = delay or req.hold_kv
    if req.status is Status.RUNNING:
      self.running.remove(req)
      self._release(req, keep_pages=delay)
      if delay:
        self.held[req.request_id] = req
    elif req.status is Status.WAITING_FOR_REMOTE_KV:
      del self.waiting_for_kv[req.request_id]
      self._release(req)  # its KV never fully arrived: nothing in its pages is worth keeping
    elif req.status is Status.WAITING:
      self.waiting.remove(req)
    req.status = Status.FINISHED
    req.finish_reason = reason

  def _take_row(self, req: Request) -> None:
    req.row = self._free_rows.pop()
    self.row_gen[req.row] += 1

  def _release(self, req: Request, keep_pages: bool = False) -> None:
    if not keep_pages:
      self.kv.free(req.request_id)
    if req.row is not None:
      self.row_gen[req.row] += 1
      self._free_rows.append(req.row)
      req.row = None
