"""`jaxinfer bench router` and `router-sim` (jaxinfer/bench/router.py, router_sim.py): the router
benchmark's workload and per-run summary on inputs made by hand, and a small simulation run
end to end (the simulation runs no model)."""

import argparse
import json

import pytest

from jaxinfer import bench
from jaxinfer.bench import router


def test_workload_shares_system_prompts_between_conversations():
  args = argparse.Namespace(systems=2, system_len=6, conversations=5, turns=3, user_len=4)
  convs = router.workload(args, vocab=1000, seed=0)
  assert len(convs) == 5 and all(len(users) == 3 and all(len(u) == 4 for u in users) for _, users in convs)
  assert [c[0] for c in convs] == [convs[0][0], convs[1][0]] * 2 + [convs[0][0]]  # conversation c: system c % 2
  assert convs[0][0] != convs[1][0]
  assert min(min(s) for s, _ in convs) >= 100  # away from the special tokens
  assert router.workload(args, vocab=1000, seed=0) == convs


def test_summarize_pools_a_policys_requests():
  rec = lambda ttft, cached, prefill_cached: dict(ttft=ttft, prompt_tokens=100, cached_tokens=cached,
                                                  prefill_cached_tokens=prefill_cached, output_tokens=10)
  s = router.summarize([rec(0.1, 50, 0), rec(0.3, 0, 20)], seconds=4.0)
  assert (s["requests"], s["ttft_p50_s"], s["output_tokens_per_s"], s["requests_per_s"]) == (2, 0.2, 5.0, 0.5)
  assert (s["cached_fraction"], s["prefill_cached_fraction"]) == (0.25, 0.1)


def test_router_sim_runs_every_policy_and_writes_its_settings(tmp_path, capsys):
  out = tmp_path / "sim.json"
  assert bench.main(["router-sim", "--workers", "2", "--requests", "300", "--policies", "kv,round_robin",
                     "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert result["benchmark"] == "router-sim" and result["command"].startswith("jaxinfer bench router-sim")
  assert [(r["workers"], r["policy"]) for r in result["rows"]] == [(2, "kv"), (2, "round_robin")]
  assert result["settings"]["requests"] == 300 and "command" not in result["settings"]
  assert {"cpu_model", "cpus"} <= set(result["machine"]) and len(result["load_average_before"]) == 3
  with pytest.raises(SystemExit):
    bench.main(["router-sim", "--policies", "kv,fastest"])
  assert "unknown policy 'fastest'" in capsys.readouterr().err
