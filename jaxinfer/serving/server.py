"""The server: `jaxinfer.v1.Inference` over gRPC, and optionally the OpenAI
HTTP API, over one `Backend` (a local engine, or the KV-aware router).

    llm = LLM(warmup=False)                        # the engine thread warms up
    server = InferenceServer(llm, ServerConfig(port=50051, http_port=8000, metrics_port=9090))
    server.start_in_thread()                       # or: await server.start() on your loop
    ...
    server.stop_in_thread()                        # drains within the grace period

`InferenceServer(backend)` takes any `Backend` (backend.py); an `LLM` is
wrapped in an `EngineBackend`, the only reason this file imports `LLM`.
Threads: grpc.aio handlers and the HTTP app (uvicorn) run on one asyncio
loop and share the backend: validation, admission, the per-request streams
(and, for a local engine, its thread). This file is the gRPC adapter and
the lifecycle of both listeners.

A server over a local engine also serves `jaxinfer.v1.KVEvents`
(kv_events.proto): its prefix cache's snapshot and numbered event batches,
for a router's index. Each subscriber has a bounded queue filled from the
engine thread; one that falls `kv_event_buffer` batches behind is ended
with RESOURCE_EXHAUSTED (the engine never waits) and may subscribe again.

Status codes (`status_of`): INVALID_ARGUMENT (bad input, naming the field),
RESOURCE_EXHAUSTED (admission limits, naming the limit), FAILED_PRECONDITION
(the model has no tokenizer for a text prompt), UNAVAILABLE (shutting down),
INTERNAL (this request failed in the engine; the others go on).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import signal
import socket
import sys
import threading
import uuid
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxinfer.engine.kv_connector import KVTransferTimeout
from jaxinfer.errors import InvalidRequestError, JaxinferError, TokenizerError
from jaxinfer.engine.kv_manager import KVEvent
from jaxinfer.llm import LLM, Prompt
from jaxinfer.serving.backend import Backend, EngineBackend, Overloaded, RequestFailed, Unavailable, Usage
from jaxinfer.serving.convert import messages_from_proto, response_from_output, sampling_from_proto
from jaxinfer.serving.engine_loop import KVWatcher
from jaxinfer.serving.proto import inference_pb2 as pb
from jaxinfer.serving.proto import inference_pb2_grpc as pb_grpc
from jaxinfer.serving.proto import kv_events_pb2 as kv_pb
from jaxinfer.serving.proto import kv_events_pb2_grpc as kv_pb_grpc

if TYPE_CHECKING:
  import uvicorn

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name  # "jaxinfer.v1.Inference"
KV_EVENTS_SERVICE_NAME = kv_pb.DESCRIPTOR.services_by_name["KVEvents"].full_name  # "jaxinfer.v1.KVEvents"
# Generate metadata a router sets on a decode worker's call: the prefill worker it chose
# (by cached overlap) for the prompt's KV. Must be one of the decode worker's --prefill-workers.
PREFILL_WORKER_METADATA = "x-jaxinfer-prefill-worker"


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """Network, admission and shutdown knobs (engine capacity lives in EngineConfig).

  Admission bounds the work that waits for the engine: requests admitted
  but without a first token yet, and their prompt tokens. Past either,
  Generate answers RESOURCE_EXHAUSTED (HTTP: 429) at once instead of
  queueing without bound.
  """

  host: str = "127.0.0.1"
  port: int = 50051  # 0: any free port (see InferenceServer.port)
  max_waiting_requests: int = 256
  max_waiting_tokens: int = 131072
  stream_buffer: int = 64  # queued messages per request before deltas merge
  grace_period_s: float = 30.0  # shutdown: how long in-flight requests may take to finish
  metrics_port: int | None = None  # Prometheus HTTP endpoint; None: off, 0: any free port
  http_port: int | None = None  # OpenAI-compatible HTTP API; None: off, 0: any free port
  served_model_name: str | None = None  # the HTTP API's model name; None: the source's basename
  # Prefill/decode disaggregation (disagg.py): 'both' serves alone; 'prefill' also serves
  # jaxinfer.v1.KVTransfer; 'decode' imports every prompt's KV from `prefill_workers`.
  role: str = "both"
  prefill_workers: tuple[str, ...] = ()
  kv_transfer_timeout_s: float = 60.0  # decode: request to imported; prefill: first token to Ack
  kv_event_buffer: int = 4096  # KV event batches queued per WatchKVEvents subscriber before it is dropped

  def __post_init__(self):
    for name in ("max_waiting_requests", "max_waiting_tokens", "stream_buffer", "kv_event_buffer"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InvalidRequestError(f"{name} must be a positive int, got {v!r}")
    for name in ("port", "metrics_port", "http_port"):
      v = getattr(self, name)
      if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 65536):
        raise InvalidRequestError(f"{name} must be in [0, 65536), got {v!r}")
    if not self.grace_period_s >= 0:
      raise InvalidRequestError(f"grace_period_s must be >= 0, got {self.grace_period_s!r}")
    if self.role not in ("both", "prefill", "decode"):
      raise InvalidRequestError(f"role must be both, prefill or decode, got {self.role!r}")
    if (self.role == "decode") != bool(self.prefill_workers):
      raise InvalidRequestError("prefill_workers: a decode worker needs at least one prefill worker "
                                f"address, and only a decode worker takes them (role={self.role!r}, "
                                f"prefill_workers={list(self.prefill_workers)})")
    if not self.kv_transfer_timeout_s > 0:
      raise InvalidRequestError(f"kv_transfer_timeout_s must be > 0, got {self.kv_transfer_timeout_s!r}")


def status_of(e: BaseException) -> grpc.StatusCode:
  """The one place errors become gRPC statuses (also the prefill worker's KVTransfer, disagg.py)."""
  if isinstance(e, InvalidRequestError):
    return grpc.StatusCode.INVALID_ARGUMENT
  if isinstance(e, TokenizerError):
    return grpc.StatusCode.FAILED_PRECONDITION
  if isinstance(e, Overloaded):
    return grpc.StatusCode.RESOURCE_EXHAUSTED
  if isinstance(e, KVTransferTimeout):
    return grpc.StatusCode.DEADLINE_EXCEEDED
  if isinstance(e, Unavailable):
    return grpc.StatusCode.UNAVAILABLE
  return grpc.StatusCode.INTERNAL


def _prompt_from_proto(request: pb.GenerateRequest) -> Prompt:
  which = request.WhichOneof("prompt")
  if which is None:
    raise InvalidRequestError("prompt: set one of text, token_ids, chat")
  if which == "text":
    return request.text
  if which == "token_ids":
    return list(request.token_ids.ids)
  return messages_from_proto(request.chat)


def _usage_to_proto(u: Usage) -> pb.Usage:
  return pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                  cached_tokens=u.cached_tokens, time_to_first_token_s=u.time_to_first_token_s,
                  latency_s=u.latency_s, prefill_cached_tokens=u.prefill_cached_tokens,
                  accepted_draft_tokens=u.accepted_draft_tokens)


