"""MLPerf Inference LoadGen harness: Offline, Server and Interactive over jaxinfer.

LoadGen (`mlcommons-loadgen`) decides when each query is issued; the system
under test (SUT) runs it and reports its first token (FirstTokenComplete)
and its whole output with the token count (QuerySamplesComplete), as
MLPerf's LLM benchmarks do, so LoadGen itself measures TTFT and TPOT.

SUTs:
  inprocess  the engine thread (`EngineLoop`) over one LLMEngine in this process
  grpc       a `jaxinfer serve` process on a free port, driven through the
             asyncio `Client` (streams), so the numbers include gRPC

Scenarios (latency bounds are those of MLPerf's llama2-70b benchmark; a
135M-parameter model on 2 CPU cores is a different system, so read them
as "would this machine meet the interactive product's targets"):
  Offline      every sample in one query; throughput
  Server       Poisson arrivals at --qps; TTFT p99 <= 2 s, TPOT p99 <= 200 ms
  Interactive  Server with TTFT p99 <= 450 ms, TPOT p99 <= 40 ms

Run rules are shortened so a CPU run takes minutes: --duration seconds
(MLPerf asks 600) and as few queries as that gives. LoadGen's VALID /
INVALID verdict is reported as it gave it, with its reasons (early stopping
wants hundreds of queries; a short run usually fails it).

  jaxinfer bench mlperf                          # default model: Offline + Server sweep + Interactive
  jaxinfer bench mlperf --scenarios Server --qps 0.5,1,2 --sut grpc
  jaxinfer bench mlperf --model tests/data/tiny/llama3 --duration 2 --samples 8 --out /tmp/m

Writes <out>/mlperf-<date>.json (default out: benchmarks/results/), one
plot <out>/mlperf-<date>.png (throughput against TTFT and TPOT
percentiles across the target QPS), and LoadGen's own logs per run under
<out>/mlperf-logs/ (not committed).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxinfer.bench.harness import RESULTS, ROOT, UsageError, environment, write_results

DATASET = ROOT / "benchmarks" / "data" / "mlperf_prompts.jsonl"


@dataclasses.dataclass(frozen=True)
class Scenario:
  name: str
  loadgen: str  # LoadGen's TestScenario
  ttft_s: float | None = None
  tpot_s: float | None = None


SCENARIOS = {
    "Offline": Scenario("Offline", "Offline"),
    "Server": Scenario("Server", "Server", ttft_s=2.0, tpot_s=0.2),
    "Interactive": Scenario("Interactive", "Server", ttft_s=0.45, tpot_s=0.04),
}


@dataclasses.dataclass
class Sample:
  index: int
  token_ids: list[int]
  max_tokens: int


def load_samples(path: Path, llm, limit: int | None) -> list[Sample]:
  """The dataset's chat prompts, tokenized once with the model's chat template."""
  rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  if limit:
    rows = rows[:limit]
  samples = []
  for i, row in enumerate(rows):
    _, ids = llm.encode_prompt(row["messages"])
    # A model with a short context (the tiny test models) gets shorter targets.
    room = llm.max_model_len - len(ids)
    if room < 1:
      raise SystemExit(f"{path}: sample {i} has {len(ids)} prompt tokens, more than the model's "
                       f"max_model_len={llm.max_model_len}")
    samples.append(Sample(i, ids, min(int(row["max_tokens"]), room)))
  return samples


# ---- systems under test -------------------------------------------------------------------------


class _Responses:
  """Token arrays handed to LoadGen stay alive until the run ends (it reads them by pointer)."""

  def __init__(self):
    self._keep: list[np.ndarray] = []
    self._lock = threading.Lock()
    self._started: set[int] = set()
    self.errors: list[str] = []

  def first(self, query_id: int, token_ids) -> None:
    import mlperf_loadgen as lg
    with self._lock:
      self._started.add(query_id)
    a = self._hold(token_ids[:1])
    lg.FirstTokenComplete([lg.QuerySampleResponse(query_id, a.ctypes.data, a.nbytes, len(a))])

  def done(self, query_id: int, token_ids) -> None:
    import mlperf_loadgen as lg
    a = self._hold(token_ids)
    lg.QuerySamplesComplete([lg.QuerySampleResponse(query_id, a.ctypes.data, a.nbytes, len(a))])

  def failed(self, query_id: int, error: BaseException) -> None:
    # LoadGen must hear of every query or it waits forever; the error is
    # counted and reported beside its verdict.
    # Token latencies need a first token before the end, or LoadGen's
    # percentiles take garbage from the failed query.
    with self._lock:
      self.errors.append(f"{type(error).__name__}: {error}")
      started = query_id in self._started
    if not started:
      self.first(query_id, [])
    self.done(query_id, [])

  def _hold(self, token_ids) -> np.ndarray:
    a = np.asarray(token_ids, np.int32)
    with self._lock:
      self._keep.append(a)
    return a


class InProcessSUT:
  """Queries go straight to the engine thread; its sink reports to LoadGen from that thread."""

  name = "inprocess"

  def __init__(self, llm, samples: list[Sample], params_for):
    from jaxinfer.serving.engine_loop import EngineLoop, Sink

    self.samples, self.params_for, self.frontend = samples, params_for, llm.frontend
    self.responses = _Responses()
    self.loop = EngineLoop(llm.engine, warmup=False).start()
    self.loop.ready.wait()
    responses = self.responses

    class LoadgenSink(Sink):
      def __init__(self, query_id: int):
        super().__init__()
        self.query_id = query_id

      def deliver(self, out) -> None:
        if out.new_token_ids and len(out.token_ids) == len(out.new_token_ids):
          responses.first(self.query_id, out.token_ids)
        if out.finished:
          if out.finish_reason == "error":
            responses.failed(self.query_id, RuntimeError(out.error))
          else:
            responses.done(self.query_id, out.token_ids)

      def fail(self, error: BaseException) -> None:
        responses.failed(self.query_id, error)

    self._sink = LoadgenSink

  def issue_queries(self, queries) -> None:
    for q in queries:
      s = self.samples[q.index]
      # Checked as the server checks a request (jaxinfer.frontend), then queued on the engine thread.
      request = self.frontend.validate(s.token_ids, self.params_for(s))
      self.loop.add(f"q{q.id}", request, self._sink(q.id))

  def flush_queries(self) -> None:
    pass

  def close(self) -> None:
    self.loop.stop()


class GrpcSUT:
  """Each query is one streamed Generate call to a `jaxinfer serve` process."""

  name = "grpc"

  def __init__(self, server_args: list[str], samples: list[Sample], params_for):
    from jaxinfer.bench.serving import start_server
    from jaxinfer.serving import Client

    self.samples, self.params_for = samples, params_for
    self.responses = _Responses()
    self.server = start_server(server_args, max_waiting_requests=4096)
    self.aloop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self.aloop.run_forever, name="mlperf-grpc", daemon=True)
    self._thread.start()
    self.client = Client(f"127.0.0.1:{self.server.port}")

  async def _one(self, query_id: int, sample: Sample) -> None:
    ids: list[int] = []
    try:
      async for r in self.client.astream(sample.token_ids, params=self.params_for(sample)):
        if r.token_ids and not ids:
          self.responses.first(query_id, list(r.token_ids))
        ids += r.token_ids
    except Exception as e:  # grpc.RpcError and friends: counted, LoadGen is told
      self.responses.failed(query_id, e)
      return
    self.responses.done(query_id, ids)

  def issue_queries(self, queries) -> None:
    for q in queries:
      asyncio.run_coroutine_threadsafe(self._one(q.id, self.samples[q.index]), self.aloop)

  def flush_queries(self) -> None:
    pass

  def close(self) -> None:
    async def close_client():
      await self.client.aclose()
    asyncio.run_coroutine_threadsafe(close_client(), self.aloop).result(30)
    self.aloop.call_soon_threadsafe(self.aloop.stop)
    self._thread.join(30)
    self.server.stop()


# ---- one LoadGen run ------------------------------------------------------------------------------


def parse_detail_log(path: Path) -> dict[str, Any]:
  """LoadGen's mlperf_log_detail.txt: one ':::MLLOG {json}' per line -> {key: value}."""
  values: dict[str, Any] = {}
  for line in path.read_text().splitlines():
    if line.startswith(":::MLLOG "):
      entry = json.loads(line[len(":::MLLOG "):])
      values[entry["key"]] = entry["value"]
  return values


