"""The paged KV cache spec: what one page holds per layer, and everything derived from it.

The pool is, per layer, a dict of arrays [N, p, *token_shape] (N pages of p
tokens). What a token holds depends on the layer's attention:

  GQA layer   {'k': [K, d], 'v': [K, d]}   logical axes ('kv_heads', 'head_dim')
  MLA layer   {'latent': [r + R]}          logical axes ('kv_latent',)

An MLA layer (DeepSeek-V2/V3, `cfg.kv_lora_rank > 0`) caches the compressed
KV latent c_KV and the decoupled rope key k^R, concatenated (DeepSeek-V2
paper, sections 2.1.2-2.1.3): every head reads the same latent, so there is
no head axis to shard, and a token costs r + R values instead of 2 * K * d.

A quantized cache (`kv_cache_dtype` 'int8' or 'fp8': float8_e4m3fn) holds
each array's values in that dtype and, beside each, a float32 scale per token
and head: 'k_scale' [N, p, K], 'v_scale' [N, p, K]; MLA's latent has one per
group of R values, 'latent_scale' [N, p, (r + R) / gcd(r, R)], so that c_KV
and the rope key never share one (DeepSeek-V3: 9 groups of 64).
A token's vector is stored as round(x / s) with s = max|x| / 127 (int8) or
max|x| / 448 (fp8), so it reads back as values * s. The scales are more
arrays of the layer like any other (sharded on the same kv_heads, moved by
the same gathers), and `write` is the one place that quantizes.

`CacheSpec.from_config(cfg, dtype)` chooses each layer's kind from the config
(`layer_cache(cfg, i)`), so mixed stacks are one tuple of layers. A drafter's
own attention layers (an MTP module, jaxinfer.models.mtp: `draft_layers=1`)
are more layers of the model's kind after the model's, in the same pages: the
pool's size, shardings and transfers then count them like any other. From the
spec alone come allocation (`abstract`, `zeros`), bytes per token and the pool
size (`bytes_per_token`, `num_pages_for`), shardings (`shardings`: the
logical axes ('pages', 'page_size', *token axes) through the same rule table
as the weights, jaxinfer.sharding), and KV transfer (`gather_pages`,
`scatter_tokens`, `check_transfer`). No other module spells the layout.

Legend: N pages in the pool, p page size, n pages moved, T tokens moved,
K kv heads, d head_dim, r kv_lora_rank, R qk_rope_head_dim.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import KVTransferError
from jaxinfer.indexing import set_at, storage_dtype, take, values_dtype

# Per layer: {name: [N, p, *token_shape]}, e.g. {'k': [N, p, K, d], 'v': [N, p, K, d]}.
Cache = list[dict[str, jax.Array]]

PAGE_AXES = ("pages", "page_size")


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8")
QUANTIZED_KV = {"int8": 127.0, "float8_e4m3fn": 448.0}  # stored dtype -> the max |value| a scale maps to
SCALE_DTYPE = "float32"


def kv_cache_dtype(name: str | None, model_dtype) -> str:
  """The cache's dtype name for a `kv_cache_dtype` option: 'auto' (or None) is the model's
  dtype, 'fp8' is float8_e4m3fn; InvalidRequestError for anything else, and fp8 where
  this jax / backend cannot convert float8 (jaxinfer.quant.check_fp8)."""
  from jaxinfer.errors import InvalidRequestError
  if name is None or name == "auto":
    return jnp.dtype(model_dtype).name
  if name not in KV_CACHE_DTYPES:
    raise InvalidRequestError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
  if name == "fp8":
    from jaxinfer.quant import check_fp8
    check_fp8()
    return "float8_e4m3fn"
  return name


@dataclasses.dataclass(frozen=True)
class TokenArray:
  """One array of a layer's cache, per token: its name, shape and logical axes, and its
  dtype when it is not the cache's (a quantized cache's float32 scales)."""

  name: str
  shape: tuple[int, ...]
  axes: tuple[str, ...]
  dtype: str | None = None
  # A quantized cache scales each run of `group` values of the last axis on its own
  # (0: the whole last axis, one scale per token and head).
  group: int = 0

  def __post_init__(self):
    assert len(self.shape) == len(self.axes), (self.shape, self.axes)

  @property
  def size(self) -> int:
    return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class LayerCache:
  """What one layer's page holds per token: 'gqa' ({'k', 'v'}) or 'mla' ({'latent'})."""

  kind: str
  arrays: tuple[TokenArray, ...]

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(a.name for a in self.arrays)

  def with_scales(self) -> "LayerCache":
    """The layer with a float32 '<name>_scale' per token and head beside each array (its
    shape without the last axis), as a quantized cache holds; unchanged if it has them."""
    if any(a.dtype is not None for a in self.arrays):
      return self
    def scale(a):
      if a.group:  # [..., F // group]: the groups stay on the value's last axis
        return TokenArray(f"{a.name}_scale", a.shape[:-1] + (a.shape[-1] // a.group,), a.axes, SCALE_DTYPE)
      return TokenArray(f"{a.name}_scale", a.shape[:-1], a.axes[:-1], SCALE_DTYPE)
    return LayerCache(self.kind, self.arrays + tuple(scale(a) for a in self.arrays))


def gqa_layer(num_kv_heads: int, head_dim: int) -> LayerCache:
  tok = ((num_kv_heads, head_dim), ("kv_heads", "head_dim"))
  return LayerCache("gqa", (TokenArray("k", *tok), TokenArray("v", *tok)))


def mla_layer(kv_lora_rank: int, qk_rope_head_dim: int) -> LayerCache:
  # Quantized, the latent is scaled in groups of the rope width (DeepSeek-V3: 9 groups of 64),
  # so c_KV and the rope key, of unrelated magnitudes, never share a scale.
  group = math.gcd(kv_lora_rank, qk_rope_head_dim)
  return LayerCache("mla", (TokenArray("latent", (kv_lora_rank + qk_rope_head_dim,), ("kv_latent",),
                                       group=group),))


def layer_cache(cfg, i: int) -> LayerCache:
  """Layer i's cache: MLA's latent when the config has a KV LoRA rank, else GQA heads.

  Every layer of today's configs has the same kind; the index is there so a
  config that mixes attention kinds per layer needs no other change here."""
  del i
  if getattr(cfg, "kv_lora_rank", 0) > 0:
    return mla_layer(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
  return gqa_layer(cfg.num_kv_heads, cfg.head_dim)


@dataclasses.dataclass(frozen=True)
class CacheSpec:
  """Every layer's per-token cache arrays, in one dtype (hashable: a static jit argument).

  The arrays hold `storages()` (jaxinfer.indexing.storage_dtype): `dtype` itself, or on the
  CPU a bfloat16 (float8) cache's bits as uint16 (uint8), which the model reads through
  indexing.take. A quantized dtype ('int8', 'float8_e4m3fn') gives every array a float32
  scale array beside it (`LayerCache.with_scales`)."""

  layers: tuple[LayerCache, ...]
  dtype: str  # numpy dtype name, e.g. 'float32', 'bfloat16', 'int8', 'float8_e4m3fn'

  def __post_init__(self):
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
    if self.quantized:
      object.__setattr__(self, "layers", tuple(l.with_scales() for l in self.layers))

  @classmethod
  def from_config(cls, cfg, dtype, draft_layers: int = 0) -> "CacheSpec":
    """The model's layers, then `draft_layers` more of the same kind (an MTP module's)."""
    return cls(tuple(layer_cache(cfg, i) for i in range(cfg.num_layers + draft_layers)),
               jnp.dtype(dtype).name)

  @property
  def quantized(self) -> bool:
    return self.dtype in QUANTIZED_KV

  def array_dtype(self, a: TokenArray) -> str:
    return a.dtype or self.dtype

  # ---- sizes ----------------------------------------------------------------------------

  def bytes_per_token(self) -> int:
    """KV bytes one token takes over every layer (a quantized cache's scales included)."""
    return sum(a.size * jnp.dtype(self.array_dtype(a)).itemsize for l in self.layers for a in l.arrays)

  def page_bytes(self, page_size: int) -> int:
    return self.bytes_per_token() * page_size

  def num_pages_for(self, budget_bytes: int, page_size: int, cap: int | None = None) -> int:
    """Pages of `page_size` tokens that fit `budget_bytes` (at most `cap`)."""
    n = budget_bytes // self.page_bytes(page_size)
    return n if cap is None else min(n, cap)

  # ---- allocation -----------------------------------------------------------------------

  def shapes(self, num_pages: int, page_size: int) -> list[dict[str, tuple[int, ...]]]:
    return [{a.name: (num_pages, page_size) + a.shape for a in l.arrays} for l in self.layers]

  def axes(self) -> list[dict[str, tuple[str, ...]]]:
    """Logical axes of every cache array: ('pages', 'page_size', *the token's axes)."""
    return [{a.name: PAGE_AXES + a.axes for a in l.arrays} for l in self.layers]

  def dtypes(self) -> list[dict[str, str]]:
    """Each array's dtype as values (what transfers carry): the cache's, or a scale's float32."""
    return [{a.name: self.array_dtype(a) for a in l.arrays} for l in self.layers]

  def storages(self) -> list[dict[str, Any]]:
    """What each array holds (jaxinfer.indexing.storage_dtype of its dtype)."""
    return [{name: storage_dtype(dt) for name, dt in layer.items()} for layer in self.dtypes()]

  def abstract(self, num_pages: int, page_size: int, shardings=None) -> list[dict[str, jax.ShapeDtypeStruct]]:
    """ShapeDtypeStructs of the whole pool: nothing allocated."""
    shapes, dtypes = self.shapes(num_pages, page_size), self.storages()
    if shardings is None:
      return jax.tree.map(lambda s, dt: jax.ShapeDtypeStruct(s, dt), shapes, dtypes, is_leaf=_is_shape)
    return jax.tree.map(lambda s, dt, sh: jax.ShapeDtypeStruct(s, dt, sharding=sh), shapes, dtypes, shardings,
                        is_leaf=_is_shape)

  def zeros(self, num_pages: int, page_size: int, shardings=None) -> Cache:
    """A zeroed pool. Inside jit: plain zeros. With `shardings`: each device allocates
    only its own shard (a jitted fill with those out_shardings), never the whole pool first."""
    def fill():
      return jax.tree.map(lambda s, dt: jnp.zeros(s, dt), self.shapes(num_pages, page_size), self.storages(),
                          is_leaf=_is_shape)
    if shardings is None:
      return fill()
    return jax.jit(fill, out_shardings=shardings)()

  def page_shards(self, mesh, rules: Mapping | None = None) -> int:
    """Into how many shards the rules split the 'pages' axis on `mesh` (1 without a mesh):
    pool sizes are rounded to a multiple of it (attention data parallelism maps 'pages' to
    'data', so each data shard owns a contiguous block of pages)."""
    if mesh is None:
      return 1
    from jaxinfer.sharding import RULES, mesh_axes
    rule = (RULES if rules is None else rules).get("pages")
    return math.prod(mesh.shape[ax] for ax in mesh_axes("pages", rule) if ax in mesh.shape)

  def shardings(self, mesh, num_pages: int, page_size: int, rules: Mapping | None = None):
    """NamedShardings of the pool from its logical axes and the weights' rule table (so the
    pages' kv_heads dim is split like wk's). ShardingError when an axis does not divide."""
    from jaxinfer.sharding import named_sharding
    shapes, axes = self.shapes(num_pages, page_size), self.axes()
    return [{name: named_sharding(axes[i][name], shapes[i][name], mesh, rules,
                                  name=f"KV cache layer {i} {name!r}")
             for name in shapes[i]} for i in range(len(self.layers))]

  # ---- KV transfer ----------------------------------------------------------------------

  def uniform_layer(self) -> LayerCache | None:
    """The one layer kind every layer has, or None for a mixed stack."""
    first = self.layers[0]
    return first if all(l == first for l in self.layers) else None

  def num_transfer_tokens(self, arrays: Sequence[Mapping[str, np.ndarray]], page_major: bool) -> int:
    """Tokens a transfer carries (0 for an empty one): n * p for pages, T for a token run."""
    if not arrays or not arrays[0]:
      return 0
    a = next(iter(arrays[0].values()))
    return int(a.shape[0] * a.shape[1]) if page_major else int(a.shape[0])

  def check_transfer(self, arrays: Sequence[Mapping[str, np.ndarray]], *, page_major: bool,
                     page_size: int | None = None) -> list[dict[str, np.ndarray]]:
    """The transfer as token runs {name: [T, *token_shape]} per layer, or KVTransferError
    naming the layer, array and dimension that do not match this spec.

    Page-major arrays are [n, p', *token_shape] from a worker whose page size p' may
    differ from ours (`page_size`, only used to phrase errors): a page is a run of p'
    tokens, so they are flattened, and re-chunked into our pages by whoever writes
    them. A token shape of [1, F] is accepted for an [F] array (the wire layout of a
    headless MLA latent is one 'kv head')."""
    if len(arrays) != len(self.layers):
      raise KVTransferError(f"num_layers: the transfer has {len(arrays)} layers, this model has {len(self.layers)}")
    lead = ("pages", "page_size") if page_major else ("tokens",)
    out, count = [], None
    for l, (layer, spec) in enumerate(zip(arrays, self.layers)):
      if set(layer) != set(spec.names):
        raise KVTransferError(f"layer {l}: the transfer has arrays {sorted(layer)}, this cache {sorted(spec.names)}")
      runs = {}
      for tok in spec.arrays:
        a = np.asarray(layer[tok.name])
        dims = lead + tok.axes
        if a.ndim == len(dims) + 1 and a.shape[len(lead)] == 1 and len(tok.shape) == 1:
          a = a.reshape(a.shape[:len(lead)] + a.shape[len(lead) + 1:])
        if a.ndim != len(dims):
          raise KVTransferError(f"layer {l} {tok.name!r}: {a.ndim} dimensions, expected {len(dims)} {dims}")
        for dim, got, exp in zip(dims[len(lead):], a.shape[len(lead):], tok.shape):
          if got != exp:
            name = {"kv_heads": "num_kv_heads"}.get(dim, dim)
            raise KVTransferError(f"layer {l} {tok.name!r}: {name} is {got}, expected {exp} "
                                  f"(token shape {tuple(a.shape[len(lead):])} vs {tok.shape})")
        if a.dtype != np.dtype(self.array_dtype(tok)):
          raise KVTransferError(f"layer {l} {tok.name!r}: dtype is {a.dtype}, this cache holds "
                                f"{self.array_dtype(tok)}")
        run = a.reshape((-1,) + tok.shape)
        if count is None:
          count = (a.shape[:len(lead)], len(run))
        elif count[1] != len(run):
          what = f"{a.shape[0]} pages of {a.shape[1]}" if page_major else f"{len(run)} tokens"
          raise KVTransferError(f"layer {l} {tok.name!r}: {what}, but the transfer's first array has "
                                f"{count[0]} ({count[1]} tokens)")
        runs[tok.name] = run
      out.append(runs)
    return out


def _is_shape(x: Any) -> bool:
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


# ---- device functions (the runner jits them) -------------------------------------------------

def gather_pages(cache: Cache, ids: jax.Array) -> Cache:
  """Pages `ids` [n] of every array: per layer {name: [n, p, *token_shape]}."""
  return jax.tree.map(lambda x: take(x, ids), cache)


def write(layer: dict[str, jax.Array], name: str, new: jax.Array, slots: jax.Array) -> dict[str, jax.Array]:
  """The arrays of `layer` that change when tokens `new` [T, *token_shape] go into array
  `name` at `slots` [T] (page * p + offset; out-of-range slots are dropped): {name: ...},
  and {name + '_scale': ...} in a quantized cache, where this is the one place that
  quantizes (per token and head, see the module doc).

  Indexed by (page, offset), not through a flattened [N * p] view: for a single
  token XLA's CPU backend lowers the flat form to an update that copies the
  whole layer cache first (and a bfloat16 one converts it: jaxinfer.indexing)."""
  pages = layer[name]
  p = pages.shape[1]
  at = (slots // p, slots % p)
  scale_name = f"{name}_scale"
  if scale_name not in layer:
    return {name: set_at(pages, at, new, mode="drop")}
  scales = layer[scale_name]
  groups = scales.shape[-1] if scales.ndim == pages.ndim else None
  vals, scale = quantize_tokens(new, values_dtype(pages.dtype), groups)
  return {name: set_at(pages, at, vals, mode="drop"), scale_name: set_at(scales, at, scale, mode="drop")}


def quantize_tokens(x: jax.Array, dtype, groups: int | None = None) -> tuple[jax.Array, jax.Array]:
  """x [..., F] as (values [..., F] of int8 / float8_e4m3fn, float32 scales [...]): each
  vector's max |x| maps to the dtype's largest value; an all-zero vector gets scale 1.
  `groups` G: each of G equal runs of the last axis gets its own scale ([..., G])."""
  dtype = jnp.dtype(dtype)
  x = x.astype(jnp.float32)
  if groups is not None:
    vals, scale = quantize_tokens(x.reshape(x.shape[:-1] + (groups, x.shape[-1] // groups)), dtype)
    return vals.reshape(x.shape), scale
  amax = jnp.max(jnp.abs(x), axis=-1)
  scale = jnp.where(amax > 0, amax / QUANTIZED_KV[dtype.name], 1.0)
  y = jnp.clip(x / scale[..., None], -QUANTIZED_KV[dtype.name], QUANTIZED_KV[dtype.name])
  return (jnp.round(y) if dtype == jnp.int8 else y).astype(dtype), scale


def dequantize_tokens(values: jax.Array, scale: jax.Array) -> jax.Array:
  """The float32 tokens quantize_tokens stored: values * scale per vector (or per group,
  when scale has the values' rank: [..., G] for [..., F])."""
  if scale.ndim == values.ndim:
    grouped = values.reshape(values.shape[:-1] + (scale.shape[-1], -1))
    return (grouped.astype(jnp.float32) * scale[..., None]).reshape(values.shape)
  return values.astype(jnp.float32) * scale[..., None]


def scatter_tokens(cache: Cache, slots: jax.Array, runs: Cache) -> Cache:
  """cache[slot // p, slot % p] = run[t] for each token t (slots [T], runs {name: [T, ...]}).

  Token-granular, so a run may start and end mid-page: a page filled by two
  transfers keeps both halves, and runs cut at another worker's page size
  land in ours. Padding tokens all target slot 0 (the padding page)."""
  def write(x, a):
    p = x.shape[1]
    return set_at(x, (slots // p, slots % p), a)
  return jax.tree.map(write, cache, runs)


# ---- conveniences ------------------------------------------------------------------------------

def init_cache(cfg, num_pages: int, page_size: int, dtype=jnp.float32) -> Cache:
  """A zeroed pool for `cfg` (see CacheSpec.zeros)."""
  return CacheSpec.from_config(cfg, dtype).zeros(num_pages, page_size)


def cache_bytes_per_token(cfg, dtype) -> int:
  return CacheSpec.from_config(cfg, dtype).bytes_per_token()
