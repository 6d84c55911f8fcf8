"""Prefill/decode disaggregation over gRPC (`jaxinfer serve --role prefill|decode`).

    client --Generate--> decode worker                         prefill worker
                         engine admits the request:            (serves jaxinfer.v1.KVTransfer)
                         pages allocated, no compute  --Prefill(prompt, sampling + seed, skip_tokens)-->
                                                               runs the prompt to its first token
                                                               (max_tokens=1, pages held)
                                                      <--header: first token + logprobs, KV layout--
                         import_kv_tokens per chunk   <--chunks of pages (exported chunk by chunk)--
                                                      <--done(num_bytes)--
                         finish_remote_kv: the first
                         token is streamed, decoding  --Ack, half-close-->
                         goes on here                                    pages freed

The engine side is engine/kv_connector.py: `DecodeConnector` is the
consumer's connector (its hooks run on the engine thread and hand the
transfer to the server's asyncio loop); `KVTransferServicer` is the
producer's RPC.

Why gRPC streaming rather than jax.experimental.transfer: see the note
below the imports. Pages go as raw bytes (C order, the cache dtype; a
quantized cache's float32 scales after its values),
`pages_per_chunk` per message (a power of two up to 4 MiB, so the
export / import programs stay among the runner's bucketed few), in the
prefill worker's page size (its KVLayout says which): the decode worker
cuts each chunk into tokens and writes them into its own pages, so the two
may use different page sizes (the rest of the layout must match). The
request names tokens, not pages, for the same reason (`skip_tokens`).

Sampler state that crosses: the seed (the decode worker draws one for an
unseeded request and sends it, so the first token is the one a single
worker samples: each token's key is fold_in(seed, position)); back come the
first token, its logprob and top logprobs. The penalty history and the
grammar matcher are rebuilt on the decode side from prompt + first token.

Prefix cache: the decode worker looks its own cache up first and asks only
for the tokens after its hits (`skip_tokens`); the prefill worker computes
the whole prompt anyway (its own prefix cache permitting), since it needs
the prompt's last logits. Requests with prompt_logprobs are computed on the
decode worker (they need every prompt position's logits).

Cancel safety. Decode side: the client's cancel / deadline aborts the
request in the engine, which frees its pages and (request_finished) cancels
the transfer task, which cancels the Prefill call. A transfer that takes
longer than --kv-transfer-timeout ends the request with DEADLINE_EXCEEDED;
a prefill worker that dies or refuses, with UNAVAILABLE (or its status); a
transfer whose layout, page count or bytes do not match, or that ends
early, with INTERNAL naming what differs; pages freed each time. Prefill
side: the pages are held from the first token until the Ack; a cancelled
call, a dead peer or no Ack within --kv-transfer-timeout frees them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import math
import time
from typing import Callable, Mapping, Sequence

import grpc
import numpy as np

from jaxinfer.engine.engine import RequestOutput
from jaxinfer.engine.kv_connector import KVConnector, KVLayout, KVTransferError, KVTransferTimeout
from jaxinfer.engine.kv_transfer import MAX_TRANSFER_PAGES
from jaxinfer.errors import InvalidRequestError, JaxinferError
from jaxinfer.serving.backend import Overloaded, Unavailable
from jaxinfer.serving.convert import sampling_from_proto, sampling_to_proto
from jaxinfer.serving.engine_loop import LoopSink
from jaxinfer.serving.metrics import Metrics
from jaxinfer.serving.proto import inference_pb2 as pb
from jaxinfer.serving.proto import kv_transfer_pb2 as kv_pb
from jaxinfer.serving.proto import kv_transfer_pb2_grpc as kv_grpc
from jaxinfer.serving.server import status_of

log = logging.getLogger(__name__)

KV_TRANSFER_SERVICE_NAME = kv_pb.DESCRIPTOR.services_by_name["KVTransfer"].full_name  # "jaxinfer.v1.KVTransfer"
ROLES = ("both", "prefill", "decode")
CHUNK_BYTES = 4 << 20  # per KVChunk message; under the channel's 64 MiB receive limit with room
MAX_MESSAGE_BYTES = 64 << 20

# Why not jax.experimental.transfer (checked with jax 0.10.2 on CPU): it works there: two
# processes, start_transfer_server + await_pull / connect().pull, moved a 512-token SmolLM2
# prompt's KV, though no faster than this gRPC stream on CPU (benchmarks/results/kv-transfer-*.json;
# docs/performance.md, "kv-transfer"). It is not used (yet) because a pending await_pull cannot be cancelled, only
# timed out (absolute deadline), so a decode worker that is cancelled or dies leaves the
# producer's buffers referenced until then; a gRPC stream cancels both ways at once and
# carries statuses, deadlines and the first token on the server's own port. The
# export_pages / import_pages seam is where a device-to-device path would plug in.


class PrefillUnavailable(Unavailable):
  """The prefill worker could not be reached, or went away mid-transfer (UNAVAILABLE)."""


# ---- wire format ------------------------------------------------------------------------

def layout_to_proto(l: KVLayout) -> kv_pb.KVLayout:
  return kv_pb.KVLayout(num_layers=l.num_layers, page_size=l.page_size, num_kv_heads=l.num_kv_heads,
                        head_dim=l.head_dim, dtype=l.dtype, names=list(l.names), scale_groups=l.scale_groups)


def layout_from_proto(m: kv_pb.KVLayout) -> KVLayout:
  return KVLayout(num_layers=m.num_layers, page_size=m.page_size, num_kv_heads=m.num_kv_heads,
                  head_dim=m.head_dim, dtype=m.dtype, names=tuple(m.names), scale_groups=m.scale_groups)


def pages_per_chunk(layout: KVLayout, chunk_bytes: int = CHUNK_BYTES) -> int:
  """Pages per KVChunk: a power of two (a runner transfer bucket) of at most chunk_bytes, >= 1."""
  n = max(1, chunk_bytes // max(1, layout.page_bytes))
  return min(MAX_TRANSFER_PAGES, 1 << (n.bit_length() - 1))


def pack_pages(arrays: Sequence[Mapping[str, np.ndarray]], layout: KVLayout) -> bytes:
  """KVChunk.data: per layer, each array of layout.names, then (a quantized cache) each
  one's float32 scales, in C order, little-endian."""
  return b"".join(np.ascontiguousarray(layer[name]).astype(dtype.newbyteorder("<"), copy=False).tobytes()
                  for layer in arrays for name, dtype in _wire_arrays(layout))


