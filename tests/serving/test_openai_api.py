"""The OpenAI-compatible HTTP API, through the official `openai` client and raw
httpx, against a real server on localhost (gRPC + HTTP on one loop, one
engine), over the tiny llama3 stretched to 4096 positions as in
test_server.py. Token ids are compared exactly through
`return_tokens_as_token_ids` (logprob tokens come back as 'token_id:N')."""

import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest

from helpers import FailingTokenizer
from jaxinfer import LLM, SamplingParams
from jaxinfer.serving import InferenceServer, ServerConfig
from jaxinfer.structured import StructuredOutput

ENGINE = dict(max_num_seqs=32, max_num_batched_tokens=64, warmup=False)
LONG = dict(max_tokens=3000, ignore_eos=True, temperature=0)  # outlives any test's patience
MAX_WAITING = 4


@pytest.fixture(scope="module")
def reference(model_dir):
  return LLM(model_dir, **ENGINE)


@pytest.fixture(scope="module")
def server(model_dir):
  # No warm-up: buckets compile on first use (the persistent cache makes that quick), keeping the file fast.
  llm = LLM(model_dir, **ENGINE)
  s = InferenceServer(llm, ServerConfig(port=0, http_port=0, max_waiting_requests=MAX_WAITING),
                      warmup=False).start_in_thread()
  yield s
  if not s.backend.draining:  # the drain test may have stopped it already
    s.stop_in_thread(5)


@pytest.fixture(scope="module")
def url(server):
  return f"http://127.0.0.1:{server.http_port}"


@pytest.fixture(scope="module")
def client(url):
  # No retries: a 429 or 503 must reach the test, not be retried away.
  return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def ids_of(tokens):
  return [int(t.removeprefix("token_id:")) for t in tokens]


def until(condition, timeout=30.0):
  """Polls `condition` until it holds; the deadline only bounds a failure."""
  end = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < end, "condition not reached"
    time.sleep(0.01)


def pool_is_full(server, timeout=10.0):
  """Waits until no request holds a KV page (aborts are taken between steps)."""
  full = server.llm.engine.kv.num_pages - 1
  end = time.monotonic() + timeout
  while True:
    free, unfinished = server.call_engine(lambda e: (e.kv.num_free_pages, e.num_unfinished))
    if (free, unfinished) == (full, 0) or time.monotonic() > end:
      return free == full and unfinished == 0
    time.sleep(0.02)


def metric(text, name, missing_is_zero=False):
  """A sample's value in /metrics text; `name` may carry labels: 'x_total{code="A"}'."""
  m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
  if m is None and missing_is_zero:  # a labelled counter appears at its first increment
    return 0.0
  assert m, f"{name} missing from /metrics"
  return float(m.group(1))


def metrics(url):
  return httpx.get(f"{url}/metrics").text


REJECTED = 'jaxinfer_rejected_requests_total{code="%s"}'


GREEDY = dict(temperature=0, max_tokens=12, extra_body=dict(ignore_eos=True, return_tokens_as_token_ids=True))


def test_models_and_health(client, url, server):
  models = client.models.list().data
  assert [m.id for m in models] == ["llama3"]  # the model directory's basename
  assert httpx.get(f"{url}/health").status_code == 200
  assert client.models.retrieve("llama3").id == "llama3"
  with pytest.raises(openai.NotFoundError):
    client.models.retrieve("gpt-4")


@pytest.mark.parametrize("prompt", ["Hello world, how are you?", [1, 5, 9, 200, 17]])
def test_completions_greedy_equal_llm_generate(client, reference, prompt):
  ref = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
  r = client.completions.create(model="llama3", prompt=prompt, logprobs=0, **GREEDY)
  choice = r.choices[0]
  assert (choice.text, choice.finish_reason) == (ref.text, "length")
  assert ids_of(choice.logprobs.tokens) == ref.token_ids
  assert choice.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
  assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
      len(ref.prompt_token_ids), 12, len(ref.prompt_token_ids) + 12)
  # Streamed: the deltas add up to the same text and ids; the usage chunk comes last, with no choices.
  chunks = list(client.completions.create(model="llama3", prompt=prompt, logprobs=0, stream=True,
                                          stream_options={"include_usage": True}, **GREEDY))
  assert "".join(c.choices[0].text for c in chunks[:-1]) == ref.text
  assert [t for c in chunks[:-1] for t in ids_of(c.choices[0].logprobs.tokens)] == ref.token_ids
  assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 2) + ["length"]
  assert all(c.usage is None for c in chunks[:-1])
  assert chunks[-1].choices == []
  assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(ref.prompt_token_ids), 12)


