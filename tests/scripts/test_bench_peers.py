"""jaxinfer/bench/peers.py's pure-Python parts: where the peer venvs are, the TTFT prompts
and cases, the worker's TTFT loop and its `serve` protocol. No peer is installed or run here."""

import io
import json
import sys
from pathlib import Path

import pytest

from jaxinfer.bench import _peer_worker as worker
from jaxinfer.bench import harness
from jaxinfer.bench import peers as bench_peers

ROOT = Path(__file__).resolve().parents[2]


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
  info = harness.cpu_info()
  flags = {"amx", "avx512", "avx512_bf16", "avx512_vnni", "avx2"}
  assert set(info) == {"cpu_model", "cpus"} | flags
  assert all(isinstance(info[f], bool) for f in flags)


def test_worker_serve_times_one_generation_per_go_until_stop(monkeypatch, capsys):
  calls = []

  def session(spec):
    def generate(n_new):
      calls.append(n_new)
      return [[7] * n_new for _ in spec["prompts"]], 0.5, 2.0
    return generate, {"precision": "Q4_1", "version": "x"}, lambda: calls.append("closed")

  monkeypatch.setitem(worker.SESSIONS, "llama.cpp", session)
  monkeypatch.setattr(sys, "stdin", io.StringIO("go\ngo\nstop\ngo\n"))
  spec = {"system": "llama.cpp", "dtype": "int4", "prompts": [[5, 6]], "max_new_tokens": 8}
  final = worker.serve(spec)
  lines = [json.loads(l[len(worker.RESULT_PREFIX):]) for l in capsys.readouterr().out.splitlines()]
  assert calls == [4, 8, 8, "closed"]  # a 4-token warm-up, two timed runs, nothing after `stop`
  assert lines[0] == {"ready": True, "precision": "Q4_1", "version": "x"}
  assert lines[1:] == [{"wall_s": 2.0, "ttft_s": 0.5, "generated_tokens": 8, "tokens_per_s": 4.0}] * 2
  assert final["runs"] == 2 and final["done"]


def test_worker_serve_rejects_an_unknown_line(monkeypatch, capsys):
  monkeypatch.setitem(worker.SESSIONS, "llama.cpp",
                      lambda spec: (lambda n: ([[1] * n], 0.1, 0.2), {}, lambda: None))
  monkeypatch.setattr(sys, "stdin", io.StringIO("run\n"))
  with pytest.raises(ValueError, match="expected 'go' or 'stop'"):
    worker.serve({"system": "llama.cpp", "dtype": "int4", "prompts": [[5]], "max_new_tokens": 2})


def test_peer_session_without_llama_cpp_is_not_ready(clean_env, tmp_path, capsys):
  # This environment's own Python has no llama_cpp: the worker answers `unavailable` and the
  # session says so instead of raising (a benchmark then runs on without the peer).
  gguf = tmp_path / "m.Q4_1.gguf"
  gguf.write_bytes(b"GGUF")
  with bench_peers.PeerSession("llama.cpp", "int4", [[5, 6]], 4, timeout_s=120, gguf_path=gguf,
                               peer_python_path=sys.executable) as s:
    assert not s.ready
  assert "llama_cpp not importable" in capsys.readouterr().err
  with pytest.raises(ValueError, match="llama.cpp only"):
    bench_peers.PeerSession("vllm-cpu", "float32", [[5]], 4)