class _Servicer(pb_grpc.InferenceServicer):
  """jaxinfer.v1.Inference over a Backend: proto in, proto out, errors as statuses."""

  def __init__(self, backend: Backend):
    self.b = backend

  async def _refuse(self, context, e: JaxinferError):
    self.b.reject(e)
    await context.abort(status_of(e), str(e))

  async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
    b = self.b
    rid = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
    try:
      if b.draining:  # before parsing: a draining server owes no validation
        raise Unavailable("the server is shutting down")
      prompt, ids, params = b.parse(_prompt_from_proto(request), sampling_from_proto(request.sampling))
      hint = dict(context.invocation_metadata() or ()).get(PREFILL_WORKER_METADATA)
      gen = b.generate(ids, params, request_id=rid, prompt=prompt, prefill_worker=hint)
    except JaxinferError as e:
      await self._refuse(context, e)
    async with gen:  # leaving early (cancel, deadline, disconnect) aborts it in the engine
      try:
        async for out in gen:
          if request.stream and (out.new_token_ids or out.new_text or out.finished):
            yield response_from_output(rid, out, whole=False,
                                       usage=_usage_to_proto(gen.usage(out)) if out.finished else None)
          elif out.finished:
            yield response_from_output(rid, out, whole=True, usage=_usage_to_proto(gen.usage(out)))
      except JaxinferError as e:
        message = str(e) if isinstance(e, RequestFailed) else f"request {rid}: {e}"
        await context.abort(status_of(e), message)

  async def Tokenize(self, request: pb.TokenizeRequest, context):
    b = self.b
    try:
      which = request.WhichOneof("input")
      if which is None:
        b.require_tokenizer("Tokenize")
        raise InvalidRequestError("input: set text or chat")
      if which == "chat":
        ids = b.tokenize(messages_from_proto(request.chat))
      else:
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = b.tokenize(request.text, add_special_tokens=add)
      pieces = b.token_pieces(ids)
    except JaxinferError as e:
      await self._refuse(context, e)
    return pb.TokenizeResponse(token_ids=ids, tokens=pieces)

  async def Detokenize(self, request: pb.DetokenizeRequest, context):
    try:
      text = self.b.detokenize(list(request.token_ids), skip_special_tokens=request.skip_special_tokens)
    except JaxinferError as e:
      await self._refuse(context, e)
    return pb.DetokenizeResponse(text=text)

  async def GetModelInfo(self, request, context):
    i = self.b.model_info
    return pb.ModelInfo(model=i.model, max_model_len=i.max_model_len, vocab_size=i.vocab_size,
                        dtype=i.dtype, devices=list(i.devices), max_num_seqs=i.max_num_seqs,
                        page_size=i.page_size, num_pages=i.num_pages, architecture=i.architecture,
                        eos_token_ids=list(i.eos_token_ids), role=i.role,
                        prefill_workers=list(i.prefill_workers))


