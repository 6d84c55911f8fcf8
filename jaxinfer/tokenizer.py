"""Tokenizers: HF tokenizer.json, sentencepiece .model, and vocabularies embedded in GGUF.

`Tokenizer` wraps one backend (the `tokenizers` library or sentencepiece)
with what generation needs: BOS/EOS ids, chat templates rendered with jinja2
from the model's own metadata, and `IncrementalDetokenizer` for streaming
text that never splits a multi-byte UTF-8 character.

GGUF vocabularies are rebuilt into the same two backends: 'gpt2' (byte-level
BPE) into a `tokenizers` BPE model, 'llama' (sentencepiece) into a
sentencepiece ModelProto. A converted checkpoint stores the backend's own
file plus `tokenizer_meta.json`, so loading never needs the source again.
"""

from __future__ import annotations

import functools

import json
import re
from pathlib import Path
from typing import Any, Sequence

import jinja2
import jinja2.sandbox
import sentencepiece as spm
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from jaxinfer.errors import InvalidRequestError, TokenizerError

META_FILE = "tokenizer_meta.json"

# GGUF token types (same numbering as sentencepiece's piece types).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split patterns by GGUF `tokenizer.ggml.pre` (llama.cpp's names).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2_pre_tokenizer(pre: str | None):
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre in (None, "default", "gpt-2", "gpt2"):
    return byte_level
  if pre == "smollm":  # gpt2 regex with every digit split on its own
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
  if split is None:
    raise TokenizerError(f"GGUF pre-tokenizer {pre!r} is not supported "
                         "(supported: gpt-2, smollm, llama-bpe, qwen2)")
  return pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
  ])


