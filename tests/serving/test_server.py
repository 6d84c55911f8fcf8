"""The gRPC server with real sockets on localhost, over a tiny llama3 whose
context was stretched to 4096 positions so that long requests outlive the
cancellations, deadlines and shutdowns the tests aim at them."""

import asyncio
import re
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from helpers import FailingTokenizer
from jaxinfer import LLM, SamplingParams
from jaxinfer.serving import Client, InferenceServer, ServerConfig
from jaxinfer.serving.client import GenerateResult
from jaxinfer.serving.proto import inference_pb2 as pb

ENGINE = dict(max_num_seqs=32, max_num_batched_tokens=64, warmup=False)
LONG = dict(max_tokens=3000, ignore_eos=True, temperature=0)  # seconds of work: outlives any test's patience


@pytest.fixture(scope="module")
def reference(model_dir):
  return LLM(model_dir, **ENGINE)


@pytest.fixture(scope="module")
def server(model_dir):
  llm = LLM(model_dir, **ENGINE)
  s = InferenceServer(llm, ServerConfig(port=0, metrics_port=0)).start_in_thread()
  yield s
  s.stop_in_thread(5)


@pytest.fixture
def client(server):
  with Client(f"127.0.0.1:{server.port}", timeout=120) as c:
    yield c


def pool_is_full(server, timeout=10.0):
  """Waits until no request holds a KV page (aborts are taken between steps)."""
  full = server.llm.engine.kv.num_pages - 1
  end = time.monotonic() + timeout
  while True:
    free, unfinished = server.call_engine(lambda e: (e.kv.num_free_pages, e.num_unfinished))
    if (free, unfinished) == (full, 0) or time.monotonic() > end:
      return free == full and unfinished == 0
    time.sleep(0.02)


PROMPTS = [[1, 5, 9, 200, 17], list(range(3, 90)), [7] * 33, "Hello world, how are you?",
           [{"role": "user", "content": "What is the capital of France?"}]]


def test_greedy_streams_equal_llm_generate(client, reference):
  want = reference.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
  for prompt, ref in zip(PROMPTS, want):
    deltas = list(client.stream(prompt, temperature=0, max_tokens=24, ignore_eos=True))
    assert [t for d in deltas for t in d.token_ids] == ref.token_ids
    assert "".join(d.text for d in deltas) == ref.text
    assert all(d.finish_reason == pb.FINISH_REASON_UNSPECIFIED for d in deltas[:-1])
    last = deltas[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert last.usage.completion_tokens == 24
    assert 0 < last.usage.time_to_first_token_s <= last.usage.latency_s
    whole = client.generate(prompt, temperature=0, max_tokens=24, ignore_eos=True, request_id="mine")
    assert (whole.token_ids, whole.text, whole.finish_reason) == (ref.token_ids, ref.text, "length")
    assert whole.request_id == "mine"


def test_logprobs_stop_strings_and_seeds_match_the_engine(client, reference):
  sp = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=12, logprobs=3, stop_token_ids=(5,))
  ref = reference.generate([[1, 2, 3, 4]], sp)[0]
  got = client.generate([1, 2, 3, 4], params=sp)
  assert got.token_ids == ref.token_ids
  assert [lp.logprob for lp in got.logprobs] == pytest.approx(ref.logprobs, abs=1e-6)
  for lp, top in zip(got.logprobs, ref.top_logprobs):
    assert {t.token_id: t.logprob for t in lp.top} == pytest.approx(top, abs=1e-6)
    assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
  # A stop string cut from the text; the streamed deltas add up to the cut text.
  text = reference.generate(["Hello"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].text
  stop = text[5:8]
  ref = reference.generate(["Hello"], SamplingParams(temperature=0, max_tokens=30, stop=(stop,)))[0]
  deltas = list(client.stream("Hello", temperature=0, max_tokens=30, stop=[stop]))
  assert "".join(d.text for d in deltas) == ref.text
  assert deltas[-1].finish_reason == pb.FINISH_REASON_STOP


def test_prompt_logprobs_come_with_the_first_token(client, reference):
  prompt = [1, 5, 9, 200, 17, 3]
  ref = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2))[0]
  for got in (client.generate(prompt, params=SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)),
              GenerateResult.join(list(client.stream(prompt, temperature=0, max_tokens=3, prompt_logprobs=2)))):
    assert got.token_ids == ref.token_ids
    assert [lp.token_id for lp in got.prompt_logprobs] == prompt[1:]
    for lp, want, t in zip(got.prompt_logprobs, ref.prompt_logprobs[1:], prompt[1:]):
      assert lp.logprob == pytest.approx(want[t], abs=1e-6)
      assert {x.token_id: x.logprob for x in lp.top} == pytest.approx(want, abs=1e-6)
      assert [x.logprob for x in lp.top] == sorted((x.logprob for x in lp.top), reverse=True)
  deltas = list(client.stream(prompt, temperature=0, max_tokens=3, prompt_logprobs=2))
  first = next(d for d in deltas if d.token_ids)
  assert len(first.prompt_logprobs) == 5 and not any(d.prompt_logprobs for d in deltas if d is not first)
  assert not client.generate(prompt, temperature=0, max_tokens=3).prompt_logprobs  # only when asked


