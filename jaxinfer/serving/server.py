"""The gRPC batching server: `jaxinfer.v1.Inference` over one `LLMEngine`.

    llm = LLM(warmup=False)                        # the engine thread warms up
    server = InferenceServer(llm, ServerConfig(port=50051, metrics_port=9090))
    server.start_in_thread()                       # or: await server.start() on your loop
    ...
    server.stop_in_thread()                        # drains within the grace period

Threads: grpc.aio handlers run on one asyncio loop; the engine runs on its
own thread (`EngineLoop`). A handler validates its request (tokenizing on
the loop), checks admission, posts it to the engine and then awaits its
`_Stream`: a bounded per-request queue that the engine thread fills through
`loop.call_soon_threadsafe`, so the engine never waits for a client. When
the queue is full, new deltas merge into the last queued one (the client
sees fewer, larger messages; nothing is dropped). A handler that ends
before its request finished (client cancel, deadline, disconnect) aborts it
in the engine, which frees its KV pages on its next command pass.

Status codes: INVALID_ARGUMENT (bad input, naming the field),
RESOURCE_EXHAUSTED (admission limits, naming the limit), FAILED_PRECONDITION
(the model has no tokenizer for a text prompt), UNAVAILABLE (shutting down),
INTERNAL (this request failed in the engine; the others go on).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import signal
import sys
import threading
import time
import uuid
from typing import Any

import grpc
import jax
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxinfer.engine.engine import RequestOutput
from jaxinfer.errors import InvalidRequestError, JaxinferError, TokenizerError
from jaxinfer.llm import LLM
from jaxinfer.serving.convert import (messages_from_proto, response_from_output,
                                      sampling_from_proto)
from jaxinfer.serving.engine_loop import EngineLoop, Sink
from jaxinfer.serving.metrics import Metrics
from jaxinfer.serving.proto import inference_pb2 as pb
from jaxinfer.serving.proto import inference_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name  # "jaxinfer.v1.Inference"


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """Network, admission and shutdown knobs (engine capacity lives in EngineConfig).

  Admission bounds the work that waits for the engine: requests admitted
  but without a first token yet, and their prompt tokens. Past either,
  Generate answers RESOURCE_EXHAUSTED at once instead of queueing without
  bound.
  """

  host: str = "127.0.0.1"
  port: int = 50051  # 0: any free port (see InferenceServer.port)
  max_waiting_requests: int = 256
  max_waiting_tokens: int = 131072
  stream_buffer: int = 64  # queued messages per request before deltas merge
  grace_period_s: float = 30.0  # shutdown: how long in-flight requests may take to finish
  metrics_port: int | None = None  # Prometheus HTTP endpoint; None: off, 0: any free port

  def __post_init__(self):
    for name in ("max_waiting_requests", "max_waiting_tokens", "stream_buffer"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InvalidRequestError(f"{name} must be a positive int, got {v!r}")
    for name in ("port", "metrics_port"):
      v = getattr(self, name)
      if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 65536):
        raise InvalidRequestError(f"{name} must be in [0, 65536), got {v!r}")
    if not self.grace_period_s >= 0:
      raise InvalidRequestError(f"grace_period_s must be >= 0, got {self.grace_period_s!r}")


class _Shutdown(Exception):
  """Put into the streams still running when the grace period ends."""


def _status_of(e: BaseException) -> grpc.StatusCode:
  if isinstance(e, InvalidRequestError):
    return grpc.StatusCode.INVALID_ARGUMENT
  if isinstance(e, TokenizerError):
    return grpc.StatusCode.FAILED_PRECONDITION
  if isinstance(e, _Shutdown):
    return grpc.StatusCode.UNAVAILABLE
  return grpc.StatusCode.INTERNAL


class _Admission:
  """A request's claim on the waiting budget, given back once (first token or end)."""

  def __init__(self, server: "InferenceServer", tokens: int):
    self._server, self.tokens, self._held = server, tokens, True
    server._waiting_requests += 1
    server._waiting_tokens += tokens

  def release(self) -> None:
    if self._held:
      self._held = False
      self._server._waiting_requests -= 1
      self._server._waiting_tokens -= self.tokens


class _Stream(Sink):
  """A request's bounded output queue: filled from the engine thread, read on the loop."""

  def __init__(self, loop: asyncio.AbstractEventLoop, capacity: int, admission: _Admission):
    super().__init__()
    self._loop = loop
    self._capacity = capacity
    self._admission = admission
    self._items: collections.deque = collections.deque()
    self._ready = asyncio.Event()

  # engine thread
  def deliver(self, out: RequestOutput) -> None:
    self._post(out)

  def fail(self, error: BaseException) -> None:
    self._post(error)

  def _post(self, item) -> None:
    try:
      self._loop.call_soon_threadsafe(self.put, item)
    except RuntimeError:  # the loop is closed: nobody is listening any more
      pass

  # loop thread
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