_KV_KINDS = {"stored": kv_pb.KVEvent.STORED, "removed": kv_pb.KVEvent.REMOVED}


def kv_event_to_proto(e: KVEvent) -> kv_pb.KVEvent:
  m = kv_pb.KVEvent(kind=_KV_KINDS[e.kind], block_hash=e.block_hash)
  if e.parent_hash is not None:
    m.parent_hash = e.parent_hash
  return m


class _KVSubscription(KVWatcher):
  """One WatchKVEvents call's bounded queue: filled from the engine thread, read on the loop."""

  def __init__(self, loop: asyncio.AbstractEventLoop, capacity: int):
    self._loop, self._capacity = loop, capacity
    self._items: collections.deque = collections.deque()
    self._ready = asyncio.Event()
    self.overflowed = False

  # engine thread
  def snapshot(self, seq: int, block_hashes: list[int]) -> None:
    self._post(("snapshot", seq, block_hashes))

  def batch(self, seq: int, events: list[KVEvent]) -> None:
    self._post(("batch", seq, events))

  def _post(self, item) -> None:
    if self.closed:
      return
    try:
      self._loop.call_soon_threadsafe(self._put, item)
    except RuntimeError:  # the loop is closed
      self.closed = True

  # loop thread
  def _put(self, item) -> None:
    if self.closed:
      return
    if len(self._items) >= self._capacity:
      # Dropped, not blocked on: a gap would make the subscriber's index wrong, and
      # waiting would stall the engine. It resubscribes and starts from a snapshot.
      self.overflowed = self.closed = True
    else:
      self._items.append(item)
    self._ready.set()

  async def get(self):
    """The next (kind, seq, payload), or None once dropped for falling behind."""
    while not self._items:
      if self.overflowed:
        return None
      self._ready.clear()
      await self._ready.wait()
    return self._items.popleft()


class _KVEventsServicer(kv_pb_grpc.KVEventsServicer):
  """jaxinfer.v1.KVEvents over a local engine's event stream."""

  def __init__(self, backend: EngineBackend, capacity: int):
    self.b, self.capacity = backend, capacity

  async def WatchKVEvents(self, request, context):
    sub = _KVSubscription(asyncio.get_running_loop(), self.capacity)
    self.b.watch_kv_events(sub)
    block_size = self.b.model_info.page_size
    try:
      while True:
        item = await sub.get()
        if item is None:
          await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"KV event subscriber fell behind: {self.capacity} batches were queued "
                              f"unread (kv_event_buffer); subscribe again to start from a fresh snapshot")
        kind, seq, payload = item
        if kind == "snapshot":
          yield kv_pb.WatchKVEventsResponse(
              snapshot=kv_pb.KVSnapshot(seq=seq, block_hashes=payload, block_size=block_size))
        else:
          yield kv_pb.WatchKVEventsResponse(
              batch=kv_pb.KVEventBatch(seq=seq, events=[kv_event_to_proto(e) for e in payload]))
    finally:
      sub.closed = True  # the engine thread forgets it on its next batch


