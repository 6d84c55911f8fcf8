"""scripts/bench_peers.py's pure-Python parts: where the peer venvs are, the TTFT prompts
and cases, and the worker's TTFT loop. No peer is installed or run here."""

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
bench_peers = importlib.import_module("bench_peers")
worker = importlib.import_module("_peer_worker")


@pytest.fixture
def clean_env(monkeypatch):
  for var in ("JAXINFER_PEERS_ENV", "JAXINFER_PEER_PYTHON", "JAXINFER_REF_PYTHON"):
    monkeypatch.delenv(var, raising=False)
  return monkeypatch


def test_default_interpreters_are_the_setup_script_venvs(clean_env):
  assert bench_peers.peer_python() == str(ROOT / ".peers" / "peer" / "bin" / "python")
  assert bench_peers.ref_python() == str(ROOT / ".peers" / "ref" / "bin" / "python")


def test_interpreter_overrides(clean_env, tmp_path):
  clean_env.setenv("JAXINFER_PEERS_ENV", str(tmp_path))
  assert bench_peers.peer_python() == str(tmp_path / "peer" / "bin" / "python")
  assert bench_peers.ref_python() == str(tmp_path / "ref" / "bin" / "python")
  clean_env.setenv("JAXINFER_PEER_PYTHON", "/x/py")
  clean_env.setenv("JAXINFER_REF_PYTHON", "/y/py")
  assert bench_peers.peer_python() == "/x/py"
  assert bench_peers.ref_python() == "/y/py"
  assert bench_peers.peer_python("/z/py") == "/z/py"


def test_setup_script_and_bench_peers_agree_on_the_venv_names():
  script = (ROOT / "scripts" / "setup_peers.sh").read_text()
  assert "PEER=$ENV_DIR/peer" in script and "REF=$ENV_DIR/ref" in script
  assert "${JAXINFER_PEERS_ENV:-$ROOT/.peers}" in script


def test_ttft_prompts_are_deterministic_distinct_and_avoid_special_ids():
  a = bench_peers.ttft_prompts(64, 3)
  assert a == bench_peers.ttft_prompts(64, 3)
  assert len(a) == 3 and all(len(p) == 64 for p in a)
  assert len({tuple(p) for p in a}) == 3
  assert min(min(p) for p in a) >= 17
  assert bench_peers.ttft_prompts(64, 3, seed=1) != a
  warm = bench_peers.ttft_warmup_prompt(64)
  assert len(warm) == 64 and warm not in a


def test_ttft_cases_group_by_length_with_a_warmup_each():
  ps = bench_peers.ttft_prompts(8, 2) + bench_peers.ttft_prompts(16, 2)
  cases = bench_peers.ttft_cases(ps)
  assert [len(c["warmup"]) for c in cases] == [8, 16]
  assert [c["prompts"] for c in cases] == [ps[:2], ps[2:]]
  assert cases[0]["warmup"] == bench_peers.ttft_warmup_prompt(8)


def test_ttft_cases_flat_prompt_is_timed_repeats_times():
  cases = bench_peers.ttft_cases((5, 6, 7), repeats=4, warmup_token_ids=[1, 2, 3])
  assert cases == [{"warmup": [1, 2, 3], "prompts": [[5, 6, 7]] * 4}]


def test_ttft_cases_rejects_bad_input():
  with pytest.raises(ValueError):
    bench_peers.ttft_cases([])
  with pytest.raises(ValueError):
    bench_peers.ttft_cases([[1, 2], []])
  with pytest.raises(ValueError):
    bench_peers.ttft_cases([[1, 2], [1, 2, 3]], warmup_token_ids=[4, 5])
  with pytest.raises(ValueError):
    bench_peers.ttft_cases([1, 2], repeats=0)


def test_run_peer_ttft_without_a_venv_returns_none(clean_env, tmp_path, capsys):
  clean_env.setenv("JAXINFER_PEERS_ENV", str(tmp_path))
  assert bench_peers.run_peer_ttft("llama.cpp", "float32", [20] * 8) is None
  assert "setup_peers.sh" in capsys.readouterr().err
  with pytest.raises(ValueError):
    bench_peers.run_peer_ttft("nope", "float32", [20] * 8)


def test_worker_ttft_loop_warms_up_first_and_takes_the_median():
  seen = []
  times = iter([9.0, 3.0, 1.0, 2.0])

  def first_token(p):
    seen.append(p)
    return len(seen), next(times)

  spec = {"cases": [{"warmup": [1, 1], "prompts": [[2, 2], [3, 3], [4, 4]]}]}
  mem = worker.Memory(period_s=60).start()
  [case] = worker._ttft_cases(spec, first_token, mem)
  mem.stop()
  assert seen == [[1, 1], [2, 2], [3, 3], [4, 4]]
  assert case == {"prompt_len": 2, "ttft_s": 2.0, "ttft_runs_s": [3.0, 1.0, 2.0],
                  "warmup_s": 9.0, "first_tokens": [2, 3, 4]}
  json.dumps(case)  # goes back to bench_peers as one JSON line


def test_cpu_info_has_the_fields_results_carry():
  info = bench_peers.cpu_info()
  flags = {"amx", "avx512", "avx512_bf16", "avx512_vnni", "avx2"}
  assert set(info) == {"cpu_model", "cpus"} | flags
  assert all(isinstance(info[f], bool) for f in flags)
