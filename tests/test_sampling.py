"""SamplingParams validation and the on-device sampler."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.errors import InvalidRequestError
from jaxinfer.sampling import MAX_LOGPROBS, SamplingBatch, SamplingParams, sample, validate_per_request


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
    (dict(repetition_penalty=0.0), r"repetition_penalty must be > 0, got 0.0"),
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5"),
    (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\], got -3"),
    (dict(logprobs=21), r"logprobs must be an int in \[0, 20\] or None, got 21"),
    (dict(prompt_logprobs=-1), r"prompt_logprobs must be an int in \[0, 20\] or None"),
    (dict(logprobs=1.5), r"logprobs must be an int"),
])
def test_invalid_values_name_the_field(kwargs, message):
  with pytest.raises(InvalidRequestError, match=message):
    SamplingParams(**kwargs)


def test_per_request_list_length_is_checked():
  with pytest.raises(InvalidRequestError, match=r"sampling_params has 1 entries for 2 prompts"):
    validate_per_request([SamplingParams()], 2)


def run(logits, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, positions=None,
        repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, counts=None,
        prompt_mask=None, want_logprobs=False, full_output=False):
  B, V = logits.shape
  full = lambda v, dt: jnp.full((B,), v, dt)
  seeds = jnp.zeros((B,), jnp.uint32) if seeds is None else jnp.asarray(seeds, jnp.uint32)
  positions = jnp.zeros((B,), jnp.int32) if positions is None else jnp.asarray(positions, jnp.int32)
  sp = SamplingBatch(full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
                     full(min_p, jnp.float32), full(repetition_penalty, jnp.float32),
                     full(presence_penalty, jnp.float32), full(frequency_penalty, jnp.float32),
                     seeds, positions, full(want_logprobs, jnp.bool_))
  counts = jnp.zeros((B, V), jnp.int32) if counts is None else jnp.asarray(counts, jnp.int32)
  prompt_mask = jnp.zeros((B, V), bool) if prompt_mask is None else jnp.asarray(prompt_mask)
  out = jax.jit(sample)(jnp.asarray(logits), sp, counts, prompt_mask, jnp.arange(B))
  out = tuple(np.asarray(o) for o in out)
  return out if full_output else out[:2]


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


ROW = np.array([[2.0, 1.9, -1.0, -1.2]], np.float32)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
  seen = np.array([[True, False, True, False]])
  ids, _ = run(ROW, repetition_penalty=2.0, prompt_mask=seen)
  assert ids[0] == 1  # 2.0 / 2 = 1.0 < 1.9
  from jaxinfer.sampling import apply_penalties
  sp = SamplingBatch(*[jnp.ones(1)] * 4, jnp.array([2.0]), jnp.zeros(1), jnp.zeros(1),
                     jnp.zeros(1, jnp.uint32), jnp.zeros(1, jnp.int32), jnp.zeros(1, bool))
  out = apply_penalties(jnp.asarray(ROW), sp, jnp.zeros((1, 4), jnp.int32), jnp.asarray(seen))
  np.testing.assert_allclose(out, [[1.0, 1.9, -2.0, -1.2]])


def test_frequency_and_presence_penalties_count_output_tokens():
  counts = np.array([[3, 0, 0, 0]])
  assert run(ROW, counts=counts)[0][0] == 0
  assert run(ROW, frequency_penalty=0.05, counts=counts)[0][0] == 1  # 2.0 - 0.15 < 1.9
  assert run(ROW, presence_penalty=0.2, counts=counts)[0][0] == 1  # once, whatever the count
  assert run(ROW, presence_penalty=0.05, counts=counts)[0][0] == 0
  # The prompt alone does not trigger presence / frequency penalties.
  assert run(ROW, presence_penalty=2.0, prompt_mask=np.array([[True] * 4]))[0][0] == 0
  # Negative values reward repetition.
  assert run(ROW, frequency_penalty=-0.1, counts=np.array([[0, 0, 0, 40]]))[0][0] == 3


def test_top_logprobs_are_the_best_of_the_raw_distribution():
  ids, lp, top_ids, top_lp = run(LOGITS, want_logprobs=True, repetition_penalty=1.5,
                                 prompt_mask=np.ones_like(LOGITS, bool), full_output=True)
  ref = np.asarray(jax.nn.log_softmax(LOGITS))
  assert top_ids.shape == (4, MAX_LOGPROBS)
  np.testing.assert_array_equal(top_ids, np.argsort(-ref, axis=-1)[:, :MAX_LOGPROBS])
  np.testing.assert_allclose(top_lp, np.take_along_axis(ref, top_ids, -1), rtol=1e-5)
  np.testing.assert_allclose(lp, ref[np.arange(4), ids], rtol=1e-5)
  _, _, none_ids, none_lp = run(LOGITS, full_output=True)
  assert not none_ids.any() and not none_lp.any()