class _Undecodable:
  """What a request deserializer returns for bytes protobuf refuses (see _RejectUndecodable)."""

  def __init__(self, message: str):
    self.message = message


class _RejectUndecodable(grpc.aio.ServerInterceptor):
  """Request bytes that do not decode as the method's message (invalid UTF-8 in a
  string field, e.g. text bytes ff fe or an encoded surrogate in `stop`; truncated
  or garbled bytes) are INVALID_ARGUMENT naming the message type.

  gRPC decodes a request before any handler runs, and a deserializer that raises
  becomes UNKNOWN with a traceback in the log. So the deserializer returns a
  marker instead, and the handler is wrapped to refuse it first.
  """

  def __init__(self, backend: Backend):
    self._backend = backend

  async def intercept_service(self, continuation, details):
    handler = await continuation(details)
    if (handler is None or handler.request_deserializer is None
        or not details.method.startswith(f"/{SERVICE_NAME}/")):
      return handler
    decode, backend = handler.request_deserializer, self._backend
    method = details.method.rsplit("/", 1)[-1]

    def deserialize(data: bytes):
      try:
        return decode(data)
      except Exception as e:  # protobuf's DecodeError; the message names no field
        return _Undecodable(f"{method}: the request bytes are not a valid {SERVICE_NAME}.{method} "
                            f"request message (invalid UTF-8 in a string field, or corrupt bytes): {e}")

    async def refuse(request, context):
      backend.reject(InvalidRequestError(request.message))
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)

    if handler.unary_stream is not None:
      inner = handler.unary_stream

      async def unary_stream(request, context):
        if isinstance(request, _Undecodable):
          await refuse(request, context)
        async for response in inner(request, context):
          yield response
      return handler._replace(request_deserializer=deserialize, unary_stream=unary_stream)
    if handler.unary_unary is not None:
      inner_unary = handler.unary_unary

      async def unary_unary(request, context):
        if isinstance(request, _Undecodable):
          await refuse(request, context)
        return await inner_unary(request, context)
      return handler._replace(request_deserializer=deserialize, unary_unary=unary_unary)
    return handler


def _uvicorn_server(config: "uvicorn.Config") -> "uvicorn.Server":
  import uvicorn

  class Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # serve() owns SIGTERM / SIGINT: one drain for both listeners
      yield

  return Server(config)


