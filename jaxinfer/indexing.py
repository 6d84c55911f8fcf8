"""Gathers and scatters that move bfloat16 as its bits, and the KV cache stored so on the CPU.

XLA's CPU backend runs a bfloat16 gather, scatter or dynamic-update-slice by
converting the whole operand to float32 first (and a scatter's result back
after); tests/test_indexing.py asserts it on the compiled HLO, jax 0.10. For a
layer's KV cache that is a float32 copy of every page, per layer and per step,
and where the read sits in a loop XLA hoists the convert out of it, so the
copy is made whatever the loop reads. A bitcast to uint16 does not help on an
array that is bfloat16 outside the step: XLA CPU materializes the bitcast
(twice around a scatter). So on the CPU a bfloat16 KV cache is *stored* as
uint16, its bits (`storage_dtype`): `set_at` writes values' bits into it and
`take` reads a gathered tile back as bfloat16, and no whole-cache conversion
is left. A uint16 array here always holds bfloat16 bits (nothing else in
jaxinfer is uint16). Anywhere but the CPU the cache is plain bfloat16.

float8_e4m3fn (an fp8 KV cache, `kv_cache_dtype='fp8'`) has the same problem
on the CPU and the same cure: it is stored as uint8, its bits. int8 does not
(XLA CPU gathers and scatters it as it is).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

BITS = jnp.dtype(jnp.uint16)  # the storage of bfloat16 on the CPU
FP8_BITS = jnp.dtype(jnp.uint8)  # the storage of float8_e4m3fn on the CPU
# value dtype -> the unsigned integer of its width that stores it on the CPU
_STORED = {jnp.dtype(jnp.bfloat16): BITS, jnp.dtype(jnp.float8_e4m3fn): FP8_BITS}
_VALUES = {bits: v for v, bits in _STORED.items()}


def storage_dtype(dtype, backend: str | None = None):
  """What a KV cache of `dtype` holds: on the CPU, bfloat16's bits (uint16) or float8's
  (uint8); else `dtype`."""
  dtype = jnp.dtype(dtype)
  if dtype in _STORED and (backend or jax.default_backend()) == "cpu":
    return _STORED[dtype]
  return dtype


def values_dtype(dtype):
  """The dtype an array of `dtype` holds values of (bfloat16 for uint16 storage, float8 for uint8)."""
  return _VALUES.get(jnp.dtype(dtype), jnp.dtype(dtype))


def _bits(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, _STORED[x.dtype]) if x.dtype in _STORED else x


def values(x: jax.Array) -> jax.Array:
  """x as values: a uint16 / uint8 (stored) array bitcast to bfloat16 / float8, anything
  else as it is."""
  return jax.lax.bitcast_convert_type(x, _VALUES[x.dtype]) if x.dtype in _VALUES else x


def take(x: jax.Array, index: Any) -> jax.Array:
  """x[index] as values (numpy indexing: an integer array, or a tuple of them and slices);
  bfloat16 and float8 are gathered as their bits, which XLA CPU fuses into the gather."""
  return values(_bits(x)[index])


def set_at(x: jax.Array, index: Any, new: jax.Array, **kwargs) -> jax.Array:
  """x.at[index].set(new in x's value dtype, **kwargs) (mode=, unique_indices=, ...), writing
  bits into a stored (uint16 / uint8) x; the result has x's dtype."""
  new = new.astype(values_dtype(x.dtype))
  return x.at[index].set(_bits(new) if x.dtype in _VALUES else new, **kwargs)
