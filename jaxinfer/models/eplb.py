"""Expert-parallel load balancing (EPLB): redundant copies of hot experts, placed by measured load.

Legend: L MoE layers, E logical experts (the model's), S physical slots (E + redundant),
n EP devices, Sl = S / n slots per device, Rm = 1 + S - E the most replicas one expert can have,
T tokens, A active experts per token.

Without EPLB, expert e lives on device e // (E / n), so a hot expert makes its device the
step's slowest (the step waits for the busiest device's rows). With a `Placement`, each MoE
layer has S >= E physical slots, Sl on each device; slot s holds a copy of logical expert
`slots[layer][s]`; every expert has at least one slot, a hot one several. The router still
picks logical experts; `assign_slots` turns each token copy's choice into one of that expert's
slots, so replicas share its rows. The weights are laid out by slot ([S, ...] instead of
[E, ...], `relayout`), and since every replica of an expert holds the same weights the MoE
output does not change, only which device computes it.

Planning (`plan`) is the greedy packing of DeepSeek's EPLB (github.com/deepseek-ai/EPLB,
`rebalance_experts_hierarchical`), which TensorRT-LLM's wide-EP load balancer also uses:
  1. with several hosts, the expert groups (DeepSeek-V3's `n_group`, which node-limited routing
     keeps a token within) are packed onto hosts by load, the same number on each, so most
     traffic stays inside a host;
  2. replicate: each redundant slot goes, one at a time, to the expert with the most load per
     replica (load / replicas so far);
  3. pack: the replicas, heaviest (load per replica) first, each onto the least-loaded device
     that still has a free slot (`balanced_packing`).
Offline: `jaxinfer eplb plan` writes a placement from recorded counts. Online
(`OnlineBalancer`, driven by the engine between steps): every `replan_interval` steps the
counts of the last `window` steps are planned again and the slot weights rebuilt (a gather
from the current slots: every expert has one) before the engine swaps them in, so no step
sees a half-moved expert.

Replica choice (`assign_slots`): a source device's copies of expert e, in token order, take
its replicas in turn, starting at replica (source device index) mod replicas: deterministic,
and each source splits its rows of e evenly (within one) over the replicas, which is what the
planner assumed (load / replicas each).
"""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import from_options
from jaxinfer.errors import InvalidRequestError

FORMAT = "jaxinfer-eplb-placement/1"
# The MoE layer's expert weights: leading axis E (logical) or S (by slot, under a placement).
EXPERT_KEYS = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")
# Replicated tables the EP FFN reads (int32): each logical expert's slots [E, Rm] (unused
# entries repeat its first slot) and its number of replicas [E].
SLOTS_KEY, REPLICAS_KEY = "eplb_slots", "eplb_replicas"


