"""runner.pack: the host side of the step, to exact arrays (no model)."""

import numpy as np
import pytest

from jaxinfer.engine.runner import ScheduledSeq, pack
from jaxinfer.sampling import SamplingParams


def test_pack_lays_out_a_prefill_chunk_a_decode_and_a_verification():
  greedy = SamplingParams(temperature=0)
  hot = SamplingParams(temperature=0.5, top_k=7, logprobs=3)
  seqs = [
      # a prefill chunk: tokens 2..4 of 6 known (no sampling this step)
      ScheduledSeq(row=5, token_ids=[10, 11, 12, 13, 14, 15], start=2, num_new=3, pages=[7, 3],
                   params=greedy, seed=1),
      # a decode: its newest token at position 4
      ScheduledSeq(row=0, token_ids=[20, 21, 22, 23, 24], start=4, num_new=1, pages=[9, 8], params=hot,
                   seed=2),
      # a verification: newest token 32 at position 2, then drafts 40, 41
      ScheduledSeq(row=3, token_ids=[30, 31, 32], start=2, num_new=3, pages=[4, 6], params=hot, seed=3,
                   draft_ids=[40, 41]),
  ]
  b = pack(seqs, T=8, S=4, k=2, pages_per_seq=3, page_size=4, scratch_row=9, vocab_size=64)
  np.testing.assert_array_equal(b.tokens, [12, 13, 14, 24, 32, 40, 41, 0])
  np.testing.assert_array_equal(b.positions, [2, 3, 4, 4, 2, 3, 4, 0])
  # each row's next known token (0 past the known ones): prompt logprobs and an MTP module read it
  np.testing.assert_array_equal(b.targets, [13, 14, 15, 0, 0, 0, 0, 0])
  # slot = page * page_size + offset; padding writes go to page 0
  np.testing.assert_array_equal(b.paged.slot_mapping, [7 * 4 + 2, 7 * 4 + 3, 3 * 4 + 0, 8 * 4 + 0,
                                                       4 * 4 + 2, 4 * 4 + 3, 6 * 4 + 0, 0])
  np.testing.assert_array_equal(b.paged.cu_q_lens, [0, 3, 4, 7, 7])
  np.testing.assert_array_equal(b.paged.kv_lens, [5, 5, 5, 0])
  np.testing.assert_array_equal(b.paged.page_indices, [[7, 3, 0], [9, 8, 0], [4, 6, 0], [0, 0, 0]])
  assert int(b.paged.num_seqs) == 3
  # k + 1 = 3 logits rows per sequence: the chunk's and the decode's last token, all 3 verify rows
  np.testing.assert_array_equal(b.logits_indices, [2, 0, 0, 3, 0, 0, 4, 5, 6, 0, 0, 0])
  np.testing.assert_array_equal(b.rows, [5, 9, 9, 0, 9, 9, 3, 3, 3, 9, 9, 9])
  np.testing.assert_array_equal(b.sampling.position, [5, 0, 0, 5, 0, 0, 3, 4, 5, 0, 0, 0])
  np.testing.assert_array_equal(b.sampling.seed, [1, 0, 0, 2, 0, 0, 3, 3, 3, 0, 0, 0])
  np.testing.assert_array_equal(b.sampling.top_k, [0, 0, 0, 7, 0, 0, 7, 7, 7, 0, 0, 0])
  np.testing.assert_array_equal(b.sampling.want_logprobs, [0, 0, 0, 1, 0, 0, 1, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(b.samples, [False, True, True, False])
  np.testing.assert_array_equal(b.draft_ids, [[0, 0], [0, 0], [40, 41], [0, 0]])
  np.testing.assert_array_equal(b.num_drafts, [0, 0, 2, 0])


def test_pack_refuses_what_does_not_fit():
  s = ScheduledSeq(row=0, token_ids=[1, 2], start=1, num_new=3, pages=[1], params=SamplingParams(),
                   seed=0, draft_ids=[5, 6])
  with pytest.raises(ValueError, match="2 drafts exceed the step's 1 speculative tokens"):
    pack([s], T=4, S=1, k=1, pages_per_seq=1, page_size=4, scratch_row=1, vocab_size=64)
  with pytest.raises(ValueError, match="2 sequences do not fit the 4-token bucket"):
    pack([s, s], T=4, S=1, k=2, pages_per_seq=1, page_size=4, scratch_row=1, vocab_size=64)


def control_flow(jaxpr) -> list[str]:
  """The cond / while primitives of a closed jaxpr and every sub-jaxpr outside a kernel
  (pallas_call): what would make XLA:GPU copy a predicate to the host and wait."""
  import jax.extend as jex
  found = []

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name in ("cond", "while"):
        found.append(eqn.primitive.name)
      if eqn.primitive.name == "pallas_call":
        continue
      for v in eqn.params.values():
        for sub in (v if isinstance(v, (tuple, list)) else (v,)):
          if isinstance(sub, jex.core.ClosedJaxpr):
            walk(sub.jaxpr)
          elif isinstance(sub, jex.core.Jaxpr):
            walk(sub)

  walk(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr)
  return found


@pytest.fixture(scope="module")
def kernel_runner():
  from conftest import tiny_dir
  from jaxinfer import LLM
  return LLM(tiny_dir("llama3"), attention_impl="pallas_interpret", max_num_seqs=4, max_num_batched_tokens=16,
             warmup=False).runner


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, seed=3),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=5),
    SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=2),
], ids=["greedy", "sampled", "truncated", "penalized"])
def test_a_gpu_step_has_no_data_dependent_control_flow(kernel_runner, params):
  """A mixed step (a prefill chunk and a decode) as a GPU runs it (the Pallas attention, the
  sampler with rows_at_once) traces to programs with no cond and no while outside the kernel:
  the host picked every program from the batch, so launching never waits for the device.
  (Break it: a lax.cond back in sample() or an any()-guarded branch fails this.)"""
  seqs = [ScheduledSeq(row=0, token_ids=list(range(1, 12)), start=0, num_new=8, pages=[1, 2, 3], params=params,
                       seed=1),
          ScheduledSeq(row=1, token_ids=[5, 6, 7], start=2, num_new=1, pages=[4], params=params, seed=2)]
  programs = kernel_runner.trace_step(seqs, rows_at_once=True)
  assert set(programs) == {"forward", "sample"}
  for name, jaxpr in programs.items():
    assert control_flow(jaxpr) == [], name


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=5)],
                         ids=["greedy", "sampled"])