class Tokenizer:
  """Text <-> token ids for one model."""

  def __init__(self, backend: tokenizers.Tokenizer | spm.SentencePieceProcessor, *,
               bos_id: int | None, eos_ids: Sequence[int], add_bos: bool,
               chat_template: str | None, special_tokens: Sequence[str] = (),
               legacy: bool = False):
    self.backend = backend
    # sentencepiece only: legacy=True puts a dummy-prefix space before the text after
    # every special token (old HF Llama behaviour); False only at the start of the text
    # (HF legacy=False and llama.cpp).
    self.legacy = legacy
    self.bos_id = bos_id
    self.eos_ids = tuple(int(i) for i in eos_ids)
    self.add_bos = add_bos  # True: we prepend BOS (sentencepiece); tokenizer.json does its own
    self.chat_template = chat_template
    self._is_spm = isinstance(backend, spm.SentencePieceProcessor)
    self.special_tokens = tuple(special_tokens)
    # sentencepiece does not parse special tokens inside text: split on them ourselves.
    self._special_re = (re.compile("(" + "|".join(map(re.escape, sorted(self.special_tokens, key=len, reverse=True))) + ")")
                        if self._is_spm and self.special_tokens else None)
    self._special_ids = {self.token_to_id(t) for t in self.special_tokens} - {None}
    self._template = None
    self._spm_no_prefix = _without_dummy_prefix(backend) if self._is_spm else None

  # ---- basics ----------------------------------------------------------------

  @functools.cached_property
  def vocab_size(self) -> int:
    if self._is_spm:
      return self.backend.get_piece_size()
    return self.backend.get_vocab_size(with_added_tokens=True)

  def token_to_id(self, token: str) -> int | None:
    if self._is_spm:
      i = self.backend.piece_to_id(token)
      return None if i == self.backend.unk_id() and token != self.backend.id_to_piece(i) else i
    return self.backend.token_to_id(token)

  def id_to_token(self, token_id: int) -> str:
    if self._is_spm:
      return self.backend.id_to_piece(token_id)
    return self.backend.id_to_token(token_id)

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`; special token strings in the text become their ids."""
    if not isinstance(text, str):
      raise InvalidRequestError(f"prompt must be a string, got {type(text).__name__}")
    if not self._is_spm:
      return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
    ids: list[int] = []
    if add_special_tokens and self.add_bos and self.bos_id is not None:
      ids.append(self.bos_id)
    parts = self._special_re.split(text) if self._special_re else [text]
    after_special = False
    for part in parts:
      if not part:
        continue
      if part in self.special_tokens:
        ids.append(self.token_to_id(part))
        after_special = True
      else:
        sp = self._spm_no_prefix if after_special and not self.legacy else self.backend
        ids.extend(sp.encode(part))
    return ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    # Models often pad their vocab past the tokenizer's (for matmul shapes): ids
    # there have no text. A model may still sample one, so it decodes to "".
    n = self.vocab_size
    ids = [int(i) for i in ids if 0 <= int(i) < n]
    if self._is_spm:
      if skip_special_tokens:
        ids = [i for i in ids if i not in self._special_ids and not self.backend.is_control(i)]
      return self.backend.decode(ids)
    return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

  def detokenizer(self) -> "IncrementalDetokenizer":
    return IncrementalDetokenizer(self)

  # ---- chat ------------------------------------------------------------------

  def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                          add_generation_prompt: bool = True) -> str:
    """Renders chat messages with the model's own template (jinja2, sandboxed)."""
    validate_messages(messages)
    if not self.chat_template:
      raise TokenizerError("this model has no chat template; pass a plain text prompt instead")
    if self._template is None:
      env = jinja2.sandbox.ImmutableSandboxedEnvironment(
          trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
      env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
      env.globals["raise_exception"] = _raise_template_error
      try:
        self._template = env.from_string(self.chat_template)
      except jinja2.TemplateError as e:
        raise TokenizerError(f"the model's chat template does not parse: {e}") from None
    bos = self.id_to_token(self.bos_id) if self.bos_id is not None else ""
    eos = self.id_to_token(self.eos_ids[0]) if self.eos_ids else ""
    try:
      return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                   bos_token=bos, eos_token=eos)
    except jinja2.TemplateError as e:
      raise InvalidRequestError(f"messages: the chat template rejected them: {e}") from None

  def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
    # The rendered template spells BOS itself where the model wants one.
    return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

  # ---- persistence -----------------------------------------------------------

  def save(self, directory: str | Path) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if self._is_spm:
      (directory / "tokenizer.model").write_bytes(self.backend.serialized_model_proto())
    else:
      self.backend.save(str(directory / "tokenizer.json"))
    meta = dict(bos_id=self.bos_id, eos_ids=list(self.eos_ids), add_bos=self.add_bos,
                chat_template=self.chat_template, special_tokens=list(self.special_tokens),
                legacy=self.legacy)
    (directory / META_FILE).write_text(json.dumps(meta, indent=1))

  @classmethod
  def load(cls, directory: str | Path) -> "Tokenizer":
    """Loads what `save` wrote."""
    directory = Path(directory)
    try:
      meta = json.loads((directory / META_FILE).read_text())
    except (OSError, ValueError) as e:
      raise TokenizerError(f"{directory / META_FILE}: cannot read tokenizer metadata ({e})") from None
    if (directory / "tokenizer.model").exists():
      backend = _load_spm(directory / "tokenizer.model")
    else:
      backend = _load_tokenizer_json(directory / "tokenizer.json")
    return cls(backend, bos_id=meta["bos_id"], eos_ids=meta["eos_ids"], add_bos=meta["add_bos"],
               chat_template=meta["chat_template"], special_tokens=meta.get("special_tokens", ()),
               legacy=meta.get("legacy", False))

  # ---- sources ---------------------------------------------------------------

  @classmethod
  def from_hf_dir(cls, directory: str | Path) -> "Tokenizer | None":
    """The tokenizer of a Hugging Face model dir, or None when it ships no tokenizer files."""
    directory = Path(directory)
    if (directory / "tokenizer.json").exists():
      backend = _load_tokenizer_json(directory / "tokenizer.json")
      is_spm = False
    elif (directory / "tokenizer.model").exists():
      backend = _load_spm(directory / "tokenizer.model")
      is_spm = True
    else:
      return None
    config = _read_json(directory / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
      template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (directory / "chat_template.jinja").exists():
      template = (directory / "chat_template.jinja").read_text()

    def token_id(entry) -> int | None:
      if isinstance(entry, dict):
        entry = entry.get("content")
      if not entry:
        return None
      return backend.piece_to_id(entry) if is_spm else backend.token_to_id(entry)

    bos_id = token_id(config.get("bos_token"))
    eos = _read_json(directory / "generation_config.json").get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not eos_ids and token_id(config.get("eos_token")) is not None:
      eos_ids = [token_id(config.get("eos_token"))]
    if is_spm:
      special = [e["content"] for e in config.get("added_tokens_decoder", {}).values() if e.get("special")]
      for key in ("bos_token", "eos_token"):
        entry = config.get(key)
        entry = entry.get("content") if isinstance(entry, dict) else entry
        if entry and entry not in special:
          special.append(entry)
    else:
      special = []
    return cls(backend, bos_id=bos_id, eos_ids=eos_ids,
               add_bos=is_spm and bool(config.get("add_bos_token", True)),
               chat_template=template, special_tokens=special,
               legacy=bool(config.get("legacy", True)))  # transformers' default

  @classmethod
  def from_gguf(cls, meta: dict[str, Any]) -> "Tokenizer | None":
    """Rebuilds the vocabulary embedded in GGUF metadata; None when the file has none."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
      return None
    types = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    special = [t for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)]
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = [meta["tokenizer.ggml.eos_token_id"]] if "tokenizer.ggml.eos_token_id" in meta else []
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and eot not in eos_ids:
      eos_ids.append(eot)
    template = meta.get("tokenizer.chat_template")
    if kind == "gpt2":
      merges = meta.get("tokenizer.ggml.merges") or []
      bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                       merges=[tuple(m.split(" ", 1)) for m in merges])
      backend = tokenizers.Tokenizer(bpe)
      backend.pre_tokenizer = _gpt2_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
      backend.decoder = decoders.ByteLevel()
      backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
      add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
      if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
      return cls(backend, bos_id=bos_id, eos_ids=eos_ids, add_bos=False, chat_template=template,
                 special_tokens=special)
    if kind == "llama":
      from sentencepiece import sentencepiece_model_pb2 as pb
      proto = pb.ModelProto()
      scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
      for token, score, ty in zip(tokens, scores, types):
        proto.pieces.add(piece=token, score=float(score), type=int(ty))
      proto.trainer_spec.model_type = pb.TrainerSpec.BPE
      proto.trainer_spec.vocab_size = len(tokens)
      proto.trainer_spec.byte_fallback = _BYTE in types
      unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
      proto.trainer_spec.unk_id = int(unk)
      proto.trainer_spec.bos_id = int(bos_id) if bos_id is not None else -1
      proto.trainer_spec.eos_id = int(eos_ids[0]) if eos_ids else -1
      proto.trainer_spec.pad_id = -1
      proto.normalizer_spec.name = "identity"
      proto.normalizer_spec.add_dummy_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
      proto.normalizer_spec.remove_extra_whitespaces = False
      proto.normalizer_spec.escape_whitespaces = True
      backend = spm.SentencePieceProcessor()
      try:
        backend.LoadFromSerializedProto(proto.SerializeToString())
      except RuntimeError as e:
        raise TokenizerError(f"GGUF sentencepiece vocabulary is malformed: {e}") from None
      return cls(backend, bos_id=bos_id, eos_ids=eos_ids,
                 add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
                 chat_template=template,
                 special_tokens=special)
    raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)")


class IncrementalDetokenizer:
  """Turns a growing list of token ids into text deltas.

  Each delta is the text the newest tokens add, decoded in the context of a
  few tokens before them (sentencepiece drops a leading space at the start
  of a decode, and byte-level BPE splits one UTF-8 character over several
  tokens). A delta is held back while the text ends in U+FFFD, i.e. while a
  character is still incomplete, so no delta ever carries a broken character.
  With a Hugging Face tokenizer, its `DecodeStream` does the same in one Rust
  call per token (a third of the two decodes' host time; the engine runs this
  for every sequence at every step).
  """

  def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
    self.tokenizer = tokenizer
    self.skip_special_tokens = skip_special_tokens
    self.ids: list[int] = []
    self.text = ""
    self._prefix = 0  # start of the context window
    self._read = 0  # tokens before this are already in self.text
    self._stream = None if tokenizer._is_spm else decoders.DecodeStream(skip_special_tokens=skip_special_tokens)

  def push(self, token_id: int) -> str:
    self.ids.append(int(token_id))
    if self._stream is not None:
      if not 0 <= token_id < self.tokenizer.vocab_size:
        return ""  # a padded vocab's id past the tokenizer's: no text (as `decode` has it)
      delta = self._stream.step(self.tokenizer.backend, int(token_id)) or ""
      self.text += delta
      return delta
    decode = lambda ids: self.tokenizer.decode(ids, self.skip_special_tokens)
    before = decode(self.ids[self._prefix:self._read])
    after = decode(self.ids[self._prefix:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
      delta = after[len(before):]
      self._prefix, self._read = self._read, len(self.ids)
      self.text += delta
      return delta
    return ""


def _without_dummy_prefix(sp: spm.SentencePieceProcessor) -> spm.SentencePieceProcessor:
  """A copy of a sentencepiece model that does not prepend a space to its input."""
  from sentencepiece import sentencepiece_model_pb2 as pb
  proto = pb.ModelProto()
  proto.ParseFromString(sp.serialized_model_proto())
  proto.normalizer_spec.add_dummy_prefix = False
  out = spm.SentencePieceProcessor()
  out.LoadFromSerializedProto(proto.SerializeToString())
  return out


def validate_messages(messages: Any) -> None:
  if not isinstance(messages, (list, tuple)) or not messages:
    raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} dicts")
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
      raise InvalidRequestError(
          f"messages[{i}] must be a dict with string 'role' and 'content', got {m!r}"[:200])


def _raise_template_error(message: str):
  raise jinja2.TemplateError(message)


def _read_json(path: Path) -> dict[str, Any]:
  if not path.exists():
    return {}
  try:
    return json.loads(path.read_text())
  except ValueError as e:
    raise TokenizerError(f"{path}: not valid JSON ({e})") from None


def _load_tokenizer_json(path: Path) -> tokenizers.Tokenizer:
  try:
    return tokenizers.Tokenizer.from_file(str(path))
  except Exception as e:  # the library raises a bare Exception on bad files
    raise TokenizerError(f"{path}: not a valid tokenizer.json ({e})") from None


def _load_spm(path: Path) -> spm.SentencePieceProcessor:
  sp = spm.SentencePieceProcessor()
  try:
    sp.Load(str(path))
  except (OSError, RuntimeError) as e:
    raise TokenizerError(f"{path}: not a valid sentencepiece model ({e})") from None
  return sp
