"""The KV-aware router: one `jaxinfer.v1.Inference` endpoint (and optionally the
OpenAI HTTP API) in front of several `jaxinfer serve` workers of one model.

    jaxinfer serve --model M --port 50061 &   jaxinfer serve --model M --port 50062 &
    jaxinfer route --model M --workers 127.0.0.1:50061,127.0.0.1:50062 --port 50051

`RouterBackend` implements the `Backend` contract (backend.py), so the same
gRPC servicer and HTTP app serve it. Per request it

  1. tokenizes and validates with the model's tokenizer and config, loaded
     without weights (`jaxinfer.frontend.Frontend`): a request a worker would refuse is
     refused here with the worker's INVALID_ARGUMENT message, never forwarded;
  2. picks a worker: `KVRouter.select` over the chain of block hashes of the
     prompt (the workers' own `hash_blocks`, so a hash names the same prefix
     everywhere), or round-robin with `policy="round_robin"`;
  3. forwards the token ids to it as a streaming Generate and relays the
     responses (cancelling the client's call cancels the worker's).

The index (`KVRouter.index`) is fed by each worker's `jaxinfer.v1.KVEvents`
stream: a snapshot, then numbered batches; a gap or a broken stream means
subscribing again (a fresh snapshot). At start every worker must be SERVING
and serve the same model (GetModelInfo: architecture, vocab_size,
max_model_len, page_size, eos_token_ids), else start fails naming the worker
and the field. Health is checked every `health_interval_s`; a worker that
fails a check, or whose call fails with UNAVAILABLE, gets no new requests
until a check says SERVING again. A request whose worker fails before its
first token is retried on another; after it, the client gets UNAVAILABLE.
Likewise a worker that answers RESOURCE_EXHAUSTED (its admission limits are
full) before the first token: the request goes to another worker it has not
tried (the busy one stays up for other requests); only when every worker
has refused does the client get RESOURCE_EXHAUSTED.

Disaggregated mode (`--prefill-workers P1,P2 --decode-workers D1,D2`, instead
of `--workers`): the index follows the prefill workers' KV events, so step 2
picks the prefill worker by cached overlap (KVRouter over the prefill
workers) and the decode worker by load (fewest requests, then prompt blocks,
in flight through this router); the Generate goes to the decode worker with
the prefill worker's address in its `x-jaxinfer-prefill-worker` metadata
(server.PREFILL_WORKER_METADATA), and the decode worker takes the prompt's KV
from there. At start every decode worker must say (GetModelInfo: role,
prefill_workers) that it is a decode worker whose --prefill-workers include
every one of the router's, else start fails naming both. A prefill worker's
load is charged until the request's first token (its part is done then).
A prefill that fails before the first token (the decode worker answers
UNAVAILABLE or RESOURCE_EXHAUSTED naming its prefill worker) is tried again
on another prefill worker, through the same or another decode worker.

Addresses may be `dns:HOST:PORT`: expanded to every address HOST resolves
to (`expand_addresses`; a Kubernetes headless Service names its pods this
way). Aggregated (`--workers`), the set can change while the router runs:
with `resolve_interval_s` > 0 the entries (and the lines of `workers_file`)
are resolved again that often (`named_workers`). A new address joins once
it is SERVING the same model (same checks as at start); a gone one leaves at
once: no new request goes to it and its index entries are dropped, while its
in-flight streams go on to their end on its still-open channel (closed after
the last). An empty or unresolvable answer keeps the current set (a DNS
hiccup must not empty the router). The disaggregated sets are fixed at start.

Everything runs on the serving asyncio loop (grpc.aio channels); no threads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import socket
import time
import uuid
from pathlib import Path
from typing import Collection, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxinfer.engine.engine import RequestOutput
from jaxinfer.engine.kv_manager import KVEvent, hash_blocks
from jaxinfer.errors import InvalidRequestError, JaxinferError, TokenizerError
from jaxinfer.frontend import Frontend
from jaxinfer.sampling import SamplingParams
from jaxinfer.serving.backend import ModelInfo, Overloaded, PromptMixin, RequestFailed, Unavailable, Usage, \
    rejection_code
from jaxinfer.serving.convert import FINISH_REASON_NAMES, sampling_to_proto
from jaxinfer.serving.kv_router import KVRouter, RouterConfig, SequenceGap
from jaxinfer.serving.proto import inference_pb2 as pb
from jaxinfer.serving.proto import inference_pb2_grpc as pb_grpc
from jaxinfer.serving.proto import kv_events_pb2 as kv_pb
from jaxinfer.serving.proto import kv_events_pb2_grpc as kv_pb_grpc
from jaxinfer.serving.server import PREFILL_WORKER_METADATA

log = logging.getLogger(__name__)

POLICIES = ("kv", "round_robin")
_KINDS = {kv_pb.KVEvent.STORED: "stored", kv_pb.KVEvent.REMOVED: "removed"}


class RouterMetrics:
  """The router's registry: the rejection counter both adapters share, plus routing."""

  def __init__(self):
    r = self.registry = CollectorRegistry()
    self.rejected_requests = Counter("jaxinfer_rejected_requests",
                                     "Requests refused before reaching a worker, by status "
                                     "(gRPC's names, whichever transport refused).", ["code"], registry=r)
    self.routed_requests = Counter(
        "jaxinfer_router_routed_requests", "Requests sent to each worker, by the worker's part in them: "
        "both (aggregated), or prefill and decode (a disaggregated request counts on one of each).",
        ["worker", "role"], registry=r)
    self.retried_requests = Counter("jaxinfer_router_retried_requests",
                                    "Requests sent again elsewhere after this worker failed before "
                                    "their first token.", ["worker"], registry=r)
    self.predicted_cached_tokens = Counter(
        "jaxinfer_router_predicted_cached_tokens",
        "Prompt tokens the router's index expected the chosen worker (disaggregated: the prefill "
        "worker) to have cached.", ["worker"], registry=r)
    self.actual_cached_tokens = Counter(
        "jaxinfer_router_actual_cached_tokens",
        "Prompt tokens the worker reported served by its prefix cache (usage.cached_tokens; "
        "disaggregated: the prefill worker's, as the decode worker relays it).", ["worker"], registry=r)
    self.decision_time = Histogram(
        "jaxinfer_router_decision_seconds", "Hashing the prompt and choosing a worker.",
        buckets=(1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2), registry=r)
    self.time_to_first_token = Histogram(
        "jaxinfer_time_to_first_token_seconds", "Request arrival at the router to its first token.",
        buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                 30.0, 60.0, 120.0), registry=r)
    self.worker_up = Gauge("jaxinfer_router_worker_up", "1 while the worker gets requests.", ["worker"],
                           registry=r)
    self.kv_resyncs = Counter("jaxinfer_router_kv_resyncs",
                              "KV event subscriptions (re)started from a snapshot.", ["worker"], registry=r)
    self.kv_event_batch = Gauge("jaxinfer_router_kv_event_batch",
                                "The worker's latest KV event batch (its sequence number) in the router's "
                                "index: the index is current up to it.", ["worker"], registry=r)

  def exposition(self) -> bytes:
    return generate_latest(self.registry)