def test_64_concurrent_streams_are_batched_and_all_correct(server, reference):
  prompts = [[1 + i, 2 + (i * 7) % 200, 3 + (i * 13) % 250] * (1 + i % 5) for i in range(64)]
  want = reference.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
  steps_before = server.call_engine(lambda e: e.num_steps)

  async def run():
    async with Client(f"127.0.0.1:{server.port}", timeout=300) as c:
      async def one(p):
        return [d async for d in c.astream(p, temperature=0, max_tokens=16, ignore_eos=True)]
      return await asyncio.gather(*(one(p) for p in prompts))

  got = asyncio.run(run())
  for deltas, ref in zip(got, want):
    assert [t for d in deltas for t in d.token_ids] == ref.token_ids
    assert deltas[-1].finish_reason == pb.FINISH_REASON_LENGTH
  # 64 x 16 tokens took far fewer steps than one step per token: they were batched.
  steps = server.call_engine(lambda e: e.num_steps) - steps_before
  assert steps < 64 * 16 / 8
  assert pool_is_full(server)


def test_cancel_mid_stream_frees_pages(server, client):
  stream = client.stream([1, 2, 3], **LONG)
  got = [next(stream) for _ in range(3)]
  assert all(len(d.token_ids) >= 1 for d in got)
  assert server.call_engine(lambda e: e.num_unfinished) == 1
  assert server.call_engine(lambda e: e.kv.num_free_pages) < server.llm.engine.kv.num_pages - 1
  stream.close()  # cancels the call
  assert pool_is_full(server)


def test_deadline_and_disconnect_abort_the_request(server):
  with Client(f"127.0.0.1:{server.port}") as c:
    with pytest.raises(grpc.RpcError) as e:
      c.generate([4, 5, 6], timeout=0.5, **LONG)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
  assert pool_is_full(server)
  c = Client(f"127.0.0.1:{server.port}")
  stream = c.stream([4, 5, 6], **LONG)
  next(stream)
  c.close()  # the connection goes away mid-stream
  assert pool_is_full(server)


INVALID = [
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt=[]), "prompt is empty"),
    (dict(prompt=[1, 99999]), "prompt token id 99999 is out of range"),
    (dict(prompt=[1, 2], max_tokens=4095), "exceeds max_model_len=4096"),
    (dict(prompt=[1, 2], temperature=-1.0), "sampling.temperature must be >= 0"),
    (dict(prompt=[1, 2], top_p=0.0), "sampling.top_p must be in (0, 1]"),
    (dict(prompt=[1, 2], logprobs=50), "sampling.logprobs must be an int in [0, 20]"),
    (dict(prompt=[1, 2], max_tokens=0), "sampling.max_tokens must be an int >= 1"),
    (dict(prompt=[1, 2], presence_penalty=3.0), "sampling.presence_penalty must be in [-2, 2]"),
    (dict(prompt=[{"role": "", "content": "hi"}]), "chat.messages[0].role is empty"),
]


