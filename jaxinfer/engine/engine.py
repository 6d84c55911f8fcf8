"""`LLMEngine`: requests in, incremental outputs out, one `step()` at a time.

    engine = LLMEngine.from_model(None)                 # the embedded default model
    engine.add_request("r1", [1, 2, 3], SamplingParams(max_tokens=8))
    while engine.has_unfinished():
      for out in engine.step():                         # RequestOutput deltas
        print(out.request_id, out.new_text, out.finished)

step() = schedule (host) -> run (device: one ragged step, sampling
included) -> postprocess (host: append tokens, detokenize, stop checks,
free finished requests' pages). Servers drive it from their own loop;
`jaxinfer.LLM` drives it for notebooks and scripts.

A structured-output request keeps an llguidance matcher (engine/grammar.py):
it masks the request's logits rows in each step, consumes every committed
token (never the recomputed ones after a preemption), cuts drafts at the
first one the grammar rejects, and ends the request with 'stop' once only
EOS could follow.

Disaggregation (engine/kv_connector.py): with a connector set
(`set_kv_connector`), a new request whose prompt KV comes from another
worker waits with its pages allocated; the connector feeds `import_kv` and
then `finish_remote_kv` (the remote worker's first token joins the output as
if sampled here, the request decodes on). A request added with `hold_kv`
keeps its pages after it finishes, for `export_kv`, until `release_kv`.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import secrets
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.engine.kv_connector import KVConnector, KVTransferError
from jaxinfer.engine.kv_manager import KVEvent, KVManager
from jaxinfer.engine.output import OutputProcessor, RequestOutput
from jaxinfer.engine.runner import LaunchedStep, ModelRunner, ScheduledSeq
from jaxinfer.engine.scheduler import DPBalanceConfig, Request, Scheduler, SchedulerOutput
from jaxinfer.engine.spec_decode import SpeculativeConfig, make_drafter
from jaxinfer.errors import InvalidRequestError
from jaxinfer.frontend import Frontend, ValidRequest
from jaxinfer.models import eplb
from jaxinfer.models.cache import CacheSpec, kv_cache_dtype
from jaxinfer.models.eplb import EplbConfig
from jaxinfer.params import model_dtype
from jaxinfer.sharding import make_rules
from jaxinfer.ops import ATTENTION_IMPLS
from jaxinfer.sampling import SamplingParams
from jaxinfer.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Capacity and batching knobs; the batch sizes default by backend (`for_backend`), the rest suit any.

  The KV pool holds `num_pages` pages of `page_size` tokens; when
  `num_pages` is None it is sized from `kv_cache_bytes` (but never more
  than every sequence at full length needs).
  """

  max_model_len: int | None = None  # None: min(the model's context, 4096)
  # Sequences per step and the per-step token budget (= the largest step bucket). None: sized
  # for the backend (BACKEND_DEFAULTS): a CPU is compute-bound at a few hundred tokens a step,
  # while a GPU reads its weights once per step whatever the batch, so fewer, larger steps
  # (the 256 x 128/128 workload: ~216 steps at 512 tokens, ~132 at 8192).
  max_num_seqs: int | None = None
  max_num_batched_tokens: int | None = None
  page_size: int = 16
  num_pages: int | None = None
  # The KV pool's budget. None: by backend and memory (`kv_budget`): 1 GiB on the CPU; on a
  # GPU, KV_MEMORY_FRACTION of what its allocator may hold, less what is in use (the weights);
  # 1 GiB in a multi-host job (every process must size the same pool: give it there).
  kv_cache_bytes: int | None = None
  enable_prefix_caching: bool = True
  warmup: bool = True
  compilation_cache_dir: str | None = None  # None: ~/.cache/jaxinfer/xla ("" disables)
  attention_impl: str = "auto"  # jaxinfer.ops.ATTENTION_IMPLS: 'auto' (Mosaic on sm_90 + jax >= 0.11, else Pallas on GPU, XLA elsewhere), 'xla', 'pallas', 'mosaic' (+ '_interpret')
  # The KV cache's dtype: 'auto' (the model's), 'float32', 'bfloat16', or quantized 'int8' /
  # 'fp8' (float8 e4m3) with a float32 scale per token and kv head (jaxinfer.models.cache).
  kv_cache_dtype: str = "auto"
  # Speculative decoding: None (off), or a SpeculativeConfig / a dict of its fields,
  # e.g. {"method": "ngram", "num_speculative_tokens": 3}.
  speculative: SpeculativeConfig | None = None
  # Async scheduling: the host schedules and packs step n+1 while the device runs step n,
  # whose sampled ids stay on the device and feed step n+1 (LLMEngine.step). With
  # speculative method 'mtp' the drafts stay there too. 'ngram' drafts are looked up in the
  # committed tokens on the host: a step that samples for a request that drafts is
  # postprocessed before the next is packed, so such steps do not overlap. On by default: it
  # hides the host's part of a step (scheduling, packing, the dispatch), a sizable share of a
  # batch-1 decode step on the CPU (the exposed host time: docs/performance.md).
  async_scheduling: bool = True
  # Expert-parallel load balancing (MoE): None (off), an EplbConfig, a placement file's path
  # (`jaxinfer eplb plan`), or a dict of EplbConfig's fields, e.g. {"num_redundant_experts": 8,
  # "replan_interval": 100} (jaxinfer.models.eplb).
  eplb: EplbConfig | None = None
  # Layers scanned (stacked weights and one KV pool, lax.scan: the step's program and its compile
  # time stay flat in depth) or unrolled. None: the backend's (BACKEND_SCAN_LAYERS). Not with
  # MoE layers, per-layer windows, an MTP module, attention DP or KV transfer (refused).
  scan_layers: bool | None = None
  # Attention DP: prefill held back on a data rank that would run ahead of the others, for at
  # most `timeout` steps a request: a DPBalanceConfig or a dict of its fields, e.g.
  # {"hold_prefill": False} (jaxinfer.engine.scheduler); None: its defaults.
  dp_balance: DPBalanceConfig | None = None

  def __post_init__(self):
    object.__setattr__(self, "speculative", SpeculativeConfig.parse(self.speculative))
    object.__setattr__(self, "dp_balance", DPBalanceConfig.parse(self.dp_balance))
    object.__setattr__(self, "eplb", EplbConfig.parse(self.eplb))
    for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "kv_cache_bytes"):
      v = getattr(self, name)
      optional = name != "page_size"
      if v is None and optional:
        continue
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InvalidRequestError(f"{name} must be a positive int{' or None' if optional else ''}, got {v!r}")
    if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
      raise InvalidRequestError(f"max_model_len must be a positive int, got {self.max_model_len!r}")
    if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 2):
      raise InvalidRequestError(f"num_pages must be an int >= 2, got {self.num_pages!r}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise InvalidRequestError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
    kv_cache_dtype(self.kv_cache_dtype, "float32")  # InvalidRequestError for an unknown name
    if not isinstance(self.async_scheduling, bool):
      raise InvalidRequestError(f"async_scheduling must be a bool, got {self.async_scheduling!r}")
    if self.scan_layers is not None and not isinstance(self.scan_layers, bool):
      raise InvalidRequestError(f"scan_layers must be a bool or None, got {self.scan_layers!r}")


  def for_backend(self, platform: str) -> "EngineConfig":
    """This config with the sizes it leaves to the backend filled in (BACKEND_DEFAULTS)."""
    seqs, tokens = BACKEND_DEFAULTS.get(platform, BACKEND_DEFAULTS["gpu"])
    scan = self.scan_layers if self.scan_layers is not None else BACKEND_SCAN_LAYERS.get(
        platform, BACKEND_SCAN_LAYERS["gpu"])
    return dataclasses.replace(self, max_num_seqs=self.max_num_seqs or seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens or tokens, scan_layers=scan)


# (max_num_seqs, max_num_batched_tokens) by device platform; any other accelerator takes 'gpu''s.
BACKEND_DEFAULTS = {"cpu": (64, 512), "gpu": (256, 8192)}
# The KV pool's default budget where the backend reports no memory (the CPU: host memory is
# shared with everything else on the machine, so a fixed, modest pool).
DEFAULT_KV_BYTES = 1 << 30
# On an accelerator, the share of its allocator's limit the weights and the KV pool may take
# together (vLLM's gpu_memory_utilization is 0.9 of the whole device; jax's allocator limit is
# already 75% of it by default, XLA_PYTHON_CLIENT_MEM_FRACTION): the rest is left to the
# step's activations and XLA's scratch.
KV_MEMORY_FRACTION = 0.85


def kv_budget(memory_stats: Sequence[Mapping[str, int] | None]) -> int:
  """The default KV budget in bytes from the memory stats of the devices the pool lives on
  (`Device.memory_stats()`; None where the backend has none, as the CPU): on each device
  KV_MEMORY_FRACTION of its limit less what is in use, the tightest device's figure (as if the
  pool were not split: under tensor parallelism a smaller pool than would fit, never a larger
  one); DEFAULT_KV_BYTES where some device has no stats."""
  if not memory_stats or any(not m or "bytes_limit" not in m for m in memory_stats):
    return DEFAULT_KV_BYTES
  return max(0, min(int(KV_MEMORY_FRACTION * m["bytes_limit"]) - m.get("bytes_in_use", 0) for m in memory_stats))
# scan_layers by platform. The CPU unrolls: scanned, its step slices each layer's weights out of
# the stack (a copy per layer per step), 1.4x the default model's batch-1 step and 4.5x a
# Llama-3-8B layer's, for compile time flat in depth (benchmarks/results/layers-scan-2026-11-28.json).
# A GPU has not measured it yet: unrolled, as before.
BACKEND_SCAN_LAYERS = {"cpu": False, "gpu": False}


@dataclasses.dataclass
class _Launched:
  """A dispatched step and what its postprocess needs."""

  sched: SchedulerOutput
  seqs: list[ScheduledSeq]
  handle: LaunchedStep
  needs_host_tokens: bool  # a structured-output request sampled: the next mask needs its token


class LLMEngine:
  """Continuous batching over a paged, prefix-cached KV cache."""

  def __init__(self, cfg: ModelConfig, params: Any, tokenizer: Tokenizer | None,
               engine_config: EngineConfig = EngineConfig(), *, mesh=None, sharding_rules=None,
               progress: bool = False, mtp_params: Any = None, model_path: str | Path | None = None):
    """`mtp_params`: the MTP head (jaxinfer.models.mtp) for speculative method 'mtp'; without
    it the head is looked for beside `model_path` and among the shipped heads
    (jaxinfer.checkpoint.mtp_head), and a model with none is an InvalidRequestError."""
    ec = engine_config.for_backend((mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform)
    if ec.speculative is not None and ec.speculative.method == "mtp" and mtp_params is None:
      mtp_params = _find_mtp_head(cfg, params, model_path, mesh)
    self.config = cfg
    self.tokenizer = tokenizer
    self.engine_config = ec
    self.max_model_len = min(cfg.max_position_embeddings, ec.max_model_len or 4096)
    _enable_compilation_cache(ec.compilation_cache_dir)
    kv_dtype = kv_cache_dtype(ec.kv_cache_dtype, model_dtype(params))
    # An MTP module's attention K/V is one more layer in every page.
    cache_spec = CacheSpec.from_config(cfg, kv_dtype, draft_layers=int(mtp_params is not None))
    per_page = cache_spec.page_bytes(ec.page_size)
    pages_per_seq = -(-self.max_model_len // ec.page_size)
    # A pool split along 'pages' (attention data parallelism: sharding_rules={"pages": "data"})
    # is `shards` equal pools, each with its own reserved padding page.
    shards = cache_spec.page_shards(mesh, make_rules(sharding_rules))
    free_note = ""
    if ec.num_pages is None:
      # Enough for max_num_seqs full sequences spread over the shards, and at least one
      # per shard: a sequence lives on one shard, so a pool of many small shards must
      # still hold a max_model_len sequence in each.
      seqs_per_shard = max(1, -(-ec.max_num_seqs // shards))
      budget = ec.kv_cache_bytes
      if budget is None:
        devices = mesh.devices.flat if mesh is not None else jax.devices()[:1]
        # A multi-host job's processes must size the same pool, and each sees only its own
        # devices' memory: no stats there (the fixed default).
        budget = kv_budget([d.memory_stats() for d in devices] if jax.process_count() == 1 else [None])
        if budget != DEFAULT_KV_BYTES:
          free_note = (f" (by default the budget is what the device has free: {budget / 2**30:.2f} GiB; another "
                       f"engine in this process may hold the rest)")
      num_pages = cache_spec.num_pages_for(budget, ec.page_size,
                                           cap=shards * (seqs_per_shard * pages_per_seq + 1))
      num_pages -= num_pages % shards
    else:
      num_pages = ec.num_pages
      if num_pages % shards:
        from jaxinfer.errors import ShardingError
        raise ShardingError(f"num_pages={num_pages} does not split into the {shards} shards the "
                            f"sharding rules give the KV pool's 'pages' axis")
    if num_pages // shards - 1 < pages_per_seq:
      where = f"{num_pages // shards} per shard, " if shards > 1 else ""
      raise InvalidRequestError(
          f"the KV pool ({num_pages} pages of {ec.page_size} tokens, {where}page 0 reserved) cannot hold "
          f"one sequence of max_model_len={self.max_model_len}: give more kv_cache_bytes / "
          f"num_pages or a smaller max_model_len{free_note}")
    self.kv = KVManager(num_pages, ec.page_size, ec.enable_prefix_caching, num_shards=shards)
    self.scheduler = Scheduler(self.kv, ec.max_num_seqs, ec.max_num_batched_tokens,
                               max_model_len=self.max_model_len, dp_balance=ec.dp_balance)
    self.spec = ec.speculative
    self.drafter = make_drafter(self.spec) if self.spec is not None else None
    k = self.spec.num_speculative_tokens if self.spec is not None else 0
    # Per draft position j: drafts proposed there and accepted (acceptance rate by position).
    # spec_proposed[0] counts the sequence-steps that verified drafts.
    self.spec_proposed = np.zeros(k, np.int64)
    self.spec_accepted = np.zeros(k, np.int64)
    # EPLB: the experts laid out by slot; `_rebalance` swaps in re-planned ones between steps.
    params, self.eplb = eplb.setup(ec.eplb, cfg, params, mesh, make_rules(sharding_rules))
    self.runner = ModelRunner(cfg, params, num_pages=num_pages, page_size=ec.page_size,
                              max_num_seqs=ec.max_num_seqs,
                              max_num_batched_tokens=ec.max_num_batched_tokens,
                              max_model_len=self.max_model_len, mesh=mesh, sharding_rules=sharding_rules,
                              attention_impl=ec.attention_impl, num_speculative_tokens=k,
                              mtp_params=mtp_params, kv_cache_dtype=kv_dtype, scan_layers=ec.scan_layers,
                              relaxed_acceptance=self.spec.relaxed if self.spec is not None else None)
    self.kv_cache_dtype = kv_dtype
    self.kv_cache_bytes = num_pages * per_page
    log.info("KV cache: %s", self.kv_summary())
    self.frontend = Frontend(cfg, tokenizer, str(model_path) if model_path is not None else "<params>",
                             self.max_model_len)
    self.eos_ids = self.frontend.eos_ids
    self.grammars = self.frontend.grammars
    self.outputs = OutputProcessor(tokenizer, self.eos_ids, ec.max_num_seqs)
    self._requests: dict[str, Request] = {}
    self._pending: list[RequestOutput] = []  # outputs made between steps (finish_remote_kv)
    self._inflight: _Launched | None = None  # async scheduling: the step the device is running
    self.last_step_idle = False  # the last step() scheduled nothing: only a new command can change that
    self.num_computed_tokens = 0  # tokens run through the model (prefix hits excluded)
    self.num_steps = 0
    # MoE: token copies routed to each expert so far, per MoE layer (load monitoring).
    num_moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    self.expert_tokens = np.zeros((num_moe_layers, max(cfg.num_experts, 1)), np.int64)
    if ec.warmup:
      self.warmup(progress)
    if jax.process_count() > 1 and jax.process_index() == 0:
      # Multi-host: the other processes run this runner's device calls too (jaxinfer.distributed).
      from jaxinfer.distributed import LeaderRunner
      self.runner = LeaderRunner(self.runner)

  def close(self) -> None:
    """Multi-host: releases the followers (their `follow` returns). Single host: nothing."""
    close = getattr(self.runner, "close", None)
    if close is not None:
      close()

  @classmethod
  def from_model(cls, model: str | Path | None = None, dtype: str = "float32",
                 engine_config: EngineConfig = EngineConfig(), *, mesh=None, sharding_rules=None,
                 progress: bool = False, quantization: str | None = None) -> "LLMEngine":
    """Loads a checkpoint (None: the embedded default model) and builds the engine.

    mesh: shard weights and KV cache by their logical axes (jaxinfer.sharding);
    sharding_rules: overrides of jaxinfer.sharding.RULES, e.g. {"kv_heads": None}.
    A model the mesh cannot split as the rules ask is a ShardingError naming the tensor.
    quantization ('int8', 'fp8', 'int4'): linear weights quantized (see jaxinfer.quant)."""
    from jaxinfer.checkpoint import load_model
    from jaxinfer.sharding import param_shardings
    if model is None:
      from jaxinfer.default_model import default_checkpoint
      model = default_checkpoint()
    shardings_fn = None
    if mesh is not None:
      rules = make_rules(sharding_rules)
      shardings_fn = lambda cfg, quantization=None: param_shardings(cfg, mesh, quantization, rules)
    elif sharding_rules:
      from jaxinfer.errors import ShardingError
      raise ShardingError("sharding_rules need a mesh (mesh=jaxinfer.sharding.make_mesh(...))")
    loaded = load_model(model, dtype=dtype, shardings_fn=shardings_fn, quantization=quantization)
    engine = cls(loaded.config, loaded.params, loaded.tokenizer, engine_config, mesh=mesh,
                 sharding_rules=sharding_rules, progress=progress, model_path=model)
    engine.source = engine.frontend.source = loaded.source
    return engine

  def warmup(self, progress: bool = False) -> None:
    """Compiles every step bucket now, so no request waits on XLA later (and freezes the heap:
    `ModelRunner.warmup`)."""
    from tqdm.auto import tqdm
    with tqdm(total=len(self.runner.token_buckets), desc="compiling", unit="program",
              disable=not progress, leave=False) as bar:
      self.runner.warmup(bar)

  # ---- requests ------------------------------------------------------------------------

  def add_request(self, request_id: str, prompt_token_ids: Sequence[int] | ValidRequest,
                  params: SamplingParams | None = None, *, prompt: str | None = None,
                  hold_kv: bool = False, kv_source: str | None = None, stream: bool = True) -> None:
    """Queues a request; raises InvalidRequestError (and queues nothing) on bad input.

    A `ValidRequest` from this engine's `frontend` (ids, params and prompt text checked where
    the request entered) is taken as it is; token ids are checked here, with `params`
    (default: SamplingParams()).

    hold_kv: when it finishes, its pages stay allocated (for `export_kv`) until `release_kv`.
    kv_source: for a KV connector that imports prompts' KV, the worker to import it from
    (the connector checks it); None: the connector chooses.
    stream: `step()` returns this request's output after every step that produced tokens;
    False: only its final output (what `LLM.generate` reads; each step skips making it).
    """
    if request_id in self._requests or request_id in self.scheduler.held:
      raise InvalidRequestError(f"request id {request_id!r} is already in use")
    if isinstance(prompt_token_ids, ValidRequest) and params not in (None, prompt_token_ids.params):
      raise InvalidRequestError("add_request: a ValidRequest carries its own sampling params")
    valid = self.frontend.validate(prompt_token_ids, params if params is not None else SamplingParams(), prompt)
    ids, params, prompt = valid.prompt_token_ids, valid.params, valid.prompt
    seed = params.seed if params.seed is not None else secrets.randbits(32)
    req = Request(request_id, ids, params, seed, prompt=prompt, hold_kv=hold_kv, kv_source=kv_source)
    self.outputs.start(req, self.grammars.matcher(params.structured) if params.structured is not None else None,
                       stream=stream)
    self._requests[request_id] = req
    self.scheduler.add(req)

  def abort(self, request_id: str) -> RequestOutput | None:
    """Ends a request now and frees its pages; returns its final output (None if unknown)."""
    req = self._requests.get(request_id)
    if req is None:
      return None
    self._finish(req, "abort")
    return self.outputs.output(req)

  def has_unfinished(self) -> bool:
    """Whether a step() has anything left to do for a request. A step in flight whose requests
    have all ended (aborted meanwhile) is not: its work is dropped whenever the next step()
    collects it, and the pool it writes to is reused only by steps that run after it."""
    inflight = self._inflight is not None and any(r.finish_reason is None for r, _ in self._inflight.sched.scheduled)
    return self.scheduler.has_unfinished() or bool(self._pending) or inflight

  # ---- KV transfer (disaggregation) -----------------------------------------------------

  def set_kv_connector(self, connector: KVConnector | None) -> None:
    """Requests admitted from now on ask `connector` whether their prompt KV comes from elsewhere."""
    self.scheduler.connector = connector

  def kv_layout(self):
    """The wire layout of this engine's KV pages (derived from the runner's cache spec)."""
    return self.runner.kv_layout()

  def export_kv(self, request_id: str, first_page: int, num_pages: int) -> list[dict[str, np.ndarray]]:
    """Host copies of pages [first_page, first_page + num_pages) of a running or held request."""
    pages = self.kv.pages(request_id)
    if request_id not in self.scheduler.held and request_id not in self._requests:
      raise KVTransferError(f"request {request_id!r} holds no KV pages (released, or never added)")
    if not 0 <= first_page <= first_page + num_pages <= len(pages):
      raise KVTransferError(f"pages [{first_page}, {first_page + num_pages}) are outside request "
                            f"{request_id!r}'s {len(pages)} pages")
    return self.runner.export_pages(pages[first_page:first_page + num_pages])

  def release_kv(self, request_id: str) -> bool:
    """Ends a hold_kv request wherever it is (aborted if still running) and frees its
    pages. True if it held any; releasing an unknown or released id does nothing."""
    req = self._requests.get(request_id)
    if req is not None:
      req.hold_kv = False
      self._finish(req, "abort")
      return True
    return self.scheduler.release_held(request_id)

  def _waiting_for_kv(self, request_id: str) -> Request:
    req = self.scheduler.waiting_for_kv.get(request_id)
    if req is None:
      raise KVTransferError(f"request {request_id!r} is not waiting for remote KV (aborted or finished)")
    return req

  def import_kv(self, request_id: str, first_page: int, arrays: Sequence[dict[str, np.ndarray]]) -> None:
    """Writes remote pages into the request's pages from its page index `first_page` on.

    Only pages that the remote tokens cover may be written: never a prefix-cache hit
    (shared with other requests), never past the request's allocation."""
    req = self._waiting_for_kv(request_id)
    pages = self.kv.pages(request_id)
    ps = self.kv.page_size
    n = self.runner.num_import_pages(arrays)
    lo, hi = req.num_computed // ps, -(-(req.num_computed + req.num_remote_tokens) // ps)
    if not lo <= first_page <= first_page + n <= hi:
      raise KVTransferError(f"request {request_id!r}: pages [{first_page}, {first_page + n}) are not "
                            f"among the pages its remote tokens fill, [{lo}, {hi})")
    self.runner.import_pages(pages[first_page:first_page + n], arrays)

  def export_kv_tokens(self, request_id: str, start: int, num_tokens: int) -> list[dict[str, np.ndarray]]:
    """Tokens [start, start + num_tokens) of a running or held request's KV, token-major
    (per layer {name: [num_tokens, ...]}): what a worker with any page size can import."""
    if request_id not in self.scheduler.held and request_id not in self._requests:
      raise KVTransferError(f"request {request_id!r} holds no KV pages (released, or never added)")
    return self.runner.export_tokens(self.kv.pages(request_id), start, num_tokens)

  def import_kv_tokens(self, request_id: str, start: int, runs: Sequence[dict[str, np.ndarray]]) -> None:
    """Writes remote tokens [start, start + T) (as `export_kv_tokens` returns them, from a
    worker of any page size) into the request's pages. Only its remote tokens may be written."""
    req = self._waiting_for_kv(request_id)
    first, last = req.num_computed, req.num_computed + req.num_remote_tokens
    runs = self.runner.cache_spec.check_transfer(runs, page_major=False)  # KVTransferError if malformed
    T = self.runner.cache_spec.num_transfer_tokens(runs, page_major=False)
    if not first <= start <= start + T <= last:
      raise KVTransferError(f"request {request_id!r}: tokens [{start}, {start + T}) are not among "
                            f"its remote tokens [{first}, {last})")
    self.runner.import_tokens(self.kv.pages(request_id), start, runs)

  def finish_remote_kv(self, request_id: str, first_token: int | None = None, logprob: float = 0.0,
                       top: dict[int, float] | None = None, remote_cached_tokens: int = 0) -> None:
    """The request's remote KV is imported: it runs from the next step on.
    `remote_cached_tokens`: of its prompt, what the remote worker had in its prefix
    cache (reported in the outputs, for a router's cache accounting).

    With `first_token` (the token the remote worker sampled after the prompt, its
    logprob and top logprobs) the token is committed here as if sampled here: stop
    checks, grammar and detokenization included; its output comes with the next
    `step()`. Without, the remote tokens must leave at least one to compute here."""
    req = self._waiting_for_kv(request_id)
    req.num_remote_cached_tokens = remote_cached_tokens
    if first_token is None and req.num_computed + req.num_remote_tokens >= len(req.token_ids):
      raise KVTransferError(f"request {request_id!r}: every token's KV is remote, so the remote "
                            f"worker must send the first token")
    if first_token is not None:
      self.frontend.check_token_ids([first_token])
    self.scheduler.kv_arrived(req)
    if first_token is None:
      return
    top = top or {}
    top_ids = np.array(list(top), np.int64)
    top_lps = np.array(list(top.values()), np.float64)
    try:
      reason = self.outputs.commit_one(req, int(first_token), float(logprob), top_ids, top_lps)
      if reason is not None:
        self._finish(req, reason)
      if req.output.stream or reason is not None:
        self._pending.append(self.outputs.output(req))
    except Exception as e:  # like a step's postprocessing: this request fails, nobody else
      log.exception("request %s failed", request_id)
      self._pending.append(self._fail(req, e))

  @property
  def num_unfinished(self) -> int:
    return len(self._requests)

  def kv_events(self) -> list[KVEvent]:
    """Prefix-cache 'stored' / 'removed' events since the last call."""
    return self.kv.drain_events()

  # ---- the step ----------------------------------------------------------------------

  def step(self) -> list[RequestOutput]:
    """Runs one engine step; returns an output for every request that finished, and for
    every streaming one (`add_request(stream=True)`, the default) that produced tokens.

    With `async_scheduling`, the step launched here runs on the device while the host
    postprocesses the one the previous call launched (detokenization and stop checks one
    step behind): a request's output comes one call later, and a request that stopped
    (EOS, stop string) has run one more step, whose work is dropped."""
    outputs, self._pending = self._pending, []
    inflight, self._inflight = self._inflight, None
    if inflight is not None and inflight.needs_host_tokens:
      outputs += self._postprocess(inflight)  # grammar masks and n-gram drafts need its tokens
      inflight = None
    if self.drafter is not None:
      self._propose_drafts()
    self._rebalance()
    sched, launched, error = self._launch()
    if inflight is not None:
      outputs += self._postprocess(inflight)
    if error is not None:  # after the step before it: its tokens are committed first
      log.error("engine step failed (%d requests)", len(sched.scheduled), exc_info=error)
      outputs += self._fail_step([req for req, _ in sched.scheduled if req.finish_reason is None], error)
    if launched is not None and self.engine_config.async_scheduling:
      self._inflight = launched
    elif launched is not None:
      outputs += self._postprocess(launched)
    # Idle: nothing ran and a preemption cannot admit anyone next time; only a new command can change that.
    self.last_step_idle = not sched.scheduled and not sched.preempted and inflight is None
    return outputs

  def _rebalance(self) -> None:
    """EPLB online re-planning, between steps: when due, the expert weights re-laid out from the
    recent counts are swapped in whole (built before the swap; a step in flight keeps the
    arrays it was launched with)."""
    if self.eplb is None:
      return
    params = self.eplb.maybe_replan(self.runner.params)
    if params is not None:
      self.runner.params = params

  def _launch(self) -> tuple[SchedulerOutput, "_Launched | None", Exception | None]:
    """Schedules and dispatches a step (the device runs it while the host goes on); a
    failure to launch is returned, and ends the step's requests (the engine goes on)."""
    sched = self.scheduler.schedule()
    if not sched.scheduled:
      return sched, None, None
    seqs = []
    pages, wants_prompt_logprobs = self.kv.pages, self.outputs.wants_prompt_logprobs
    for (req, n), start, drafts in zip(sched.scheduled, sched.starts, sched.drafts):
      if req.needs_history:
        self.runner.set_history(req.row, req.prompt_token_ids, req.output_token_ids)
        req.needs_history = False
      # (The start is what the scheduler saw, before the step counted as computed; a start
      # at the end of the known tokens feeds the token in flight.)
      seqs.append(ScheduledSeq(
          row=req.row, token_ids=req.token_ids, start=start, num_new=n, pages=pages(req.request_id),
          params=req.params, seed=req.seed,
          want_prompt_logprobs=req.output.prompt_lp is not None and wants_prompt_logprobs(req, start),
          draft_ids=drafts, grammar=req.output.grammar, feed=start == len(req.token_ids)))
    try:
      handle = self.runner.launch(seqs)
    except Exception as e:
      return sched, None, e
    self.num_steps += 1
    self.num_computed_tokens += sched.num_tokens
    # Grammar masks and n-gram drafts for the next step are made from this step's tokens.
    ngram = self.spec is not None and self.spec.method == "ngram"
    needs_host = any((s.grammar is not None or (ngram and _speculates(s.params))) and s.samples
                     for s in seqs)
    return sched, _Launched(sched, seqs, handle, needs_host), None

  def _postprocess(self, launched: "_Launched") -> list[RequestOutput]:
    """Waits for a launched step; the scheduler settles its progress, the output processor
    commits its tokens (stop checks, detokenization), and a finished request ends."""
    sched, seqs = launched.sched, launched.seqs
    try:
      result = self.runner.collect(launched.handle)
    except Exception as e:
      self.scheduler.update_from_output(sched)
      log.exception("engine step failed (%d requests)", len(seqs))
      return self._fail_step([req for req, _ in sched.scheduled if req.finish_reason is None], e)
    if self.expert_tokens.size:
      self.expert_tokens += result.expert_tokens
      if self.eplb is not None:
        self.eplb.observe(result.expert_tokens)
    # Python lists once: per-element numpy reads cost ~100 ns each, per token per request.
    ids, logprobs, committed = result.ids.tolist(), result.logprobs.tolist(), result.num_committed.tolist()
    accepted = self.scheduler.update_from_output(sched, ids, committed)
    outputs = []
    prompt_lp = result.prompt is not None
    mtp_drafts = result.drafts is not None and result.drafts.shape[1] > 0
    reqs = list(map(_FIRST, sched.scheduled))
    # Rows that verified drafts count acceptance; a step with prompt logprobs or MTP drafts
    # to record goes the per-request way whole.
    eligible = not (prompt_lp or mtp_drafts)
    if eligible and self.spec is not None:
      eligible = np.fromiter(map(len, sched.drafts), np.int64, len(reqs)) == 0
    slow = self.outputs.commit_plain(reqs, sched.rows, sched.row_gens, self.scheduler.row_gen, result.ids,
                                     result.logprobs, result.num_committed, eligible)
    starts = np.cumsum([0] + [n for _, n in sched.scheduled]) if prompt_lp else None
    commit, output = self.outputs.commit, self.outputs.output
    for i in slow.tolist():
      req, n = sched.scheduled[i]
      try:
        if req.finish_reason is not None:
          continue  # ended (stop, abort) while this step ran: its work is dropped
        seq = seqs[i]
        if prompt_lp and seq.want_prompt_logprobs:
          t = starts[i]
          self.outputs.add_prompt_logprobs(req, seq.start, seq.num_new, *(a[t:t + n] for a in result.prompt))
        if seq.draft_ids:
          self._count_acceptance(len(seq.draft_ids), len(accepted[i]))
        c = committed[i]  # 0 for a partial prefill chunk
        if c:
          reason = commit(req, ids[i], logprobs[i], result.top_ids, result.top_logprobs, c, len(accepted[i]), i)
          if reason is not None:
            self._finish(req, reason)
            outputs.append(output(req))
          elif req.output.stream:
            outputs.append(output(req))
          if mtp_drafts and req.finish_reason is None:
            # MTP: drafted on device for exactly the tokens committed now (spec_decode.MtpDrafter).
            self.drafter.record(req.request_id, len(req.token_ids), result.drafts[i].tolist())
      except Exception as e:  # one request's failure must not end the others
        log.exception("request %s failed", req.request_id)
        outputs.append(self._fail(req, e))
    return outputs

  def _propose_drafts(self) -> None:
    """Drafts for the next step, for each running request that has caught up.

    Async scheduling: a request whose newest token is still on the device (in the step in
    flight) gets placeholders; the step reads the MTP drafts the step in flight made for it
    (runner._feed). How many drafts that step accepts is unknown here, so the room left by
    max_tokens assumes none (the output processor cuts a run past max_tokens), and the room left by
    max_model_len assumes all."""
    k = self.spec.num_speculative_tokens
    for req in self.scheduler.running:
      req.spec_token_ids = []
      if req.num_uncomputed != 1 or not _speculates(req.params):
        continue
      # Never draft past max_tokens: the bonus token needs one slot of its own.
      room = min(k, req.params.max_tokens - req.num_output_tokens - req.num_inflight - 1)
      if req.num_inflight:
        room = min(room, self.max_model_len - 1 - req.num_computed - req.num_inflight_drafts)
        req.spec_token_ids = [0] * max(room, 0)
      elif room > 0:
        if self.spec.method == "mtp":
          drafts = self.drafter.take(req.request_id, req.token_ids, room)
        else:
          drafts = self.drafter.propose(req.token_ids, room)
        grammar = req.output.grammar
        if grammar is not None:  # the first draft the grammar rejects could never be accepted
          drafts = drafts[:grammar.valid_prefix(drafts)]
        req.spec_token_ids = drafts

  def _count_acceptance(self, proposed: int, accepted: int) -> None:
    """(Called for sequences with drafts only: numpy's += on an empty slice still costs
    ~10 us, per request per step.)"""
    self.spec_proposed[:proposed] += 1
    self.spec_accepted[:accepted] += 1

  def _fail(self, req: Request, exc: BaseException) -> RequestOutput:
    """Ends `req` with finish_reason 'error' (its pages are freed) and says why."""
    self._finish(req, "error")
    out = self.outputs.output(req)
    out.error = f"{type(exc).__name__}: {exc}"
    return out

  def _fail_step(self, reqs: list[Request], exc: BaseException) -> list[RequestOutput]:
    """A failed device step ends its requests. If it also lost the donated KV
    cache, every running request's KV is gone: those end too, and the device
    state and the prefix cache start afresh."""
    outputs = [self._fail(req, exc) for req in reqs]
    if self.runner.state_lost():
      outputs += [self._fail(req, exc) for req in list(self.scheduler.running)]
      # Imported and held pages are gone too: their transfers must fail, not move zeros.
      outputs += [self._fail(req, exc) for req in list(self.scheduler.waiting_for_kv.values())]
      for rid in list(self.scheduler.held):
        self.scheduler.release_held(rid)
      self.runner.reset_state()
      self.kv.reset_prefix_cache()
    return outputs

  def _finish(self, req: Request, reason: str) -> None:
    """Ends a request: pages and sampler row freed, the engine forgets it, its matcher goes."""
    if self.spec is not None and self.spec.method == "mtp":
      self.drafter.forget(req.request_id)
    self.scheduler.finish(req, reason)
    self._requests.pop(req.request_id, None)
    req.output.grammar = None

  # ---- introspection -----------------------------------------------------------------

  def kv_summary(self) -> str:
    """The pool in one line: pages, bytes, dtype, and how many tokens and max_model_len
    sequences it holds (page 0 of each shard is reserved)."""
    p = self.engine_config.page_size
    tokens = (self.kv.num_pages - self.kv.num_shards) * p
    per_token = self.runner.cache_spec.bytes_per_token()
    scales = ", scales included" if self.runner.cache_spec.quantized else ""
    return (f"{self.kv.num_pages} pages x {p} tokens = {self.kv_cache_bytes / 2**20:.1f} MiB of "
            f"{self.kv_cache_dtype} ({per_token} bytes per token{scales}): {tokens} tokens, "
            f"{tokens // self.max_model_len} sequences of {self.max_model_len}")

  def stats(self) -> dict[str, Any]:
    kv = self.kv
    return {
        "running": len(self.scheduler.running),
        "waiting": len(self.scheduler.waiting),
        "kv_usage": kv.usage,
        "kv_free_pages": kv.num_free_pages,
        "kv_held_requests": len(self.scheduler.held),  # finished, pages kept for a transfer
        "kv_waiting_for_remote": len(self.scheduler.waiting_for_kv),
        "prefix_hit_rate": kv.hit_tokens / kv.queried_tokens if kv.queried_tokens else 0.0,
        "preemptions": self.scheduler.num_preemptions,
        "computed_tokens": self.num_computed_tokens,
        "generated_tokens": self.outputs.num_generated_tokens,
        "steps": self.num_steps,
        "compiled_programs": self.runner.compiled_programs(),
        **self._spec_stats(),
        **self._moe_stats(),
        **self._dp_stats(),
    }

  def _dp_stats(self) -> dict[str, Any]:
    """Attention DP: the last step's scheduled tokens per data rank and their imbalance
    (the busiest rank's over the mean; every rank's step is padded to the busiest's)."""
    if self.kv.num_shards == 1:
      return {}
    return {"dp_rank_tokens": list(self.scheduler.rank_tokens), "dp_rank_imbalance": self.scheduler.rank_imbalance}

  def _moe_stats(self) -> dict[str, Any]:
    """MoE models: routed token copies, the worst layer's expert imbalance (its busiest
    expert's tokens over the mean; 1.0 is perfectly even) and tokens per expert summed over
    the MoE layers. Per layer: `self.expert_tokens` [MoE layers, E]."""
    if not self.expert_tokens.size:
      return {}
    per_layer = self.expert_tokens
    mean = per_layer.mean(axis=1)
    imbalance = float(np.max(np.where(mean > 0, per_layer.max(axis=1) / np.maximum(mean, 1e-9), 0.0)))
    stats = {"moe_routed_tokens": int(per_layer.sum()), "moe_expert_imbalance": imbalance,
             "moe_expert_tokens": per_layer.sum(axis=0).tolist()}
    if self.eplb is not None:
      stats.update(eplb_slots=self.eplb.placement.num_slots, eplb_replans=self.eplb.replans,
                   eplb_replan_seconds=self.eplb.replan_seconds)
    return stats

  def _spec_stats(self) -> dict[str, float]:
    """Speculative decoding: mean committed tokens per verifying sequence-step
    (accepted drafts + 1), and the acceptance rate at each draft position."""
    if self.spec is None:
      return {}
    n = int(self.spec_proposed[0])  # sequence-steps that verified drafts
    stats = {"spec_verify_steps": n, "spec_draft_tokens": int(self.spec_proposed.sum()),
             "spec_accepted_tokens": int(self.spec_accepted.sum()),
             "spec_mean_acceptance_length": float(1 + self.spec_accepted.sum() / n) if n else 0.0}
    for j, (p, a) in enumerate(zip(self.spec_proposed, self.spec_accepted)):
      stats[f"spec_acceptance_rate_{j + 1}"] = float(a / p) if p else 0.0
    return stats


def _find_mtp_head(cfg: ModelConfig, params: Any, model_path: str | Path | None, mesh=None) -> Any:
  """The MTP head for this model (device arrays in the params' dtype), or InvalidRequestError
  saying how to train one."""
  from jaxinfer.checkpoint.mtp_head import find_mtp_head
  from jaxinfer.engine.spec_decode import TRAIN_MTP_COMMAND
  found = find_mtp_head(model_path, cfg)
  if found is None:
    model = model_path if model_path is not None else "<checkpoint>"
    raise InvalidRequestError(
        f"speculative method 'mtp' needs an MTP head and model {cfg.name or cfg.architecture!r} has none "
        f"(no DeepSeek MTP layer, nothing beside the checkpoint, none shipped); train one with: "
        f"{TRAIN_MTP_COMMAND.format(model=model)} (or use method='ngram')")
  source, weights = found
  log.info("MTP head from %s", source)
  dtype = model_dtype(params)
  weights = jax.tree.map(lambda a: np.asarray(a).astype(dtype), weights)
  if mesh is None:
    return jax.device_put(weights, jax.devices()[0])
  # One block: replicated on every device of the mesh, beside the sharded model.
  return jax.device_put(weights, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


_FIRST = operator.itemgetter(0)


def _speculates(params: SamplingParams) -> bool:
  """Whether a request gets drafts. Penalties would need each verified row to see the
  drafts before it in its history; such requests decode without speculation."""
  return not params.uses_penalties


def _enable_compilation_cache(path: str | None) -> None:
  """Turns on JAX's persistent compilation cache (restarts skip XLA compiles)."""
  if path == "":
    return
  if jax.config.jax_compilation_cache_dir:
    return  # the user configured it
  path = path or os.environ.get("JAXINFER_COMPILATION_CACHE",
                                str(Path.home() / ".cache" / "jaxinfer" / "xla"))
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
