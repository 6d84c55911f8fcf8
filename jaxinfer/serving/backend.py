"""The transport-neutral serving core: the `Backend` contract, and `EngineBackend`
(one local engine thread, admission, drain, per-request streams).

    backend = EngineBackend(llm, max_waiting_requests=256)
    backend.start()                                     # on the asyncio loop that will serve
    text, ids, params = backend.parse("Hello", SamplingParams(max_tokens=8))
    async with backend.generate(ids, params, request_id="r1", prompt=text) as gen:
      async for out in gen:                             # RequestOutput deltas
        ...
      usage = gen.usage(out)

The gRPC servicer (server.py) and the OpenAI HTTP app (openai_api.py) are
thin adapters over a `Backend`: they turn their wire format into a prompt
and a SamplingParams, and the errors below into their own statuses, each in
one place. `Backend` is a Protocol so that another implementation (the KV-
aware router, router.py, which forwards to workers) serves the same two APIs.

Threads: everything here runs on one asyncio loop except the engine
(`EngineLoop`). A request's `_Stream` is a bounded queue that the engine
thread fills through `loop.call_soon_threadsafe`, so the engine never waits
for a client. When the queue is full, new deltas merge into the last queued
one (the client sees fewer, larger messages; nothing is dropped). A
`Generation` left before its request finished (client cancel, deadline,
disconnect) aborts it in the engine, which frees its KV pages on its next
command pass.

Errors: InvalidRequestError (bad input, naming the field), TokenizerError
(the model has no tokenizer for a text prompt), Overloaded (admission
limits, naming the limit), Unavailable (warming up or shutting down),
RequestFailed (this request failed in the engine; the others go on).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import time
import uuid
from typing import Callable, Protocol, Sequence

import jax
from prometheus_client import CollectorRegistry, Counter

from jaxinfer.engine.engine import RequestOutput
from jaxinfer.errors import InvalidRequestError, JaxinferError, TokenizerError
from jaxinfer.frontend import Frontend, Prompt, ValidRequest
from jaxinfer.llm import LLM
from jaxinfer.sampling import SamplingParams
from jaxinfer.serving.engine_loop import EngineLoop, KVWatcher, LoopSink
from jaxinfer.serving.metrics import Metrics


class Overloaded(JaxinferError):
  """An admission limit is full; retrying later may succeed."""


class Unavailable(JaxinferError):
  """The server is warming up or shutting down."""


class RequestFailed(JaxinferError):
  """This request failed inside the engine (the batch went on without it)."""


def rejection_code(e: BaseException) -> str:
  """The label of `jaxinfer_rejected_requests` for a request refused with `e`.

  gRPC's status names, whichever transport refused it, so one dashboard
  reads both."""
  if isinstance(e, InvalidRequestError):
    return "INVALID_ARGUMENT"
  if isinstance(e, TokenizerError):
    return "FAILED_PRECONDITION"
  if isinstance(e, Overloaded):
    return "RESOURCE_EXHAUSTED"
  if isinstance(e, Unavailable):
    return "UNAVAILABLE"
  return "INTERNAL"


@dataclasses.dataclass(frozen=True)
class ModelInfo:
  model: str  # where it was loaded from
  max_model_len: int
  vocab_size: int
  dtype: str
  devices: tuple[str, ...]
  max_num_seqs: int
  page_size: int
  num_pages: int
  architecture: str
  eos_token_ids: tuple[int, ...]
  role: str = "both"  # disaggregation: both, prefill, decode; a router says "router"
  prefill_workers: tuple[str, ...] = ()  # a decode worker's: the prefill workers it may be told to use


@dataclasses.dataclass(frozen=True)
class Usage:
  prompt_tokens: int
  completion_tokens: int
  cached_tokens: int  # prompt tokens served by the prefix cache
  time_to_first_token_s: float  # 0 when no token came
  latency_s: float  # arrival to the last token (or now)
  prefill_cached_tokens: int = 0  # a decode worker's: what its prefill worker had cached
  accepted_draft_tokens: int = 0  # speculative decoding: drafts the target accepted

  @classmethod
  def of(cls, out: RequestOutput, arrival: float, first_token_at: float | None,
         last_token_at: float | None) -> "Usage":
    """A request's usage from its output and its times (time.monotonic())."""
    last = last_token_at or time.monotonic()
    return cls(prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(out.token_ids),
               cached_tokens=out.num_cached_tokens,
               time_to_first_token_s=(first_token_at - arrival) if first_token_at is not None else 0.0,
               latency_s=last - arrival, prefill_cached_tokens=out.num_remote_cached_tokens,
               accepted_draft_tokens=out.num_accepted_draft_tokens)


