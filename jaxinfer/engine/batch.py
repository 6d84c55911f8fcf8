"""A step's inputs on the host: the scheduled sequences packed into one padded batch.

`pack` lays out any mix of prefill chunks, decodes and verified drafts (the
runner's module docstring has the layout); `pack_shards` does it per data shard
for attention DP. `InputBatch` keeps, per sampler row, the running request's known
tokens (`TokenTable`), page table and sampling controls in preallocated arrays,
written when a request joins or grows, so that a step's token ids are gathered by
(row, position) and a step of plain decodes (one known token each, the steady
state) packs by gathering rows (`InputBatch.pack_decodes`) instead of walking each
sequence's tokens, pages and parameters: the same StepBatch as `pack`
(tests/engine/test_batch.py), for the host's part of a step at a few hundred
sequences. `to_buffers` turns a batch into the two flat buffers that cross to the
device.

Legend: T tokens, S sequences, k drafts per sequence, L = S * (k + 1) logits rows,
P pages per sequence, R sampler rows, V vocab, W = ceil(V / 32) mask words.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.grammar import Grammar, fill_bitmasks, mask_words
from jaxinfer.engine.kv_manager import NULL_PAGE
from jaxinfer.models.transformer import PagedBatch
from jaxinfer.sampling import SamplingBatch, SamplingParams


def power_of_two_buckets(lo: int, hi: int) -> tuple[int, ...]:
  """lo, 2lo, 4lo, ... and finally hi itself."""
  out, b = [], lo
  while b < hi:
    out.append(b)
    b *= 2
  out.append(hi)
  return tuple(out)


def slot_mapping(page_table: Any, seq: Any, pos: Any, page_size: int) -> Any:
  """The KV slots (page * page_size + offset) of positions `pos` of the sequences `seq`,
  whose pages are the rows of `page_table` [S, P] (numpy on the host, jax on the device)."""
  return page_table[seq, pos // page_size] * page_size + pos % page_size


def bucket(n: int, buckets: tuple[int, ...]) -> int:
  for b in buckets:
    if n <= b:
      return b
  raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(slots=True)
class ScheduledSeq:
  """One sequence's share of a step: token_ids[start:] (num_new - len(draft_ids)
  of them) followed by the drafts, at positions start, start + 1, ..."""

  row: int  # sampler-history row
  token_ids: Sequence[int]  # all committed tokens of the request (prompt + output)
  start: int  # tokens before this are already in the cache
  num_new: int  # tokens this step computes, drafts included
  pages: Sequence[int]
  params: SamplingParams
  seed: int
  want_prompt_logprobs: bool = False
  draft_ids: Sequence[int] = ()  # speculative tokens to verify after the committed ones
  grammar: Grammar | None = None  # structured output: its matcher, at the committed tokens
  # Async scheduling: the one token to compute is the one the step before sampled, still on
  # the device (not yet in token_ids); the step reads it from its history row. Drafts of a
  # fed sequence are placeholders: the step reads the MTP drafts that step made, and shifts
  # the positions by the drafts it accepted (known on the device only).
  feed: bool = False

  @property
  def num_committed_new(self) -> int:
    return self.num_new - len(self.draft_ids)

  @property
  def samples(self) -> bool:
    """Whether this step reaches the end of the known tokens (else: a prefill chunk)."""
    return self.feed or self.start + self.num_committed_new == len(self.token_ids)


class StepBatch(NamedTuple):
  """Everything one step reads, as arrays (a pytree: host numpy in, device arrays in the step)."""

  tokens: Any  # [T]
  positions: Any  # [T]
  paged: PagedBatch  # slot mapping, kv lens, page table, cu_q_lens, num_seqs
  logits_indices: Any  # [L] the row of the T rows that each logits row reads
  sampling: SamplingBatch  # [L] per logits row
  rows: Any  # [L] sampler-history row of each logits row
  samples: Any  # [S] bool: the sequence commits tokens this step (not a prefill chunk)
  draft_ids: Any  # [S, k]
  num_drafts: Any  # [S]
  targets: Any  # [T] next known token of each row (prompt logprobs, the MTP module's input)
  allowed: Any  # [L, W] int32 allowed-token bitmask per logits row (-1: any token); None: no row has one
  # Async scheduling. feed [T]: row * (k + 1) + j for the j-th token of a sequence fed from
  # history row `row` (j = 0 its last committed token, j >= 1 its MTP draft j); -1: tokens[t].
  # shift [S]: the history row whose last step's accepted drafts shift this sequence's
  # positions, KV slots and lengths (the host packed it without them); -1: none.
  feed: Any
  shift: Any


class SamplerInputs(NamedTuple):
  """The part of a StepBatch the sampler reads: no [T] array, so its program is keyed by the
  step's sequence rows, not its tokens."""

  sampling: SamplingBatch  # [L]
  rows: Any  # [L]
  samples: Any  # [S]
  draft_ids: Any  # [S, k]
  num_drafts: Any  # [S]
  allowed: Any  # [L, W] or None
  shift: Any  # [S]

  @classmethod
  def of(cls, b: StepBatch) -> "SamplerInputs":
    return cls(b.sampling, b.rows, b.samples, b.draft_ids, b.num_drafts, b.allowed, b.shift)


