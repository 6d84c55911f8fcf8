"""`jaxinfer.LLM`: the notebook / script front door.

    llm = LLM()                                    # embedded SmolLM2-135M-Instruct
    llm = LLM("path/to/hf_dir" | "model.gguf" | "checkpoints/name", dtype="bfloat16")
    outs = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=32))
    outs[0].text, outs[0].token_ids
    llm.logits([1, 2, 3])                          # [3, vocab] float32 next-token logits

A prompt is text, a list of token ids, or a chat (a list of
{'role', 'content'} dicts, rendered with the model's chat template).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence, Union

import numpy as np
from tqdm.auto import tqdm

from jaxinfer.checkpoint import load_model
from jaxinfer.errors import InvalidRequestError, TokenizerError
from jaxinfer.runner import Runner, bucket
from jaxinfer.sampling import SamplingParams, validate_per_request
from jaxinfer.tokenizer import Tokenizer

Prompt = Union[str, Sequence[int], Sequence[dict]]


@dataclasses.dataclass
class RequestOutput:
  """One finished request: the prompt, the new text and ids, and why it stopped."""

  prompt: str | None
  prompt_token_ids: list[int]
  text: str
  token_ids: list[int]
  logprobs: list[float]  # log-probability of each generated token
  finish_reason: str  # 'stop' (EOS, stop id or stop string) or 'length'


class LLM:
  """A model loaded for offline generation and evaluation."""

  def __init__(self, model: str | Path | None = None, dtype: str = "float32", *,
               max_batch_size: int = 16, max_model_len: int | None = None, mesh=None):
    """Loads `model` (None: the embedded default) onto devices.

    `mesh` (a jax.sharding.Mesh with axes ('data', 'expert', 'model')) shards
    the weights by their logical axes; default: the first device.
    """
    if model is None:
      from jaxinfer.default_model import default_checkpoint
      model = default_checkpoint()
    shardings_fn = None
    if mesh is not None:
      from jaxinfer.sharding import param_shardings
      shardings_fn = lambda cfg: param_shardings(cfg, mesh)
    loaded = load_model(model, dtype=dtype, shardings_fn=shardings_fn)
    self.config = loaded.config
    self.tokenizer: Tokenizer | None = loaded.tokenizer
    self.source = loaded.source
    self.dtype = dtype
    limit = self.config.max_position_embeddings
    self.max_model_len = min(limit, max_model_len or 4096)
    if max_batch_size < 1:
      raise InvalidRequestError(f"max_batch_size must be >= 1, got {max_batch_size}")
    self.runner = Runner(self.config, loaded.params, max_batch_size, self.max_model_len)

  # ---- prompts -----------------------------------------------------------------

  def _require_tokenizer(self, what: str) -> Tokenizer:
    if self.tokenizer is None:
      raise TokenizerError(f"{self.source} has no tokenizer files: {what} needs one "
                           "(pass token ids instead)")
    return self.tokenizer

  def encode_prompt(self, prompt: Prompt, apply_chat_template: bool = False) -> tuple[str | None, list[int]]:
    """(text or None, token ids) for one prompt, validated."""
    if isinstance(prompt, str):
      if not prompt:
        raise InvalidRequestError("prompt is empty")
      tok = self._require_tokenizer("a text prompt")
      if apply_chat_template and tok.chat_template:
        return prompt, tok.encode_chat([{"role": "user", "content": prompt}])
      return prompt, tok.encode(prompt)
    prompt = list(prompt)
    if not prompt:
      raise InvalidRequestError("prompt is empty")
    if all(isinstance(m, dict) for m in prompt):
      tok = self._require_tokenizer("a chat prompt")
      text = tok.apply_chat_template(prompt)
      return text, tok.encode(text, add_special_tokens=False)
    ids = []
    for t in prompt:
      if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
        raise InvalidRequestError(f"prompt token ids must be ints, got {t!r}")
      if not 0 <= t < self.config.vocab_size:
        raise InvalidRequestError(f"prompt token id {t} is out of range [0, {self.config.vocab_size})")
      ids.append(int(t))
    return None, ids

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

  def generate(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
               apply_chat_template: bool = False, use_tqdm: bool = False) -> list[RequestOutput]:
    """Generates for every prompt; returns outputs in prompt order.

    `apply_chat_template=True` wraps text prompts as a single user turn.
    """
    plist = self._as_prompt_list(prompts)
    if not plist:
      return []
    params = validate_per_request(sampling_params, len(plist))
    encoded = [self.encode_prompt(p, apply_chat_template) for p in plist]
    for i, ((_, ids), sp) in enumerate(zip(encoded, params)):
      if len(ids) + sp.max_tokens > self.max_model_len:
        raise InvalidRequestError(
            f"prompt {i}: {len(ids)} prompt tokens + max_tokens={sp.max_tokens} exceeds "
            f"max_model_len={self.max_model_len}")
    outputs: list[RequestOutput | None] = [None] * len(plist)
    size = self.runner.batch_buckets[-1]
    # Similar lengths together waste less padding.
    order = sorted(range(len(plist)), key=lambda i: len(encoded[i][1]))
    bar = tqdm(total=len(plist), desc="generating", unit="req", disable=not use_tqdm)
    for start in range(0, len(order), size):
      group = order[start:start + size]
      results = self._generate_group([encoded[i][1] for i in group], [params[i] for i in group])
      for i, (text, ids, logprobs, reason) in zip(group, results):
        outputs[i] = RequestOutput(encoded[i][0], encoded[i][1], text, ids, logprobs, reason)
      bar.update(len(group))
    bar.close()
    return outputs  # type: ignore[return-value]

  def _generate_group(self, prompts: list[list[int]], params: list[SamplingParams]):
    n = len(prompts)
    seeds = np.random.default_rng().integers(0, 2**32, n, dtype=np.uint32)
    sampling = dict(
        temperature=np.array([p.temperature for p in params], np.float32),
        top_k=np.array([p.top_k for p in params], np.int32),
        top_p=np.array([p.top_p for p in params], np.float32),
        min_p=np.array([p.min_p for p in params], np.float32),
        seed=np.array([p.seed if p.seed is not None else s for p, s in zip(params, seeds)], np.uint32),
    )
    slots = max(len(p) + sp.max_tokens for p, sp in zip(prompts, params))
    slots = bucket(slots, self.runner.len_buckets)
    cache, ids, logprobs = self.runner.prefill(prompts, sampling, slots)
    eos = set(self.tokenizer.eos_ids) if self.tokenizer else set()
    seqs = [_Sequence(p, sp, eos, self.tokenizer) for p, sp in zip(prompts, params)]
    while True:
      ids_h, logprobs_h = np.asarray(ids), np.asarray(logprobs)
      for i, s in enumerate(seqs):
        if not s.finished:
          s.append(int(ids_h[i]), float(logprobs_h[i]))
      if all(s.finished for s in seqs):
        break
      positions = np.array([len(s.prompt) + len(s.ids) - 1 for s in seqs], np.int32)
      last = np.array([s.ids[-1] for s in seqs], np.int32)
      cache, ids, logprobs = self.runner.decode(cache, last, positions, sampling)
    return [(s.text(), s.ids, s.logprobs, s.finish_reason) for s in seqs]

  # ---- evaluation --------------------------------------------------------------

  def logits(self, token_ids: Sequence[int]) -> np.ndarray:
    """Next-token logits at every position: float32 [len(token_ids), vocab]."""
    _, ids = self.encode_prompt(list(token_ids))
    if len(ids) > self.max_model_len:
      raise InvalidRequestError(f"{len(ids)} token ids exceed max_model_len={self.max_model_len}")
    return self.runner.logits(ids)


class _Sequence:
  """Host-side state of one generating request: ids, stop checks, text."""

  def __init__(self, prompt: list[int], params: SamplingParams, eos: set[int], tokenizer):
    self.prompt = prompt
    self.params = params
    self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos)
    self.ids: list[int] = []
    self.logprobs: list[float] = []
    self.finished = False
    self.finish_reason = ""
    self._detok = tokenizer.detokenizer() if tokenizer is not None else None
    self._stop_text: str | None = None

  def append(self, token: int, logprob: float) -> None:
    self.ids.append(token)
    self.logprobs.append(logprob)
    if self._detok is not None:
      self._detok.push(token)
      if self.params.stop:
        text = self._detok.text
        hits = [text.find(s) for s in self.params.stop if s in text]
        if hits:
          self._stop_text = text[:min(hits)]
          self.finished, self.finish_reason = True, "stop"
          return
    if token in self.stop_ids:
      self.finished, self.finish_reason = True, "stop"
    elif len(self.ids) >= self.params.max_tokens:
      self.finished, self.finish_reason = True, "length"

  def text(self) -> str:
    if self._detok is None:
      return ""
    if self._stop_text is not None:
      return self._stop_text
    return self._detok.tokenizer.decode(self.ids)
