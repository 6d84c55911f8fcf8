"""`jaxinfer route` in front of two `jaxinfer serve` workers, all real processes
on loopback, over a tiny llama3 (context stretched to 4096 so that long
streams outlive the kill test; pages of 4 tokens so short prompts span
several blocks).

The test that kills a worker runs last (file order): it takes one of the
module's workers down."""

import json
import re
import shutil
import signal
import socket
import threading
import time

import grpc
import pytest

from jaxinfer.serving import Client
from jaxinfer.serving.client import GenerateResult
from jaxinfer.serving.process import JaxinferProcess
from jaxinfer.serving.proto import inference_pb2 as pb

PAGE = 4
WORKER_FLAGS = ["--page-size", str(PAGE), "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
                "--metrics-port", "0"]


def free_port() -> int:
  """A port nobody listens on now: a worker started on it can be named to another process
  before it is up, so both start at once."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def processes(model_dir):
  """The module's workers: two alike, and one whose admission limit (--max-waiting-tokens 1)
  refuses every prompt of more than one token. The first test's setup carries their start
  (over 30 s on two cores): each process loads the model and warms up, running every step
  program. The three compile the same programs: the first warms up alone, so that on a cold
  compilation cache it compiles them once (~25 s of CPU here, ~7 s read back from the
  cache) and the other two, started together after it, read them from the cache."""
  procs = [JaxinferProcess("serve", "--model", str(model_dir), "--port", "0", *WORKER_FLAGS)]
  try:
    procs[0].wait()
    procs += [JaxinferProcess("serve", "--model", str(model_dir), "--port", "0", *WORKER_FLAGS),
              JaxinferProcess("serve", "--model", str(model_dir), "--port", "0", *WORKER_FLAGS,
                              "--max-waiting-tokens", "1")]
    yield [procs[0], *(p.wait() for p in procs[1:])]  # procs[0] is up (wait() reads its log once)
  finally:
    for p in procs:
      p.stop()


@pytest.fixture(scope="module")
def workers(processes):
  return processes[:2]


@pytest.fixture(scope="module")
def busy(processes):
  return processes[2]


def route(model_dir, worker_addresses, *args):
  return JaxinferProcess("route", "--model", str(model_dir), "--workers", ",".join(worker_addresses), "--port", "0",
              "--metrics-port", "0", "--health-interval", "0.3", *args)


@pytest.fixture(scope="module")
def router(model_dir, workers):
  p = route(model_dir, [w.address for w in workers], "--http-port", "0").wait()
  yield p
  p.stop()


@pytest.fixture(scope="module")
def rc(router):
  with Client(router.address, timeout=120) as c:
    yield c


def worker_clients(workers):
  return [Client(w.address, timeout=120) for w in workers]


def total(text, name):
  """The sum of a metric's samples over its labels (0 when absent); `name` may carry labels."""
  return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def index_caught_up(router, workers, timeout=60.0) -> bool:
  """Waits until the router's KV index holds every event each worker has published so far:
  a worker's snapshot names its latest event batch (it publishes what is pending first), and
  the router's jaxinfer_router_kv_event_batch gauge names the batch it folded in last. The
  timeout only bounds a failure."""
  from jaxinfer.serving.proto import kv_events_pb2 as kv_pb
  from jaxinfer.serving.proto import kv_events_pb2_grpc as kv_pb_grpc
  for w in workers:
    with grpc.insecure_channel(w.address) as channel:
      call = kv_pb_grpc.KVEventsStub(channel).WatchKVEvents(kv_pb.WatchKVEventsRequest())
      seq = next(call).snapshot.seq
      call.cancel()
    name = f'jaxinfer_router_kv_event_batch{{worker="{w.address}"}}'
    if not wait_for(lambda: total(router.metrics_text(), name) >= seq, timeout):
      return False
  return True


