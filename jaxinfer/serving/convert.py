"""Proto <-> engine conversions shared by the server and the client.

Field names in error messages are the proto's (`sampling.temperature`,
`chat.messages[1].role`), so a client can tell which field to fix.
"""

from __future__ import annotations

from typing import Any, Sequence

from jaxinfer.engine.engine import RequestOutput
from jaxinfer.errors import InvalidRequestError
from jaxinfer.sampling import SamplingParams
from jaxinfer.serving.proto import inference_pb2 as pb
from jaxinfer.structured import StructuredOutput

# SamplingOptions fields that are `optional` in the proto: unset = the engine's default.
_OPTIONAL = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "max_tokens", "logprobs", "prompt_logprobs")

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
FINISH_REASON_NAMES = {v: k for k, v in FINISH_REASONS.items()}


def sampling_from_proto(o: pb.SamplingOptions) -> SamplingParams:
  kw: dict[str, Any] = {name: getattr(o, name) for name in _OPTIONAL if o.HasField(name)}
  kw.update(stop=tuple(o.stop), stop_token_ids=tuple(o.stop_token_ids), ignore_eos=o.ignore_eos)
  try:
    if o.HasField("structured"):
      kw["structured"] = structured_from_proto(o.structured)
    return SamplingParams(**kw)
  except InvalidRequestError as e:
    raise InvalidRequestError(f"sampling.{e}") from None


def sampling_to_proto(params: SamplingParams | None = None, **overrides: Any) -> pb.SamplingOptions:
  """SamplingOptions from a SamplingParams and/or keyword fields (unknown names are an error)."""
  known = set(_OPTIONAL) | {"stop", "stop_token_ids", "ignore_eos", "structured"}
  unknown = sorted(set(overrides) - known)
  if unknown:
    raise InvalidRequestError(f"unknown sampling option(s) {unknown}; known: {sorted(known)}")
  values: dict[str, Any] = {}
  if params is not None:
    values = {name: getattr(params, name) for name in known}
  values.update(overrides)
  if isinstance(values.get("stop"), str):
    values["stop"] = [values["stop"]]
  if values.get("structured") is not None:
    values["structured"] = structured_to_proto(values["structured"])
  return pb.SamplingOptions(**{k: v for k, v in values.items() if v is not None})


def structured_from_proto(o: pb.StructuredOutput) -> StructuredOutput:
  """Errors read `structured.<field>: ...` (sampling_from_proto prefixes `sampling.`)."""
  kind = o.WhichOneof("kind")
  if kind is None:
    raise InvalidRequestError("structured is set but none of json_schema, json_object, regex, choice is")
  if kind == "choice":
    return StructuredOutput(choice=tuple(o.choice.choices))
  return StructuredOutput(**{kind: getattr(o, kind)})


def structured_to_proto(s: StructuredOutput | dict) -> pb.StructuredOutput:
  """From a StructuredOutput, or a dict of its fields (checked by StructuredOutput)."""
  if isinstance(s, dict):
    s = StructuredOutput(**s)
  if s.kind == "choice":
    return pb.StructuredOutput(choice=pb.Choices(choices=s.choice))
  return pb.StructuredOutput(**{s.kind: getattr(s, s.kind)})


def messages_from_proto(chat: pb.Chat) -> list[dict[str, str]]:
  if not chat.messages:
    raise InvalidRequestError("chat.messages is empty")
  for i, m in enumerate(chat.messages):
    if not m.role:
      raise InvalidRequestError(f"chat.messages[{i}].role is empty")
  return [{"role": m.role, "content": m.content} for m in chat.messages]


def prompt_to_proto(prompt: str | Sequence[int] | Sequence[dict], request: Any) -> None:
  """Sets the `prompt` oneof of a GenerateRequest (or the `input` of a TokenizeRequest)."""
  if isinstance(prompt, str):
    request.text = prompt
    return
  prompt = list(prompt)
  if prompt and all(isinstance(m, dict) for m in prompt):
    request.chat.messages.extend(pb.ChatMessage(role=m.get("role", ""), content=m.get("content", ""))
                                 for m in prompt)
  elif hasattr(request, "token_ids"):
    request.token_ids.ids.extend(int(t) for t in prompt)
  else:
    raise InvalidRequestError("give text or chat messages")


def response_from_output(request_id: str, out: RequestOutput, *, whole: bool,
                         usage: pb.Usage | None = None) -> pb.GenerateResponse:
  """One GenerateResponse: the output's new tokens (or, `whole`, all of them)."""
  if whole:
    ids, text = out.token_ids, out.text
  else:
    ids, text = out.new_token_ids, out.new_text
  first = len(out.token_ids) - len(ids)
  r = pb.GenerateResponse(request_id=request_id, token_ids=ids, text=text)
  if out.top_logprobs is not None:  # the request asked for logprobs
    for j in range(first, len(out.token_ids)):
      r.logprobs.add(token_id=out.token_ids[j], logprob=out.logprobs[j], top=_top(out.top_logprobs[j]))
  if out.prompt_logprobs is not None and first == 0 and ids:  # complete once a token is out
    for t, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
      r.prompt_logprobs.add(token_id=t, logprob=entry[t], top=_top(entry))
  if out.finished:
    r.finish_reason = FINISH_REASONS[out.finish_reason]
    if usage is not None:
      r.usage.CopyFrom(usage)
  return r


def _top(entry: dict[int, float]) -> list[pb.TopLogprob]:
  """A {token: logprob} entry (the n best plus the chosen token), most likely first."""
  return [pb.TopLogprob(token_id=t, logprob=lp) for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])]
