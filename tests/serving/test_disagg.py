"""Prefill/decode disaggregation with real processes on loopback: `jaxinfer serve
--role prefill` and `--role decode`, over a tiny llama3 whose context was
stretched to 4096 positions so that a long prompt keeps a transfer in flight
long enough to cancel it or kill its prefill worker. The real pair keeps an int8 KV
cache, so every transfer here carries scales beside the values (tests/serving/
test_router_disagg.py moves float32 pages).

Each worker's KV pool is read through its Prometheus gauge
`jaxinfer_kv_cache_usage_ratio` (--metrics-port): 0 once nobody holds a page."""

import asyncio
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from jaxinfer import LLM, SamplingParams, StructuredOutput
from jaxinfer.serving import Client, InferenceServer, ServerConfig
from jaxinfer.serving.client import build_request
from jaxinfer.serving.convert import sampling_to_proto
from jaxinfer.serving.disagg import layout_to_proto
from jaxinfer.serving.proto import inference_pb2 as pb
from jaxinfer.serving.proto import inference_pb2_grpc as pb_grpc
from jaxinfer.serving.proto import kv_transfer_pb2 as kv_pb
from jaxinfer.serving.proto import kv_transfer_pb2_grpc as kv_grpc
from jaxinfer.serving.process import JaxinferProcess

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ["--max-num-seqs", "8", "--max-num-batched-tokens", "32"]  # few step buckets to warm up
LONG_PROMPT = [(7 * i) % 300 + 3 for i in range(4000)]  # ~1 s of prefill here: a transfer in flight


def start_worker(model_dir, *args, port: int = 0) -> JaxinferProcess:
  """`jaxinfer serve` in its own process, on free ports (or `port`), starting: `wait()` for it."""
  return JaxinferProcess("serve", "--model", str(model_dir), "--port", str(port), "--metrics-port", "0",
                         *ENGINE, *args, cwd=ROOT)


def worker(model_dir, *args) -> JaxinferProcess:
  """`jaxinfer serve` in its own process, on free ports, once SERVING."""
  return start_worker(model_dir, *args).wait()