# The route process's tie-break generator is seeded (RouterBackend seed 0): its draws among
# two idle workers are np.random.default_rng(0).integers(2) = 1 1 1 0 0 0 0 0 0 1 1 1 for 12
# requests, so the second listed worker gets 6 of 12 tied requests.
TIES_TO_SECOND_OF_12 = 6


PROMPTS = ["Hello there", [5, 6, 7, 8, 9, 10, 11, 12, 13], [{"role": "user", "content": "Hi, who are you?"}]]


@pytest.mark.parametrize("prompt", PROMPTS, ids=["text", "ids", "chat"])
def test_greedy_outputs_equal_one_worker(rc, workers, prompt):
  direct = Client(workers[0].address, timeout=120)
  want = direct.generate(prompt, max_tokens=12, temperature=0)
  got = rc.generate(prompt, max_tokens=12, temperature=0)
  assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
  assert got.usage.prompt_tokens == want.usage.prompt_tokens
  deltas = list(rc.stream(prompt, max_tokens=12, temperature=0))
  assert [t for d in deltas for t in d.token_ids] == want.token_ids
  assert "".join(d.text for d in deltas) == want.text
  assert deltas[-1].finish_reason == pb.FINISH_REASON_LENGTH and deltas[-1].usage.completion_tokens == 12
  direct.close()


def test_prompt_logprobs_through_the_router_equal_one_worker(rc, workers):
  direct = Client(workers[0].address, timeout=120)
  prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
  want = direct.generate(prompt, max_tokens=3, temperature=0, prompt_logprobs=2, logprobs=1)
  got = rc.generate(prompt, max_tokens=3, temperature=0, prompt_logprobs=2, logprobs=1)
  assert [lp.token_id for lp in want.prompt_logprobs] == prompt[1:]
  assert got.prompt_logprobs == want.prompt_logprobs and got.logprobs == want.logprobs
  streamed = GenerateResult.join(list(rc.stream(prompt, max_tokens=3, temperature=0, prompt_logprobs=2)))
  assert streamed.prompt_logprobs == want.prompt_logprobs
  direct.close()


def test_openai_http_through_the_router(router, workers):
  import httpx
  direct = Client(workers[0].address, timeout=120).generate([3, 4, 5], max_tokens=5, temperature=0)
  r = httpx.post(f"http://127.0.0.1:{router.http_port}/v1/completions",
                 json=dict(prompt=[3, 4, 5], max_tokens=5, temperature=0), timeout=60)
  assert r.status_code == 200, r.text
  assert r.json()["choices"][0]["text"] == direct.text


def test_shared_prefix_lands_on_the_worker_that_holds_it(rc, router, workers):
  prefix = list(range(60, 100))  # 40 tokens = 10 blocks, seen by no other test
  first = rc.generate(prefix + [200], max_tokens=2, temperature=0)
  assert first.usage.cached_tokens == 0
  assert index_caught_up(router, workers)  # the holder's KV events are in the router's index
  before = router.metrics_text()
  cached = []
  for i in range(6):  # a coin flip each if routing ignored the cache: 1/64 to pass by luck
    r = rc.generate(prefix + [201 + i, 7], max_tokens=2, temperature=0)
    cached.append(r.usage.cached_tokens)
  assert cached == [40] * 6
  after = router.metrics_text()
  for name in ("jaxinfer_router_predicted_cached_tokens_total", "jaxinfer_router_actual_cached_tokens_total"):
    assert total(after, name) - total(before, name) == 6 * 40, name


INVALID = [
    (dict(prompt=[1, 999]), "prompt token id 999 is out of range [0, 320)"),
    (dict(prompt=[1, 2], max_tokens=5000), "exceeds max_model_len=4096"),
    (dict(prompt=[1, 2], temperature=-1.0), "sampling.temperature"),
    (dict(prompt="", max_tokens=3), "prompt is empty"),
    (dict(prompt=[1, 2], structured=dict(regex="(unclosed")), "structured"),
]