class Generation(Protocol):
  """One request in flight, as the adapters use it: `async with gen: async for out in gen`.

  Yields RequestOutputs (deltas plus cumulative state). Leaving the `async
  with` before the request finished aborts it wherever it runs. Iteration
  raises RequestFailed, Unavailable, or what the request was refused with.
  """

  request_id: str

  def __aiter__(self) -> "Generation": ...

  async def __anext__(self) -> RequestOutput: ...

  async def __aenter__(self) -> "Generation": ...

  async def __aexit__(self, *exc) -> None: ...

  def usage(self, out: RequestOutput) -> Usage: ...

  def close(self) -> None:
    """Leaves it (idempotent): aborts the request if it has not finished."""


class ServingMetrics(Protocol):
  """The part of a backend's metrics the adapters touch; the rest is the backend's own."""

  registry: CollectorRegistry
  rejected_requests: Counter  # labelled by `rejection_code`

  def exposition(self) -> bytes: ...


class Backend(Protocol):
  """What the gRPC servicer and the OpenAI app need from whatever serves the model.

  Every method runs on the serving asyncio loop. Errors are the exceptions
  of this module plus InvalidRequestError / TokenizerError; each adapter maps
  them to its statuses in one place.
  """

  metrics: ServingMetrics  # the registry both adapters expose (and count rejections in)
  model_info: ModelInfo
  draining: bool  # set by the server when it starts to drain; new requests are Unavailable

  # ---- lifecycle ----
  def start(self) -> None:
    """Starts serving work in the background (warm-up, connecting to workers)."""

  async def wait_ready(self) -> None:
    """Returns once `start`'s background work succeeded; raises JaxinferError saying what broke it."""

  @property
  def ready(self) -> bool:
    """Started, not failed, not draining: new requests will be served."""

  @property
  def state(self) -> str:
    """'ready', 'warming up', 'draining' or 'failed: <why>' (for health endpoints)."""

  @property
  def num_active(self) -> int:
    """Requests in flight (the drain waits for them)."""

  def shut_down_all(self, message: str) -> int:
    """Ends every request in flight with Unavailable(message); returns how many."""

  async def stop(self) -> None:
    """Releases what `start` took (engine thread, worker channels), after the drain."""

  # ---- requests ----
  def reject(self, e: BaseException) -> None:
    """Counts a request refused before it reached the model."""

  def parse(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, ValidRequest, SamplingParams]: ...

  def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]: ...

  def validate(self, prompt_ids: Sequence[int], params: SamplingParams, prompt: str | None = None) -> ValidRequest: ...

  def generate(self, prompt_ids: ValidRequest | Sequence[int], params: SamplingParams, *,
               request_id: str | None = None, prompt: str | None = None,
               prefill_worker: str | None = None) -> Generation:
    """prompt_ids: what `parse` / `validate` returned (not checked again), or token ids
    (checked here). prefill_worker: the prefill worker a decode worker must take the
    prompt's KV from (a router's pick); InvalidRequestError where that cannot be honoured."""

  # ---- tokenizer ----
  def require_tokenizer(self, what: str) -> None:
    """TokenizerError saying that `what` needs a tokenizer, if the model has none."""

  def tokenize(self, prompt: str | Sequence[dict], add_special_tokens: bool = True) -> list[int]: ...

  def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

  def token_pieces(self, ids: Sequence[int]) -> list[str]: ...

  def token_texts(self, ids: Sequence[int]) -> list[str]: ...