def unpack_pages(data: bytes, num_pages: int, layout: KVLayout) -> list[dict[str, np.ndarray]]:
  """The inverse of pack_pages, or KVTransferError when the byte count is not num_pages pages'.
  Values come as [num_pages, page_size, num_kv_heads, head_dim]; scales as [..., num_kv_heads,
  scale_groups], or [..., num_kv_heads] with one group (the cache's own per-head shape)."""
  want = num_pages * layout.page_bytes
  if len(data) != want:
    raise KVTransferError(f"a chunk of {num_pages} pages carries {len(data)} bytes, expected {want} "
                          f"({layout.page_bytes} per page)")
  lead = (num_pages, layout.page_size, layout.num_kv_heads)
  out, at = [], 0
  for _ in range(layout.num_layers):
    layer = {}
    for name, dtype in _wire_arrays(layout):
      if name not in layout.scale_names:
        last = (layout.head_dim,)
      else:  # one group: the cache's own per-head scale shape
        last = (layout.scale_groups,) if layout.scale_groups > 1 else ()
      count = math.prod(lead + last)
      a = np.frombuffer(data, dtype.newbyteorder("<"), count=count, offset=at).reshape(lead + last)
      layer[name] = a.astype(dtype, copy=False)
      at += count * dtype.itemsize
    out.append(layer)
  return out


