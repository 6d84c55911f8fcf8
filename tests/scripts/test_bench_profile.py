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