class _Admission:
  """A request's claim on the waiting budget, given back once (first output or end)."""

  def __init__(self, backend: "EngineBackend", tokens: int):
    self._backend, self.tokens, self._held = backend, tokens, True
    backend.waiting_requests += 1
    backend.waiting_tokens += tokens

  def release(self) -> None:
    if self._held:
      self._held = False
      self._backend.waiting_requests -= 1
      self._backend.waiting_tokens -= self.tokens


class _Stream(LoopSink):
  """A request's bounded output queue: filled from the engine thread, read on the loop."""

  def __init__(self, loop: asyncio.AbstractEventLoop, capacity: int, admission: _Admission):
    super().__init__(loop)
    self._capacity = capacity
    self._admission = admission
    self._items: collections.deque = collections.deque()
    self._ready = asyncio.Event()

  def on_loop(self, item: RequestOutput | BaseException) -> None:
    self.put(item)

  def put(self, item: RequestOutput | BaseException) -> None:
    self._admission.release()  # it has left the waiting queue (first output, or ended)
    last = self._items[-1] if self._items else None
    if (len(self._items) >= self._capacity and isinstance(item, RequestOutput)
        and isinstance(last, RequestOutput)):
      # Merge: `item` carries the cumulative state; only the deltas need joining.
      self._items[-1] = dataclasses.replace(item, new_token_ids=last.new_token_ids + item.new_token_ids,
                                            new_text=last.new_text + item.new_text)
    else:
      self._items.append(item)
    self._ready.set()

  async def get(self) -> RequestOutput | BaseException:
    while not self._items:
      self._ready.clear()
      await self._ready.wait()
    return self._items.popleft()

  def __len__(self) -> int:
    return len(self._items)


class EngineGeneration:
  """One request in flight on the local engine: an async iterator of its RequestOutputs (deltas plus cumulative state).

  Iterate it inside `async with`: leaving the block before the request
  finished (a break, a cancelled task, a disconnected client) aborts it in
  the engine. Iteration raises RequestFailed when the engine failed this
  request, Unavailable when the server shut down before it finished, and
  whatever the engine refused it with (InvalidRequestError).
  """

  def __init__(self, backend: "EngineBackend", key: str, request_id: str, stream: _Stream,
               admission: _Admission):
    self._backend, self.key, self.request_id = backend, key, request_id
    self._stream, self._admission = stream, admission
    self.finished = False
    self._closed = False

  def __aiter__(self) -> "EngineGeneration":
    return self

  async def __anext__(self) -> RequestOutput:
    if self.finished or self._closed:
      raise StopAsyncIteration
    item = await self._stream.get()
    if isinstance(item, BaseException):
      self.close()  # a shutdown leaves it running in the engine: aborted here (a no-op for the others)
      if isinstance(item, JaxinferError):
        raise item
      raise RequestFailed(f"request {self.request_id} failed in the engine: {item}") from item
    if item.finish_reason == "error":
      self.finished = True
      self.close()
      raise RequestFailed(f"request {self.request_id} failed in the engine: {item.error}")
    self.finished = item.finished
    return item

  def close(self) -> None:
    """Gives back its admission and, if it is still running, aborts it in the engine."""
    if self._closed:
      return
    self._closed = True
    self._admission.release()
    self._backend.active.pop(self.key, None)
    if not self.finished:  # cancelled, disconnected or shut down: free its pages now
      self._backend.engine_loop.abort(self.key)

  async def __aenter__(self) -> "EngineGeneration":
    return self

  async def __aexit__(self, *exc) -> None:
    self.close()

  def shut_down(self, message: str) -> None:
    """Ends the iteration with Unavailable(message) (the server is going away)."""
    self._stream.put(Unavailable(message))

  def usage(self, out: RequestOutput) -> Usage:
    s = self._stream
    return Usage.of(out, s.arrival, s.first_token_at, s.last_token_at)


