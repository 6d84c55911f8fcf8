"""scripts/bench_moe.py's jaxinfer side on the tiny Mixtral: the step split's parts at real step
shapes, the per-expert-array grouped matmul it compares against equal to ragged_dot, the
bottleneck it names, and the greedy-agreement and decode-rate arithmetic. (The transformers
side needs the ref venv and a 2 GB model; the full script is run by hand.)"""

import importlib
import sys
from pathlib import Path

import pytest

from conftest import tiny_dir
from jaxinfer import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
bench_moe = importlib.import_module("bench_moe")


@pytest.fixture(scope="module")
def llm():
  return LLM(tiny_dir("mixtral"), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
             max_model_len=64, warmup=False, enable_prefix_caching=False)


def test_split_parts_add_up_and_the_alternative_matches_ragged_dot(llm):
  # The shapes (token buckets 2 and 16) are those of the stream test's prompts: compiled once.
  # The stubbed-experts step (one more compile) for the decode shape only, to keep this quick.
  rows = (bench_moe.time_split(llm, [("decode b=2", 2, 1, 20)], reps=1)
          + bench_moe.time_split(llm, [("prefill 2x5", 2, 5, 0)], reps=1, ablate=False))
  assert [(r["shape"], r["sequences"], r["tokens"]) for r in rows] == [("decode b=2", 2, 2), ("prefill 2x5", 2, 16)]
  # 8 experts top-2: 4 token copies take moe.py's per-copy path, 32 take ragged_dot
  assert [r["uses_ragged_dot"] for r in rows] == [False, True]
  assert rows[0]["parts_ms"]["dispatch"] == 0 < rows[1]["parts_ms"]["dispatch"]
  for r in rows:
    assert set(r["parts_ms"]) == set(bench_moe.SPLIT_PARTS)
    assert all(r["parts_ms"][k] > 0 for k in bench_moe.SPLIT_PARTS if k not in ("rest", "dispatch"))
    assert sum(r["parts_ms"].values()) == pytest.approx(r["step_ms"])
    assert r["share"]["attention"] == pytest.approx(r["parts_ms"]["attention"] / r["step_ms"])
    # 2 MoE layers: a part of the split is layer 0's time twice
    assert r["parts_ms"]["grouped_matmul"] == pytest.approx(2 * r["per_layer_ms"]["grouped_matmul"])
    assert r["grouped_matmul_alternative"]["max_abs_diff_vs_ragged_dot"] < 1e-5
    assert r["routed_experts_ms_per_layer"] > 0
    neck = bench_moe.bottleneck(r)
    assert neck["part"] == max((k for k in bench_moe.SPLIT_PARTS if k != "rest"), key=r["parts_ms"].get)
    assert neck["text"].startswith(("ragged_dot on XLA:CPU is", "the routed experts' matmuls",
                                    f"{bench_moe.PART_NAMES[neck['part']]} on"))
  in_step = rows[0]["experts_in_step"]
  assert in_step["experts_ms"] == pytest.approx(rows[0]["step_ms"] - in_step["step_without_experts_ms"])
  assert rows[1]["experts_in_step"] is None
  # per layer: the router's dot, and the per-copy path's four (gate, up, down, combine) stubbed out
  assert in_step["dots_in_step"] - in_step["dots_without_experts"] == 2 * 4


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
