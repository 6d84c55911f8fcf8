#!/usr/bin/env python
"""Expert-parallel load balancing (EPLB, jaxinfer/models/eplb.py): routed rows per device with
and without redundant experts under Zipf-skewed routing, the dispatch's wire and compute rows,
and the online re-planning's share of an engine step.

  jaxinfer bench eplb [--experts 64 --top-k 8 --devices 8 --redundant 8]
                               [--zipf 1.0 --steps 400 --tokens 512 --shift-every 100]
                               [--window 32 --interval 8] [--no-timing] [--out PATH]

Rows (counted, not timed: 8 fake devices share this machine's cores): a DeepSeek-V3-shaped
routing (E experts, top-k, 8 EP devices) drawn per step from a Zipf law: expert of popularity
rank r has weight r^-s (s = --zipf), the ranks a seeded random permutation per MoE layer, a new
one every --shift-every steps (the load moves); each token picks k distinct experts with
probability proportional to their weights (Gumbel top-k). The routing is synthetic on purpose:
the tiny model's random router is near uniform. Per step, each device's routed rows (the token
copies it receives) are counted through the engine's own code, `eplb.assign_slots` on each
source device's tokens, for three layouts:
  plain:  expert e on device e // (E / n), no redundancy (jaxinfer without EPLB);
  static: a placement planned once from the first --window steps' counts (`jaxinfer eplb plan`);
  online: `eplb.OnlineBalancer` as the engine runs it, from a plan of even load, re-planned
          every --interval steps from the last --window steps' counts.
Reported per layout: the busiest device's rows over the mean (per step, worst layer; mean,
median, p95, max over steps), and per device the dispatch rows of both schemes
(models/expert_parallel.py): 'fixed' sends and computes n * C rows (C = Tl * min(k, slots per
device), padding included); 'ragged' sends its Tl * k routed rows and receives / computes
what was routed to it.

Time (--no-timing skips it): a DeepSeek-V3-shaped tiny model (random weights, E experts, top-k,
8 groups / top-4 groups, 2 MoE layers) through `LLMEngine` with experts over 8 devices and
online EPLB (every --interval steps, from its own router's counts): each step's wall time and
each re-plan's (the plan, the weight gather, waited for), side by side in one run, the steps
synchronous (async scheduling off) so that a re-plan is not timed behind a step still running.
Fraction = re-plan time / step time over the run (amortized), and one re-plan over the median
step; the first move, which compiles the gather program, is reported apart.

Writes benchmarks/results/eplb-<date>.json and a PNG beside it (per-device rows over steps,
plain vs online, and the busiest/mean ratio of every layout), with CPU model, commit, command
and load average.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxinfer.models import eplb  # noqa: E402
from jaxinfer.models.eplb import EplbConfig, OnlineBalancer, Placement  # noqa: E402


# ---------------------------------------------------------------------- routing and rows


def zipf_weights(E: int, s: float, perm: np.ndarray) -> np.ndarray:
  """[E]: expert perm[r] has popularity rank r, weight (r + 1)^-s."""
  w = np.empty(E)
  w[perm] = 1.0 / np.arange(1, E + 1) ** s
  return w


def draw_routing(rng: np.random.Generator, weights: np.ndarray, T: int, A: int) -> np.ndarray:
  """[T, A] distinct experts per token, drawn with probability proportional to `weights`
  (Gumbel top-k: sampling without replacement)."""
  keys = np.log(weights)[None, :] + rng.gumbel(size=(T, len(weights)))
  return np.argsort(-keys, axis=1)[:, :A].astype(np.int32)


def _rows_fn(n: int, Sl: int):
  def rows(ids, table, reps):
    # ids [n, Tl, A]: each source device's tokens, as the EP FFN splits them.
    slots = jax.vmap(eplb.assign_slots, in_axes=(0, None, None, 0))(ids, table, reps, jnp.arange(n))
    return jnp.bincount((slots // Sl).reshape(-1), length=n)  # [n] rows each device receives
  return jax.jit(rows)


def device_rows(ids: np.ndarray, placement: Placement, layer: int, rows_fn) -> np.ndarray:
  """Rows each EP device receives for the routing ids [T, A] under `placement`'s layer (T
  divisible by the devices)."""
  table, reps = placement.tables()
  n = placement.num_devices
  return np.asarray(rows_fn(ids.reshape(n, -1, ids.shape[1]), table[layer], reps[layer]))


def dispatch_rows(received: np.ndarray, tokens: int, A: int, slots_per_device: int) -> dict[str, Any]:
  """Per device, from the rows each received [n]: what each dispatch sends, receives and runs
  through the expert matmuls (models/expert_parallel.py)."""
  from jaxinfer.models.expert_parallel import capacity
  n = len(received)
  Tl = tokens // n
  fixed = n * capacity(Tl, A, slots_per_device)
  return {
      "fixed": {"sent": fixed, "received": fixed, "computed": fixed},
      "ragged": {"sent": Tl * A, "received_max": int(received.max()), "received_mean": float(received.mean()),
                 "computed_max": int(received.max()), "computed_mean": float(received.mean())},
  }


def simulate(args) -> dict[str, Any]:
  E, A, n, L = args.experts, args.top_k, args.devices, args.layers
  T = args.tokens
  if T % n:
    raise SystemExit(f"--tokens {T} must divide by --devices {n}")
  rng = np.random.default_rng(args.seed)
  perms = [rng.permutation(E) for _ in range(L)]
  plain = Placement(E, n, (tuple(range(E)),) * L)
  cfg = EplbConfig(num_redundant_experts=args.redundant, replan_interval=args.interval, window=args.window)
  online_start = cfg.initial(E, n, L)
  balancer = OnlineBalancer(cfg, online_start)
  # A stand-in params tree (one float per expert): OnlineBalancer re-lays it out like the engine's.
  params = {"layers": [{"moe": {"router": jnp.zeros((1, E)), "w_gate": jnp.arange(E, dtype=jnp.float32)}}
                       for _ in range(L)]}
  params = eplb.relayout(params, online_start)
  static = None
  fns = {S: _rows_fn(n, S // n) for S in {E, E + args.redundant}}
  rows = {"plain": [], "static": [], "online": []}  # per step [L, n]
  counts_window = []
  for step in range(args.steps):
    if step and step % args.shift_every == 0:
      perms = [rng.permutation(E) for _ in range(L)]
    ids = [draw_routing(rng, zipf_weights(E, args.zipf, perms[l]), T, A) for l in range(L)]
    counts = np.stack([np.bincount(i.reshape(-1), minlength=E) for i in ids])  # [L, E]
    if static is None and len(counts_window) == args.window:
      static = eplb.plan(np.sum(counts_window, axis=0), n, args.redundant)
    layouts = {"plain": plain, "static": static or online_start, "online": balancer.placement}
    for name, pl in layouts.items():
      rows[name].append(np.stack([device_rows(ids[l], pl, l, fns[pl.num_slots]) for l in range(L)]))
    counts_window.append(counts)
    balancer.observe(counts)  # after the step, as the engine does; the re-plan comes before the next
    new = balancer.maybe_replan(params)
    if new is not None:
      params = new
      got = np.asarray(params["layers"][0]["moe"]["w_gate"])
      assert (got == np.asarray(balancer.placement.slots[0])).all()  # the weights followed the plan
  out = {name: np.asarray(r) for name, r in rows.items()}  # [steps, L, n]
  return {"rows": out, "replans": balancer.replans, "final_placement": balancer.placement,
          "static_placement": static}


def imbalance(rows: np.ndarray) -> np.ndarray:
  """[steps]: the worst layer's busiest device over its mean, per step."""
  return (rows.max(axis=2) / rows.mean(axis=2)).max(axis=1)