def test_a_gpu_verify_step_has_no_data_dependent_control_flow(params):
  """The same for a step that verifies drafts (k = 2: a decode row with two n-gram drafts
  beside a prefill chunk): the accept path, fused or general, branches on nothing either."""
  from conftest import tiny_dir
  from jaxinfer import LLM
  runner = LLM(tiny_dir("llama3"), attention_impl="pallas_interpret", max_num_seqs=4, max_num_batched_tokens=16,
               speculative={"method": "ngram", "num_speculative_tokens": 2}, warmup=False).runner
  seqs = [ScheduledSeq(row=0, token_ids=list(range(1, 12)), start=0, num_new=8, pages=[1, 2, 3], params=params,
                       seed=1),
          ScheduledSeq(row=1, token_ids=[5, 6, 7], start=2, num_new=3, pages=[4, 5], params=params, seed=2,
                       draft_ids=[8, 9])]
  programs = runner.trace_step(seqs, rows_at_once=True)
  assert set(programs) == {"forward", "sample"}
  for name, jaxpr in programs.items():
    assert control_flow(jaxpr) == [], name


def test_freeze_heap_skips_the_live_heap_and_frees_what_died_since_the_last_freeze():
  """Warm-up ends with freeze_heap: a full collection then skips what start-up left alive,
  and a later freeze thaws and collects what died meanwhile (an earlier engine in a cycle)."""
  import gc
  import weakref

  from jaxinfer.engine.runner import freeze_heap

  class Node:
    pass

  a = Node()
  a.self = a  # a cycle: only the cyclic collector frees it
  alive = weakref.ref(a)
  try:
    freeze_heap()
    del a
    gc.collect()
    assert alive() is not None  # frozen: a full collection skipped it
    freeze_heap()
    assert alive() is None  # thawed, then collected
  finally:
    gc.unfreeze()
