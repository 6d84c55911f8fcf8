"""The few Pallas Triton names that moved between jax releases, resolved once.

The kernels use only public `jax.experimental.pallas` (`pl`) and
`jax.experimental.pallas.triton` (`plgpu`) names that exist in jax 0.10.x and
0.11.x: `pl.pallas_call`, `pl.program_id`, `pl.ds`, `pl.when`, `pl.cdiv`,
`plgpu.load` / `plgpu.store` (masked), `plgpu.dot`, `plgpu.CompilerParams`.
The compiler-parameter class is the one name that has been renamed (it was
`TritonCompilerParams` before jax 0.7), so it is looked up here rather than
spelled in each kernel.
"""

from __future__ import annotations

from jax.experimental.pallas import triton as plgpu

_CompilerParams = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams


def triton_compiler_params(num_warps: int, num_stages: int):
  """Launch parameters for the Triton lowering (ignored in interpret mode)."""
  return _CompilerParams(num_warps=num_warps, num_stages=num_stages)