def settled(args) -> np.ndarray:
  """[steps] bool: the steps at least window + interval after the last reshuffle (or the start)."""
  return np.arange(args.steps) % args.shift_every >= args.window + args.interval


def summarize(sim: dict[str, Any], args) -> dict[str, Any]:
  out = {}
  S = args.experts + args.redundant
  for name, r in sim["rows"].items():
    ratio = imbalance(r)
    slots_per_device = (args.experts if name == "plain" else S) // args.devices
    worst = int(np.argmax(r.max(axis=2).max(axis=1)))  # the step with the busiest device
    layer = int(np.argmax(r[worst].max(axis=1)))
    out[name] = {
        "busiest_over_mean": {"mean": float(ratio.mean()), "median": float(np.median(ratio)),
                              "p95": float(np.percentile(ratio, 95)), "max": float(ratio.max())},
        # Settled: the steps whose window holds only the current Zipf order and whose plan came
        # after it filled (from window + interval steps after each reshuffle).
        "busiest_over_mean_settled": float(ratio[settled(args)].mean()),
        "slots_per_device": slots_per_device,
        "dispatch_rows_per_device_busiest_step": dispatch_rows(r[worst, layer], args.tokens, args.top_k,
                                                               slots_per_device),
    }
  out["online"]["replans_that_moved_experts"] = sim["replans"]
  return out


