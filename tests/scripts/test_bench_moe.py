"""scripts/bench_moe.py's jaxinfer side on the tiny Mixtral: the step split's arithmetic at real step
shapes (timings set by hand), the per-expert-array grouped matmul it compares against equal to ragged_dot, the
bottleneck it names, and the greedy-agreement and decode-rate arithmetic. (The transformers
side needs the ref venv and a 2 GB model; the full script is run by hand.)"""

from pathlib import Path

import pytest

from conftest import tiny_dir
from helpers import load_script
from jaxinfer import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
bench_moe = load_script("bench_moe")


@pytest.fixture(scope="module")
def llm():
  return LLM(tiny_dir("mixtral"), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
             max_model_len=64, warmup=False, enable_prefix_caching=False)


# Seconds the stubbed timer reports for each timed callable: the decode shape takes moe.py's
# per-copy path (no dispatch / grouped_matmul of its own), the prefill shape ragged_dot.
DECODE_S = dict(step=0.100, router=0.001, experts=0.020, attention=0.003, lm_head=0.005, alternative=0.004,
                step_without_experts=0.070)
PREFILL_S = dict(step=0.050, router=0.001, experts=0.006, attention=0.010, lm_head=0.002, alternative=0.003,
                 dispatch=0.002, grouped_matmul=0.004)


def test_the_split_of_hand_made_timings_and_the_bottleneck_it_names(llm, monkeypatch):
  """time_split's arithmetic on timings set by hand (each timed callable still runs once, at
  the step's shapes): per layer x the layers that have the part (2 MoE layers, 2 attention
  layers), the LM head once, rest = step - parts, shares of the step; then the bottleneck.
  The shapes (token buckets 2 and 16) are the stream test's prompts': compiled once."""
  import jax

  def interleaved(fns, reps):
    for fn in fns.values():
      jax.block_until_ready(fn())
    table = PREFILL_S if "dispatch" in fns else DECODE_S
    assert set(fns) == set(table)
    return {k: table[k] for k in fns}

  monkeypatch.setattr(bench_moe, "interleaved", interleaved)
  decode, prefill = (bench_moe.time_split(llm, [("decode b=2", 2, 1, 20)], reps=1)
                     + bench_moe.time_split(llm, [("prefill 2x5", 2, 5, 0)], reps=1, ablate=False))
  assert [(r["shape"], r["sequences"], r["tokens"]) for r in (decode, prefill)] == [("decode b=2", 2, 2),
                                                                                    ("prefill 2x5", 2, 16)]
  # 8 experts top-2: 4 token copies take moe.py's per-copy path, 32 take ragged_dot
  assert [r["uses_ragged_dot"] for r in (decode, prefill)] == [False, True]
  approx = lambda d: pytest.approx(d, rel=1e-12)
  # decode: the routed experts (20 ms per layer) are the whole matmul part; no dispatch
  assert decode["per_layer_ms"] == approx(dict(router=1, dispatch=0, grouped_matmul=20, attention=3))
  assert decode["parts_ms"] == approx(dict(router=2, dispatch=0, grouped_matmul=40, attention=6, lm_head=5,
                                           rest=47))
  assert decode["share"] == approx(dict(router=0.02, dispatch=0, grouped_matmul=0.4, attention=0.06, lm_head=0.05,
                                        rest=0.47))
  assert (decode["step_ms"], decode["routed_experts_ms_per_layer"]) == approx((100, 20))
  assert decode["grouped_matmul_alternative"]["per_layer_ms"] == approx(4)
  in_step = decode["experts_in_step"]
  assert {k: in_step[k] for k in ("step_without_experts_ms", "experts_ms", "experts_share")} == approx(
      dict(step_without_experts_ms=70, experts_ms=30, experts_share=0.3))
  # per layer: the router's dot, and the per-copy path's four (gate, up, down, combine) stubbed out
  assert in_step["dots_in_step"] - in_step["dots_without_experts"] == 2 * 4
  assert bench_moe.bottleneck(decode)["text"] == (
      "the routed experts' matmuls (moe.py's non-ragged path) on XLA:CPU is 30% of the decode b=2 step "
      "(step 100 ms, 70 ms with the routed experts stubbed out; timed alone 40 ms); per layer 20.0 ms, vs "
      "4.0 ms for a masked matmul per expert over per-expert weight arrays")
  # prefill: ragged_dot's dispatch and grouped matmul timed apart; attention is the largest part
  assert prefill["experts_in_step"] is None
  assert prefill["parts_ms"] == approx(dict(router=2, dispatch=4, grouped_matmul=8, attention=20, lm_head=2,
                                            rest=14))
  assert prefill["share"]["attention"] == approx(0.4)
  neck = bench_moe.bottleneck(prefill)
  assert (neck["part"], neck["text"]) == ("attention", "attention on XLA:CPU is 40% of the prefill 2x5 step "
                                                       "(20 of 50 ms, timed alone)")
  # The per-expert-array alternative computes what ragged_dot computes.
  for r in (decode, prefill):
    assert r["grouped_matmul_alternative"]["max_abs_diff_vs_ragged_dot"] < 1e-5


