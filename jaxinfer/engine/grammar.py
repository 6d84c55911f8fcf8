"""Structured output: grammars compiled by llguidance, one matcher per request, token bitmasks.

    compiler = GrammarCompiler(tokenizer, vocab_size)
    compiler.check(StructuredOutput(json_schema=...))    # InvalidRequestError naming the field
    g = compiler.matcher(structured)                      # per request, fresh state
    fill_bitmasks([(g, row, drafts)], allowed)            # allowed [L, W] int32, W = ceil(V / 32)
    g.consume(token)                                      # every committed token
    g.finished                                            # only EOS could follow: the request stops

Why llguidance: it is one self-contained wheel (Rust, no Python
dependencies), computes a 49k-token mask in tens of microseconds from an
Earley parser over a token trie, and takes JSON schema, regex and Lark
directly. xgrammar, the other common choice, imports torch, transformers and
triton at runtime, which jaxinfer does not allow as runtime dependencies.

The mask layout is llguidance's: bit (i % 32) of int32 word i // 32 allows
token i. Rows of unconstrained requests are all ones (-1), so one [L, W]
array goes to every step and no request adds a compiled shape.

Model vocabularies are often padded past the tokenizer's (SmolLM2's is not,
the tiny test Llama's is 320 for 302 tokens): ids the tokenizer does not have
are never allowed, whatever llguidance does with them.

Legend: L logits rows, V the model's vocab, W = ceil(V / 32) mask words.
"""

from __future__ import annotations

import collections
import json
import threading
from typing import Sequence

import llguidance as llg
import llguidance.numpy as llg_np
import numpy as np

from jaxinfer.errors import InvalidRequestError, JaxinferError, TokenizerError
from jaxinfer.structured import StructuredOutput
from jaxinfer.tokenizer import Tokenizer

# JSON is generated compact with the usual separators: flexible whitespace lets a
# model pad forever (a random-weight model does) and never changes the value.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 128  # compiled grammars kept (LRU); a matcher for a cached one is a deep copy


class GrammarError(JaxinferError):
  """A matcher rejected a committed token: the mask and the matcher disagree (a bug)."""


def mask_words(vocab_size: int) -> int:
  return (vocab_size + 31) // 32


def grammar_text(structured: StructuredOutput) -> str:
  """The llguidance grammar (its JSON form) of one StructuredOutput."""
  kind = structured.kind
  if kind == "json_schema":
    return llg.LLMatcher.grammar_from_json_schema(structured.json_schema, overrides=JSON_OPTIONS)
  if kind == "json_object":
    return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
  if kind == "regex":
    return llg.LLMatcher.grammar_from_regex(structured.regex)
  # A Lark alternation of string literals; JSON string escaping is valid Lark.
  return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in structured.choice))


class Grammar:
  """One request's matcher: the grammar state after its committed output tokens."""

  def __init__(self, matcher: llg.LLMatcher, num_tokens: int):
    self.matcher = matcher
    self.num_tokens = num_tokens  # the tokenizer's; ids past it (vocab padding) are never allowed

  def consume(self, token: int) -> None:
    if not self.matcher.consume_token(token):
      raise GrammarError(f"the grammar rejected committed token {token}: {self.matcher.get_error()}")

  def valid_prefix(self, tokens: Sequence[int]) -> int:
    """How many of `tokens` the grammar accepts in order from here (the state is unchanged)."""
    return self.matcher.validate_tokens(list(tokens)) if tokens else 0

  @property
  def finished(self) -> bool:
    """Nothing but EOS can follow: the output is complete."""
    return self.matcher.is_stopped()


