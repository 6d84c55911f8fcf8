"""`jaxinfer route --prefill-workers P1,P2 --decode-workers D`: the router picks the
prefill worker by cached prefix and names it to the decode worker in the
`x-jaxinfer-prefill-worker` metadata. Real processes on loopback, the tiny llama3
and worker flags of test_router.py (pages of 4 tokens).

The test that kills a prefill worker runs last (file order)."""

import grpc
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.serving import Client
from jaxinfer.serving.client import build_request
from jaxinfer.serving.proto import inference_pb2 as pb
from jaxinfer.serving.proto import inference_pb2_grpc as pb_grpc
from jaxinfer.serving.server import PREFILL_WORKER_METADATA
from jaxinfer.serving.process import JaxinferProcess
from test_router import PAGE, TIES_TO_SECOND_OF_12, WORKER_FLAGS, FakeWorker, free_port, index_caught_up, total


def route(model_dir, prefill, decode, *args):
  return JaxinferProcess("route", "--model", str(model_dir), "--prefill-workers", ",".join(prefill),
              "--decode-workers", ",".join(decode), "--port", "0", "--metrics-port", "0",
              "--health-interval", "0.3", *args)


def serve(model_dir, role, *args, port=0):
  return JaxinferProcess("serve", "--model", str(model_dir), "--port", str(port), "--role", role, *WORKER_FLAGS, *args)


@pytest.fixture(scope="module")
def processes(model_dir):
  """Every worker of the module (the prefill workers on ports picked beforehand, so the
  decode workers can name them): two prefill workers and a decode worker taking KV from
  both; a prefill worker whose admission limit (--max-waiting-tokens 1) refuses every
  prompt, and a decode worker taking KV from it and the first. The first test's setup
  carries their start (over 30 s on two cores): each process loads the model and warms up,
  running every step program. All five compile the same programs: the first warms up alone,
  so that on a cold compilation cache it compiles them once and the other four, started
  together after it, read them from the cache rather than compiling them five times over."""
  ports = [free_port() for _ in range(3)]
  p0, p1, pbusy = (f"127.0.0.1:{port}" for port in ports)
  procs = [serve(model_dir, "prefill", port=ports[0])]
  try:
    procs[0].wait()
    procs += [serve(model_dir, "prefill", port=ports[1]),
              serve(model_dir, "decode", "--prefill-workers", f"{p0},{p1}"),
              serve(model_dir, "prefill", "--max-waiting-tokens", "1", port=ports[2]),
              serve(model_dir, "decode", "--prefill-workers", f"{p0},{pbusy}")]
    yield [procs[0], *(p.wait() for p in procs[1:])]  # procs[0] is up (wait() reads its log once)
  finally:
    for p in procs:
      p.stop()


@pytest.fixture(scope="module")
def prefills(processes):
  return processes[:2]


@pytest.fixture(scope="module")
def decode(processes):
  return processes[2]


@pytest.fixture(scope="module")
def busy_and_its_decode(processes):
  return processes[3:]


@pytest.fixture(scope="module")
def router1(model_dir, prefills, decode):
  """One prefill worker (a subset of the decode worker's two) and the decode worker."""
  p = route(model_dir, [prefills[0].address], [decode.address]).wait()
  yield p
  p.stop()


@pytest.fixture(scope="module")
def router2(model_dir, prefills, decode):
  p = route(model_dir, [w.address for w in prefills], [decode.address]).wait()
  yield p
  p.stop()


@pytest.fixture(scope="module")
def reference(model_dir):
  return LLM(model_dir, page_size=PAGE, max_num_seqs=8, max_num_batched_tokens=32, warmup=False)


PROMPTS = ["Hello there", [5, 6, 7, 8, 9, 10, 11, 12, 13], [{"role": "user", "content": "Hi, who are you?"}]]