def named_workers(entries: Sequence[str], workers_file: str | None = None) -> tuple[str, ...]:
  """The worker addresses named now: `entries` (--workers) then the lines of `workers_file`
  (comma- or line-separated; blank lines and # comments skipped), dns: ones resolved, without
  repeats. OSError if the file cannot be read, InvalidRequestError for an entry that does not
  resolve."""
  named = list(expand_addresses(entries, "--workers"))
  if workers_file is not None:
    listed = [a.strip() for line in Path(workers_file).read_text().splitlines()
              for a in line.split("#")[0].split(",") if a.strip()]
    named += expand_addresses(listed, "--workers-file")
  return tuple(dict.fromkeys(named))


def expand_addresses(addresses: Sequence[str], what: str = "workers") -> tuple[str, ...]:
  """HOST:PORT entries as given; each `dns:HOST:PORT` replaced by IP:PORT for every
  address HOST resolves to now (socket.getaddrinfo), in its order, without repeats.
  Resolved once: a router started from a headless Service sees the pods of that moment."""
  out: list[str] = []
  for a in addresses:
    if not a.startswith("dns:"):
      out.append(a)
      continue
    host, sep, port = a[len("dns:"):].rpartition(":")
    if not sep or not host or not port.isdigit():
      raise InvalidRequestError(f"{what}: {a!r} is not dns:HOST:PORT")
    try:
      infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
      raise InvalidRequestError(f"{what}: {a!r}: {host} does not resolve ({e})") from None
    for family, _, _, _, sockaddr in infos:
      ip = sockaddr[0]
      address = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
      if address not in out:
        out.append(address)
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class RouterOptions:
  """Aggregated: `workers`. Disaggregated: `prefill_workers` and `decode_workers`
  (requests go to a decode worker, naming the prefill worker it takes the KV from)."""

  workers: tuple[str, ...] = ()
  prefill_workers: tuple[str, ...] = ()
  decode_workers: tuple[str, ...] = ()
  policy: str = "kv"
  overlap_weight: float = 1.0
  request_weight: float = 0.0
  temperature: float = 0.0
  health_interval_s: float = 1.0
  connect_timeout_s: float = 120.0  # start: how long each worker may take to turn SERVING
  # Aggregated only: re-read the workers from `worker_entries` (as given: HOST:PORT or
  # dns:HOST:PORT) and `workers_file` every resolve_interval_s (0: the set is fixed).
  worker_entries: tuple[str, ...] = ()
  workers_file: str | None = None
  resolve_interval_s: float = 0.0

  def __post_init__(self):
    if self.disaggregated:
      if self.workers:
        raise InvalidRequestError(
            "workers: give --workers (aggregated: each worker serves whole requests) or --prefill-workers "
            f"with --decode-workers (disaggregated), not both (workers={list(self.workers)})")
      for name in ("prefill_workers", "decode_workers"):
        if not getattr(self, name):
          raise InvalidRequestError(f"{name}: a disaggregated router needs at least one prefill and one "
                                    f"decode worker (prefill_workers={list(self.prefill_workers)}, "
                                    f"decode_workers={list(self.decode_workers)})")
    elif not self.workers:
      raise InvalidRequestError("workers: give at least one worker address (or --prefill-workers and "
                                "--decode-workers)")
    every = self.all_workers
    for a in every:
      if every.count(a) > 1:
        raise InvalidRequestError(f"workers: {a} is given twice (workers={list(self.workers)}, prefill_workers="
                                  f"{list(self.prefill_workers)}, decode_workers={list(self.decode_workers)})")
    if self.policy not in POLICIES:
      raise InvalidRequestError(f"policy must be one of {POLICIES}, got {self.policy!r}")
    for name in ("health_interval_s", "connect_timeout_s"):
      if not getattr(self, name) > 0:
        raise InvalidRequestError(f"{name} must be > 0, got {getattr(self, name)!r}")
    if not self.resolve_interval_s >= 0:
      raise InvalidRequestError(f"resolve_interval_s must be >= 0, got {self.resolve_interval_s!r}")
    if self.resolve_interval_s and self.disaggregated:
      raise InvalidRequestError("resolve_interval_s: only --workers (aggregated) can change while the router "
                                "runs; the prefill and decode workers are fixed at start")
    if self.resolve_interval_s and not (self.worker_entries or self.workers_file):
      raise InvalidRequestError("resolve_interval_s: give worker_entries or workers_file to re-read")

  @property
  def disaggregated(self) -> bool:
    return bool(self.prefill_workers or self.decode_workers)

  @property
  def all_workers(self) -> tuple[str, ...]:
    return (*self.workers, *self.prefill_workers, *self.decode_workers)

  @property
  def kv_workers(self) -> tuple[str, ...]:
    """Whose KV events feed the index (and who is picked by cached overlap)."""
    return self.prefill_workers if self.disaggregated else self.workers

  @property
  def generate_workers(self) -> tuple[str, ...]:
    """Who gets the Generate calls."""
    return self.decode_workers if self.disaggregated else self.workers