class GrammarCompiler:
  """Compiles StructuredOutputs for one tokenizer and model vocab; thread-safe
  (servers validate requests on their event loop while the engine thread steps)."""

  def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, cache_size: int = CACHE_SIZE):
    self.tokenizer = tokenizer
    self.vocab_size = vocab_size
    self.words = mask_words(vocab_size)
    self.cache_size = cache_size
    self._ll_tokenizer: llg.LLTokenizer | None = None
    self._compiled: collections.OrderedDict[StructuredOutput, llg.LLMatcher] = collections.OrderedDict()
    self._lock = threading.Lock()

  @property
  def ll_tokenizer(self) -> llg.LLTokenizer:
    """Built on first use: ~0.3 s for a 49k vocabulary, paid only by engines that see structured requests."""
    with self._lock:
      if self._ll_tokenizer is None:
        if self.tokenizer is None:
          raise TokenizerError("structured output needs the model's tokenizer, and this engine has none")
        self._ll_tokenizer = ll_tokenizer(self.tokenizer, self.vocab_size)
      return self._ll_tokenizer

  def check(self, structured: StructuredOutput) -> None:
    """Compiles (or finds) the grammar; InvalidRequestError naming the field if it is rejected."""
    self._template(structured)

  def matcher(self, structured: StructuredOutput) -> Grammar:
    return Grammar(self._template(structured).deep_copy(), self.tokenizer.vocab_size)

  def _template(self, structured: StructuredOutput) -> llg.LLMatcher:
    tok = self.ll_tokenizer
    with self._lock:
      m = self._compiled.get(structured)
      if m is not None:
        self._compiled.move_to_end(structured)
        return m
    # Compile outside the lock (llguidance drops the GIL; a big schema takes ~100 ms).
    try:
      text = grammar_text(structured)
    except ValueError as e:
      raise InvalidRequestError(f"structured.{structured.kind}: {e}") from None
    m = llg.LLMatcher(tok, text, log_level=0)
    if m.is_error():
      raise InvalidRequestError(f"structured.{structured.kind}: {_summary(m.get_error())}")
    # A grammar can compile and still match nothing (regex '[a&&b]'): its first mask
    # leaves the matcher in error. Caught here, such a request is refused up front
    # instead of ending at once with an empty output.
    probe = m.deep_copy()
    probe.compute_bitmask()
    if probe.is_error():
      raise InvalidRequestError(f"structured.{structured.kind}: no output can satisfy it "
                                f"({_summary(probe.get_error())})")
    with self._lock:
      self._compiled[structured] = m
      while len(self._compiled) > self.cache_size:
        self._compiled.popitem(last=False)
    return m


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llg.LLTokenizer:
  """An llguidance tokenizer over our Tokenizer, with n_vocab = the model's vocab.

  A `tokenizers` backend hands over its JSON. A sentencepiece one becomes a
  byte string per piece ('▁' -> ' ', '<0xAB>' -> that byte, control pieces
  as llguidance's special tokens: 0xFF + name), and encodes without the dummy
  prefix space (llguidance re-tokenizes text fragments, not whole prompts).
  """
  n_vocab = max(vocab_size, tokenizer.vocab_size)
  eos = list(tokenizer.eos_ids)
  if not eos:
    raise TokenizerError("structured output needs an EOS token, and this tokenizer has none")
  if not tokenizer._is_spm:
    return llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=n_vocab, eos_token=eos)
  sp = tokenizer.backend
  tokens, special = [], []
  for i in range(sp.get_piece_size()):
    piece = sp.id_to_piece(i)
    if sp.is_byte(i):
      tokens.append(bytes([int(piece[3:5], 16)]))
    elif sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i) or i in tokenizer._special_ids:
      tokens.append(b"\xff" + piece.encode())
      special.append(i)
    else:
      tokens.append(piece.replace("\u2581", " ").encode())
  plain = tokenizer._spm_no_prefix

  class _SentencePiece:
    eos_token_id = eos[0]
    bos_token_id = tokenizer.bos_id
    special_token_ids = special

    def __init__(self):
      self.tokens = tokens

    def __call__(self, text: bytes) -> list[int]:
      return plain.encode(text.decode("utf-8", errors="replace"))

  return llg.LLTokenizer(llg.TokenizerWrapper(_SentencePiece()), n_vocab=n_vocab, eos_token=eos)


_executor: llg.LLExecutor | None = None


def fill_bitmasks(items: Sequence[tuple[Grammar, int, Sequence[int]]], allowed: np.ndarray) -> None:
  """Writes allowed-token masks into allowed [L, W] int32 (rows not named stay as they are).

  Each item (grammar, row, drafts) fills row `row` with the mask of the
  grammar's current state and rows row + 1 .. row + len(drafts) with the
  masks after drafts[:1], drafts[:2], ... (a verified sequence's logits
  rows). The drafts must be a prefix the grammar accepts (`valid_prefix`).
  Ids the tokenizer does not have (vocab padding) are cleared.
  """
  global _executor
  if not items:
    return
  if _executor is None:
    _executor = llg.LLExecutor()
  L, W = allowed.shape
  # llguidance writes masks of its own n_vocab: wider than W when the tokenizer has
  # more tokens than the model has logits.
  words = max(mask_words(g.num_tokens) for g, _, _ in items)
  buf = allowed if words <= W else np.zeros((L, words), np.int32)
  # llguidance's draft variant refuses empty draft lists: rows without drafts go separately.
  plain = [(g.matcher, row) for g, row, d in items if not len(d)]
  drafted = [(g.matcher, row, list(d)) for g, row, d in items if len(d)]
  if plain:
    llg_np.fill_next_token_bitmask_par(_executor, plain, buf)
  if drafted:
    llg_np.fill_next_token_bitmask_par_with_draft_tokens(_executor, drafted, buf)
  for g, row, d in items:
    rows = slice(row, row + 1 + len(d))
    if buf is not allowed:
      allowed[rows] = buf[rows, :W]
    cut = g.num_tokens
    if cut < W * 32:
      allowed[rows, cut // 32] &= np.int32((1 << (cut % 32)) - 1)
      allowed[rows, cut // 32 + 1:] = 0


def _summary(message: str) -> str:
  """llguidance's error on one line: its first line plus the regex parser's `error:` line,
  without the caret diagrams of the generated grammar (positions the user never wrote)."""
  lines = [l.strip() for l in message.strip().splitlines()]
  keep = lines[:1] + [l for l in lines[1:] if l.startswith("error:")]
  return " ".join(keep) or "rejected"
