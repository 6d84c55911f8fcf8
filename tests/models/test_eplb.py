"""EPLB (models/eplb.py): the greedy planner's exact placements, the replica choice, placement
files and their errors, and, on 8 fake CPU devices, a DeepSeek-V3-shaped MoE FFN whose experts
are laid out by several placements (redundant replicas included) giving the non-EP FFN's output;
the ragged dispatch run through an all-gather stand-in for `ragged_all_to_all` (XLA:CPU has
none: checked here too)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_dir
from jaxinfer.config import ModelConfig
from jaxinfer.errors import InvalidRequestError
from jaxinfer.models import eplb, moe
from jaxinfer.models.eplb import EplbConfig, Placement, assign_slots, plan
from jaxinfer.models.expert_parallel import ExpertParallelism, choose_dispatch, ep_moe_ffn, supports_ragged_all_to_all
from jaxinfer.params import is_spec, moe_specs
from jaxinfer.sharding import make_mesh, make_rules, mesh_axes, named_sharding

# ---- planning ------------------------------------------------------------------------


def test_plan_replicates_the_hottest_and_packs_by_load():
  """8 experts, 4 devices, 4 redundant slots (3 per device). Replicate: e0 80 -> 2 copies (40
  each), then e0 (40, ties e1 at 40: the lower id) -> 3, e1 -> 2, e0 (26.7) -> 4: e0 x4 at 20,
  e1 x2 at 20, e2 20, e3..e7 10. Pack heaviest first onto the least loaded device with room:
  the seven 20s go d0 d1 d2 d3 d0 d1 d2, then the 10s d3 d3 d0 d1 d2: 50, 50, 50, 40 rows,
  where the plain layout (2 experts per device) puts 120 of 190 on device 0."""
  counts = [80, 40, 20, 10, 10, 10, 10, 10]
  p = plan(counts, num_devices=4, num_redundant=4)
  assert p.slots == ((0, 1, 5, 0, 1, 6, 0, 2, 7, 0, 3, 4),)
  assert p.slots_per_device == 3 and p.num_redundant == 4 and p.max_replicas == 5
  np.testing.assert_array_equal(p.device_loads(counts), [[50, 50, 50, 40]])
  plain = Placement(8, 4, (tuple(range(8)),))
  np.testing.assert_array_equal(plain.device_loads(counts), [[120, 30, 20, 20]])


def test_plan_packs_groups_onto_hosts_first():
  """2 hosts, 4 groups of 2 experts: group loads 100, 2, 60, 4 -> g0 host 0, g2 host 1, g3 host 1
  (64 < 100), g1 host 0 (host 1 full). Each host then replicates its hottest two (6 slots for 4
  experts) and packs onto its 2 devices; no expert leaves its group's host."""
  counts = [50, 50, 1, 1, 30, 30, 2, 2]
  p = plan(counts, num_devices=4, num_redundant=4, num_hosts=2, num_groups=4)
  assert p.slots == ((0, 1, 2, 0, 1, 3, 4, 5, 6, 4, 5, 7),)
  # One host, the same counts: the global plan mixes the groups.
  assert plan(counts, 4, 4).slots == ((0, 4, 6, 0, 4, 7, 1, 2, 5, 1, 3, 5),)


def test_plan_puts_an_experts_replicas_on_different_devices():
  """4 experts, 2 devices, 2 redundant slots: e0 (25) and e1 (19) get a second replica (12.5
  and 9.5 each). Heaviest first onto the lighter device: e2 15 -> d0, e0 12.5 -> d1; the
  other e0 12.5 would go to the lighter d1 too, a twin that moves none of e0's load off d1,
  so it goes to d0; e1 9.5 -> d1, e1 9.5 -> d0 (d1 holds e1), e3 8 -> d1 (d0 is full): 37
  and 30 rows. (The twin plan's 34 and 33 balance on paper only: its two e0 copies share
  d1's e0 tokens, so a skew within e0 stays on d1.)"""
  counts = [25, 19, 15, 8]
  p = plan(counts, num_devices=2, num_redundant=2)
  assert p.slots == ((0, 1, 2, 0, 1, 3),)
  np.testing.assert_array_equal(p.device_loads(counts), [[37, 30]])
  # Zipf-skewed 64 experts over 8 devices with 8 redundant slots: no device holds a twin.
  p = plan(1e4 / np.arange(1, 65), num_devices=8, num_redundant=8)
  for device in np.reshape(p.slots[0], (8, -1)):
    assert len(set(device.tolist())) == len(device)