def test_chat_greedy_equals_llm_chat(client, reference):
  messages = [{"role": "user", "content": "What is the capital of France?"}]
  ref = reference.chat(messages, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3))
  r = client.chat.completions.create(model="llama3", messages=messages, logprobs=True, top_logprobs=3, **GREEDY)
  choice = r.choices[0]
  assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", ref.text, "length")
  assert ids_of(t.token for t in choice.logprobs.content) == ref.token_ids
  for got, top in zip(choice.logprobs.content, ref.top_logprobs):
    assert {int(t.token[9:]): t.logprob for t in got.top_logprobs} == pytest.approx(top, abs=1e-5)
  assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 12)
  # Text content parts are joined; the stream opens with the role and ends with a usage chunk.
  parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                        {"type": "text", "text": " of France?"}]}]
  chunks = list(client.chat.completions.create(model="llama3", messages=parts, stream=True,
                                               stream_options={"include_usage": True},
                                               max_completion_tokens=12, temperature=0,
                                               extra_body=dict(ignore_eos=True)))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == ref.text
  assert chunks[-2].choices[0].finish_reason == "length"
  assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


def test_sampling_fields_reach_the_engine(client, reference):
  """Seeded sampling with every knob set gives the engine's tokens for the same SamplingParams."""
  sp = SamplingParams(temperature=0.9, top_k=30, top_p=0.95, min_p=0.01, seed=7, max_tokens=10,
                      repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3, ignore_eos=True)
  ref = reference.generate([[1, 2, 3, 4]], sp)[0]
  r = client.completions.create(
      model="llama3", prompt=[1, 2, 3, 4], temperature=0.9, top_p=0.95, seed=7, max_tokens=10,
      presence_penalty=0.5, frequency_penalty=0.3, logprobs=0,
      extra_body=dict(top_k=30, min_p=0.01, repetition_penalty=1.1, ignore_eos=True,
                      return_tokens_as_token_ids=True))
  assert ids_of(r.choices[0].logprobs.tokens) == ref.token_ids
  # A stop string (str or list) is cut from the text; finish_reason says stop.
  text = reference.generate(["Hello"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].text
  stop = text[5:8]
  ref = reference.generate(["Hello"], SamplingParams(temperature=0, max_tokens=30, stop=(stop,)))[0]
  for s in (stop, [stop, "never appears"]):
    r = client.completions.create(model="llama3", prompt="Hello", temperature=0, max_tokens=30, stop=s)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (ref.text, "stop")


def test_structured_output_fields_map_to_structured_output():
  from jaxinfer.serving.openai_api import ApiError, ChatCompletionRequest, _structured

  def structured(**kw):
    return _structured(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **kw))[0]

  schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
  assert structured() is None
  assert structured(response_format={"type": "text"}) is None
  assert structured(response_format={"type": "json_object"}) == StructuredOutput(json_object=True)
  assert structured(response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}) == (
      StructuredOutput(json_schema=schema))
  assert structured(guided_regex=r"\d+") == StructuredOutput(regex=r"\d+")
  assert structured(guided_choice=["yes", "no"]) == StructuredOutput(choice=("yes", "no"))
  with pytest.raises(ApiError) as e:
    structured(response_format={"type": "json_object"}, guided_regex="a")
  assert e.value.param == "guided_regex"
  with pytest.raises(ApiError) as e:
    structured(response_format={"type": "json_schema"})
  assert (e.value.status, e.value.param) == (400, "response_format.json_schema")