@pytest.mark.parametrize("prompt", PROMPTS, ids=["text", "ids", "chat"])
def test_greedy_outputs_equal_one_worker(router1, prefills, reference, prompt):
  want = reference.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
  before, routed_before = prefills[0].metrics_text(), router1.metrics_text()
  with Client(router1.address, timeout=120) as c:
    got = c.generate(prompt, max_tokens=12, temperature=0)
    assert (got.token_ids, got.text) == (want.token_ids, want.text)
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    deltas = list(c.stream(prompt, max_tokens=12, temperature=0))
  assert [t for d in deltas for t in d.token_ids] == want.token_ids
  assert "".join(d.text for d in deltas) == want.text
  assert deltas[-1].finish_reason == pb.FINISH_REASON_LENGTH and deltas[-1].usage.completion_tokens == 12
  # The prompts were computed by the prefill worker (its first token is the output's first).
  after = prefills[0].metrics_text()
  assert total(after, "jaxinfer_prompt_tokens_total") - total(before, "jaxinfer_prompt_tokens_total") == \
      2 * len(want.prompt_token_ids)
  name = f'jaxinfer_router_routed_requests_total{{role="prefill",worker="{prefills[0].address}"}}'
  assert total(router1.metrics_text(), name) - total(routed_before, name) == 2


def test_shared_prefix_goes_to_the_prefill_worker_that_holds_it(router2, prefills):
  prefix = list(range(60, 100))  # 40 tokens = 10 blocks, seen by no other test
  with Client(router2.address, timeout=120) as c:
    c.generate(prefix + [200], max_tokens=2, temperature=0)
    assert index_caught_up(router2, prefills)  # the holder's KV events are in the router's index
    text = router2.metrics_text()
    routed = [total(text, f'jaxinfer_router_routed_requests_total{{role="prefill",worker="{w.address}"}}')
              for w in prefills]
    holder = routed.index(1.0)  # the first request went to one of them (a tie: either)
    other = 1 - holder
    hits = [total(w.metrics_text(), "jaxinfer_prefix_cache_hit_tokens_total") for w in prefills]
    for i in range(6):  # a coin flip each if routing ignored the prefill workers' caches
      r = c.generate(prefix + [201 + i, 7], max_tokens=2, temperature=0)
      assert r.usage.prefill_cached_tokens == 40  # relayed: prefill worker -> decode worker -> router
  after = router2.metrics_text()
  h, o = prefills[holder].address, prefills[other].address
  assert total(after, f'jaxinfer_router_routed_requests_total{{role="prefill",worker="{h}"}}') == 7
  assert total(after, f'jaxinfer_router_routed_requests_total{{role="prefill",worker="{o}"}}') == 0
  # The holder's own prefix cache served the 10 blocks each time, and the router's
  # prediction and the count the decode worker relays from the holder agree.
  assert total(prefills[holder].metrics_text(), "jaxinfer_prefix_cache_hit_tokens_total") - hits[holder] == 6 * 40
  for name in ("jaxinfer_router_predicted_cached_tokens_total", "jaxinfer_router_actual_cached_tokens_total"):
    assert total(after, f'{name}{{worker="{h}"}}') - total(text, f'{name}{{worker="{h}"}}') == 6 * 40, name


def generate_with_hint(address, prompt, hint, **sampling):
  with grpc.insecure_channel(address) as ch:
    call = pb_grpc.InferenceStub(ch).Generate(build_request(prompt, stream=False, **sampling), timeout=120,
                                              metadata=[(PREFILL_WORKER_METADATA, hint)])
    return list(call)


def test_the_decode_worker_takes_the_kv_from_the_hinted_prefill_worker(decode, prefills):
  for target in (1, 0):  # each in turn: its default pick alone would not hit both
    before = [total(w.metrics_text(), "jaxinfer_prompt_tokens_total") for w in prefills]
    r = generate_with_hint(decode.address, [9, 8, 7, 6, 5], prefills[target].address, max_tokens=3,
                           temperature=0)
    assert len(r[-1].token_ids) == 3
    after = [total(w.metrics_text(), "jaxinfer_prompt_tokens_total") for w in prefills]
    assert [a - b for a, b in zip(after, before)] == [5 * (i == target) for i in range(2)]