def test_rest_is_not_a_bottleneck_candidate():
  row = dict(shape="decode b=1", step_ms=100.0, per_layer_ms={}, uses_ragged_dot=True,
             parts_ms=dict(router=1.0, dispatch=2.0, grouped_matmul=3.0, attention=10.0, lm_head=4.0, rest=80.0),
             share=dict(router=0.01, dispatch=0.02, grouped_matmul=0.03, attention=0.1, lm_head=0.04, rest=0.8))
  assert bench_moe.bottleneck(row)["text"] == "attention on XLA:CPU is 10% of the decode b=1 step (10 of 100 ms, timed alone)"
  assert bench_moe.bottleneck(row, "XLA:GPU")["part"] == "attention"


def test_bottleneck_text_names_ragged_dot_with_its_share():
  row = dict(shape="decode b=16", step_ms=200.0, per_layer_ms={"grouped_matmul": 45.0}, uses_ragged_dot=True,
             parts_ms=dict(router=1.0, dispatch=2.0, grouped_matmul=180.0, attention=10.0, lm_head=3.0, rest=4.0),
             share=dict(router=0.005, dispatch=0.01, grouped_matmul=0.9, attention=0.05, lm_head=0.015, rest=0.02),
             grouped_matmul_alternative={"per_layer_ms": 3.5})
  assert bench_moe.bottleneck(row)["text"] == (
      "ragged_dot on XLA:CPU is 90% of the decode b=16 step (180 of 200 ms, timed alone); per layer 45.0 ms, "
      "vs 3.5 ms for a masked matmul per expert over per-expert weight arrays")
  row["experts_in_step"] = {"step_without_experts_ms": 40.0, "experts_ms": 160.0, "experts_share": 0.8}
  assert bench_moe.bottleneck(row)["text"].startswith(
      "ragged_dot on XLA:CPU is 80% of the decode b=16 step (step 200 ms, 40 ms with the routed experts "
      "stubbed out; timed alone 180 ms); per layer 45.0 ms")
  row["uses_ragged_dot"] = False
  assert bench_moe.bottleneck(row)["text"].startswith(
      "the routed experts' matmuls (moe.py's non-ragged path) on XLA:CPU is 80% of the decode b=16 step")


def test_stream_ids_are_the_greedy_ids(llm):
  ps = bench_moe.prompts(2, 5, 300, seed=3)
  ids, first, wall = bench_moe.jaxinfer_generate(llm, ps, 4)
  sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
  assert ids == [o.token_ids for o in llm.generate(ps, sp)]
  assert 0 < first <= wall


def test_agreement_and_decode_rate():
  a = bench_moe.agreement([[1, 2, 3], [4, 5, 6], [7]], [[1, 2, 3], [4, 9, 6], [8]])
  assert a == {"identical": 1, "sequences": 3, "common_prefix": [3, 1, 0], "tokens_agreeing": 4, "tokens": 7}
  assert bench_moe.decode_rate(16, 8, 2.0, 9.0) == pytest.approx(16 * 7 / 7.0)