def summarize(log: dict[str, Any], scenario: Scenario, qps: float | None, errors: list[str],
              seconds: float) -> dict[str, Any]:
  """The parts of a LoadGen log this report needs, latencies in seconds."""
  def ns(key):
    v = log.get(key)
    return None if v is None else v / 1e9

  row: dict[str, Any] = {
      "scenario": scenario.name, "target_qps": qps, "wall_s": round(seconds, 2),
      "result": log.get("result_validity"),
      "invalid_reasons": [r for r in (
          None if log.get("result_perf_constraints_met", True) else "latency constraints not met",
          None if log.get("result_min_duration_met", True) else "min duration not met",
          None if log.get("result_min_queries_met", True) else "min query count not met",
          None if log.get("early_stopping_met", True) else "early stopping not met",
      ) if r],
      "queries": log.get("result_query_count"),
      "errors": len(errors), "first_errors": errors[:3],
  }
  if scenario.loadgen == "Offline":
    row["samples_issued"] = log.get("generated_samples_per_query")
    row["samples_per_s"] = log.get("result_samples_per_second")
    row["tokens_per_s"] = log.get("result_tokens_per_second")
  else:
    row["samples_per_s"] = log.get("result_completed_samples_per_sec")
    row["tokens_per_s"] = log.get("result_completed_tokens_per_second")
    row["ttft_limit_s"], row["tpot_limit_s"] = scenario.ttft_s, scenario.tpot_s
    row["overlatency_queries"] = log.get("result_overlatency_query_count")
    for p in ("50.00", "90.00", "99.00"):
      q = p.split(".")[0]
      row[f"ttft_p{q}_s"] = ns(f"result_first_token_{p}_percentile_latency_ns")
      row[f"tpot_p{q}_s"] = ns(f"result_time_per_output_token_{p}_percentile_ns")
  for p in ("50.00", "99.00"):
    row[f"latency_p{p.split('.')[0]}_s"] = ns(f"result_{p}_percentile_latency_ns")
  return row