class TokenTable:
  """The known tokens (prompt + output so far) of the request on each sampler row: ids [R, N],
  what a step's tokens and targets are gathered from by (row, position).

  A row follows its request's token list, which only ever grows (the output processor
  appends; nothing truncates it): before a step reads a row (`sync`), the row is copied
  whole if another list has taken it, else only the list's new tail. A sequence fed its
  token from the device (async scheduling) reads nothing here, and its row is not synced."""

  def __init__(self, num_rows: int, width: int):
    self.ids = np.zeros((num_rows, width), np.int32)  # [R, N]
    self._len = [0] * num_rows  # tokens of the row's list copied so far
    self._owner: list[Any] = [None] * num_rows  # the list the row follows

  @classmethod
  def covering(cls, seqs: Sequence[ScheduledSeq]) -> "TokenTable":
    """A table for these sequences alone (a `pack` called without the runner's)."""
    return cls(max((s.row for s in seqs), default=0) + 1, max((len(s.token_ids) for s in seqs), default=0) + 1)

  def sync(self, row: int, token_ids: Sequence[int]) -> None:
    have = self._len[row] if self._owner[row] is token_ids else 0
    n = len(token_ids)
    if n == have:
      return
    if n > self.ids.shape[1]:
      raise ValueError(f"{n} tokens exceed the token table's {self.ids.shape[1]} per row")
    self.ids[row, have:n] = token_ids[have:n]
    self._owner[row], self._len[row] = token_ids, n

  def sync_many(self, rows: Sequence[int], lists: Sequence[Sequence[int]]) -> None:
    """`sync` of each row to its list; the rows one token behind (a decode's, the common
    case) are written in one scatter rather than a slice each."""
    owner, have_len, width = self._owner, self._len, self.ids.shape[1]
    one_rows, one_pos, one_ids = [], [], []
    for row, ids in zip(rows, lists):
      if owner[row] is ids:
        have, n = have_len[row], len(ids)
        if n == have:
          continue
        if n == have + 1 and n <= width:
          one_rows.append(row)
          one_pos.append(have)
          one_ids.append(ids[have])
          continue
      self.sync(row, ids)  # a new list on the row, a longer tail, or the width's error
    if one_rows:
      self.ids[one_rows, one_pos] = one_ids
      for row, have in zip(one_rows, one_pos):  # counted once written (a raise above leaves them behind)
        have_len[row] = have + 1