@dataclasses.dataclass(frozen=True)
class Placement:
  """Which logical expert each physical slot holds, per MoE layer: `slots[layer][s]`.

  Slot s lives on EP device s // slots_per_device (the devices in the order of the mesh axes
  the 'experts' rule names). A placement of one layer applies to every MoE layer."""

  num_experts: int
  num_devices: int
  slots: tuple[tuple[int, ...], ...]  # [L][S]

  def __post_init__(self):
    object.__setattr__(self, "slots", tuple(tuple(int(e) for e in layer) for layer in self.slots))
    E, n = self.num_experts, self.num_devices
    for name, v in (("num_experts", E), ("num_devices", n)):
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InvalidRequestError(f"placement {name} must be a positive int, got {v!r}")
    if not self.slots:
      raise InvalidRequestError("a placement needs at least one layer of slots")
    S = len(self.slots[0])
    if any(len(layer) != S for layer in self.slots):
      raise InvalidRequestError(f"placement layers have different slot counts: {sorted({len(l) for l in self.slots})}")
    if S < E or S % n:
      raise InvalidRequestError(f"a placement of {E} experts over {n} devices needs a multiple of {n} slots, "
                                f"at least {E}; got {S}")
    for i, layer in enumerate(self.slots):
      bad = [e for e in layer if not 0 <= e < E]
      if bad:
        raise InvalidRequestError(f"placement layer {i}: expert ids {bad[:4]} are not in [0, {E})")
      missing = sorted(set(range(E)) - set(layer))
      if missing:
        raise InvalidRequestError(f"placement layer {i}: experts {missing[:8]} have no slot")

  @property
  def num_layers(self) -> int:
    return len(self.slots)

  @property
  def num_slots(self) -> int:
    return len(self.slots[0])

  @property
  def slots_per_device(self) -> int:
    return self.num_slots // self.num_devices

  @property
  def num_redundant(self) -> int:
    return self.num_slots - self.num_experts

  @property
  def max_replicas(self) -> int:
    return 1 + self.num_redundant

  def replicas(self) -> np.ndarray:
    """[L, E] int32: how many slots each expert has."""
    return np.stack([np.bincount(layer, minlength=self.num_experts) for layer in self.slots]).astype(np.int32)

  def tables(self) -> tuple[np.ndarray, np.ndarray]:
    """(slots of each expert [L, E, Rm] int32, in slot order, unused entries = its first;
    replicas [L, E] int32): what `assign_slots` reads."""
    L, E, Rm = self.num_layers, self.num_experts, self.max_replicas
    table = np.zeros((L, E, Rm), np.int32)
    for i, layer in enumerate(self.slots):
      per = collections.defaultdict(list)
      for s, e in enumerate(layer):
        per[e].append(s)
      for e, ss in per.items():
        table[i, e] = ss + [ss[0]] * (Rm - len(ss))
    return table, self.replicas()

  def device_loads(self, counts: np.ndarray) -> np.ndarray:
    """[L, n]: the rows each device would get from per-expert counts [L or 1, E], each expert's
    split evenly over its replicas (what `assign_slots` does, up to one row per source)."""
    counts = _as_counts(counts, self.num_experts)
    counts = np.broadcast_to(counts, (max(len(counts), self.num_layers), self.num_experts))
    slots = np.broadcast_to(np.asarray(self.slots), (len(counts), self.num_slots))
    reps = np.stack([np.bincount(s, minlength=self.num_experts) for s in slots])
    per_slot = np.take_along_axis(counts / reps, slots, axis=1)  # [L, S]
    return per_slot.reshape(len(counts), self.num_devices, -1).sum(axis=2)

  def for_layers(self, num_layers: int) -> "Placement":
    """This placement for a model of `num_layers` MoE layers (one layer's applies to all)."""
    if self.num_layers == num_layers:
      return self
    if self.num_layers == 1:
      return dataclasses.replace(self, slots=self.slots * num_layers)
    raise InvalidRequestError(f"the placement has {self.num_layers} layers of slots, the model "
                              f"{num_layers} MoE layers (give one per MoE layer, or one for all)")

  def check(self, num_experts: int, num_devices: int, num_layers: int) -> "Placement":
    """This placement for a model of `num_experts` experts over `num_devices` EP devices and
    `num_layers` MoE layers, or InvalidRequestError saying what does not match."""
    if self.num_experts != num_experts:
      raise InvalidRequestError(f"the placement is for {self.num_experts} experts, the model has {num_experts}")
    if self.num_devices != num_devices:
      raise InvalidRequestError(f"the placement is for {self.num_devices} expert-parallel devices, the mesh "
                                f"splits the experts over {num_devices} (the 'experts' rule's mesh axes)")
    return self.for_layers(num_layers)

  # ---- files -------------------------------------------------------------------------

  def to_json(self) -> dict[str, Any]:
    return {"format": FORMAT, "num_experts": self.num_experts, "num_devices": self.num_devices,
            "slots": [list(layer) for layer in self.slots]}

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "Placement":
    if not isinstance(d, Mapping) or d.get("format") != FORMAT:
      raise InvalidRequestError(f"not an EPLB placement (want a JSON object with format {FORMAT!r})")
    try:
      return cls(d["num_experts"], d["num_devices"], tuple(tuple(l) for l in d["slots"]))
    except (KeyError, TypeError) as e:
      raise InvalidRequestError(f"EPLB placement: {e!r}") from None

  def save(self, path: str | Path) -> None:
    Path(path).write_text(json.dumps(self.to_json()) + "\n")

  @classmethod
  def load(cls, path: str | Path) -> "Placement":
    try:
      d = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
      raise InvalidRequestError(f"cannot read EPLB placement {path}: {e}") from None
    return cls.from_json(d)


# ---- planning --------------------------------------------------------------------------


