"""Host-side KV page pool with reference counts and a prefix cache.

The device cache (jaxinfer.models.cache) holds `num_pages` pages of
`page_size` tokens per layer; this class decides which page ids each
request owns. A request's token i lives in page
`pages[i // page_size]` at offset `i % page_size`:

    tokens   | 0 .. 15 | 16 .. 31 | 32 .. 40 ------|
    pages    |   p7    |   p3     |   p12 (partial)|
    hashes   |   h0    | h1(h0,..)|   -            |   only full, final blocks

A full block whose KV is final (its tokens verified, not speculative) is
hashed with its parent's hash, `h_i = H(h_{i-1}, tokens of block i)`, so a
hash names the whole prefix up to and including that block. A later request
whose prompt starts with the same blocks takes those pages by reference
instead of computing them. Pages nobody references but that hold a cached
block stay cached until the pool runs dry, then go least recently used first.

Every block that enters or leaves the cache is published as a `KVEvent`
(a KV-aware router keeps a global index from them). Page 0 is never handed
out: padding tokens of a step write their KV there.

Attention data parallelism (`num_shards` > 1: the pool is split along its
pages over the mesh's 'data' axis): shard s owns the contiguous pages
[s * N/shards, (s + 1) * N/shards) and never hands out its first one (its
own padding page). A request lives on one shard, chosen at its first
allocation, and every page it ever gets, prefix hits included, is from that
shard. A block is cached once, on the shard that computed it first; a
request on another shard recomputes it (it does not hit, and its copy is
not published, so a router's index sees one page per hash).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Sequence

import numpy as np

NULL_PAGE = 0


def hash_block(parent: int | None, token_ids: Sequence[int]) -> int:
  """Chained block hash, stable across processes (a router compares workers' hashes)."""
  return hash_blocks(token_ids, len(token_ids), parent)[0]


def hash_blocks(token_ids: Sequence[int], block_size: int, parent: int | None = None,
                num_blocks: int | None = None) -> list[int]:
  """The chain of hashes of the full blocks of `token_ids` (or its first `num_blocks`).

  hash_blocks(t, ps)[i] == hash_block(hash_blocks(t, ps)[i - 1], t[i*ps:(i+1)*ps]).
  The tokens become bytes once; a 2k-token prompt hashes in ~60 us instead
  of ~300 us block by block (the router hashes every prompt it routes).
  """
  data = np.asarray(token_ids, np.int64).tobytes()
  n = len(token_ids) // block_size if num_blocks is None else num_blocks
  step = 8 * block_size
  blake2b = hashlib.blake2b
  prev = b"root" if parent is None else parent.to_bytes(8, "little")
  out = []
  for i in range(n):
    prev = blake2b(prev + data[i * step:(i + 1) * step], digest_size=8).digest()
    out.append(int.from_bytes(prev, "little"))
  return out


@dataclasses.dataclass(frozen=True)
class KVEvent:
  """A cached block appeared ('stored') or was evicted ('removed')."""

  kind: str
  block_hash: int
  parent_hash: int | None = None
  token_ids: tuple[int, ...] = ()


class KVManager:
  """Page ids, reference counts and the prefix cache for one device cache."""

  def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
               num_shards: int = 1):
    if num_shards < 1 or num_pages % num_shards:
      raise ValueError(f"num_pages={num_pages} must split into num_shards={num_shards} equal shards")
    if num_pages // num_shards < 2:
      raise ValueError(f"num_pages must be >= 2 per shard (each shard's first page is reserved), "
                       f"got {num_pages} for {num_shards} shards")
    if page_size < 1:
      raise ValueError(f"page_size must be >= 1, got {page_size}")
    self.num_pages = num_pages
    self.page_size = page_size
    self.enable_prefix_caching = enable_prefix_caching
    self.num_shards = num_shards
    self.shard_pages = num_pages // num_shards
    n = self.shard_pages
    self._free: list[collections.deque[int]] = [collections.deque(range(s * n + 1, (s + 1) * n))
                                                for s in range(num_shards)]
    self._ref = [0] * num_pages
    self._page_hash: dict[int, int] = {}
    self._hash_page: dict[int, int] = {}
    # Per shard: unreferenced pages that still hold a cached block, least recently used first.
    self._evictable: list[collections.OrderedDict[int, None]] = [collections.OrderedDict()
                                                                 for _ in range(num_shards)]
    self._pages: dict[str, list[int]] = {}
    self._hashes: dict[str, list[int]] = {}  # the request's chain of full-block hashes
    self._shard: dict[str, int] = {}  # the shard each request with pages lives on
    self._events: list[KVEvent] = []
    self.queried_tokens = 0  # prefix-cache hit rate = hit_tokens / queried_tokens
    self.hit_tokens = 0

  # ---- queries -----------------------------------------------------------------

  @property
  def num_free_pages(self) -> int:
    """Pages that an allocation may take: free ones plus evictable cached ones (all shards)."""
    return sum(self.num_free_pages_in(s) for s in range(self.num_shards))

  def num_free_pages_in(self, shard: int) -> int:
    return len(self._free[shard]) + len(self._evictable[shard])

  @property
  def usage(self) -> float:
    """Fraction of usable pages referenced by requests."""
    return 1.0 - self.num_free_pages / (self.num_pages - self.num_shards)

  def pages(self, request_id: str) -> list[int]:
    return self._pages.get(request_id, [])

  def shard_of(self, page: int) -> int:
    return page // self.shard_pages

  def is_padding_page(self, page: int) -> bool:
    """Each shard's first page (page 0 = NULL_PAGE for shard 0) is never handed out."""
    return page % self.shard_pages == 0

  def request_shard(self, request_id: str) -> int | None:
    """The shard a request with pages lives on (None: it holds none)."""
    return self._shard.get(request_id)

  def ref_count(self, page: int) -> int:
    return self._ref[page]

  def cached_hashes(self) -> set[int]:
    return set(self._hash_page)

  def _hit_pages(self, token_ids: Sequence[int]) -> list[int]:
    """Pages of the longest cached prefix of full blocks, whatever their shards."""
    ps = self.page_size
    pages = []
    for h in hash_blocks(token_ids, ps, num_blocks=(len(token_ids) - 1) // ps):
      page = self._hash_page.get(h)
      if page is None:
        break
      pages.append(page)
    return pages

  def lookup(self, token_ids: Sequence[int], shard: int = 0, record: bool = True) -> list[int]:
    """Pages holding the longest cached prefix of full blocks of `token_ids` on `shard`.

    At least one token is always left to compute: the step needs it to
    produce the next token's logits. Takes no reference (see `allocate`).
    `record=False`: a probe that the hit-rate counters do not see.
    """
    if not self.enable_prefix_caching:
      return []
    pages = self._hit_pages(token_ids)
    on_shard = next((i for i, p in enumerate(pages) if self.shard_of(p) != shard), len(pages))
    pages = pages[:on_shard]
    if record:
      self.queried_tokens += len(token_ids)
      self.hit_tokens += len(pages) * self.page_size
    return pages

  def hit_pages_per_shard(self, token_ids: Sequence[int]) -> list[int]:
    """Per shard, the pages of `token_ids`' longest cached prefix there (what `lookup`
    would return, counted; no hit-rate counter sees it)."""
    hits = [0] * self.num_shards
    if self.enable_prefix_caching:
      pages = self._hit_pages(token_ids)
      for s in range(self.num_shards):
        hits[s] = next((i for i, p in enumerate(pages) if self.shard_of(p) != s), len(pages))
    return hits

  def rank_shards(self, token_ids: Sequence[int], loads: Sequence[int], use_cache: bool = True) -> list[int]:
    """Shards for a new request, best first: the longest prefix hit, then the least load,
    then the lowest index. (The scheduler ranks data ranks by predicted load instead,
    `scheduler.rank_by_load`; this older rule is kept for comparison, `jaxinfer bench adp-sim`.)"""
    hits = self.hit_pages_per_shard(token_ids) if use_cache else [0] * self.num_shards
    return sorted(range(self.num_shards), key=lambda s: (-hits[s], loads[s], s))

  # ---- allocation: check, then act -----------------------------------------------

  def pages_needed(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> int:
    """Free pages `allocate(request_id, num_tokens, cached)` would consume."""
    have = len(self._pages.get(request_id, ())) + len(cached)
    new = max(0, -(-num_tokens // self.page_size) - have)
    # A cached page nobody references counts as free until it is taken.
    return new + sum(1 for p in cached if self._ref[p] == 0)

  def holds(self, request_id: str, num_tokens: int) -> bool:
    """Whether the request's pages already hold `num_tokens` tokens (allocate would take none)."""
    return len(self._pages.get(request_id, ())) * self.page_size >= num_tokens

  def can_allocate(self, request_id: str, num_tokens: int, cached: Sequence[int] = (),
                   shard: int = 0) -> bool:
    """`shard` only counts on a request's first allocation; later ones use its shard."""
    shard = self._shard.get(request_id, shard)
    return self.pages_needed(request_id, num_tokens, cached) <= self.num_free_pages_in(shard)

  def allocate(self, request_id: str, num_tokens: int, cached: Sequence[int] = (),
               shard: int = 0) -> list[int]:
    """Gives the request pages for its first `num_tokens` tokens; returns its page list.

    `cached` (from `lookup` on the same shard, only on a request's first
    allocation) are shared by reference. The first allocation puts the
    request on `shard`. Raises if `can_allocate` is false, changing nothing.
    """
    shard = self._shard.get(request_id, shard)
    if not self.can_allocate(request_id, num_tokens, cached, shard):
      raise RuntimeError(f"out of KV pages for {request_id!r}: need "
                         f"{self.pages_needed(request_id, num_tokens, cached)}, have "
                         f"{self.num_free_pages_in(shard)}" + (f" on shard {shard}" if self.num_shards > 1 else ""))
    if cached and request_id in self._pages:
      raise ValueError(f"cached pages can only be given on {request_id!r}'s first allocation")
    if any(self.shard_of(p) != shard for p in cached):
      raise ValueError(f"cached pages {list(cached)} are not all on {request_id!r}'s shard {shard}")
    self._shard[request_id] = shard
    pages = self._pages.setdefault(request_id, [])
    hashes = self._hashes.setdefault(request_id, [])
    for p in cached:
      if self._ref[p] == 0:
        del self._evictable[shard][p]
      self._ref[p] += 1
      pages.append(p)
      hashes.append(self._page_hash[p])
    while len(pages) * self.page_size < num_tokens:
      p = self._take_page(shard)
      self._ref[p] = 1
      pages.append(p)
    return pages

  def _take_page(self, shard: int) -> int:
    if self._free[shard]:
      return self._free[shard].popleft()
    page, _ = self._evictable[shard].popitem(last=False)
    h = self._page_hash.pop(page)
    del self._hash_page[h]
    self._events.append(KVEvent("removed", h))
    return page

  def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_final: int) -> None:
    """Publishes the request's full blocks among its first `num_final` tokens.

    Only tokens whose KV is written and final may be counted: a speculative
    token that is later rejected must never sit in a cached block.
    """
    if not self.enable_prefix_caching:
      return
    ps, pages, hashes = self.page_size, self._pages[request_id], self._hashes[request_id]
    for i in range(len(hashes), min(num_final // ps, len(pages))):
      parent = hashes[-1] if hashes else None
      block = tuple(token_ids[i * ps:(i + 1) * ps])
      h = hash_block(parent, block)
      hashes.append(h)
      if h in self._hash_page:
        continue  # another request computed the same block first; keep its page
      self._hash_page[h] = pages[i]
      self._page_hash[pages[i]] = h
      self._events.append(KVEvent("stored", h, parent, block))

  def free(self, request_id: str) -> None:
    """Drops the request's references; its pages are reusable at once."""
    pages = self._pages.pop(request_id, [])
    self._hashes.pop(request_id, None)
    self._shard.pop(request_id, None)
    # Tail blocks first, so a shared prefix outlives the suffixes hanging off it.
    for p in reversed(pages):
      self._ref[p] -= 1
      if self._ref[p] == 0:
        if p in self._page_hash:
          self._evictable[self.shard_of(p)][p] = None
        else:
          self._free[self.shard_of(p)].append(p)

  def reset_prefix_cache(self) -> None:
    """Forgets every unreferenced cached block (e.g. after new weights)."""
    for evictable in self._evictable:
      for p in list(evictable):
        del evictable[p]
        h = self._page_hash.pop(p)
        del self._hash_page[h]
        self._events.append(KVEvent("removed", h))
        self._free[self.shard_of(p)].append(p)

  def drain_events(self) -> list[KVEvent]:
    events, self._events = self._events, []
    return events