def pack(seqs: Sequence[ScheduledSeq], T: int, S: int, k: int, pages_per_seq: int, page_size: int,
         scratch_row: int, vocab_size: int, tokens: TokenTable | None = None) -> StepBatch:
  """Packs the scheduled sequences, in order, into one padded StepBatch of T tokens,
  S sequences and S * (k + 1) logits rows. Padding tokens write to page 0 (NULL_PAGE);
  padding sequences and logits rows are greedy on the scratch history row. Grammar
  masks are computed here for the rows that sample (this reads matcher state only).
  tokens: the rows' token table (the runner's persistent one; None: one made for these
  sequences)."""
  if len(seqs) > S:
    raise ValueError(f"{len(seqs)} sequences do not fit the {T}-token bucket ({S} sequences)")
  table = tokens if tokens is not None else TokenTable.covering(seqs)
  ps, K1, m = page_size, k + 1, len(seqs)
  L = S * K1
  # Per sequence, then per token and per logits row by np.repeat: at 256 decodes a loop of
  # small numpy ops per sequence was most of the host's step time.
  n = np.fromiter((s.num_new for s in seqs), np.int32, m)
  nd = np.fromiter((len(s.draft_ids) for s in seqs), np.int32, m)
  if m and nd.max() > k:
    raise ValueError(f"{nd.max()} drafts exceed the step's {k} speculative tokens")
  start = np.fromiter((s.start for s in seqs), np.int32, m)
  end = start + n
  cu = np.zeros(S + 1, np.int32)
  cu[1:m + 1] = np.cumsum(n)
  cu[m + 1:] = cu[m]
  t = int(cu[m])
  tok_seq = np.repeat(np.arange(m, dtype=np.int32), n)  # [t] the sequence of each token row
  pos = start[tok_seq] + np.arange(t, dtype=np.int32) - cu[tok_seq]
  page_indices = np.full((S, pages_per_seq), NULL_PAGE, np.int32)
  for i, s in enumerate(seqs):
    page_indices[i, :len(s.pages)] = s.pages
  slots = np.full(T, NULL_PAGE * ps, np.int32)
  draft_ids = np.zeros((S, k), np.int32)
  known = np.zeros(m, np.int32)  # each sequence's known tokens (0 for a fed one: it reads none)
  read_rows, read_lists = [], []  # the rows the step reads tokens from, and their lists
  for i, s in enumerate(seqs):
    if len(s.draft_ids):
      draft_ids[i, :len(s.draft_ids)] = s.draft_ids
    if not s.feed:
      known[i] = len(s.token_ids)
      read_rows.append(s.row)
      read_lists.append(s.token_ids)
  table.sync_many(read_rows, read_lists)
  # The committed tokens, then the drafts; and every row's next known token: prompt logprobs
  # score it, and an MTP module reads it (rows that sample get theirs on device), 0 past the end.
  seq_row = np.fromiter((s.row for s in seqs), np.int32, m)
  row_of = seq_row[tok_seq]  # [t]
  j = pos - start[tok_seq]  # [t] the token's index in its sequence's share
  ncn = (n - nd)[tok_seq]
  width = table.ids.shape[1]
  tokens = np.zeros(T, np.int32)
  tokens[:t] = np.where(pos < known[tok_seq], table.ids[row_of, np.minimum(pos, width - 1)], 0)
  is_draft = (j >= ncn) & (known[tok_seq] > 0)
  tokens[:t][is_draft] = draft_ids[tok_seq[is_draft], (j - ncn)[is_draft]]
  targets = np.zeros(T, np.int32)
  targets[:t] = np.where(pos + 1 < known[tok_seq], table.ids[row_of, np.minimum(pos + 1, width - 1)], 0)
  positions = np.zeros(T, np.int32)
  feed = np.full(T, -1, np.int32)
  shift = np.full(S, -1, np.int32)
  fed = [i for i, s in enumerate(seqs) if s.feed]
  if fed:
    if any(s.num_committed_new != 1 for s in map(seqs.__getitem__, fed)):
      raise ValueError("a sequence fed its in-flight token computes that token and its drafts only")
    fed = np.asarray(fed)
    shift[fed] = [seqs[i].row for i in fed]
    f_tok = np.repeat(fed, n[fed])  # the fed sequences' token rows
    f_j = np.arange(len(f_tok)) - np.repeat(np.cumsum(n[fed]) - n[fed], n[fed])
    feed[cu[f_tok] + f_j] = shift[f_tok] * K1 + f_j
  positions[:t] = pos
  slots[:t] = slot_mapping(page_indices, tok_seq, pos, ps)
  kv_lens = np.zeros(S, np.int32)
  kv_lens[:m] = end
  samples = np.zeros(S, bool)
  samples[:m] = [s.samples for s in seqs]
  num_drafts = np.zeros(S, np.int32)
  num_drafts[:m] = nd
  constrained: list[tuple[Grammar, int, Sequence[int]]] = [
      (s.grammar, i * K1, s.draft_ids) for i, s in enumerate(seqs)
      if s.grammar is not None and s.samples]  # a prefill chunk's row is never sampled
  # Logits rows i*(k+1) .. i*(k+1)+nd read the last nd + 1 token rows; row j samples the
  # token at position end - nd + j.
  row_seq = np.repeat(np.arange(m, dtype=np.int32), nd + 1)
  j = np.arange(len(row_seq), dtype=np.int32) - np.repeat(np.cumsum(nd + 1) - (nd + 1), nd + 1)
  li = row_seq * K1 + j
  logits_indices = np.zeros(L, np.int32)
  logits_indices[li] = cu[1:m + 1][row_seq] - nd[row_seq] - 1 + j
  rows = np.full(L, scratch_row, np.int32)
  rows[li] = seq_row[row_seq]
  seeds = np.zeros(L, np.uint32)
  seeds[li] = np.fromiter((s.seed for s in seqs), np.uint32, m)[row_seq]
  sample_pos = np.zeros(L, np.int32)
  sample_pos[li] = (end - nd)[row_seq] + j
  params: list[SamplingParams | None] = [None] * L
  for r, i in zip(li.tolist(), row_seq.tolist()):
    params[r] = seqs[i].params
  sampling = SamplingBatch.from_params(params, seeds, sample_pos)
  allowed = None  # no [L, W] mask crosses to the device unless some row has a grammar
  if constrained:
    allowed = np.full((L, mask_words(vocab_size)), -1, np.int32)
    fill_bitmasks(constrained, allowed)
  return StepBatch(tokens, positions, PagedBatch(slots, kv_lens, page_indices, cu, np.int32(len(seqs))),
                   logits_indices, sampling, rows, samples, draft_ids, num_drafts, targets, allowed, feed, shift)