def balanced_packing(weight: np.ndarray, num_packs: int, group: np.ndarray | None = None) -> np.ndarray:
  """Pack N items (N divisible by num_packs) into num_packs packs of N / num_packs items each,
  heaviest first, each into the lightest pack with room (ties: the lowest index): pack [N].

  group [N]: items of one group (an expert's replicas) go to packs holding none of its items
  while some pack with room does: two replicas on one device would split that device's
  tokens between them, not the expert's load between devices."""
  N = len(weight)
  if N % num_packs:
    raise InvalidRequestError(f"{N} items do not pack evenly into {num_packs} packs")
  cap = N // num_packs
  load = np.zeros(num_packs)
  count = np.zeros(num_packs, np.int64)
  pack = np.empty(N, np.int64)
  held: list[set] = [set() for _ in range(num_packs)]
  for i in np.argsort(-np.asarray(weight, np.float64), kind="stable"):
    room = np.flatnonzero(count < cap)
    if group is not None:
      apart = [p for p in room if group[i] not in held[p]]
      room = np.asarray(apart) if apart else room
    p = room[np.argmin(load[room])]
    if group is not None:
      held[p].add(group[i])
    pack[i] = p
    load[p] += weight[i]
    count[p] += 1
  return pack


def replicate(weight: np.ndarray, num_slots: int) -> np.ndarray:
  """Replica counts [N] (each >= 1, summing to num_slots): the extra slots one at a time to the
  item with the most weight per replica (ties: the lowest index)."""
  reps = np.ones(len(weight), np.int64)
  w = np.asarray(weight, np.float64)
  for _ in range(num_slots - len(weight)):
    reps[np.argmax(w / reps)] += 1
  return reps


def _plan_layer(load: np.ndarray, num_devices: int, num_slots: int, num_hosts: int, num_groups: int) -> list[int]:
  """One layer's slots [S] (device d holds slots d * Sl ... (d + 1) * Sl - 1)."""
  E = len(load)
  group = E // num_groups
  # 1. groups onto hosts by load, num_groups / num_hosts each.
  host_of_group = balanced_packing(load.reshape(num_groups, group).sum(axis=1), num_hosts)
  per_host_slots, per_host_devices = num_slots // num_hosts, num_devices // num_hosts
  Sl = num_slots // num_devices
  slots = []
  for h in range(num_hosts):
    experts = np.concatenate([np.arange(g * group, (g + 1) * group) for g in np.flatnonzero(host_of_group == h)])
    # 2. the host's redundant slots to its hottest experts (by load per replica).
    reps = replicate(load[experts], per_host_slots)
    replica_expert = np.repeat(experts, reps)  # [per_host_slots], each expert's replicas together
    replica_load = np.repeat(load[experts] / reps, reps)
    # 3. the replicas onto the host's devices, heaviest first onto the least loaded.
    device = balanced_packing(replica_load, per_host_devices, group=replica_expert)
    for d in range(per_host_devices):
      on = replica_expert[device == d]
      assert len(on) == Sl
      slots.extend(int(e) for e in on)
  return slots


def plan(counts: np.ndarray, num_devices: int, num_redundant: int, *, num_hosts: int = 1,
         num_groups: int = 1) -> Placement:
  """A placement from per-expert counts [L, E] (or [E]: one layer for all): E + num_redundant
  slots over num_devices devices, replicas of the hottest experts packed by load (module doc).

  num_hosts > 1: the num_groups expert groups are packed onto hosts first (both must divide
  evenly: groups by hosts, devices by hosts, slots by hosts)."""
  counts = _as_counts(counts)
  L, E = counts.shape
  S = E + num_redundant
  for name, v in (("num_devices", num_devices), ("num_hosts", num_hosts), ("num_groups", num_groups)):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
      raise InvalidRequestError(f"{name} must be a positive int, got {v!r}")
  if isinstance(num_redundant, bool) or not isinstance(num_redundant, (int, np.integer)) or num_redundant < 0:
    raise InvalidRequestError(f"num_redundant_experts must be an int >= 0, got {num_redundant!r}")
  if S % num_devices:
    raise InvalidRequestError(f"{E} experts + {num_redundant} redundant = {S} slots do not split evenly over "
                              f"{num_devices} devices")
  if E % num_groups:
    raise InvalidRequestError(f"{E} experts do not split into {num_groups} groups")
  if num_groups % num_hosts or num_devices % num_hosts or S % num_hosts:
    raise InvalidRequestError(f"{num_groups} expert groups, {num_devices} devices and {S} slots must each split "
                              f"evenly over {num_hosts} hosts")
  if num_hosts > 1 and S // num_hosts < E // num_hosts:
    raise InvalidRequestError(f"{S} slots over {num_hosts} hosts cannot hold each host's experts")
  load = np.maximum(counts.astype(np.float64), 0.0)
  return Placement(E, num_devices, tuple(tuple(_plan_layer(l, num_devices, S, num_hosts, num_groups))
                                         for l in load))


