"""`Client`: the Python side of `jaxinfer.v1.Inference`, blocking or asyncio.

    with Client("127.0.0.1:50051") as c:
      r = c.generate("What is the capital of France?", max_tokens=32, temperature=0)
      print(r.text, r.finish_reason, r.usage.time_to_first_token_s)
      for delta in c.stream([{"role": "user", "content": "Hi"}], max_tokens=64):
        print(delta.text, end="")

    async with Client("127.0.0.1:50051") as c:       # the a* methods
      r = await c.agenerate([1, 2, 3], max_tokens=8)
      async for delta in c.astream("Once upon a time"):
        ...

A prompt is text, token ids, or chat messages ([{'role', 'content'}]).
Sampling options are keyword arguments (the fields of SamplingOptions, as in
`jaxinfer.SamplingParams`) or `params=SamplingParams(...)`. Server errors
come out as `grpc.RpcError` (`.code()`, `.details()`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxinfer.sampling import SamplingParams
from jaxinfer.serving.convert import FINISH_REASON_NAMES, prompt_to_proto, sampling_to_proto
from jaxinfer.serving.proto import inference_pb2 as pb
from jaxinfer.serving.proto import inference_pb2_grpc as pb_grpc

Prompt = str | Sequence[int] | Sequence[dict]


@dataclasses.dataclass
class GenerateResult:
  """A finished request, from one response or a whole stream of them."""

  request_id: str
  text: str
  token_ids: list[int]
  finish_reason: str  # 'stop', 'length' or 'abort'
  usage: pb.Usage
  logprobs: list[pb.TokenLogprob]  # with logprobs=n
  prompt_logprobs: list[pb.TokenLogprob] = dataclasses.field(default_factory=list)  # with prompt_logprobs=n

  @classmethod
  def join(cls, responses: Sequence[pb.GenerateResponse]) -> "GenerateResult":
    last = responses[-1]
    return cls(request_id=last.request_id, text="".join(r.text for r in responses),
               token_ids=[t for r in responses for t in r.token_ids],
               finish_reason=FINISH_REASON_NAMES.get(last.finish_reason, ""),
               usage=last.usage, logprobs=[lp for r in responses for lp in r.logprobs],
               prompt_logprobs=[lp for r in responses for lp in r.prompt_logprobs])


def build_request(prompt: Prompt, *, stream: bool, request_id: str = "",
                  params: SamplingParams | None = None, **sampling: Any) -> pb.GenerateRequest:
  request = pb.GenerateRequest(request_id=request_id, stream=stream,
                               sampling=sampling_to_proto(params, **sampling))
  prompt_to_proto(prompt, request)
  return request


def _tokenize_request(prompt: str | Sequence[dict], add_special_tokens: bool) -> pb.TokenizeRequest:
  request = pb.TokenizeRequest()
  prompt_to_proto(prompt, request)
  if request.WhichOneof("input") == "text":
    request.add_special_tokens = add_special_tokens
  return request


class Client:
  """One channel for blocking calls, one (created on first use, on the running loop) for asyncio."""

  def __init__(self, target: str = "127.0.0.1:50051", *, timeout: float | None = None):
    self.target = target
    self.timeout = timeout  # default per-call deadline, seconds
    self._channel = grpc.insecure_channel(target)
    self._stub = pb_grpc.InferenceStub(self._channel)
    self._achannel: grpc.aio.Channel | None = None
    self._astub: pb_grpc.InferenceStub | None = None

  # ---- blocking ----------------------------------------------------------------------

  def stream(self, prompt: Prompt, *, request_id: str = "", timeout: float | None = None,
             params: SamplingParams | None = None, **sampling: Any) -> Iterator[pb.GenerateResponse]:
    """Yields a response per engine step; closing the iterator early cancels the request."""
    request = build_request(prompt, stream=True, request_id=request_id, params=params, **sampling)
    call = self._stub.Generate(request, timeout=timeout or self.timeout)
    try:
      yield from call
    finally:
      call.cancel()  # a no-op once finished; frees the server's pages when we stop early

  def generate(self, prompt: Prompt, *, request_id: str = "", timeout: float | None = None,
               params: SamplingParams | None = None, **sampling: Any) -> GenerateResult:
    request = build_request(prompt, stream=False, request_id=request_id, params=params, **sampling)
    return GenerateResult.join(list(self._stub.Generate(request, timeout=timeout or self.timeout)))

  def tokenize(self, prompt: str | Sequence[dict], *, add_special_tokens: bool = True) -> list[int]:
    return list(self._stub.Tokenize(_tokenize_request(prompt, add_special_tokens),
                                    timeout=self.timeout).token_ids)

  def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
    return self._stub.Detokenize(pb.DetokenizeRequest(token_ids=token_ids,
                                                      skip_special_tokens=skip_special_tokens),
                                 timeout=self.timeout).text

  def model_info(self) -> pb.ModelInfo:
    return self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout)

  def health(self, service: str = "") -> str:
    """'SERVING', 'NOT_SERVING', ... of the standard grpc.health.v1 service."""
    r = health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                        timeout=self.timeout or 10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

  def wait_until_serving(self, timeout: float = 600.0) -> None:
    """Blocks until the server answers SERVING (it is NOT_SERVING during warm-up)."""
    import time
    end = time.monotonic() + timeout
    while True:
      try:
        if self.health() == "SERVING":
          return
      except grpc.RpcError:
        pass  # not listening yet
      if time.monotonic() > end:
        raise TimeoutError(f"{self.target} did not become SERVING within {timeout} s")
      time.sleep(0.1)

  def close(self) -> None:
    self._channel.close()

  def __enter__(self) -> "Client":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ---- asyncio -----------------------------------------------------------------------

  def _async_stub(self) -> pb_grpc.InferenceStub:
    if self._astub is None:
      self._achannel = grpc.aio.insecure_channel(self.target)
      self._astub = pb_grpc.InferenceStub(self._achannel)
    return self._astub

  async def astream(self, prompt: Prompt, *, request_id: str = "", timeout: float | None = None,
                    params: SamplingParams | None = None, **sampling: Any) -> AsyncIterator[pb.GenerateResponse]:
    request = build_request(prompt, stream=True, request_id=request_id, params=params, **sampling)
    call = self._async_stub().Generate(request, timeout=timeout or self.timeout)
    try:
      async for response in call:
        yield response
    finally:
      call.cancel()

  async def agenerate(self, prompt: Prompt, *, request_id: str = "", timeout: float | None = None,
                      params: SamplingParams | None = None, **sampling: Any) -> GenerateResult:
    request = build_request(prompt, stream=False, request_id=request_id, params=params, **sampling)
    call = self._async_stub().Generate(request, timeout=timeout or self.timeout)
    return GenerateResult.join([r async for r in call])

  async def atokenize(self, prompt: str | Sequence[dict], *, add_special_tokens: bool = True) -> list[int]:
    r = await self._async_stub().Tokenize(_tokenize_request(prompt, add_special_tokens), timeout=self.timeout)
    return list(r.token_ids)

  async def adetokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
    r = await self._async_stub().Detokenize(
        pb.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens), timeout=self.timeout)
    return r.text

  async def amodel_info(self) -> pb.ModelInfo:
    return await self._async_stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout)

  async def aclose(self) -> None:
    if self._achannel is not None:
      await self._achannel.close()
    self._channel.close()

  async def __aenter__(self) -> "Client":
    return self

  async def __aexit__(self, *exc) -> None:
    await self.aclose()