def test_a_bad_hint_is_invalid_argument(decode, prefills, router2):
  bogus = "10.0.0.1:1"
  with pytest.raises(grpc.RpcError) as e:
    generate_with_hint(decode.address, [1, 2, 3], bogus, max_tokens=2)
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert (f"x-jaxinfer-prefill-worker: '{bogus}' is not one of this decode worker's --prefill-workers "
          f"{[w.address for w in prefills]}") in e.value.details()
  with pytest.raises(grpc.RpcError) as e:  # a prefill worker imports no KV
    generate_with_hint(prefills[0].address, [1, 2, 3], prefills[1].address, max_tokens=2)
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert "this worker's role is prefill, not decode" in e.value.details()
  with pytest.raises(grpc.RpcError) as e:  # the router picks; a client does not
    generate_with_hint(router2.address, [1, 2, 3], prefills[0].address, max_tokens=2)
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert "the router picks the prefill worker itself" in e.value.details()


def test_decode_workers_must_accept_the_routers_prefill_workers(model_dir, prefills, decode):
  with Client(prefills[0].address, timeout=60) as c:
    info = c.model_info()
  assert (info.role, list(info.prefill_workers)) == ("prefill", [])
  with Client(decode.address, timeout=60) as c:
    info = c.model_info()
  assert (info.role, list(info.prefill_workers)) == ("decode", [w.address for w in prefills])
  # A prefill worker the decode worker was not told about: its Generate would refuse the hint.
  stranger = pb.ModelInfo()
  stranger.CopyFrom(info)
  stranger.role = "prefill"
  del stranger.prefill_workers[:]
  fake = FakeWorker(stranger)
  try:
    p = route(model_dir, [prefills[0].address, fake.address], [decode.address], "--connect-timeout", "30")
    assert p.proc.wait(120) == 1
    err = p.proc.stderr.read()
    assert (f"jaxinfer: error: decode worker {decode.address} does not take KV from the router's prefill "
            f"worker(s) ['{fake.address}']: its --prefill-workers are "
            f"{[w.address for w in prefills]}") in err, err
  finally:
    fake.stop()
  # Roles swapped: a prefill worker where a decode worker belongs.
  p = route(model_dir, [prefills[0].address], [prefills[1].address], "--connect-timeout", "30")
  assert p.proc.wait(120) == 1
  err = p.proc.stderr.read()
  assert (f"jaxinfer: error: decode worker {prefills[1].address} is not a decode worker: its role is "
          "'prefill'") in err, err


def test_route_flags_are_checked_before_anything_connects(model_dir):
  cases = [
      (["--workers", "127.0.0.1:1", "--prefill-workers", "127.0.0.1:2", "--decode-workers", "127.0.0.1:3"],
       "give --workers (aggregated: each worker serves whole requests) or --prefill-workers with "
       "--decode-workers (disaggregated), not both"),
      (["--prefill-workers", "127.0.0.1:2"], "decode_workers: a disaggregated router needs at least one "
                                             "prefill and one decode worker"),
      ([], "workers: give at least one worker address"),
      (["--workers", "dns:localhost"], "--workers: 'dns:localhost' is not dns:HOST:PORT"),
      (["--prefill-workers", "127.0.0.1:2", "--decode-workers", "127.0.0.1:2"], "127.0.0.1:2 is given twice"),
      (["--prefill-workers", "127.0.0.1:2", "--decode-workers", "127.0.0.1:3", "--resolve-interval", "1"],
       "resolve_interval_s: only --workers (aggregated) can change while the router runs"),
      (["--workers-file", "/nonexistent/workers"], "--workers-file: [Errno 2] No such file or directory")]
  procs = [(JaxinferProcess("route", "--model", str(model_dir), "--port", "0", *args), args, message)
           for args, message in cases]  # all at once: each is a Python start-up
  for p, args, message in procs:
    assert p.proc.wait(120) == 1, args
    err = p.proc.stderr.read()
    assert "jaxinfer: error: " in err and message in err, (args, err)


def test_dns_entries_expand_to_the_resolved_addresses(model_dir, prefills, decode):
  """dns:localhost:PORT is 127.0.0.1:PORT here: the spelling the decode worker was given."""
  p = route(model_dir, [f"dns:localhost:{prefills[1].port}"], [f"dns:localhost:{decode.port}"]).wait()
  try:
    with Client(p.address, timeout=120) as c:
      assert len(c.generate([4, 5, 6], max_tokens=2, ignore_eos=True).token_ids) == 2
    text = p.metrics_text()
    assert total(text, f'jaxinfer_router_routed_requests_total{{role="prefill",worker="{prefills[1].address}"}}') == 1
    assert total(text, f'jaxinfer_router_routed_requests_total{{role="decode",worker="{decode.address}"}}') == 1
  finally:
    p.stop()