def free_port() -> int:
  """A port nobody listens on now: a worker started on it can be named to another one
  before it is up, so both start at once."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def kv_usage(w: JaxinferProcess) -> float:
  return w.metric("jaxinfer_kv_cache_usage_ratio")


def sample(text: str, name: str, **labels: str) -> float:
  """One labelled sample of a Prometheus scrape (0 when it is not there yet)."""
  want = ",".join(f'{k}="{v}"' for k, v in labels.items())
  m = re.search(rf"^{re.escape(name)}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
  return float(m.group(1)) if m else 0.0


def wait_for(predicate, timeout=15.0, what="condition", logs=()):
  end = time.monotonic() + timeout
  while not predicate():
    if time.monotonic() > end:
      tails = "".join(f"\n--- worker on port {w.port}:\n" + "".join(w.log[-25:]) for w in logs)
      raise AssertionError(f"timed out after {timeout} s waiting for {what}{tails}")
    time.sleep(0.02)


@pytest.fixture(scope="module")
def reference(model_dir):
  return LLM(model_dir, max_num_seqs=8, max_num_batched_tokens=32, kv_cache_dtype="int8", warmup=False)


@pytest.fixture(scope="module")
def pair(model_dir):
  """A prefill worker (16-token pages; no Ack within 3 s frees its pages) and a decode
  worker on it with 8-token pages: every transfer here is re-chunked on the way in. Both
  keep an int8 KV cache (values and their per-token, per-head scales cross together). The
  first test's setup carries their start (over 30 s on two cores): each process loads the
  model and warms up, compiling every step bucket."""
  port = free_port()  # both start at once: the decode worker only dials it per request
  prefill = start_worker(model_dir, "--role", "prefill", "--kv-transfer-timeout", "3", "--kv-cache-dtype", "int8",
                         port=port)
  decode = start_worker(model_dir, "--role", "decode", "--prefill-workers", f"127.0.0.1:{port}", "--page-size", "8",
                        "--kv-cache-dtype", "int8")
  try:
    prefill.wait()
    decode.wait()
  except BaseException:
    decode.stop()
    prefill.stop()
    raise
  yield prefill, decode
  decode.stop()
  prefill.stop()


def test_stubs_are_fresh(tmp_path):
  from test_proto import normalized
  proto = "jaxinfer/serving/proto/kv_transfer.proto"
  out = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={tmp_path}",
                        f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", proto],
                       cwd=ROOT, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  for name in ("kv_transfer_pb2.py", "kv_transfer_pb2.pyi", "kv_transfer_pb2_grpc.py"):
    fresh = (tmp_path / "jaxinfer/serving/proto" / name).read_text()
    committed = (ROOT / "jaxinfer/serving/proto" / name).read_text()
    assert normalized(committed) == normalized(fresh), f"{name} is stale: regenerate it (see {proto})"
  method = kv_pb.DESCRIPTOR.services_by_name["KVTransfer"].methods_by_name["Prefill"]
  assert method.full_name == "jaxinfer.v1.KVTransfer.Prefill"
  assert method.client_streaming and method.server_streaming


PROMPTS = [[1, 5, 9, 200, 17], list(range(3, 90)), "Hello world, how are you?",
           [{"role": "user", "content": "What is the capital of France?"}]]


def test_decode_worker_outputs_equal_one_worker(pair, reference):
  """Greedy streams and whole responses, several concurrent, and a seeded request with
  logprobs: the same tokens and logprobs as one engine doing it all, though the prefill
  worker's pages hold 16 tokens and the decode worker's 8."""
  prefill, decode = pair
  greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
  want = reference.generate(PROMPTS, greedy)
  with Client(decode.address, timeout=120) as c:
    for prompt, ref in zip(PROMPTS, want):
      deltas = list(c.stream(prompt, params=greedy))
      assert [t for d in deltas for t in d.token_ids] == ref.token_ids
      assert "".join(d.text for d in deltas) == ref.text
      assert deltas[-1].finish_reason == pb.FINISH_REASON_LENGTH
      # Again, whole: the decode worker's prefix cache now holds this prompt's full pages,
      # so only the tokens after them come over (from mid-page of the prefill worker's).
      whole = c.generate(prompt, params=greedy)
      assert (whole.token_ids, whole.text) == (ref.token_ids, ref.text)
    seeded = SamplingParams(temperature=0.9, top_k=50, seed=11, max_tokens=16, logprobs=3, ignore_eos=True)
    ref = reference.generate([[2, 4, 6, 8]], seeded)[0]
    got = c.generate([2, 4, 6, 8], params=seeded)
    assert got.token_ids == ref.token_ids
    assert [lp.logprob for lp in got.logprobs] == pytest.approx(ref.logprobs, abs=1e-5)
    assert {t.token_id: t.logprob for t in got.logprobs[0].top} == pytest.approx(ref.top_logprobs[0], abs=1e-5)
    # Penalties (the decode worker rebuilds the history from prompt + first token) and a
    # grammar (the prefill worker constrains the first token, the decode worker's matcher
    # consumes it).
    for sp in (SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5,
                              presence_penalty=0.8, frequency_penalty=0.5),
               SamplingParams(temperature=0, max_tokens=16, structured=StructuredOutput(regex="[a-e ]{3,12}"))):
      ref = reference.generate(["Hello hello"], sp)[0]
      got = c.generate("Hello hello", params=sp)
      assert (got.token_ids, got.text) == (ref.token_ids, ref.text)

  prompts = [[1 + i, 2 + (i * 7) % 200, 3 + (i * 13) % 250] * (1 + 7 * i) for i in range(6)]
  want = reference.generate(prompts, greedy)

  async def run():
    async with Client(decode.address, timeout=120) as c:
      async def one(p):
        return [d async for d in c.astream(p, params=greedy)]
      return await asyncio.gather(*(one(p) for p in prompts))

  for deltas, ref in zip(asyncio.run(run()), want):
    assert [t for d in deltas for t in d.token_ids] == ref.token_ids
  wait_for(lambda: kv_usage(decode) == 0.0 and kv_usage(prefill) == 0.0, what="both pools to empty")


def test_cancel_during_transfer_frees_both_pools(pair):
  prefill, decode = pair
  cancelled = lambda w, d: sample(w.metrics_text(), "jaxinfer_kv_transfer_failures_total", direction=d,
                                  reason="cancelled")
  before = cancelled(prefill, "sent"), cancelled(decode, "received")
  with grpc.insecure_channel(decode.address) as ch:
    request = build_request(LONG_PROMPT, stream=True, temperature=0, max_tokens=50)
    call = pb_grpc.InferenceStub(ch).Generate(request)
    # Both sides hold pages: the decode worker's wait for the KV, the prefill worker's prompt.
    wait_for(lambda: kv_usage(decode) > 0 and kv_usage(prefill) > 0, what="the transfer to start")
    call.cancel()
    with pytest.raises(grpc.RpcError) as e:
      list(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED
  wait_for(lambda: kv_usage(decode) == 0.0, what="the decode pool to empty", logs=pair)
  wait_for(lambda: kv_usage(prefill) == 0.0, what="the prefill pool to empty", logs=pair)
  # Counted as cancelled transfers on both sides (the prefill worker's call is cancelled by the decode worker's).
  wait_for(lambda: (cancelled(prefill, "sent"), cancelled(decode, "received")) == (before[0] + 1, before[1] + 1),
           what="both sides to count the cancelled transfer")
  # A deadline far shorter than the request: DEADLINE_EXCEEDED, both pools empty again.
  # A fresh prompt (the first one's blocks are cached on both sides now) and 2000 new
  # tokens, so the request outlives 0.5 s however fast this machine is (the deadline
  # lands in the prefill, the transfer or the decode; each must free both pools).
  fresh = [(11 * i) % 300 + 3 for i in range(2000)]
  with Client(decode.address) as c:
    with pytest.raises(grpc.RpcError) as e:
      c.generate(fresh, timeout=0.5, temperature=0, max_tokens=2000, ignore_eos=True)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
  wait_for(lambda: kv_usage(decode) == 0.0, what="the decode pool to empty", logs=pair)
  wait_for(lambda: kv_usage(prefill) == 0.0, what="the prefill pool to empty", logs=pair)


def test_transfer_metrics_count_the_pages_and_bytes_of_a_known_transfer(pair):
  """A 99-token prompt neither worker has seen crosses as 7 pages of 16 tokens, 1280
  bytes each (2 layers x k, v x 16 positions x 1 head x (16 int8 values + a float32
  scale)): the prefill
  worker's "sent" and the decode worker's "received" counters (pages as sent, in the
  prefill worker's page size) move by exactly that, one completed transfer and one
  duration each, and no failure."""
  prefill, decode = pair
  prompt = [(13 * i) % 290 + 5 for i in range(99)]
  names = ("jaxinfer_kv_transfer_pages_total", "jaxinfer_kv_transfer_bytes_total", "jaxinfer_kv_transfers_total",
           "jaxinfer_kv_transfer_duration_seconds_count")
  sides = ((prefill, "sent"), (decode, "received"))
  before = {d: w.metrics_text() for w, d in sides}
  with Client(decode.address, timeout=120) as c:
    assert len(c.generate(prompt, temperature=0, max_tokens=2, ignore_eos=True).token_ids) == 2
  for w, d in sides:  # the prefill worker counts the transfer once the Ack is in: poll
    wait_for(lambda: sample(w.metrics_text(), "jaxinfer_kv_transfers_total", direction=d) ==
             sample(before[d], "jaxinfer_kv_transfers_total", direction=d) + 1, what=f"the {d} transfer")
    after = w.metrics_text()
    moved = [sample(after, n, direction=d) - sample(before[d], n, direction=d) for n in names]
    assert moved == [7, 7 * 1280, 1, 1], (d, moved)
    failures = lambda text: re.findall(r"^jaxinfer_kv_transfer_failures_total\{.*$", text, re.M)
    assert failures(after) == failures(before[d])  # earlier tests' failures, none added


def prefill_message(prompt, request_id="t", skip_tokens=0, **sampling):
  return kv_pb.PrefillClientMessage(request=kv_pb.PrefillRequest(
      request_id=request_id, prompt_token_ids=prompt, skip_tokens=skip_tokens,
      sampling=sampling_to_proto(**{"temperature": 0, "seed": 1, "max_tokens": 8} | sampling)))


def test_prefill_worker_frees_held_pages_without_an_ack_or_on_cancel(pair):
  prefill, _ = pair
  prompt = list(range(1, 100))  # 7 pages of 16

  async def run():
    async with grpc.aio.insecure_channel(prefill.address) as ch:
      stub = kv_grpc.KVTransferStub(ch)
      # No Ack: the pages stay held, then go after --kv-transfer-timeout (3 s).
      call = stub.Prefill()
      # 99 + 4095 tokens exceed the context, but only the prompt and one token are made here.
      await call.write(prefill_message(prompt, max_tokens=4095))
      msgs = [await call.read() for _ in range(3)]
      assert [m.WhichOneof("kind") for m in msgs] == ["header", "chunk", "done"]
      header, chunk, done = msgs[0].header, msgs[1].chunk, msgs[2].done
      assert (header.num_prompt_tokens, header.first_page, header.num_pages) == (99, 0, 7)
      assert (chunk.first_page, chunk.num_pages, done.num_bytes) == (0, 7, len(chunk.data))
      assert len(chunk.data) == 7 * 2 * 2 * 16 * 1 * (16 + 4)  # pages x layers x (k, v) x tokens x (values + scale)
      timeouts = lambda: sample(prefill.metrics_text(), "jaxinfer_kv_transfer_failures_total",
                                direction="sent", reason="ack_timeout")
      before = timeouts()
      assert kv_usage(prefill) > 0  # held past the done message, waiting for the Ack
      with pytest.raises(grpc.aio.AioRpcError) as e:
        await call.read()
      assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
      assert "no Ack within --kv-transfer-timeout=3 s" in e.value.details()
      assert timeouts() == before + 1
      await asyncio.to_thread(wait_for, lambda: kv_usage(prefill) == 0.0)
      # Cancelled after the header: freed at once. 40 tokens skipped (5 pages of 8 on a
      # decode worker): pages from the one holding token 40, page 2 of 16.
      call = stub.Prefill()
      await call.write(prefill_message(prompt, skip_tokens=40))
      header = (await call.read()).header
      assert (header.first_page, header.num_pages) == (2, 5)
      call.cancel()
      await asyncio.to_thread(wait_for, lambda: kv_usage(prefill) == 0.0, 2.0)
      # A request without the decode worker's seed is refused, naming it.
      call = stub.Prefill()
      await call.write(kv_pb.PrefillClientMessage(request=kv_pb.PrefillRequest(
          prompt_token_ids=prompt, sampling=sampling_to_proto(temperature=0))))
      with pytest.raises(grpc.aio.AioRpcError) as e:
        await call.read()
      assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.seed" in e.value.details()

  asyncio.run(run())


class FakePrefill(kv_grpc.KVTransferServicer):
  """A prefill worker that misbehaves as the request id says (`hang`, `layout`, `truncate`,
  `short`), sending `layout` (the decode worker's own) otherwise."""

  def __init__(self, layout):
    self.layout = layout

  async def Prefill(self, request_iterator, context):
    r = (await context.read()).request
    how = r.request_id.split("#")[0]
    if how == "hang":
      await asyncio.sleep(3600)
    layout = layout_to_proto(self.layout)
    if how == "layout":
      layout.page_size, layout.dtype = 32, "bfloat16"
    pages = -(-len(r.prompt_token_ids) // self.layout.page_size)
    first = pb.TokenLogprob(token_id=5, logprob=-1.0)
    await context.write(kv_pb.PrefillServerMessage(header=kv_pb.PrefillHeader(
        first_token=first, layout=layout, num_prompt_tokens=len(r.prompt_token_ids), first_page=0,
        num_pages=pages)))
    if how == "short":  # one byte short
      data = bytes(pages * self.layout.page_bytes - 1)
      await context.write(kv_pb.PrefillServerMessage(chunk=kv_pb.KVChunk(first_page=0, num_pages=pages, data=data)))
    await context.write(kv_pb.PrefillServerMessage(done=kv_pb.PrefillDone(num_bytes=0)))
    await context.read()


@pytest.fixture(scope="module")
def victim(model_dir):
  """A prefill worker for the kill test, started with `fake_and_decode` (while that loads
  its model and the tests before the kill run) on a port known at once (the decode worker
  lists it), and waited for there."""
  port = free_port()
  p = start_worker(model_dir, "--role", "prefill", port=port)
  p.listed_address = f"127.0.0.1:{port}"
  yield p
  p.stop()


@pytest.fixture(scope="module")
def fake_and_decode(model_dir, victim):
  """An in-process decode worker (2 s transfer timeout) over three prefill workers: an
  in-process fake, an address nobody listens on, and the kill test's victim. Each test names
  the one its request takes the KV from (`generate_from`). Its first test's setup carries the
  victim's start and the decode worker's model load (over 30 s on two cores)."""
  llm = LLM(model_dir, max_num_seqs=8, max_num_batched_tokens=32, warmup=False)
  loop = asyncio.new_event_loop()
  threading.Thread(target=loop.run_forever, daemon=True).start()

  async def start_fake():  # grpc.aio objects belong to the loop they are made on
    server = grpc.aio.server()
    kv_grpc.add_KVTransferServicer_to_server(FakePrefill(llm.engine.kv_layout()), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port

  fake_server, fake_port = asyncio.run_coroutine_threadsafe(start_fake(), loop).result(30)
  decode = InferenceServer(llm, ServerConfig(port=0, metrics_port=0, role="decode",
                                             prefill_workers=(f"127.0.0.1:{fake_port}", UNREACHABLE,
                                                              victim.listed_address),
                                             kv_transfer_timeout_s=2.0)).start_in_thread()
  decode.fake_address = f"127.0.0.1:{fake_port}"
  yield decode
  decode.stop_in_thread(1)
  asyncio.run_coroutine_threadsafe(fake_server.stop(0), loop).result(10)
  loop.call_soon_threadsafe(loop.stop)


UNREACHABLE = "127.0.0.1:1"  # nothing listens there


def generate_from(decode, prefill_worker: str, prompt, *, request_id: str = "", timeout: float = 30, **sampling):
  """A request to the decode worker naming the prefill worker its prompt KV comes from (the
  x-jaxinfer-prefill-worker metadata a router sends)."""
  from jaxinfer.serving.server import PREFILL_WORKER_METADATA
  with grpc.insecure_channel(f"127.0.0.1:{decode.port}") as ch:
    call = pb_grpc.InferenceStub(ch).Generate(build_request(prompt, stream=False, request_id=request_id, **sampling),
                                              timeout=timeout, metadata=[(PREFILL_WORKER_METADATA, prefill_worker)])
    return list(call)


def pool_is_full(server):
  e = server.llm.engine
  return server.call_engine(lambda e: e.kv.num_free_pages) == e.kv.num_pages - 1


@pytest.mark.parametrize("how, code, message, reason", [
    ("hang", grpc.StatusCode.DEADLINE_EXCEEDED, "did not complete within --kv-transfer-timeout=2 s", "timeout"),
    # Another page size is fine (re-chunked), another dtype is not.
    ("layout", grpc.StatusCode.INTERNAL, "KV layout mismatch with prefill worker 127.0.0.1:\\d+: dtype: "
                                         "ours 'float32', prefill worker 127.0.0.1:\\d+'s 'bfloat16'$",
     "invalid_transfer"),
    ("truncate", grpc.StatusCode.INTERNAL, "truncated transfer from prefill worker .*: 0 of 1 pages",
     "invalid_transfer"),
    ("short", grpc.StatusCode.INTERNAL, "a chunk of 1 pages carries 4095 bytes, expected 4096", "invalid_transfer"),
])
def test_failed_transfers_are_clear_errors_and_free_the_pages(fake_and_decode, how, code, message, reason):
  decode = fake_and_decode
  failures = lambda: sample(decode.metrics.exposition().decode(), "jaxinfer_kv_transfer_failures_total",
                            direction="received", reason=reason)
  before = failures()
  with pytest.raises(grpc.RpcError) as e:
    generate_from(decode, decode.fake_address, [1, 2, 3, 4, 5], request_id=how, temperature=0, max_tokens=4)
  assert e.value.code() == code
  assert re.search(message, e.value.details()), e.value.details()
  assert failures() == before + 1
  wait_for(lambda: pool_is_full(decode), what="the decode pool to empty")


def test_an_unreachable_prefill_worker_is_unavailable_at_once(fake_and_decode):
  decode = fake_and_decode
  failures = lambda: sample(decode.metrics.exposition().decode(), "jaxinfer_kv_transfer_failures_total",
                            direction="received", reason="unavailable")
  before = failures()
  # UNAVAILABLE, not the DEADLINE_EXCEEDED of the 2 s transfer timeout: it did not wait for it.
  with pytest.raises(grpc.RpcError) as e:
    generate_from(decode, UNREACHABLE, [300, 1, 2], temperature=0, max_tokens=4)
  assert e.value.code() == grpc.StatusCode.UNAVAILABLE
  assert f"prefill worker {UNREACHABLE} is unavailable" in e.value.details()
  assert failures() == before + 1
  wait_for(lambda: pool_is_full(decode), what="the decode pool to empty")


def test_killing_the_prefill_worker_mid_transfer_is_unavailable(fake_and_decode, victim):
  """UNAVAILABLE naming the dead worker, not the DEADLINE_EXCEEDED of the 2 s transfer
  timeout: the decode worker noticed the death rather than waiting the transfer out."""
  decode = fake_and_decode
  victim.wait()
  try:
    prompt = [300] + LONG_PROMPT[1:]
    box = {}

    def run():
      try:
        generate_from(decode, victim.listed_address, prompt, timeout=60, temperature=0, max_tokens=20)
      except grpc.RpcError as e:
        box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    wait_for(lambda: kv_usage(victim) > 0, what="the prefill worker to start the prompt")
    victim.proc.kill()
    t.join(60)
    assert not t.is_alive()
    e = box["error"]
    assert e.code() == grpc.StatusCode.UNAVAILABLE
    assert f"prefill worker {victim.listed_address} is unavailable" in e.details()
    wait_for(lambda: pool_is_full(decode), what="the decode pool to empty")
  finally:
    victim.stop()


def test_an_engine_call_cancelled_before_it_runs_is_skipped_and_the_loop_lives(fake_and_decode):
  """A transfer cancelled while its import / export waits for the engine thread cancels
  that call's future; resolving it there would raise and end the engine thread."""
  loop = fake_and_decode.engine_loop
  gate, ran = threading.Event(), []
  blocker = loop.call(lambda e: gate.wait(10))
  skipped = loop.call(lambda e: ran.append("skipped"))
  assert skipped.cancel()
  gate.set()
  assert blocker.result(10) is True
  assert loop.call(lambda e: e.num_unfinished).result(10) == 0  # still taking commands
  assert ran == []


def test_roles_are_checked_before_anything_loads(capsys):
  from jaxinfer.cli import main
  from jaxinfer.errors import InvalidRequestError
  with pytest.raises(InvalidRequestError, match="role must be both, prefill or decode, got 'mixed'"):
    ServerConfig(role="mixed")
  with pytest.raises(InvalidRequestError, match="a decode worker needs at least one prefill worker address"):
    ServerConfig(role="decode")
  with pytest.raises(InvalidRequestError, match="only a decode worker takes them"):
    ServerConfig(role="prefill", prefill_workers=("127.0.0.1:1",))
  with pytest.raises(InvalidRequestError, match="kv_transfer_timeout_s must be > 0"):
    ServerConfig(kv_transfer_timeout_s=0)
  assert main(["serve", "--model", "/nonexistent", "--role", "decode"]) == 1
  assert "a decode worker needs at least one prefill worker address" in capsys.readouterr().err