def _as_counts(counts: Any, num_experts: int | None = None) -> np.ndarray:
  """Counts as float64 [L, E] from [L, E] or [E]; InvalidRequestError for anything else."""
  try:
    a = np.asarray(counts, np.float64)
  except (TypeError, ValueError):
    raise InvalidRequestError("expert counts must be numbers, [MoE layers, experts] or [experts]") from None
  if a.ndim == 1:
    a = a[None]
  if a.ndim != 2 or a.shape[1] < 1 or a.shape[0] < 1:
    raise InvalidRequestError(f"expert counts must be [MoE layers, experts] or [experts], got shape {a.shape}")
  if not np.isfinite(a).all() or (a < 0).any():
    raise InvalidRequestError("expert counts must be finite and >= 0")
  if num_experts is not None and a.shape[1] != num_experts:
    raise InvalidRequestError(f"expert counts have {a.shape[1]} experts, the placement {num_experts}")
  return a


def load_counts(path: str | Path) -> np.ndarray:
  """Recorded expert counts from a JSON file: `{"expert_tokens": [[...], ...]}` ([MoE layers, E],
  `LLMEngine.expert_tokens` as a list), the same array bare, or the `moe_expert_tokens` [E] of
  `LLMEngine.stats()` (summed over layers: one layer for all)."""
  try:
    d = json.loads(Path(path).read_text())
  except (OSError, ValueError) as e:
    raise InvalidRequestError(f"cannot read expert counts {path}: {e}") from None
  if isinstance(d, Mapping):
    key = next((k for k in ("expert_tokens", "moe_expert_tokens") if k in d), None)
    if key is None:
      raise InvalidRequestError(f"{path}: want a key 'expert_tokens' ([MoE layers, experts]) or "
                                f"'moe_expert_tokens' ([experts])")
    d = d[key]
  return _as_counts(d)


# ---- the slots, on device --------------------------------------------------------------


def assign_slots(ids, slot_table, replicas, source):
  """Each token copy's slot: ids [T, A] logical experts -> [T, A] int32 physical slots.

  slot_table [E, Rm], replicas [E] (`Placement.tables`, one layer); `source`: this device's
  index among the EP devices (an int or a traced scalar). The copies of expert e, in copy
  order t * A + a, take its replicas in turn from replica `source` mod replicas (module doc)."""
  T, A = ids.shape
  E = slot_table.shape[0]
  flat = ids.reshape(-1)  # [R]
  order = jnp.argsort(flat, stable=True)
  per_expert = jnp.bincount(flat, length=E)
  rank_sorted = jnp.arange(flat.shape[0]) - (jnp.cumsum(per_expert) - per_expert)[flat[order]]
  rank = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted, unique_indices=True)  # [R]: among e's copies
  replica = (rank + source) % replicas[flat]
  return slot_table[flat, replica].reshape(T, A).astype(jnp.int32)


def moe_layer_indices(params: Mapping[str, Any]) -> list[int]:
  """The decoder layers (indices into params['layers']) that have routed experts."""
  return [i for i, layer in enumerate(params["layers"]) if isinstance(layer, Mapping) and "moe" in layer]


def relayout(params: Mapping[str, Any], placement: Placement, source_slots: np.ndarray | None = None
             ) -> dict[str, Any]:
  """params with each MoE layer's expert weights laid out by `placement`'s slots ([S, ...]) and
  its slot tables added (replicated like the router).

  `source_slots` None: the weights are logical ([E, ...]), slot s takes expert slots[s]'s.
  Else ([L, E] int): they are by slot already, and expert e is read from its slot
  source_slots[layer, e] (online re-planning: a gather from the current layout). The new
  arrays keep their old ones' sharding (the 'experts' rule splits S like it split E)."""
  layers = moe_layer_indices(params)
  placement = placement.for_layers(len(layers))
  table, reps = placement.tables()
  slots = np.asarray(placement.slots, np.int32)  # [L, S]
  if source_slots is not None:
    slots = np.take_along_axis(np.asarray(source_slots, np.int32), slots, axis=1)
  experts = [{k: v for k, v in params["layers"][i]["moe"].items() if k in EXPERT_KEYS} for i in layers]
  want = placement.num_experts if source_slots is None else None
  for i, ex in zip(layers, experts):
    for k, leaf in _leaves(ex):
      if want is not None and leaf.shape[0] != want:
        raise InvalidRequestError(f"layer {i} moe.{k}: {leaf.shape[0]} experts, the placement {want}")
  gathered = _gather(experts, jnp.asarray(slots))
  out = dict(params)
  out["layers"] = list(params["layers"])
  for j, i in enumerate(layers):
    moe = dict(params["layers"][i]["moe"])
    moe.update(gathered[j])
    router = moe["router"]
    put = (lambda a: jax.device_put(a, jax.sharding.NamedSharding(router.sharding.mesh, jax.sharding.PartitionSpec()))
           ) if isinstance(getattr(router, "sharding", None), jax.sharding.NamedSharding) else jnp.asarray
    moe[SLOTS_KEY], moe[REPLICAS_KEY] = put(table[j]), put(reps[j])
    out["layers"][i] = dict(params["layers"][i], moe=moe)
  if isinstance(params["layers"], tuple):
    out["layers"] = tuple(out["layers"])
  return out