class PromptMixin:
  """parse / encode / validate and the tokenizer methods of a Backend, from the model's
  `self.frontend` (jaxinfer.frontend: an engine's, or the router's weightless one). One
  implementation, so a router refuses what a worker would, in the same words."""

  frontend: Frontend

  def parse(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, ValidRequest, SamplingParams]:
    """(prompt text, the checked request, params) for text, token ids or chat messages, or
    InvalidRequestError / TokenizerError naming what is wrong."""
    request = self.frontend.request(prompt, params)
    return request.prompt, request, params

  def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
    """(text or None, ids); a chat is rendered with the model's template. The
    first half of `parse`, for callers whose params depend on the prompt's length."""
    return self.frontend.encode_prompt(prompt)

  def validate(self, prompt_ids: Sequence[int], params: SamplingParams, prompt: str | None = None) -> ValidRequest:
    """The request checked as the engine needs it (ids, lengths, grammar), or InvalidRequestError."""
    return self.frontend.validate(prompt_ids, params, prompt)

  # ---- tokenizer -------------------------------------------------------------------

  def require_tokenizer(self, what: str) -> None:
    self.frontend.tokenizer_or_error(what)

  def tokenize(self, prompt: str | Sequence[dict], add_special_tokens: bool = True) -> list[int]:
    """Token ids of a text (with or without special tokens) or of a rendered chat."""
    tok = self.frontend.tokenizer_or_error("tokenize")
    if isinstance(prompt, str):
      return tok.encode(prompt, add_special_tokens=add_special_tokens)
    return self.frontend.encode_prompt(list(prompt))[1]

  def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    tok = self.frontend.tokenizer_or_error("detokenize")
    ids = list(ids)
    if ids:
      try:
        self.frontend.check_token_ids(ids)
      except InvalidRequestError as e:
        raise InvalidRequestError(f"token_ids: {e}") from None
    return tok.decode(ids, skip_special_tokens=skip_special_tokens)

  def token_pieces(self, ids: Sequence[int]) -> list[str]:
    """The vocabulary entry of each id (e.g. 'Ġworld')."""
    tok = self.frontend.tokenizer_or_error("token strings")
    return [tok.id_to_token(t) for t in ids]

  def token_texts(self, ids: Sequence[int]) -> list[str]:
    """Each id decoded on its own (what it adds to the text, roughly); 'token_id:N' without a tokenizer."""
    tok = self.frontend.tokenizer
    if tok is None:
      return [f"token_id:{t}" for t in ids]
    return [tok.decode([t], skip_special_tokens=False) for t in ids]


