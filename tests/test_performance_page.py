"""docs/performance.md is generated from benchmarks/results/*.json by
scripts/render_performance.py; these tests fail when the page is stale against the results, and
pin what the renderer does with runs, machines and files it cannot read."""

import json
import subprocess
import sys
from pathlib import Path

from helpers import load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "render_performance.py"
render_performance = load_script("render_performance")


def test_the_committed_page_equals_a_fresh_render_of_the_results():
  fresh = render_performance.render(REPO / "benchmarks" / "results")
  committed = (REPO / "docs" / "performance.md").read_text()
  assert committed == fresh, ("docs/performance.md is stale against benchmarks/results/: "
                              "run python scripts/render_performance.py and commit the page")


def test_check_mode_exits_1_on_a_stale_page_and_0_on_a_fresh_one(tmp_path):
  results = tmp_path / "results"
  results.mkdir()
  (results / "spec-2026-01-02.json").write_text(json.dumps(
      {"benchmark": "spec", "commit": "abc1234", "command": "python scripts/bench_spec.py", "rows": [
          {"method": "none", "tokens_per_s": 10.0, "speedup": 1.0}]}))
  page = tmp_path / "performance.md"
  page.write_text("# Performance\n\nhand-written\n")
  run = lambda: subprocess.run([sys.executable, str(SCRIPT), "--results", str(results), "--out", str(page),
                                "--check"], capture_output=True, text=True, timeout=60)
  stale = run()
  assert stale.returncode == 1 and "stale" in stale.stderr
  assert render_performance.main(["--results", str(results), "--out", str(page)]) == 0
  assert run().returncode == 0


def _write(folder: Path, name: str, data) -> None:
  (folder / name).write_text(data if isinstance(data, str) else json.dumps(data))


def test_latest_run_per_machine_class_with_its_commit_command_link_and_ratios(tmp_path):
  epyc = {"cpu_model": "AMD EPYC", "cpus": 2, "avx512": True, "avx512_vnni": True, "avx512_bf16": True}
  row = lambda tps, ratio: {"system": "jaxinfer", "tokens_per_s": tps, "ratio_to_float32": ratio}
  _write(tmp_path, "offline-quant-2026-11-27-a.json", {"date": "2026-11-27T10:00:00", "commit": "aaaaaaa",
                                                       "machine": epyc, "command": "bench a", "rows": [row(1.5, 1.1)]})
  # Named before -a but run later: the timestamp, not the name, makes it the latest.
  _write(tmp_path, "offline-quant-2026-11-27-0.json", {"date": "2026-11-27T11:00:00", "commit": "bbbbbbb",
                                                       "machine": epyc, "command": "bench b", "rows": [row(2.5, 1.3)]})
  _write(tmp_path, "offline-quant-2026-11-28.json", {"date": "2026-11-28", "commit": "ccccccc",
                                                     "device": "NVIDIA H200", "rows": [row(99.0, 2.0)]})
  _write(tmp_path, "broken-2026-11-28.json", "{not json")
  _write(tmp_path, "list-2026-11-28.json", [1, 2])
  page = render_performance.render(tmp_path)

  cpu = page.split("### AMD EPYC, 2 cores, AVX-512 VNNI BF16: jaxinfer\n", 1)[1].split("###", 1)[0]
  assert "[`offline-quant-2026-11-27-0.json`](results/offline-quant-2026-11-27-0.json)" in cpu
  assert "commit `bbbbbbb`, 2026-11-27" in cpu and "command: `bench b`" in cpu
  assert "| system | tokens_per_s | ratio_to_float32 |" in cpu and "| jaxinfer | 2.5 | 1.3 |" in cpu
  assert "older runs of it on this machine class: [`offline-quant-2026-11-27-a.json`]" in cpu
  assert "| jaxinfer | 1.5 | 1.1 |" not in page  # an older run is linked, not tabled
  gpu = page.split("### NVIDIA H200: jaxinfer\n", 1)[1]
  assert "commit `ccccccc`, 2026-11-28" in gpu and "command: `not recorded in the JSON`" in gpu
  skipped = page.split("## Skipped files", 1)[1]
  assert "`broken-2026-11-28.json`: not readable JSON" in skipped
  assert "`list-2026-11-28.json`: a JSON list, not an object" in skipped