def split_tables(params: Any) -> tuple[Any, dict[int, tuple[Any, Any]]]:
  """(params without the placement's slot tables, {MoE layer index: (slots, replicas)}): the
  tree the spec-driven transforms (sharding.runtime_params) know, and what `join_tables` puts
  back after them."""
  layers = params.get("layers") if isinstance(params, Mapping) else None
  if not isinstance(layers, (list, tuple)):
    return params, {}
  tables, out_layers = {}, list(layers)
  for i, layer in enumerate(layers):
    moe = layer.get("moe") if isinstance(layer, Mapping) else None
    if isinstance(moe, Mapping) and SLOTS_KEY in moe:
      tables[i] = (moe[SLOTS_KEY], moe[REPLICAS_KEY])
      rest = {k: v for k, v in moe.items() if k not in (SLOTS_KEY, REPLICAS_KEY)}
      out_layers[i] = dict(layer, moe=rest)
  if not tables:
    return params, {}
  return dict(params, layers=type(layers)(out_layers)), tables


def join_tables(params: Any, tables: Mapping[int, tuple[Any, Any]]) -> Any:
  """`split_tables`' inverse."""
  if not tables:
    return params
  layers = list(params["layers"])
  for i, (slots, replicas) in tables.items():
    layers[i] = dict(layers[i], moe=dict(layers[i]["moe"], **{SLOTS_KEY: slots, REPLICAS_KEY: replicas}))
  return dict(params, layers=type(params["layers"])(layers))


def _leaves(tree: Mapping[str, Any]):
  for k, v in tree.items():
    for leaf in jax.tree.leaves(v):
      yield k, leaf


def _gather(experts: list[dict[str, Any]], slots) -> list[dict[str, Any]]:
  """experts[j][k][slots[j]] for every layer j and weight k (every leaf along its leading axis),
  in one program whose outputs keep the inputs' shardings (compiled once per layout: online
  re-planning reuses it)."""
  shardings = jax.tree.map(lambda a: getattr(a, "sharding", None), experts)
  leaves, treedef = jax.tree.flatten(shardings)
  named = all(isinstance(s, jax.sharding.NamedSharding) for s in leaves)
  key = (treedef, tuple(leaves) if named else None)
  fn = _GATHER_JIT.get(key)
  if fn is None:
    take = lambda ex, idx: [jax.tree.map(lambda a: a[idx[j]], e) for j, e in enumerate(ex)]
    fn = _GATHER_JIT[key] = jax.jit(take, out_shardings=shardings if named else None)
  return fn(experts, slots)


_GATHER_JIT: dict = {}