class EngineBackend(PromptMixin):
  """A `Backend` over a local engine: the engine thread, its metrics, admission,
  drain and the requests in flight, for one model.

  Admission bounds the work that waits for the engine: requests admitted
  but without a first output yet, and their prompt tokens. Past either,
  `generate` raises Overloaded at once instead of queueing without bound.
  Every method except the constructor runs on the serving asyncio loop
  (no locks: the counters are only touched there).
  """

  def __init__(self, llm: LLM, *, max_waiting_requests: int = 256, max_waiting_tokens: int = 131072,
               stream_buffer: int = 64, warmup: bool = True,
               on_ready: Callable[[], None] | None = None):
    self.llm = llm
    self.frontend = llm.frontend
    self.max_waiting_requests = max_waiting_requests
    self.max_waiting_tokens = max_waiting_tokens
    self.stream_buffer = stream_buffer
    self.metrics = Metrics()
    self.engine_loop = EngineLoop(llm.engine, self.metrics, warmup=warmup, on_ready=on_ready)
    self.active: dict[str, EngineGeneration] = {}
    self.kv_connector = None  # a decode worker's DecodeConnector (set_role)
    self.draining = False
    self.waiting_requests = 0
    self.waiting_tokens = 0
    self._keys = itertools.count()
    e, cfg = llm.engine, llm.config
    self.model_info = ModelInfo(
        model=str(llm.source), max_model_len=e.max_model_len, vocab_size=cfg.vocab_size,
        dtype=llm.dtype, devices=tuple(str(d) for d in jax.devices()),
        max_num_seqs=e.engine_config.max_num_seqs, page_size=e.engine_config.page_size,
        num_pages=e.kv.num_pages, architecture=cfg.architecture, eos_token_ids=tuple(e.eos_ids))

  # ---- state -----------------------------------------------------------------------

  def start(self) -> None:
    """Starts the engine thread (it warms up first; `ready` after that)."""
    self.engine_loop.start()

  async def wait_ready(self) -> None:
    loop = self.engine_loop
    await asyncio.get_running_loop().run_in_executor(None, loop.ready.wait)
    if loop.error is not None:
      raise JaxinferError(f"engine warm-up failed: {loop.error}") from loop.error

  @property
  def ready(self) -> bool:
    """Warm and not draining: new requests will be served."""
    loop = self.engine_loop
    return loop.ready.is_set() and loop.error is None and not self.draining

  @property
  def state(self) -> str:
    if self.draining:
      return "draining"
    if self.engine_loop.error is not None:
      return f"failed: engine warm-up failed: {self.engine_loop.error}"
    return "ready" if self.engine_loop.ready.is_set() else "warming up"

  @property
  def num_active(self) -> int:
    return len(self.active)

  async def stop(self) -> None:
    await asyncio.get_running_loop().run_in_executor(None, self.engine_loop.stop)

  def set_role(self, role: str, kv_connector=None) -> None:
    """Says (in model_info, for a router's GetModelInfo) what disagg.attach made of this
    worker: its role and, for a decode worker, the prefill workers it may be told to use."""
    self.kv_connector = kv_connector
    workers = tuple(kv_connector.workers) if kv_connector is not None else ()
    self.model_info = dataclasses.replace(self.model_info, role=role, prefill_workers=workers)

  def watch_kv_events(self, watcher: KVWatcher) -> None:
    """Feeds `watcher` a snapshot of the prefix cache, then every numbered batch of
    KV events after it (see EngineLoop.watch_kv_events)."""
    self.engine_loop.watch_kv_events(watcher)

  def reject(self, e: BaseException) -> None:
    """Counts a request refused before reaching the engine."""
    self.metrics.rejected_requests.labels(rejection_code(e)).inc()

  # ---- requests --------------------------------------------------------------------

  def admit(self, num_tokens: int) -> _Admission:
    """A claim on the waiting budget, or Overloaded saying which limit is full."""
    if self.waiting_requests >= self.max_waiting_requests:
      raise Overloaded(f"server busy: {self.waiting_requests} requests are waiting "
                       f"(max_waiting_requests={self.max_waiting_requests}); retry later")
    if self.waiting_tokens + num_tokens > self.max_waiting_tokens:
      raise Overloaded(f"server busy: {self.waiting_tokens} prompt tokens are waiting and this request "
                       f"adds {num_tokens} (max_waiting_tokens={self.max_waiting_tokens}); retry later")
    return _Admission(self, num_tokens)

  def generate(self, prompt_ids: ValidRequest | Sequence[int], params: SamplingParams, *,
               request_id: str | None = None, prompt: str | None = None,
               prefill_worker: str | None = None) -> EngineGeneration:
    """Admits a parsed request and posts it to the engine; raises Unavailable or
    Overloaded at once (before anything is queued) when it cannot be taken, and
    InvalidRequestError for a `prefill_worker` this worker cannot use."""
    if self.draining:
      raise Unavailable("the server is shutting down")
    if prefill_worker is not None:
      if self.kv_connector is None:
        raise InvalidRequestError(f"x-jaxinfer-prefill-worker: {prefill_worker!r} names a prefill worker, "
                                  f"but this worker's role is {self.model_info.role}, not decode")
      self.kv_connector.check_source(prefill_worker)
    request = self.validate(prompt_ids, params, prompt)  # (a request from parse is not checked again)
    admission = self.admit(len(request))
    rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
    key = f"{rid}#{next(self._keys)}"  # the engine's id: unique even when clients reuse theirs
    stream = _Stream(asyncio.get_running_loop(), self.stream_buffer, admission)
    gen = EngineGeneration(self, key, rid, stream, admission)
    self.active[key] = gen
    self.engine_loop.add(key, request, stream, kv_source=prefill_worker)
    return gen

  def shut_down_all(self, message: str) -> int:
    """Ends every request in flight with Unavailable(message); returns how many."""
    left = list(self.active.values())
    for gen in left:
      gen.shut_down(message)
    return len(left)
