"""Where a step's time goes, as a table, a JSON and a picture.

  jaxinfer bench profile [--dtype float32] [--quantization int8] [--batches 64,1] [--kv-len 100]
                         [--host-batches 64,256]

Device step (one decode token per sequence, kv length --kv-len): the full
step against the same step with attention or sampling replaced by trivial
stand-ins (attention returns q; sampling sums each logits row), each in a
fresh process; attention = full - no-attention, sampling = full -
no-sampling, and the rest (the matmuls, norms, KV writes)
= full - attention - sampling - host pack.

Host overhead (engine.step() with the device call taken out): the
scheduler, pack() and postprocessing (append, detokenize, stop checks) per
step at --host-batches running sequences, with outputs made every step (a
server streaming) and only at the end (LLM.generate); its split between those
parts (cProfile, in a run of its own); the same with the device programs
replayed over --replay-steps steps (the host's work alone, with warm caches,
as a GPU's host runs it: on the CPU backend a real step evicts the host's
caches, which makes the same host code ~3x slower after it), as it comes and
with the heap frozen as warm-up leaves it (runner.freeze_heap: the worst step
shows a full garbage collection or its absence); then the wall time per step without and with
async scheduling, and the share of it the device was idle (wall - device
time, over wall).

Prints tables; writes benchmarks/results/profile-step-<date>.json and a
stacked-bar PNG beside it (matplotlib).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import time
from pathlib import Path

from jaxinfer.bench.harness import environment, subcommand_argv, write_results


def worker(variant: str, dtype: str, batch: int, kv_len: int, iters: int, quantization: str | None = None) -> dict:
  """ms per step of `variant` (full | no-attention | no-sampling), and of pack() alone."""
  import jax.numpy as jnp

  import jaxinfer.engine.runner as runner_mod
  import jaxinfer.ops as ops
  if variant == "no-attention":
    ops.ragged_paged_attention = lambda q, *a, **k: q
  if variant == "no-sampling":
    def reduce_only(logits, sp, counts, prompt, rows, allowed=None, **_):
      # One cheap pass over the logits, so the LM head stays in the program (XLA would
      # drop it if nothing read the logits); it undercounts sampling by that pass.
      B = logits.shape[0]
      s = jnp.sum(logits, axis=-1)
      return ((s > 0).astype(jnp.int32), s, jnp.zeros((B, 20), jnp.int32), jnp.zeros((B, 20)))
    runner_mod.sample = reduce_only
  from jaxinfer import LLM, SamplingParams
  from jaxinfer.engine.runner import ScheduledSeq, bucket, pack
  llm = LLM(None, dtype=dtype, max_num_seqs=max(batch, 1), warmup=False, kv_cache_bytes=600_000_000,
            quantization=quantization)
  sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
  per_seq = kv_len // 16 + 2
  seqs = [ScheduledSeq(row=i, token_ids=[5] * (kv_len + 1), start=kv_len, num_new=1,
                       pages=list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)), params=sp, seed=0)
          for i in range(batch)]
  r = llm.runner
  r.execute(seqs)
  t0 = time.perf_counter()
  for _ in range(iters):
    r.execute(seqs)
  step = (time.perf_counter() - t0) / iters * 1000
  T = bucket(batch, r.token_buckets)
  t0 = time.perf_counter()
  for _ in range(iters):
    pack(seqs, T, r.num_seqs_bucket(T), r.num_speculative_tokens, r.pages_per_seq, r.page_size,
         r.scratch_row, r.cfg.vocab_size, r.input_batch.tokens)  # the runner's table, as a step packs
  return dict(step_ms=step, pack_ms=(time.perf_counter() - t0) / iters * 1000)


def host_worker(batch: int, steps: int, stream: bool = True, replay_steps: int = 200, model: str | None = None) -> dict:
  """Host ms per engine step at `batch` running decodes (the device call excluded), and
  the wall time per step with and without async scheduling. `stream`: every step makes each
  request's output (a server streaming); False: only final outputs (LLM.generate)."""
  import numpy as np

  sync = _host_run(batch, steps, stream, async_scheduling=False, time_device=True, model=model)
  device_ms = sync.pop("device_ms")
  phases = _host_run(batch, steps, stream, async_scheduling=False, time_device=True, model=model, profile=True)["phases"]
  # Replayed steps cost the host's work only, so many of them: a mean over a few is one
  # cyclic garbage collection or scheduler hiccup away from another number.
  replayed = _host_run(batch, replay_steps, stream, async_scheduling=False, time_device=False, model=model, replay=True)
  # The same after warm-up's freeze_heap (what a warmed engine runs with): a full collection
  # of the start-up heap falls inside some step otherwise (see the worst step of each).
  frozen = _host_run(batch, replay_steps, stream, async_scheduling=False, time_device=False, model=model, replay=True,
                     freeze=True)
  plain = _host_run(batch, steps, stream, async_scheduling=False, time_device=False, model=model)
  overlapped = _host_run(batch, steps, stream, async_scheduling=True, time_device=False, model=model)
  host_ms = float(np.median(sync["host"]) * 1000)
  sync_ms, async_ms = plain["wall_ms"], overlapped["wall_ms"]
  # Exposed: the part of a step's wall time the device was not running (host work it waited for).
  return dict(batch=batch, stream=stream, host_ms=host_ms, host_ms_replayed=replayed["wall_ms"],
              host_ms_replayed_median=float(np.median(replayed["host"]) * 1000), replayed_steps=replay_steps,
              host_ms_replayed_worst=float(replayed["host"].max() * 1000),
              host_ms_replayed_frozen=frozen["wall_ms"],
              host_ms_replayed_frozen_worst=float(frozen["host"].max() * 1000),
              device_ms=device_ms, step_ms=sync_ms, async_step_ms=async_ms,
              host_phases=phases, exposed_share=max(0.0, sync_ms - device_ms) / sync_ms,
              async_exposed_share=max(0.0, async_ms - device_ms) / async_ms)