def run_one(sut, samples: list[Sample], scenario: Scenario, qps: float | None, args,
            log_dir: Path) -> dict[str, Any]:
  import mlperf_loadgen as lg

  settings = lg.TestSettings()
  settings.scenario = getattr(lg.TestScenario, scenario.loadgen)
  settings.mode = lg.TestMode.PerformanceOnly
  settings.use_token_latencies = True
  settings.min_duration_ms = int(args.duration * 1000)
  settings.min_query_count = args.min_queries if args.min_queries else len(samples)
  if scenario.loadgen == "Offline":
    # Offline issues max(min_query_count, expected_qps * min_duration) samples in one query.
    settings.offline_expected_qps = args.offline_qps
  else:
    settings.server_target_qps = qps
    settings.ttft_latency = int(scenario.ttft_s * 1e9)
    settings.tpot_latency = int(scenario.tpot_s * 1e9)
  log_settings = lg.LogSettings()
  log_dir.mkdir(parents=True, exist_ok=True)
  log_settings.log_output.outdir = str(log_dir)
  log_settings.log_output.copy_summary_to_stdout = False
  sut.responses.errors.clear()

  lg_sut = lg.ConstructSUT(sut.issue_queries, sut.flush_queries)
  qsl = lg.ConstructQSL(len(samples), len(samples), lambda idx: None, lambda idx: None)
  t = time.perf_counter()
  try:
    lg.StartTestWithLogSettings(lg_sut, qsl, settings, log_settings)
  finally:
    lg.DestroyQSL(qsl)
    lg.DestroySUT(lg_sut)
  seconds = time.perf_counter() - t
  return summarize(parse_detail_log(log_dir / "mlperf_log_detail.txt"), scenario, qps,
                   list(sut.responses.errors), seconds)


# ---- report ----------------------------------------------------------------------------------------


def _fmt(v, scale=1.0, digits=2) -> str:
  return "-" if v is None else f"{v * scale:.{digits}f}"