def test_invalid_requests_are_refused_by_the_router_as_a_worker_would(rc, workers):
  counters = ("jaxinfer_prompt_tokens_total", "jaxinfer_generation_tokens_total",
              "jaxinfer_rejected_requests_total")

  def worker_counts():
    return [total(w.metrics_text(), n) for w in workers for n in counters]

  before = worker_counts()
  errors = []
  for kw, fragment in INVALID:
    kw = dict(kw)
    prompt = kw.pop("prompt")
    with pytest.raises(grpc.RpcError) as e:
      rc.generate(prompt, **{"max_tokens": 2, **kw})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert fragment in e.value.details()
    errors.append(e.value.details())
  assert worker_counts() == before  # nothing reached a worker
  direct = Client(workers[0].address, timeout=120)
  for (kw, _), got in zip(INVALID, errors):
    kw = dict(kw)
    prompt = kw.pop("prompt")
    with pytest.raises(grpc.RpcError) as e:
      direct.generate(prompt, **{"max_tokens": 2, **kw})
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, got)
  direct.close()


def test_a_worker_of_another_model_or_a_dead_address_is_refused_at_start(tmp_path, model_dir, workers):
  """Two routers, started at once: one whose --model differs from the workers' (vocab_size),
  one given an address nothing listens on. Each exits 1 naming the worker and why."""
  other = tmp_path / "other"
  shutil.copytree(model_dir, other)
  cfg = json.loads((other / "config.json").read_text())
  cfg["vocab_size"] = 512  # the router reads config and tokenizer only: no weights to mismatch
  (other / "config.json").write_text(json.dumps(cfg))
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens once the socket closes
  mismatched = route(other, [w.address for w in workers], "--connect-timeout", "30")
  unreachable = route(model_dir, [workers[0].address, dead], "--connect-timeout", "1")
  assert mismatched.proc.wait(120) == 1
  err = mismatched.proc.stderr.read()
  assert (f"jaxinfer: error: worker {workers[0].address} serves another model: its vocab_size is 320, "
          f"the router's --model {other} has 512") in err, err
  assert unreachable.proc.wait(120) == 1
  err = unreachable.proc.stderr.read()
  assert f"jaxinfer: error: worker {dead} is not SERVING after 1 s (UNAVAILABLE" in err, err


def wait_for(predicate, timeout=10.0):
  end = time.monotonic() + timeout
  while not predicate():
    if time.monotonic() > end:
      return False
    time.sleep(0.05)
  return True


def test_a_client_cancel_aborts_the_request_on_its_worker(rc, workers):
  def running():
    return sum(total(w.metrics_text(), "jaxinfer_running_requests") for w in workers)

  assert wait_for(lambda: running() == 0)
  stream = rc.stream([21, 22, 23], max_tokens=3000, temperature=0, ignore_eos=True)
  assert next(stream).token_ids
  assert running() == 1
  stream.close()  # cancels the client's call; the router cancels the worker's
  assert wait_for(lambda: running() == 0, 5.0), "the worker kept running a request nobody reads"


def test_sigterm_drains_the_router(model_dir, workers):
  p = route(model_dir, [w.address for w in workers], "--grace-period", "1").wait()
  with Client(p.address, timeout=60) as c:
    short = c.stream([24, 25], max_tokens=20, temperature=0, ignore_eos=True)
    long = c.stream([26, 27], max_tokens=3000, temperature=0, ignore_eos=True)
    got_short = [next(short)]
    assert next(long).token_ids
    p.proc.send_signal(signal.SIGTERM)
    got_short += list(short)  # finishes within the grace period
    assert sum(len(d.token_ids) for d in got_short) == 20
    with pytest.raises(grpc.RpcError) as e:
      for _ in long:
        pass
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shut down before it finished (grace period 1 s)" in e.value.details()
  assert p.proc.wait(30) == 0


