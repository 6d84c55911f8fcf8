"""SamplingParams validation and the on-device sampler."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.errors import InvalidRequestError
from jaxinfer.sampling import SamplingParams, sample, validate_per_request


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-0.5), r"temperature must be >= 0, got -0.5"),
    (dict(temperature=float("nan")), r"temperature must be >= 0, got nan"),
    (dict(top_k=-1), r"top_k must be an int >= 0"),
    (dict(top_k=2.5), r"top_k must be an int"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(min_p=2.0), r"min_p must be in \[0, 1\]"),
    (dict(max_tokens=0), r"max_tokens must be an int >= 1, got 0"),
    (dict(seed=-3), r"seed must be an int in \[0, 2\*\*32\)"),
    (dict(stop=[""]), r"stop must hold non-empty strings"),
    (dict(stop_token_ids=[-1]), r"stop_token_ids must hold non-negative ints"),
])
def test_invalid_values_name_the_field(kwargs, message):
  with pytest.raises(InvalidRequestError, match=message):
    SamplingParams(**kwargs)


def test_per_request_list_length_is_checked():
  with pytest.raises(InvalidRequestError, match=r"sampling_params has 1 entries for 2 prompts"):
    validate_per_request([SamplingParams()], 2)


def run(logits, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, positions=None):
  B = logits.shape[0]
  full = lambda v, dt: jnp.full((B,), v, dt)
  seeds = jnp.zeros((B,), jnp.uint32) if seeds is None else jnp.asarray(seeds, jnp.uint32)
  positions = jnp.zeros((B,), jnp.int32) if positions is None else jnp.asarray(positions, jnp.int32)
  ids, lp = jax.jit(sample)(jnp.asarray(logits), full(temperature, jnp.float32), full(top_k, jnp.int32),
                            full(top_p, jnp.float32), full(min_p, jnp.float32), seeds, positions)
  return np.asarray(ids), np.asarray(lp)


LOGITS = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32) * 3


def test_greedy_is_argmax_with_logprob():
  ids, lp = run(LOGITS)
  np.testing.assert_array_equal(ids, LOGITS.argmax(-1))
  ref = jax.nn.log_softmax(LOGITS)[np.arange(4), ids]
  np.testing.assert_allclose(lp, ref, rtol=1e-6)


@pytest.mark.parametrize("kwargs", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_filters_that_leave_one_token_are_greedy(kwargs):
  ids, _ = run(LOGITS, temperature=1.0, seeds=np.arange(4), **kwargs)
  np.testing.assert_array_equal(ids, LOGITS.argmax(-1))


def test_top_k_and_top_p_restrict_the_support():
  row = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
  seen_k, seen_p = set(), set()
  for seed in range(200):
    seen_k.add(int(run(row, temperature=1.0, top_k=2, seeds=[seed])[0][0]))
    seen_p.add(int(run(row, temperature=1.0, top_p=0.85, seeds=[seed])[0][0]))
  assert seen_k == {0, 1}
  assert seen_p == {0, 1, 2}  # 0.5 + 0.3 < 0.85: the third token is needed


def test_sampling_frequencies_follow_temperature():
  row = np.log(np.array([[0.7, 0.2, 0.1]], np.float32))
  draws = np.array([run(row, temperature=1.0, seeds=[s])[0][0] for s in range(400)])
  freq = np.bincount(draws, minlength=3) / len(draws)
  np.testing.assert_allclose(freq, [0.7, 0.2, 0.1], atol=0.07)


def test_seeded_rows_do_not_depend_on_the_batch():
  logits = np.tile(LOGITS[:1], (4, 1))
  alone, _ = run(logits[:1], temperature=1.0, seeds=[7], positions=[3])
  mixed, _ = run(logits, temperature=1.0, seeds=[1, 7, 9, 7], positions=[3, 3, 3, 5])
  assert mixed[1] == alone[0]
  other_greedy, _ = run(np.concatenate([logits[:1], LOGITS[1:]]), temperature=0.0)
  assert other_greedy[0] == LOGITS[0].argmax()