class _Servicer(pb_grpc.InferenceServicer):
  def __init__(self, server: "InferenceServer"):
    self.s = server

  async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
    s = self.s
    rid = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
    if s.draining:
      await s.reject(context, grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
    try:
      prompt, ids, params = s.parse_generate(request)
    except JaxinferError as e:
      await s.reject(context, _status_of(e), str(e))
    admission = s.admit(len(ids))
    if isinstance(admission, str):
      await s.reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, admission)
    key = f"{rid}#{next(s._keys)}"  # the engine's id: unique even when clients reuse theirs
    stream = _Stream(asyncio.get_running_loop(), s.config.stream_buffer, admission)
    s.active[key] = stream
    s.engine_loop.add(key, ids, params, stream, prompt=prompt)
    finished = False
    try:
      while not finished:
        item = await stream.get()
        if isinstance(item, BaseException):
          finished = not isinstance(item, _Shutdown)
          await context.abort(_status_of(item), f"request {rid}: {item}")
        finished = item.finished
        if item.finish_reason == "error":
          await context.abort(grpc.StatusCode.INTERNAL, f"request {rid} failed in the engine: {item.error}")
        if request.stream and (item.new_token_ids or item.new_text or finished):
          yield response_from_output(rid, item, whole=False, usage=s.usage(item, stream) if finished else None)
        elif finished:
          yield response_from_output(rid, item, whole=True, usage=s.usage(item, stream))
    finally:
      admission.release()
      s.active.pop(key, None)
      if not finished:  # cancelled, past its deadline, disconnected or shut down: free its pages now
        s.engine_loop.abort(key)

  async def Tokenize(self, request: pb.TokenizeRequest, context):
    s = self.s
    try:
      tok = s.llm._require_tokenizer("Tokenize")
      which = request.WhichOneof("input")
      if which is None:
        raise InvalidRequestError("input: set text or chat")
      if which == "chat":
        _, ids = s.llm.encode_prompt(messages_from_proto(request.chat))
      else:
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = tok.encode(request.text, add_special_tokens=add)
    except JaxinferError as e:
      await s.reject(context, _status_of(e), str(e))
    return pb.TokenizeResponse(token_ids=ids, tokens=[tok.id_to_token(t) for t in ids])

  async def Detokenize(self, request: pb.DetokenizeRequest, context):
    s = self.s
    try:
      tok = s.llm._require_tokenizer("Detokenize")
      ids = list(request.token_ids)
      if ids:
        s.llm.engine.check_token_ids(ids)
    except JaxinferError as e:
      await s.reject(context, _status_of(e), f"token_ids: {e}" if isinstance(e, InvalidRequestError) else str(e))
    return pb.DetokenizeResponse(text=tok.decode(ids, skip_special_tokens=request.skip_special_tokens))

  async def GetModelInfo(self, request, context):
    return self.s.model_info


