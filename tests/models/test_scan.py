"""Scanned layers (models/transformer.py): stacked weights and one pool of L x N pages run the
same decoder layer under lax.scan, with the unrolled step's logits and cache, bit for bit."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_dir
from jaxinfer.checkpoint.hf import read_config
from jaxinfer.models.cache import init_cache
from jaxinfer.models.transformer import PagedBatch, compute_logits, forward, is_stacked, stack_cache, stack_layers
from jaxinfer.params import fuse_params, init_params


def _run(cfg, params, cache):
  """5 prompt tokens of sequence 0 (pages 1), 1 decode token of sequence 1 (page 2, position 7),
  2 tokens of padding whose slot (1000) is out of the pool: dropped, in every layer."""
  tokens = jnp.array([3, 17, 5, 200, 9, 42, 0, 0], jnp.int32)
  pos = jnp.array([0, 1, 2, 3, 4, 7, 0, 0], jnp.int32)
  slots = jnp.array([16, 17, 18, 19, 20, 39, 1000, 1000], jnp.int32)
  batch = PagedBatch(slots, jnp.array([5, 8], jnp.int32), jnp.array([[1], [2]], jnp.int32),
                     jnp.array([0, 5, 6], jnp.int32), jnp.int32(2))

  def run(params, cache):
    hidden, cache = forward(params, cfg, tokens, pos, cache, batch, attention_impl="xla")
    return compute_logits(params, cfg, hidden[:6]), cache

  logits, cache = jax.jit(run)(params, cache)
  return np.asarray(logits), cache


@pytest.mark.parametrize("family,quantization", [("llama3", None), ("qwen2", "int8"), ("mistral", None)])
def test_scanned_layers_give_the_unrolled_logits_and_cache(family, quantization):
  """llama3: GQA; qwen2: biases, int8 groups; mistral: a sliding window shorter than the context."""
  cfg = read_config(tiny_dir(family))
  cfg = dataclasses.replace(cfg, num_layers=3)  # three layers: the page offset of layer 2 is 2 N
  params = fuse_params(cfg, init_params(cfg, jax.random.key(5), quantization=quantization))
  cache = init_cache(cfg, 3, 16)
  # Earlier tokens of sequence 1 in its page, different per layer, so a layer reading another
  # layer's pages would see other keys.
  rng = np.random.default_rng(0)
  cache = [{k: a.at[2, :7].set(rng.standard_normal(a.shape[2:]).astype(np.float32)[None]) for k, a in layer.items()}
           for layer in cache]
  want, want_cache = _run(cfg, params, cache)
  stacked = stack_layers(cfg, params)
  assert is_stacked(stacked["layers"]) and stacked["layers"]["wqkv"].shape[0] == 3
  got, got_cache = _run(cfg, stacked, stack_cache(cache))
  assert np.abs(want).max() > 0.1
  np.testing.assert_array_equal(got, want)
  for name in ("k", "v"):
    np.testing.assert_array_equal(np.asarray(got_cache[0][name]), np.asarray(stack_cache(want_cache)[0][name]))


def test_layers_that_differ_cannot_be_scanned_and_say_why():
  cfg = read_config(tiny_dir("qwen3_moe"))
  with pytest.raises(ValueError, match=r"layers cannot be scanned: it has MoE layers"):
    stack_layers(cfg, init_params(cfg, jax.random.key(0)))