def test_plan_per_layer_and_without_redundancy():
  counts = np.array([[1, 2, 3, 4], [4, 3, 2, 1]])
  p = plan(counts, num_devices=2, num_redundant=0)
  # Heaviest first onto the lighter device: 4 -> d0, 3 -> d1, 2 -> d1, 1 -> d0.
  assert p.slots == ((0, 3, 1, 2), (0, 3, 1, 2))
  np.testing.assert_array_equal(p.device_loads(counts), [[5, 5], [5, 5]])


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_devices=3, num_redundant=0), "8 experts \\+ 0 redundant = 8 slots do not split evenly over 3"),
    (dict(num_devices=4, num_redundant=-1), "num_redundant_experts must be an int >= 0"),
    (dict(num_devices=4, num_redundant=0, num_hosts=3, num_groups=4), "split\\s+evenly over 3 hosts"),
    (dict(num_devices=4, num_redundant=0, num_groups=3), "8 experts do not split into 3 groups"),
])
def test_plan_errors(kwargs, match):
  with pytest.raises(InvalidRequestError, match=match):
    plan(np.ones(8), **kwargs)


def test_assign_slots_shares_an_experts_rows_over_its_replicas():
  """The placement above: e0 in slots 0, 3, 6, 9, e1 in 1, 4. From source 1, e0's copies (in
  copy order) take replicas 1, 2, 3, 0, 1 -> slots 3, 6, 9, 0, 3; e1's take 1, 0, 1 -> 4, 1, 4."""
  p = Placement(8, 4, ((0, 1, 5, 0, 1, 6, 0, 2, 7, 0, 3, 4),))
  table, reps = p.tables()
  np.testing.assert_array_equal(table[0, 0], [0, 3, 6, 9, 0])
  np.testing.assert_array_equal(table[0, 1], [1, 4, 1, 1, 1])
  np.testing.assert_array_equal(reps[0], [4, 2, 1, 1, 1, 1, 1, 1])
  ids = jnp.array([[0, 1], [0, 2], [0, 1], [0, 3], [0, 1]])
  got = assign_slots(ids, jnp.asarray(table[0]), jnp.asarray(reps[0]), 1)
  np.testing.assert_array_equal(got, [[3, 4], [6, 7], [9, 1], [0, 10], [3, 4]])


# ---- files and checks ----------------------------------------------------------------


def test_placement_file_round_trip_and_model_checks(tmp_path):
  p = plan([5, 1, 1, 1], num_devices=2, num_redundant=2)
  path = tmp_path / "placement.json"
  p.save(path)
  assert Placement.load(path) == p
  assert EplbConfig.parse(str(path)).placement == p
  assert p.check(4, 2, 3).slots == p.slots * 3  # one layer's placement for every MoE layer
  with pytest.raises(InvalidRequestError, match="the placement is for 4 experts, the model has 8"):
    p.check(8, 2, 3)
  with pytest.raises(InvalidRequestError, match="for 2 expert-parallel devices, the mesh splits the experts over 8"):
    p.check(4, 8, 3)
  two = Placement(4, 2, p.slots * 2)
  with pytest.raises(InvalidRequestError, match="2 layers of slots, the model 3 MoE layers"):
    two.check(4, 2, 3)