class FakeWorker:
  """A worker that says it serves the model (workers[0]'s ModelInfo) and is SERVING,
  but fails every Generate with UNAVAILABLE before any token."""

  def __init__(self, info: pb.ModelInfo):
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2_grpc

    from jaxinfer.serving.proto import inference_pb2_grpc as pb_grpc
    from jaxinfer.serving.proto import kv_events_pb2 as kv_pb
    from jaxinfer.serving.proto import kv_events_pb2_grpc as kv_pb_grpc

    class Inference(pb_grpc.InferenceServicer):
      def GetModelInfo(self, request, context):
        return info

      def Generate(self, request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, "fake worker: going away")

    class KVEvents(kv_pb_grpc.KVEventsServicer):
      def WatchKVEvents(self, request, context):
        yield kv_pb.WatchKVEventsResponse(snapshot=kv_pb.KVSnapshot(seq=0, block_size=info.page_size))
        while context.is_active():
          time.sleep(0.05)

    self.server = grpc.server(futures.ThreadPoolExecutor(8))
    pb_grpc.add_InferenceServicer_to_server(Inference(), self.server)
    kv_pb_grpc.add_KVEventsServicer_to_server(KVEvents(), self.server)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), self.server)  # "" is SERVING
    self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
    self.server.start()

  def stop(self):
    self.server.stop(0)


def test_a_request_whose_worker_fails_before_its_first_token_is_retried_elsewhere(model_dir, workers):
  with Client(workers[0].address, timeout=60) as c:
    fake = FakeWorker(c.model_info())
  p = route(model_dir, [workers[0].address, fake.address]).wait()
  try:
    with Client(p.address, timeout=60) as c:
      for i in range(12):  # idle workers tie (a seeded draw each) once a health check has the fake up again
        assert wait_for(lambda: total(p.metrics_text(), f'jaxinfer_router_worker_up{{worker="{fake.address}"}}') == 1)
        assert len(c.generate([50 + i, 51, 52], max_tokens=2, ignore_eos=True).token_ids) == 2
    text = p.metrics_text()
    retried = total(text, f'jaxinfer_router_retried_requests_total{{worker="{fake.address}"}}')
    routed_fake = total(text, f'jaxinfer_router_routed_requests_total{{role="both",worker="{fake.address}"}}')
    assert retried == routed_fake == TIES_TO_SECOND_OF_12  # every request the fake got was served by the other
  finally:
    p.stop()
    fake.stop()


def test_a_worker_that_refuses_before_the_first_token_is_retried_elsewhere(model_dir, workers, busy):
  """A worker whose admission limit (--max-waiting-tokens 1) refuses every prompt of more
  than one token with RESOURCE_EXHAUSTED, next to a normal one: every request the router
  gives it is served by the other instead, and it stays up (busy is not dead). Alone
  behind a router, its refusal reaches the client as RESOURCE_EXHAUSTED."""
  p = route(model_dir, [workers[0].address, busy.address])
  alone = route(model_dir, [busy.address])  # both routers start at once
  try:
    p.wait()
    with Client(p.address, timeout=60) as c:
      for i in range(12):  # idle workers, no shared full block: a tie each, drawn by the seeded generator
        assert len(c.generate([60 + i, 61, 62], max_tokens=2, ignore_eos=True).token_ids) == 2
    text = p.metrics_text()
    retried = total(text, f'jaxinfer_router_retried_requests_total{{worker="{busy.address}"}}')
    routed_busy = total(text, f'jaxinfer_router_routed_requests_total{{role="both",worker="{busy.address}"}}')
    assert retried == routed_busy == TIES_TO_SECOND_OF_12
    assert total(text, f'jaxinfer_router_worker_up{{worker="{busy.address}"}}') == 1
    alone.wait()
    with Client(alone.address, timeout=60) as c, pytest.raises(grpc.RpcError) as e:
      c.generate([70, 71], max_tokens=2)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    assert "max_waiting_tokens=1" in e.value.details()
  finally:
    p.stop()
    alone.stop()


