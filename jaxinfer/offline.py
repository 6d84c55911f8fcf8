"""Offline batch generation over JSON Lines, resumable.

Input, one request per line:

    {"id": "q1", "prompt": "Tell me a joke", "max_tokens": 64, "temperature": 0.7}
    {"id": "q2", "messages": [{"role": "user", "content": "Hi"}]}
    {"id": "q3", "prompt": [1, 2, 3], "sampling_params": {"top_k": 5}}

`prompt` is text or token ids; `messages` is a chat. Any SamplingParams
field, at the top level or under "sampling_params", overrides the run's
defaults for that line. A line without an id gets "line-<n>" (1-based).

Output, one record per request, written (and flushed) as each finishes:

    {"id": "q1", "text": ..., "token_ids": [...], "finish_reason": "stop",
     "num_prompt_tokens": 9, "num_generated_tokens": 12, "num_cached_tokens": 0}

A bad line gets {"id": ..., "error": "..."} and the run goes on (a repeated
id is filed as "line-<n>", so it never hides the first one on resume). Running
again with the same output file skips every id already there (resume after
a crash or Ctrl-C; a half-written last line is dropped first).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Iterator

from jaxinfer.errors import InvalidRequestError, JaxinferError
from jaxinfer.sampling import SamplingParams

_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


@dataclasses.dataclass
class OfflineSummary:
  done: int = 0  # requests generated in this run
  errors: int = 0  # bad lines recorded as errors in this run
  skipped: int = 0  # ids already in the output
  generated_tokens: int = 0
  seconds: float = 0.0

  @property
  def tokens_per_s(self) -> float:
    return self.generated_tokens / self.seconds if self.seconds else 0.0


def _done_ids(output: Path) -> set[str]:
  """Ids already in the output; drops a half-written last line (a crash mid-write)."""
  if not output.exists():
    return set()
  data = output.read_bytes()
  if data and not data.endswith(b"\n"):
    data = data[:data.rfind(b"\n") + 1]
    output.write_bytes(data)
  ids = set()
  for line in data.decode("utf-8").splitlines():
    try:
      ids.add(str(json.loads(line)["id"]))
    except (ValueError, KeyError, TypeError):
      continue
  return ids


def _parse(line: str, n: int, defaults: SamplingParams) -> tuple[str, dict[str, Any]]:
  """(id, request) for one input line; the request holds 'prompt' and 'params', or 'error'."""
  try:
    obj = json.loads(line)
  except ValueError as e:
    return f"line-{n}", {"error": f"line {n}: not valid JSON ({e.msg})"}
  if not isinstance(obj, dict):
    return f"line-{n}", {"error": f"line {n}: expected a JSON object, got {type(obj).__name__}"}
  rid = str(obj.get("id", f"line-{n}"))
  has_prompt, has_messages = "prompt" in obj, "messages" in obj
  if has_prompt == has_messages:
    return rid, {"error": f"line {n}: give exactly one of 'prompt' or 'messages'"}
  overrides = dict(obj.get("sampling_params") or {})
  overrides.update({k: v for k, v in obj.items() if k in _FIELDS})
  unknown = set(obj) - _FIELDS - {"id", "prompt", "messages", "sampling_params"}
  if unknown:
    return rid, {"error": f"line {n}: unknown field(s) {sorted(unknown)}"}
  try:
    params = dataclasses.replace(defaults, **overrides)
  except (InvalidRequestError, TypeError) as e:
    return rid, {"error": f"line {n}: {e}"}
  return rid, {"prompt": obj["prompt"] if has_prompt else obj["messages"], "params": params}


def _lines(path: Path) -> Iterator[tuple[int, str]]:
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if line.strip():
        yield n, line


def generate_jsonl(llm, input_path: str | Path, output_path: str | Path,
                   defaults: SamplingParams = SamplingParams(), *, apply_chat_template: bool = True,
                   progress: bool = True, window: int | None = None) -> OfflineSummary:
  """Runs every request of `input_path` not yet in `output_path`; appends results there.

  At most `window` requests (default 4 x max_num_seqs) are queued at once, so
  memory stays flat however long the input is. Text prompts are sent as a
  user turn of the chat template when `apply_chat_template` (and the model
  has one).
  """
  from tqdm.auto import tqdm

  input_path, output_path = Path(input_path), Path(output_path)
  if not input_path.is_file():
    raise InvalidRequestError(f"input file {input_path} does not exist")
  engine = llm.engine
  window = window or 4 * engine.engine_config.max_num_seqs
  done = _done_ids(output_path)
  summary = OfflineSummary()
  todo = sum(1 for _ in _lines(input_path))
  bar = tqdm(total=todo, desc="requests", unit="req", disable=not progress, initial=0)
  start = time.perf_counter()
  in_flight: dict[str, str] = {}  # engine request id -> user id
  seen: set[str] = set()
  output_path.parent.mkdir(parents=True, exist_ok=True)
  with open(output_path, "a", encoding="utf-8") as out:

    def write(record: dict) -> None:
      out.write(json.dumps(record, ensure_ascii=False) + "\n")
      out.flush()

    def drain(until: int) -> None:
      while len(in_flight) > until:
        for o in engine.step():
          summary.generated_tokens += len(o.new_token_ids)  # (final outputs only: the whole output)
          if o.finished:
            rid = in_flight.pop(o.request_id)
            write(_record(rid, o))
            summary.done += 1
            bar.update(1)
        elapsed = time.perf_counter() - start
        bar.set_postfix_str(f"{summary.generated_tokens / max(elapsed, 1e-9):.1f} tok/s", refresh=False)

    try:
      for n, line in _lines(input_path):
        rid, req = _parse(line, n, defaults)
        if rid in done or rid in seen:
          summary.skipped += rid in done
          if rid in seen:  # a repeated id: the first wins; the error is filed under the line
            write({"id": f"line-{n}", "error": f"line {n}: duplicate id {rid!r}"})
            summary.errors += 1
          bar.update(1)
          continue
        seen.add(rid)
        if "error" not in req:
          try:
            text, ids = llm.encode_prompt(req["prompt"], apply_chat_template)
            engine_id = f"offline-{n}"
            engine.add_request(engine_id, ids, req["params"], prompt=text, stream=False)
            in_flight[engine_id] = rid
          except JaxinferError as e:
            req = {"error": f"line {n}: {e}"}
        if "error" in req:
          write({"id": rid, **req})
          summary.errors += 1
          bar.update(1)
        drain(window)
      drain(0)
    finally:
      for engine_id in list(in_flight):  # interrupted: the rest is redone on resume
        engine.abort(engine_id)
      bar.close()
  summary.seconds = time.perf_counter() - start
  return summary


def _record(rid: str, o) -> dict[str, Any]:
  rec = {"id": rid, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
         "num_prompt_tokens": len(o.prompt_token_ids), "num_generated_tokens": len(o.token_ids),
         "num_cached_tokens": o.num_cached_tokens}
  if o.top_logprobs is not None:
    rec["logprobs"] = o.logprobs
    rec["top_logprobs"] = [{str(k): v for k, v in d.items()} for d in o.top_logprobs]
  if o.prompt_logprobs is not None:
    rec["prompt_logprobs"] = [None if d is None else {str(k): v for k, v in d.items()}
                              for d in o.prompt_logprobs]
  return rec
