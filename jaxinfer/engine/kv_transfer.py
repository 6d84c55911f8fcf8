"""KV pages in and out of the paged cache, as host arrays (prefill/decode disaggregation).

`export_pages` / `export_tokens` gather a power-of-two bucket of pages (at most
MAX_TRANSFER_PAGES per program) and `import_pages` / `import_tokens` scatter a
power-of-two bucket of tokens (at most MAX_TRANSFER_PAGES pages' worth per program;
more are split), so transfers add a bounded set of programs, compiled on first use.
Imports write tokens, not pages: pages exported at another worker's page size land in
ours. Every call takes the cache and an import returns the new one: the runner owns the
cache, and its `export_*` / `import_*` (the names a multi-host leader mirrors to its
followers, jaxinfer.distributed) hand it over.

Layouts (per layer, the cache spec's arrays: {'k', 'v'} of [K, d] for GQA, {'latent'} for
MLA): page-major [n, page_size, *token_shape] (`export_pages`), token-major
[T, *token_shape] (`export_tokens`, independent of the page size).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from jaxinfer.engine.batch import bucket, power_of_two_buckets, slot_mapping
from jaxinfer.engine.kv_connector import KVLayout, KVTransferError
from jaxinfer.engine.kv_manager import NULL_PAGE
from jaxinfer.models.cache import CacheSpec, gather_pages, scatter_tokens

MAX_TRANSFER_PAGES = 64  # pages per gather / scatter program (largest transfer bucket)

Arrays = list[dict[str, np.ndarray]]  # per layer {name: array}


class KVTransfer:
  """The gather and scatter programs of one cache (its spec, page size, pool and placement)."""

  def __init__(self, cache_spec: CacheSpec, page_size: int, num_pages: int, mesh, sharding_rules,
               scan_layers: bool, cache_shardings: Any, programs: set):
    self.cache_spec, self.page_size, self.num_pages = cache_spec, page_size, num_pages
    self.mesh, self.sharding_rules, self.scan_layers = mesh, sharding_rules, scan_layers
    self.programs = programs  # the runner's record of what has compiled (shared)
    self.transfer_buckets = power_of_two_buckets(1, MAX_TRANSFER_PAGES)  # pages per export program
    self.import_buckets = power_of_two_buckets(page_size, MAX_TRANSFER_PAGES * page_size)  # tokens
    # Exported pages come back whole on every process: a multi-host pool's shards are not
    # all addressable from one process, which device_get needs (jaxinfer.distributed).
    self._gather = jax.jit(gather_pages)
    if mesh is not None:
      replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
      self._gather = jax.jit(gather_pages, out_shardings=replicated)
    # The imported pool keeps the pool's sharding (not whatever the scatter would propagate).
    self._scatter = jax.jit(scatter_tokens, donate_argnums=(0,), out_shardings=cache_shardings)

  def num_programs(self) -> int:
    """The most programs transfers can compile: one per export and per import bucket."""
    return len(self.transfer_buckets) + len(self.import_buckets)

  def layout(self) -> KVLayout:
    return KVLayout.from_cache_spec(self.cache_spec, self.page_size)

  def export_pages(self, cache: Any, page_ids: Sequence[int]) -> Arrays:
    """Host copies of the given pages, page-major."""
    ids = self._check_page_ids(page_ids)
    parts = []
    for lo in range(0, len(ids), MAX_TRANSFER_PAGES):
      part = ids[lo:lo + MAX_TRANSFER_PAGES]
      padded = np.full(bucket(len(part), self.transfer_buckets), NULL_PAGE, np.int32)  # pad: page 0
      padded[:len(part)] = part
      self.programs.add(("export", len(padded)))
      got = jax.device_get(self._gather(cache, padded))
      # Slice on the host: a device-side [:n] would compile once per count.
      parts.append([{name: a[:len(part)] for name, a in layer.items()} for layer in got])
    if not parts:
      return [{name: np.zeros((0,) + shape[1:], np.dtype(dtypes[name])) for name, shape in layer.items()}
              for layer, dtypes in zip(self.cache_spec.shapes(0, self.page_size), self.cache_spec.dtypes())]
    if len(parts) == 1:
      return parts[0]
    return [{name: np.concatenate([p[i][name] for p in parts]) for name in layer}
            for i, layer in enumerate(parts[0])]

  def export_tokens(self, cache: Any, page_ids: Sequence[int], start: int, num_tokens: int) -> Arrays:
    """Tokens [start, start + num_tokens) of a sequence whose pages are `page_ids`, token-major:
    a worker with another page size can `import_tokens` them."""
    p = self.page_size
    first, last = start // p, -(-(start + num_tokens) // p)
    if start < 0 or num_tokens < 0 or last > len(page_ids):
      raise KVTransferError(f"tokens [{start}, {start + num_tokens}) are outside the {len(page_ids)} "
                            f"pages of {p} tokens given")
    off = start - first * p
    return [{name: a.reshape((-1,) + a.shape[2:])[off:off + num_tokens] for name, a in layer.items()}
            for layer in self.export_pages(cache, page_ids[first:last])]

  def num_import_pages(self, arrays: Sequence[dict[str, np.ndarray]]) -> int:
    """Our pages that page-major `arrays` (any worker's page size) fill; KVTransferError if
    they do not match this cache."""
    runs = self.cache_spec.check_transfer(arrays, page_major=True, page_size=self.page_size)
    return -(-_run_length(runs) // self.page_size)

  def import_pages(self, cache: Any, page_ids: Sequence[int], arrays: Sequence[dict[str, np.ndarray]]) -> Any:
    """The cache with `arrays` (as `export_pages` returns them, possibly from another worker
    with other page ids or another page size) written into the given pages: their tokens in
    order, re-chunked into our pages. KVTransferError, changing nothing, when the number of
    layers, the arrays' names, the token count, kv heads, head_dim (or the latent width) or
    dtype do not fit this cache and these pages."""
    ids = self._check_page_ids(page_ids)
    runs = self.cache_spec.check_transfer(arrays, page_major=True, page_size=self.page_size)
    T, p = _run_length(runs), self.page_size
    if -(-T // p) != len(ids):
      n_src, p_src = next(iter(arrays[0].values())).shape[:2] if arrays else (0, p)
      if p_src == p:
        raise KVTransferError(f"page count is {n_src}, expected {len(ids)}")
      raise KVTransferError(f"{n_src} pages of {p_src} tokens fill {-(-T // p)} pages of {p}, expected {len(ids)}")
    return self._write_tokens(cache, ids, 0, runs)

  def import_tokens(self, cache: Any, page_ids: Sequence[int], start: int,
                    runs: Sequence[dict[str, np.ndarray]]) -> Any:
    """The cache with token runs (as `export_tokens` returns them) written at positions
    [start, start + T) of a sequence whose pages are `page_ids` (a run may start or end
    mid-page: the rest of those pages is kept). KVTransferError, changing nothing, on a
    mismatch."""
    runs = self.cache_spec.check_transfer(runs, page_major=False)
    T, p = _run_length(runs), self.page_size
    if start < 0 or start + T > len(page_ids) * p:
      raise KVTransferError(f"tokens [{start}, {start + T}) are outside the {len(page_ids)} pages "
                            f"of {p} tokens given")
    ids = self._check_page_ids(list(page_ids)[start // p:-(-(start + T) // p)])
    return self._write_tokens(cache, ids, start - (start // p) * p, runs)

  def _check_page_ids(self, page_ids: Sequence[int]) -> np.ndarray:
    if self.scan_layers:
      raise KVTransferError("KV transfer reads and writes per-layer pools; this runner scans layers "
                            "over one stacked pool (scan_layers=False transfers)")
    ids = np.asarray(page_ids, np.int64).reshape(-1)
    bad = ids[(ids <= NULL_PAGE) | (ids >= self.num_pages)]
    if bad.size:
      raise KVTransferError(f"page ids {bad.tolist()} are outside [1, {self.num_pages}) "
                            f"(page {NULL_PAGE} is reserved for padding)")
    shards = self.cache_spec.page_shards(self.mesh, self.sharding_rules)
    bad = ids[ids % (self.num_pages // shards) == 0]
    if bad.size:
      raise KVTransferError(f"page ids {bad.tolist()} are padding pages (the first of each of the "
                            f"pool's {shards} data shards)")
    return ids.astype(np.int32)

  def _write_tokens(self, cache: Any, ids: np.ndarray, start: int, runs: list[dict[str, np.ndarray]]) -> Any:
    """Token t of the runs goes to position start + t of the pages `ids` (already checked)."""
    if len(set(ids.tolist())) != len(ids):
      raise KVTransferError(f"page ids repeat: {ids.tolist()}")
    T, p = _run_length(runs), self.page_size
    pos = start + np.arange(T)
    slots = slot_mapping(ids[None], 0, pos, p).astype(np.int32)
    chunk = self.import_buckets[-1]
    for lo in range(0, T, chunk):
      part = slots[lo:lo + chunk]
      B = bucket(len(part), self.import_buckets)
      padded = np.full(B, NULL_PAGE * p, np.int32)  # padding tokens write the padding page
      padded[:len(part)] = part
      block = []
      for layer in runs:
        d = {}
        for name, a in layer.items():
          buf = np.zeros((B,) + a.shape[1:], a.dtype)
          buf[:len(part)] = a[lo:lo + len(part)]
          d[name] = buf
        block.append(d)
      self.programs.add(("import", B))
      cache = self._scatter(cache, padded, block)
    return cache


def _run_length(runs: Sequence[dict[str, np.ndarray]]) -> int:
  return len(next(iter(runs[0].values()))) if runs and runs[0] else 0