def _wire_arrays(layout: KVLayout) -> list[tuple[str, np.dtype]]:
  """(name, dtype) of each array of one layer, in wire order."""
  return ([(n, np.dtype(layout.dtype)) for n in layout.names]
          + [(n, np.dtype(np.float32)) for n in layout.scale_names])


def _token_logprob(out: RequestOutput) -> pb.TokenLogprob:
  m = pb.TokenLogprob(token_id=out.token_ids[0], logprob=out.logprobs[0])
  if out.top_logprobs:
    # Kept in the engine's order (top n by logprob, then the chosen token if outside them):
    # the decode side rebuilds the same entry from it.
    m.top.extend(pb.TopLogprob(token_id=t, logprob=lp) for t, lp in out.top_logprobs[0].items())
  return m


# ---- producer: the prefill worker's RPC --------------------------------------------------

class _FirstOutput(LoopSink):
  """Resolves with a max_tokens=1 request's (only, final) output; filled from the engine thread."""

  def __init__(self, loop: asyncio.AbstractEventLoop):
    super().__init__(loop)
    self._future: asyncio.Future = loop.create_future()

  def on_loop(self, item) -> None:
    if self._future.done():
      return
    if isinstance(item, BaseException):
      self._future.set_exception(item)
    else:
      self._future.set_result(item)

  async def wait(self) -> RequestOutput:
    return await self._future