def test_workers_join_and_leave_while_the_router_runs(model_dir, workers, tmp_path):
  """--workers-file re-read every 0.3 s. Worker a alone: it caches a prefix and runs a
  long stream. The file then names b instead: a leaves at once (no new request; its
  index entries dropped, so b, reusing a's slot, is not predicted to hold a's prefix)
  while its stream runs on to its end there; b joins once SERVING and gets the requests."""
  a, b = workers
  listing = tmp_path / "workers"
  listing.write_text(f"{a.address}  # the first\n")
  p = JaxinferProcess("route", "--model", str(model_dir), "--workers-file", str(listing), "--resolve-interval",
                      "0.3", "--port", "0", "--metrics-port", "0", "--health-interval", "0.3").wait()
  try:
    def metric(name, w):
      m = re.search(rf'^{name}\{{(?:role="both",)?worker="{re.escape(w.address)}"\}} (\S+)$', p.metrics_text(), re.M)
      return float(m.group(1)) if m else 0.0

    with Client(p.address, timeout=120) as c:
      prefix = list(range(110, 150))  # 10 blocks, seen by no other test
      c.generate(prefix + [7], max_tokens=2, temperature=0)
      stream = c.stream([51, 52], max_tokens=1500, temperature=0, ignore_eos=True)
      first = next(stream)
      assert metric("jaxinfer_router_routed_requests_total", a) == 2
      assert index_caught_up(p, [a])  # a's KV events of the prefix are in the index
      listing.write_text(f"{b.address}\n")
      assert wait_for(lambda: metric("jaxinfer_router_worker_up", b) == 1, 30), p.tail()
      assert metric("jaxinfer_router_worker_up", a) == 0
      assert a.metric("jaxinfer_running_requests") == 1  # the stream was still running on a when it left
      assert c.generate(prefix + [8], max_tokens=2, temperature=0).usage.cached_tokens == 0
      assert metric("jaxinfer_router_predicted_cached_tokens_total", b) == 0
      assert metric("jaxinfer_router_routed_requests_total", b) == 1
      assert metric("jaxinfer_router_routed_requests_total", a) == 2
      rest = list(stream)
      assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 1500
      assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
  finally:
    p.stop()


def test_killing_a_worker_mid_stream(rc, router, workers):
  """Last: it kills workers[1]. Its streams end UNAVAILABLE within seconds; the
  other worker's finish; later requests are routed around it."""
  n = 6
  streams = [rc.stream([30 + i] * 6, max_tokens=400, temperature=0, ignore_eos=True) for i in range(n)]
  firsts = [next(s) for s in streams]  # all running: the router split them by load
  assert all(f.token_ids for f in firsts)
  routed = re.findall(r'^jaxinfer_router_routed_requests_total\{role="both",worker="([^"]+)"\} (\S+)$',
                      router.metrics_text(), re.M)
  assert len(routed) == 2
  outcome: list = [None] * n
  ended_at: list = [None] * n

  def drain(i):
    try:
      outcome[i] = len(firsts[i].token_ids) + sum(len(d.token_ids) for d in streams[i])
    except grpc.RpcError as e:
      outcome[i] = e
    ended_at[i] = time.monotonic()

  threads = [threading.Thread(target=drain, args=(i,)) for i in range(n)]
  for t in threads:
    t.start()
  killed_at = time.monotonic()
  workers[1].proc.kill()
  for t in threads:
    t.join(120)
  failed = [(o, t - killed_at) for o, t in zip(outcome, ended_at) if isinstance(o, grpc.RpcError)]
  finished = [o for o in outcome if not isinstance(o, grpc.RpcError)]
  assert failed and finished, outcome
  for e, after in failed:
    assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
    assert f"worker {workers[1].address} went away mid-request" in e.details()
    assert after < 5.0
  assert finished == [400] * len(finished)
  # New requests go to the live worker (the failed stream marked the other down at once).
  for i in range(4):
    assert len(rc.generate([40 + i, 41], max_tokens=3, ignore_eos=True).token_ids) == 3
