"""`jaxinfer bench adp-sim` at a toy size: the windows' and the time to first token's
arithmetic on a hand-made step matrix, and a seeded 40-request trace on 4 ranks where the old
rule's first step gives one rank 906 tokens, the split budget caps it at its 512-token share,
and the hold cuts every rank to the 176 the least busy one runs."""

import json

import pytest

from jaxinfer.bench import adp_sim as simulate_adp
from jaxinfer.bench import main as bench



def test_windows_take_max_over_mean_per_step():
  tokens = [[4, 4, 4, 4], [8, 0, 0, 0], [0, 0, 0, 0], [6, 2, 2, 2]]
  s = simulate_adp.summarize(tokens, saturated=[True, False, False, False], last_arrival=1)
  assert s["saturated"] == {"steps": 1, "mean": 1.0, "p50": 1.0, "p95": 1.0, "step_weighted": 1.0}
  assert s["arrivals"]["steps"] == 2 and s["arrivals"]["mean"] == 2.5  # ratios 1 and 4
  assert s["arrivals"]["step_weighted"] == 2.0  # (4 + 8) / (4 + 2)
  assert s["all"]["steps"] == 3 and s["all"]["mean"] == pytest.approx(7 / 3, abs=1e-4)  # the idle step is left out
  assert s["all"]["step_weighted"] == 2.0  # (4 + 8 + 6) / (4 + 2 + 3)
  assert (s["total_steps"], s["tokens"], s["padded_tokens"]) == (4, 36, 4 * (4 + 8 + 0 + 6))
  # Arrived at step 0, first token at step 1; at 1, first token at 3: 2 and 3 steps, and the
  # busiest rank's tokens over those steps 4 + 8 and 8 + 0 + 6.
  s = simulate_adp.summarize(tokens, [False] * 4, 1, first_tokens=[(0, 1), (1, 3)])
  assert s["ttft_steps"] == {"p50": 2.5, "p99": 2.99, "max": 3, "mean": 2.5}
  assert s["ttft_busiest_tokens"] == {"p50": 13.0, "p99": 13.98, "max": 14}


def test_a_seeded_trace_balances_and_is_recorded(tmp_path):
  out = tmp_path / "adp.json"
  assert bench(["adp-sim", "--requests", "40", "--loads", "1.5", "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert result["commit"] and result["machine"]["cpu_model"] and len(result["load_average_before"]) == 3
  (run,) = result["runs"]
  old, balanced, held = (run["policies"][p] for p in ("least_loaded", "balanced", "held"))
  assert old["first_steps_rank_tokens"][0] == [191, 176, 326, 906]  # one budget: rank 3 takes 906 of 2048
  assert balanced["first_steps_rank_tokens"][:2] == [[191, 176, 326, 512], [512] * 4]
  assert old["summary"]["saturated"]["mean"] == 2.2966
  assert balanced["summary"]["saturated"] == {"steps": 7, "mean": 1.0, "p50": 1.0, "p95": 1.0, "step_weighted": 1.0}
  # The hold: every rank at the least busy one's 176 tokens in the first step (the 1,205
  # planned were all prefill), no request held past the timeout, less padded work.
  assert held["first_steps_rank_tokens"][:2] == [[176] * 4, [512] * 4] and held["max_held_steps"] == 4
  assert held["summary"]["arrivals"]["step_weighted"] == 1.0 and balanced["summary"]["arrivals"]["step_weighted"] == 1.0542
  assert (held["summary"]["padded_tokens"], balanced["summary"]["padded_tokens"]) == (26896, 28400)
  assert [(r["policy"], r["saturated_max_over_mean"]) for r in result["rows"]] == [
      ("least_loaded", 2.2966), ("split", 1.0), ("balanced", 1.0), ("held", 1.0)]
  assert [r["ttft_steps_p99"] for r in result["rows"]] == [4.0, 5.0, 5.0, 9.22]
  assert out.with_suffix(".png").stat().st_size > 10_000
