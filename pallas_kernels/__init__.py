"""Pallas kernels for GPU (each file: kernel + validating wrapper + pure-jnp reference).

- `ragged_paged_attention`: decode, speculative verification and chunked
  prefill of many sequences in one call, over the paged KV cache
  (`ragged_paged_attention.py`).
- `flash_attention`: dense causal (or full) GQA attention for long prefill
  (`flash_attention.py`).

Both are written for the Pallas Triton lowering (any recent NVIDIA GPU) and
run on CPU with `interpret=True`, which is how the tests check them against
their references. `jaxinfer.ops` still dispatches to its XLA implementation;
wiring these kernels in behind it is a separate change.
"""

from pallas_kernels.flash_attention import BlockSizes as FlashBlockSizes
from pallas_kernels.flash_attention import flash_attention, flash_attention_reference
from pallas_kernels.ragged_paged_attention import BlockSizes as RaggedBlockSizes
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

__all__ = [
    "FlashBlockSizes",
    "RaggedBlockSizes",
    "flash_attention",
    "flash_attention_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
]
