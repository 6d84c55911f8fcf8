"""The `jaxinfer` command line.

  jaxinfer generate "What is the capital of France?"       # embedded default model
  jaxinfer generate --model path/to/model.gguf "Hello" "Bonjour"
  jaxinfer generate --input prompts.jsonl --output out.jsonl  # offline batch, resumable
  jaxinfer serve --port 50051 --metrics-port 9090              # gRPC server, drains on SIGTERM
  jaxinfer serve --http-port 8000                              # + OpenAI-compatible HTTP, same engine
  jaxinfer serve --role prefill --port 50061                   # disaggregation: prefill worker (KVTransfer)
  jaxinfer serve --role decode --prefill-workers 127.0.0.1:50061  # decode worker: prompts' KV from there
  jaxinfer route --model M --workers HOST:PORT,HOST:PORT       # KV-aware router over `serve` workers of M
  jaxinfer route --model M --prefill-workers P1,P2 --decode-workers D1,D2  # ... over prefill/decode workers
  jaxinfer generate --mesh 1,1,8 "Hi"                          # tensor parallel over 8 devices
  jaxinfer serve --mesh 2,1,8 --coordinator HOST0:1234 --num-processes 2 --process-id I  # 2 hosts
  jaxinfer convert path/to/hf_dir_or.gguf [checkpoints/name]
  jaxinfer eplb plan --counts counts.json --devices 8 --redundant 8 -o placement.json  # MoE expert placement
  jaxinfer serve --mesh 1,8,1 --eplb placement.json                                  # ... served with it

Errors a user can cause print one line (`jaxinfer: error: ...`) and exit 1.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from jaxinfer.errors import JaxinferError


def _generate(args: argparse.Namespace) -> None:
  from jaxinfer.errors import InvalidRequestError
  from jaxinfer.sampling import SamplingParams

  if bool(args.prompts) == bool(args.input):
    raise InvalidRequestError("give prompts or --input FILE.jsonl (not both)")
  if args.input and not args.output:
    raise InvalidRequestError("--input needs --output FILE.jsonl (results are appended there)")
  params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens,
                          stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos,
                          repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty)
  llm = _load_llm(args, progress=args.input is not None, warmup=args.warmup)
  if _follow(llm):
    return
  try:
    _generate_with(llm, args, params)
  finally:
    llm.close()


def _generate_with(llm, args: argparse.Namespace, params) -> None:
  if args.input and not args.quiet:
    e = llm.engine
    print(f"KV cache: {e.kv_summary()}; {e.runner.compiled_programs()} programs compiled", file=sys.stderr)
  if args.input:
    from jaxinfer.offline import generate_jsonl
    s = generate_jsonl(llm, args.input, args.output, params,
                       apply_chat_template=not args.no_chat_template, progress=not args.quiet)
    print(f"{s.done} generated, {s.errors} errors, {s.skipped} already done; "
          f"{s.generated_tokens} tokens in {s.seconds:.1f} s ({s.tokens_per_s:.1f} tok/s) -> {args.output}",
          file=sys.stderr)
    return
  outputs = llm.generate(args.prompts, params, apply_chat_template=not args.no_chat_template)
  for prompt, out in zip(args.prompts, outputs):
    if len(args.prompts) > 1:
      print(f"### {prompt}")
    print(out.text.strip())


def _engine_options(args: argparse.Namespace) -> dict:
  """EngineConfig fields from the shared engine flags."""
  engine = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, page_size=args.page_size, num_pages=args.num_pages,
                enable_prefix_caching=not args.no_prefix_caching, attention_impl=args.attention_impl,
                kv_cache_dtype=args.kv_cache_dtype, async_scheduling=args.async_scheduling)
  if args.speculative_method is not None:
    engine["speculative"] = {"method": args.speculative_method,
                             "num_speculative_tokens": args.num_speculative_tokens,
                             "relaxed_top_n": args.speculative_relaxed_top_n,
                             "relaxed_delta": args.speculative_relaxed_delta}
  if args.kv_cache_gb is not None:
    engine["kv_cache_bytes"] = int(args.kv_cache_gb * 2**30)
  if args.dp_balance_timeout is not None:
    engine["dp_balance"] = ({"hold_prefill": False} if args.dp_balance_timeout == 0
                            else {"timeout": args.dp_balance_timeout})
  if args.eplb is not None or args.eplb_redundant is not None or args.eplb_replan_interval:
    engine["eplb"] = {"placement": args.eplb, "num_redundant_experts": args.eplb_redundant or 0,
                      "replan_interval": args.eplb_replan_interval, "window": args.eplb_window}
  return engine


def _load_llm(args: argparse.Namespace, **options):
  """The LLM the flags describe, joined to its multi-host job first when --coordinator is given."""
  from jaxinfer.errors import InvalidRequestError
  from jaxinfer.llm import LLM

  if args.coordinator is None and args.num_processes != 1:
    raise InvalidRequestError("--num-processes needs --coordinator HOST:PORT")
  if args.coordinator is not None:
    from jaxinfer import distributed
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  mesh = None
  if args.mesh is not None:
    from jaxinfer.sharding import make_mesh
    try:
      data, expert, model = (int(x) for x in args.mesh.split(","))
    except ValueError:
      raise InvalidRequestError(f"--mesh must be DATA,EXPERT,MODEL (three ints), got {args.mesh!r}") from None
    mesh = make_mesh(data, expert, model)
  elif args.coordinator is not None:
    raise InvalidRequestError("a multi-host job needs --mesh DATA,EXPERT,MODEL over all processes' devices")
  if args.attention_dp:
    if mesh is None or mesh.shape["data"] < 2:
      raise InvalidRequestError("--attention-dp splits the KV pool over the mesh's data axis: give "
                                "--mesh DATA,EXPERT,MODEL with DATA >= 2")
    options["sharding_rules"] = {"pages": "data"}
  return LLM(args.model, dtype=args.dtype, mesh=mesh, **options, **_engine_options(args))


def _follow(llm) -> bool:
  """On a multi-host follower: runs the leader's device calls until it is done; True if so."""
  from jaxinfer import distributed
  if not distributed.is_multi_host() or distributed.is_leader():
    return False
  import jax
  calls = distributed.follow(llm.runner)
  print(f"jaxinfer: process {jax.process_index()} ran {calls} device calls from the leader", file=sys.stderr)
  return True