def table_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
  """One row per layout: the busiest device over the mean and, at the busiest step, the rows per
  device each dispatch moves and computes."""
  out = []
  for name in ("plain", "static", "online"):
    s = summary[name]
    d = s["dispatch_rows_per_device_busiest_step"]
    out.append({"layout": name, "busiest_over_mean": s["busiest_over_mean"]["mean"],
                "busiest_over_mean_settled": s["busiest_over_mean_settled"],
                "busiest_over_mean_p95": s["busiest_over_mean"]["p95"], "slots_per_device": s["slots_per_device"],
                "fixed_rows_sent_and_computed": d["fixed"]["sent"], "ragged_rows_sent": d["ragged"]["sent"],
                "ragged_rows_computed_max": d["ragged"]["computed_max"],
                "ragged_rows_computed_mean": d["ragged"]["computed_mean"]})
  return out


# ---------------------------------------------------------------------- engine timing


def engine_timing(args) -> dict[str, Any]:
  """Step and re-plan wall times of LLMEngine with online EPLB, side by side in one run."""
  import dataclasses

  from jaxinfer.config import ModelConfig
  from jaxinfer.engine.engine import EngineConfig, LLMEngine
  from jaxinfer.params import init_params
  from jaxinfer.sampling import SamplingParams
  from jaxinfer.sharding import make_mesh, make_rules, param_shardings

  tiny = json.loads((ROOT / "tests" / "data" / "tiny" / "deepseek_v3" / "config.json").read_text())
  cfg = dataclasses.replace(ModelConfig.from_hf(tiny), num_experts=args.experts, num_experts_per_token=args.top_k,
                            n_group=8, topk_group=4)
  mesh = make_mesh(1, args.devices, 1)
  params = jax.device_put(init_params(cfg, jax.random.key(0)), param_shardings(cfg, mesh, None, make_rules(None)))
  # Synchronous steps: each step() has finished its device work when it returns, so the re-plan
  # (between steps) is timed alone, not behind a step still running on the devices.
  ec = EngineConfig(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64, warmup=True,
                    async_scheduling=False,
                    eplb={"num_redundant_experts": args.redundant, "replan_interval": args.interval,
                          "window": args.window})
  engine = LLMEngine(cfg, params, None, ec, mesh=mesh)
  replans: list[tuple[float, bool]] = []
  plan_only = engine.eplb.maybe_replan

  def timed(p):
    t0 = time.perf_counter()
    out = plan_only(p)
    if out is not None:
      jax.block_until_ready(out)  # the gather done, not just dispatched
    replans.append((time.perf_counter() - t0, out is not None))
    return out
  engine.eplb.maybe_replan = timed
  rng = np.random.default_rng(args.seed)
  for i in range(16):
    engine.add_request(f"r{i}", rng.integers(2, cfg.vocab_size, size=int(rng.integers(8, 48))).tolist(),
                       SamplingParams(temperature=0, max_tokens=args.engine_tokens, ignore_eos=True))
  steps = []
  while engine.has_unfinished():
    before = len(replans)
    t0 = time.perf_counter()
    engine.step()
    dt = time.perf_counter() - t0
    r = sum(s for s, _ in replans[before:])
    steps.append((dt - r, r, any(m for _, m in replans[before:])))
  step_s = np.array([s for s, _, _ in steps])
  moved = [r for r, _, m in steps if m]
  # The first move compiles the gather program (once per engine): reported apart, left out of
  # the median and the amortized share.
  first = next((i for i, (_, _, m) in enumerate(steps) if m), None)
  total_replan = sum(r for i, (_, r, _) in enumerate(steps) if i != first)
  first_ms = moved[0] * 1e3 if moved else None
  moved = moved[1:]
  return {
      "model": {"experts": cfg.num_experts, "top_k": cfg.num_experts_per_token, "n_group": cfg.n_group,
                "topk_group": cfg.topk_group, "hidden": cfg.hidden_size, "expert_width": cfg.moe_intermediate_size,
                "moe_layers": sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers)), "devices": args.devices,
                "redundant": args.redundant},
      "steps": len(steps), "replan_interval_steps": args.interval, "window_steps": args.window,
      "replans_that_moved_experts": len(moved) + (first is not None),
      "first_replan_ms_with_compile": first_ms,
      "step_ms_median": float(np.median(step_s) * 1e3),
      "replan_ms_median": float(np.median(moved) * 1e3) if moved else None,
      "replan_over_step_time_amortized": float(total_replan / step_s.sum()),
      "one_replan_over_median_step": float(np.median(moved) / np.median(step_s)) if moved else None,
  }


# ---------------------------------------------------------------------- output