class InferenceServer:
  """gRPC server + engine thread + health + reflection + metrics, for one model."""

  def __init__(self, llm: LLM, config: ServerConfig = ServerConfig(), *, warmup: bool = True):
    self.llm = llm
    self.config = config
    self.metrics = Metrics()
    self.health = health.aio.HealthServicer()
    self.engine_loop = EngineLoop(llm.engine, self.metrics, warmup=warmup, on_ready=self._engine_ready)
    self.active: dict[str, _Stream] = {}
    self.draining = False
    self.port: int | None = None
    self.metrics_port: int | None = None
    self._keys = itertools.count()
    self._waiting_requests = 0
    self._waiting_tokens = 0
    self._server: grpc.aio.Server | None = None
    self._httpd = None
    self._loop: asyncio.AbstractEventLoop | None = None
    self._stopped: asyncio.Event | None = None
    self._thread: threading.Thread | None = None
    e, cfg = llm.engine, llm.config
    self.model_info = pb.ModelInfo(
        model=str(getattr(llm, "source", "")), max_model_len=e.max_model_len, vocab_size=cfg.vocab_size,
        dtype=str(llm.runner.dtype), devices=[str(d) for d in jax.devices()],
        max_num_seqs=e.engine_config.max_num_seqs, page_size=e.engine_config.page_size,
        num_pages=e.kv.num_pages, architecture=cfg.architecture, eos_token_ids=list(e.eos_ids))

  # ---- request handling (loop thread) -----------------------------------------------

  def parse_generate(self, request: pb.GenerateRequest):
    """(prompt text, prompt ids, SamplingParams) or InvalidRequestError naming the field."""
    which = request.WhichOneof("prompt")
    if which is None:
      raise InvalidRequestError("prompt: set one of text, token_ids, chat")
    if which == "text":
      prompt = request.text
    elif which == "token_ids":
      prompt = list(request.token_ids.ids)
    else:
      prompt = messages_from_proto(request.chat)
    params = sampling_from_proto(request.sampling)
    text, ids = self.llm.encode_prompt(prompt)
    self.llm.engine.validate(ids, params)
    return text, ids, params

  def admit(self, num_tokens: int) -> _Admission | str:
    """A claim on the waiting budget, or the message saying which limit is full."""
    c = self.config
    if self._waiting_requests >= c.max_waiting_requests:
      return (f"server busy: {self._waiting_requests} requests are waiting "
              f"(max_waiting_requests={c.max_waiting_requests}); retry later")
    if self._waiting_tokens + num_tokens > c.max_waiting_tokens:
      return (f"server busy: {self._waiting_tokens} prompt tokens are waiting and this request adds "
              f"{num_tokens} (max_waiting_tokens={c.max_waiting_tokens}); retry later")
    return _Admission(self, num_tokens)

  async def reject(self, context, code: grpc.StatusCode, message: str):
    self.metrics.rejected_requests.labels(code.name).inc()
    await context.abort(code, message)

  def usage(self, out: RequestOutput, stream: _Stream) -> pb.Usage:
    first = stream.first_token_at
    last = stream.last_token_at or time.monotonic()
    return pb.Usage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(out.token_ids),
                    cached_tokens=out.num_cached_tokens,
                    time_to_first_token_s=(first - stream.arrival) if first is not None else 0.0,
                    latency_s=last - stream.arrival)

  # ---- lifecycle -----------------------------------------------------------------

  async def start(self) -> int:
    """Listens (health NOT_SERVING) and starts the engine thread; SERVING once warm."""
    self._loop = asyncio.get_running_loop()
    self._stopped = asyncio.Event()
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])  # a port in use is an error
    pb_grpc.add_InferenceServicer_to_server(_Servicer(self), server)
    health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
    for name in ("", SERVICE_NAME):
      await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{self.config.host}:{self.config.port}"
    try:
      self.port = server.add_insecure_port(address)
    except RuntimeError as e:
      raise JaxinferError(f"cannot listen on {address}: {e}") from None
    await server.start()
    self._server = server
    if self.config.metrics_port is not None:
      from prometheus_client import start_http_server
      self._httpd, _ = start_http_server(self.config.metrics_port, self.config.host,
                                         registry=self.metrics.registry)
      self.metrics_port = self._httpd.server_port
    self.engine_loop.start()
    log.info("listening on %s:%d", self.config.host, self.port)
    return self.port

  def _engine_ready(self) -> None:  # engine thread
    async def serving():
      for name in ("", SERVICE_NAME):
        await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
    asyncio.run_coroutine_threadsafe(serving(), self._loop)

  async def wait_ready(self) -> None:
    """Returns once warm-up finished; raises what broke it."""
    await asyncio.get_running_loop().run_in_executor(None, self.engine_loop.ready.wait)
    if self.engine_loop.error is not None:
      raise JaxinferError(f"engine warm-up failed: {self.engine_loop.error}") from self.engine_loop.error

  async def shutdown(self, grace: float | None = None) -> dict[str, int]:
    """Drains: refuse new work, let in-flight requests finish within `grace`
    seconds, abort the rest (UNAVAILABLE), then stop the engine thread."""
    if self.draining:
      await self._stopped.wait()
      return {}
    grace = self.config.grace_period_s if grace is None else grace
    self.draining = True
    await self.health.enter_graceful_shutdown()
    in_flight = len(self.active)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    while self.active and loop.time() < deadline:
      await asyncio.sleep(0.02)
    left = list(self.active.values())
    for stream in left:
      stream.put(_Shutdown(f"the server shut down before it finished (grace period {grace:g} s)"))
    until = loop.time() + 5.0
    while self.active and loop.time() < until:  # let the handlers send their status
      await asyncio.sleep(0.01)
    await self._server.stop(1.0)
    await loop.run_in_executor(None, self.engine_loop.stop)
    if self._httpd is not None:
      self._httpd.shutdown()
      self._httpd.server_close()
    summary = {"in_flight": in_flight, "finished": in_flight - len(left), "aborted": len(left)}
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
    if wait_ready and not self.engine_loop.ready.wait(timeout):
      raise TimeoutError(f"the engine did not finish warm-up within {timeout} s")
    if self.engine_loop.error is not None:
      self.stop_in_thread(0)
      raise JaxinferError(f"engine warm-up failed: {self.engine_loop.error}")
    return self

  def stop_in_thread(self, grace: float | None = None) -> dict[str, int]:
    summary = asyncio.run_coroutine_threadsafe(self.shutdown(grace), self._loop).result()
    self._thread.join(30)
    return summary

  def call_engine(self, fn) -> Any:
    """fn(engine) on the engine thread (a consistent view between steps), e.g. stats."""
    return self.engine_loop.call(fn).result(60)


def serve(llm: LLM, config: ServerConfig = ServerConfig()) -> int:
  """Runs a server until SIGTERM / SIGINT, then drains. Returns the exit code.

  A second signal during the drain aborts what is left at once.
  """
  async def main() -> int:
    server = InferenceServer(llm, config)
    await server.start()
    where = f"{config.host}:{server.port}"
    metrics = f"; metrics on http://{config.host}:{server.metrics_port}/metrics" if server.metrics_port else ""
    print(f"jaxinfer: listening on {where} ({llm.source}){metrics}; warming up", file=sys.stderr, flush=True)
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
        for stream in list(server.active.values()):
          stream.put(_Shutdown("the server was stopped"))

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
