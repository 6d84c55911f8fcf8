"""SamplingParams validation and the on-device sampler."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import USER_XLA
from jaxinfer.errors import InvalidRequestError
from jaxinfer.sampling import (ALL_WORK, CANDIDATES, MAX_LOGPROBS, WARM_MODES, SamplerMode, SamplingBatch, SamplingParams,
                               _bits_are_per_index,
                               _gumbel_at, apply_penalties, candidate_thresholds, first_argmax, sample,
                               sort_descending, validate_per_request)


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
        prompt_mask=None, want_logprobs=False, full_output=False, mesh=None):
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
  args = (jnp.asarray(logits), sp, counts, prompt_mask, jnp.arange(B))
  if mesh is not None:  # every input replicated over the mesh, as in a sharded engine's step
    args = jax.device_put(args, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  # The mode the engine would pick: read off the host rows.
  mode = SamplerMode.of(jax.device_get(sp), V)
  out = sampler(CANDIDATES, mode)(*args)  # one jitted sampler per mode (a fresh partial would recompile)
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


@pytest.mark.parametrize("shape", [(8, 1, 1), (1, 1, 8)])
def test_sampling_over_a_mesh_draws_the_same_tokens(shape):
  """Partitioned over 8 devices the sampler compiles (its TopK pre-selection once
  aborted XLA:CPU under SPMD) and draws what one device draws."""
  from jaxinfer.sharding import make_mesh
  controls = dict(temperature=0.8, top_k=5, top_p=0.9, seeds=[1, 2, 3, 4], positions=[0, 1, 2, 3])
  one = run(LOGITS, **controls, full_output=True)
  many = run(LOGITS, **controls, full_output=True, mesh=make_mesh(*shape))
  for a, b in zip(one, many):
    np.testing.assert_array_equal(a, b)


ROW = np.array([[2.0, 1.9, -1.0, -1.2]], np.float32)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
  seen = np.array([[True, False, True, False]])
  ids, _ = run(ROW, repetition_penalty=2.0, prompt_mask=seen)
  assert ids[0] == 1  # 2.0 / 2 = 1.0 < 1.9
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


# ---- exactness against the full-sort sampler -------------------------------------------


def reference_sample(logits, sp, counts_table, prompt_table, rows):
  """The sampler before top-k pre-selection: every sampled batch sorts every row.
  Kept as the reference that `sample` must reproduce."""
  logits = logits.astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  penalized = (sp.repetition_penalty != 1) | (sp.presence_penalty != 0) | (sp.frequency_penalty != 0)
  logits = jax.lax.cond(jnp.any(penalized),
                        lambda x: apply_penalties(x, sp, counts_table[rows], prompt_table[rows]),
                        lambda x: x, logits)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def sampled(_):
    V = logits.shape[-1]
    scaled = logits / jnp.where(sp.temperature > 0, sp.temperature, 1.0)[:, None]
    desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, V), V)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
    in_k = jnp.arange(V)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.maximum(jnp.sum(in_k & (before < sp.top_p[:, None]), axis=-1), 1)
    pth = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
    mth = desc[:, :1] + jnp.log(jnp.maximum(sp.min_p, 1e-30))[:, None]
    threshold = jnp.maximum(jnp.maximum(kth, pth), jnp.where(sp.min_p[:, None] > 0, mth, -jnp.inf))
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(sp.seed, sp.position)
    drawn = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
    return jnp.where(sp.temperature > 0, drawn, greedy)

  ids = jax.lax.cond(jnp.any(sp.temperature > 0), sampled, lambda _: greedy, None)
  top_lp, top_ids = jax.lax.top_k(log_probs, min(MAX_LOGPROBS, log_probs.shape[-1]))
  return ids, jnp.take_along_axis(log_probs, ids[:, None], axis=-1)[:, 0], top_ids, top_lp


reference = jax.jit(reference_sample)


@functools.cache
def sampler(width, mode=ALL_WORK):
  return jax.jit(functools.partial(sample, candidates=width, mode=mode))


def random_batch(rng, B, V, W):
  """Logits of mixed peakiness, and per-row controls around every edge: top-k
  next to the candidate width W and the vocab, top-p near 1, tiny min-p."""
  scale = rng.choice([0.3, 1.0, 3.0, 8.0], size=(B, 1))
  logits = (rng.normal(size=(B, V)) * scale).astype(np.float32)
  pick = lambda options: np.asarray(options)[rng.integers(0, len(options), B)]
  penalize = rng.random(B) < 0.3
  R = B + 3
  sp = SamplingBatch(
      temperature=jnp.asarray(pick([0.0, 0.3, 1.0, 1.0, 1.7]), jnp.float32),
      top_k=jnp.asarray(pick([0, 0, 1, 3, W - 1, W, W + 1, V // 2, V - 1, V, V + 7]), jnp.int32),
      top_p=jnp.asarray(pick([1.0, 1.0, 0.999999, 0.9999, 0.95, 0.6, 1e-6]), jnp.float32),
      min_p=jnp.asarray(pick([0.0, 0.0, 1e-9, 1e-4, 0.05, 0.5, 1.0]), jnp.float32),
      repetition_penalty=jnp.asarray(np.where(penalize, pick([1.0, 0.8, 1.3]), 1.0), jnp.float32),
      presence_penalty=jnp.asarray(np.where(penalize, pick([0.0, 0.5, -0.5]), 0.0), jnp.float32),
      frequency_penalty=jnp.asarray(np.where(penalize, pick([0.0, 0.2]), 0.0), jnp.float32),
      seed=jnp.asarray(rng.integers(0, 2**32, B), jnp.uint32),
      position=jnp.asarray(rng.integers(0, 4096, B), jnp.int32),
      want_logprobs=jnp.asarray(rng.random(B) < 0.5))
  counts = jnp.asarray(rng.integers(0, 3, (R, V)) * (rng.random((R, V)) < 0.05), jnp.int32)
  prompt = jnp.asarray(rng.random((R, V)) < 0.05)
  rows = jnp.asarray(rng.permutation(R)[:B], jnp.int32)
  return jnp.asarray(logits), sp, counts, prompt, rows


@pytest.mark.parametrize("width,rows_at_once", [(8, False), (64, False), (256, False), (64, True)])
def test_matches_the_full_sort_reference(width, rows_at_once):
  """In the mode the host reads off each batch (the engine's), with the candidates' fallback
  loop (CPU) or every truncated row sorted (rows_at_once: GPU)."""
  B, V = 16, 512
  rng = np.random.default_rng(width)
  paths = np.zeros(2, int)  # truncated sampled rows settled by the candidates, rows that sorted
  for _ in range(25):
    args = random_batch(rng, B, V, width)
    mode = SamplerMode.of(jax.device_get(args[1]), V, rows_at_once=rows_at_once)
    got = [np.asarray(o) for o in sampler(width, mode)(*args)]
    want = [np.asarray(o) for o in reference(*args)]
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
    asked = np.asarray(args[1].want_logprobs)
    np.testing.assert_array_equal(got[2][asked], want[2][asked])
    np.testing.assert_allclose(got[3][asked], want[3][asked], rtol=1e-5, atol=1e-5)
    truncated, decided = truncated_and_decided(*args, width)
    paths += [np.sum(truncated & decided), np.sum(truncated & ~decided)]
  assert (paths > 10).all(), paths  # both paths ran


def truncated_and_decided(logits, sp, counts, prompt, rows, width):
  """Which rows sample with a truncation, and which of those `candidate_thresholds`
  settles ([B] bool each; penalties as in `sample`)."""
  scores = apply_penalties(logits, sp, counts[rows], prompt[rows])
  V = logits.shape[-1]
  t = jnp.where(sp.temperature > 0, sp.temperature, 1.0)[:, None]
  top_k = jnp.where(sp.top_k < V, sp.top_k, 0)
  truncated = (sp.temperature > 0) & ((top_k > 0) | (sp.top_p < 1) | (sp.min_p > 0))
  decided = candidate_thresholds(scores, t, top_k, sp.top_p, sp.min_p, width)[-1]
  return np.asarray(truncated), np.asarray(decided)


def batch_of(logits, **controls):
  B = logits.shape[0]
  defaults = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                  presence_penalty=0.0, frequency_penalty=0.0, seed=0, position=0, want_logprobs=False)
  dtypes = dict(top_k=jnp.int32, seed=jnp.uint32, position=jnp.int32, want_logprobs=jnp.bool_)
  cols = {k: jnp.broadcast_to(jnp.asarray(controls.get(k, v), dtypes.get(k, jnp.float32)), (B,))
          for k, v in defaults.items()}
  return SamplingBatch(**cols)


FLAT = np.random.default_rng(3).normal(size=(6, 2000)).astype(np.float32)  # mass spread thin


@pytest.mark.parametrize("controls", [dict(top_k=300), dict(top_p=0.999), dict(top_p=0.9),
                                      dict(min_p=1e-9), dict(top_k=1500, top_p=0.5)])
def test_thresholds_beyond_the_candidates_fall_back_to_the_exact_path(controls):
  W = 256
  sp = batch_of(FLAT, seed=np.arange(6), position=7, **controls)
  V = FLAT.shape[1]
  top_k = jnp.where(sp.top_k < V, sp.top_k, 0)
  decided = candidate_thresholds(jnp.asarray(FLAT), jnp.ones((6, 1)), top_k, sp.top_p, sp.min_p, W)[-1]
  assert not np.asarray(decided).any()
  history = jnp.zeros((6, V), jnp.int32), jnp.zeros((6, V), bool), jnp.arange(6)
  got = sampler(W)(jnp.asarray(FLAT), sp, *history)
  want = reference(jnp.asarray(FLAT), sp, *history)
  np.testing.assert_array_equal(got[0], want[0])


def test_a_row_that_falls_back_does_not_change_its_neighbours():
  logits = np.concatenate([FLAT[:1] * 8, FLAT[1:2]])  # a peaked row, a flat one
  run_ = sampler(64)
  history = jnp.zeros((2, 2000), jnp.int32), jnp.zeros((2, 2000), bool), jnp.arange(2)
  sp = batch_of(logits, top_p=0.95)
  _, decided = truncated_and_decided(jnp.asarray(logits), sp, *history, 64)
  assert decided.tolist() == [True, False]
  together = run_(jnp.asarray(logits), batch_of(logits, top_p=0.95, seed=11, position=[3, 4]),
                  *history)[0]
  alone = run_(jnp.asarray(logits[:1]), batch_of(logits[:1], top_p=0.95, seed=11, position=3),
               history[0][:1], history[1][:1], history[2][:1])[0]
  flat_alone = run_(jnp.asarray(logits[1:]), batch_of(logits[1:], top_p=0.95, seed=11, position=4),
                    history[0][:1], history[1][:1], history[2][:1])[0]
  assert together[0] == alone[0] and together[1] == flat_alone[0]


def test_gumbel_noise_at_chosen_tokens_is_jax_randoms():
  assert _bits_are_per_index()  # a JAX upgrade that renames a flag would lose the fast path
  V = 3000
  keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(
      jnp.arange(4, dtype=jnp.uint32) * 977, jnp.arange(4) + 5)
  idx = jnp.asarray(np.random.default_rng(0).integers(0, V, (4, 64)), jnp.int32)
  full = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
  np.testing.assert_array_equal(jax.jit(_gumbel_at)(keys, idx), jnp.take_along_axis(full, idx, -1))


def test_sort_descending_matches_jnp():
  x = np.random.default_rng(1).normal(size=999).astype(np.float32)
  x[[5, 9]] = [0.0, x[3]]
  np.testing.assert_array_equal(jax.jit(sort_descending)(x), -np.sort(-x))


@pytest.mark.parametrize("V", [999, 1024, 49152])  # jnp.argmax; blocks of 512 (2, 96 blocks)
def test_first_argmax_matches_jnp(V):
  x = np.random.default_rng(V).normal(size=(4, V)).astype(np.float32)
  x[0, [V - 3, 700, 10]] = x[0].max() + 1  # ties in different blocks: the first wins
  x[1] = 0.5  # all tied
  x[2, -1] = np.inf
  np.testing.assert_array_equal(jax.jit(first_argmax)(x), jnp.argmax(jnp.asarray(x), axis=-1))
  x[3, [7, 9]] = np.nan
  assert 0 <= int(jax.jit(first_argmax)(x)[3]) < V  # NaN rows: some token


def test_a_mode_with_more_work_on_draws_the_same_tokens():
  """Work a batch does not need leaves its rows bit-exact: the host may pick any mode that
  covers the batch (ALL_WORK covers every batch)."""
  rng = np.random.default_rng(5)
  B, V, W = 16, 512, 64
  for _ in range(5):
    args = random_batch(rng, B, V, W)
    least = SamplerMode.of(jax.device_get(args[1]), V)
    got = [np.asarray(o) for o in sampler(W, least)(*args)]
    want = [np.asarray(o) for o in sampler(W, ALL_WORK)(*args)]
    for a, b in zip(got, want):
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("controls,at_once,mode", [
    (dict(temperature=0.0), True, SamplerMode()),
    (dict(temperature=0.8), True, SamplerMode(draw=True, rows_at_once=True)),
    (dict(temperature=0.8), False, SamplerMode(draw=True)),
    (dict(temperature=0.0, repetition_penalty=1.2), True, SamplerMode(process=True)),
    (dict(temperature=0.0, want_logprobs=True), True, SamplerMode(logprobs=True)),
    (dict(temperature=0.8, top_p=0.9), True, SamplerMode(truncate=True, rows_at_once=True)),
])
def test_the_host_picks_the_mode_and_the_program_never_branches(controls, at_once, mode):
  """SamplerMode.of reads the batch's needs on the host, and the program compiled for that
  mode has no conditional and no loop with a data-dependent trip count (on XLA:GPU either
  would make the host wait for the step)."""
  sp = batch_of(LOGITS, **controls)
  assert SamplerMode.of(jax.device_get(sp), LOGITS.shape[1], rows_at_once=at_once) == mode
  history = jnp.zeros((4, 50), jnp.int32), jnp.zeros((4, 50), bool), jnp.arange(4)
  hlo = sampler(CANDIDATES_FOR_TEST, mode).lower(jnp.asarray(LOGITS), sp, *history).compile(compiler_options=USER_XLA).as_text()
  assert data_dependent_control_flow(hlo) == []


def test_warm_modes_cover_every_batch():
  """Each flag set has a warm mode that covers it, on both backends (runner.sampler_mode)."""
  import itertools
  for flags in itertools.product([False, True], repeat=4):
    for at_once in (False, True):
      need = SamplerMode(*flags, rows_at_once=at_once and (flags[0] or flags[1]))
      warm = [m._replace(rows_at_once=at_once and (m.draw or m.truncate)) for m in WARM_MODES]
      assert any(m.covers(need) for m in warm), need
  assert not SamplerMode(process=True).covers(SamplerMode(draw=True))


CANDIDATES_FOR_TEST = 16


def data_dependent_control_flow(hlo: str) -> list[str]:
  """The conditionals and the loops without a known trip count in optimized HLO text.
  (XLA:CPU rolls threefry's 5 rounds into a loop of known trip count: no predicate is read.)"""
  return [line.strip()[:160] for line in hlo.splitlines()
          if " conditional(" in line or (" while(" in line and '"known_trip_count"' not in line)]


def test_the_candidates_fallback_loop_is_the_only_loop_and_only_without_rows_at_once():
  """The CPU's truncation keeps a loop over the rows whose threshold lies past the candidates
  (a sort costs ~5 ms a row there); this test would fail if another loop crept in."""
  sp = batch_of(LOGITS, temperature=0.8, top_p=0.9)
  history = jnp.zeros((4, 50), jnp.int32), jnp.zeros((4, 50), bool), jnp.arange(4)
  hlo = sampler(CANDIDATES_FOR_TEST, SamplerMode(truncate=True)).lower(
      jnp.asarray(LOGITS), sp, *history).compile(compiler_options=USER_XLA).as_text()
  assert len(data_dependent_control_flow(hlo)) == 1 and " conditional(" not in hlo