def test_a_prefill_worker_that_refuses_is_retried_on_another(model_dir, prefills, busy_and_its_decode):
  """A prefill worker whose admission limit (--max-waiting-tokens 1) refuses every prompt
  next to a normal one, behind a decode worker that takes KV from both: a request whose
  prefill the router gives to the refusing one (the decode worker answers
  RESOURCE_EXHAUSTED naming it) is prefilled by the other instead, and the refusing one
  stays up."""
  busy, dec = busy_and_its_decode
  p = route(model_dir, [prefills[0].address, busy.address], [dec.address]).wait()
  try:
    with Client(p.address, timeout=60) as c:
      for i in range(12):  # idle prefill workers, no shared full block: a tie each, drawn by the seeded generator
        assert len(c.generate([80 + i, 81, 82], max_tokens=2, ignore_eos=True).token_ids) == 2
    text = p.metrics_text()
    retried = total(text, f'jaxinfer_router_retried_requests_total{{worker="{busy.address}"}}')
    routed_busy = total(text, f'jaxinfer_router_routed_requests_total{{role="prefill",worker="{busy.address}"}}')
    assert retried == routed_busy == TIES_TO_SECOND_OF_12
    assert total(text, f'jaxinfer_router_routed_requests_total{{role="prefill",worker="{prefills[0].address}"}}') == 12
    assert total(text, f'jaxinfer_router_worker_up{{worker="{busy.address}"}}') == 1
  finally:
    p.stop()


def test_a_dead_prefill_worker_is_routed_around(model_dir, router2, prefills, decode):
  """Last: it kills the prefill worker that holds a prefix. The next request with that
  prefix is routed there (the index still says so) or, once a health check saw it
  dead, elsewhere; either way it is served, before its first token, by the other.
  Through a router whose health checks are a minute apart the first such request
  certainly goes to the dead holder: it must be retried, not failed."""
  def routed(text, w):
    return total(text, f'jaxinfer_router_routed_requests_total{{role="prefill",worker="{w.address}"}}')

  prefix = list(range(150, 190))
  blind = None
  try:
    with Client(router2.address, timeout=120) as c:
      before = router2.metrics_text()
      c.generate(prefix + [1], max_tokens=2, temperature=0)
      after = router2.metrics_text()
      holder = next(i for i, w in enumerate(prefills) if routed(after, w) > routed(before, w))
      # A second router that health-checks once a minute: it cannot learn of the death below
      # from a check, so its first request with the prefix goes to the dead holder.
      blind = route(model_dir, [w.address for w in prefills], [decode.address], "--health-interval", "60")
      blind.wait()
      # The holder's blocks are in both indexes: the next request would go there.
      assert index_caught_up(router2, prefills) and index_caught_up(blind, prefills)
      prefills[holder].proc.kill()
      prefills[holder].proc.wait(30)
      for i in range(4):
        assert len(c.generate(prefix + [3 + i], max_tokens=3, ignore_eos=True).token_ids) == 3
    text = router2.metrics_text()
    assert total(text, f'jaxinfer_router_worker_up{{worker="{prefills[holder].address}"}}') == 0
    assert routed(text, prefills[1 - holder]) - routed(after, prefills[1 - holder]) == 4
    with Client(blind.address, timeout=120) as c:
      assert len(c.generate(prefix + [9], max_tokens=3, ignore_eos=True).token_ids) == 3
    text = blind.metrics_text()
    dead = prefills[holder].address
    # Sent to the holder (the index's choice), failed UNAVAILABLE before its first token,
    # prefilled by the other one.
    assert routed(text, prefills[holder]) == 1 and routed(text, prefills[1 - holder]) == 1
    assert total(text, f'jaxinfer_router_retried_requests_total{{worker="{dead}"}}') == 1
    assert total(text, f'jaxinfer_router_worker_up{{worker="{dead}"}}') == 0
  finally:
    if blind is not None:
      blind.stop()