def print_table(rows: list[dict[str, Any]]) -> None:
  print("| scenario | SUT | target QPS | result | samples/s | tokens/s | TTFT p50 / p99 (ms) | "
        "TPOT p50 / p99 (ms) | queries | errors |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    ttft = f"{_fmt(r.get('ttft_p50_s'), 1e3, 0)} / {_fmt(r.get('ttft_p99_s'), 1e3, 0)}"
    tpot = f"{_fmt(r.get('tpot_p50_s'), 1e3, 1)} / {_fmt(r.get('tpot_p99_s'), 1e3, 1)}"
    verdict = r["result"] + (f" ({'; '.join(r['invalid_reasons'])})" if r["invalid_reasons"] else "")
    print(f"| {r['scenario']} | {r['sut']} | {_fmt(r['target_qps'])} | {verdict} | "
          f"{_fmt(r['samples_per_s'])} | {_fmt(r['tokens_per_s'], digits=1)} | {ttft} | {tpot} | "
          f"{r['queries']} | {r['errors']} |")


def plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
  """Throughput (x) against TTFT and TPOT percentiles (y), one point per target QPS."""
  online = [r for r in rows if r["scenario"] != "Offline" and r.get("ttft_p50_s") is not None]
  if not online:
    return None
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for ax, metric, label in ((axes[0], "ttft", "TTFT (s)"), (axes[1], "tpot", "TPOT (ms)")):
    scale = 1e3 if metric == "tpot" else 1.0
    for (scenario, sut) in sorted({(r["scenario"], r["sut"]) for r in online}):
      pts = sorted((r for r in online if (r["scenario"], r["sut"]) == (scenario, sut)),
                   key=lambda r: r["target_qps"])
      x = [r["tokens_per_s"] for r in pts]
      for pct, style in (("p50", "-o"), ("p99", "--s")):
        ax.plot(x, [r[f"{metric}_{pct}_s"] * scale for r in pts], style,
                label=f"{scenario} {sut} {pct}")
      for r in pts:
        ax.annotate(f"{r['target_qps']:g} qps", (r["tokens_per_s"], r[f"{metric}_p99_s"] * scale),
                    fontsize=7, textcoords="offset points", xytext=(3, 3))
      limit = pts[0][f"{metric}_limit_s"] * scale
      ax.axhline(limit, color="grey", lw=0.8, ls=":")
      ax.annotate(f"{scenario} limit", (x[0], limit), fontsize=7, color="grey")
    ax.set_xlabel("completed tokens/s")
    ax.set_ylabel(label)
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  offline = [r for r in rows if r["scenario"] == "Offline"]
  if offline:
    for ax in axes:
      for r in offline:
        ax.axvline(r["tokens_per_s"], color="tab:red", lw=0.8)
      ax.annotate("Offline tokens/s", (offline[0]["tokens_per_s"], ax.get_ylim()[0]), fontsize=7,
                  color="tab:red", rotation=90, va="bottom")
  fig.suptitle("jaxinfer under MLPerf LoadGen: latency percentiles vs throughput")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


# ---- main --------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M)")
  p.add_argument("--dtype", default="float32")
  p.add_argument("--sut", default="inprocess", help="inprocess, grpc, or both (comma-separated)")
  p.add_argument("--scenarios", default="Offline,Server,Interactive")
  p.add_argument("--qps", default="0.25,0.5,1,2", help="Server target QPS sweep")
  p.add_argument("--interactive-qps", default="0.25,0.5", help="Interactive target QPS sweep")
  p.add_argument("--offline-qps", type=float, default=1.5,
                 help="Offline expected QPS (LoadGen issues expected_qps x duration samples)")
  p.add_argument("--duration", type=float, default=60.0, help="minimum seconds per run (MLPerf: 600)")
  p.add_argument("--min-queries", type=int, default=0, help="minimum queries per run (default: the samples)")
  p.add_argument("--samples", type=int, default=None, help="use the first N prompts of the dataset")
  p.add_argument("--dataset", default=str(DATASET))
  p.add_argument("--max-num-seqs", type=int, default=64)
  p.add_argument("--max-num-batched-tokens", type=int, default=512)
  p.add_argument("--prefix-caching", action="store_true",
                 help="keep the prefix cache on (LoadGen repeats samples, so hits flatter TTFT)")
  p.add_argument("--out", default=str(RESULTS), help="folder for mlperf-<date>.json, its plot and LoadGen's logs")


def check_arguments(args: argparse.Namespace) -> argparse.Namespace:
  """Parses the comma lists into args.suts, scenario_list, qps_list, interactive_qps_list;
  UsageError names a bad one."""
  args.suts = [s.strip() for s in args.sut.split(",") if s.strip()]
  if "both" in args.suts:
    args.suts = ["inprocess", "grpc"]
  for s in args.suts:
    if s not in ("inprocess", "grpc"):
      raise UsageError(f"--sut: unknown SUT {s!r} (inprocess, grpc, both)")
  args.scenario_list = [s.strip() for s in args.scenarios.split(",") if s.strip()]
  for s in args.scenario_list:
    if s not in SCENARIOS:
      raise UsageError(f"--scenarios: unknown scenario {s!r} (known: {', '.join(SCENARIOS)})")
  try:
    args.qps_list = [float(q) for q in args.qps.split(",")]
    args.interactive_qps_list = [float(q) for q in args.interactive_qps.split(",")]
  except ValueError as e:
    raise UsageError(f"--qps / --interactive-qps: {e}") from None
  if any(q <= 0 for q in args.qps_list + args.interactive_qps_list) or args.offline_qps <= 0:
    raise UsageError("target QPS must be > 0")
  if args.duration <= 0:
    raise UsageError("--duration must be > 0")
  return args


def run(args: argparse.Namespace) -> int:
  check_arguments(args)
  try:
    import mlperf_loadgen  # noqa: F401
  except ImportError:
    print("jaxinfer bench mlperf needs mlcommons-loadgen: pip install -e '.[test]' (or pip install "
          "mlcommons-loadgen)", file=sys.stderr)
    return 2
  from jaxinfer import LLM, SamplingParams

  env = environment(args.command)

  engine_kw = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   enable_prefix_caching=args.prefix_caching)
  print(f"loading {args.model or 'the default model'} and warming up", file=sys.stderr, flush=True)
  llm = LLM(args.model, dtype=args.dtype, **engine_kw)
  samples = load_samples(Path(args.dataset), llm, args.samples)

  def params_for(s: Sample) -> SamplingParams:
    # Greedy, EOS honoured: the work per sample is the model's own answer, up to its target length.
    return SamplingParams(temperature=0.0, max_tokens=s.max_tokens)

  server_args = ["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
                 "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
  if args.model:
    server_args = ["--model", str(args.model)] + server_args
  if not args.prefix_caching:
    server_args.append("--no-prefix-caching")

  load_before = os.getloadavg()
  stamp = datetime.date.today().isoformat()
  out_dir = Path(args.out)
  logs = out_dir / "mlperf-logs"
  rows: list[dict[str, Any]] = []
  for sut_name in args.suts:
    sut = InProcessSUT(llm, samples, params_for) if sut_name == "inprocess" else \
        GrpcSUT(server_args, samples, params_for)
    try:
      for name in args.scenario_list:
        scenario = SCENARIOS[name]
        sweep = [None] if scenario.loadgen == "Offline" else (
            args.qps_list if name == "Server" else args.interactive_qps_list)
        for qps in sweep:
          tag = f"{sut_name}-{name}" + (f"-{qps:g}qps" if qps else "")
          print(f"running {tag}", file=sys.stderr, flush=True)
          row = run_one(sut, samples, scenario, qps, args, logs / tag)
          row["sut"] = sut_name
          rows.append(row)
    finally:
      sut.close()

  print_table(rows)
  png = plot(rows, out_dir / f"mlperf-{stamp}.png")
  payload = {
      "model": str(llm.source), "dtype": args.dtype, "dataset": str(Path(args.dataset).relative_to(ROOT))
      if Path(args.dataset).resolve().is_relative_to(ROOT) else args.dataset,
      "samples": len(samples), "engine": engine_kw,
      "run_rules": {"min_duration_s": args.duration, "min_queries": args.min_queries or len(samples),
                    "note": "shortened from MLPerf's 600 s; LoadGen's verdict is reported as given"},
      "scenarios": {k: dataclasses.asdict(v) for k, v in SCENARIOS.items() if k in args.scenario_list},
      "rows": rows, "plot": png.name if png else None,
      "loadgen_version": _loadgen_version(logs),
      # Other work on the machine inflates latencies; the 1-minute load average says how much there was.
      "load_average_1m": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2),
                          "cores": os.cpu_count()},
  }
  path = write_results("mlperf", payload, out_dir / f"mlperf-{stamp}.json", env=env)
  print(f"wrote {path}" + (f" and {png}" if png else ""), file=sys.stderr)
  return 0


def _loadgen_version(logs: Path) -> str | None:
  for detail in sorted(logs.glob("*/mlperf_log_detail.txt")):
    return parse_detail_log(detail).get("loadgen_version")
  return None