class BufferLayout(NamedTuple):
  """Where each leaf of a host pytree lies in its two flat buffers (hashable: a static argument)."""

  treedef: Any
  leaves: tuple[tuple[str, int, tuple[int, ...], str], ...]  # (buffer 'i' / 'f', offset, shape, dtype)


_LAYOUTS: dict[Any, BufferLayout] = {}  # one per step shape: the same object every step


def to_buffers(tree: Any) -> tuple[np.ndarray, np.ndarray, BufferLayout]:
  """A host pytree as one int32 and one float32 buffer (bools and uint32 ride in the int32 one):
  two host->device copies per step, however many arrays the step reads. The layout, a static
  argument of the step's programs, is built once per treedef and leaf shapes."""
  leaves, treedef = jax.tree.flatten(tree)
  leaves = [np.asarray(x) for x in leaves]
  key = (treedef, tuple((x.shape, x.dtype.char) for x in leaves))
  layout = _LAYOUTS.get(key)
  if layout is None:
    size = {"i": 0, "f": 0}
    spec = []
    for x in leaves:
      kind = "f" if x.dtype.kind == "f" else "i"
      spec.append((kind, size[kind], x.shape, x.dtype.str))
      size[kind] += x.size
    layout = _LAYOUTS.setdefault(key, BufferLayout(treedef, tuple(spec)))
  ints = [x.reshape(-1) for x, (kind, *_) in zip(leaves, layout.leaves) if kind == "i"]
  floats = [x.reshape(-1) for x, (kind, *_) in zip(leaves, layout.leaves) if kind == "f"]
  # casting="unsafe": bools become 0 / 1 and uint32 keeps its bits (from_buffers undoes both).
  cat = lambda parts, dt: np.concatenate(parts, dtype=dt, casting="unsafe") if parts else np.zeros(0, dt)
  return cat(ints, np.int32), cat(floats, np.float32), layout


