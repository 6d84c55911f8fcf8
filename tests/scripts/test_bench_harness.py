"""jaxinfer/bench/harness.py: what every `jaxinfer bench` result carries, and the workload."""

import json

import pytest

from jaxinfer.bench import harness


def test_write_results_adds_the_environment_and_keeps_the_payload(tmp_path):
  env = harness.environment("jaxinfer bench spec --ks 1")
  path = harness.write_results("spec", {"rows": [{"k": 1}], "commit": "from the payload"}, tmp_path / "r.json",
                               env=env)
  r = json.loads(path.read_text())
  assert list(r)[:7] == ["benchmark", "date", "commit", "command", "machine", "load_average_before", "rows"]
  assert r["benchmark"] == "spec" and r["command"] == "jaxinfer bench spec --ks 1"
  assert r["commit"] == "from the payload"  # a field the payload sets itself wins
  assert r["rows"] == [{"k": 1}] and len(r["load_average_after"]) == 3
  assert {"cpu_model", "cpus", "avx2", "avx512", "amx", "platform", "python"} <= set(r["machine"])
  assert r["date"].endswith("+00:00")  # UTC, to the second


def test_default_results_path_is_the_benchmark_and_today(monkeypatch, tmp_path):
  monkeypatch.setattr(harness, "RESULTS", tmp_path)
  import datetime
  assert harness.results_path("kv-cache") == tmp_path / f"kv-cache-{datetime.date.today().isoformat()}.json"
  assert harness.results_path("kv-cache", "x/y.json") == harness.Path("x/y.json")


def test_workload_label_and_prompts_past_the_question_list():
  w = harness.Workload(num_prompts=18, max_tokens=128)
  assert w.label == "18 prompts x 128"
  qs = harness.chat_questions(18)
  assert qs[:16] == list(harness.QUESTIONS) and len(set(qs)) == 18
  assert qs[16] == f"{harness.QUESTIONS[0]} (variant 1)"
  with pytest.raises(ValueError, match="num_prompts >= 1"):
    harness.Workload(num_prompts=0, max_tokens=8)


def test_a_run_through_the_cli_records_the_command_a_user_types():
  assert harness.command_line(["offline", "--peers", "none"]) == "jaxinfer bench offline --peers none"
  assert harness.subcommand_argv("profile")[1:] == ["-m", "jaxinfer", "bench", "profile"]
