"""`jaxinfer.LLM`: the notebook / script front door.

    llm = LLM()                                    # embedded SmolLM2-135M-Instruct
    llm = LLM("path/to/hf_dir" | "model.gguf" | "checkpoints/name", dtype="bfloat16")
    outs = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=32))
    outs[0].text, outs[0].token_ids
    for delta in llm.stream(["Tell me a story"]):  # incremental outputs, for notebooks
      print(delta.new_text, end="")
    llm.logits([1, 2, 3])                          # [3, vocab] float32 next-token logits

Every call goes through one `LLMEngine` (continuous batching over a paged,
prefix-cached KV cache); `llm.engine` is there for anything finer.

A prompt is text, a list of token ids, or a chat (a list of
{'role', 'content'} dicts, rendered with the model's chat template).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from jaxinfer.engine.engine import EngineConfig, LLMEngine, RequestOutput
from jaxinfer.errors import InvalidRequestError
from jaxinfer.frontend import Prompt
from jaxinfer.sampling import SamplingParams, validate_per_request
from jaxinfer.tokenizer import Tokenizer

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


class LLM:
  """A model loaded for offline generation and evaluation."""

  def __init__(self, model: str | Path | None = None, dtype: str = "float32", *, mesh=None,
               sharding_rules: dict | None = None, progress: bool = False,
               quantization: str | None = None, **engine_options: Any):
    """Loads `model` (None: the embedded default) onto devices and warms the engine up.

    `mesh` (a jax.sharding.Mesh with axes ('data', 'expert', 'model'), e.g.
    `jaxinfer.sharding.make_mesh(model=4)`) shards the weights and the KV
    cache by their logical axes (jaxinfer.sharding.RULES); default: the first
    device. `sharding_rules` overrides rules, each a mesh axis, a tuple of
    them, or None to replicate: e.g. {"kv_heads": None} replicates the KV
    heads when there are fewer than the 'model' axis splits (what vLLM does
    implicitly; here a ShardingError names the tensor and suggests this).
    `quantization` ('int8', 'fp8', 'int4' or 'int8-channel') stores linear
    weights quantized: int8 in groups of 32 inputs with a scale and a min
    each, and the LM head int8 in groups of 32 (near-lossless: the default
    model's greedy answers are float32's); int4 in groups of 32 with scales
    and mins, its head as int8's; fp8 e4m3 with per-channel scales, the head
    kept float; 'int8-channel' (opt-in) one int8 scale per channel and the
    head per embedding column: the fastest int8 at batch 1, and the least
    accurate (quantized at load; a checkpoint converted with `--quantize`, a
    GGUF's Q8_0 tensors as int8 and its Q4_0 / Q4_1 tensors as int4 load
    directly); see jaxinfer.quant.leaf_layout.
    `engine_options` are `EngineConfig` fields (max_model_len, max_num_seqs,
    max_num_batched_tokens, page_size, num_pages, kv_cache_bytes,
    enable_prefix_caching, warmup, compilation_cache_dir, attention_impl,
    speculative, e.g. {"method": "ngram", "num_speculative_tokens": 3}; eplb,
    MoE expert placement: a file from `jaxinfer eplb plan`, or e.g.
    {"num_redundant_experts": 8, "replan_interval": 100}, see jaxinfer.models.eplb;
    async_scheduling; scan_layers: layers under lax.scan, None for the backend's default).
    """
    known = set(EngineConfig.__dataclass_fields__)
    unknown = sorted(set(engine_options) - known)
    if unknown:
      raise InvalidRequestError(f"unknown LLM option(s) {unknown}; engine options are {sorted(known)}")
    self.engine = LLMEngine.from_model(model, dtype, EngineConfig(**engine_options), mesh=mesh,
                                       sharding_rules=sharding_rules, progress=progress,
                                       quantization=quantization)
    self.config = self.engine.config
    self.frontend = self.engine.frontend
    self.tokenizer: Tokenizer | None = self.engine.tokenizer
    self.source = self.engine.source
    self.dtype = dtype
    self.quantization = quantization
    self.max_model_len = self.engine.max_model_len
    self.runner = self.engine.runner
    self._ids = itertools.count()

  # ---- prompts -----------------------------------------------------------------

  def tokenizer_or_error(self, what: str) -> Tokenizer:
    """The tokenizer, or TokenizerError saying that `what` needs one (the model shipped none)."""
    return self.frontend.tokenizer_or_error(what)

  def encode_prompt(self, prompt: Prompt, apply_chat_template: bool = False) -> tuple[str | None, list[int]]:
    """(text or None, token ids) for one prompt, validated (jaxinfer.frontend)."""
    return self.frontend.encode_prompt(prompt, apply_chat_template)

  @staticmethod
  def _as_prompt_list(prompts: Any) -> list[Prompt]:
    if isinstance(prompts, str):
      return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, (int, np.integer)) for p in prompts):
      return [prompts]  # one prompt of token ids
    if prompts and all(isinstance(p, dict) for p in prompts):
      return [prompts]  # one chat
    return prompts

  # ---- generation --------------------------------------------------------------

  def _add(self, prompts: Any, sampling_params: Any, apply_chat_template: bool, stream: bool) -> list[str]:
    """Validates every prompt first (a bad one queues nothing), then queues them all
    (`stream`: each step reports their progress; else only their ends)."""
    plist = self._as_prompt_list(prompts)
    params = validate_per_request(sampling_params, len(plist))
    valid = []
    for i, (p, sp) in enumerate(zip(plist, params)):
      try:
        valid.append(self.frontend.request(p, sp, apply_chat_template))
      except InvalidRequestError as e:
        raise InvalidRequestError(f"prompt {i}: {e}") from None
    ids = []
    for request in valid:
      rid = f"llm-{next(self._ids)}"
      self.engine.add_request(rid, request, stream=stream)
      ids.append(rid)
    return ids

  def generate(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
               apply_chat_template: bool = False, use_tqdm: bool = False) -> list[RequestOutput]:
    """Generates for every prompt (all batched together); returns outputs in prompt order.

    `sampling_params` is one SamplingParams for all, or a list with one per
    prompt. `apply_chat_template=True` wraps text prompts as a single user turn.
    """
    order = self._add(prompts, sampling_params, apply_chat_template, stream=False)
    if not order:
      return []
    final: dict[str, RequestOutput] = {}
    bar = tqdm(total=len(order), desc="generating", unit="req", disable=not use_tqdm)
    try:
      for out in self._run(order):
        if out.finished:
          final[out.request_id] = out
          bar.update(1)
    finally:
      bar.close()
    return [final[rid] for rid in order]

  def stream(self, prompts: Prompt | Sequence[Prompt],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             apply_chat_template: bool = False) -> Iterator[RequestOutput]:
    """Yields each request's outputs as they grow (`new_text`, `new_token_ids` are deltas; the
    cumulative `token_ids` / `logprobs` of an unfinished output are read-only views, as they
    were when it was made: `engine.output.Prefix`).

    Requests of one call are batched together, so outputs of different
    prompts interleave: `out.index` is the prompt's position in `prompts`.
    Leaving the loop early aborts what is still running.
    """
    ids = self._add(prompts, sampling_params, apply_chat_template, stream=True)
    index = {rid: i for i, rid in enumerate(ids)}
    for out in self._run(ids):
      out.index = index[out.request_id]
      yield out

  def chat(self, messages: Sequence[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
    """One chat turn: the reply to `messages` ([{'role', 'content'}, ...])."""
    return self.generate([list(messages)], sampling_params)[0]

  def _run(self, request_ids: list[str]) -> Iterator[RequestOutput]:
    pending = set(request_ids)
    try:
      while pending:
        for out in self.engine.step():
          if out.request_id in pending:
            if out.finished:
              pending.discard(out.request_id)
            yield out
    finally:
      for rid in pending:  # the caller stopped early, or a step failed
        self.engine.abort(rid)

  # ---- evaluation --------------------------------------------------------------

  def logits(self, token_ids: Sequence[int]) -> np.ndarray:
    """Next-token logits at every position: float32 [len(token_ids), vocab]."""
    _, ids = self.encode_prompt(list(token_ids))
    if len(ids) > self.max_model_len:
      raise InvalidRequestError(f"{len(ids)} token ids exceed max_model_len={self.max_model_len}")
    return self.runner.logits(ids)

  def close(self) -> None:
    """Multi-host: lets the follower processes finish (see jaxinfer.distributed); else nothing."""
    self.engine.close()