# ---- online ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EplbConfig:
  """Expert-parallel load balancing for the engine (EngineConfig.eplb).

  `placement`: a Placement or the path of one (`jaxinfer eplb plan`); None: start from a plan of
  even load with `num_redundant_experts` extra slots. `replan_interval`: re-plan every that many
  engine steps from the counts of the last `window` steps (0: never, the placement stays).
  `num_hosts`: hosts the EP devices span, for the groups-to-hosts step of the planner."""

  placement: Placement | None = None
  num_redundant_experts: int = 0
  replan_interval: int = 0
  window: int = 256
  num_hosts: int = 1

  def __post_init__(self):
    if isinstance(self.placement, (str, Path)):
      object.__setattr__(self, "placement", Placement.load(self.placement))
    elif self.placement is not None and not isinstance(self.placement, Placement):
      raise InvalidRequestError(f"eplb placement must be a Placement or a path, got {type(self.placement).__name__}")
    for name, low in (("num_redundant_experts", 0), ("replan_interval", 0), ("window", 1), ("num_hosts", 1)):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise InvalidRequestError(f"eplb {name} must be an int >= {low}, got {v!r}")
    if self.placement is not None and self.num_redundant_experts not in (0, self.placement.num_redundant):
      raise InvalidRequestError(f"eplb num_redundant_experts={self.num_redundant_experts} but the placement has "
                                f"{self.placement.num_redundant}")

  @classmethod
  def parse(cls, value: Any) -> "EplbConfig | None":
    """None, an EplbConfig, a Placement or a placement's path, or a dict of the fields."""
    if value is None or isinstance(value, EplbConfig):
      return value
    if isinstance(value, (str, Path, Placement)):
      return cls(placement=value)
    if isinstance(value, Mapping):
      return from_options(cls, value, "eplb")
    raise InvalidRequestError(f"eplb must be a placement path, a Placement, a dict or an EplbConfig, got {value!r}")

  def initial(self, num_experts: int, num_devices: int, num_layers: int, num_groups: int = 1) -> Placement:
    """The placement to start from, checked against the model and mesh."""
    if self.placement is not None:
      return self.placement.check(num_experts, num_devices, num_layers)
    even = np.ones((num_layers, num_experts))
    groups = num_groups if self.num_hosts > 1 else 1
    return plan(even, num_devices, self.num_redundant_experts, num_hosts=self.num_hosts, num_groups=groups)


class OnlineBalancer:
  """Re-plans from a sliding window of measured counts and rebuilds the slot weights.

  The engine calls `observe` with each step's counts [L, E] and, between steps, `maybe_replan`
  with its current params; that returns new params (every array built before the engine
  swaps them in) or None when nothing is due or the placement would not change."""

  def __init__(self, config: EplbConfig, placement: Placement, num_groups: int = 1):
    self.config = config
    self.placement = placement
    self.num_groups = num_groups if config.num_hosts > 1 else 1
    self.window: collections.deque[np.ndarray] = collections.deque(maxlen=config.window)
    self.steps = 0
    self.replans = 0  # plans that changed the placement (weights moved)
    self.replan_seconds = 0.0  # host time in maybe_replan when it planned (planning + dispatch of the gather)

  def observe(self, counts: np.ndarray) -> None:
    self.window.append(np.asarray(counts, np.int64))
    self.steps += 1

  def due(self) -> bool:
    k = self.config.replan_interval
    return bool(k) and self.steps > 0 and self.steps % k == 0 and len(self.window) > 0

  def maybe_replan(self, params: Mapping[str, Any]) -> dict[str, Any] | None:
    if not self.due():
      return None
    import time
    t0 = time.perf_counter()
    counts = np.sum(self.window, axis=0)
    new = plan(counts, self.placement.num_devices, self.placement.num_redundant,
               num_hosts=self.config.num_hosts, num_groups=self.num_groups)
    self.steps = 0
    if new == self.placement:
      self.replan_seconds += time.perf_counter() - t0
      return None
    table, _ = self.placement.tables()
    out = relayout(params, new, source_slots=table[:, :, 0])
    self.placement = new
    self.replans += 1
    self.replan_seconds += time.perf_counter() - t0
    return out


def setup(config: "EplbConfig | None", cfg: Any, params: Mapping[str, Any], mesh: Any, rules: Mapping[str, Any]
          ) -> tuple[Mapping[str, Any], "OnlineBalancer | None"]:
  """The engine's params with `config`'s placement applied, and the balancer that re-plans it
  (None without EPLB). InvalidRequestError when the placement does not fit the model or mesh."""
  if config is None:
    return params, None
  from jaxinfer.models.expert_parallel import ExpertParallelism
  layers = moe_layer_indices(params)
  if not cfg.num_experts or not layers:
    raise InvalidRequestError("eplb needs a mixture-of-experts model")
  ep = ExpertParallelism.from_rules(mesh, rules)
  n = ep.num_devices if ep is not None else 1
  if config.replan_interval and jax.process_count() > 1:
    raise InvalidRequestError("eplb online re-planning (replan_interval > 0) runs on one host only; "
                              "give a placement file and replan_interval=0 for a multi-host job")
  placement = config.initial(cfg.num_experts, n, len(layers), cfg.n_group)
  return relayout(params, placement), OnlineBalancer(config, placement, cfg.n_group)
