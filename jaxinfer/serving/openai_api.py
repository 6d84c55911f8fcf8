"""The OpenAI-compatible HTTP API (FastAPI) over a `Backend`: the same engine as gRPC.

    POST /v1/completions          prompt: text or token ids
    POST /v1/chat/completions     messages (text content)
    GET  /v1/models               the one served model
    GET  /health                  200 when serving, 503 while warming up or draining
    GET  /metrics                 Prometheus text (the server's registry)

Both POSTs stream as server-sent events (`data: {chunk}` ... `data: [DONE]`)
with `stream: true`, and take OpenAI's sampling fields plus vLLM's extras
(top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids,
guided_regex / guided_choice / guided_json, return_tokens_as_token_ids).
Unknown fields are ignored, as OpenAI does.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`;
`_api_error` is the one place engine errors become HTTP statuses: 400 bad
input (param names the field), 404 another model, 429 admission limits, 503
warming up or draining, 500 this request failed in the engine. An error
after a stream started (headers sent) is one `data: {"error": ...}` event.
A client that goes away aborts its request in the engine (pages freed).

The app depends on the `Backend` contract only (a local engine or the
KV-aware router); it never imports `LLM`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
import uuid
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxinfer.engine.engine import RequestOutput
from jaxinfer.errors import InvalidRequestError, JaxinferError, TokenizerError
from jaxinfer.sampling import MAX_LOGPROBS, SamplingParams
from jaxinfer.serving.backend import Backend, Generation, Overloaded, RequestFailed, Unavailable, Usage
from jaxinfer.structured import StructuredOutput

# ---- request bodies -------------------------------------------------------------------


class _Body(BaseModel):
  model_config = ConfigDict(extra="allow")  # clients send fields we do not use (user, metadata, ...)


class StreamOptions(_Body):
  include_usage: bool = False


class JsonSchema(_Body):
  name: str | None = None
  schema_: dict[str, Any] | None = Field(default=None, alias="schema")
  strict: bool | None = None


class ResponseFormat(_Body):
  type: Literal["text", "json_object", "json_schema"]
  json_schema: JsonSchema | None = None


class _Sampling(_Body):
  # Every optional field takes null too: clients (not the official one) send `"n": null`, `"stream": null`.
  model: str | None = None
  max_tokens: int | None = None
  temperature: float | None = None
  top_p: float | None = None
  n: int | None = None
  stream: bool | None = False
  stream_options: StreamOptions | None = None
  stop: str | list[str] | None = None
  seed: int | None = None
  frequency_penalty: float | None = None
  presence_penalty: float | None = None
  response_format: ResponseFormat | None = None
  # vLLM's extras
  top_k: int | None = None
  min_p: float | None = None
  repetition_penalty: float | None = None
  ignore_eos: bool | None = False
  stop_token_ids: list[int] | None = None
  guided_regex: str | None = None
  guided_choice: list[str] | None = None
  guided_json: dict[str, Any] | str | None = None
  return_tokens_as_token_ids: bool | None = False  # logprob tokens as "token_id:N" (exact ids)


class CompletionRequest(_Sampling):
  prompt: str | list[int] | list[str] | list[list[int]]
  logprobs: int | None = None
  echo: bool | None = False
  suffix: str | None = None
  best_of: int | None = None


class ContentPart(_Body):
  type: str
  text: str | None = None


class ChatMessage(_Body):
  role: str
  content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_Sampling):
  messages: list[ChatMessage]
  logprobs: bool | None = False
  top_logprobs: int | None = None
  max_completion_tokens: int | None = None


# ---- errors -----------------------------------------------------------------------------


class ApiError(Exception):
  def __init__(self, status: int, message: str, type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

  def response(self) -> JSONResponse:
    return JSONResponse(self.body(), status_code=self.status)


def _api_error(e: BaseException, param: str | None = None) -> ApiError:
  """The one place errors become HTTP statuses."""
  if isinstance(e, ApiError):
    return e
  if isinstance(e, (InvalidRequestError, TokenizerError)):
    return ApiError(400, str(e), param=param)
  if isinstance(e, Overloaded):
    return ApiError(429, str(e), "rate_limit_error", code="rate_limit_exceeded")
  if isinstance(e, Unavailable):
    return ApiError(503, str(e), "server_error", code="service_unavailable")
  if isinstance(e, RequestFailed):
    return ApiError(500, str(e), "server_error", code="internal_error")
  return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error", code="internal_error")


# jaxinfer_rejected_requests counts refusals under gRPC's status names, whichever transport refused.
_REJECTION_CODES = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}

_TYPE_TAG = re.compile(r"^(str|int|float|bool|dict|list|none)$|\[|^[A-Z]")  # pydantic's union-member loc entries


def _validation_error(e: RequestValidationError) -> ApiError:
  err = e.errors()[0]
  if err["type"] == "json_invalid":
    where = err["loc"][1] if len(err["loc"]) > 1 else "?"
    detail = (err.get("ctx") or {}).get("error", err["msg"])
    return ApiError(400, f"malformed JSON body: {detail} (at character {where})")
  param = ""
  for part in err["loc"][1:]:  # loc[0] is 'body'
    if isinstance(part, int):
      param += f"[{part}]"
    elif not _TYPE_TAG.search(part):
      param += f".{part}" if param else part
  if not param:
    return ApiError(400, f"request body: {err['msg']}")
  return ApiError(400, f"{param}: {err['msg']}", param=param)


# The engine's names for sampling fields -> the request's (a SamplingParams error starts with its field).
_ENGINE_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "stop_token_ids", "stop", "max_tokens", "logprobs", "structured")


def _param_of(message: str, names: dict[str, str], default: str | None) -> str | None:
  if "max_model_len" in message:  # prompt + max_tokens too long: shorten max_tokens
    return names["max_tokens"]
  word = re.match(r"[a-z_]+", message)
  if word and word.group(0) in names:
    return names[word.group(0)]
  return default


# ---- request -> (prompt, SamplingParams) ------------------------------------------------------


def _structured(body: _Sampling) -> tuple[StructuredOutput | None, str | None]:
  """The StructuredOutput a request asks for and the field that asked, or (None, None)."""
  asked: list[tuple[str, dict]] = []
  rf = body.response_format
  if rf is not None and rf.type == "json_object":
    asked.append(("response_format", dict(json_object=True)))
  elif rf is not None and rf.type == "json_schema":
    if rf.json_schema is None or rf.json_schema.schema_ is None:
      raise ApiError(400, "response_format.json_schema.schema is required with type json_schema",
                     param="response_format.json_schema")
    asked.append(("response_format", dict(json_schema=rf.json_schema.schema_)))
  if body.guided_json is not None:
    asked.append(("guided_json", dict(json_schema=body.guided_json)))
  if body.guided_regex is not None:
    asked.append(("guided_regex", dict(regex=body.guided_regex)))
  if body.guided_choice is not None:
    asked.append(("guided_choice", dict(choice=body.guided_choice)))
  if not asked:
    return None, None
  if len(asked) > 1:
    raise ApiError(400, f"ask for one structured output, got {', '.join(a for a, _ in asked)}",
                   param=asked[1][0])
  field, kw = asked[0]
  try:
    return StructuredOutput(**kw), field
  except InvalidRequestError as e:
    raise ApiError(400, f"{field}: {e}", param=field) from None


def _sampling(body: _Sampling, max_tokens: int, max_tokens_field: str, logprobs: int | None,
              logprobs_field: str) -> SamplingParams:
  structured, structured_field = _structured(body)
  kw: dict[str, Any] = dict(max_tokens=max_tokens, logprobs=logprobs, ignore_eos=bool(body.ignore_eos),
                            structured=structured)
  for name in ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
               "frequency_penalty"):
    if getattr(body, name) is not None:
      kw[name] = getattr(body, name)
  if body.stop is not None:
    kw["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
  if body.stop_token_ids is not None:
    kw["stop_token_ids"] = tuple(body.stop_token_ids)
  try:
    return SamplingParams(**kw)
  except InvalidRequestError as e:
    names = {n: n for n in _ENGINE_FIELDS}
    names.update(max_tokens=max_tokens_field, logprobs=logprobs_field,
                 structured=structured_field or "response_format")
    raise ApiError(400, str(e), param=_param_of(str(e), names, None)) from None


def _chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
  if not body.messages:
    raise ApiError(400, "messages must not be empty", param="messages")
  out = []
  for i, m in enumerate(body.messages):
    if isinstance(m.content, list):
      texts = []
      for j, part in enumerate(m.content):
        if part.type != "text" or part.text is None:
          raise ApiError(400, f"messages[{i}].content[{j}]: only text parts are supported, got {part.type!r}",
                         param=f"messages[{i}].content[{j}].type")
        texts.append(part.text)
      content = "".join(texts)
    else:
      content = m.content or ""
    out.append({"role": m.role, "content": content})
  return out


# ---- responses ----------------------------------------------------------------------------------


def _usage(u: Usage) -> dict:
  return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
          "total_tokens": u.prompt_tokens + u.completion_tokens,
          "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _sse(obj: dict | str) -> str:
  return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class _Api:
  """The handlers' shared state: the backend, the model's name, token strings."""

  def __init__(self, backend: Backend, served_model_name: str | None):
    self.b = backend
    self.model = served_model_name or os.path.basename(str(backend.model_info.model).rstrip("/\\")) or "model"
    self.created = int(time.time())

  def check_model(self, body: _Sampling) -> None:
    if body.model is not None and body.model != self.model:
      raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {self.model!r}",
                     param="model", code="model_not_found")

  def check_serving(self) -> None:
    if self.b.draining:
      raise Unavailable("the server is shutting down")
    if not self.b.ready:
      raise Unavailable("the server is warming up; retry shortly (GET /health says 200 when ready)")

  def tokens(self, ids: list[int], as_ids: bool) -> list[str]:
    return [f"token_id:{t}" for t in ids] if as_ids else self.b.token_texts(ids)

  async def submit(self, body: _Sampling, prompt, prompt_field: str, build_params) -> Generation:
    """Validates, admits and posts one request; raises ApiError."""
    self.check_model(body)
    if body.n not in (None, 1):
      raise ApiError(400, f"n: only n=1 is supported, got {body.n}", param="n")
    try:
      self.check_serving()
      text, ids = self.b.encode(prompt)
    except JaxinferError as e:
      raise _api_error(e, prompt_field) from None
    params = build_params(len(ids))
    try:
      if params.structured is None:
        request = self.b.validate(ids, params, text)
      else:  # compiling a grammar can take ~100 ms: not on the loop that streams everyone's tokens
        request = await asyncio.get_running_loop().run_in_executor(None, self.b.validate, ids, params, text)
      gen = self.b.generate(request, params, prompt=text, request_id=f"http-{uuid.uuid4().hex[:16]}")
    except JaxinferError as e:
      names = {"max_tokens": "max_completion_tokens" if getattr(body, "max_completion_tokens", None)
               is not None else "max_tokens",
               "structured": _structured(body)[1]}  # the engine compiles the grammar: a bad schema fails here
      raise _api_error(e, _param_of(str(e), names, prompt_field)) from None
    return gen

  def default_max_tokens(self, num_prompt_tokens: int) -> int:
    return max(1, self.b.model_info.max_model_len - num_prompt_tokens)  # as vLLM: the rest of the context

  # ---- logprobs in OpenAI's two shapes ----

  def completion_logprobs(self, out: RequestOutput, first: int, as_ids: bool, offset: int) -> dict:
    ids = out.token_ids[first:]
    tokens = self.tokens(ids, as_ids)
    offsets, at = [], offset
    for t in tokens:
      offsets.append(at)
      at += len(t)
    tops = []
    for j in range(first, len(out.token_ids)):
      top = sorted(out.top_logprobs[j].items(), key=lambda kv: -kv[1])
      tops.append(dict(zip(self.tokens([t for t, _ in top], as_ids), (lp for _, lp in top))))
    return {"tokens": tokens, "token_logprobs": out.logprobs[first:], "top_logprobs": tops,
            "text_offset": offsets}

  def chat_logprobs(self, out: RequestOutput, first: int, as_ids: bool) -> dict:
    content = []
    for j in range(first, len(out.token_ids)):
      top = sorted(out.top_logprobs[j].items(), key=lambda kv: -kv[1])
      (token,), names = self.tokens([out.token_ids[j]], as_ids), self.tokens([t for t, _ in top], as_ids)
      content.append({"token": token, "logprob": out.logprobs[j], "bytes": list(token.encode()),
                      "top_logprobs": [{"token": n, "logprob": lp, "bytes": list(n.encode())}
                                       for n, (_, lp) in zip(names, top)]})
    return {"content": content}


async def _last_output(gen: Generation) -> RequestOutput:
  last = None
  async for out in gen:
    last = out
  return last


async def _until_disconnected(request: Request) -> None:
  while True:  # the body was read already: what comes next is the disconnect
    if (await request.receive())["type"] == "http.disconnect":
      return


class _ClientGone(Exception):
  pass


async def _unless_disconnected(request: Request, coro):
  """Awaits coro, cancelling it if the client disconnects first (a non-streamed
  request's work is wasted once nobody waits for it)."""
  task = asyncio.ensure_future(coro)
  watch = asyncio.ensure_future(_until_disconnected(request))
  try:
    done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
  finally:
    watch.cancel()
    if not task.done():
      task.cancel()
  if task in done:
    return task.result()
  with contextlib.suppress(BaseException):  # its Generation is closed by the caller's `async with`
    await task
  raise _ClientGone()


class _GenerationResponse(StreamingResponse):
  """Closes its Generation however the response ends: Starlette may cancel the
  body iterator before it ever ran (a client gone before the first byte)."""

  def __init__(self, content: AsyncIterator[str], gen: Generation):
    super().__init__(content, media_type="text/event-stream",
                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    self._gen = gen

  async def __call__(self, scope, receive, send) -> None:
    try:
      await super().__call__(scope, receive, send)
    finally:
      self._gen.close()


def create_app(backend: Backend, served_model_name: str | None = None) -> FastAPI:
  api = _Api(backend, served_model_name)
  app = FastAPI(title="jaxinfer (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None)
  app.state.api = api

  @app.exception_handler(ApiError)
  async def on_api_error(request: Request, e: ApiError):
    if e.status in _REJECTION_CODES:  # refused before reaching the engine
      backend.metrics.rejected_requests.labels(_REJECTION_CODES[e.status]).inc()
    return e.response()

  @app.exception_handler(RequestValidationError)
  async def on_validation_error(request: Request, e: RequestValidationError):
    return await on_api_error(request, _validation_error(e))

  @app.exception_handler(JaxinferError)
  async def on_engine_error(request: Request, e: JaxinferError):  # after the request was admitted
    return _api_error(e).response()

  @app.exception_handler(StarletteHTTPException)
  async def on_http_error(request: Request, e: StarletteHTTPException):
    code = "not_found" if e.status_code == 404 else None
    return ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code).response()

  @app.exception_handler(Exception)
  async def on_error(request: Request, e: Exception):
    return _api_error(e).response()

  @app.get("/health")
  async def health():
    if backend.ready:
      return Response(status_code=200)
    return JSONResponse({"status": backend.state}, status_code=503)

  @app.get("/metrics")
  async def metrics():
    return Response(backend.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

  def model_card() -> dict:
    info = backend.model_info
    return {"id": api.model, "object": "model", "created": api.created, "owned_by": "jaxinfer",
            "root": info.model, "max_model_len": info.max_model_len}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [model_card()]}

  @app.get("/v1/models/{model:path}")
  async def model(model: str):
    if model != api.model:
      raise ApiError(404, f"the model {model!r} does not exist; this server serves {api.model!r}",
                     param="model", code="model_not_found")
    return model_card()

  @app.post("/v1/completions")
  async def completions(body: CompletionRequest, request: Request):
    for name, bad in (("echo", body.echo), ("suffix", body.suffix is not None),
                      ("best_of", body.best_of not in (None, 1))):
      if bad:
        raise ApiError(400, f"{name} is not supported", param=name)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
      if len(prompt) != 1:
        raise ApiError(400, f"prompt: one prompt per request, got {len(prompt)}", param="prompt")
      prompt = prompt[0]
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
      raise ApiError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {body.logprobs}", param="logprobs")
    mt = body.max_tokens

    def params(n_prompt: int) -> SamplingParams:
      return _sampling(body, api.default_max_tokens(n_prompt) if mt is None else mt, "max_tokens",
                       body.logprobs, "logprobs")

    gen = await api.submit(body, prompt, "prompt", params)
    rid, created, as_ids = f"cmpl-{gen.request_id[5:]}", int(time.time()), bool(body.return_tokens_as_token_ids)
    head = {"id": rid, "object": "text_completion", "created": created, "model": api.model}
    if body.stream:
      usage = body.stream_options is not None and body.stream_options.include_usage

      async def events() -> AsyncIterator[str]:
        async with gen:
          sent = 0  # characters of text sent: logprobs' text_offset
          try:
            async for out in gen:
              if not (out.new_token_ids or out.new_text or out.finished):
                continue
              first = len(out.token_ids) - len(out.new_token_ids)
              lp = (api.completion_logprobs(out, first, as_ids, sent)
                    if out.top_logprobs is not None else None)
              choice = {"index": 0, "text": out.new_text, "logprobs": lp, "finish_reason": out.finish_reason}
              yield _sse({**head, "choices": [choice], **({"usage": None} if usage else {})})
              sent += len(out.new_text)
              if out.finished and usage:
                yield _sse({**head, "choices": [], "usage": _usage(gen.usage(out))})
          except JaxinferError as e:
            yield _sse(_api_error(e).body())
          yield _sse("[DONE]")

      return _GenerationResponse(events(), gen)
    async with gen:
      try:
        out = await _unless_disconnected(request, _last_output(gen))
      except _ClientGone:
        return Response(status_code=499)  # nobody reads it
      lp = api.completion_logprobs(out, 0, as_ids, 0) if out.top_logprobs is not None else None
      return {**head, "choices": [{"index": 0, "text": out.text, "logprobs": lp,
                                   "finish_reason": out.finish_reason}],
              "usage": _usage(gen.usage(out))}

  @app.post("/v1/chat/completions")
  async def chat_completions(body: ChatCompletionRequest, request: Request):
    if body.top_logprobs is not None and not body.logprobs:
      raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
      raise ApiError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}",
                     param="top_logprobs")
    messages = _chat_messages(body)
    if body.max_completion_tokens is not None:
      mt, mt_field = body.max_completion_tokens, "max_completion_tokens"
    else:
      mt, mt_field = body.max_tokens, "max_tokens"
    logprobs = (body.top_logprobs or 0) if body.logprobs else None

    def params(n_prompt: int) -> SamplingParams:
      return _sampling(body, api.default_max_tokens(n_prompt) if mt is None else mt, mt_field,
                       logprobs, "top_logprobs")

    gen = await api.submit(body, messages, "messages", params)
    rid, created, as_ids = f"chatcmpl-{gen.request_id[5:]}", int(time.time()), bool(body.return_tokens_as_token_ids)
    if body.stream:
      usage = body.stream_options is not None and body.stream_options.include_usage
      head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": api.model}
      tail = {"usage": None} if usage else {}

      async def events() -> AsyncIterator[str]:
        async with gen:
          yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}], **tail})
          try:
            async for out in gen:
              if not (out.new_token_ids or out.new_text or out.finished):
                continue
              first = len(out.token_ids) - len(out.new_token_ids)
              lp = api.chat_logprobs(out, first, as_ids) if out.top_logprobs is not None else None
              delta = {"content": out.new_text} if (out.new_text or out.new_token_ids) else {}
              choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": out.finish_reason}
              yield _sse({**head, "choices": [choice], **tail})
              if out.finished and usage:
                yield _sse({**head, "choices": [], "usage": _usage(gen.usage(out))})
          except JaxinferError as e:
            yield _sse(_api_error(e).body())
          yield _sse("[DONE]")

      return _GenerationResponse(events(), gen)
    async with gen:
      try:
        out = await _unless_disconnected(request, _last_output(gen))
      except _ClientGone:
        return Response(status_code=499)
      lp = api.chat_logprobs(out, 0, as_ids) if out.top_logprobs is not None else None
      return {"id": rid, "object": "chat.completion", "created": created, "model": api.model,
              "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                           "logprobs": lp, "finish_reason": out.finish_reason}],
              "usage": _usage(gen.usage(out))}

  return app