class _Worker:
  def __init__(self, address: str):
    self.address = address
    self.channel = grpc.aio.insecure_channel(address)
    self.stub = pb_grpc.InferenceStub(self.channel)
    self.health = health_pb2_grpc.HealthStub(self.channel)
    self.kv = kv_pb_grpc.KVEventsStub(self.channel)
    self.info: pb.ModelInfo | None = None


@dataclasses.dataclass
class _Route:
  """Where one attempt of a request went, and what it is charged."""

  worker: str  # the Generate call's worker (disaggregated: the decode worker)
  prefill: str | None  # disaggregated: the prefill worker named in the call's metadata
  blocks: float  # prompt blocks charged to each
  prefill_charged: bool = True  # until the first token: the prefill worker's part is done then
  # The worker's channel when routed: a worker that left (and perhaps came back under the
  # same address) is not charged the end of a request its earlier membership started.
  member: "_Worker | None" = None


class RouterGeneration:
  """One forwarded request: a `Generation` whose outputs come from a worker's stream."""

  def __init__(self, backend: "RouterBackend", request_id: str, prompt: str | None, ids: list[int],
               params: SamplingParams):
    self._b, self.request_id, self._params = backend, request_id, params
    self._request = pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=ids),
                                       sampling=sampling_to_proto(params), stream=True)
    self._out = RequestOutput(request_id, prompt, ids, "", [], [],
                              top_logprobs=[] if params.logprobs is not None else None,
                              prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
    self.arrival = time.monotonic()
    self.first_token_at: float | None = None
    self.last_token_at: float | None = None
    self.finished = False
    self._closed = False
    self._shutdown: Unavailable | None = None
    self._call = None
    self._route: _Route | None = None
    self._tried: set[str] = set()  # workers that failed or refused this request before its first token

  # ---- the worker call -------------------------------------------------------------

  def _dispatch(self) -> None:
    """Starts the call on the best live worker(s) (Unavailable if none is)."""
    route = self._route = self._b.choose(self._request.token_ids.ids, exclude=self._tried)
    metadata = ((PREFILL_WORKER_METADATA, route.prefill),) if route.prefill is not None else None
    self._call = route.member.stub.Generate(self._request, metadata=metadata)

  def _release(self) -> None:
    if self._route is not None:
      self._b.release(self._route)
      self._route = None
    if self._call is not None:
      self._call.cancel()  # a no-op once it ended; otherwise frees the worker's pages

  def __aiter__(self) -> "RouterGeneration":
    return self

  async def __anext__(self) -> RequestOutput:
    while True:
      if self.finished or self._closed:
        raise StopAsyncIteration
      route = self._route
      try:
        r = await self._call.read()
      except asyncio.CancelledError:
        if self._shutdown is None:
          raise  # our caller was cancelled (client gone): __aexit__ cancels the worker's call
        self.close()
        raise self._shutdown from None
      except grpc.aio.AioRpcError as e:
        if self._shutdown is not None:
          self.close()
          raise self._shutdown from None
        self._retry_or_raise(route, e)
        continue
      if r is grpc.aio.EOF:
        self.close()
        raise RequestFailed(f"request {self.request_id}: worker {route.worker} ended the stream without "
                            "a finish reason")
      return self._apply(route, r)

  def _retry_or_raise(self, route: _Route, e: grpc.aio.AioRpcError) -> None:
    code, details = e.code(), e.details()
    gone = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    busy = code == grpc.StatusCode.RESOURCE_EXHAUSTED  # admission limits full: up, but not for this one
    worker = route.worker
    # A decode worker whose prefill worker is gone or full answers UNAVAILABLE / RESOURCE_EXHAUSTED
    # naming it (disagg.PrefillUnavailable, "prefill worker X is overloaded"): the prefill worker
    # is the one to route around, the decode worker is fine.
    if (gone or busy) and route.prefill is not None and f"prefill worker {route.prefill} " in details:
      worker = route.prefill
    if gone:
      self._b.mark_down(worker, f"{code.name}: {details}")
    self._release()
    self._call = None
    if (gone or busy) and self.first_token_at is None:
      self._tried.add(worker)
      try:
        self._dispatch()  # Unavailable when every worker is down or has been tried
      except Unavailable:
        pass  # the client gets this worker's status, below
      else:
        self._b.metrics.retried_requests.labels(worker).inc()
        log.warning("request %s: worker %s failed before its first token (%s: %s); trying %s",
                    self.request_id, worker, code.name, details, self._route.prefill or self._route.worker)
        return
    self.close()
    if gone:
      raise Unavailable(f"request {self.request_id}: worker {worker} went away "
                        f"{'mid-request' if self.first_token_at is not None else 'and no other worker is up'}"
                        f" ({code.name}: {details})")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
      raise InvalidRequestError(details)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
      raise TokenizerError(details)
    if busy:
      raise Overloaded(f"worker {worker}: {details}" if len(self._tried) < 2 else
                       f"every worker refused request {self.request_id}; the last, {worker}: {details}")
    raise RequestFailed(f"request {self.request_id} failed on worker {worker}: {code.name}: {details}")

  def _apply(self, route: _Route, r: pb.GenerateResponse) -> RequestOutput:
    o, now = self._out, time.monotonic()
    new_ids = list(r.token_ids)
    if new_ids:
      if self.first_token_at is None:
        self.first_token_at = now
        self._b.metrics.time_to_first_token.observe(now - self.arrival)
        self._b.release_prefill(route)  # its part (prompt, first token, KV sent) is done
      self.last_token_at = now
    o.token_ids = o.token_ids + new_ids
    o.text += r.text
    o.logprobs = o.logprobs + [lp.logprob for lp in r.logprobs]
    if o.top_logprobs is not None:
      o.top_logprobs = o.top_logprobs + [{t.token_id: t.logprob for t in lp.top} for lp in r.logprobs]
    if r.prompt_logprobs and o.prompt_logprobs is not None:  # with the first token
      o.prompt_logprobs = [None] + [{t.token_id: t.logprob for t in lp.top} | {lp.token_id: lp.logprob}
                                    for lp in r.prompt_logprobs]
    o.new_token_ids, o.new_text = new_ids, r.text
    if r.finish_reason:
      o.finish_reason = FINISH_REASON_NAMES.get(r.finish_reason, "stop")
      o.num_cached_tokens = r.usage.cached_tokens
      o.num_remote_cached_tokens = r.usage.prefill_cached_tokens
      o.num_accepted_draft_tokens = r.usage.accepted_draft_tokens
      if route.prefill is None:
        self._b.metrics.actual_cached_tokens.labels(route.worker).inc(r.usage.cached_tokens)
      else:  # the prediction was about the prefill worker's cache: compare with what it had
        self._b.metrics.actual_cached_tokens.labels(route.prefill).inc(r.usage.prefill_cached_tokens)
      self.finished = True
      self.close()
    return dataclasses.replace(o)

  # ---- Generation --------------------------------------------------------------------

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    self._release()
    self._b.active.pop(id(self), None)

  async def __aenter__(self) -> "RouterGeneration":
    return self

  async def __aexit__(self, *exc) -> None:
    self.close()

  def shut_down(self, message: str) -> None:
    self._shutdown = Unavailable(message)
    if self._call is not None:
      self._call.cancel()

  def usage(self, out: RequestOutput) -> Usage:
    return Usage.of(out, self.arrival, self.first_token_at, self.last_token_at)


class RouterBackend(PromptMixin):
  """A `Backend` that serves each request on one of several workers."""

  def __init__(self, frontend: Frontend, options: RouterOptions, *, seed: int = 0):
    self.frontend = frontend
    self.options = options
    self.metrics = RouterMetrics()
    self.workers: dict[str, _Worker] = {}  # channels are made in start(), on the serving loop
    self.router: KVRouter | None = None  # the kv_workers' index and load; built once they said their page size
    self.decode_router: KVRouter | None = None  # disaggregated: the decode workers' liveness and load
    self.active: dict[int, RouterGeneration] = {}
    self.draining = False
    self._round_robin = itertools.count()
    self._seed = seed
    self._tasks: list[asyncio.Task] = []
    self._watches: dict[str, asyncio.Task] = {}  # kv worker -> its KV event subscription
    self._joining: dict[str, asyncio.Task] = {}  # addresses named but not yet SERVING / checked
    self._retired: list[_Worker] = []  # left, channel open until their last stream ends
    self._started: asyncio.Task | None = None
    cfg = frontend.config
    self.model_info = ModelInfo(
        model=frontend.source, max_model_len=frontend.max_model_len, vocab_size=cfg.vocab_size, dtype="",
        devices=(), max_num_seqs=0, page_size=0, num_pages=0, architecture=cfg.architecture,
        eos_token_ids=frontend.eos_ids, role="router")

  # ---- lifecycle ---------------------------------------------------------------------

  def start(self) -> None:
    self.workers = {a: _Worker(a) for a in self.options.all_workers}
    self._started = asyncio.ensure_future(self._connect())

  async def wait_ready(self) -> None:
    try:
      await asyncio.shield(self._started)
    except JaxinferError:
      raise
    except Exception as e:  # grpc errors other than the ones _connect explains
      raise JaxinferError(f"router start failed: {type(e).__name__}: {e}") from e

  @property
  def ready(self) -> bool:
    return self.state == "ready"

  @property
  def state(self) -> str:
    s = self._started
    if self.draining:
      return "draining"
    if s is None or not s.done():
      return "warming up"
    if s.cancelled():
      return "failed: stopped before the workers answered"
    if s.exception() is not None:
      return f"failed: {s.exception()}"
    return "ready"

  @property
  def num_active(self) -> int:
    return len(self.active)

  async def _connect(self) -> None:
    """Every worker SERVING and serving the same model as --model; then the KV
    event subscriptions and the health checks start."""
    o = self.options
    addresses = o.all_workers
    infos = await asyncio.gather(*(self._wait_serving(self.workers[a]) for a in addresses))
    first = addresses[0]
    f = self.frontend
    by_address = dict(zip(addresses, infos))
    self._check_roles(by_address)
    for address, info in zip(addresses, infos):
      self.workers[address].info = info
      self._check_model(address, info)
      if info.max_model_len != infos[0].max_model_len:
        raise JaxinferError(f"worker {address} does not match worker {first}: its max_model_len is "
                            f"{info.max_model_len}, worker {first}'s is {infos[0].max_model_len} "
                            "(start every worker with the same flags)")
    # The index hashes blocks of one page size: the workers whose events feed it must agree.
    # A decode worker may use another (it re-chunks the tokens a prefill worker sends).
    i0 = by_address[o.kv_workers[0]]
    for address in o.kv_workers:
      if by_address[address].page_size != i0.page_size:
        raise JaxinferError(f"worker {address} does not match worker {o.kv_workers[0]}: its page_size is "
                            f"{by_address[address].page_size}, worker {o.kv_workers[0]}'s is {i0.page_size} "
                            "(start every worker with the same flags)")
    f.max_model_len = i0.max_model_len
    self.model_info = dataclasses.replace(self.model_info, max_model_len=i0.max_model_len, dtype=i0.dtype,
                                          page_size=i0.page_size)
    self._refresh_model_info()
    config = RouterConfig(block_size=i0.page_size, overlap_weight=o.overlap_weight,
                          request_weight=o.request_weight, temperature=o.temperature)
    self.router = KVRouter(config, seed=self._seed)
    for address in o.kv_workers:
      self.router.add_worker(address)
    if o.disaggregated:
      self.decode_router = KVRouter(config, seed=self._seed)
      for address in o.decode_workers:
        self.decode_router.add_worker(address)
    for address in addresses:
      self.metrics.worker_up.labels(address).set(1)
    self._watches = {a: asyncio.ensure_future(self._watch(self.workers[a])) for a in o.kv_workers}
    self._tasks = [asyncio.ensure_future(self._check_health())]
    if o.resolve_interval_s:
      self._tasks.append(asyncio.ensure_future(self._follow_membership()))
    if o.disaggregated:
      log.info("routing to %d decode workers by load, %d prefill workers by %s (block size %d)",
               len(o.decode_workers), len(o.prefill_workers), o.policy, i0.page_size)
    else:
      log.info("routing to %d workers (%s policy, block size %d)", len(self.workers), o.policy, i0.page_size)

  def _check_model(self, address: str, info: pb.ModelInfo) -> None:
    """JaxinferError unless the worker serves the router's --model."""
    f = self.frontend
    ours = {"architecture": f.config.architecture, "vocab_size": f.config.vocab_size,
            "eos_token_ids": tuple(f.eos_ids)}
    theirs = {"architecture": info.architecture, "vocab_size": info.vocab_size,
              "eos_token_ids": tuple(info.eos_token_ids)}
    for field, value in ours.items():
      if theirs[field] != value:
        raise JaxinferError(f"worker {address} serves another model: its {field} is {theirs[field]!r}, "
                            f"the router's --model {f.source} has {value!r}")

  def _refresh_model_info(self) -> None:
    """Devices, sequences and pages summed over the workers of now."""
    serving = [self.workers[a].info for a in self._generate_workers() if self.workers[a].info is not None]
    self.model_info = dataclasses.replace(
        self.model_info, devices=tuple(f"{w.address}/{d}" for w in self.workers.values() if w.info is not None
                                       for d in w.info.devices),
        max_num_seqs=sum(i.max_num_seqs for i in serving), num_pages=sum(i.num_pages for i in serving))

  def _generate_workers(self) -> tuple[str, ...]:
    """Who gets the Generate calls now (decode workers hold the running requests)."""
    return self.options.decode_workers if self.options.disaggregated else tuple(self.workers)

  # ---- membership (aggregated) -------------------------------------------------------

  async def _follow_membership(self) -> None:
    o = self.options
    loop = asyncio.get_running_loop()
    while True:
      await asyncio.sleep(o.resolve_interval_s)
      try:  # getaddrinfo blocks: off the loop
        named = await loop.run_in_executor(None, named_workers, o.worker_entries, o.workers_file)
      except (OSError, JaxinferError) as e:
        log.warning("re-reading the workers failed (%s); keeping %s", e, sorted(self.workers))
        continue
      if not named:
        log.warning("the workers' entries name no worker now; keeping %s", sorted(self.workers))
        continue
      for address in named:
        if address not in self.workers and address not in self._joining:
          self._joining[address] = asyncio.ensure_future(self._join(address))
      for address in [a for a in self.workers if a not in named]:
        self.remove_worker(address)
      for address in [a for a in self._joining if a not in named]:
        self._joining.pop(address).cancel()
      self._close_retired()

  async def _join(self, address: str) -> None:
    """Adds `address` once it is SERVING the same model with the same page size."""
    w = _Worker(address)
    try:
      info = await self._wait_serving(w)
      self._check_model(address, info)
      for field in ("max_model_len", "page_size"):
        if getattr(info, field) != getattr(self.model_info, field):
          raise JaxinferError(f"worker {address}: its {field} is {getattr(info, field)}, the other "
                              f"workers' {getattr(self.model_info, field)} (start every worker with the same flags)")
    except (JaxinferError, grpc.aio.AioRpcError) as e:
      log.error("worker %s not added: %s", address, e)
      await w.channel.close()
      return
    except asyncio.CancelledError:
      await w.channel.close()
      raise
    finally:
      self._joining.pop(address, None)
    w.info = info
    self.workers[address] = w
    self.router.add_worker(address)
    self._watches[address] = asyncio.ensure_future(self._watch(w))
    self._refresh_model_info()
    self.metrics.worker_up.labels(address).set(1)
    log.info("worker %s joined (%d workers)", address, len(self.workers))

  def remove_worker(self, address: str) -> None:
    """No new request goes to `address` and its index entries are dropped; its in-flight
    streams go on on its channel, closed once they ended (`_close_retired`)."""
    w = self.workers.pop(address)
    self.router.remove_worker(address)
    watch = self._watches.pop(address, None)
    if watch is not None:
      watch.cancel()
    self._retired.append(w)
    self._refresh_model_info()
    self.metrics.worker_up.labels(address).set(0)
    log.info("worker %s left (%d workers); its in-flight requests finish there", address, len(self.workers))

  def _close_retired(self) -> None:
    busy = {id(g._route.member) for g in self.active.values() if g._route is not None}
    for w in [w for w in self._retired if id(w) not in busy]:
      self._retired.remove(w)
      asyncio.ensure_future(w.channel.close())

  def _check_roles(self, infos: dict[str, pb.ModelInfo]) -> None:
    """Disaggregated: the prefill workers serve KVTransfer, and every decode worker
    accepts every prefill worker the router may name (its Generate refuses others)."""
    o = self.options
    if not o.disaggregated:
      return
    for address in o.prefill_workers:
      if infos[address].role != "prefill":
        raise JaxinferError(f"prefill worker {address} is not a prefill worker: its role is "
                            f"{infos[address].role or 'unknown'!r} (start it with jaxinfer serve --role prefill)")
    for address in o.decode_workers:
      info = infos[address]
      if info.role != "decode":
        raise JaxinferError(f"decode worker {address} is not a decode worker: its role is "
                            f"{info.role or 'unknown'!r} (start it with jaxinfer serve --role decode)")
      missing = [p for p in o.prefill_workers if p not in info.prefill_workers]
      if missing:
        raise JaxinferError(
            f"decode worker {address} does not take KV from the router's prefill worker(s) {missing}: its "
            f"--prefill-workers are {list(info.prefill_workers)} (give every decode worker the router's "
            "--prefill-workers, spelled the same)")

  async def _wait_serving(self, w: _Worker) -> pb.ModelInfo:
    loop = asyncio.get_running_loop()
    end = loop.time() + self.options.connect_timeout_s
    why = "no answer"
    while True:
      try:
        r = await w.health.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
        if r.status == health_pb2.HealthCheckResponse.SERVING:
          return await w.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10.0)
        why = f"health says {health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)}"
      except grpc.aio.AioRpcError as e:
        why = f"{e.code().name}: {e.details()}"
      if loop.time() > end:
        raise JaxinferError(f"worker {w.address} is not SERVING after {self.options.connect_timeout_s:g} s "
                            f"({why})")
      await asyncio.sleep(0.2)

  async def stop(self) -> None:
    for t in [*self._tasks, *self._watches.values(), *self._joining.values(), self._started]:
      if t is not None and not t.done():
        t.cancel()
    await asyncio.gather(*(w.channel.close() for w in [*self.workers.values(), *self._retired]),
                         return_exceptions=True)

  # ---- worker state ------------------------------------------------------------------

  def _router_of(self, address: str) -> KVRouter | None:
    if self.decode_router is not None and address in self.options.decode_workers:
      return self.decode_router
    return self.router

  def mark_down(self, address: str, why: str) -> None:
    r = self._router_of(address)
    if r is not None and address in r.workers:
      log.warning("worker %s is down (%s): routing around it", address, why)
      r.set_alive(address, False)
      self.metrics.worker_up.labels(address).set(0)

  def _mark_up(self, address: str) -> None:
    r = self._router_of(address)
    if address not in self.workers:
      return  # it left while its check was under way
    if address not in r.workers:
      log.info("worker %s is SERVING again", address)
      r.set_alive(address, True)
      self.metrics.worker_up.labels(address).set(1)

  async def _check_health(self) -> None:
    interval = self.options.health_interval_s

    async def check(w: _Worker) -> None:
      try:
        r = await w.health.Check(health_pb2.HealthCheckRequest(), timeout=interval)
        if r.status == health_pb2.HealthCheckResponse.SERVING:
          self._mark_up(w.address)
        else:
          self.mark_down(w.address, health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))
      except grpc.aio.AioRpcError as e:
        self.mark_down(w.address, f"health check: {e.code().name}")

    while True:
      await asyncio.gather(*(check(w) for w in self.workers.values()))
      await asyncio.sleep(interval)

  async def _watch(self, w: _Worker) -> None:
    """The worker's KV events into the index, resubscribing (a fresh snapshot)
    after a gap or a broken stream."""
    index, name = self.router.index, w.address
    failing = False  # say so once per outage, not at every retry
    while True:
      call = w.kv.WatchKVEvents(kv_pb.WatchKVEventsRequest())
      try:
        async for m in call:
          failing = False
          if m.HasField("snapshot"):
            s = m.snapshot
            if s.block_size != self.model_info.page_size:
              log.error("worker %s hashes blocks of %d tokens, not %d: its KV events are ignored",
                        name, s.block_size, self.model_info.page_size)
              return
            index.load_snapshot(name, s.seq, s.block_hashes)
            self.metrics.kv_resyncs.labels(name).inc()
            self.metrics.kv_event_batch.labels(name).set(s.seq)
          else:
            b = m.batch
            index.apply(name, b.seq, [KVEvent(_KINDS[e.kind], e.block_hash,
                                              e.parent_hash if e.HasField("parent_hash") else None)
                                      for e in b.events])
            self.metrics.kv_event_batch.labels(name).set(b.seq)
      except SequenceGap as e:
        log.warning("%s; resubscribing", e)
      except grpc.aio.AioRpcError as e:
        if not failing:
          log.info("KV events of worker %s: %s (%s); resubscribing", name, e.code().name, e.details())
        failing = True
      finally:
        call.cancel()
      await asyncio.sleep(self.options.health_interval_s)

  # ---- requests ----------------------------------------------------------------------

  def reject(self, e: BaseException) -> None:
    self.metrics.rejected_requests.labels(rejection_code(e)).inc()

  def choose(self, ids: Sequence[int], exclude: Collection[str] = ()) -> _Route:
    """Where a request goes (never to a worker in `exclude`), charged to its worker(s);
    counts the decision."""
    t = time.perf_counter()
    o = self.options
    ps = self.model_info.page_size
    num_blocks = -(-len(ids) // ps)
    r = self.router
    # Disaggregated, the decode worker is picked first: with none up there is nothing to charge.
    decode = self._pick_decode(exclude) if o.disaggregated else None
    role, what = ("prefill", "prefill workers") if o.disaggregated else ("both", "workers")
    names = ", ".join(o.kv_workers if o.disaggregated else self.workers)
    none_up = f"no worker is up ({what}: {names})"
    if exclude:
      none_up = f"no worker is up that has not failed or refused this request ({what}: {names})"
    if o.policy == "round_robin":
      live = [w for w in r.workers if w not in exclude]
      if not live:
        raise Unavailable(none_up)
      worker = live[next(self._round_robin) % len(live)]
      overlap = int(r.index.overlap(hash_blocks(ids, ps))[r.index.slot(worker)])
    else:
      try:
        choice = r.select(hash_blocks(ids, ps), num_blocks, exclude=exclude)
      except LookupError:
        raise Unavailable(none_up) from None
      worker, overlap = choice.worker, choice.overlap_blocks
    # A worker always computes the last prompt token (LLMEngine needs its logits),
    # so it can reuse at most the full blocks before it.
    predicted = min(overlap, (len(ids) - 1) // ps) * ps
    r.started(worker, num_blocks)
    m = self.metrics
    m.routed_requests.labels(worker, role).inc()
    m.predicted_cached_tokens.labels(worker).inc(predicted)
    if decode is not None:
      self.decode_router.started(decode, num_blocks)
      m.routed_requests.labels(decode, "decode").inc()
      route = _Route(decode, worker, float(num_blocks), member=self.workers[decode])
    else:
      route = _Route(worker, None, float(num_blocks), member=self.workers[worker])
    m.decision_time.observe(time.perf_counter() - t)
    return route

  def _pick_decode(self, exclude: Collection[str] = ()) -> str:
    """The live decode worker with the fewest requests, then prompt blocks, in flight
    through this router; ties in turn. Its KV comes from elsewhere, so overlap says nothing."""
    d = self.decode_router
    live = [w for w in d.workers if w not in exclude]
    if not live:
      raise Unavailable(f"no worker is up (decode workers: {', '.join(self.options.decode_workers)})")
    turn = next(self._round_robin)
    order = [live[(turn + i) % len(live)] for i in range(len(live))]
    slot = d.index.slot
    return min(order, key=lambda w: (d.active_requests[slot(w)], d.active_blocks[slot(w)]))

  def release_prefill(self, route: _Route) -> None:
    """The prefill worker's part of a request is over (first token, or the request ended)."""
    if route.prefill is not None and route.prefill_charged:
      self.router.finished(route.prefill, route.blocks)
      route.prefill_charged = False

  def release(self, route: _Route) -> None:
    self.release_prefill(route)
    if self.workers.get(route.worker) is route.member:  # not if it left since
      (self.decode_router if self.options.disaggregated else self.router).finished(route.worker, route.blocks)

  def generate(self, prompt_ids: Sequence[int], params: SamplingParams, *, request_id: str | None = None,
               prompt: str | None = None, prefill_worker: str | None = None) -> RouterGeneration:
    if self.draining:
      raise Unavailable("the server is shutting down")
    if prefill_worker is not None:
      raise InvalidRequestError(f"{PREFILL_WORKER_METADATA}: the router picks the prefill worker itself; "
                                f"send {prefill_worker!r} to a decode worker, not to the router")
    if not self.ready:
      raise Unavailable(f"the router is not ready ({self.state})")
    rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
    ids = self.validate(prompt_ids, params, prompt).prompt_token_ids  # (parse's request: not checked again)
    gen = RouterGeneration(self, rid, prompt, ids, params)
    gen._dispatch()
    self.active[id(gen)] = gen
    return gen

  def shut_down_all(self, message: str) -> int:
    left = list(self.active.values())
    for gen in left:
      gen.shut_down(message)
    return len(left)

  def worker_loads(self) -> dict[str, tuple[float, float]]:
    """worker -> (active requests, active prompt blocks), as the router counts them
    (a prefill worker's until its requests' first tokens)."""
    if self.router is None:
      return {}
    loads = {}
    for w in self.workers:
      r = self._router_of(w)
      s = r.index.slot(w)
      loads[w] = (float(r.active_requests[s]), float(r.active_blocks[s]))
    return loads


__all__ = ["POLICIES", "RouterBackend", "RouterGeneration", "RouterMetrics", "RouterOptions",
           "expand_addresses"]
