"""`jaxinfer bench profile` (jaxinfer/bench/profile.py): the step's split from its variants'
timings, with the worker processes stubbed by timings set by hand, and the JSON and picture it
writes."""

import json

from jaxinfer import bench
from jaxinfer.bench import profile

# ms per step of each variant, as the workers would report them.
STEP_MS = {"full": 50.0, "no-attention": 38.0, "no-sampling": 51.0}


def test_attention_sampling_and_rest_are_differences_of_the_variants(monkeypatch, tmp_path, capsys):
  spawned = []

  def spawn(spec):
    spawned.append(spec)
    return {"step_ms": STEP_MS[spec["variant"]], "pack_ms": 2.0}

  monkeypatch.setattr(profile, "_spawn", spawn)
  out = tmp_path / "profile-step.json"
  assert bench.main(["profile", "--batches", "4", "--host-batches", "", "--kv-len", "16", "--out", str(out)]) == 0
  assert [s["variant"] for s in spawned] == ["full", "no-attention", "no-sampling"]
  [row] = json.loads(out.read_text())["rows"]
  # attention = 50 - 38; sampling = 50 - 51 < 0 is noise, counted as 0; rest = 50 - 12 - 0 - 2.
  assert (row["attention_ms"], row["sampling_ms"], row["host_pack_ms"], row["rest_ms"]) == (12.0, 0.0, 2.0, 36.0)
  assert row["tokens_per_s"] == 4 / 50.0 * 1000
  assert out.with_suffix(".png").stat().st_size > 5_000
  assert "| 4 | 16 | float32 | 50.0 | 12.0 | 0.0 | 2.00 | 36.0 | 80 |" in capsys.readouterr().out


def test_host_rows_time_the_host_real_replayed_and_frozen():
  """The host rows' worker on a tiny model: every figure is there and positive, the replayed
  run took its own step count, and the heap is thawed after the frozen run."""
  import gc

  from conftest import tiny_dir
  gc.unfreeze()
  row = profile.host_worker(batch=4, steps=2, stream=True, replay_steps=6, model=str(tiny_dir("llama3")))
  assert gc.get_freeze_count() == 0
  assert row["replayed_steps"] == 6 and row["batch"] == 4 and row["stream"] is True
  for key in ("host_ms", "host_ms_replayed", "host_ms_replayed_median", "host_ms_replayed_worst",
              "host_ms_replayed_frozen", "host_ms_replayed_frozen_worst", "device_ms", "step_ms", "async_step_ms"):
    assert row[key] > 0, key
  assert row["host_ms_replayed_worst"] >= row["host_ms_replayed_median"]
  assert abs(sum(row["host_phases"].values()) - 1.0) < 1e-9