def _serve(args: argparse.Namespace) -> None:
  import logging

  from jaxinfer.serving.router import expand_addresses
  from jaxinfer.serving.server import ServerConfig, serve

  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  for noisy in ("jax", "absl"):  # backend probing and orbax's restore chatter are not news
    logging.getLogger(noisy).setLevel(logging.WARNING)
  config = ServerConfig(host=args.host, port=args.port, max_waiting_requests=args.max_waiting_requests,
                        max_waiting_tokens=args.max_waiting_tokens, grace_period_s=args.grace_period,
                        metrics_port=args.metrics_port, http_port=args.http_port,
                        served_model_name=args.served_model_name, role=args.role,
                        prefill_workers=expand_addresses(
                            [a.strip() for a in (args.prefill_workers or "").split(",") if a.strip()],
                            "--prefill-workers"),
                        kv_transfer_timeout_s=args.kv_transfer_timeout)
  # The server warms up on its engine thread, so health says NOT_SERVING meanwhile.
  llm = _load_llm(args, warmup=False)
  if _follow(llm):
    return
  try:
    code = serve(llm, config)
  finally:
    llm.close()
  if code:
    raise SystemExit(code)


def _route(args: argparse.Namespace) -> None:
  import logging

  from jaxinfer.errors import InvalidRequestError
  from jaxinfer.frontend import Frontend
  from jaxinfer.serving.router import RouterBackend, RouterOptions, expand_addresses, named_workers
  from jaxinfer.serving.server import ServerConfig, serve

  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

  def entries(flag: str) -> list[str]:
    return [a.strip() for a in (getattr(args, flag.replace("-", "_")) or "").split(",") if a.strip()]

  def addresses(flag: str) -> tuple[str, ...]:
    return expand_addresses(entries(flag), f"--{flag}")

  worker_entries = tuple(entries("workers"))
  # Something to re-read (a dns: entry, a file): followed every --resolve-interval seconds.
  follow = args.workers_file is not None or any(a.startswith("dns:") for a in worker_entries)
  interval = args.resolve_interval if args.resolve_interval is not None else (10.0 if follow else 0.0)
  try:
    workers = named_workers(worker_entries, args.workers_file)
  except OSError as e:
    raise InvalidRequestError(f"--workers-file: {e}") from None
  options = RouterOptions(workers=workers, prefill_workers=addresses("prefill-workers"),
                          decode_workers=addresses("decode-workers"), policy=args.policy,
                          overlap_weight=args.overlap_weight,
                          request_weight=args.request_weight, temperature=args.temperature,
                          health_interval_s=args.health_interval, connect_timeout_s=args.connect_timeout,
                          worker_entries=worker_entries if interval else (),
                          workers_file=args.workers_file if interval else None, resolve_interval_s=interval)
  config = ServerConfig(host=args.host, port=args.port, grace_period_s=args.grace_period,
                        metrics_port=args.metrics_port, http_port=args.http_port,
                        served_model_name=args.served_model_name)
  # Tokenizer and config only: the workers hold the weights.
  code = serve(RouterBackend(Frontend.load(args.model), options), config)
  if code:
    raise SystemExit(code)