def test_structured_output_over_http(client):
  """The constraint reaches the engine: sampled at temperature 1 from random weights, the
  outputs still match (a regex, a choice, a JSON schema)."""
  kw = dict(model="llama3", temperature=1.0, max_tokens=60)
  for seed in range(3):
    r = client.completions.create(prompt="go", seed=seed, extra_body=dict(guided_regex=r"\d{3}-\d{4}"), **kw)
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(messages=[{"role": "user", "content": "?"}], seed=seed,
                                       extra_body=dict(guided_choice=["yes", "no", "maybe so"]), **kw)
    assert r.choices[0].message.content in ("yes", "no", "maybe so")
  schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}
  r = client.chat.completions.create(
      messages=[{"role": "user", "content": "?"}], seed=0,
      response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}, **kw)
  assert r.choices[0].finish_reason == "stop"
  assert set(json.loads(r.choices[0].message.content)) == {"ok"}
  with pytest.raises(openai.BadRequestError) as e:  # a schema the grammar compiler rejects
    client.chat.completions.create(
        messages=[{"role": "user", "content": "?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},
        **kw)
  assert e.value.param == "response_format" and "frobnicate" in e.value.message
  with pytest.raises(openai.BadRequestError) as e:  # a valid regex that no output can match
    client.completions.create(prompt="go", extra_body=dict(guided_regex="[a&&b]"), **kw)
  assert e.value.param == "guided_regex" and "no output can satisfy it" in e.value.message


BAD = [  # path, raw body, status, param, a fragment of the message
    ("completions", '{"prompt": "x", ', 400, None, "malformed JSON body"),
    ("completions", "[1, 2]", 400, None, "request body"),
    ("completions", '{"max_tokens": 4}', 400, "prompt", "prompt: Field required"),
    ("completions", '{"prompt": 17}', 400, "prompt", "prompt: Input should be"),
    ("completions", '{"prompt": "x", "temperature": "hot"}', 400, "temperature", "valid number"),
    ("completions", '{"prompt": "x", "max_tokens": -1}', 400, "max_tokens", "max_tokens must be an int >= 1"),
    ("completions", '{"prompt": "x", "max_tokens": 5000}', 400, "max_tokens", "exceeds max_model_len=4096"),
    ("completions", '{"prompt": "x", "top_p": 0}', 400, "top_p", "top_p must be in (0, 1]"),
    ("completions", '{"prompt": "x", "n": 2}', 400, "n", "only n=1"),
    ("completions", '{"prompt": "", "max_tokens": 2}', 400, "prompt", "prompt is empty"),
    ("completions", '{"prompt": [1, 99999], "max_tokens": 2}', 400, "prompt", "out of range"),
    ("completions", '{"prompt": "x", "logprobs": 30}', 400, "logprobs", "logprobs must be in [0, 20]"),
    ("completions", '{"model": "gpt-4", "prompt": "x"}', 404, "model", "does not exist"),
    ("chat/completions", '{"messages": []}', 400, "messages", "must not be empty"),
    ("chat/completions", '{"messages": [{"content": "hi"}]}', 400, "messages[0].role", "Field required"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}',
     400, "max_completion_tokens", "max_tokens must be an int >= 1"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}',
     400, "top_logprobs", "needs logprobs"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "seed": -1}', 400, "seed", "seed"),
]