def from_buffers(layout: BufferLayout, ints: jax.Array, floats: jax.Array) -> Any:
  """The pytree of `to_buffers`, on device (static slices: no gather)."""
  out = []
  for kind, off, shape, dtype in layout.leaves:
    n = math.prod(shape)
    x = (ints if kind == "i" else floats)[off:off + n].reshape(shape)
    dtype = np.dtype(dtype)
    if dtype == np.uint32:
      x = jax.lax.bitcast_convert_type(x, jnp.uint32)
    elif dtype == np.bool_:
      x = x != 0
    out.append(x)
  return jax.tree.unflatten(layout.treedef, out)


def pack_shards(seqs: Sequence[ScheduledSeq], shards: Sequence[int], num_shards: int, shard_pages: int,
                T: int, S: int, k: int, pages_per_seq: int, page_size: int, scratch_row: int,
                vocab_size: int, tokens: TokenTable | None = None) -> tuple[StepBatch, tuple[np.ndarray, np.ndarray]]:
  """Attention DP: one `pack` per data shard, of that shard's sequences with their page ids
  made shard-local (local page 0 is the shard's padding page), concatenated: T tokens,
  S sequences and S * (k + 1) logits rows per shard, in shard order. Also returns where each
  scheduled sequence's result row and each of its tokens landed, to undo the grouping."""
  groups = [[i for i, d in enumerate(shards) if d == shard] for shard in range(num_shards)]
  tokens = tokens if tokens is not None else TokenTable.covering(seqs)
  parts = []
  for d, group in enumerate(groups):
    local = [dataclasses.replace(seqs[i], pages=[p - d * shard_pages for p in seqs[i].pages]) for i in group]
    b = pack(local, T, S, k, pages_per_seq, page_size, scratch_row, vocab_size, tokens)
    # Shard d's hidden rows follow the d * T rows of the shards before it.
    parts.append(b._replace(logits_indices=b.logits_indices + d * T,
                            paged=b.paged._replace(num_seqs=np.atleast_1d(b.paged.num_seqs))))
  batch = jax.tree.map(lambda *xs: np.concatenate(xs), *parts)
  seq_rows = np.zeros(len(seqs), np.int64)
  token_start = np.zeros(len(seqs), np.int64)
  for d, group in enumerate(groups):
    t = d * T
    for j, i in enumerate(group):
      seq_rows[i], token_start[i] = d * S + j, t
      t += seqs[i].num_new
  token_rows = np.concatenate([np.arange(token_start[i], token_start[i] + s.num_new) for i, s in enumerate(seqs)]
                              + [np.zeros(0, np.int64)])
  return batch, (seq_rows, token_rows)