class InferenceServer:
  """gRPC server (+ health, reflection), optional OpenAI HTTP server and metrics
  endpoint, all over one Backend for one model.

  `backend`: any Backend, or an `LLM` (wrapped in an EngineBackend with this
  config's admission limits; `warmup` says whether its engine thread warms up).
  """

  def __init__(self, backend: Backend | LLM, config: ServerConfig = ServerConfig(), *, warmup: bool = True):
    self.llm: LLM | None = None
    if isinstance(backend, LLM):
      self.llm = backend
      backend = EngineBackend(backend, max_waiting_requests=config.max_waiting_requests,
                              max_waiting_tokens=config.max_waiting_tokens,
                              stream_buffer=config.stream_buffer, warmup=warmup)
    self.config = config
    self.health = health.aio.HealthServicer()
    self.backend: Backend = backend
    self.metrics = backend.metrics
    self.port: int | None = None
    self.http_port: int | None = None
    self.metrics_port: int | None = None
    self._server: grpc.aio.Server | None = None
    self._http: "uvicorn.Server | None" = None
    self._http_task: asyncio.Task | None = None
    self._httpd = None
    self._loop: asyncio.AbstractEventLoop | None = None
    self._stopped: asyncio.Event | None = None
    self._thread: threading.Thread | None = None
    self._ready_task: asyncio.Task | None = None

  @property
  def draining(self) -> bool:
    return self.backend.draining

  @property
  def engine_loop(self):
    """The local engine's thread (an EngineBackend's only)."""
    if not isinstance(self.backend, EngineBackend):
      raise AttributeError(f"{type(self.backend).__name__} runs no local engine")
    return self.backend.engine_loop

  # ---- lifecycle -----------------------------------------------------------------

  async def start(self) -> int:
    """Listens (health NOT_SERVING) and starts the engine thread; SERVING once warm."""
    self._loop = asyncio.get_running_loop()
    self._stopped = asyncio.Event()
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)],  # a port in use is an error
                             interceptors=[_RejectUndecodable(self.backend)])
    pb_grpc.add_InferenceServicer_to_server(_Servicer(self.backend), server)
    self.kv_connector = None  # a decode worker's DecodeConnector
    if self.config.role != "both":  # prefill/decode disaggregation
      from jaxinfer.serving import disagg
      self.kv_connector = disagg.attach(self.config.role, self.backend, server,
                                        prefill_workers=self.config.prefill_workers,
                                        timeout_s=self.config.kv_transfer_timeout_s)
    if isinstance(self.backend, EngineBackend):
      self.backend.set_role(self.config.role, self.kv_connector)
    services = [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME]
    if isinstance(self.backend, EngineBackend):
      kv_pb_grpc.add_KVEventsServicer_to_server(
          _KVEventsServicer(self.backend, self.config.kv_event_buffer), server)
      services.append(KV_EVENTS_SERVICE_NAME)
    health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
    for name in ("", SERVICE_NAME):
      await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(tuple(services), server)
    address = f"{self.config.host}:{self.config.port}"
    try:
      self.port = server.add_insecure_port(address)
    except RuntimeError as e:
      raise JaxinferError(f"cannot listen on {address}: {e}") from None
    if self.config.http_port is not None:
      await self._start_http()
    await server.start()
    self._server = server
    if self.config.metrics_port is not None:
      from prometheus_client import start_http_server
      self._httpd, _ = start_http_server(self.config.metrics_port, self.config.host,
                                         registry=self.metrics.registry)
      self.metrics_port = self._httpd.server_port
    self.backend.start()
    self._ready_task = asyncio.ensure_future(self._serving_when_ready())
    log.info("listening on %s:%d%s", self.config.host, self.port,
             f" (OpenAI HTTP on port {self.http_port})" if self.http_port is not None else "")
    return self.port

  async def _start_http(self) -> None:
    """uvicorn on this loop: the HTTP handlers share the Backend with gRPC, no second engine."""
    import uvicorn

    from jaxinfer.serving.openai_api import create_app

    host, port = self.config.host, self.config.http_port
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
      sock.bind((host, port))  # bound here so that port 0 is known before serving, and a busy port fails now
    except OSError as e:
      sock.close()
      raise JaxinferError(f"cannot listen on {host}:{port} (HTTP): {e}") from None
    self.http_port = sock.getsockname()[1]
    app = create_app(self.backend, served_model_name=self.config.served_model_name)
    # lifespan off: the app has no startup work; signals stay with serve(), which drains both servers.
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5,
                            access_log=False)
    self._http = _uvicorn_server(config)
    self._http_task = asyncio.ensure_future(self._http.serve(sockets=[sock]))
    while not self._http.started:
      if self._http_task.done():  # startup failed: say why
        self._http_task.result()
        raise JaxinferError(f"the HTTP server on {host}:{self.http_port} did not start")
      await asyncio.sleep(0.01)

  async def _serving_when_ready(self) -> None:
    try:
      await self.backend.wait_ready()
    except JaxinferError:
      return  # health stays NOT_SERVING; wait_ready() tells whoever waits why
    if not self.backend.draining:
      for name in ("", SERVICE_NAME):
        await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

  async def wait_ready(self) -> None:
    """Returns once the backend is ready (warm, connected); raises what broke it."""
    await self.backend.wait_ready()

  async def shutdown(self, grace: float | None = None) -> dict[str, int]:
    """Drains: refuse new work (both transports), let in-flight requests finish
    within `grace` seconds, end the rest (UNAVAILABLE / an error event), then
    stop the servers and the engine thread."""
    b = self.backend
    if b.draining:
      await self._stopped.wait()
      return {}
    grace = self.config.grace_period_s if grace is None else grace
    b.draining = True
    await self.health.enter_graceful_shutdown()
    in_flight = b.num_active
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    while b.num_active and loop.time() < deadline:
      await asyncio.sleep(0.02)
    aborted = b.shut_down_all(f"the server shut down before it finished (grace period {grace:g} s)")
    until = loop.time() + 5.0
    while b.num_active and loop.time() < until:  # let the handlers send their status
      await asyncio.sleep(0.01)
    await self._server.stop(1.0)
    if self.kv_connector is not None:  # its channels to the prefill workers
      await self.kv_connector.close()
    if self._http is not None:
      self._http.should_exit = True
      await self._http_task
    await b.stop()
    if self._httpd is not None:
      self._httpd.shutdown()
      self._httpd.server_close()
    summary = {"in_flight": in_flight, "finished": in_flight - aborted, "aborted": aborted}
    log.info("stopped: %s", summary)
    self._stopped.set()
    return summary

  async def wait_for_termination(self) -> None:
    await self._stopped.wait()

  # ---- running on a thread of its own (notebooks, tests, benchmarks) ---------------

  def start_in_thread(self, wait_ready: bool = True, timeout: float = 600.0) -> "InferenceServer":
    """Runs the server's asyncio loop on a daemon thread; returns once it listens
    (and, with `wait_ready`, once warm-up finished)."""
    started = threading.Event()
    failure: list[BaseException] = []

    def main():
      loop = asyncio.new_event_loop()
      try:
        loop.run_until_complete(self.start())
      except BaseException as e:  # re-raised on the caller's thread
        failure.append(e)
        started.set()
        return
      started.set()
      loop.run_until_complete(self.wait_for_termination())
      loop.run_until_complete(loop.shutdown_asyncgens())
      loop.close()

    self._thread = threading.Thread(target=main, name="jaxinfer-grpc", daemon=True)
    self._thread.start()
    started.wait(timeout)
    if failure:
      raise failure[0]
    if wait_ready:
      ready = asyncio.run_coroutine_threadsafe(self.backend.wait_ready(), self._loop)
      try:
        ready.result(timeout)
      except TimeoutError:
        raise TimeoutError(f"the backend was not ready within {timeout} s") from None
      except JaxinferError:
        self.stop_in_thread(0)
        raise
    return self

  def stop_in_thread(self, grace: float | None = None) -> dict[str, int]:
    summary = asyncio.run_coroutine_threadsafe(self.shutdown(grace), self._loop).result()
    self._thread.join(30)
    return summary

  def call_engine(self, fn) -> Any:
    """fn(engine) on the engine thread (a consistent view between steps), e.g. stats."""
    return self.engine_loop.call(fn).result(60)