def test_bad_requests_are_openai_errors_naming_the_field(url, client, reference):
  for path, body, status, param, message in BAD:
    r = httpx.post(f"{url}/v1/{path}", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, (body, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], message in error["message"]) == (param, True), (body, error)
    assert error["type"] == "invalid_request_error"
  assert r.json()["error"]["message"].startswith("seed must be an int")
  assert httpx.get(f"{url}/v1/nothing").json()["error"]["code"] == "not_found"
  # The client raises the matching exceptions; the server serves on.
  with pytest.raises(openai.NotFoundError) as e:
    client.completions.create(model="other", prompt="x", max_tokens=2)
  assert e.value.code == "model_not_found"
  with pytest.raises(openai.BadRequestError) as e:
    client.chat.completions.create(model="llama3", messages=[{"role": "user", "content": "x"}], n=3)
  assert e.value.param == "n"
  ref = reference.generate([[3, 4]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
  r = client.completions.create(model="llama3", prompt=[3, 4], max_tokens=5, temperature=0,
                                extra_body=dict(ignore_eos=True))
  assert r.choices[0].text == ref.text


def test_a_failure_inside_one_request_is_500_for_it_only(client, server, reference):
  """The poisoned requests' detokenizers raise (helpers.FailingTokenizer, armed only once
  the healthy stream's first chunk came): a 500, or an error event once streaming."""
  engine = server.llm.engine
  tok = FailingTokenizer(engine.tokenizer)
  want = reference.generate([[11, 12]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
  engine.outputs.tokenizer = tok  # detokenizers come from it
  try:
    healthy = iter(client.completions.create(model="llama3", prompt=[11, 12], stream=True, max_tokens=20,
                                             temperature=0, extra_body=dict(ignore_eos=True)))
    text = next(healthy).choices[0].text  # its detokenizer is made: arming reaches only the next ones
    tok.armed = True
    with pytest.raises(openai.InternalServerError) as e:
      client.completions.create(model="llama3", prompt=[13, 14], max_tokens=5)
    assert "failed in the engine: RuntimeError: boom" in e.value.message
    with pytest.raises(openai.APIError) as e:  # streamed: headers were sent, so an error event
      list(client.completions.create(model="llama3", prompt=[13, 15], max_tokens=5, stream=True))
    assert "failed in the engine: RuntimeError: boom" in e.value.message
    tok.armed = False
    text += "".join(c.choices[0].text for c in healthy)
  finally:
    engine.outputs.tokenizer = tok.tokenizer
  assert text == want.text
  assert pool_is_full(server)


def test_disconnect_mid_stream_frees_pages(url, server):
  body = dict(prompt=[1, 2, 3], stream=True, **LONG)
  with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
    assert r.status_code == 200
    lines = r.iter_lines()
    got = [next(lines) for _ in range(6)]  # 3 events, each a data line and a blank line
  assert all(line.startswith("data: {") for line in got[::2])
  assert pool_is_full(server)
  # A non-streamed request whose client goes away is aborted too: sent on a raw socket while
  # the engine is held, the socket closed once the server queued it.
  aborted = 'jaxinfer_finished_requests_total{finish_reason="abort"}'
  before = metric(metrics(url), aborted, missing_is_zero=True)
  gate = threading.Event()
  held = server.engine_loop.call(lambda e: gate.wait(60))
  try:
    body = json.dumps(dict(messages=[{"role": "user", "content": "hi"}], **LONG)).encode()
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
      sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % len(body) + body)
      until(lambda: server.backend.waiting_requests == 1)
  finally:
    gate.set()
  held.result(60)
  assert pool_is_full(server)
  assert metric(metrics(url), aborted) - before == 1  # aborted, not run to its 3000 tokens


def test_admission_limit_is_429_then_the_waiting_requests_finish(url, client, server):
  busy = REJECTED % "RESOURCE_EXHAUSTED"
  before = metric(metrics(url), busy, missing_is_zero=True)
  gate = threading.Event()
  held = server.engine_loop.call(lambda e: gate.wait(60))  # the engine thread stops taking steps
  results = []

  def run(i):
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json=dict(prompt=[5, i], max_tokens=6, temperature=0, ignore_eos=True))
    results.append(r)

  threads = [threading.Thread(target=run, args=(i,)) for i in range(MAX_WAITING)]
  try:
    for t in threads:
      t.start()
    end = time.monotonic() + 30
    while server.backend.waiting_requests < MAX_WAITING and time.monotonic() < end:
      time.sleep(0.01)
    with pytest.raises(openai.RateLimitError) as e:
      client.completions.create(model="llama3", prompt=[6], max_tokens=2)
    assert f"{MAX_WAITING} requests are waiting (max_waiting_requests={MAX_WAITING})" in e.value.message
  finally:
    gate.set()
  held.result(60)
  for t in threads:
    t.join(60)
  assert [r.status_code for r in results] == [200] * MAX_WAITING
  assert all(r.json()["usage"]["completion_tokens"] == 6 for r in results)
  assert server.backend.waiting_requests == 0
  assert metric(metrics(url), busy) - before == 1


def test_metrics_endpoint(url, client):
  """Counts this test's own requests (other tests of the module may run before or after it)."""
  before = metrics(url)
  client.completions.create(model="llama3", prompt=[1, 2, 3, 4, 5], max_tokens=7, temperature=0,
                            extra_body=dict(ignore_eos=True))
  with pytest.raises(openai.BadRequestError):
    client.completions.create(model="llama3", prompt=[1], max_tokens=2, temperature=-1.0)
  after = metrics(url)
  assert metric(after, "jaxinfer_generation_tokens_total") - metric(before, "jaxinfer_generation_tokens_total") == 7
  assert metric(after, "jaxinfer_prompt_tokens_total") - metric(before, "jaxinfer_prompt_tokens_total") == 5
  bad = REJECTED % "INVALID_ARGUMENT"
  assert metric(after, bad) - metric(before, bad, missing_is_zero=True) == 1


def test_warming_up_is_503(reference):
  """Before warm-up ends (here: an engine thread never started) health and requests say 503."""
  from starlette.testclient import TestClient

  from jaxinfer.serving.backend import EngineBackend
  from jaxinfer.serving.openai_api import create_app

  with TestClient(create_app(EngineBackend(reference, warmup=False))) as c:
    r = c.get("/health")
    assert (r.status_code, r.json()) == (503, {"status": "warming up"})
    r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"


def test_draining_is_503_and_cuts_streams_past_the_grace_period(url, client, server, reference):
  """Last: it shuts the module's server down. What each drain finds in flight is set by
  holding the engine (engine_loop.call), not by timing: a drain whose grace outlasts the held
  request lets it finish once let go; then, on a second server over the same LLM, a drain
  with no grace cuts the held stream."""
  want = reference.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
  gate = threading.Event()
  held = server.engine_loop.call(lambda e: gate.wait(60))
  got, summary = [], []
  request = threading.Thread(target=lambda: got.append(httpx.post(
      f"{url}/v1/completions", timeout=60, json=dict(prompt=[7, 8, 9], max_tokens=8, temperature=0, ignore_eos=True))))
  request.start()
  until(lambda: server.backend.waiting_requests == 1)  # queued behind the held engine
  stopper = threading.Thread(target=lambda: summary.append(server.stop_in_thread(60)))
  stopper.start()
  try:
    until(lambda: server.draining)
    r = httpx.get(f"{url}/health")
    assert (r.status_code, r.json()) == (503, {"status": "draining"})
    with pytest.raises(openai.APIStatusError) as e:
      client.completions.create(model="llama3", prompt=[1], max_tokens=2)
    assert e.value.status_code == 503 and "shutting down" in e.value.message
  finally:
    gate.set()
  held.result(60)
  request.join(60)
  stopper.join(60)
  assert got[0].status_code == 200 and got[0].json()["choices"][0]["text"] == want.text
  assert summary == [{"in_flight": 1, "finished": 1, "aborted": 0}]
  # No grace: the stream the held engine cannot move on ends with an error event.
  second = InferenceServer(server.llm, ServerConfig(port=0, http_port=0), warmup=False).start_in_thread()
  client = openai.OpenAI(base_url=f"http://127.0.0.1:{second.http_port}/v1", api_key="unused", max_retries=0,
                         timeout=120)
  stream = iter(client.completions.create(model="llama3", prompt=[7, 8, 9], stream=True, temperature=0,
                                          max_tokens=3000, extra_body=dict(ignore_eos=True)))
  assert next(stream).choices[0].text is not None
  gate = threading.Event()
  held = second.engine_loop.call(lambda e: gate.wait(60))
  summary = []
  stopper = threading.Thread(target=lambda: summary.append(second.stop_in_thread(0)))
  stopper.start()
  try:
    with pytest.raises(openai.APIError) as e:  # the SSE error event once the grace period is over
      for _ in stream:
        pass
  finally:
    gate.set()
  assert "shut down before it finished (grace period 0 s)" in e.value.message
  held.result(60)
  stopper.join(60)
  assert summary == [{"in_flight": 1, "finished": 0, "aborted": 1}]
