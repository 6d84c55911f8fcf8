"""Pallas kernels for GPU (each file: kernel + validating wrapper + pure-jnp reference).

The attention kernels land with the kernels issue; until then `jaxinfer.ops`
uses its XLA reference implementation on every backend.
"""
