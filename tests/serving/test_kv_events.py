"""jaxinfer.v1.KVEvents on an in-process server: a subscriber's snapshot plus its
numbered batches are exactly what the engine's KVManager published, in order,
and fold into the cache the engine holds."""

import asyncio
import dataclasses
import threading

import grpc
import pytest

from conftest import tiny_dir
from jaxinfer import LLM
from jaxinfer.engine.kv_manager import KVEvent
from jaxinfer.serving import Client, InferenceServer, ServerConfig
from jaxinfer.serving.kv_router import KVIndex
from jaxinfer.serving.proto import kv_events_pb2 as kv_pb
from jaxinfer.serving.proto import kv_events_pb2_grpc as kv_pb_grpc

PAGE = 4
# 24 usable pages: a few 30-token prompts fill the pool, so later ones evict ("removed").
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=PAGE, num_pages=25, max_model_len=64,
              warmup=False)
KINDS = {kv_pb.KVEvent.STORED: "stored", kv_pb.KVEvent.REMOVED: "removed"}


@pytest.fixture(scope="module")
def published():
  """Every non-empty list of events the server's KVManager handed out, in order."""
  return []


@pytest.fixture(scope="module")
def server(published):
  llm = LLM(tiny_dir("llama3"), **ENGINE)
  kv = llm.engine.kv
  drain = kv.drain_events
  lock = threading.Lock()

  def recording_drain():
    events = drain()
    if events:
      with lock:
        published.append(events)
    return events

  kv.drain_events = recording_drain
  # No warm-up: the few step shapes these tests run compile on first use.
  s = InferenceServer(llm, ServerConfig(port=0), warmup=False).start_in_thread()
  yield s
  s.stop_in_thread(5)


class Subscriber:
  """Reads one WatchKVEvents stream on a thread: (snapshot seq, hashes, block size) then batches."""

  def __init__(self, port):
    self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    self.call = kv_pb_grpc.KVEventsStub(self.channel).WatchKVEvents(kv_pb.WatchKVEventsRequest())
    self.snapshot = None
    self.batches: list[tuple[int, list[KVEvent]]] = []
    self.error = None
    self.thread = threading.Thread(target=self._read, daemon=True)
    self.thread.start()

  def _read(self):
    try:
      for m in self.call:
        if m.HasField("snapshot"):
          self.snapshot = (m.snapshot.seq, list(m.snapshot.block_hashes), m.snapshot.block_size)
        else:
          self.batches.append((m.batch.seq, [
              KVEvent(KINDS[e.kind], e.block_hash, e.parent_hash if e.HasField("parent_hash") else None)
              for e in m.batch.events]))
    except grpc.RpcError as e:
      self.error = e

  def wait_for(self, seq, timeout=30.0):
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end:
      if self.snapshot is not None and (self.batches[-1][0] if self.batches else self.snapshot[0]) >= seq:
        return
      time.sleep(0.01)
    raise TimeoutError(f"no batch {seq} within {timeout} s (snapshot {self.snapshot}, "
                       f"last {self.batches[-1][0] if self.batches else None})")

  def close(self):
    self.call.cancel()
    self.thread.join(10)
    self.channel.close()


def last_seq(server):
  """The engine loop's last batch number, read between steps (after every pending publication)."""
  return server.engine_loop.call(lambda e: server.engine_loop.kv_seq).result(30)


def run(client, prompts):
  for p in prompts:
    client.generate(p, max_tokens=3, temperature=0, ignore_eos=True)


def test_snapshot_then_numbered_batches_equal_what_the_kv_manager_published(server, published):
  with Client(f"127.0.0.1:{server.port}", timeout=60) as c:
    early = Subscriber(server.port)
    early.wait_for(0)
    seq0, hashes0, block_size = early.snapshot
    with_prefix = [[1 + (i % 7)] * 16 + [50 + i] * 14 for i in range(3)]  # 30 tokens: 7 full blocks
    run(c, with_prefix)
    seq1 = last_seq(server)
    early.wait_for(seq1)
    late = Subscriber(server.port)  # subscribes mid-way: a snapshot, then the batches after it
    late.wait_for(seq1)
    run(c, [[100 + i] * 30 for i in range(6)])  # more than the pool holds: evictions
    seq2 = last_seq(server)
    early.wait_for(seq2)
    late.wait_for(seq2)
    final = server.call_engine(lambda e: e.kv.cached_hashes())
  early.close()
  late.close()

  assert block_size == PAGE
  # Numbered 1, 2, ... with no gap after the snapshot, one batch per non-empty drain, equal to it.
  assert [s for s, _ in early.batches] == list(range(seq0 + 1, seq2 + 1))
  # The wire carries no block tokens (a router indexes hashes only).
  sent = [[dataclasses.replace(e, token_ids=()) for e in events] for events in published[seq0:seq2]]
  assert [events for _, events in early.batches] == sent
  kinds = {e.kind for _, events in early.batches for e in events}
  assert kinds == {"stored", "removed"}, kinds
  assert all(e.parent_hash is None for _, evs in early.batches for e in evs if e.kind == "removed")

  # The late subscriber's snapshot is the cache as of its seq, and its batches continue from there.
  late_seq, late_hashes, _ = late.snapshot
  assert seq1 <= late_seq <= seq2
  assert [s for s, _ in late.batches] == list(range(late_seq + 1, seq2 + 1))
  for sub in (early, late):
    index = KVIndex()
    index.add_worker("w")
    index.load_snapshot("w", sub.snapshot[0], sub.snapshot[1])
    for seq, events in sub.batches:
      index.apply("w", seq, events)
    assert index.holds("w") == final
  assert final and hashes0 == [] and seq0 == 0


def test_a_subscriber_that_falls_behind_is_dropped_not_waited_for():
  from jaxinfer.serving.server import _KVSubscription

  async def main():
    sub = _KVSubscription(asyncio.get_running_loop(), capacity=2)
    sub.snapshot(0, [5])
    sub.batch(1, [KVEvent("stored", 7)])
    sub.batch(2, [KVEvent("stored", 8)])  # the queue holds 2: this one overflows it
    await asyncio.sleep(0)  # the engine thread posts with call_soon_threadsafe
    assert await sub.get() == ("snapshot", 0, [5])
    assert await sub.get() == ("batch", 1, [KVEvent("stored", 7)])
    assert await sub.get() is None  # dropped: batch 2 was never queued, so no gap is ever delivered
    assert sub.closed and sub.overflowed
    sub.batch(3, [KVEvent("stored", 9)])  # the engine thread stops posting to it
    await asyncio.sleep(0)
    assert await sub.get() is None

  asyncio.run(main())