class InputBatch:
  """The running requests' known tokens, page tables and sampling controls, one row per
  sampler row, kept across steps (vLLM's persistent input batch and block table).

  The tokens are a `TokenTable` (`pack` gathers from it too). A row's page table and
  controls are rewritten when it changes hands (its `ScheduledSeq.pages` is another list:
  the KV manager keeps one per request while it holds pages) and its page table
  extended when that list grows; otherwise a step reads the row as it is. The
  scratch row stays a padding row (greedy, no pages)."""

  def __init__(self, scratch_row: int, pages_per_seq: int, page_size: int, num_speculative_tokens: int):
    R = scratch_row + 1
    self.scratch_row, self.page_size, self.k = scratch_row, page_size, num_speculative_tokens
    self.tokens = TokenTable(R, pages_per_seq * page_size + 1)  # [R, N]: every position, and one sampled past them
    self.page_table = np.full((R, pages_per_seq), NULL_PAGE, np.int32)  # [R, P]
    self.sampling = SamplingBatch.from_params([None] * R, np.zeros(R, np.uint32), np.zeros(R, np.int32))
    self._owner: list[Any] = [None] * R
    self._num_pages = [0] * R

  def _write(self, s: ScheduledSeq) -> None:
    row, pages = s.row, s.pages
    if row == self.scratch_row:
      raise ValueError(f"row {row} is the scratch row (padding only)")
    if self._owner[row] is not pages:  # a new request on this row
      self._owner[row], self._num_pages[row] = pages, 0
      self.page_table[row] = NULL_PAGE
      self.sampling.set_row(row, s.params)
      self.sampling.seed[row] = s.seed
    have = self._num_pages[row]
    self.page_table[row, have:len(pages)] = pages[have:]
    self._num_pages[row] = len(pages)

  def pack_decodes(self, seqs: Sequence[ScheduledSeq], T: int, S: int) -> StepBatch | None:
    """`pack(seqs, T, S, ...)` for a step whose every sequence computes one known token and
    samples after it (no drafts, prompt logprobs or grammar), by row gathers; None for any
    other step (`pack` lays it out)."""
    m = len(seqs)
    if m > S:
      raise ValueError(f"{m} sequences do not fit the {T}-token bucket ({S} sequences)")
    owner, num_pages = self._owner, self._num_pages
    rows, starts, fed, known_rows, known_ids = [], [], [], [], []
    for i, s in enumerate(seqs):
      if s.num_new != 1 or s.draft_ids or s.grammar is not None or s.want_prompt_logprobs:
        return None
      start, ids = s.start, s.token_ids
      if s.feed:
        fed.append(i)
      elif start + 1 == len(ids):
        known_rows.append(s.row)
        known_ids.append(ids)
      else:
        return None  # the last token of a prefill chunk that stops short of the known tokens
      if owner[s.row] is not s.pages or num_pages[s.row] != len(s.pages):
        self._write(s)
      rows.append(s.row)
      starts.append(start)
    self.tokens.sync_many(known_rows, known_ids)
    ps, K1 = self.page_size, self.k + 1
    L = S * K1
    row = np.asarray(rows, np.int32)
    pos = np.asarray(starts, np.int32)
    i = np.arange(m, dtype=np.int32)
    page_indices = np.full((S, self.page_table.shape[1]), NULL_PAGE, np.int32)
    page_indices[:m] = self.page_table[row]
    tok = np.zeros(T, np.int32)
    tok[:m] = self.tokens.ids[row, pos]
    positions = np.zeros(T, np.int32)
    positions[:m] = pos
    slots = np.full(T, NULL_PAGE * ps, np.int32)
    slots[:m] = slot_mapping(page_indices, i, pos, ps)
    cu = np.full(S + 1, m, np.int32)
    cu[:m + 1] = np.arange(m + 1)
    kv_lens = np.zeros(S, np.int32)
    kv_lens[:m] = pos + 1
    samples = np.zeros(S, bool)
    samples[:m] = True
    feed = np.full(T, -1, np.int32)
    shift = np.full(S, -1, np.int32)
    if fed:
      shift[fed] = row[fed]
      feed[fed] = row[fed] * K1
      tok[fed] = 0  # read on the device (its row here may hold an older list's token)
    # Sequence i's one logits row is row i * (k + 1); the rest are padding, on the scratch row.
    li = i * K1
    logits_indices = np.zeros(L, np.int32)
    logits_indices[li] = i
    rows_l = np.full(L, self.scratch_row, np.int32)
    rows_l[li] = row
    sample_pos = np.zeros(L, np.int32)
    sample_pos[li] = pos + 1
    sp = self.sampling
    seeds = np.zeros(L, np.uint32)
    seeds[li] = sp.seed[row]
    sampling = SamplingBatch(*(a[rows_l] for a in sp[:7]), seed=seeds, position=sample_pos,
                             want_logprobs=sp.want_logprobs[rows_l])
    return StepBatch(tok, positions, PagedBatch(slots, kv_lens, page_indices, cu, np.int32(m)),
                     logits_indices, sampling, rows_l, samples, np.zeros((S, self.k), np.int32),
                     np.zeros(S, np.int32), np.zeros(T, np.int32), None, feed, shift)