class KVTransferServicer(kv_grpc.KVTransferServicer):
  """jaxinfer.v1.KVTransfer.Prefill over a local engine (a `--role prefill` worker).

  `backend`: the server's engine backend (admission, validation, the engine
  thread). Requests go through the same admission limits as Generate.
  """

  def __init__(self, backend, timeout_s: float, chunk_bytes: int = CHUNK_BYTES):
    self.b = backend
    self.timeout_s = timeout_s
    self.layout = backend.llm.engine.kv_layout()
    self.page_size = self.layout.page_size
    self.pages_per_chunk = pages_per_chunk(self.layout, chunk_bytes)
    self._keys = itertools.count()

  async def Prefill(self, request_iterator, context):
    b = self.b
    failed = b.metrics.kv_transfer_failures
    first = await context.read()
    if first is grpc.aio.EOF or first.WhichOneof("kind") != "request":
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "Prefill: the first message must be a PrefillRequest")
    r = first.request
    ids = list(r.prompt_token_ids)
    try:
      if b.draining:
        raise Unavailable("the prefill worker is shutting down")
      params = sampling_from_proto(r.sampling)
      if params.seed is None:
        raise InvalidRequestError("sampling.seed: a Prefill request must carry the decode worker's seed")
      # Only the first token is made here: the prompt alone must fit this worker's context.
      params = dataclasses.replace(params, max_tokens=1)
      request = b.validate(ids, params)
      num_pages = -(-len(ids) // self.page_size)
      if r.skip_tokens >= len(ids):
        raise InvalidRequestError(f"skip_tokens={r.skip_tokens} leaves none of the prompt's {len(ids)} tokens")
      admission = b.admit(len(ids))
    except JaxinferError as e:
      b.reject(e)
      failed.labels("sent", "refused").inc()
      await context.abort(status_of(e), f"Prefill {r.request_id}: {e}")
    key = f"kvx-{r.request_id}#{next(self._keys)}"
    sink = _FirstOutput(asyncio.get_running_loop())
    b.engine_loop.add(key, request, sink, hold_kv=True)
    try:
      try:
        out = await sink.wait()
      finally:
        admission.release()
      if out.finish_reason == "error" or not out.token_ids:
        failed.labels("sent", "engine_error").inc()
        await context.abort(grpc.StatusCode.INTERNAL, f"Prefill {r.request_id} failed in the engine: {out.error}")
      try:
        # From here the pages are held for this call only: bounded by the timeout.
        async with asyncio.timeout(self.timeout_s):
          await self._send_pages(context, key, out, len(ids), r.skip_tokens // self.page_size, num_pages)
          ack = await context.read()
      except TimeoutError:
        failed.labels("sent", "ack_timeout").inc()
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"Prefill {r.request_id}: no Ack within --kv-transfer-timeout="
                            f"{self.timeout_s:g} s; its KV pages were freed")
      if ack is grpc.aio.EOF or ack.WhichOneof("kind") != "ack":
        failed.labels("sent", "no_ack").inc()
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"Prefill {r.request_id}: the stream ended without an Ack; its KV pages were freed")
      b.metrics.kv_transfers.labels("sent").inc()
    except JaxinferError as e:  # e.g. the engine refused the request (InvalidRequestError)
      failed.labels("sent", "engine_error").inc()
      await context.abort(status_of(e), f"Prefill {r.request_id}: {e}")
    except asyncio.CancelledError:  # the decode worker cancelled the call or went away
      failed.labels("sent", "cancelled").inc()
      raise
    finally:
      # Cancelled, timed out, failed or acknowledged: the pages go back (and the request,
      # if the decode worker gave up before its first token, is aborted).
      b.engine_loop.call(lambda e: e.release_kv(key))

  async def _send_pages(self, context, key: str, out: RequestOutput, num_tokens: int, skip: int,
                        num_pages: int) -> None:
    header = kv_pb.PrefillHeader(first_token=_token_logprob(out), layout=layout_to_proto(self.layout),
                                 num_prompt_tokens=num_tokens, first_page=skip, num_pages=num_pages - skip,
                                 cached_tokens=out.num_cached_tokens)
    await context.write(kv_pb.PrefillServerMessage(header=header))
    m = self.b.metrics
    t0 = time.perf_counter()
    sent = 0
    for lo in range(skip, num_pages, self.pages_per_chunk):
      n = min(self.pages_per_chunk, num_pages - lo)
      # One chunk at a time: host memory stays one chunk per call, and gRPC's flow
      # control paces the exports to what the decode worker reads.
      arrays = await asyncio.wrap_future(self.b.engine_loop.call(lambda e, lo=lo, n=n: e.export_kv(key, lo, n)))
      data = pack_pages(arrays, self.layout)
      sent += len(data)
      await context.write(kv_pb.PrefillServerMessage(chunk=kv_pb.KVChunk(first_page=lo, num_pages=n, data=data)))
      m.kv_transfer_pages.labels("sent").inc(n)
      m.kv_transfer_bytes.labels("sent").inc(len(data))
    await context.write(kv_pb.PrefillServerMessage(done=kv_pb.PrefillDone(num_bytes=sent)))
    m.kv_transfer_duration.labels("sent").observe(time.perf_counter() - t0)


# ---- consumer: the decode worker's connector ---------------------------------------------

PickWorker = Callable[[Sequence[int], Mapping[str, int]], str]


@dataclasses.dataclass(frozen=True)
class TransferRecord:
  """One completed transfer, as the decode worker saw it."""

  worker: str
  num_prompt_tokens: int
  num_pages: int
  num_bytes: int
  prefill_s: float  # Prefill call to header (queue + prompt compute on the prefill worker)
  transfer_s: float  # header to the last page imported


