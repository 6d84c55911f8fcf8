"""`jaxinfer bench eplb`'s counting: each device's routed rows for a hand-made routing (plain and
with replicas), the two dispatches' row arithmetic, and a short rows-only run that writes its
JSON and PNG (the engine timing is run by hand)."""

import argparse
import json

import numpy as np

from jaxinfer.bench import eplb as bench
from jaxinfer.bench import main as bench_main
from jaxinfer.models.eplb import Placement



def test_device_rows_by_hand():
  """8 tokens all on experts 0 and 1, 4 devices, 2 tokens per source. Plain: both experts on
  device 0, all 16 rows there. Placed (e0 on every device, e1 on devices 0 and 1): source d's two
  e0 copies go to replicas d and d + 1, its e1 copies to devices 0 and 1: 6, 6, 2, 2."""
  ids = np.tile(np.array([[0, 1]], np.int32), (8, 1))
  plain = Placement(8, 4, (tuple(range(8)),))
  placed = Placement(8, 4, ((0, 1, 5, 0, 1, 6, 0, 2, 7, 0, 3, 4),))
  np.testing.assert_array_equal(bench.device_rows(ids, plain, 0, bench._rows_fn(4, 2)), [16, 0, 0, 0])
  np.testing.assert_array_equal(bench.device_rows(ids, placed, 0, bench._rows_fn(4, 3)), [6, 6, 2, 2])


def test_dispatch_rows():
  """16 tokens over 4 devices (Tl = 4), top-2, 3 slots per device: C = 4 * 2, the fixed dispatch
  moves and computes 4 * 8 = 32 rows per device; the ragged one sends 8, computes what came."""
  d = bench.dispatch_rows(np.array([3, 5, 0, 24]), tokens=16, A=2, slots_per_device=3)
  assert d["fixed"] == {"sent": 32, "received": 32, "computed": 32}
  assert d["ragged"] == {"sent": 8, "received_max": 24, "received_mean": 8.0, "computed_max": 24,
                         "computed_mean": 8.0}


def test_short_run_writes_json_and_png(tmp_path, capsys):
  out = tmp_path / "eplb.json"
  assert bench_main(["eplb", "--experts", "8", "--top-k", "2", "--devices", "4", "--redundant", "4", "--layers", "1",
                     "--steps", "12", "--tokens", "32", "--shift-every", "6", "--window", "2", "--interval", "2",
                     "--no-timing", "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert out.with_suffix(".png").stat().st_size > 0
  assert [r["layout"] for r in result["rows"]] == ["plain", "static", "online"]
  rows = result["layouts"]
  assert set(rows) == {"plain", "static", "online"}
  assert rows["plain"]["slots_per_device"] == 2 and rows["online"]["slots_per_device"] == 3
  assert rows["online"]["replans_that_moved_experts"] >= 1
  fixed = rows["online"]["dispatch_rows_per_device_busiest_step"]["fixed"]
  assert fixed["sent"] == 4 * 8 * 2  # n * Tl * min(A, slots per device)
  assert result["replan_timing"] is None and "load_average_before" in result
  assert "online  busiest/mean" in capsys.readouterr().out


def test_simulated_rows_add_up():
  args = argparse.Namespace(experts=8, top_k=2, devices=4, redundant=4, layers=2, zipf=1.2, steps=6, tokens=16,
                            shift_every=3, window=2, interval=2, seed=3)
  sim = bench.simulate(args)
  for name, r in sim["rows"].items():
    assert r.shape == (6, 2, 4)
    assert (r.sum(axis=2) == 16 * 2).all(), name  # every token copy lands on one device
