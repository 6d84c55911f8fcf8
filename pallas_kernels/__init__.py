"""Pallas kernels for GPU (each file: kernel + validating wrapper + pure-jnp reference).

- `ragged_paged_attention`: decode, speculative verification and chunked
  prefill of many sequences in one call, over the paged KV cache
  (`ragged_paged_attention.py`).
- `flash_attention`: dense causal (or full) GQA attention for long prefill
  (`flash_attention.py`).
- `ragged_paged_mla`: absorbed multi-head latent attention (DeepSeek-V2/V3)
  of ragged queries over the paged latent cache (`ragged_paged_mla.py`).
- `spec_accept`: speculative decoding's accept step (the target's k + 1
  verify rows per sequence read once: accept test, correction / bonus token,
  Gumbel noise hashed in the kernel) for point-mass and full-q drafts
  (`spec_accept.py`). Not dispatched to by the engine yet.

- `ragged_paged_attention_mgpu` (import it from its module; it runs under jax >= 0.11):
  the ragged kernel on Pallas Mosaic GPU for Hopper, TMA + wgmma, tested in
  Mosaic GPU interpret mode (`ragged_paged_attention_mgpu.py`).
- `ragged_paged_mla_mgpu` (likewise jax >= 0.11): the MLA kernel on Mosaic GPU, all heads
  against one shared latent row per token (`ragged_paged_mla_mgpu.py`; tested in interpret
  mode and lowered for sm_90, not yet run on a GPU).
- `gemv_mgpu` (likewise jax >= 0.11): a few-token (1-16) GEMV over per-channel fp8 / int8
  weights on Mosaic GPU, read at one byte a weight; `jaxinfer.quant.linear` runs it on an
  sm_90+ GPU (`gemv_mgpu.py`).

The others are written for the Pallas Triton lowering (any recent NVIDIA GPU) and
run on CPU with `interpret=True`, which is how the tests check them against
their references. The model reaches the ragged kernels only through
`jaxinfer.ops.ragged_paged_attention` / `jaxinfer.ops.ragged_paged_mla`
(attention_impl 'pallas' or 'pallas_interpret'; 'mosaic' / 'mosaic_interpret' for
the Mosaic GPU kernels; 'auto' on GPU takes 'mosaic' on sm_90 under jax >= 0.11,
else 'pallas');
flash_attention is not dispatched to yet.
"""

from pallas_kernels.flash_attention import BlockSizes as FlashBlockSizes
from pallas_kernels.flash_attention import flash_attention, flash_attention_reference
from pallas_kernels.ragged_paged_attention import BlockSizes as RaggedBlockSizes
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.ragged_paged_mla import BlockSizes as MlaBlockSizes
from pallas_kernels.ragged_paged_mla import ragged_paged_mla, ragged_paged_mla_reference
from pallas_kernels.spec_accept import BlockSizes as AcceptBlockSizes
from pallas_kernels.spec_accept import spec_accept, spec_accept_reference

__all__ = [
    "AcceptBlockSizes",
    "FlashBlockSizes",
    "MlaBlockSizes",
    "RaggedBlockSizes",
    "flash_attention",
    "flash_attention_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "ragged_paged_mla",
    "ragged_paged_mla_reference",
    "spec_accept",
    "spec_accept_reference",
]