@pytest.mark.parametrize("slots, match", [
    (((0, 1, 2),), "needs a multiple of 2 slots, at least 4; got 3"),
    (((0, 1, 2, 2),), "experts \\[3\\] have no slot"),
    (((0, 1, 2, 9),), "expert ids \\[9\\] are not in \\[0, 4\\)"),
    (((0, 1, 2, 3), (0, 1, 2, 3, 0, 1)), "different slot counts"),
])
def test_bad_placements_are_named(slots, match):
  with pytest.raises(InvalidRequestError, match=match):
    Placement(4, 2, slots)


def test_counts_files(tmp_path):
  f = tmp_path / "c.json"
  f.write_text(json.dumps({"expert_tokens": [[1, 2], [3, 4]]}))
  np.testing.assert_array_equal(eplb.load_counts(f), [[1, 2], [3, 4]])
  f.write_text(json.dumps({"moe_expert_tokens": [1, 2, 3]}))  # LLMEngine.stats(): summed over layers
  np.testing.assert_array_equal(eplb.load_counts(f), [[1, 2, 3]])
  f.write_text(json.dumps({"tokens": [1]}))
  with pytest.raises(InvalidRequestError, match="want a key 'expert_tokens'"):
    eplb.load_counts(f)
  f.write_text(json.dumps([[-1, 2]]))
  with pytest.raises(InvalidRequestError, match="finite and >= 0"):
    eplb.load_counts(f)


def test_a_placement_file_that_is_not_one(tmp_path):
  f = tmp_path / "p.json"
  f.write_text(json.dumps({"slots": [[0]]}))
  with pytest.raises(InvalidRequestError, match="not an EPLB placement"):
    Placement.load(f)
  with pytest.raises(InvalidRequestError, match="cannot read EPLB placement"):
    Placement.load(tmp_path / "missing.json")


# ---- the FFN under placements ----------------------------------------------------------


def deepseek_config() -> ModelConfig:
  """The tiny DeepSeek-V3 (sigmoid router with bias, 4 groups / top-2 groups, a shared expert),
  widened to 16 experts, 4 per token."""
  cfg = ModelConfig.from_hf(json.loads((tiny_dir("deepseek_v3") / "config.json").read_text()))
  return dataclasses.replace(cfg, num_experts=16, num_experts_per_token=4)


CFG = deepseek_config()


def random_params(cfg, seed=1):
  rng = np.random.default_rng(seed)

  def one(spec):
    scale = 1 / np.sqrt(spec.fan_in) if spec.linear else 0.1
    return jnp.asarray(rng.normal(size=spec.shape) * scale, jnp.float32)

  return jax.tree.map(one, moe_specs(cfg, 1), is_leaf=is_spec)


def placements(n: int) -> dict[str, Placement]:
  E = CFG.num_experts
  zipf = 1.0 / np.arange(1, E + 1) ** 1.2
  return {
      "permuted": Placement(E, n, (tuple(int(e) for e in np.random.default_rng(0).permutation(E)),)),
      "planned": plan(zipf[np.random.default_rng(1).permutation(E)], n, 8),
      "one_hot_expert": Placement(E, n, (tuple(range(E)) + (5,) * 8,)),  # e5: 9 replicas
  }


def ragged_all_to_all_by_gather(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name):
  """jax.lax.ragged_all_to_all's documented semantics from all-gathers (which XLA:CPU runs): each
  sender i's rows operand_i[input_offsets_i[me] :+ send_sizes_i[me]] land at output_offsets_i[me]."""
  me = jax.lax.axis_index(axis_name)
  ops = jax.lax.all_gather(operand, axis_name)  # [n, N, ...]
  ins, sizes, outs = (jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets))
  pos = jnp.arange(output.shape[0])
  result = output
  for i in range(ops.shape[0]):
    k = pos - outs[i, me]
    mask = (k >= 0) & (k < sizes[i, me])
    rows = ops[i][jnp.clip(ins[i, me] + k, 0, operand.shape[0] - 1)]
    result = jnp.where(mask.reshape((-1,) + (1,) * (output.ndim - 1)), rows, result)
  return result