def test_runs_of_other_workloads_or_systems_are_not_hidden_as_older(tmp_path):
  # bench_offline's batch-1 run against llama.cpp, then a later 64-prompt run of jaxinfer alone:
  # both are the latest of their kind, so both get a table.
  cpu = {"cpu_model": "AMD EPYC", "cpus": 2, "avx2": True}
  peer_row = lambda system: {"workload": "1 prompts x 128", "system": system, "tokens_per_s": 90.0}
  _write(tmp_path, "offline-quant-2026-11-27-b1.json", {"date": "2026-11-27T10:00:00", "machine": cpu,
                                                        "rows": [peer_row("jaxinfer"), peer_row("llama.cpp")]})
  _write(tmp_path, "offline-quant-2026-11-27-b64.json", {"date": "2026-11-27T12:00:00", "machine": cpu, "rows": [
      {"workload": "64 prompts x 128", "system": "jaxinfer", "tokens_per_s": 300.0}]})
  page = render_performance.render(tmp_path)
  assert "### AMD EPYC, 2 cores, AVX2: 1 prompts x 128 | jaxinfer, llama.cpp\n" in page
  assert "### AMD EPYC, 2 cores, AVX2: 64 prompts x 128 | jaxinfer\n" in page
  assert "| 1 prompts x 128 | llama.cpp | 90 |" in page and "| 64 prompts x 128 | jaxinfer | 300 |" in page
  assert "older runs of it" not in page


def test_runs_that_recorded_only_their_day_are_each_shown_for_the_last_day(tmp_path):
  # spec-...-23.json and spec-...-23-seq-buckets.json: no time of day, so neither can be called
  # the later one; the 22nd's run is older than both.
  cpu = {"cpu_model": "AMD EPYC", "cpus": 2, "avx2": True}
  for name, tps in (("spec-2026-11-22.json", 1.0), ("spec-2026-11-23.json", 2.0),
                    ("spec-2026-11-23-seq-buckets.json", 3.0)):
    _write(tmp_path, name, {"cpu": cpu, "rows": [{"method": "ngram", "tokens_per_s": tps}]})
  page = render_performance.render(tmp_path)
  assert "| ngram | 2 |" in page and "| ngram | 3 |" in page and "| ngram | 1 |" not in page
  assert page.count("### AMD EPYC, 2 cores, AVX2\n") == 2
  assert "older runs of it on this machine class: [`spec-2026-11-22.json`]" in page


def test_a_run_of_a_moved_script_shows_the_command_that_repeats_it_today(tmp_path):
  cpu = {"cpu_model": "AMD EPYC", "cpus": 2, "avx2": True}
  _write(tmp_path, "spec-2026-11-23.json", {"cpu": cpu, "command": "scripts/bench_spec.py --methods mtp --ks 1,2",
                                            "rows": [{"method": "mtp", "tokens_per_s": 1.0}]})
  _write(tmp_path, "kernels-2026-11-23.json", {"cpu": cpu, "command": "python3 scripts/not_moved.py --gpu",
                                               "rows": [{"kernel": "x", "us": 1.0}]})
  page = render_performance.render(tmp_path)
  assert "- command: `scripts/bench_spec.py --methods mtp --ks 1,2`\n- the same run today: " \
         "`jaxinfer bench spec --methods mtp --ks 1,2`" in page
  assert page.count("the same run today") == 1
  # A note in parentheses after the flags is not carried over as a flag.
  assert (render_performance.current_command("OUT=x bash scripts/gpu_check.sh (= python3 scripts/bench_offline.py "
                                             "--gpu --timeout 220)") == "jaxinfer bench offline --gpu --timeout 220")
  assert (render_performance.current_command("python scripts/bench_batch1_interleaved.py 5 r.json")
          == "jaxinfer bench offline --interleaved 5 --formats int8,int8-channel,int4,fp8 --peers none --out r.json")