def _add_model_options(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", default=None,
                 help="HF dir, .gguf file or jaxinfer checkpoint (default: embedded SmolLM2-135M-Instruct)")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--max-num-seqs", type=int, default=None,
                 help="sequences per step (max batch); default by backend: 64 on a CPU, 256 on a GPU")
  p.add_argument("--max-num-batched-tokens", type=int, default=None,
                 help="tokens per step; default by backend: 512 on a CPU, 8192 on a GPU")
  p.add_argument("--max-model-len", type=int, default=None, help="context length (default: min(model's, 4096))")
  p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
  p.add_argument("--num-pages", type=int, default=None, help="KV pages (default: from --kv-cache-gb)")
  p.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache budget (default: 1 on CPU; on a GPU, 85%% of its allocator's limit less the weights)")
  p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8", "fp8"],
                 help="KV cache dtype: auto = the model's; int8 / fp8 store it quantized (a float32 scale "
                      "per token and kv head), so about 2-4x more tokens fit")
  p.add_argument("--no-prefix-caching", action="store_true")
  p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                 help="schedule and pack step n+1 while the device runs step n (default: on) "
                      "(with --speculative-method mtp too; ngram drafts need each step's tokens on "
                      "the host, so those steps do not overlap)")
  p.add_argument("--attention-impl", default="auto", choices=["auto", "xla", "pallas", "pallas_interpret", "mosaic", "mosaic_interpret"],
                 help="attention kernel: auto = Mosaic GPU on sm_90 under jax >= 0.11, else Pallas (Triton) on GPU, XLA elsewhere")
  p.add_argument("--speculative-method", default=None, choices=["ngram", "mtp"],
                 help="speculative decoding: ngram = prompt lookup, mtp = the model's MTP head (default: off)")
  p.add_argument("--num-speculative-tokens", type=int, default=3,
                 help="drafts per step with --speculative-method (1-8)")
  p.add_argument("--speculative-relaxed-top-n", type=int, default=0, metavar="N",
                 help="relaxed acceptance (lossy; default 0 = off): greedy requests also accept a draft "
                      "among the target's N most likely tokens, within --speculative-relaxed-delta of "
                      "the top token's probability")
  p.add_argument("--speculative-relaxed-delta", type=float, default=0.0, metavar="P",
                 help="with --speculative-relaxed-top-n: how far below the top probability a draft may be")
  p.add_argument("--eplb", default=None, metavar="PLACEMENT.json",
                 help="MoE expert-parallel load balancing: lay the experts out by this placement "
                      "(`jaxinfer eplb plan`; redundant copies of hot experts over the EP devices)")
  p.add_argument("--eplb-redundant", type=int, default=None, metavar="N",
                 help="EPLB without a placement file: N redundant expert slots, planned from even load "
                      "and then from measured load with --eplb-replan-interval")
  p.add_argument("--eplb-replan-interval", type=int, default=0, metavar="STEPS",
                 help="EPLB: re-plan the placement every STEPS engine steps from the last --eplb-window "
                      "steps' expert counts and move the expert weights between steps (default 0: never)")
  p.add_argument("--eplb-window", type=int, default=256, metavar="STEPS",
                 help="EPLB: steps of expert counts each re-plan looks at (default 256)")
  p.add_argument("--mesh", default=None, metavar="DATA,EXPERT,MODEL",
                 help="shard over a (data, expert, model) device mesh, e.g. 1,1,8 (default: one device)")
  p.add_argument("--attention-dp", action="store_true",
                 help="attention data parallelism: the KV pool's pages split over the mesh's DATA ranks, "
                      "each request on one rank (needs --mesh with DATA >= 2)")
  p.add_argument("--dp-balance-timeout", type=int, default=None, metavar="STEPS",
                 help="attention DP: steps a request's prefill may be held back so that no rank runs "
                      "ahead of the others (default 4; 0 turns the hold off)")
  p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                 help="multi-host: the jax.distributed coordinator (process 0's address); every process "
                      "runs the same command with its own --process-id")
  p.add_argument("--num-processes", type=int, default=1, help="multi-host: processes in the job")
  p.add_argument("--process-id", type=int, default=0,
                 help="multi-host: this process (0 leads: it schedules and serves; the others follow)")