MESHES = {"expert8": ((1, 8, 1), None), "wide_2x2x2": ((2, 2, 2), {"experts": ("data", "expert")})}


def placed_ffn(p, placement, mesh_name, dispatch):
  shape, overrides = MESHES[mesh_name]
  mesh, rules = make_mesh(*shape), make_rules(overrides)
  shardings = jax.tree.map(lambda s: named_sharding(s.axes, s.shape, mesh, rules), moe_specs(CFG, 1),
                           is_leaf=is_spec)
  placed = eplb.relayout({"layers": [{"moe": jax.device_put(p, shardings)}]}, placement)["layers"][0]["moe"]
  exchange = ragged_all_to_all_by_gather if dispatch == "ragged" else None
  f = jax.jit(lambda p, x, valid: ep_moe_ffn(
      p, CFG, x, valid, mesh=mesh, expert_axes=mesh_axes("experts", rules["experts"]),
      mlp_axes=mesh_axes("mlp", rules["mlp"]), dispatch=dispatch, ragged_all_to_all=exchange))
  return f, placed


def skewed(p):
  """Every token picks the same 4 experts (the bias steers all to 12..15; the router is zero)."""
  return dict(p, router=jnp.zeros_like(p["router"]), router_bias=jnp.zeros_like(p["router_bias"]).at[12:].set(10.0))


@pytest.mark.parametrize("mesh_name, placement, dispatch", [
    ("expert8", "permuted", "fixed"), ("expert8", "planned", "fixed"), ("expert8", "one_hot_expert", "fixed"),
    ("wide_2x2x2", "planned", "fixed"), ("wide_2x2x2", "one_hot_expert", "fixed"),
    ("expert8", "planned", "ragged"), ("expert8", "one_hot_expert", "ragged"), ("wide_2x2x2", "planned", "ragged"),
])
def test_placed_ep_ffn_equals_the_non_ep_ffn(mesh_name, placement, dispatch):
  """Random routing (T=13 divides no mesh axis) and every token on the same 4 experts (the
  capacity's worst case, with 'one_hot_expert' none of them replicated, with 'planned' some)."""
  n = 8 if mesh_name == "expert8" else 4
  pl = placements(n)[placement]
  p = random_params(CFG)
  x = jax.random.normal(jax.random.key(2), (13, CFG.hidden_size))
  valid = jnp.arange(13) < 12
  ref_ffn = jax.jit(moe.moe_ffn, static_argnums=1)
  f, placed = placed_ffn(p, pl, mesh_name, dispatch)
  assert placed["w_gate"].shape[0] == pl.num_slots
  assert placed["w_gate"].sharding.shard_shape(placed["w_gate"].shape)[0] == pl.slots_per_device
  for params in (p, skewed(p)):
    ref, ref_stats = ref_ffn(params, CFG, x, valid)
    assert np.abs(np.asarray(ref)).min() > 0
    weights = {k: v for k, v in placed.items() if k in eplb.EXPERT_KEYS}
    out, stats = f({**params, **weights, **{k: placed[k] for k in (eplb.SLOTS_KEY, eplb.REPLICAS_KEY)}}, x, valid)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(stats.tokens_per_expert, ref_stats.tokens_per_expert)  # logical experts