def plot(sim: dict[str, Any], summary: dict[str, Any], args, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = sim["rows"]
  fig, axes = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
  steps = np.arange(args.steps)
  for ax, name, title in ((axes[0], "plain", "without EPLB"), (axes[1], "online", "with online EPLB")):
    r = rows[name][:, 0]  # layer 0, [steps, n]
    for d in range(args.devices):
      ax.plot(steps, r[:, d], lw=0.8, label=f"device {d}")
    ax.axhline(args.tokens * args.top_k / args.devices, color="k", ls="--", lw=0.8, label="mean")
    ax.set_ylabel("routed rows (layer 0)")
    ax.set_title(f"{title}: busiest/mean {summary[name]['busiest_over_mean']['mean']:.3f} (mean over steps)")
  axes[0].legend(ncol=5, fontsize=7)
  for name in ("plain", "static", "online"):
    axes[2].plot(steps, imbalance(rows[name]), lw=0.9, label=name)
  for s in range(args.shift_every, args.steps, args.shift_every):
    axes[2].axvline(s, color="gray", ls=":", lw=0.8)
  axes[2].axhline(1.15, color="r", ls="--", lw=0.8, label="1.15")
  axes[2].set_ylabel("busiest / mean (worst layer)")
  axes[2].set_xlabel("step (dotted: the Zipf ranks reshuffled)")
  axes[2].legend()
  fig.suptitle(f"EPLB: {args.experts} experts top-{args.top_k} over {args.devices} devices, +{args.redundant} "
               f"redundant, Zipf s={args.zipf}, {args.tokens} tokens/step")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def cpu_model() -> str:
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  import platform
  return platform.processor() or "unknown"


def add_arguments(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("--experts", type=int, default=64)
  ap.add_argument("--top-k", type=int, default=8)
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--redundant", type=int, default=8)
  ap.add_argument("--layers", type=int, default=2, help="MoE layers (each its own popularity order)")
  ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent s (>= 1.0 for the issue's target)")
  ap.add_argument("--steps", type=int, default=400)
  ap.add_argument("--tokens", type=int, default=512, help="tokens per step")
  ap.add_argument("--shift-every", type=int, default=100, help="steps between reshuffles of the Zipf ranks")
  ap.add_argument("--window", type=int, default=32, help="steps of counts each plan looks at")
  ap.add_argument("--interval", type=int, default=16, help="online: steps between re-plans (rows and engine)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--no-timing", action="store_true", help="rows only (no engine run)")
  ap.add_argument("--engine-tokens", type=int, default=160, help="timing: tokens generated per request")
  ap.add_argument("--out", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
  load_before = os.getloadavg()
  sim = simulate(args)
  summary = summarize(sim, args)
  timing = None if args.no_timing else engine_timing(args)
  load_after = os.getloadavg()
  date = datetime.date.today().isoformat()
  out = args.out or ROOT / "benchmarks" / "results" / f"eplb-{date}.json"
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
  result = {
      "benchmark": "eplb", "date": date, "commit": commit, "command": args.command,
      "cpu": {"cpu_model": cpu_model(), "cpus": os.cpu_count()}, "jax": jax.__version__,
      "device": "cpu",
      "ep_devices": f"{args.devices} fake XLA:CPU devices (--xla_force_host_platform_device_count)",
      "load_average_before": [round(x, 2) for x in load_before],
      "load_average_after": [round(x, 2) for x in load_after],
      "routing": {"experts": args.experts, "top_k": args.top_k, "layers": args.layers, "zipf": args.zipf,
                  "tokens_per_step": args.tokens, "steps": args.steps, "shift_every": args.shift_every,
                  "seed": args.seed, "redundant": args.redundant, "window": args.window,
                  "interval": args.interval},
      "rows": table_rows(summary),
      "layouts": summary,
      "replan_timing": timing,
      "static_placement_slots": [list(l) for l in sim["static_placement"].slots] if sim["static_placement"] else None,
  }
  if not args.no_timing or args.out is not None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(sim, summary, args, out.with_suffix(".png"))
  for name in ("plain", "static", "online"):
    b = summary[name]["busiest_over_mean"]
    print(f"{name:7s} busiest/mean: mean {b['mean']:.3f}  median {b['median']:.3f}  p95 {b['p95']:.3f}  "
          f"max {b['max']:.3f}  (settled: {summary[name]['busiest_over_mean_settled']:.3f})")
  d = summary["online"]["dispatch_rows_per_device_busiest_step"]
  print(f"dispatch rows per device (online, busiest step): fixed sends/computes {d['fixed']['sent']}, "
        f"ragged sends {d['ragged']['sent']}, computes max {d['ragged']['computed_max']} "
        f"mean {d['ragged']['computed_mean']:.0f}")
  if timing and timing["replan_ms_median"] is not None:
    print(f"engine: median step {timing['step_ms_median']:.1f} ms, median re-plan {timing['replan_ms_median']:.1f} ms, "
          f"re-plan / step time {timing['replan_over_step_time_amortized']:.4f} amortized "
          f"({timing['replans_that_moved_experts']} moves in {timing['steps']} steps)")
  if not args.no_timing or args.out is not None:
    print(f"wrote {out} and {out.with_suffix('.png').name}")
  return 0
