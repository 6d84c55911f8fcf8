"""The output processor: a step's sampled ids become each request's output.

It owns everything a request shows its caller: committing tokens (stop ids, stop strings,
max_tokens, the grammar's end), detokenization that never ends inside a character or a
possible stop string, logprobs and prompt logprobs, and the `RequestOutput` deltas. It never
touches request progress (the scheduler's) or device state (the runner's): a token that ends
a request is reported, and the engine ends it.

A step is committed over its rows at once (`commit_plain`): what decides a plain row's
commit (its stop ids, its length limit, its token count) is kept in arrays by sampler row
(`RowControls`), so the rows that take one token, do not finish, and show nothing until
the end are found and committed by numpy and C-level appends; per-request Python runs for
the rest only: a row that finishes, streams, has stop strings, top logprobs, a grammar,
more than MAX_ROW_STOP_IDS stop ids, drafts (or commits no token or several), a row that
changed hands since its step ran, and every row of a step with prompt logprobs or MTP
drafts to record. A row's controls are made when its request is first seen there, and
again after one of its commits went the per-request way.
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import itertools
import operator
from typing import Sequence

import numpy as np

from jaxinfer.engine.scheduler import Request
from jaxinfer.tokenizer import Tokenizer


class Prefix(collections.abc.Sequence):
  """items[start:stop] of a list that is only ever appended to, as it was when the view was
  made, without copying it: a streamed output's cumulative ids and logprobs (a copy each step
  would cost every request O(its length) per step, O(length^2) over a stream). Read-only;
  compares equal to a list with the same items; list(view) copies."""

  __slots__ = ("_items", "_start", "_stop")

  def __init__(self, items: list, start: int = 0, stop: int | None = None):
    self._items, self._start = items, start
    self._stop = len(items) if stop is None else stop

  def __len__(self) -> int:
    return self._stop - self._start

  def __getitem__(self, i):
    if isinstance(i, slice):
      lo, hi, step = i.indices(len(self))
      return self._items[self._start + lo:self._start + hi:step] if step > 0 else list(self)[i]
    n = len(self)
    if not -n <= i < n:
      raise IndexError("Prefix index out of range")
    return self._items[self._start + (i % n)]

  def __iter__(self):
    return itertools.islice(self._items, self._start, self._stop)

  def __eq__(self, other) -> bool:
    if not isinstance(other, collections.abc.Sequence) or isinstance(other, (str, bytes)):
      return NotImplemented
    return len(self) == len(other) and all(a == b for a, b in zip(self, other))

  __hash__ = None

  def __add__(self, other) -> list:
    return list(self) + list(other)

  def __repr__(self) -> str:
    return repr(list(self))


@dataclasses.dataclass
class RequestOutput:
  """A request's state after a step: cumulative text and ids, plus what is new.

  `new_token_ids` / `new_text` are the delta since the previous output of
  this request (what a stream sends). A streamed output's cumulative
  `token_ids`, `logprobs`, `top_logprobs` and `prompt_logprobs` are read-only
  `Prefix` views (the request's lists as they were, not copied every step); a
  finished output's are lists. Text never ends inside a UTF-8
  character or inside a possible stop string; it is complete once finished.
  `finish_reason`: None while running, else 'stop' (EOS, stop id or stop
  string), 'length' (max_tokens or the context), 'abort', or 'error' (this
  request failed inside the engine: `error` says how; others went on).
  """

  request_id: str
  prompt: str | None
  prompt_token_ids: list[int]
  text: str
  token_ids: Sequence[int]
  logprobs: Sequence[float]  # log-probability of each generated token
  finish_reason: str | None = None
  new_token_ids: list[int] = dataclasses.field(default_factory=list)
  new_text: str = ""
  top_logprobs: Sequence[dict[int, float]] | None = None  # with SamplingParams.logprobs
  prompt_logprobs: Sequence[dict[int, float] | None] | None = None  # with .prompt_logprobs
  num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
  num_remote_cached_tokens: int = 0  # remote KV: prompt tokens the remote worker had in its prefix cache
  num_accepted_draft_tokens: int = 0  # speculative decoding: drafts the target accepted into the output
  index: int = 0  # LLM.stream: the prompt's position in the call's prompts
  error: str | None = None  # with finish_reason 'error'

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None


class OutputState:
  """One request's output so far: logprobs, detokenized text, what was sent, its matcher."""

  def __init__(self, req: Request, tokenizer: Tokenizer | None, eos_ids: Sequence[int], stream: bool = True,
               grammar=None):
    p = req.params
    self.stream = stream  # an output after every step (else only the final one)
    self.stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
    self.logprobs: list[float] = []
    self.top: list[dict[int, float]] | None = [] if p.logprobs is not None else None
    self.prompt_lp: list[dict[int, float] | None] | None = (
        [None] if p.prompt_logprobs is not None else None)
    self.detok = tokenizer.detokenizer() if tokenizer is not None else None
    # Nobody reads the text before the end (not streamed, no stop string to find): the
    # tokens are detokenized when the final output is made, in one tight loop, instead of
    # one at a time between device steps.
    self.deferred = not stream and not p.stop
    self.text = ""  # the final text once a stop string cut it; else detok.text
    self.hold = max((len(s) for s in p.stop), default=1) - 1  # chars a stop string may still claim
    self.sent_tokens = 0
    self.sent_chars = 0
    self.stopped_by_text = False
    self.grammar = grammar  # structured output: the request's matcher (engine/grammar.py)
    self.accepted_drafts = 0  # speculative decoding: accepted drafts that joined the output
    # No top logprobs, stop strings or grammar: a token's commit is a few appends and two
    # checks (OutputProcessor.commit inlines it; most decode rows of most steps are this).
    self.plain = self.top is None and not p.stop and grammar is None
    self.max_tokens = p.max_tokens

  def visible_text(self, finished: bool) -> str:
    if self.detok is None:
      return ""
    if self.stopped_by_text:
      return self.text
    text = self.detok.text
    return text if finished else text[:max(self.sent_chars, len(text) - self.hold)]


# Stop ids a row's controls hold (EOS ids plus SamplingParams.stop_token_ids); a request with
# more commits through the per-request path.
MAX_ROW_STOP_IDS = 8


class RowControls:
  """Per sampler row, what commits a plain token of the request holding it (R rows):

    tenancy [R]    the row's `Scheduler.row_gen` these controls were made for (-1: none)
    plain [R]      its commits need no per-request Python: one token at a time, no stop
                   strings, top logprobs or grammar, and not streamed (nothing to show)
    num_tokens [R] the request's known tokens (prompt + output), kept by `commit_plain`
    limit [R]      num_tokens at which it ends with 'length' (prompt + max_tokens)
    stop [R, MAX_ROW_STOP_IDS]  ids that end it with 'stop' (-1 pads)

  A row's controls are made when its request is first seen there (`bind`: a join) and
  dropped when one of its commits goes the per-request way (the count is then the
  request's again, and the next step re-binds)."""

  def __init__(self, num_rows: int):
    self.tenancy = np.full(num_rows, -1, np.int64)
    self.plain = np.zeros(num_rows, bool)
    self.num_tokens = np.zeros(num_rows, np.int64)
    self.limit = np.zeros(num_rows, np.int64)
    self.stop = np.full((num_rows, MAX_ROW_STOP_IDS), -1, np.int64)

  def bind(self, row: int, tenancy: int, req: Request) -> None:
    out = req.output
    self.tenancy[row] = tenancy
    self.plain[row] = out.plain and not out.stream and len(out.stop_ids) <= MAX_ROW_STOP_IDS
    self.num_tokens[row] = len(req.token_ids)
    self.limit[row] = req.num_prompt_tokens + out.max_tokens
    self.stop[row] = -1
    self.stop[row, :min(len(out.stop_ids), MAX_ROW_STOP_IDS)] = sorted(out.stop_ids)[:MAX_ROW_STOP_IDS]


class OutputProcessor:
  """Commits tokens to requests and makes their outputs (see the module docstring)."""

  def __init__(self, tokenizer: Tokenizer | None, eos_ids: Sequence[int], num_rows: int = 0):
    self.tokenizer = tokenizer
    self.eos_ids = tuple(eos_ids)
    self.num_generated_tokens = 0
    self.rows = RowControls(num_rows)

  def commit_plain(self, reqs: Sequence[Request], rows: np.ndarray, tenancy: np.ndarray,
                   row_gen: np.ndarray, ids: np.ndarray, logprobs: np.ndarray, counts: np.ndarray,
                   eligible: np.ndarray | bool = True) -> np.ndarray:
    """Commits, at once, the step's rows that take one token, do not finish, and whose request
    shows nothing until it ends; returns the indices of the other rows (each needs `commit`,
    in order). reqs[i] ran on sampler row rows[i] of tenancy tenancy[i] (`SchedulerOutput`);
    row_gen: every row's tenancy now (a row freed or re-taken since is not its request's);
    ids / logprobs [S, k + 1] and counts [S]: the step's results; eligible: rows the caller
    lets through (False: drafts, prompt logprobs or MTP drafts to record)."""
    m = len(reqs)
    ctl = self.rows
    if eligible is False:  # MTP drafts, prompt logprobs: every row commits per request
      ctl.tenancy[rows] = -1  # their counts become the requests' again
      return np.arange(m)
    held = row_gen[rows] == tenancy
    join = np.flatnonzero(held & (ctl.tenancy[rows] != tenancy))
    for i in join.tolist():  # the rows a request has just joined
      ctl.bind(int(rows[i]), int(tenancy[i]), reqs[i])
    tok = ids[:m, 0]
    n = ctl.num_tokens[rows] + 1
    fast = (held & ctl.plain[rows] & (counts[:m] == 1) & eligible & (n < ctl.limit[rows])
            & ~(ctl.stop[rows] == tok[:, None]).any(axis=1))
    idx = np.flatnonzero(fast)
    if len(idx):
      r = rows[idx]
      ctl.num_tokens[r] = n[idx]
      got = list(map(reqs.__getitem__, idx.tolist()))
      # Appends without a Python frame per request (deque(maxlen=0) drains the map).
      collections.deque(map(list.append, map(_TOKEN_IDS, got), tok[idx].tolist()), maxlen=0)
      collections.deque(map(list.append, map(_LOGPROBS, got), logprobs[idx, 0].tolist()), maxlen=0)
      self.num_generated_tokens += len(idx)
    slow = np.flatnonzero(~fast)
    # Their counts become the requests' again: the next step re-binds those it may take.
    drop = slow[held[slow] & ctl.plain[rows[slow]] & (counts[slow] > 0)]
    ctl.tenancy[rows[drop]] = -1
    return slow

  def start(self, req: Request, grammar=None, stream: bool = True) -> None:
    """Gives a new request its output state (and its structured-output matcher)."""
    req.output = OutputState(req, self.tokenizer, self.eos_ids, stream, grammar)

  def commit(self, req: Request, ids: Sequence[int], logprobs: Sequence[float], top_ids: np.ndarray,
             top_logprobs: np.ndarray, count: int, num_drafts: int = 0, row: int | None = None) -> str | None:
    """Appends up to `count` of the sampled tokens ids[:count] (the first `num_drafts` of them
    accepted drafts), stopping at the first that finishes the request; returns its finish
    reason ('stop', 'length') or None. Top logprobs are top_ids[j] / top_logprobs[j], or with
    `row` the step's whole arrays' [row, j] (read only when the request wants them)."""
    out = req.output
    if count == 1 and out.plain:  # commit_one, inlined for the common row
      token = ids[0]
      req.token_ids.append(token)
      self.num_generated_tokens += 1
      out.logprobs.append(logprobs[0])
      if out.detok is not None and not out.deferred:
        out.detok.push(token)
      if token in out.stop_ids:
        return "stop"
      return "length" if len(req.token_ids) - len(req.prompt_token_ids) >= out.max_tokens else None
    if row is not None:
      top_ids, top_logprobs = top_ids[row], top_logprobs[row]
    before = len(req.token_ids)
    reason = None
    for j in range(count):
      reason = self.commit_one(req, ids[j], logprobs[j], top_ids[j], top_logprobs[j])
      if reason is not None:
        break
    # The committed run is the accepted drafts, then one token; a stop inside it keeps some.
    req.output.accepted_drafts += min(num_drafts, len(req.token_ids) - before)
    return reason

  def commit_one(self, req: Request, token: int, logprob: float, top_ids, top_lps) -> str | None:
    """Appends one token; returns the finish reason it brings, or None."""
    out, p = req.output, req.params
    req.token_ids.append(token)
    self.num_generated_tokens += 1
    out.logprobs.append(logprob)
    if out.top is not None:
      out.top.append(logprob_entry(top_ids, top_lps, p.logprobs, token, logprob))
    reason = None
    if out.detok is not None and not out.deferred:
      before = len(out.detok.text)
      out.detok.push(token)
      if p.stop:
        text = out.detok.text
        # A stop string may straddle earlier text: search from where it could begin.
        lo = max(0, before - out.hold)
        hits = [at for at in (text.find(s, lo) for s in p.stop) if at >= 0]
        if hits:
          out.text, out.stopped_by_text, reason = text[:min(hits)], True, "stop"
    if out.grammar is not None:
      out.grammar.consume(token)  # on commit only: a preempted request's recompute never re-consumes
    if reason is None and token in out.stop_ids:
      reason = "stop"
    elif reason is None and out.grammar is not None and out.grammar.finished:
      reason = "stop"  # only EOS could follow
    elif reason is None and req.num_output_tokens >= p.max_tokens:
      reason = "length"
    return reason

  @staticmethod
  def wants_prompt_logprobs(req: Request, start: int) -> bool:
    """Whether a step of req's from position `start` computes prompt positions' logprobs: some
    are missing, and the step starts before the prompt's last position. (The entries
    collected lag a step under async scheduling: alone, that test would send the first
    decode step through the prompt-logprobs program too.)"""
    lp = req.output.prompt_lp
    return lp is not None and len(lp) < req.num_prompt_tokens and start + 1 < req.num_prompt_tokens

  @staticmethod
  def add_prompt_logprobs(req: Request, start: int, num_new: int, target_lp, top_ids, top_lp) -> None:
    """Prompt logprobs of the step's rows start .. start + num_new - 1 (row j predicts the
    token at start + j + 1): per-row arrays of this request's rows."""
    out, k = req.output, req.params.prompt_logprobs
    for j in range(num_new):
      pos = start + j + 1
      if pos != len(out.prompt_lp) or pos >= req.num_prompt_tokens:
        continue
      out.prompt_lp.append(logprob_entry(top_ids[j], top_lp[j], k, req.token_ids[pos], target_lp[j]))

  @staticmethod
  def output(req: Request) -> RequestOutput:
    """The request's output now: cumulative state plus the delta since the last one made."""
    out = req.output
    finished = req.finish_reason is not None
    # Finished: lists, once. Streaming: views of the lists the request appends to.
    snap = list if finished else Prefix
    ids = req.output_token_ids if finished else Prefix(req.token_ids, req.num_prompt_tokens)
    if out.deferred and out.detok is not None:
      for token in ids[len(out.detok.ids):]:
        out.detok.push(token)
    text = out.visible_text(finished)
    o = RequestOutput(
        request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
        text=text, token_ids=ids, logprobs=snap(out.logprobs), finish_reason=req.finish_reason,
        new_token_ids=ids[out.sent_tokens:], new_text=text[out.sent_chars:],
        top_logprobs=snap(out.top) if out.top is not None else None,
        prompt_logprobs=snap(out.prompt_lp) if out.prompt_lp is not None else None,
        num_cached_tokens=req.num_cached_tokens, num_remote_cached_tokens=req.num_remote_cached_tokens,
        num_accepted_draft_tokens=out.accepted_drafts)
    out.sent_tokens, out.sent_chars = len(ids), len(text)
    return o


_TOKEN_IDS = operator.attrgetter("token_ids")
_LOGPROBS = operator.attrgetter("output.logprobs")


def logprob_entry(top_ids, top_lps, n: int, token: int, logprob) -> dict[int, float]:
  """{token id: logprob} for the n best tokens plus the one actually chosen."""
  entry = {int(a): float(b) for a, b in zip(top_ids[:n], top_lps[:n])}
  entry[int(token)] = float(logprob)
  return entry
