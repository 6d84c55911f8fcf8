"""The engine thread: the only thread that touches the `LLMEngine` once started.

RPC handlers never call the engine. They post commands (add, abort) to a
queue; the thread takes every pending command between steps, runs a step,
and hands each output to its request's `Sink`. A sink must return at once
(the server's sink only schedules a callback on the asyncio loop), so a slow
client can never stall the batch.

    loop = EngineLoop(engine, metrics)
    loop.start()                    # warm-up runs on the thread; loop.ready is set after it
    loop.add("r1", ids, params, sink)
    loop.abort("r1")                # pages are free once the thread takes the command
    loop.watch_kv_events(watcher)   # a snapshot of the prefix cache, then numbered event batches
    loop.stop()

KV events: after every pass (commands, then a step) the thread drains the
engine's prefix-cache events and, if there were any, numbers them as one
batch (1, 2, ... per process, whether anyone watches or not) and hands it to
every watcher. A new watcher first gets the cache's full set of block hashes
as of the last batch number, so snapshot + later batches = the cache.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any, Callable

from jaxinfer.engine.engine import LLMEngine, RequestOutput
from jaxinfer.engine.kv_manager import KVEvent
from jaxinfer.errors import InvalidRequestError
from jaxinfer.frontend import ValidRequest
from jaxinfer.serving.metrics import Metrics

log = logging.getLogger(__name__)

# Seconds an idle multi-host leader waits before pinging its followers (jaxinfer.distributed).
KEEPALIVE_S = 20.0


class Sink:
  """Where a request's outputs go. Called on the engine thread: must not block.

  The engine loop stamps `first_token_at` / `last_token_at`
  (time.monotonic) before each `deliver`; `arrival` is set by whoever
  created the request.
  """

  def __init__(self, arrival: float | None = None):
    self.arrival = time.monotonic() if arrival is None else arrival
    self.first_token_at: float | None = None
    self.last_token_at: float | None = None

  def deliver(self, out: RequestOutput) -> None:
    raise NotImplementedError

  def fail(self, error: BaseException) -> None:
    """The request never reached the engine (e.g. InvalidRequestError) or the loop broke."""
    raise NotImplementedError


class LoopSink(Sink):
  """A sink read on an asyncio loop: each output or error is handed to `on_loop`
  there (scheduled with call_soon_threadsafe, so the engine thread never waits)."""

  def __init__(self, loop: asyncio.AbstractEventLoop):
    super().__init__()
    self._loop = loop

  def deliver(self, out: RequestOutput) -> None:
    self._post(out)

  def fail(self, error: BaseException) -> None:
    self._post(error)

  def _post(self, item: RequestOutput | BaseException) -> None:
    try:
      self._loop.call_soon_threadsafe(self.on_loop, item)
    except RuntimeError:  # the loop is closed: nobody is listening any more
      pass

  def on_loop(self, item: RequestOutput | BaseException) -> None:
    """Runs on the loop thread."""
    raise NotImplementedError


class KVWatcher:
  """Where a subscriber's KV events go. Called on the engine thread: must not block.

  Set `closed` (any thread) to unsubscribe; the engine thread drops it on its next batch.
  """

  closed: bool = False

  def snapshot(self, seq: int, block_hashes: list[int]) -> None:
    raise NotImplementedError

  def batch(self, seq: int, events: list[KVEvent]) -> None:
    raise NotImplementedError


class EngineLoop:
  """Runs `engine` on its own thread, fed by a command queue."""

  def __init__(self, engine: LLMEngine, metrics: Metrics | None = None, *, warmup: bool = True,
               on_ready: Callable[[], None] | None = None):
    self.engine = engine
    self.metrics = metrics
    self._warmup = warmup
    self._on_ready = on_ready
    self._commands: queue.SimpleQueue = queue.SimpleQueue()
    self._sinks: dict[str, Sink] = {}
    self._watchers: list[KVWatcher] = []
    self.kv_seq = 0  # the number of the last KV event batch (engine thread)
    self.ready = threading.Event()
    self.error: BaseException | None = None  # set when warm-up failed
    self._thread = threading.Thread(target=self._main, name="jaxinfer-engine", daemon=True)

  # ---- any thread ------------------------------------------------------------------

  def start(self) -> "EngineLoop":
    self._thread.start()
    return self

  def add(self, request_id: str, request: ValidRequest, sink: Sink, *, hold_kv: bool = False,
          kv_source: str | None = None) -> None:
    """Queues a request its backend checked (jaxinfer.frontend). hold_kv: its KV pages
    outlive it (a transfer reads them) until `call(lambda e: e.release_kv(request_id))`
    frees them. kv_source: the prefill worker a decode worker's connector must take its
    prompt KV from."""
    self._commands.put(("add", request_id, request, sink, hold_kv, kv_source))

  def abort(self, request_id: str) -> None:
    self._commands.put(("abort", request_id))

  def fail(self, request_id: str, error: BaseException) -> None:
    """Ends a request with `error` (its sink's `fail`), e.g. its KV transfer failed; pages freed."""
    self._commands.put(("fail", request_id, error))

  def watch_kv_events(self, watcher: KVWatcher) -> None:
    self._commands.put(("watch", watcher))

  def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
    """Runs fn(engine) on the engine thread between steps (a consistent view of its state)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._commands.put(("call", fn, future))
    return future

  def stop(self, timeout: float | None = 30.0) -> None:
    """Aborts whatever is left and ends the thread."""
    if self._thread.is_alive():
      self._commands.put(("stop",))
      self._thread.join(timeout)

  # ---- the engine thread -------------------------------------------------------------

  def _main(self) -> None:
    try:
      if self._warmup:
        t = time.perf_counter()
        self.engine.warmup()
        log.info("warm-up: %d programs compiled in %.1f s", self.engine.runner.compiled_programs(),
                 time.perf_counter() - t)
    except BaseException as e:  # reported through .error; the server refuses to start
      log.exception("warm-up failed")
      self.error = e
      self.ready.set()
      return
    self.ready.set()
    if self._on_ready is not None:
      self._on_ready()
    while True:
      # A step that scheduled nothing (requests waiting for remote KV, or for pages that
      # such requests hold) will schedule nothing until a command changes the state.
      commands = self._take_commands(block=not self.engine.has_unfinished() or self.engine.last_step_idle)
      for cmd in commands:
        if cmd[0] == "stop":
          self._abort_all()
          return
        self._act(cmd)
      if self.engine.has_unfinished():
        self._step()
      self._publish_kv_events()

  def _take_commands(self, block: bool) -> list[tuple]:
    commands = []
    keepalive = getattr(self.engine.runner, "keepalive", None)  # a multi-host leader's
    while block and not commands:
      try:
        commands.append(self._commands.get(timeout=KEEPALIVE_S if keepalive else None))
      except queue.Empty:
        # Followers wait for the next call inside a collective, which may time out
        # if the leader stays idle too long: an empty call now and then resets it.
        keepalive()
    while True:
      try:
        commands.append(self._commands.get_nowait())
      except queue.Empty:
        return commands

  def _act(self, cmd: tuple) -> None:
    kind = cmd[0]
    if kind == "add":
      _, rid, request, sink, hold_kv, kv_source = cmd
      try:
        self.engine.add_request(rid, request, hold_kv=hold_kv, kv_source=kv_source)
      except Exception as e:  # the sink reports it; nothing was queued
        if not isinstance(e, InvalidRequestError):
          log.exception("adding request %s failed", rid)
        sink.fail(e)
        return
      self._sinks[rid] = sink
      if self.metrics is not None:
        self.metrics.prompt_tokens.inc(len(request))
    elif kind == "abort":
      self._sinks.pop(cmd[1], None)
      out = self.engine.abort(cmd[1])
      if out is not None and self.metrics is not None:
        self.metrics.finished_requests.labels("abort").inc()
        # The gauges move now: when this was the last request, no step follows to update them.
        self.metrics.set_engine_stats(self.engine.stats())
    elif kind == "watch":
      watcher = cmd[1]
      self._publish_kv_events()  # events still in the manager would be in the snapshot and in a batch
      watcher.snapshot(self.kv_seq, sorted(self.engine.kv.cached_hashes()))
      self._watchers.append(watcher)
    elif kind == "fail":
      _, rid, error = cmd
      sink = self._sinks.pop(rid, None)
      if self.engine.abort(rid) is not None and sink is not None:
        sink.fail(error)
        if self.metrics is not None:
          self.metrics.finished_requests.labels("error").inc()
          self.metrics.set_engine_stats(self.engine.stats())
    elif kind == "call":
      _, fn, future = cmd
      # A caller that gave up (asyncio.wrap_future cancels on cancel) gets nothing run, and
      # a cancelled future must never be resolved: set_result would raise on this thread.
      if not future.set_running_or_notify_cancel():
        return
      try:
        future.set_result(fn(self.engine))
      except Exception as e:  # handed to the caller
        future.set_exception(e)
      if self.metrics is not None:  # a call may free pages (release_kv): no step may follow
        self.metrics.set_engine_stats(self.engine.stats())

  def _step(self) -> None:
    try:
      outputs = self.engine.step()
    except Exception as e:  # a bug outside the per-request guards: end what is in flight
      log.exception("engine step raised; aborting every request in flight")
      for rid, sink in list(self._sinks.items()):
        self.engine.abort(rid)
        sink.fail(e)
      self._sinks.clear()
      return
    now = time.monotonic()
    m = self.metrics
    if m is not None:  # before any output goes out: a client that sees it sees these gauges
      m.set_engine_stats(self.engine.stats())
    for out in outputs:
      sink = self._sinks.get(out.request_id)
      if sink is None:
        continue
      n = len(out.new_token_ids)
      if n:
        if sink.first_token_at is None:
          sink.first_token_at = now
          if m is not None:
            m.time_to_first_token.observe(now - sink.arrival)
            m.prefix_cache_hit_tokens.inc(out.num_cached_tokens)
        elif m is not None:
          for _ in range(n):  # several tokens in one step share the gap
            m.inter_token_latency.observe((now - sink.last_token_at) / n)
        sink.last_token_at = now
        if m is not None:
          m.generation_tokens.inc(n)
      if out.finished:
        del self._sinks[out.request_id]
        if m is not None:
          m.finished_requests.labels(out.finish_reason).inc()
          m.request_latency.observe(now - sink.arrival)
      sink.deliver(out)

  def _publish_kv_events(self) -> None:
    events = self.engine.kv_events()
    if self._watchers:
      self._watchers = [w for w in self._watchers if not w.closed]
    if not events:
      return
    self.kv_seq += 1
    for w in self._watchers:
      w.batch(self.kv_seq, events)

  def _abort_all(self) -> None:
    for rid in list(self._sinks):
      out = self.engine.abort(rid)
      sink = self._sinks.pop(rid)
      if out is not None:
        sink.deliver(out)
