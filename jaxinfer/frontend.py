"""A model's request front door: prompts become token ids, and a request is checked once.

    front = Frontend.load(None)                  # config + tokenizer, no weights (a router's)
    text, ids = front.encode_prompt([{"role": "user", "content": "Hi"}])
    request = front.validate(ids, SamplingParams(max_tokens=8), prompt=text)   # or InvalidRequestError
    engine.add_request("r1", request)            # an engine takes its own frontend's requests unchecked

Every entry uses it: `LLM` (its engine's), the gRPC and HTTP servers (`serving.backend`'s
PromptMixin) and the router (built from the checkpoint's config and tokenizer alone). So a
request a router refuses is one a worker would refuse, in the same words; and a request is
validated where it enters, once: what passes is a `ValidRequest`, which downstream code
(the engine loop, the engine) takes as it is.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence, Union

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.engine.grammar import GrammarCompiler
from jaxinfer.errors import InvalidRequestError, TokenizerError
from jaxinfer.sampling import SamplingParams
from jaxinfer.tokenizer import Tokenizer

Prompt = Union[str, Sequence[int], Sequence[dict]]


@dataclasses.dataclass(frozen=True, eq=False)
class ValidRequest:
  """A request that `frontend` checked: its prompt ids, sampling params and prompt text."""

  prompt_token_ids: list[int]
  params: SamplingParams
  prompt: str | None
  frontend: "Frontend"

  def __len__(self) -> int:
    return len(self.prompt_token_ids)


class Frontend:
  """Prompt encoding and request checks for one model (see the module docstring).

  `max_model_len`: the context a request must fit (an engine's; a router takes its
  workers' once they answered, the model's own until then)."""

  def __init__(self, config: ModelConfig, tokenizer: Tokenizer | None, source: str, max_model_len: int | None = None):
    self.config, self.tokenizer, self.source = config, tokenizer, source
    self.max_model_len = max_model_len or config.max_position_embeddings
    self.grammars = GrammarCompiler(tokenizer, config.vocab_size)
    self.eos_ids = tuple(tokenizer.eos_ids) if tokenizer is not None else ()

  @classmethod
  def load(cls, model: str | Path | None) -> "Frontend":
    """Reads config and tokenizer of an HF dir, GGUF file or jaxinfer checkpoint
    (None: the embedded default model); no tensor is read."""
    from jaxinfer.checkpoint import detect_format, orbax_io
    if model is None:
      from jaxinfer.default_model import default_checkpoint
      model = default_checkpoint()
    path = Path(model).expanduser()
    kind = detect_format(path)
    if kind == "hf":
      from jaxinfer.checkpoint.hf import read_config
      return cls(read_config(path), Tokenizer.from_hf_dir(path), str(path))
    if kind == "orbax":
      manifest = orbax_io.read_manifest(path)
      tok = Tokenizer.load(path / "tokenizer") if (path / "tokenizer").is_dir() else None
      return cls(ModelConfig.from_dict(manifest["config"]), tok, str(path))
    from jaxinfer.checkpoint.gguf import open_reader, read_metadata
    reader = open_reader(path)  # memory-mapped: the tensors are not read
    meta = read_metadata(reader)
    return cls(ModelConfig.from_gguf(meta, {t.name for t in reader.tensors}), Tokenizer.from_gguf(meta),
               str(path))

  # ---- prompts -----------------------------------------------------------------

  def tokenizer_or_error(self, what: str) -> Tokenizer:
    """The tokenizer, or TokenizerError saying that `what` needs one (the model shipped none)."""
    if self.tokenizer is None:
      raise TokenizerError(f"{self.source} has no tokenizer files: {what} needs one "
                           "(pass token ids instead)")
    return self.tokenizer

  def encode_prompt(self, prompt: Prompt, apply_chat_template: bool = False) -> tuple[str | None, list[int]]:
    """(text or None, token ids) for one prompt: text, token ids, or a chat (a list of
    {'role', 'content'} dicts, rendered with the model's chat template). Token ids are
    checked; a text's are the tokenizer's."""
    text, ids = self._encode(prompt, apply_chat_template)
    return text, ids if text is not None else self.check_token_ids(ids)

  def request(self, prompt: Prompt, params: SamplingParams, apply_chat_template: bool = False) -> ValidRequest:
    """`encode_prompt` then `validate`, each check made once."""
    text, ids = self._encode(prompt, apply_chat_template)
    return self.validate(ids, params, text)

  def _encode(self, prompt: Prompt, apply_chat_template: bool) -> tuple[str | None, list]:
    if isinstance(prompt, str):
      if not prompt:
        raise InvalidRequestError("prompt is empty")
      tok = self.tokenizer_or_error("a text prompt")
      if apply_chat_template and tok.chat_template:
        return prompt, tok.encode_chat([{"role": "user", "content": prompt}])
      return prompt, tok.encode(prompt)
    prompt = list(prompt)
    if prompt and all(isinstance(m, dict) for m in prompt):
      tok = self.tokenizer_or_error("a chat prompt")
      text = tok.apply_chat_template(prompt)
      return text, tok.encode(text, add_special_tokens=False)
    return None, prompt

  def check_token_ids(self, token_ids: Sequence[int]) -> list[int]:
    """Token ids as Python ints, or InvalidRequestError: empty, not ints, out of the vocab."""
    ids = list(token_ids)
    if not ids:
      raise InvalidRequestError("prompt is empty")
    V = self.config.vocab_size
    for t in ids:
      if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
        raise InvalidRequestError(f"prompt token ids must be ints, got {t!r}")
      if not 0 <= t < V:
        raise InvalidRequestError(f"prompt token id {t} is out of range [0, {V})")
    return [int(t) for t in ids]

  def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams, prompt: str | None = None) -> ValidRequest:
    """The request, checked: ids in the vocabulary, prompt + max_tokens within
    max_model_len, a structured-output grammar that compiles (cached); else
    InvalidRequestError naming what is wrong."""
    if isinstance(prompt_token_ids, ValidRequest):
      if prompt_token_ids.frontend is self:
        return prompt_token_ids
      # Another frontend's (a router's, a different context): checked again here.
      prompt_token_ids, prompt = prompt_token_ids.prompt_token_ids, prompt_token_ids.prompt
    if not isinstance(params, SamplingParams):
      raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    ids = self.check_token_ids(prompt_token_ids)
    if len(ids) + params.max_tokens > self.max_model_len:
      raise InvalidRequestError(
          f"{len(ids)} prompt tokens + max_tokens={params.max_tokens} exceeds "
          f"max_model_len={self.max_model_len}")
    if params.structured is not None:
      self.grammars.check(params.structured)  # compiled once (cached): a bad schema fails here
    return ValidRequest(ids, params, prompt, self)
