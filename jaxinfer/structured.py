"""What a request asks its output to look like: JSON, a JSON schema, a regex, or one of a list.

    SamplingParams(structured=StructuredOutput(json_schema={"type": "object", ...}))
    SamplingParams(structured=StructuredOutput(json_object=True))
    SamplingParams(structured=StructuredOutput(regex=r"\\d{3}-\\d{4}"))
    SamplingParams(structured=StructuredOutput(choice=("yes", "no")))

Exactly one kind is set. This module only describes and checks the request;
grammar compilation and the per-step token masks live in
`jaxinfer.engine.grammar`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxinfer.errors import InvalidRequestError

KINDS = ("json_schema", "json_object", "regex", "choice")


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
  """A constraint on a request's output text.

  json_schema: a JSON schema (a dict, or its JSON text); the output is one
    JSON value that validates against it.
  json_object: the output is one JSON object (any keys).
  regex: the whole output matches this regular expression.
  choice: the output is exactly one of these strings.

  The schema is stored as compact JSON text so the value is hashable (it is
  the key of the compiled-grammar cache). Key order is kept, not sorted: a
  JSON grammar generates an object's properties in the schema's order.
  """

  json_schema: str | None = None
  json_object: bool = False
  regex: str | None = None
  choice: tuple[str, ...] | None = None

  def __init__(self, json_schema: str | dict | None = None, json_object: bool = False,
               regex: str | None = None, choice: Any = None):
    if isinstance(json_schema, dict):
      json_schema = json.dumps(json_schema, separators=(",", ":"))
    elif json_schema is not None:
      if not isinstance(json_schema, str):
        raise InvalidRequestError(
            f"structured.json_schema must be a JSON object or its text, got {type(json_schema).__name__}")
      try:
        parsed = json.loads(json_schema)
      except json.JSONDecodeError as e:
        raise InvalidRequestError(f"structured.json_schema is not valid JSON: {e}") from None
      if not isinstance(parsed, dict):
        raise InvalidRequestError("structured.json_schema must be a JSON object")
      json_schema = json.dumps(parsed, separators=(",", ":"))
    if not isinstance(json_object, bool):
      raise InvalidRequestError(f"structured.json_object must be a bool, got {json_object!r}")
    if regex is not None and (not isinstance(regex, str) or not regex):
      raise InvalidRequestError(f"structured.regex must be a non-empty string, got {regex!r}")
    if choice is not None:
      if isinstance(choice, str) or not all(isinstance(c, str) and c for c in choice):
        raise InvalidRequestError(f"structured.choice must be a list of non-empty strings, got {choice!r}")
      choice = tuple(choice)
      if not choice:
        raise InvalidRequestError("structured.choice must not be empty")
    object.__setattr__(self, "json_schema", json_schema)
    object.__setattr__(self, "json_object", json_object)
    object.__setattr__(self, "regex", regex)
    object.__setattr__(self, "choice", choice)
    set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
    if len(set_kinds) != 1:
      raise InvalidRequestError(
          f"structured output: set exactly one of {', '.join(KINDS)}; got {set_kinds or 'none'}")

  @property
  def kind(self) -> str:
    return next(k for k in KINDS if getattr(self, k) not in (None, False))

  @property
  def schema(self) -> dict | None:
    return None if self.json_schema is None else json.loads(self.json_schema)
