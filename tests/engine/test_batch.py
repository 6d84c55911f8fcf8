"""engine/batch.py: InputBatch.pack_decodes lays out a decode step exactly as `pack` does,
from rows it keeps across steps (no model)."""

import numpy as np
import pytest

import jax

from jaxinfer.engine.batch import InputBatch, ScheduledSeq, TokenTable, pack
from jaxinfer.sampling import SamplingParams

PS, P, SCRATCH = 4, 10, 9  # page size, pages per sequence, scratch row (rows 0..8 are real)
PARAMS = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, logprobs=2),
          SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.3, presence_penalty=0.5,
                         frequency_penalty=0.25)]


def assert_same_batch(got, want):
  leaves_got, tree_got = jax.tree.flatten(got)
  leaves_want, tree_want = jax.tree.flatten(want)
  assert tree_got == tree_want
  for a, b in zip(leaves_got, leaves_want):
    assert np.asarray(a).dtype == np.asarray(b).dtype
    np.testing.assert_array_equal(a, b)


class Requests:
  """Running decodes, each with its own live page list (as the KV manager keeps one)."""

  def __init__(self, rng):
    self.rng, self.live = rng, {}

  def admit(self, row):
    n = int(self.rng.integers(1, P * PS - 16))  # room for 12 decodes and one token in flight
    ids = self.rng.integers(1, 100, n).tolist()
    pages = self.rng.choice(np.arange(1, 60), -(-(n + 1) // PS), replace=False).tolist()
    # Params drawn, not by row: a request that takes over a row may sample differently.
    self.live[row] = dict(ids=ids, pages=pages, params=PARAMS[int(self.rng.integers(3))], seed=int(self.rng.integers(2**32)))

  def decode(self, row):  # one more known token; pages for it and the one after (in flight)
    r = self.live[row]
    r["ids"].append(int(self.rng.integers(1, 100)))
    if len(r["ids"]) + 1 > len(r["pages"]) * PS:
      r["pages"].append(int(self.rng.integers(60, 90)))

  def seqs(self, rows, fed=()):
    out = []
    for row in rows:
      r = self.live[row]
      feed = row in fed  # async: its newest token is the one in flight
      start = len(r["ids"]) if feed else len(r["ids"]) - 1
      out.append(ScheduledSeq(row=row, token_ids=r["ids"], start=start, num_new=1, pages=r["pages"],
                              params=r["params"], seed=r["seed"], feed=feed))
    return out


@pytest.mark.parametrize("k", [0, 2])
def test_pack_decodes_equals_pack_over_steps_with_rows_growing_and_changing_hands(k):
  rng = np.random.default_rng(k)
  reqs = Requests(rng)
  ib = InputBatch(SCRATCH, P, PS, k)
  for row in range(6):
    reqs.admit(row)
  for step in range(12):
    if step in (4, 8):  # a request ends; another takes its row (a fresh page list)
      reqs.admit(int(rng.integers(0, 6)))
    rows = rng.permutation(6)[:int(rng.integers(1, 7))].tolist()
    fed = set(rng.choice(rows, int(rng.integers(0, len(rows) + 1)), replace=False).tolist())
    seqs = reqs.seqs(rows, fed)
    T, S = 8, 8
    got = ib.pack_decodes(seqs, T, S)
    assert got is not None
    assert_same_batch(got, pack(seqs, T, S, k, P, PS, SCRATCH, vocab_size=64))
    for row in rows:
      reqs.decode(row)


def test_pack_decodes_leaves_other_steps_to_pack():
  rng = np.random.default_rng(0)
  reqs = Requests(rng)
  ib = InputBatch(SCRATCH, P, PS, 2)
  reqs.admit(0)
  reqs.admit(1)
  decode, other = reqs.seqs([0, 1])
  ids = reqs.live[1]["ids"]
  chunk = ScheduledSeq(row=1, token_ids=ids, start=len(ids) - 3, num_new=1, pages=reqs.live[1]["pages"],
                       params=PARAMS[1], seed=1)  # the last token of a chunk that stops short
  drafts = ScheduledSeq(row=1, token_ids=ids, start=len(ids) - 1, num_new=3, pages=reqs.live[1]["pages"],
                        params=PARAMS[1], seed=1, draft_ids=[5, 6])
  lp = ScheduledSeq(row=1, token_ids=ids, start=len(ids) - 1, num_new=1, pages=reqs.live[1]["pages"],
                    params=PARAMS[1], seed=1, want_prompt_logprobs=True)
  for s in (chunk, drafts, lp):
    assert ib.pack_decodes([decode, s], 8, 8) is None
  assert ib.pack_decodes([decode, other], 8, 8) is not None
  with pytest.raises(ValueError, match="2 sequences do not fit the 2-token bucket"):
    ib.pack_decodes([decode, other], 2, 1)


def test_a_token_table_row_follows_its_list_whole_on_a_change_of_hands_else_by_its_tail():
  table = TokenTable(num_rows=3, width=6)
  a, b = [7, 8, 9], [1, 2]
  table.sync(1, a)
  assert table.ids[1, :3].tolist() == [7, 8, 9]
  a[0] = 70  # (lists only grow; this shows what a sync copies)
  a.append(10)
  table.sync(1, a)
  assert table.ids[1, :4].tolist() == [7, 8, 9, 10]  # the tail only
  table.sync(1, b)  # another list takes the row: copied whole
  assert table.ids[1, :2].tolist() == [1, 2]
  table.sync(1, a)
  assert table.ids[1, :4].tolist() == [70, 8, 9, 10]
  with pytest.raises(ValueError, match="7 tokens exceed the token table's 6 per row"):
    table.sync(2, list(range(7)))


def test_pack_reads_the_same_tokens_from_a_kept_table_over_prefill_chunks_drafts_and_fed_steps():
  """A table kept across steps (the runner's: rows synced by their lists' tails, rows
  changing hands) gives the batch a fresh one gives, field for field."""
  rng = np.random.default_rng(3)
  k, T, S = 2, 32, 8
  kept = TokenTable(SCRATCH + 1, P * PS + 1)
  kept.ids[:] = 999  # what earlier requests left in the rows: nothing past a list's end is read
  live = {}
  for step in range(16):
    for row in range(5):
      if row not in live or rng.random() < 0.1:  # a (new) request on the row, its prompt to prefill
        n = int(rng.integers(2, 20))
        live[row] = dict(ids=rng.integers(1, 100, n).tolist(), computed=0, params=PARAMS[int(rng.integers(3))])
    seqs = []
    for row in rng.permutation(5)[:int(rng.integers(1, 6))].tolist():
      r = live[row]
      ids, c = r["ids"], r["computed"]
      pages = list(range(1 + row * P, 1 + row * P + -(-(len(ids) + k + 1) // PS)))
      if c + 1 < len(ids):  # a prefill chunk
        num = min(len(ids) - c, int(rng.integers(1, 6)))
        seqs.append(ScheduledSeq(row=row, token_ids=ids, start=c, num_new=num, pages=pages, params=r["params"], seed=row))
        r["computed"] = c + num
      elif rng.random() < 0.3:  # fed its in-flight token, with placeholder drafts
        seqs.append(ScheduledSeq(row=row, token_ids=ids, start=len(ids), num_new=1 + k, pages=pages,
                                 params=r["params"], seed=row, draft_ids=[0] * k, feed=True))
      else:  # the last known token and drafts to verify
        drafts = rng.integers(1, 100, int(rng.integers(0, k + 1))).tolist()
        seqs.append(ScheduledSeq(row=row, token_ids=ids, start=len(ids) - 1, num_new=1 + len(drafts), pages=pages,
                                 params=r["params"], seed=row, draft_ids=drafts))
        ids.append(int(rng.integers(1, 100)))  # what the step commits
        r["computed"] = len(ids) - 1
    got = pack(seqs, T, S, k, P, PS, SCRATCH, 64, kept)
    assert_same_batch(got, pack(seqs, T, S, k, P, PS, SCRATCH, 64))
    want_tokens, want_targets = list_reference(seqs, T)
    assert got.tokens.tolist() == want_tokens and got.targets.tolist() == want_targets


def list_reference(seqs, T):
  """A step's token ids and next-token targets straight from the requests' lists: each
  sequence's committed tokens then its drafts (zeros when fed), and after each token the next
  known one (0 past them), padded to T."""
  tokens, targets = [], []
  for s in seqs:
    ids, c = s.token_ids, s.num_new - len(s.draft_ids)
    tokens += [0] * s.num_new if s.feed else list(ids[s.start:s.start + c]) + list(s.draft_ids)
    targets += [ids[p + 1] if p + 1 < len(ids) and not s.feed else 0 for p in range(s.start, s.start + s.num_new)]
  return tokens + [0] * (T - len(tokens)), targets + [0] * (T - len(targets))


def test_sync_many_scatters_the_rows_one_token_behind_and_counts_only_what_it_wrote():
  table = TokenTable(num_rows=4, width=5)
  a, b, c = [1, 2], [3], [4, 5, 6]
  table.sync_many([0, 1, 2], [a, b, c])  # new lists: copied whole
  a.append(7)  # one behind
  b += [8, 9]  # two behind
  table.sync_many([0, 1, 2], [a, b, c])
  assert table.ids[:3, :3].tolist() == [[1, 2, 7], [3, 8, 9], [4, 5, 6]]
  a.append(10)
  c.append(11)
  b += [12, 13, 14]  # 6 tokens: past the width
  with pytest.raises(ValueError, match="6 tokens exceed the token table's 5 per row"):
    table.sync_many([0, 2, 1], [a, c, b])
  table.ids[[0, 2], [3, 3]] = -1  # (so a row counted as written but not written would show)
  table.sync_many([0, 2], [a, c])  # the raise left rows 0 and 2 behind: written now
  assert table.ids[0, :4].tolist() == [1, 2, 7, 10] and table.ids[2, :4].tolist() == [4, 5, 6, 11]
  full = [1] * 5
  table.sync_many([3], [full])
  full.append(2)  # one behind, and past the width: the same error, not an IndexError
  with pytest.raises(ValueError, match="6 tokens exceed the token table's 5 per row"):
    table.sync_many([3], [full])
