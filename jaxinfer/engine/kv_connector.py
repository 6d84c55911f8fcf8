"""The seam through which a request's KV may come from, or go to, another worker.

Modelled on vLLM's v1 `KVConnectorBase_V1` (scheduler half), much smaller:

  consumer (a decode worker)                    producer (a prefill worker)
  ---------------------------                   ---------------------------
  get_num_new_matched_tokens(req, computed)     add_request(..., hold_kv=True): the request
    -> n prompt tokens will arrive remotely       runs to its first token as usual, but when it
  scheduler allocates pages for them, does        finishes its pages stay held (`request_finished`
    not compute them: the request waits           delays the free) until `release_kv`, called once
    (Status.WAITING_FOR_REMOTE_KV)                the transfer is acknowledged, cancelled or timed
  update_state_after_alloc(req, pages, n)         out
    -> the connector starts the transfer
  LLMEngine.import_kv(...) per chunk (engine thread), then
  LLMEngine.finish_remote_kv(id, first token)  -> the request runs on
  request_finished(req)  -> the connector stops a transfer still under way

Every hook runs on the engine's thread (the only one that touches the
engine); a connector that transfers asynchronously hands its results back
through the engine's command queue (serving/disagg.py does).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Sequence

from jaxinfer.errors import KVTransferError

if TYPE_CHECKING:
  from jaxinfer.engine.scheduler import Request
  from jaxinfer.models.cache import CacheSpec


__all__ = ["KVConnector", "KVLayout", "KVTransferError", "KVTransferTimeout"]


class KVTransferTimeout(KVTransferError):
  """A transfer did not complete within its timeout (a server answers DEADLINE_EXCEEDED)."""


@dataclasses.dataclass(frozen=True)
class KVLayout:
  """What two workers must agree on for one's pages to be the other's (page ids and pool
  sizes may differ): the wire form of a `CacheSpec` (jaxinfer.models.cache) at one page
  size, built by `from_cache_spec`. One page per layer is `[page_size, num_kv_heads,
  head_dim]` of `dtype`, for each of the cache's arrays (`names`, e.g. ('k', 'v')); an
  MLA layer's headless latent travels as one 'kv head' of head_dim r + R. A quantized
  cache (int8 / fp8) has `scale_groups` G > 0: after the values, each array's float32
  '<name>_scale' as `[page_size, num_kv_heads, G]` per page (G = 1: one per token and
  head; an MLA latent's G groups of its one 'head')."""

  num_layers: int
  page_size: int
  num_kv_heads: int
  head_dim: int
  dtype: str
  names: tuple[str, ...] = ("k", "v")
  scale_groups: int = 0

  @classmethod
  def from_cache_spec(cls, spec: "CacheSpec", page_size: int) -> "KVLayout":
    """The layout of `spec`'s pages; KVTransferError for a stack that mixes layer kinds
    (one KVLayout describes every layer alike)."""
    layer = spec.uniform_layer()
    if layer is None:
      kinds = sorted({l.kind for l in spec.layers})
      raise KVTransferError(f"the KV cache mixes layer kinds {kinds}: KVLayout describes one page "
                            "layout for every layer, so these pages cannot be transferred")
    values = [a for a in layer.arrays if a.dtype is None]  # a scale has its own dtype
    shapes = {a.shape for a in values}
    if len(shapes) != 1:
      raise KVTransferError(f"the KV cache's arrays {layer.names} have different token shapes {sorted(shapes)}")
    shape, = shapes
    heads, dim = shape if len(shape) == 2 else (1,) + shape
    groups = {math.prod(a.shape) // heads for a in layer.arrays if a.dtype is not None}
    if len(groups) > 1:
      raise KVTransferError(f"the KV cache's scale arrays have different group counts {sorted(groups)}")
    return cls(num_layers=len(spec.layers), page_size=page_size, num_kv_heads=heads, head_dim=dim,
               dtype=spec.dtype, names=tuple(a.name for a in values), scale_groups=max(groups, default=0))

  @property
  def scale_names(self) -> tuple[str, ...]:
    """The float32 scale arrays that follow the values on the wire ('k_scale', ...), if any."""
    return tuple(f"{n}_scale" for n in self.names) if self.scale_groups else ()

  @property
  def page_bytes(self) -> int:
    """Bytes of one page over every layer and array, scales included (what a transfer moves per page)."""
    import numpy as np
    tokens = self.num_layers * len(self.names) * self.page_size * self.num_kv_heads
    return tokens * (self.head_dim * np.dtype(self.dtype).itemsize + self.scale_groups * 4)

  def check_matches(self, other: "KVLayout", what: str = "the remote worker", *, page_size: bool = True) -> None:
    """KVTransferError naming every field that differs between self (ours) and `other`;
    `page_size=False`: theirs may differ (a transfer re-chunked token by token)."""
    diffs = [f"{f.name}: ours {getattr(self, f.name)!r}, {what}'s {getattr(other, f.name)!r}"
             for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)
             and (page_size or f.name != "page_size")]
    if diffs:
      raise KVTransferError(f"KV layout mismatch with {what}: " + "; ".join(diffs))


class KVConnector:
  """No remote KV: every hook is a no-op (what an engine without a connector does)."""

  def get_num_new_matched_tokens(self, req: "Request", num_computed: int) -> int:
    """Prompt tokens after the first `num_computed` (local prefix-cache hits) whose KV
    will arrive from elsewhere; 0: compute the request here as usual."""
    return 0

  def update_state_after_alloc(self, req: "Request", pages: Sequence[int], num_external_tokens: int) -> None:
    """The request's pages are allocated (its first `req.num_computed` tokens' pages are
    local cache hits); the remote tokens go into the pages after those."""

  def request_finished(self, req: "Request") -> bool:
    """The request ended (finished, aborted, failed). True: keep its pages held until
    `LLMEngine.release_kv` (a transfer still reads them)."""
    return False