def test_invalid_input_gets_invalid_argument_while_other_streams_go_on(server, client, reference):
  want = reference.generate([[9, 8, 7]], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))[0]
  background = client.stream([9, 8, 7], temperature=0, max_tokens=200, ignore_eos=True)
  first = next(background)
  for kw, message in INVALID:
    kw = dict(kw)
    with pytest.raises(grpc.RpcError) as e:
      client.generate(kw.pop("prompt"), **kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kw
    assert message in e.value.details()
  # No prompt at all, and an empty chat: built by hand (the client would not send them).
  from jaxinfer.serving.proto import inference_pb2_grpc as pb_grpc
  with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
    stub = pb_grpc.InferenceStub(channel)
    for request, message in [(pb.GenerateRequest(), "prompt: set one of text, token_ids, chat"),
                             (pb.GenerateRequest(chat=pb.Chat()), "chat.messages is empty")]:
      with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request))
      assert (e.value.code(), message in e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, True)
  rest = list(background)
  assert list(first.token_ids) + [t for d in rest for t in d.token_ids] == want.token_ids
  assert pool_is_full(server)


def test_a_failure_inside_one_request_is_internal_for_it_only(server, client, reference):
  """The poisoned request's detokenizer raises (helpers.FailingTokenizer, armed only once
  the healthy request is in the engine): INTERNAL for it, the healthy stream goes on."""
  engine = server.llm.engine
  tok = FailingTokenizer(engine.tokenizer)
  want = reference.generate([[11, 12]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
  engine.outputs.tokenizer = tok  # detokenizers come from it
  try:
    healthy = client.stream([11, 12], temperature=0, max_tokens=40, ignore_eos=True)
    first = next(healthy)  # its detokenizer is made: arming now reaches only the next request
    tok.armed = True
    with pytest.raises(grpc.RpcError) as e:
      client.generate([13, 14], temperature=0, max_tokens=40)
    tok.armed = False
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "failed in the engine: RuntimeError: boom" in e.value.details()
    rest = list(healthy)
  finally:
    engine.outputs.tokenizer = tok.tokenizer
  assert list(first.token_ids) + [t for d in rest for t in d.token_ids] == want.token_ids
  assert pool_is_full(server)


def test_tokenize_detokenize_model_info(client, reference):
  tok = reference.tokenizer
  assert client.tokenize("Hello world") == tok.encode("Hello world")
  assert client.tokenize("Hello world", add_special_tokens=False) == tok.encode("Hello world", add_special_tokens=False)
  chat = [{"role": "user", "content": "Hi"}]
  assert client.tokenize(chat) == reference.encode_prompt(chat)[1]
  ids = tok.encode("Hello world")
  assert client.detokenize(ids) == tok.decode(ids, skip_special_tokens=False)
  assert client.detokenize(ids, skip_special_tokens=True) == tok.decode(ids)
  with pytest.raises(grpc.RpcError) as e:
    client.detokenize([1, 10**6])
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in e.value.details()
  info = client.model_info()
  assert (info.max_model_len, info.vocab_size, info.dtype, info.max_num_seqs, info.architecture) == (
      4096, reference.config.vocab_size, "float32", 32, "llama")
  assert info.devices and info.num_pages == reference.engine.kv.num_pages
  assert list(info.eos_token_ids) == list(tok.eos_ids)


def test_async_client_methods(server, reference):
  async def run():
    async with Client(f"127.0.0.1:{server.port}", timeout=60) as c:
      r = await c.agenerate([1, 2, 3], temperature=0, max_tokens=8, ignore_eos=True)
      return r, await c.atokenize("Hello"), await c.adetokenize([5, 6]), await c.amodel_info()

  r, ids, text, info = asyncio.run(run())
  ref = reference.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
  assert r.token_ids == ref.token_ids and r.finish_reason == "length"
  assert ids == reference.tokenizer.encode("Hello")
  assert text == reference.tokenizer.decode([5, 6], skip_special_tokens=False)
  assert info.vocab_size == reference.config.vocab_size


def test_reflection_lists_the_services(server):
  with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
    stub = reflection_pb2_grpc.ServerReflectionStub(ch)
    responses = list(stub.ServerReflectionInfo(iter([
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="jaxinfer.v1.Inference")])))
  names = {s.name for s in responses[0].list_services_response.service}
  assert {"jaxinfer.v1.Inference", "grpc.health.v1.Health"} <= names
  assert responses[1].file_descriptor_response.file_descriptor_proto  # grpcurl can describe it


def metric(text, name, missing=None):
  """The sample `name` in a scrape; a labelled counter not yet created reads `missing`."""
  m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
  if m is None and missing is not None:
    return missing
  assert m, f"{name} missing from /metrics"
  return float(m.group(1))


def test_prometheus_metrics(server, client):
  def scrape():
    return urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()

  before = scrape()
  client.generate([1, 2, 3, 4, 5], temperature=0, max_tokens=10, ignore_eos=True)
  after = scrape()
  assert metric(after, "jaxinfer_generation_tokens_total") - metric(before, "jaxinfer_generation_tokens_total") == 10
  assert metric(after, "jaxinfer_prompt_tokens_total") - metric(before, "jaxinfer_prompt_tokens_total") == 5
  assert (metric(after, "jaxinfer_time_to_first_token_seconds_count")
          - metric(before, "jaxinfer_time_to_first_token_seconds_count")) == 1
  assert (metric(after, "jaxinfer_inter_token_latency_seconds_count")
          - metric(before, "jaxinfer_inter_token_latency_seconds_count")) == 9
  assert (metric(after, 'jaxinfer_finished_requests_total{finish_reason="length"}')
          - metric(before, 'jaxinfer_finished_requests_total{finish_reason="length"}', missing=0.0)) == 1
  with pytest.raises(grpc.RpcError):
    client.generate([1, 2, 3], temperature=-1.0)
  rejected = 'jaxinfer_rejected_requests_total{code="INVALID_ARGUMENT"}'
  assert metric(scrape(), rejected) - metric(after, rejected, missing=0.0) == 1


def scrape(server):
  return urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()


def test_gauges_fall_to_zero_when_the_last_requests_are_aborted(server, client):
  """Regression: aborting the last running requests left the gauges at their old
  values until some later request ran a step."""
  streams = [client.stream([1, 2, 3 + i], **LONG) for i in range(2)]
  for s in streams:
    next(s)  # both are running
  busy = scrape(server)
  assert metric(busy, "jaxinfer_running_requests") == 2
  assert metric(busy, "jaxinfer_kv_cache_usage_ratio") > 0
  for s in streams:
    s.close()  # cancels the call
  assert pool_is_full(server)
  end = time.monotonic() + 5
  while metric(scrape(server), "jaxinfer_running_requests") != 0 and time.monotonic() < end:
    time.sleep(0.02)
  idle = scrape(server)
  assert metric(idle, "jaxinfer_running_requests") == 0
  assert metric(idle, "jaxinfer_waiting_requests") == 0
  assert metric(idle, "jaxinfer_kv_cache_usage_ratio") == 0


def test_health_and_admission_limits_before_warm_up(model_dir):
  """While warm-up is held, admitted requests wait: health says NOT_SERVING,
  admission refuses past each limit; then all of them run (through 2-message
  stream buffers, so deltas merge without losing a token)."""
  llm = LLM(model_dir, **ENGINE)
  gate = threading.Event()
  warmup = llm.engine.warmup
  llm.engine.warmup = lambda *a: (gate.wait(60), warmup(*a))
  config = ServerConfig(port=0, max_waiting_requests=3, max_waiting_tokens=40, stream_buffer=2)
  server = InferenceServer(llm, config).start_in_thread(wait_ready=False)
  try:
    with Client(f"127.0.0.1:{server.port}", timeout=60) as c:
      assert c.health() == "NOT_SERVING" and c.health("jaxinfer.v1.Inference") == "NOT_SERVING"
      results = {}

      def run(name, prompt):
        try:
          results[name] = list(c.stream(prompt, temperature=0, ignore_eos=True, max_tokens=12))
        except grpc.RpcError as e:
          results[name] = e

      def admit(name, prompt, waiting):
        threads.append(threading.Thread(target=run, args=(name, prompt)))
        threads[-1].start()
        end = time.monotonic() + 30
        while server.backend.waiting_requests < waiting and time.monotonic() < end:
          time.sleep(0.01)

      threads = []
      admit("a", [1] * 30, 1)
      admit("b", [2] * 5, 2)
      assert (server.backend.waiting_requests, server.backend.waiting_tokens) == (2, 35)
      with pytest.raises(grpc.RpcError) as e:
        c.generate([3] * 6, max_tokens=4)  # 35 + 6 > 40 tokens
      assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
      assert "max_waiting_tokens=40" in e.value.details() and "35 prompt tokens are waiting" in e.value.details()
      admit("c", [3], 3)  # 36 tokens: fits
      with pytest.raises(grpc.RpcError) as e:
        c.generate([4], max_tokens=4)  # a 4th request
      assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
      assert "3 requests are waiting (max_waiting_requests=3)" in e.value.details()
      gate.set()
      c.wait_until_serving(60)
      assert c.health("jaxinfer.v1.Inference") == "SERVING"
      for t in threads:
        t.join(60)
      for name in "abc":
        deltas = results[name]
        assert not isinstance(deltas, Exception), deltas
        assert sum(len(d.token_ids) for d in deltas) == 12
        assert deltas[-1].finish_reason == pb.FINISH_REASON_LENGTH
      assert (server.backend.waiting_requests, server.backend.waiting_tokens) == (0, 0)
  finally:
    gate.set()
    server.stop_in_thread(5)


def test_stream_queue_merges_deltas_when_full(reference):
  from jaxinfer.engine.engine import RequestOutput
  from jaxinfer.serving.backend import EngineBackend, _Admission, _Stream

  backend = EngineBackend(reference, warmup=False)  # never started: only its admission counters are used

  async def run():
    s = _Stream(asyncio.get_running_loop(), 2, _Admission(backend, 3))
    assert (backend.waiting_requests, backend.waiting_tokens) == (1, 3)
    for i in range(5):
      ids = list(range(i + 1))
      s.put(RequestOutput("r", None, [1], text="abcde"[:i + 1], token_ids=ids, logprobs=[0.0] * (i + 1),
                          new_token_ids=[i], new_text="abcde"[i]))
    assert len(s) == 2
    assert (backend.waiting_requests, backend.waiting_tokens) == (0, 0)  # released once, by the first put
    return [await s.get(), await s.get()]

  first, merged = asyncio.run(run())
  assert (first.new_token_ids, first.new_text) == ([0], "a")
  assert (merged.new_token_ids, merged.new_text, merged.token_ids) == ([1, 2, 3, 4], "bcde", [0, 1, 2, 3, 4])


def _raw_call(server, method, data: bytes, stream: bool):
  """Sends `data` as the request bytes of `method`, unencoded by any stub."""
  with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
    path = f"/jaxinfer.v1.Inference/{method}"
    if stream:
      call = channel.unary_stream(path, request_serializer=None,
                                  response_deserializer=pb.GenerateResponse.FromString)
      return list(call(data, timeout=30))
    call = channel.unary_unary(path, request_serializer=None,
                               response_deserializer=pb.TokenizeResponse.FromString)
    return call(data, timeout=30)


def _swap(message, good: bytes, bad: bytes) -> bytes:
  """`message` serialized, with the (same-length) bytes of one string value replaced."""
  data = message.SerializeToString()
  assert data.count(good) == 1 and len(good) == len(bad)
  return data.replace(good, bad)


@pytest.mark.parametrize("data", [
    _swap(pb.GenerateRequest(text="AB"), b"AB", b"\xff\xfe"),  # invalid UTF-8 in the prompt text
    _swap(pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(stop=["QQQ"])),
          b"QQQ", b"\xed\xa0\x80"),  # an encoded surrogate (U+D800) in a stop string
    _swap(pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="ZZZ")])),
          b"ZZZ", b"\xed\xb0\x80"),  # a lone low surrogate in chat content
    b"\x0a\x05ab",  # truncated: a 5-byte string with 2 bytes
], ids=["text-ff-fe", "stop-surrogate", "chat-surrogate", "truncated"])
def test_undecodable_request_bytes_are_invalid_argument(server, client, reference, data):
  """Regression: such requests got UNKNOWN with a traceback in the server's log."""
  with pytest.raises(grpc.RpcError) as e:
    _raw_call(server, "Generate", data, stream=True)
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert "not a valid jaxinfer.v1.Inference.Generate request" in e.value.details()
  with pytest.raises(grpc.RpcError) as e:
    _raw_call(server, "Tokenize", _swap(pb.TokenizeRequest(text="AB"), b"AB", b"\xff\xfe"), stream=False)
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  # the server goes on serving
  want = reference.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))[0].token_ids
  assert client.generate([1, 2, 3], temperature=0, max_tokens=4).token_ids == want