class DecodeConnector(KVConnector):
  """Every fresh request's prompt KV (past local prefix-cache hits) comes from a prefill worker.

  `pick(prompt_ids, in_flight_per_worker) -> address` chooses the worker;
  default: fewest transfers in flight, ties in turn. A request that names its
  worker (`kv_source`: a router picked it by cached overlap and said so in the
  x-jaxinfer-prefill-worker metadata) goes there, if it is one of ours.
  Hooks run on the engine thread; the transfer runs on `loop`.
  """

  def __init__(self, prefill_workers: Sequence[str], *, timeout_s: float, pick: PickWorker | None = None,
               metrics: Metrics | None = None):
    if not prefill_workers:
      raise InvalidRequestError("a decode worker needs at least one prefill worker address")
    self.workers = tuple(prefill_workers)
    self.timeout_s = timeout_s
    self.pick = pick
    self.in_flight = {a: 0 for a in self.workers}  # loop thread
    self.records: list[TransferRecord] = []  # the last 1000 (loop thread)
    self._turn = itertools.count()
    self._transfers: dict[str, concurrent.futures.Future] = {}  # engine thread only
    self._channels: dict[str, grpc.aio.Channel] = {}
    self._loop: asyncio.AbstractEventLoop | None = None
    self._engine_loop = None
    self.layout: KVLayout | None = None
    self.metrics = metrics if metrics is not None else Metrics()  # the server's, so /metrics shows them

  def bind(self, loop: asyncio.AbstractEventLoop, engine_loop) -> None:
    """Where transfers run (the server's loop) and whom they feed (its engine thread)."""
    self._loop, self._engine_loop = loop, engine_loop
    self.layout = engine_loop.engine.kv_layout()

  # ---- engine thread ------------------------------------------------------------------

  def get_num_new_matched_tokens(self, req, num_computed: int) -> int:
    if req.params.prompt_logprobs is not None:
      return 0  # every prompt position's logits are needed: computed here
    return req.num_prompt_tokens - num_computed

  def update_state_after_alloc(self, req, pages: Sequence[int], num_external_tokens: int) -> None:
    skip = req.num_computed  # whole pages of ours: local prefix-cache hits
    params = dataclasses.replace(req.params, seed=req.seed)
    self._transfers[req.request_id] = asyncio.run_coroutine_threadsafe(
        self._transfer(req.request_id, list(req.prompt_token_ids), params, skip, req.kv_source), self._loop)

  def request_finished(self, req) -> bool:
    transfer = self._transfers.pop(req.request_id, None)
    if transfer is not None:  # aborted (cancel, deadline) or failed mid-transfer
      transfer.cancel()  # thread-safe: cancels the task on the loop, which cancels the call
    return False

  def _imported(self, engine, rid: str, header: kv_pb.PrefillHeader) -> None:
    self._transfers.pop(rid, None)  # done: a later abort must not cancel the Ack
    first = header.first_token
    engine.finish_remote_kv(rid, first.token_id, first.logprob, {t.token_id: t.logprob for t in first.top},
                            remote_cached_tokens=header.cached_tokens)

  # ---- loop thread --------------------------------------------------------------------

  def check_source(self, addr: str) -> None:
    """InvalidRequestError unless `addr` is one of this decode worker's prefill workers."""
    if addr not in self.in_flight:
      raise InvalidRequestError(f"x-jaxinfer-prefill-worker: {addr!r} is not one of this decode worker's "
                                f"--prefill-workers {list(self.workers)}")

  def _choose(self, prompt_ids: Sequence[int], hint: str | None = None) -> str:
    if hint is not None:
      self.check_source(hint)  # checked at Generate already; a direct engine caller lands here
      return hint
    if self.pick is not None:
      addr = self.pick(prompt_ids, dict(self.in_flight))
      if addr not in self.in_flight:
        raise KVTransferError(f"the pick hook chose {addr!r}, not one of the prefill workers {list(self.workers)}")
      return addr
    turn = next(self._turn)
    n = len(self.workers)
    order = [self.workers[(turn + i) % n] for i in range(n)]
    return min(order, key=lambda a: self.in_flight[a])

  def _stub(self, addr: str) -> kv_grpc.KVTransferStub:
    ch = self._channels.get(addr)
    if ch is None:
      ch = self._channels[addr] = grpc.aio.insecure_channel(
          addr, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    return kv_grpc.KVTransferStub(ch)

  async def _call(self, fn):
    return await asyncio.wrap_future(self._engine_loop.call(fn))

  async def _transfer(self, rid: str, ids: list[int], params, skip: int, hint: str | None = None) -> None:
    """Prompt tokens [skip, len(ids)) of request `rid` from a prefill worker into its pages."""
    addr = None
    call = None
    imported = False
    try:
      addr = self._choose(ids, hint)
      self.in_flight[addr] += 1
      async with asyncio.timeout(self.timeout_s):
        call = self._stub(addr).Prefill()
        t0 = time.perf_counter()
        await call.write(kv_pb.PrefillClientMessage(request=kv_pb.PrefillRequest(
            request_id=rid, prompt_token_ids=ids, sampling=sampling_to_proto(params), skip_tokens=skip)))
        header = (await self._read(call, "header", addr)).header
        t1 = time.perf_counter()
        record = await self._receive(call, rid, ids, skip, header, addr)
        await self._call(lambda e: self._imported(e, rid, header))
        imported = True
      self._record(dataclasses.replace(record, prefill_s=t1 - t0, transfer_s=time.perf_counter() - t1))
      # The prefill worker frees the pages on the Ack; its status is only worth a log line.
      await asyncio.wait_for(self._ack(call), self.timeout_s)
    except asyncio.CancelledError:
      if call is not None:
        call.cancel()
      if not imported:  # the request was aborted (cancel, deadline) before its pages were all in
        self.metrics.kv_transfer_failures.labels("received", "cancelled").inc()
      raise
    except Exception as e:  # every failure ends the request with a status; none leaves pages behind
      if call is not None:
        call.cancel()
      if imported:
        log.warning("request %s: Ack to prefill worker %s failed (it frees the pages on its timeout): %s",
                    rid, addr, e)
        return
      self.metrics.kv_transfer_failures.labels("received", _failure_reason(e)).inc()
      self._engine_loop.fail(rid, self._error(e, addr))
    finally:
      if addr is not None:
        self.in_flight[addr] -= 1

  async def _read(self, call, kind: str, addr: str) -> kv_pb.PrefillServerMessage:
    msg = await call.read()
    if msg is grpc.aio.EOF:
      raise KVTransferError(f"prefill worker {addr} ended the transfer before its {kind} (truncated)")
    if kind != "chunk or done" and msg.WhichOneof("kind") != kind:
      raise KVTransferError(f"prefill worker {addr} sent a {msg.WhichOneof('kind')} where its {kind} was due")
    return msg

  async def _receive(self, call, rid: str, ids: list[int], skip: int, header: kv_pb.PrefillHeader,
                     addr: str) -> TransferRecord:
    layout = layout_from_proto(header.layout)
    self.layout.check_matches(layout, f"prefill worker {addr}", page_size=False)
    p = layout.page_size  # theirs: pages are cut into tokens, and those written into ours
    total, first = -(-len(ids) // p), skip // p
    if (header.num_prompt_tokens, header.first_page, header.num_pages) != (len(ids), first, total - first):
      raise KVTransferError(
          f"prefill worker {addr} offers {header.num_pages} pages from page {header.first_page} of a "
          f"{header.num_prompt_tokens}-token prompt; expected {total - first} pages of {p} tokens from page "
          f"{first} of {len(ids)}")
    page, received = first, 0
    while True:
      msg = await self._read(call, "chunk or done", addr)
      if msg.WhichOneof("kind") == "done":
        break
      c = msg.chunk
      if msg.WhichOneof("kind") != "chunk" or c.first_page != page or page + c.num_pages > total:
        raise KVTransferError(f"prefill worker {addr} sent pages [{c.first_page}, {c.first_page + c.num_pages}) "
                              f"where page {page} of {total} was due")
      arrays = unpack_pages(c.data, c.num_pages, layout)
      # Tokens [lo, hi) of the prompt: the first page may start before our hits end (mid-page
      # of ours when the page sizes differ), the last one runs past the prompt.
      lo, hi = max(page * p, skip), min((page + c.num_pages) * p, len(ids))
      runs = [{name: a.reshape((-1,) + a.shape[2:])[lo - page * p:hi - page * p] for name, a in layer.items()}
              for layer in arrays]
      await self._call(lambda e, lo=lo, r=runs: e.import_kv_tokens(rid, lo, r))
      page += c.num_pages
      received += len(c.data)
      self.metrics.kv_transfer_pages.labels("received").inc(c.num_pages)
      self.metrics.kv_transfer_bytes.labels("received").inc(len(c.data))
    if page != total or msg.done.num_bytes != received:
      raise KVTransferError(f"truncated transfer from prefill worker {addr}: {page - first} of {total - first} "
                            f"pages, {received} of {msg.done.num_bytes} bytes")
    return TransferRecord(addr, len(ids), total - first, received, 0.0, 0.0)

  async def _ack(self, call) -> None:
    await call.write(kv_pb.PrefillClientMessage(ack=kv_pb.Ack()))
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:
      pass

  def _record(self, r: TransferRecord) -> None:
    self.records.append(r)
    del self.records[:-1000]
    self.metrics.kv_transfers.labels("received").inc()
    self.metrics.kv_transfer_duration.labels("received").observe(r.transfer_s)

  def _error(self, e: BaseException, addr: str | None) -> JaxinferError:
    """The status the client sees for a failed transfer."""
    if isinstance(e, TimeoutError):
      return KVTransferTimeout(f"the KV transfer from prefill worker {addr} did not complete within "
                               f"--kv-transfer-timeout={self.timeout_s:g} s")
    if isinstance(e, grpc.aio.AioRpcError):
      code, details = e.code(), e.details()
      where = f"prefill worker {addr}"
      if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return PrefillUnavailable(f"{where} is unavailable ({code.name}): {details}")
      if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return KVTransferTimeout(f"{where}: {details}")
      if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(f"{where} is overloaded: {details}")
      if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequestError(f"{where} refused the request: {details}")
      return KVTransferError(f"{where} failed ({code.name}): {details}")
    if isinstance(e, JaxinferError):
      return e
    return KVTransferError(f"KV transfer from prefill worker {addr} failed: {type(e).__name__}: {e}")

  async def close(self) -> None:
    for ch in self._channels.values():
      await ch.close()
    self._channels.clear()


def _failure_reason(e: BaseException) -> str:
  """The `reason` label of jaxinfer_kv_transfer_failures_total{direction="received"}."""
  if isinstance(e, (TimeoutError, KVTransferTimeout)):
    return "timeout"
  if isinstance(e, grpc.aio.AioRpcError):
    return {grpc.StatusCode.UNAVAILABLE: "unavailable", grpc.StatusCode.CANCELLED: "unavailable",
            grpc.StatusCode.DEADLINE_EXCEEDED: "timeout", grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
            grpc.StatusCode.INVALID_ARGUMENT: "refused"}.get(e.code(), "prefill_error")
  if isinstance(e, KVTransferError):
    return "invalid_transfer"  # layout, page count or bytes that do not match, a truncated stream
  return "error"


# ---- wiring --------------------------------------------------------------------------

def attach(role: str, backend, grpc_server: grpc.aio.Server, *, prefill_workers: Sequence[str] = (),
           timeout_s: float = 60.0, pick: PickWorker | None = None) -> DecodeConnector | None:
  """Sets a server up for its role, before its engine thread starts: `prefill` adds the
  KVTransfer service; `decode` gives the engine a DecodeConnector (returned)."""
  if role != "both" and not hasattr(backend, "engine_loop"):
    raise InvalidRequestError(f"--role {role} needs a local engine, not a {type(backend).__name__}")
  if role == "prefill":
    kv_grpc.add_KVTransferServicer_to_server(KVTransferServicer(backend, timeout_s), grpc_server)
    return None
  if role == "decode":
    connector = DecodeConnector(prefill_workers, timeout_s=timeout_s, pick=pick, metrics=backend.metrics)
    connector.bind(asyncio.get_running_loop(), backend.engine_loop)
    backend.llm.engine.set_kv_connector(connector)
    return connector
  if role != "both":
    raise InvalidRequestError(f"role must be one of {ROLES}, got {role!r}")
  return None
