"""The device side of the engine: one ragged step, as a few bucketed programs the host picks.

    forward(params, cache, history, batch) -> (cache, logits, expert counts[, MTP inputs, prompt logprobs])
    sample(history, logits, sampler inputs)  -> (history, results)        (per row bucket and SamplerMode)
    propose(params, cache, history, ...)     -> (cache, history, drafts)  (with an MTP module)

Every scheduled request contributes its new tokens (a prefill chunk, one
decode token, or 1 + k to verify k drafts) to one packed batch of T tokens
from S sequences, built on the host by engine/batch.py. Each sequence owns
k + 1 logits rows (`logits_indices`; k = the engine's speculative tokens,
0 without speculation): the last row of a prefill chunk or decode, or all
1 + k rows of a verified sequence; the step samples every row, accepts the
drafts that match (engine/spec_decode.py) and returns [S, k + 1] ids and how
many of them each sequence commits. T is rounded up to a power-of-two bucket
and S to min(T, max_num_seqs). No program branches on the batch (on XLA:GPU a
conditional copies its predicate to the host and blocks, so the host could not
prepare step n + 1 while step n runs): the host reads what the batch needs off
its rows (`sampling.SamplerMode`) and picks the sampler program that does that
work and no branch. `warmup()` compiles every program a step can run: the
forward (and MTP pass) per token bucket, the sampler per row bucket in each of
its variants (`_sampler_variants`). A step's inputs cross to the device as
two flat buffers (int32 and float32, `to_buffers`) and its results come back
as one (`_pack_results`). The KV cache and the sampling history are donated:
updated in place. Only token ids and logprobs come back.

Structured output: each logits row carries an allowed-token bitmask
(`StepBatch.allowed`, [L, W] int32, llguidance's layout; all ones for free
rows), filled on the host by engine/grammar.py from the request's matcher
(a verified row j from the state after its first j drafts), and applied to
the logits before sampling.

`history` holds, per sampler row (one per running request), how often each
token occurred in the output and which tokens are in the prompt: the
repetition / presence / frequency penalties read it on device, so no
per-step [S, V] array crosses to the device.

The KV cache's layout (what a page holds per layer, its shardings, bytes
per token) is `self.cache_spec` (jaxinfer.models.cache); this module never
spells it.

Attention data parallelism (sharding rules that split the pool's 'pages'
over 'data'): each data shard owns a contiguous block of pages and every
sequence lives on one shard (KVManager / Scheduler). `pack_shards` lays the
step out as one T-token block per shard with shard-local page ids, and the
model runs under shard_map over 'data' (`_forward`): each shard attends to
its own sequences in its own pages, no KV crosses shards; sampling runs on
the concatenated logits rows, and results go back to scheduled order. KV pages move between
workers (prefill/decode disaggregation) through `export_*` / `import_*`, which hand the cache
to engine/kv_transfer.py: a bounded set of programs, compiled on first use (as are prompt
logprobs and full-sequence logits).

Legend: T tokens, S sequences, k drafts per sequence, L = S * (k + 1) logits rows,
P pages per sequence, R sampler rows, V vocab, W = ceil(V / 32) mask words, N top logprobs.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.engine.batch import (InputBatch, SamplerInputs, ScheduledSeq, StepBatch, bucket, from_buffers, pack,
                                   pack_shards, power_of_two_buckets, slot_mapping, to_buffers)
from jaxinfer.engine.grammar import mask_words
from jaxinfer.engine.kv_connector import KVLayout
from jaxinfer.engine.kv_transfer import KVTransfer
from jaxinfer.engine.kv_manager import NULL_PAGE
from jaxinfer.models import eplb, mtp
from jaxinfer.models.cache import CacheSpec
from jaxinfer.models.expert_parallel import ExpertParallelism, tracing_with
from jaxinfer.ops import resolve_attention_impl
from jaxinfer.models.transformer import PagedBatch, compute_logits, forward, stack_cache
from jaxinfer import quant
from jaxinfer.params import model_dtype
from jaxinfer.engine.spec_decode import accept, relax
from jaxinfer.sampling import MAX_LOGPROBS, WARM_MODES, SamplerMode, chosen_logprobs, sample
from pallas_kernels.spec_accept import spec_accept

log = logging.getLogger(__name__)



@dataclasses.dataclass
class StepResult:
  """Host copies of what one step produced, row i for the i-th scheduled sequence.

  A sequence that samples commits ids[i, :num_committed[i]] (its accepted
  drafts, then the correction or bonus token); one that ran a prefill chunk
  commits nothing.
  """

  ids: np.ndarray  # [S, k + 1] int32
  num_committed: np.ndarray  # [S]
  logprobs: np.ndarray  # [S, k + 1]
  top_ids: np.ndarray  # [S, k + 1, N]
  top_logprobs: np.ndarray  # [S, k + 1, N]
  prompt: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # per token: target logprob, top ids, top lps
  # MoE: the step's real token copies routed to each expert, per MoE layer [layers, E]
  # ([0, 1] for a dense model)
  expert_tokens: np.ndarray | None = None
  # MTP: k greedy drafts per sequence for the next step [S, k] (meaningful where it committed)
  drafts: np.ndarray | None = None


class LaunchedStep(NamedTuple):
  """A dispatched step: its device outputs (futures until `ModelRunner.collect`)."""

  results: jax.Array  # one float32 buffer (`_sample_step`)
  shapes: tuple  # (shape, dtype) of each array in it
  prompt: tuple | None  # prompt logprobs (target, top-n ids, top-n logprobs), if asked
  drafts: jax.Array | None  # MTP drafts [S, k]
  order: tuple[np.ndarray, np.ndarray] | None  # attention DP: (seq rows, token rows) of `pack_shards`


def _pack_results(*arrays: jax.Array) -> jax.Array:
  """One float32 buffer [n] of every array (int32 bitcast): one device->host copy per step."""
  flat = [a.reshape(-1) if a.dtype == jnp.float32 else
          jax.lax.bitcast_convert_type(a.astype(jnp.int32), jnp.float32).reshape(-1) for a in arrays]
  return jnp.concatenate(flat)


def _unpack_results(buf: np.ndarray, shapes: Sequence[tuple[tuple[int, ...], Any]]) -> list[np.ndarray]:
  """The host arrays of `_pack_results` from their (shape, dtype)s."""
  out, off = [], 0
  for shape, dtype in shapes:
    n = math.prod(shape)
    part = buf[off:off + n]
    out.append((part if dtype == np.float32 else part.view(np.int32)).reshape(shape))
    off += n
  return out


class ModelRunner:
  """Owns the params, the paged KV cache and the compiled steps of one model."""

  def __init__(self, cfg: ModelConfig, params: Any, *, num_pages: int, page_size: int,
               max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, mesh=None,
               sharding_rules=None, attention_impl: str = "auto", num_speculative_tokens: int = 0,
               mtp_params: Any = None, kv_cache_dtype: str | None = None,
               relaxed_acceptance: tuple[int, float] | None = None, scan_layers: bool = False):
    """`mesh` and `sharding_rules` (overrides of jaxinfer.sharding.RULES) shard the KV cache
    like the weights; without a mesh everything lives on the first device. `mtp_params`
    (jaxinfer.models.mtp): the step also drafts num_speculative_tokens tokens per sequence
    with that MTP module, whose K/V is one more cache layer in the same pages.
    `kv_cache_dtype`: the cache's dtype name (None: the model's; 'int8' / 'float8_e4m3fn'
    quantize it, jaxinfer.models.cache). `relaxed_acceptance`: (top_n, delta) of
    SpeculativeConfig's relaxed acceptance, or None (exact verification). `scan_layers`: the
    weights stacked and the pool one of layers x pages, the step scanning over layers
    (models/transformer.py; InvalidRequestError where the model or the setup cannot)."""
    from jaxinfer.sharding import make_rules, runtime_params
    self.cfg = cfg
    self.attention_impl = resolve_attention_impl(attention_impl, mla=cfg.kv_lora_rank > 0)
    self.dtype = model_dtype(params)
    self.mtp = mtp_params is not None
    if self.mtp and num_speculative_tokens < 1:
      raise ValueError("an MTP module drafts num_speculative_tokens >= 1 tokens")
    self.cache_spec = CacheSpec.from_config(cfg, kv_cache_dtype or self.dtype, draft_layers=int(self.mtp))
    self.page_size = page_size
    self.num_pages = num_pages
    self.max_num_seqs = max_num_seqs
    self.max_model_len = max_model_len
    self.num_speculative_tokens = num_speculative_tokens
    self.pages_per_seq = -(-max_model_len // page_size)
    self.token_buckets = power_of_two_buckets(1, max_num_batched_tokens)
    self.len_buckets = power_of_two_buckets(min(64, max_model_len), max_model_len)
    self.mesh = mesh
    if sharding_rules and mesh is None:
      from jaxinfer.errors import ShardingError
      raise ShardingError("sharding_rules need a mesh (mesh=jaxinfer.sharding.make_mesh(...))")
    self.sharding_rules = make_rules(sharding_rules)
    # q/k/v and gate/up joined into one weight each (jaxinfer.params.FUSED): four matmuls a layer.
    # (An EPLB placement's slot tables are not weights: they pass around the spec-driven fusion.)
    params, eplb_tables = eplb.split_tables(params)
    params = eplb.join_tables(runtime_params(cfg, params, mesh, self.sharding_rules), eplb_tables)
    self.scan_layers = scan_layers
    if scan_layers:
      params = _stacked(cfg, params, mtp_params, self.cache_spec.page_shards(mesh, self.sharding_rules))
    # The MTP module rides in the params tree under 'mtp' (the decoder never reads it).
    self.params = {**params, "mtp": mtp_params} if self.mtp else params
    # Attention data parallelism: the rules split the pool's pages over mesh axes ('data'),
    # each shard owning a contiguous block; each sequence lives on one shard (the KVManager
    # and scheduler see to that) and the step runs the model per shard (see `_step`).
    self.page_shards = self.cache_spec.page_shards(mesh, self.sharding_rules)
    self.shard_pages = num_pages // self.page_shards
    if self.mtp and self.page_shards > 1:
      from jaxinfer.errors import InvalidRequestError
      raise InvalidRequestError("speculative method 'mtp' does not support attention data parallelism "
                                "(sharding rules that split the KV pool's 'pages'); use method='ngram'")
    dp = None
    if self.page_shards > 1:
      from jaxinfer.sharding import mesh_axes
      axes = mesh_axes("pages", self.sharding_rules["pages"])
      dp = (mesh, axes, _dp_param_specs(params, axes))
    # Experts split over mesh axes: the MoE layers run the all-to-all EP FFN
    # (models/expert_parallel.py), set for the tracing of this runner's programs.
    self.expert_parallelism = ExpertParallelism.from_rules(mesh, self.sharding_rules)
    self._result_order = None  # set by pack_step for launch_packed under attention DP
    self.scratch_row = max_num_seqs  # the last history row is scratch for padding sequences
    self.input_batch = InputBatch(self.scratch_row, self.pages_per_seq, page_size, num_speculative_tokens)
    self.reset_state()
    # Programs over several devices trace int8 / int4 matmuls as XLA dots the partitioner can split.
    traced = lambda fn: quant.tracing_on(mesh, tracing_with(self.expert_parallelism, fn))
    # A step is two programs (three with an MTP module), each picked by the host from what it
    # knows of the batch, none branching on it (see `SamplerMode`): the forward per token
    # bucket, the sampler per token bucket and mode, and the MTP module's pass.
    mtp_page_size = page_size if self.mtp else 0
    self._step = jax.jit(traced(functools.partial(
                             _forward_step, cfg, self.attention_impl, 1 + num_speculative_tokens, dp,
                             mtp_page_size)),
                         static_argnums=(0,), static_argnames=("prompt_logprobs",), donate_argnums=(2,))
    self._sample = jax.jit(functools.partial(_sample_step, self.attention_impl, mtp_page_size, relaxed_acceptance),
                           static_argnums=(0, 1, 2), donate_argnums=(3,))
    self._propose = jax.jit(traced(functools.partial(_propose_step, cfg, self.attention_impl, mtp_page_size)),
                            static_argnums=(0,), donate_argnums=(2, 3))
    # Speculative batches of plain rows verify in the fused Pallas kernel (GPU attention only).
    self._can_fuse = (num_speculative_tokens > 0 and relaxed_acceptance is None
                      and self.attention_impl in ("pallas", "pallas_interpret", "mosaic", "mosaic_interpret"))
    # Loops over rows where XLA:CPU runs them in place, every row at once where a loop would
    # make the host wait (GPU): SamplerMode.rows_at_once.
    self.rows_at_once = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform != "cpu"
    self._set_row = jax.jit(_set_history_row, donate_argnums=(0,))
    self._logits = jax.jit(traced(functools.partial(
        _all_logits, cfg, self.attention_impl, page_size, self.cache_spec,
        self._cache_shardings if mesh else None, self.cache_spec.page_shards(mesh, self.sharding_rules))))
    self._programs: set[tuple] = set()
    self.kv_transfer = KVTransfer(self.cache_spec, page_size, num_pages, mesh, self.sharding_rules, scan_layers,
                                  self._cache_shardings(num_pages), self._programs)

  def reset_state(self) -> None:
    """A zeroed KV cache and sampler history (at start, or after a failed step lost them).

    Both are committed to their device(s) from the start: the step's outputs are, and
    jit keys its cache on committedness, so fresh uncommitted arrays would make the
    second call of the first bucket trace and compile again (seen: 2 s)."""
    cfg = self.cfg
    rows = self.max_num_seqs + 1
    self.cache = self.cache_spec.zeros(self.num_pages, self.page_size, self._cache_shardings(self.num_pages))
    if self.scan_layers:
      self.cache = stack_cache(self.cache)  # layer i's pages at i * num_pages
    self.history = {"counts": jnp.zeros((rows, cfg.vocab_size), jnp.int32),
                    "prompt": jnp.zeros((rows, cfg.vocab_size), jnp.bool_),
                    # Async scheduling: each row's last committed token, the MTP drafts made
                    # for it, and how many drafts its last step accepted (see `_feed`).
                    "last": jnp.zeros((rows,), jnp.int32),
                    "drafts": jnp.zeros((rows, self.num_speculative_tokens), jnp.int32),
                    "accepted": jnp.zeros((rows,), jnp.int32)}
    if self.mesh is None:
      self.history = jax.device_put(self.history, jax.devices()[0])
      return
    from jax.sharding import NamedSharding, PartitionSpec
    self.history = jax.device_put(self.history, NamedSharding(self.mesh, PartitionSpec()))

  def _cache_shardings(self, num_pages: int):
    """The pool's shardings: from the cache spec's logical axes and the rules on a mesh
    (ShardingError if they do not divide), else the first device."""
    if self.mesh is None:
      device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      return jax.tree.map(lambda _: device, self.cache_spec.abstract(num_pages, self.page_size))
    return self.cache_spec.shardings(self.mesh, num_pages, self.page_size, self.sharding_rules)

  def state_lost(self) -> bool:
    """Whether a failed step consumed the donated cache or history without replacing them."""
    return any(x.is_deleted() for x in jax.tree.leaves((self.cache, self.history)))

  # ---- compile discipline ----------------------------------------------------------

  def num_seqs_bucket(self, num_tokens_bucket: int) -> int:
    """The sequence rows of the T-token program. Every sequence brings at least one token,
    so the largest bucket holds min(T, max_num_seqs): any step the scheduler can form.
    Smaller ones hold T // (k + 1): a speculating sequence verifies k + 1 tokens, and rows
    sized by tokens alone would leave k of every k + 1 padded, each still paying its k + 1
    LM-head rows (on CPU the LM head is most of a small step). k = 0: T rows, as before."""
    T = num_tokens_bucket
    if T == self.token_buckets[-1]:
      return min(T, self.max_num_seqs)
    return min(max(1, T // (1 + self.num_speculative_tokens)), self.max_num_seqs)

  def step_bucket(self, num_tokens: int, num_seqs: int) -> int:
    """The smallest token bucket whose program holds num_tokens tokens of num_seqs sequences."""
    for T in self.token_buckets:
      if num_tokens <= T and num_seqs <= self.num_seqs_bucket(T):
        return T
    raise ValueError(f"{num_tokens} tokens of {num_seqs} sequences exceed the largest step "
                     f"({self.token_buckets[-1]} tokens of {self.num_seqs_bucket(self.token_buckets[-1])})")

  def compiled_programs(self) -> int:
    """Distinct programs compiled so far (each padded shape compiles once)."""
    return len(self._programs)

  def max_programs(self) -> int:
    """Every program a request can ever trigger: per token bucket, the forward with and
    without prompt logprobs and the MTP module's pass; per row bucket, the sampler's
    variants; full-sequence logits per length bucket, the history-row setter, the KV
    transfer programs."""
    row_buckets = {self.num_seqs_bucket(T) for T in self.token_buckets}
    return (len(self.token_buckets) * (2 + int(self.mtp)) + len(row_buckets) * len(self._sampler_variants())
            + len(self.len_buckets) + 1 + self.kv_transfer.num_programs())

  def warmup(self, progress=None) -> None:
    """Compiles every program a step can run, by running it on all-padding batches (which touch
    no real page): per token bucket the forward (and the MTP pass), per row bucket the
    sampler in every variant (`_sampler_variants`). Then `freeze_heap`."""
    warm_rows = set()
    for T in self.token_buckets:
      T, lp, batch = self.pack_step([], T)
      launched, logits, expert_tokens = self._launch(T, lp, batch)
      S = batch.draft_ids.shape[0]
      if S not in warm_rows:
        warm_rows.add(S)
        inputs = SamplerInputs.of(batch)
        L = inputs.rows.shape[0]
        for mode, fused, masked in self._sampler_variants():
          allowed = np.full((L, mask_words(self.cfg.vocab_size)), -1, np.int32) if masked else None
          self._run_sampler(inputs._replace(allowed=allowed), mode, fused, logits, expert_tokens)
      self.collect(launched)
      if progress is not None:
        progress.update(1)
    self.history = self._set_row(self.history, self.scratch_row, np.zeros(self.max_model_len, np.int32), 0, 0)
    self._programs.add(("set_row",))
    jax.block_until_ready(self.cache)
    freeze_heap()  # start-up is over (a multi-host follower's too: it runs this call)

  # ---- the step ----------------------------------------------------------------------

  def execute(self, seqs: list[ScheduledSeq]) -> StepResult:
    """Runs one step for the scheduled sequences (in this order) and returns host results."""
    return self.collect(self.launch(seqs))

  def launch(self, seqs: list[ScheduledSeq]) -> "LaunchedStep":
    """Packs and dispatches one step, returning at once: the device runs it while the
    host goes on (async scheduling packs the next step meanwhile). `collect` waits."""
    return self.launch_packed(*self.pack_step(seqs))

  def pack_step(self, seqs: list[ScheduledSeq], T: int | None = None) -> tuple[int, bool, StepBatch]:
    """The step's inputs as host arrays: (token bucket, prompt logprobs wanted, batch).

    Under attention DP, T is the bucket of the busiest shard's tokens, and the batch is
    one T-token block per shard (`pack_shards`)."""
    lp = any(s.want_prompt_logprobs for s in seqs)
    if self.page_shards == 1:
      if T is None:
        T = self.step_bucket(sum(s.num_new for s in seqs), len(seqs))
      S = self.num_seqs_bucket(T)
      batch = self.input_batch.pack_decodes(seqs, T, S)  # the steady state: decodes only
      if batch is None:
        batch = pack(seqs, T, S, self.num_speculative_tokens, self.pages_per_seq, self.page_size,
                     self.scratch_row, self.cfg.vocab_size, self.input_batch.tokens)
      return T, lp, batch
    shards = [s.pages[0] // self.shard_pages for s in seqs]
    if T is None:
      load = np.bincount(shards, [s.num_new for s in seqs], self.page_shards) if seqs else [0]
      count = np.bincount(shards, minlength=self.page_shards) if seqs else [0]
      T = self.step_bucket(int(max(load)), int(max(count)))
    batch, self._result_order = pack_shards(
        seqs, shards, self.page_shards, self.shard_pages, T, self.num_seqs_bucket(T),
        self.num_speculative_tokens, self.pages_per_seq, self.page_size, self.scratch_row,
        self.cfg.vocab_size, self.input_batch.tokens)
    return T, lp, batch

  def run_batch(self, T: int, prompt_lp: bool, batch: StepBatch) -> StepResult:
    """Runs one packed step on the devices and returns host results (multi-host
    followers call this with the leader's batch; see jaxinfer.distributed)."""
    return self.collect(self.launch_packed(T, prompt_lp, batch))

  def sampler_mode(self, batch: StepBatch | SamplerInputs, rows_at_once: bool | None = None
                   ) -> tuple[SamplerMode, bool]:
    """(the sampler's mode, whether to verify in the fused kernel) for a packed batch: the
    first warm mode that covers what its rows need (`SamplerMode`, sampling.WARM_MODES).
    rows_at_once: as on a GPU (True) or XLA:CPU (False); None: this backend's."""
    at_once = self.rows_at_once if rows_at_once is None else rows_at_once
    warm = _warm_modes(at_once)
    need = SamplerMode.of(batch.sampling, self.cfg.vocab_size, masked=batch.allowed is not None,
                          rows_at_once=at_once)
    if self._can_fuse and not (need.truncate or need.process):
      return SamplerMode(logprobs=need.logprobs), True
    if batch.allowed is not None:
      return warm[-1], False
    return next(m for m in warm if m.covers(need)), False

  def _sampler_variants(self) -> list[tuple[SamplerMode, bool, bool]]:
    """Every (mode, fused, masked) a step's sampler can run: what warm-up compiles per row bucket."""
    # A grammar's mask comes with every kind of work (structured output is rarer than sampling,
    # and each variant costs a compile per row bucket).
    warm = _warm_modes(self.rows_at_once)
    out = [(m, False, False) for m in warm] + [(warm[-1], False, True)]
    if self._can_fuse:
      out += [(SamplerMode(logprobs=lp), True, False) for lp in (False, True)]
    return out

  def launch_packed(self, T: int, prompt_lp: bool, batch: StepBatch) -> "LaunchedStep":
    """Enqueues one step packed by `pack_step`; the cache and history become its (future)
    outputs. Nothing here waits for the device: the host picked every program."""
    return self._launch(T, prompt_lp, batch)[0]

  def _launch(self, T: int, prompt_lp: bool, batch: StepBatch):
    """launch_packed, also returning the step's logits and expert counts (device arrays)."""
    order, self._result_order = self._result_order, None
    mode, fused = self.sampler_mode(batch)
    ints, floats, layout = to_buffers(_model_inputs(batch))
    self._programs.add(("forward", T, prompt_lp))
    self.cache, logits, expert_tokens, extras = self._step(layout, self.params, self.cache, self.history,
                                                           ints, floats, prompt_logprobs=prompt_lp)
    results, ids, committed = self._run_sampler(SamplerInputs.of(batch), mode, fused, logits, expert_tokens)
    drafts = None
    if self.mtp:
      self._programs.add(("propose", T))
      self.cache, self.history, drafts = self._propose(layout, self.params, self.cache, self.history,
                                                       *extras["mtp"], ids, committed, ints, floats)
    S, k1 = ids.shape
    N = min(MAX_LOGPROBS, self.cfg.vocab_size)
    shapes = [((S, k1), np.int32), ((S,), np.int32), ((S, k1), np.float32)]
    if mode.logprobs:
      shapes += [((S, k1, N), np.int32), ((S, k1, N), np.float32)]
    shapes.append((tuple(expert_tokens.shape), np.int32))
    return LaunchedStep(results, tuple(shapes), extras.get("prompt"), drafts, order), logits, expert_tokens

  def trace_step(self, seqs: list[ScheduledSeq], rows_at_once: bool | None = None) -> dict[str, Any]:
    """The jaxprs of the programs `launch(seqs)` would run ({'forward', 'sample'[, 'propose']}),
    traced without running them: what a reader (or a test) checks for control flow.
    rows_at_once: the sampler as on a GPU (True) or on XLA:CPU (False); None: this backend's."""
    T, lp, batch = self.pack_step(seqs)
    self._result_order = None
    mode, fused = self.sampler_mode(batch, rows_at_once)
    ints, floats, layout = to_buffers(_model_inputs(batch))
    fwd = self._step.trace(layout, self.params, self.cache, self.history, ints, floats, prompt_logprobs=lp)
    cache, logits, expert_tokens, extras = fwd.out_info
    s_ints, s_floats, s_layout = to_buffers(SamplerInputs.of(batch))
    smp = self._sample.trace(s_layout, mode, fused, self.history, logits, expert_tokens, s_ints, s_floats)
    out = {"forward": fwd.jaxpr, "sample": smp.jaxpr}
    if self.mtp:
      _, _, ids, committed = smp.out_info
      out["propose"] = self._propose.trace(layout, self.params, self.cache, self.history, *extras["mtp"], ids,
                                           committed, ints, floats).jaxpr
    return out

  def _run_sampler(self, inputs: SamplerInputs, mode: SamplerMode, fused: bool, logits, expert_tokens):
    """Enqueues the sampler program; the history becomes its output. (results, ids, committed)."""
    s_ints, s_floats, s_layout = to_buffers(inputs)
    self._programs.add(("sample", inputs.samples.shape[0], mode, fused, inputs.allowed is not None))
    self.history, results, ids, committed = self._sample(s_layout, mode, fused, self.history, logits,
                                                         expert_tokens, s_ints, s_floats)
    return results, ids, committed

  def collect(self, launched: "LaunchedStep") -> StepResult:
    """Waits for a dispatched step and returns its host results, in scheduled order."""
    parts = _unpack_results(np.asarray(jax.device_get(launched.results)), launched.shapes)
    ids, committed, lp = parts[:3]
    S, k1 = ids.shape
    if len(parts) == 6:
      top_ids, top_lp = parts[3:5]
    else:
      N = min(MAX_LOGPROBS, self.cfg.vocab_size)
      top_ids, top_lp = np.zeros((S, k1, N), np.int32), np.zeros((S, k1, N), np.float32)
    expert_tokens = parts[-1]
    prompt = None if launched.prompt is None else tuple(np.asarray(a) for a in jax.device_get(launched.prompt))
    drafts = np.zeros((S, 0), np.int32) if launched.drafts is None else np.asarray(launched.drafts)
    out = (ids, committed, lp, top_ids, top_lp)
    if launched.order is None:
      return StepResult(*out, prompt=prompt, expert_tokens=expert_tokens, drafts=drafts)
    seq_rows, token_rows = launched.order  # attention DP: back from shard blocks to scheduled order
    return StepResult(*(a[seq_rows] for a in out),
                      prompt=tuple(a[token_rows] for a in prompt) if prompt is not None else None,
                      expert_tokens=expert_tokens, drafts=drafts[seq_rows])

  def set_history(self, row: int, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
    """Loads a request's prompt and output so far into its sampler row (for penalties)."""
    ids = np.zeros(self.max_model_len, np.int32)
    ids[:len(prompt_ids)] = prompt_ids
    ids[len(prompt_ids):len(prompt_ids) + len(output_ids)] = output_ids
    self._programs.add(("set_row",))
    self.history = self._set_row(self.history, row, ids, len(prompt_ids),
                                 len(prompt_ids) + len(output_ids))

  # ---- KV page transfer (engine/kv_transfer.py; these names are what multi-host mirrors) ----

  def kv_layout(self) -> KVLayout:
    return self.kv_transfer.layout()

  def export_pages(self, page_ids: Sequence[int]) -> list[dict[str, np.ndarray]]:
    return self.kv_transfer.export_pages(self.cache, page_ids)

  def export_tokens(self, page_ids: Sequence[int], start: int, num_tokens: int) -> list[dict[str, np.ndarray]]:
    return self.kv_transfer.export_tokens(self.cache, page_ids, start, num_tokens)

  def num_import_pages(self, arrays: Sequence[dict[str, np.ndarray]]) -> int:
    return self.kv_transfer.num_import_pages(arrays)

  def import_pages(self, page_ids: Sequence[int], arrays: Sequence[dict[str, np.ndarray]]) -> None:
    self.cache = self.kv_transfer.import_pages(self.cache, page_ids, arrays)

  def import_tokens(self, page_ids: Sequence[int], start: int, runs: Sequence[dict[str, np.ndarray]]) -> None:
    self.cache = self.kv_transfer.import_tokens(self.cache, page_ids, start, runs)

  # ---- evaluation ------------------------------------------------------------------------

  def logits(self, token_ids: Sequence[int]) -> np.ndarray:
    """Float32 next-token logits [len, V] of one sequence, computed in a scratch cache."""
    L = bucket(len(token_ids), self.len_buckets)
    tokens = np.zeros(L, np.int32)
    tokens[:len(token_ids)] = token_ids
    self._programs.add(("logits", L))
    out = self._logits(self.params, tokens, np.int32(len(token_ids)))
    # Slice on the host: a device-side slice would compile once per length.
    return np.asarray(out)[:len(token_ids)]


def _stacked(cfg: ModelConfig, params: Any, mtp_params: Any, page_shards: int) -> Any:
  """params with its layers stacked for scan_layers, or InvalidRequestError naming what cannot scan."""
  from jaxinfer.errors import InvalidRequestError
  from jaxinfer.models.transformer import scannable, stack_layers
  why = scannable(cfg)
  if why is None and mtp_params is not None:
    why = "an MTP module's cache layer shares the pool"
  if why is None and page_shards > 1:
    why = "attention DP splits the pool's pages by data shard"
  if why:
    raise InvalidRequestError(f"scan_layers=True: {cfg.architecture} layers cannot be scanned here: {why}")
  return stack_layers(cfg, params)


def _dp_param_specs(params: Any, axes: tuple[str, ...]) -> Any:
  """Each weight's PartitionSpec restricted to the DP axes: what attention DP's shard_map hands
  each data shard. Weights replicated over 'data' get P(); experts over ('data', 'expert') get
  their 'data' block (E / data experts, split further over 'expert' inside), so wide EP moves
  tokens, not weights."""
  P = jax.sharding.PartitionSpec

  def keep(entry):
    names = (entry,) if isinstance(entry, str) else tuple(entry or ())
    lead = names[:next((i for i, n in enumerate(names) if n not in axes), len(names))]
    if any(n in axes for n in names[len(lead):]):
      from jaxinfer.errors import ShardingError
      raise ShardingError(f"a weight split over {names}: under attention DP the DP axes {axes} must come "
                          f"first in its rule")
    return None if not lead else lead[0] if len(lead) == 1 else lead

  return jax.tree.map(lambda a: P(*(keep(e) for e in getattr(getattr(a, "sharding", None), "spec", ()))),
                      params)


def _forward(dp, cfg, attention_impl, decode_q_len, params, tokens, positions, cache, paged):
  """forward() on one device group, or under attention DP once per data shard: shard_map
  over the DP mesh axes only (manual), so each shard attends to its own sequences in its
  own pages with no cross-shard traffic; inside, the 'model'/'expert' axes stay automatic
  (the weights keep their tensor-parallel sharding). Weights are replicated over 'data' except
  experts under wide EP (`_dp_param_specs`), whose all-to-all spans the shards."""
  run = functools.partial(forward, cfg=cfg, attention_impl=attention_impl, decode_q_len=decode_q_len,
                          return_router_stats=True)
  if dp is None:
    hidden, cache, stats = run(params, tokens=tokens, positions=positions, cache=cache, batch=paged)
    return hidden, cache, stats.tokens_per_expert
  mesh, axes, param_specs = dp
  split = jax.sharding.PartitionSpec(axes)  # leading dim: one block per shard

  def shard(params, tokens, positions, cache, paged):
    hidden, cache, stats = run(params, tokens=tokens, positions=positions, cache=cache,
                               batch=paged._replace(num_seqs=paged.num_seqs[0]))
    return hidden, cache, stats.tokens_per_expert[None]
  # check_vma=False: attention does not communicate over the DP axes (only wide EP's
  # all-to-all does, checked there), and the attention ops' loops start from fresh
  # (unvarying) carries that the checker would ask to pcast.
  hidden, cache, per_shard = jax.shard_map(
      shard, mesh=mesh, axis_names=set(axes), check_vma=False,
      in_specs=(param_specs, split, split, split, split),
      out_specs=(split, split, split))(params, tokens, positions, cache, paged)
  return hidden, cache, per_shard.sum(0)  # [shards, layers, E] -> the whole step's


def _warm_modes(rows_at_once: bool) -> list[SamplerMode]:
  """sampling.WARM_MODES with this backend's rows_at_once (only modes that draw have one)."""
  return [m._replace(rows_at_once=rows_at_once and (m.draw or m.truncate)) for m in WARM_MODES]


def _model_inputs(batch: StepBatch) -> StepBatch:
  """What the forward and MTP programs read of a batch: the sampling rows and the grammar mask
  cross to the device once, in the sampler's own buffers (SamplerInputs)."""
  return batch._replace(sampling=None, allowed=None)


def _sample_and_accept(logits, batch: SamplerInputs, history, attention_impl, relaxed, mode: SamplerMode,
                       fused: bool):
  """(ids [S, k + 1], accepted drafts [S], logprobs [L], top-n ids and logprobs [L, N]).

  Every verify row draws its token with fold_in(seed, position) and drafts are accepted
  while they match (spec_decode.accept). `fused` (the host's choice: the Pallas attention
  (GPU) and a speculative batch of plain rows, no penalty, grammar mask or truncation) runs
  the fused kernel pallas_kernels.spec_accept instead, which draws the same tokens from the
  same keys and reads each logit row once; other batches run sample() then accept().
  relaxed = (top_n, delta): greedy rows also take near-top drafts (spec_decode.relax); the
  committed tokens' logprobs are then those of the drafts.
  """
  sp = batch.sampling
  S, k = batch.draft_ids.shape
  L, V = logits.shape
  if fused:
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(sp.seed, sp.position)
    accepted, ids = spec_accept(logits.reshape(S, k + 1, V), batch.draft_ids, batch.num_drafts,
                                sp.temperature.reshape(S, k + 1), keys.reshape(S, k + 1),
                                interpret=attention_impl.endswith("_interpret"))
    return (ids, accepted, *chosen_logprobs(logits.astype(jnp.float32), ids.reshape(L), mode.logprobs))
  ids, lp, top_ids, top_lp = sample(logits, sp, history["counts"], history["prompt"], batch.rows, batch.allowed,
                                    mode=mode)
  ids = ids.reshape(S, k + 1)
  if relaxed is not None:
    xf = logits.astype(jnp.float32)
    greedy = (sp.temperature == 0).reshape(S, k + 1)[:, :k]
    taken = relax(xf.reshape(S, k + 1, V)[:, :k], ids, batch.draft_ids, batch.num_drafts, greedy, *relaxed)
    taken_lp = chosen_logprobs(xf, taken.reshape(L), False)[0]  # (no top-n)
    lp = jnp.where((taken != ids).reshape(L), taken_lp, lp)
    ids = taken
  return ids, accept(ids, batch.draft_ids, batch.num_drafts), lp, top_ids, top_lp


def _forward_step(cfg, attention_impl, decode_q_len, dp, mtp_page_size, layout, params, cache, history,
                  ints, floats, *, prompt_logprobs: bool):
  """The model's part of a step: (cache, logits [L, V], expert_tokens, extras).

  extras: with an MTP module (mtp_page_size > 0) the hidden states [T, D] and the fed
  positions and paged batch its pass reads; with prompt_logprobs, (target logprob [T],
  top-n ids [T, N], top-n logprobs [T, N]). The MTP module's cache layer passes through."""
  if dp is not None:
    # The buffers replicated, as the numpy arrays they replace were: left to propagation, the
    # shard_map's per-shard slices of them crashed XLA:CPU's SPMD partitioner (a gather).
    replicated = jax.sharding.NamedSharding(dp[0], jax.sharding.PartitionSpec())
    ints, floats = (jax.lax.with_sharding_constraint(b, replicated) for b in (ints, floats))
  batch = from_buffers(layout, ints, floats)
  n = cfg.num_layers
  tokens, batch = _feed(batch, history, mtp_page_size)
  hidden, model_cache, expert_tokens = _forward(dp, cfg, attention_impl, decode_q_len, params, tokens,
                                                batch.positions, cache[:n], batch.paged)
  # hidden [T, D] (under attention DP: [shards * T, D]); expert_tokens [MoE layers, E]
  logits = compute_logits(params, cfg, hidden[batch.logits_indices])  # [L, V]
  extras = {}
  if mtp_page_size:
    extras["mtp"] = (hidden, batch.positions, batch.paged)
  if prompt_logprobs:
    all_lp = jax.nn.log_softmax(compute_logits(params, cfg, hidden), axis=-1)  # [T, V]
    target_lp = jnp.take_along_axis(all_lp, batch.targets[:, None], axis=-1)[:, 0]
    p_top_lp, p_top_ids = jax.lax.top_k(all_lp, min(MAX_LOGPROBS, all_lp.shape[-1]))
    extras["prompt"] = (target_lp, p_top_ids, p_top_lp)
  return list(model_cache) + list(cache[n:]), logits, expert_tokens, extras


def _sample_step(attention_impl, mtp_page_size, relaxed, layout, mode: SamplerMode, fused: bool, history,
                 logits, expert_tokens, ints, floats):
  """The sampler's part of a step (its inputs: SamplerInputs in two buffers): draws, accepts
  drafts, records the committed tokens in the history. Returns (history, results, ids
  [S, k + 1], committed [S]); results is one float32 buffer (`_pack_results`) of ids,
  committed, logprobs [S, k + 1], the top-n ids and logprobs [S, k + 1, N] when
  mode.logprobs, and expert_tokens."""
  batch = from_buffers(layout, ints, floats)
  if mtp_page_size:
    batch = _feed_drafts(batch, history)  # the same history the forward read
  S, k = batch.draft_ids.shape
  ids, accepted, lp, top_ids, top_lp = _sample_and_accept(logits, batch, history, attention_impl, relaxed,
                                                          mode, fused)
  committed = jnp.where(batch.samples, accepted + 1, 0)  # [S]
  # The committed tokens join the output: later steps penalize them.
  keep = (jnp.arange(k + 1) < committed[:, None]).reshape(-1)
  counts = history["counts"].at[batch.rows, ids.reshape(-1)].add(keep.astype(jnp.int32))
  # Each sequence's last committed token, for a next step packed before this one's ids reach
  # the host (padding sequences write the scratch row).
  last_tok = jnp.take_along_axis(ids, jnp.maximum(committed - 1, 0)[:, None], axis=1)[:, 0]
  keep_committed = functools.partial(_keep_committed, batch, committed)
  history = {**history, "counts": counts, "last": keep_committed(history["last"], last_tok),
             "accepted": keep_committed(history["accepted"], accepted)}
  out = [ids, committed, lp.reshape(S, k + 1)]
  if mode.logprobs:
    out += [top_ids.reshape(S, k + 1, -1), top_lp.reshape(S, k + 1, -1)]
  return history, _pack_results(*out, expert_tokens), ids, committed


def _propose_step(cfg, attention_impl, mtp_page_size, layout, params, cache, history, hidden, positions,
                  paged, ids, committed, ints, floats):
  """The MTP module's pass (its K/V is the cache's last layer): (cache, history, drafts [S, k])."""
  batch = from_buffers(layout, ints, floats)
  S, k = batch.draft_ids.shape
  n = cfg.num_layers
  drafts, mtp_cache = mtp.propose(params["mtp"], params, cfg, hidden, batch.targets, positions, paged,
                                  batch.logits_indices, batch.samples, batch.num_drafts, ids, committed,
                                  cache[n], k, mtp_page_size, attention_impl=attention_impl)
  history = {**history, "drafts": _keep_committed(batch, committed, history["drafts"], drafts)}
  return list(cache[:n]) + [mtp_cache], history, drafts


def _keep_committed(batch: StepBatch | SamplerInputs, committed, table, new):
  """table [R, ...] with the step's sequences that committed tokens set to new [S, ...]."""
  S, k = batch.draft_ids.shape
  seq_rows = batch.rows.reshape(S, k + 1)[:, 0]
  done = (committed > 0).reshape((S,) + (1,) * (new.ndim - 1))
  return table.at[seq_rows].set(jnp.where(done, new, table[seq_rows]))


def _feed(batch: StepBatch, history, page_size: int) -> tuple[jax.Array, StepBatch]:
  """Async scheduling: the step's tokens with the fed rows read from the device (the last
  committed token of their sequence, then its MTP drafts), and, with an MTP module
  (page_size > 0), the fed sequences' positions, KV slots and lengths moved on by the
  drafts their in-flight step accepted, which the host did not know when it packed them
  (`_feed_drafts` does the same for their draft ids and sampling positions). Returns
  (tokens [T], batch)."""
  S = batch.draft_ids.shape[0]
  nxt = jnp.concatenate([history["last"][:, None], history["drafts"]], axis=1).reshape(-1)  # [rows * (k + 1)]
  tokens = jnp.where(batch.feed >= 0, nxt[jnp.maximum(batch.feed, 0)], batch.tokens)
  if not page_size:
    return tokens, batch
  paged, T = batch.paged, tokens.shape[0]
  fed = batch.shift >= 0
  row = jnp.maximum(batch.shift, 0)
  d = jnp.where(fed, history["accepted"][row], 0)  # [S]
  t = jnp.arange(T, dtype=jnp.int32)
  tok_seq = jnp.minimum(jnp.searchsorted(paged.cu_q_lens[1:], t, side="right"), S - 1)  # [T]
  dt = jnp.where(t < paged.cu_q_lens[paged.num_seqs], d[tok_seq], 0)
  positions = batch.positions + dt
  # A position past the page table (a request that reached max_model_len in the step in
  # flight, so is finished) writes the padding page, never a real slot.
  P = paged.page_indices.shape[1]
  inside = positions < P * page_size
  slot = jnp.where(inside, slot_mapping(paged.page_indices, tok_seq, jnp.where(inside, positions, 0), page_size),
                   NULL_PAGE * page_size)
  paged = paged._replace(slot_mapping=jnp.where(dt > 0, slot, paged.slot_mapping),
                         kv_lens=jnp.minimum(paged.kv_lens + d, P * page_size))
  return tokens, batch._replace(positions=positions, paged=paged)


def _feed_drafts(batch: SamplerInputs, history) -> SamplerInputs:
  """The sampler's side of `_feed` with an MTP module: a fed sequence verifies the drafts its
  in-flight step made, at positions moved on by the drafts that step accepted."""
  S, k = batch.draft_ids.shape
  fed = batch.shift >= 0
  row = jnp.maximum(batch.shift, 0)
  d = jnp.where(fed, history["accepted"][row], 0)  # [S]
  sampling = batch.sampling._replace(position=batch.sampling.position + jnp.repeat(d, k + 1))
  return batch._replace(sampling=sampling, draft_ids=jnp.where(fed[:, None], history["drafts"][row],
                                                               batch.draft_ids))


def _set_history_row(history, row, ids, prompt_len, total_len):
  V = history["counts"].shape[1]
  idx = jnp.arange(ids.shape[0])
  is_prompt = idx < prompt_len
  is_output = (idx >= prompt_len) & (idx < total_len)
  prompt = jnp.zeros(V, jnp.bool_).at[ids].max(is_prompt)
  counts = jnp.zeros(V, jnp.int32).at[ids].add(is_output.astype(jnp.int32))
  return {**history, "counts": history["counts"].at[row].set(counts),
          "prompt": history["prompt"].at[row].set(prompt)}


def _all_logits(cfg, attention_impl, page_size, cache_spec: CacheSpec, cache_shardings, page_shards,
                params, tokens, length):
  L = tokens.shape[0]
  num_pages = -(-(L // page_size + 2) // page_shards) * page_shards  # equal shards of pages
  cache = cache_spec.zeros(num_pages, page_size)
  if cache_shardings is not None:  # on a mesh: split the scratch pages like the step's
    cache = jax.lax.with_sharding_constraint(cache, cache_shardings(num_pages))
  pos = jnp.arange(L, dtype=jnp.int32)
  # Pages 1.. hold the sequence; padding tokens write to page 0.
  slots = jnp.where(pos < length, pos + page_size, 0)
  pages = jnp.arange(1, num_pages, dtype=jnp.int32)[None, :]
  batch = PagedBatch(slots, length[None], pages, jnp.stack([0, length]).astype(jnp.int32),
                     jnp.int32(1))
  hidden, _ = forward(params, cfg, tokens, pos, cache, batch, attention_impl=attention_impl)
  return compute_logits(params, cfg, hidden)


def freeze_heap() -> None:
  """Takes every object alive now out of the cyclic garbage collector's reach (`gc.freeze`),
  once start-up's garbage is collected.

  Why: with jax loaded, the heap holds ~150k tracked objects that live as long as the
  process (jax's modules, traced programs, the tokenizer). An oldest-generation collection
  walks them all, ~140 ms on a 2-core EPYC, and it runs inside whichever step happens to
  allocate at that moment: every running request stalls for it (`jaxinfer bench profile`'s
  host rows: the worst replayed step with and without). Frozen, they are skipped; objects
  made later are collected as before. What an earlier call froze is thawed and collected
  first, so an engine that died since (several engines in one process: tests, notebooks)
  is not kept for ever."""
  gc.unfreeze()
  gc.collect()
  gc.freeze()