def serve(backend: Backend | LLM, config: ServerConfig = ServerConfig()) -> int:
  """Runs a server until SIGTERM / SIGINT, then drains. Returns the exit code.

  A second signal during the drain aborts what is left at once.
  """
  async def main() -> int:
    server = InferenceServer(backend, config)
    await server.start()
    where = f"{config.host}:{server.port}"
    http = (f"; OpenAI HTTP on http://{config.host}:{server.http_port}/v1"
            if server.http_port is not None else "")
    metrics = f"; metrics on http://{config.host}:{server.metrics_port}/metrics" if server.metrics_port else ""
    print(f"jaxinfer: listening on {where} ({server.backend.model_info.model}){http}{metrics}; warming up",
          file=sys.stderr, flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = []

    def on_signal(sig):
      signals.append(sig)
      if len(signals) == 1:
        print(f"jaxinfer: {signal.Signals(sig).name}: draining (grace period {config.grace_period_s:g} s)",
              file=sys.stderr, flush=True)
        stop.set()
      else:  # impatient: abort the rest now
        server.backend.shut_down_all("the server was stopped")

    for sig in (signal.SIGTERM, signal.SIGINT):
      loop.add_signal_handler(sig, on_signal, sig)
    ready = asyncio.ensure_future(server.wait_ready())
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({ready, waiter}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if ready.done() and ready.exception() is not None:
      print(f"jaxinfer: error: {ready.exception()}", file=sys.stderr, flush=True)
      code = 1
    elif not stop.is_set():
      print(f"jaxinfer: ready on {where} (health: SERVING)", file=sys.stderr, flush=True)
      await stop.wait()
    summary = await server.shutdown(0 if code else None)
    waiter.cancel()
    print(f"jaxinfer: stopped; {summary.get('finished', 0)} in-flight requests finished, "
          f"{summary.get('aborted', 0)} aborted", file=sys.stderr, flush=True)
    return code

  return asyncio.run(main())
