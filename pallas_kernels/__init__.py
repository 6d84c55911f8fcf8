"""Pallas kernels for GPU (each file: kernel + validating wrapper + pure-jnp reference).

- `ragged_paged_attention`: decode, speculative verification and chunked
  prefill of many sequences in one call, over the paged KV cache
  (`ragged_paged_attention.py`).

Written for the Pallas Triton lowering (any recent NVIDIA GPU); runs on CPU
with `interpret=True`, which is how the tests check it against its
reference. `jaxinfer.ops` still dispatches to its XLA implementation; wiring
the kernel in behind it is a separate change.
"""

from pallas_kernels.ragged_paged_attention import BlockSizes as RaggedBlockSizes
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

__all__ = [
    "RaggedBlockSizes",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
]