def _convert(args: argparse.Namespace) -> None:
  from pathlib import Path

  from jaxinfer.checkpoint import convert
  from jaxinfer.default_model import checkpoints_dir

  dst = args.dst or checkpoints_dir() / Path(args.src).stem.lower()
  path = convert(args.src, dst, dtype=args.dtype, overwrite=args.overwrite, quantize=args.quantize)
  print(f"wrote {path}")


def _eplb_plan(args: argparse.Namespace) -> None:
  import numpy as np

  from jaxinfer.models.eplb import load_counts, plan

  counts = load_counts(args.counts)
  placement = plan(counts, args.devices, args.redundant, num_hosts=args.hosts, num_groups=args.groups)
  placement.save(args.output)
  loads = placement.device_loads(counts)  # [L, n]
  plain = counts.reshape(len(counts), args.devices, -1).sum(axis=2) if counts.shape[1] % args.devices == 0 else None
  ratio = lambda l: float(np.max(l.max(axis=1) / np.maximum(l.mean(axis=1), 1e-12)))
  before = f"{ratio(plain):.3f} with one expert per slot in order, " if plain is not None else ""
  print(f"wrote {args.output}: {placement.num_layers} layer(s), {placement.num_slots} slots over {args.devices} "
        f"devices; busiest device / mean (worst layer, from these counts): {before}{ratio(loads):.3f} placed",
        file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jaxinfer", description="JAX/XLA LLM inference engine")
  sub = parser.add_subparsers(dest="command", required=True)

  gen = sub.add_parser("generate", help="generate text for prompts (offline)")
  gen.add_argument("prompts", nargs="*", help="prompt texts (or use --input)")
  gen.add_argument("--input", help="JSON Lines of requests (see jaxinfer.offline)")
  gen.add_argument("--output", help="JSON Lines results, appended; ids already there are skipped")
  gen.add_argument("--quiet", action="store_true", help="no progress bar")
  gen.add_argument("--warmup", action="store_true",
                   help="compile every step bucket before generating (default: each when first used; "
                        "the same bounded set of programs, and a short job compiles only what it runs)")
  _add_model_options(gen)
  gen.add_argument("--max-tokens", type=int, default=128)
  gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
  gen.add_argument("--top-k", type=int, default=0)
  gen.add_argument("--top-p", type=float, default=1.0)
  gen.add_argument("--min-p", type=float, default=0.0)
  gen.add_argument("--seed", type=int, default=None)
  gen.add_argument("--stop", action="append", help="stop string (repeatable)")
  gen.add_argument("--ignore-eos", action="store_true")
  gen.add_argument("--repetition-penalty", type=float, default=1.0)
  gen.add_argument("--presence-penalty", type=float, default=0.0)
  gen.add_argument("--frequency-penalty", type=float, default=0.0)
  gen.add_argument("--no-chat-template", action="store_true",
                   help="send prompts raw instead of as a chat user turn")
  gen.set_defaults(func=_generate)

  srv = sub.add_parser("serve", help="run the gRPC server (jaxinfer.v1.Inference; --http-port: also OpenAI HTTP) until SIGTERM")
  _add_model_options(srv)
  srv.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
  srv.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
  srv.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port)")
  srv.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                        "/v1/models, /health, /metrics) on this port, same engine (0: any free port)")
  srv.add_argument("--served-model-name", default=None,
                   help="the model name the HTTP API answers to (default: the model's basename)")
  srv.add_argument("--max-waiting-requests", type=int, default=256,
                   help="admitted requests without a first token yet; more get RESOURCE_EXHAUSTED")
  srv.add_argument("--max-waiting-tokens", type=int, default=131072,
                   help="prompt tokens of those waiting requests; more get RESOURCE_EXHAUSTED")
  srv.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM/SIGINT")
  srv.add_argument("--role", default="both", choices=["both", "prefill", "decode"],
                   help="prefill/decode disaggregation: prefill = also serve jaxinfer.v1.KVTransfer (run prompts "
                        "to their first token for decode workers); decode = take each prompt's KV from "
                        "--prefill-workers; both = neither (default)")
  srv.add_argument("--prefill-workers", default=None,
                   help="--role decode: comma-separated prefill worker gRPC addresses, HOST:PORT,...; "
                        "dns:HOST:PORT stands for every address HOST resolves to at start (as in route)")
  srv.add_argument("--kv-transfer-timeout", type=float, default=60.0,
                   help="seconds a KV transfer may take (decode: request to pages imported, else "
                        "DEADLINE_EXCEEDED; prefill: first token to the decode worker's Ack, else pages freed)")
  srv.set_defaults(func=_serve)

  rt = sub.add_parser("route", help="run a KV-aware router (jaxinfer.v1.Inference; --http-port: also OpenAI "
                                     "HTTP) in front of `jaxinfer serve` workers of one model")
  rt.add_argument("--workers", default=None,
                  help="comma-separated worker gRPC addresses, HOST:PORT,...; dns:HOST:PORT stands for every "
                       "address HOST resolves to (e.g. a Kubernetes headless Service), resolved again every "
                       "--resolve-interval: pods that come are added, pods that go are drained")
  rt.add_argument("--workers-file", default=None,
                  help="more worker addresses, one per line or comma-separated (# comments), read at start and "
                       "again every --resolve-interval: workers can be added and removed while the router runs")
  rt.add_argument("--resolve-interval", type=float, default=None,
                  help="seconds between re-reads of --workers dns: entries and --workers-file (default 10 when "
                       "there is one of them, else the workers are fixed; 0: fixed)")
  rt.add_argument("--prefill-workers", default=None,
                  help="disaggregated, instead of --workers: `serve --role prefill` workers (HOST:PORT or "
                       "dns:HOST:PORT, comma-separated), picked per request by cached prefix (--policy)")
  rt.add_argument("--decode-workers", default=None,
                  help="disaggregated: `serve --role decode` workers, picked by load; each one's "
                       "--prefill-workers must include every --prefill-workers address here, spelled the same")
  rt.add_argument("--model", default=None,
                  help="the model the workers serve (HF dir, .gguf or checkpoint; default: the embedded one): "
                       "only its tokenizer and config are read, to tokenize and validate requests here")
  rt.add_argument("--policy", default="kv", choices=["kv", "round_robin"],
                  help="kv: the worker with the best cached-prefix / load cost (default); round_robin: in turn")
  rt.add_argument("--overlap-weight", type=float, default=1.0,
                  help="cost of a prompt block the worker must compute, vs 1 per block it is already running")
  rt.add_argument("--request-weight", type=float, default=0.0, help="cost per request the worker is running")
  rt.add_argument("--temperature", type=float, default=0.0,
                  help="0: always the cheapest worker; > 0: sample softmax(-cost / (temperature * spread))")
  rt.add_argument("--health-interval", type=float, default=1.0, help="seconds between worker health checks")
  rt.add_argument("--connect-timeout", type=float, default=120.0,
                  help="seconds each worker may take to turn SERVING at start before the router gives up")
  rt.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
  rt.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
  rt.add_argument("--http-port", type=int, default=None, help="also serve the OpenAI-compatible HTTP API here")
  rt.add_argument("--metrics-port", type=int, default=None,
                  help="serve the router's Prometheus metrics at http://HOST:PORT/metrics (0: any free port)")
  rt.add_argument("--served-model-name", default=None,
                  help="the model name the HTTP API answers to (default: the model's basename)")
  rt.add_argument("--grace-period", type=float, default=30.0,
                  help="seconds in-flight requests may take to finish after SIGTERM/SIGINT")
  rt.set_defaults(func=_route)

  ep = sub.add_parser("eplb", help="MoE expert-parallel load balancing: plan an expert placement")
  ep_sub = ep.add_subparsers(dest="eplb_command", required=True)
  pl = ep_sub.add_parser("plan", help="write a placement (redundant slots for hot experts, packed by load) "
                                      "from recorded expert counts")
  pl.add_argument("--counts", required=True,
                  help='JSON: {"expert_tokens": [[...], ...]} ([MoE layers, experts]: LLMEngine.expert_tokens '
                       'as a list), the same list bare, or {"moe_expert_tokens": [...]} (LLMEngine.stats(), '
                       'summed over layers: one placement for every layer)')
  pl.add_argument("--devices", type=int, required=True, help="expert-parallel devices (the mesh's 'experts' split)")
  pl.add_argument("--redundant", type=int, default=0, help="extra expert slots (experts + redundant must "
                                                           "divide by --devices)")
  pl.add_argument("--hosts", type=int, default=1, help="hosts the devices span: expert groups are packed onto "
                                                       "hosts first (default 1)")
  pl.add_argument("--groups", type=int, default=1, help="expert groups (DeepSeek-V3's n_group) for --hosts > 1")
  pl.add_argument("-o", "--output", required=True, help="the placement JSON to write")
  pl.set_defaults(func=_eplb_plan)

  conv = sub.add_parser("convert", help="convert an HF dir or GGUF file into a jaxinfer (orbax) checkpoint")
  conv.add_argument("src")
  conv.add_argument("dst", nargs="?", help="output dir (default: checkpoints/<source name>)")
  conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="dtype stored on disk")
  conv.add_argument("--quantize", default=None, choices=["int8", "fp8", "int4", "int8-channel"],
                    help="store linear weights quantized: int8 + float32 scales and mins per group of 32 "
                         "inputs, the LM head int8 per group of 32 (GGUF Q8_0 blocks kept as stored); "
                         "int8-channel (opt-in, faster, less accurate) and fp8 (e4m3) + per-channel float32 "
                         "scales, int8-channel's head per column; int4 + float16 scales and mins per group "
                         "of 32 (GGUF Q4_0 / Q4_1 blocks kept as stored), its head as int8's; fp8 keeps the "
                         "head, and embeddings and norms keep --dtype")
  conv.add_argument("--overwrite", action="store_true")
  conv.set_defaults(func=_convert)

  # `jaxinfer bench ...` is dispatched by main() before this parser runs (jaxinfer.bench parses
  # its own subcommands, importing only the one that runs); listed here for --help.
  from jaxinfer.bench import SUBCOMMANDS  # names only: no benchmark module is imported
  sub.add_parser("bench", add_help=False,
                 help=f"run a benchmark: {', '.join(SUBCOMMANDS)} (`jaxinfer bench --help`); writes JSON "
                      "under benchmarks/results/")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["bench"]:
    from jaxinfer.bench import main as bench_main
    return bench_main(argv[1:])
  args = build_parser().parse_args(argv)
  try:
    args.func(args)
  except JaxinferError as e:
    print(f"jaxinfer: error: {e}", file=sys.stderr)
    return 1
  except KeyboardInterrupt:
    print("jaxinfer: interrupted", file=sys.stderr)
    return 130
  return 0


if __name__ == "__main__":
  sys.exit(main())