def test_placed_ffn_on_one_device_and_replicas_really_share_rows():
  """The non-EP moe_ffn under a placement (n = 1) gives the same output; and the replicas of a
  hot expert each get a share of its rows: with 'one_hot_expert' over 8 devices, expert 5's 9
  replicas split the 13 tokens that all pick it."""
  p = skewed(random_params(CFG))
  p = dict(p, router_bias=p["router_bias"].at[5].set(10.0).at[12].set(0.0))  # all pick 5, 13, 14, 15
  x = jax.random.normal(jax.random.key(2), (13, CFG.hidden_size))
  _, ids = moe.route(p, CFG, x)
  assert (np.sort(np.asarray(ids), axis=1) == [5, 13, 14, 15]).all()
  one = Placement(16, 1, (tuple(range(16)) + (5,) * 8,))
  placed = eplb.relayout({"layers": [{"moe": p}]}, one)["layers"][0]["moe"]
  np.testing.assert_allclose(moe.moe_ffn(placed, CFG, x)[0], moe.moe_ffn(p, CFG, x)[0], atol=1e-5, rtol=0)
  table, reps = one.tables()
  slots = np.asarray(assign_slots(ids, jnp.asarray(table[0]), jnp.asarray(reps[0]), 0))
  # 13 copies of e5 over its 9 slots (5, then 16..23) in turn: slots 5, 16..18 twice, the rest once.
  used = np.bincount(slots[np.asarray(ids) == 5], minlength=24)
  np.testing.assert_array_equal(used[[5] + list(range(16, 24))], [2, 2, 2, 2, 1, 1, 1, 1, 1])


# ---- the dispatch's choice -------------------------------------------------------------


def test_xla_cpu_has_no_ragged_all_to_all_so_the_fixed_dispatch_is_chosen():
  devices = tuple(jax.devices("cpu"))
  assert not supports_ragged_all_to_all(devices)
  assert choose_dispatch(devices) == "fixed"
  ep = ExpertParallelism.from_rules(make_mesh(1, 8, 1), make_rules(None))
  assert ep.dispatch == "fixed" and ep.num_devices == 8


def test_the_ragged_dispatch_lowers_to_ragged_all_to_all():
  """With jax's own collective the ragged path traces and lowers (what a GPU would compile);
  XLA:CPU then refuses to compile it."""
  p = random_params(CFG)
  f, placed = placed_ffn(p, placements(8)["planned"], "expert8", "ragged")
  f = jax.jit(lambda p, x: ep_moe_ffn(p, CFG, x, mesh=make_mesh(1, 8, 1), expert_axes=("expert",),
                                      dispatch="ragged"))
  lowered = f.lower(placed, jnp.ones((16, CFG.hidden_size)))
  assert lowered.as_text().count("ragged_all_to_all") == 3  # rows, their slots, and the results back
  with pytest.raises(Exception, match="ragged-all-to-all"):
    lowered.compile()


def test_placed_wide_ep_nested_in_attention_dp_shard_map():
  """Under attention DP the FFN runs inside the runner's shard_map over 'data': each data shard
  holds its block of slots (S / 2), routes its own tokens, and reaches every slot of the 4
  (data, expert) devices; the replica choice uses the device's index over both axes."""
  from jax.sharding import PartitionSpec as P
  pl = placements(4)["planned"]
  p = random_params(CFG)
  _, placed = placed_ffn(p, pl, "wide_2x2x2", "fixed")
  mesh = make_mesh(2, 2, 2)
  x = jax.random.normal(jax.random.key(3), (2 * 13, CFG.hidden_size))
  ref = np.concatenate([jax.jit(moe.moe_ffn, static_argnums=1)(p, CFG, x[i * 13:(i + 1) * 13])[0] for i in range(2)])
  pspec = {k: P("data") if k.startswith("w_") else P() for k in placed}
  pspec["shared"] = jax.tree.map(lambda _: P(), placed["shared"])

  def shard(p, x):
    return ep_moe_ffn(p, CFG, x, mesh=mesh, expert_axes=("data", "expert"), mlp_axes=("model",))[0]
  f = jax.jit(jax.shard_map(shard, mesh=mesh, axis_names={"data"}, check_vma=False,
                            in_specs=(pspec, P("data")), out_specs=P("data")))
  np.testing.assert_allclose(f(placed, x), ref, atol=1e-5, rtol=0)
