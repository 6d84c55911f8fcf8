#!/usr/bin/env python
"""The expert-parallel MoE FFN's two dispatches on this machine's devices: 'ragged'
(`jax.lax.ragged_all_to_all`, only routed rows travel) and 'fixed' (worst-case capacity
all-to-all), each checked against the single-program `moe.moe_ffn` and timed, at DeepSeek-V3's
expert shapes scaled by --scale (experts over every local device of the default backend).

  python scripts/check_ep_dispatch.py [--tokens 512] [--scale 8] [--redundant 0] [--out PATH]

For a machine with a GPU (XLA:CPU cannot compile the ragged collective; there the script says
so and checks the fixed dispatch only). With one device the all-to-alls are one-party (the
ragged path's offsets are then trivial): the dispatches' difference in wire rows needs two
devices or more. Writes benchmarks/results/ep-dispatch-<device>-<date>.json with the device,
commit and command; timings are medians of --reps calls after a warm-up, in one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.models import eplb, moe
from jaxinfer.models.expert_parallel import choose_dispatch, ep_moe_ffn
from jaxinfer.params import is_spec, moe_specs

ROOT = Path(__file__).resolve().parent.parent


def config(scale: int) -> ModelConfig:
  """DeepSeek-V3's MoE layer (256 experts, top-8, 8 groups / top-4, hidden 7168, expert width 2048,
  one shared expert) with hidden and widths divided by `scale`."""
  tiny = json.loads((ROOT / "tests" / "data" / "tiny" / "deepseek_v3" / "config.json").read_text())
  return dataclasses.replace(ModelConfig.from_hf(tiny), num_experts=256, num_experts_per_token=8, n_group=8,
                             topk_group=4, hidden_size=7168 // scale, moe_intermediate_size=2048 // scale,
                             shared_expert_intermediate_size=2048 // scale)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--tokens", type=int, default=512)
  ap.add_argument("--scale", type=int, default=8, help="divide DeepSeek-V3's hidden and expert widths by this")
  ap.add_argument("--redundant", type=int, default=0, help="EPLB redundant slots (0: plain layout)")
  ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--out", type=Path, default=None)
  args = ap.parse_args(argv)
  devices = jax.devices()
  n = len(devices)
  mesh = jax.sharding.Mesh(np.array(devices), ("expert",))
  cfg = config(args.scale)
  dtype = jnp.dtype(args.dtype)
  rng = np.random.default_rng(0)

  def init(spec):
    scale = 1 / np.sqrt(spec.fan_in) if spec.linear else 0.1
    return jnp.asarray(rng.normal(size=spec.shape) * scale, jnp.float32 if spec.router else dtype)

  p = jax.tree.map(init, moe_specs(cfg, 1), is_leaf=is_spec)
  x = jnp.asarray(rng.normal(size=(args.tokens, cfg.hidden_size)), dtype)
  ref = np.asarray(jax.jit(moe.moe_ffn, static_argnums=1)(p, cfg, x)[0], np.float32)
  S = cfg.num_experts + args.redundant
  if S % n:
    raise SystemExit(f"{S} slots do not split over {n} devices")
  placement = eplb.plan(np.ones(cfg.num_experts), n, args.redundant)
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert"))
  placed = {k: jax.device_put(v, split) if k in eplb.EXPERT_KEYS else v for k, v in p.items()}
  placed = eplb.relayout({"layers": [{"moe": placed}]}, placement)["layers"][0]["moe"] if args.redundant else placed
  chosen = choose_dispatch(tuple(devices))
  rows = []
  for dispatch in ("fixed", "ragged"):
    f = jax.jit(lambda p, x, d=dispatch: ep_moe_ffn(p, cfg, x, mesh=mesh, expert_axes=("expert",), dispatch=d)[0])
    try:
      out = np.asarray(f(placed, x), np.float32)
    except Exception as e:  # XLA:CPU: no ragged-all-to-all thunk
      rows.append({"dispatch": dispatch, "runs": False, "error": str(e).splitlines()[0][:200]})
      continue
    err = float(np.abs(out - ref).max())
    times = []
    for _ in range(args.reps + 1):
      t0 = time.perf_counter()
      jax.block_until_ready(f(placed, x))
      times.append(time.perf_counter() - t0)
    rows.append({"dispatch": dispatch, "runs": True, "max_abs_error_vs_moe_ffn": err,
                 "ref_max_abs": float(np.abs(ref).max()), "ms_median": statistics.median(times[1:]) * 1e3})
  base = next((r["ms_median"] for r in rows if r["dispatch"] == "fixed" and r.get("runs")), None)
  for r in rows:
    if r.get("runs") and base:
      r["ratio_to_fixed"] = r["ms_median"] / base
  device = devices[0].device_kind.replace(" ", "-").lower()
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
  result = {"benchmark": "ep-dispatch", "device": devices[0].device_kind, "num_devices": n,
            "date": datetime.date.today().isoformat(), "commit": commit, "command": " ".join(["python"] + sys.argv),
            "chosen_dispatch": chosen, "tokens": args.tokens, "dtype": args.dtype, "redundant": args.redundant,
            "shapes": {"experts": cfg.num_experts, "top_k": cfg.num_experts_per_token, "hidden": cfg.hidden_size,
                       "expert_width": cfg.moe_intermediate_size},
            "rows": rows}
  print(json.dumps(result, indent=1))
  if args.out or devices[0].platform != "cpu":
    out = args.out or ROOT / "benchmarks" / "results" / f"ep-dispatch-{device}-{result['date']}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