# engine.step()'s host parts, by the function that does them (cProfile's cumulative time).
HOST_PHASES = {"postprocess": "_postprocess", "schedule": "schedule", "pack": "pack_step"}


def _host_run(batch: int, steps: int, stream: bool, async_scheduling: bool, time_device: bool,
              profile: bool = False, replay: bool = False, freeze: bool = False, model: str | None = None) -> dict:
  """profile: the share of host time in each of HOST_PHASES (and 'other': launching,
  drafting, the engine's own loop), from cProfile; its overhead inflates times, not shares.
  replay: the step's programs replaced by one real step's outputs, returned again each step
  (the host's work alone: on the CPU backend a real step leaves the host's caches cold
  after it, which a GPU's host does not see; its wall time per step is the host's).
  freeze: the heap frozen before the timed steps, as warm-up leaves it (runner.freeze_heap),
  and thawed after them (the runs after this one in the process start as they come)."""
  import cProfile
  import pstats

  import jax
  import numpy as np

  from jaxinfer import LLM, SamplingParams
  # Room for every sequence's KV (no preemption): 32 prompt + steps + 50 tokens each.
  llm = LLM(model, max_num_seqs=batch, max_num_batched_tokens=max(512, batch), warmup=False,
            max_model_len=32 + steps + 50, num_pages=batch * (-(-(32 + steps + 50) // 16)) + 1,
            async_scheduling=async_scheduling)
  engine, runner = llm.engine, llm.runner
  device = []

  def timed(program):
    def device_call(*a, **k):  # a device call: dispatch and run to completion (pack() stays host time)
      t0 = time.perf_counter()
      out = jax.block_until_ready(program(*a, **k))
      device.append(time.perf_counter() - t0)
      return out
    return device_call

  if time_device:  # the step's programs: the forward and the sampler
    runner._step, runner._sample = timed(runner._step), timed(runner._sample)
  rng = np.random.default_rng(0)
  sp = SamplingParams(temperature=0, max_tokens=steps + 50, ignore_eos=True)
  for i in range(batch):
    engine.add_request(f"r{i}", rng.integers(100, min(40000, llm.engine.config.vocab_size), 32).tolist(), sp,
                       stream=stream)
  for _ in range(1000):  # until every request is decoding
    if engine.stats()["running"] == batch and all(r.num_uncomputed == 1 for r in engine.scheduler.running):
      break
    engine.step()
  else:
    raise RuntimeError(f"{batch} requests never all ran at once")
  for _ in range(3):  # the decode bucket compiled, and (async) a step in flight
    engine.step()
  if replay:
    runner._step, runner._sample = _replaying(runner._step), _replaying(runner._sample)
    engine.step()
  if freeze:
    from jaxinfer.engine.runner import freeze_heap
    freeze_heap()
  totals = []
  device.clear()
  profiler = cProfile.Profile() if profile else None
  t_all = time.perf_counter()
  for _ in range(steps):
    t0 = time.perf_counter()
    if profiler is not None:
      profiler.runcall(engine.step)
    else:
      engine.step()
    totals.append(time.perf_counter() - t0)
  wall_ms = (time.perf_counter() - t_all) / steps * 1000
  if freeze:
    gc.unfreeze()
  if profiler is not None:
    cumulative = {}
    for (_, _, name), (_, _, _, ct, _) in pstats.Stats(profiler).stats.items():
      cumulative[name] = cumulative.get(name, 0.0) + ct
    host = cumulative["step"] - cumulative["device_call"]
    missing = sorted(fn for fn in HOST_PHASES.values() if fn not in cumulative)
    if missing:  # a renamed engine method would otherwise count as a 0% phase
      raise RuntimeError(f"profile_step: no calls to {missing} in the profile; update HOST_PHASES")
    phases = {phase: cumulative[fn] / host for phase, fn in HOST_PHASES.items()}
    return dict(phases=phases | {"other": 1.0 - sum(phases.values())})
  if not time_device:
    return dict(wall_ms=wall_ms, host=np.array(totals))
  per_step = np.array(device).reshape(steps, -1).sum(axis=1)  # the step's programs together
  return dict(host=np.array(totals) - per_step, device_ms=float(np.median(per_step) * 1000), wall_ms=wall_ms)


def _replaying(program):
  """program, run once; later calls return that call's outputs again (ready device arrays)."""
  import jax
  outputs = []

  def replayed(*a, **k):
    if not outputs:
      outputs.append(jax.block_until_ready(program(*a, **k)))
    return outputs[0]
  return replayed


def _spawn(spec: dict) -> dict:
  out = subprocess.run([*subcommand_argv("profile"), "--worker", json.dumps(spec)], capture_output=True,
                       text=True, check=True).stdout
  return json.loads(out.split("RESULT")[-1])


def plot(rows: list[dict], path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  parts = [("attention_ms", "attention"), ("sampling_ms", "sampling"), ("rest_ms", "matmuls + rest"),
           ("host_pack_ms", "host (pack)")]
  fig, ax = plt.subplots(figsize=(6, 3.2))
  labels = [f"batch {r['batch']}" for r in rows]
  left = [0.0] * len(rows)
  for key, name in parts:
    vals = [max(r[key], 0.0) for r in rows]
    ax.barh(labels, vals, left=left, label=name)
    left = [a + b for a, b in zip(left, vals)]
  ax.set_xlabel("ms per decode step")
  ax.set_title(f"decode step, kv length {rows[0]['kv_len']}, {rows[0]['dtype']}")
  ax.legend(loc="lower right", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def add_arguments(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--quantization", default=None, choices=["int8", "fp8", "int4"],
                  help="weights quantized at load (the device-step rows)")
  ap.add_argument("--batches", default="64,1")
  ap.add_argument("--host-batches", default="64,256")
  ap.add_argument("--kv-len", type=int, default=100)
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--replay-steps", type=int, default=200,
                  help="steps of the host rows' replayed run (host work only: cheap, so many)")
  ap.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
  if args.worker:
    spec = json.loads(args.worker)
    res = host_worker(**spec["host"]) if "host" in spec else worker(**spec)
    print("RESULT", json.dumps(res))
    return 0
  env = environment(args.command)
  rows = []
  for batch in map(int, args.batches.split(",") if args.batches else []):
    ms = {v: _spawn(dict(variant=v, dtype=args.dtype, batch=batch, kv_len=args.kv_len, iters=args.iters,
                         quantization=args.quantization))
          for v in ("full", "no-attention", "no-sampling")}
    full = ms["full"]["step_ms"]
    attention = full - ms["no-attention"]["step_ms"]
    # The greedy sampler costs about one pass over the logits, as the stand-in does, so
    # the difference can come out below zero: that is noise, counted as 0.
    sampling = max(0.0, full - ms["no-sampling"]["step_ms"])
    pack_ms = ms["full"]["pack_ms"]
    rows.append(dict(batch=batch, kv_len=args.kv_len, dtype=args.dtype + (f"+{args.quantization}" if args.quantization else ""),
                     step_ms=full, attention_ms=attention,
                     sampling_ms=sampling, host_pack_ms=pack_ms, rest_ms=full - attention - sampling - pack_ms,
                     tokens_per_s=batch / full * 1000,
                     tokens_per_s_without_attention=batch / ms["no-attention"]["step_ms"] * 1000))
  print("| batch | kv len | dtype | step ms | attention ms | sampling ms | host pack ms | rest ms | tok/s |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['batch']} | {r['kv_len']} | {r['dtype']} | {r['step_ms']:.1f} | {r['attention_ms']:.1f} | "
          f"{r['sampling_ms']:.1f} | {r['host_pack_ms']:.2f} | {r['rest_ms']:.1f} | {r['tokens_per_s']:.0f} |")
  host = [_spawn({"host": dict(batch=b, steps=args.iters, stream=stream, replay_steps=args.replay_steps)})
          for stream in (True, False) for b in map(int, args.host_batches.split(",") if args.host_batches else [])]
  if host:
    print("\n| running sequences | outputs | host ms / step (schedule + pack + postprocess) | host ms, device "
          "replayed (mean / median / worst) | the same, heap frozen (mean / worst) | device ms | step ms | exposed | "
          "step ms, async scheduling | exposed, async |")
    print("|---" * 10 + "|")
    for h in host:
      print(f"| {h['batch']} | {'every step' if h['stream'] else 'final'} | {h['host_ms']:.2f} | "
            f"{h['host_ms_replayed']:.2f} / {h['host_ms_replayed_median']:.2f} / {h['host_ms_replayed_worst']:.1f} | "
            f"{h['host_ms_replayed_frozen']:.2f} / {h['host_ms_replayed_frozen_worst']:.1f} | {h['device_ms']:.1f} | {h['step_ms']:.1f} | "
            f"{h['exposed_share']:.1%} | {h['async_step_ms']:.1f} | {h['async_exposed_share']:.1%} |")
    print("\n| running sequences | outputs | " + " | ".join(f"host share: {p}" for p in (*HOST_PHASES, "other"))
          + " |")
    print("|---|---|" + "---|" * (len(HOST_PHASES) + 1))
    for h in host:
      print(f"| {h['batch']} | {'every step' if h['stream'] else 'final'} | "
            + " | ".join(f"{v:.0%}" for v in h["host_phases"].values()) + " |")
  out = write_results("profile-step", dict(rows=rows, host=host), args.out, env=env)
  if not rows:  # (--batches ''): host overhead only, no picture
    print(f"wrote {out}")
    return 0
  png = out.with_suffix(".png")
  plot(rows, png)
  print(f"wrote {out} and {png}")
  return 0

