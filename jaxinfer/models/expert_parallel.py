"""Expert parallelism: the MoE FFN under `jax.shard_map`, token copies dispatched to the devices
that hold their experts with an all-to-all, and brought back with the reverse one.

Legend: T tokens, D hidden, F expert width, E experts, A active experts per token,
n = n_ep devices the experts are split over (the product of the mesh axes that the 'experts'
rule names), El = E / n experts per device, Tl = ceil(T / n) tokens per device,
R = Tl * A token copies per device, C rows per (source, destination) pair.

One EP MoE FFN (`ep_moe_ffn`), per device:
  1. the T tokens are split over the n EP devices (padded to n * Tl); each device routes its
     Tl tokens with the replicated router (`moe.route`), R copies;
  2. dispatch: the copies, sorted by expert, go into a send buffer [n, C, D] (destination =
     expert // El, the device holding that expert), with each copy's local expert id
     [n, C]; `jax.lax.all_to_all` over the EP axes swaps the buffers, each device then holds
     [n sources, C, D] rows for its own El experts;
  3. grouped SwiGLU: the received rows sorted by local expert, `ragged_dot` with the local
     El experts (padding rows belong to no group: ragged_dot leaves them 0);
  4. combine: the reverse all-to-all returns each copy's result to its token's device, which
     picks it from (destination, slot) and sums the copies with their router weights;
  5. the outputs [n * Tl, D] leave the shard_map split over its EP axes; the caller sees
     [T, D] (jit all-gathers if it needs them replicated).

Why this and not plain jit over expert-sharded weights: on one MoE FFN (E=8, A=2, 8 fake
devices on a CPU) this all-to-all EP was faster than GSPMD's partitioning of the same
program at every token count tried (8 to 256), and both beat one device.

Dispatch, chosen by what the backend compiles (`choose_dispatch`, asked once per device set):
  'ragged': `jax.lax.ragged_all_to_all` sends only the routed rows (each device's R copies,
    sizes and offsets exchanged first with two small all_to_alls of n ints); the receive
    buffer is still the worst case (n * C rows: its shape is static) but only the rows that
    arrived are real. XLA:GPU compiles it. Written and lowered here, and its offsets checked on
    CPU through an all-gather stand-in of the collective (tests/models/test_eplb.py); not yet
    run on a GPU by this project.
  'fixed': `jax.lax.all_to_all` of [n, C, D] buffers, padding included. jax 0.10's XLA:CPU has
    no thunk for `ragged-all-to-all` ("HLO opcode `ragged-all-to-all` is not supported by
    XLA:CPU ThunkEmitter"), so the CPU engine and the tests run this one.

Capacity: C = Tl * min(A, El), the worst case: a token picks A distinct experts, at most
min(A, El) of them on one device, and all Tl tokens of a source may pick the same device
(skewed routing). So no copy is ever dropped, whatever the routing: the result equals the
non-EP `moe.moe_ffn` exactly (up to float summation order). The cost of the fixed dispatch is
memory and wire bytes: each device sends and receives n * C * D values (about T * min(A, El) * D,
n times the balanced average T * A * D / n at El >= A), and the expert matmul runs over n * C
rows of which only the routed ones are real. A capacity factor below the worst case (as in
training-time MoE) would drop tokens when routing is skewed; an inference engine must not
change a model's output, so we never do.

EPLB (models/eplb.py): with a placement the layer's weights are [S, ...] by slot, El becomes
S / n slots per device, and each copy goes to the slot `eplb.assign_slots` picks among its
expert's replicas (the router and the stats still speak of logical experts).

Tensor parallelism inside: the experts' F ('mlp') may be split over other mesh axes
(`mlp_axes`, 'model'); those axes are manual too, each device computes its F slice of
every local expert and the partial outputs are summed with a `psum` at the end (the
expert down-projection bias is added by one 'model' shard only).

Under attention data parallelism the runner already runs the model under shard_map over
'data' (manual), each data shard with its own tokens. With wide EP (experts over ('data',
'expert')) this function then opens a nested shard_map over the remaining axes only
('expert', 'model'); the all-to-all spans ('data', 'expert'), so every shard's tokens reach
the experts of every shard. This needs the already-manual axes to lead the rule (the
outer shard_map hands each data shard the contiguous block of experts that it and its
'expert' peers hold).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.errors import ShardingError
from jaxinfer.models import eplb, moe
from jaxinfer.models.layers import swiglu_mlp
from jaxinfer.quant import QuantizedWeight, is_quantized

# Per expert-weight key: the position of its 'mlp' (F) dimension after the experts axis (None: none).
_EXPERT_KEYS = {"w_gate": 2, "w_up": 2, "w_down": 1, "b_gate": 1, "b_up": 1, "b_down": None}


def capacity(tokens_per_device: int, num_active: int, experts_per_device: int) -> int:
  """Rows per (source, destination) pair that no routing can overflow (see the module doc);
  under an EPLB placement `experts_per_device` is the slots per device (a token's A copies
  go to A distinct experts, hence A distinct slots)."""
  return tokens_per_device * min(num_active, experts_per_device)


def _spec(ndim: int, lead: Any, mlp_dim: int | None, mlp: Any) -> P:
  out = [None] * ndim
  out[0] = lead
  if mlp_dim is not None:
    out[mlp_dim] = mlp
  return P(*out)


def _axes_spec(axes: tuple[str, ...]) -> Any:
  return None if not axes else axes[0] if len(axes) == 1 else axes


def ep_moe_ffn(p: dict[str, Any], cfg: ModelConfig, x: jax.Array, valid: jax.Array | None = None, *,
               mesh: Any, expert_axes: tuple[str, ...], mlp_axes: tuple[str, ...] = (),
               dispatch: str = "fixed", ragged_all_to_all: Callable | None = None
               ) -> tuple[jax.Array, moe.RouterStats]:
  """`moe.moe_ffn` with the experts split over the mesh axes `expert_axes` (the 'experts'
  rule) and their F over `mlp_axes` (the 'mlp' rule): x [T, D] -> ([T, D], RouterStats).

  Experts laid out by slot (an EPLB placement, models/eplb.py: the layer has its slot tables)
  are split by slot: S / n slots per device, each token copy sent to the slot `eplb.assign_slots`
  picks among its expert's replicas. `dispatch`: 'fixed' (the worst-case capacity all-to-all)
  or 'ragged' (`jax.lax.ragged_all_to_all`: only routed rows travel; the backend must run it,
  see `supports_ragged_all_to_all`). `ragged_all_to_all`: that collective (None: jax's; the
  tests pass an equivalent made of all-gathers to run the ragged path on XLA:CPU).

  `mesh` is the concrete Mesh (or, nested inside another shard_map, the context's abstract
  mesh is used for the axes that are already manual). Raises ShardingError if the experts (or
  slots) do not divide by the EP axes or the already-manual axes do not lead `expert_axes`.
  """
  if dispatch not in DISPATCHES:
    raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")
  ragged_all_to_all = ragged_all_to_all or jax.lax.ragged_all_to_all
  expert_axes, mlp_axes = tuple(expert_axes), tuple(mlp_axes)
  context = jax.sharding.get_abstract_mesh()
  manual = set(context.manual_axes) if not context.empty else set()
  outer = tuple(a for a in expert_axes if a in manual)  # manual already (attention DP's 'data')
  inner = tuple(a for a in expert_axes if a not in manual)
  if expert_axes[:len(outer)] != outer:
    raise ShardingError(f"expert parallelism inside shard_map over {sorted(manual)}: the experts rule "
                        f"{expert_axes} must list those axes first")
  if any(a in manual for a in mlp_axes):
    raise ShardingError(f"the 'mlp' axes {mlp_axes} of the experts are manual already ({sorted(manual)})")
  sizes = dict(mesh.shape)
  n = math.prod(sizes[a] for a in expert_axes)
  n_inner = math.prod(sizes[a] for a in inner)
  E, A = cfg.num_experts, cfg.num_experts_per_token
  placed = eplb.SLOTS_KEY in p
  # Slots (E without a placement); nested in attention DP's shard_map this shard holds its block.
  S = p["w_gate"].shape[0] * (n // n_inner)
  if S % n:
    what = f"{S} expert slots" if placed else f"{E} experts"
    raise ShardingError(f"{what} cannot be split over mesh axes {expert_axes} ({n} devices)")
  Sl = S // n  # slots (experts) per device
  T = x.shape[0]
  Tl = -(-T // n_inner)
  C = capacity(Tl, A, Sl)
  act = moe.expert_activation(cfg)
  has_bias = bool(cfg.expert_bias)

  experts = {k: p[k] for k in _EXPERT_KEYS if k in p}
  rest = {k: v for k, v in p.items() if k not in _EXPERT_KEYS and k != "shared"}
  lead, mlp = _axes_spec(inner), _axes_spec(mlp_axes)

  def expert_spec(k, v):
    if not is_quantized(v):
      return _spec(v.ndim, lead, _EXPERT_KEYS[k], mlp)
    # Values [E, out, in]: F is where the float weight does not have it. Scales [E, 1, out]:
    # split like the output axis when that is F (w_gate / w_up), else by expert only.
    out_mlp = 2 if _EXPERT_KEYS[k] == 2 else None
    return QuantizedWeight(_spec(3, lead, 3 - _EXPERT_KEYS[k], mlp), _spec(3, lead, out_mlp, mlp))

  expert_specs = {k: expert_spec(k, v) for k, v in experts.items()}

  def local(experts, rest, xl):
    # xl [Tl, D]: this device's tokens. experts: Sl slots (experts), their F slice.
    weights, ids = moe.route(rest, cfg, xl)  # [Tl, A] logical experts
    slots = ids
    if placed:
      slots = eplb.assign_slots(ids, rest[eplb.SLOTS_KEY], rest[eplb.REPLICAS_KEY],
                                jax.lax.axis_index(expert_axes))
    flat = slots.reshape(-1)  # [R], copy r = t * A + a
    order = jnp.argsort(flat, stable=True)  # copies by slot, hence by destination
    dest = flat[order] // Sl  # [R]
    per_dest = jnp.bincount(dest, length=n)  # [n]
    starts = jnp.cumsum(per_dest) - per_dest
    rows = jnp.take(xl, order // A, axis=0)  # [R, D], sorted by destination
    local_slot = (flat[order] % Sl).astype(jnp.int32)  # [R]

    if dispatch == "fixed":
      slot = jnp.arange(flat.shape[0]) - starts[dest]  # [R], < C always
      send = jnp.zeros((n, C, xl.shape[1]), xl.dtype).at[dest, slot].set(rows, unique_indices=True)
      send_slot = jnp.full((n, C), Sl, jnp.int32).at[dest, slot].set(local_slot)  # Sl: padding
      recv = jax.lax.all_to_all(send, expert_axes, 0, 0, tiled=True).reshape(n * C, -1)  # [n sources * C, D]
      recv_slot = jax.lax.all_to_all(send_slot, expert_axes, 0, 0, tiled=True).reshape(-1)  # [n * C]
    else:
      # Sizes and offsets first (n ints each way): what each source sends here, and where in
      # each destination's buffer this device's rows go (after the rows of lower sources).
      send_sizes, in_offsets = per_dest.astype(jnp.int32), starts.astype(jnp.int32)
      recv_sizes = jax.lax.all_to_all(send_sizes, expert_axes, 0, 0, tiled=True)  # [n sources]
      recv_offsets = (jnp.cumsum(recv_sizes) - recv_sizes).astype(jnp.int32)
      out_offsets = jax.lax.all_to_all(recv_offsets, expert_axes, 0, 0, tiled=True)  # [n destinations]
      # The buffer holds the worst case (n * C rows, as the fixed dispatch); only routed rows travel.
      recv = ragged_all_to_all(rows, jnp.zeros((n * C, xl.shape[1]), xl.dtype), in_offsets, send_sizes,
                               out_offsets, recv_sizes, axis_name=expert_axes)
      recv_slot = ragged_all_to_all(local_slot, jnp.full((n * C,), Sl, jnp.int32), in_offsets, send_sizes,
                                    out_offsets, recv_sizes, axis_name=expert_axes)

    by_slot = jnp.argsort(recv_slot, stable=True)  # padding (Sl) last, outside every group
    group_sizes = jnp.bincount(recv_slot, length=Sl).astype(jnp.int32)  # [Sl]
    xs = recv[by_slot]
    le = jnp.minimum(recv_slot[by_slot], Sl - 1)  # padding rows: any bias or scale, their rows are dropped
    gate = moe.expert_dot(xs, experts["w_gate"], group_sizes, le)  # [n * C, F / tp]
    up = moe.expert_dot(xs, experts["w_up"], group_sizes, le)
    if has_bias:
      gate, up = gate + experts["b_gate"][le], up + experts["b_up"][le]
    ys = moe.expert_dot(act(gate, up).astype(xl.dtype), experts["w_down"], group_sizes, le)  # [n * C, D]
    if has_bias:  # one F shard adds the bias: the psum below sums the partial products
      first = jnp.asarray(True) if not mlp_axes else jax.lax.axis_index(mlp_axes) == 0
      ys = ys + jnp.where(first, experts["b_down"][le], 0).astype(ys.dtype)
    ys = jnp.zeros_like(ys).at[by_slot].set(ys, unique_indices=True)  # [n * C, D] in arrival order

    if dispatch == "fixed":
      back = jax.lax.all_to_all(ys.reshape(n, C, -1), expert_axes, 0, 0, tiled=True)  # [n destinations, C, D]
      sent = back[dest, jnp.arange(flat.shape[0]) - starts[dest]]  # [R, D] in send order
    else:  # each destination returns its rows from here to where they were in this device's send order
      sent = ragged_all_to_all(ys, jnp.zeros((flat.shape[0], ys.shape[-1]), ys.dtype), recv_offsets, recv_sizes,
                               jax.lax.all_to_all(in_offsets, expert_axes, 0, 0, tiled=True), send_sizes,
                               axis_name=expert_axes)
    y = jnp.zeros_like(sent).at[order].set(sent, unique_indices=True).reshape(Tl, A, -1)  # [Tl, A, D]
    out = jnp.einsum("TAD,TA->TD", y.astype(jnp.float32), weights.astype(jnp.float32))
    if mlp_axes:
      out = jax.lax.psum(out, mlp_axes)
    return out.astype(xl.dtype), ids

  xp = jnp.pad(x, ((0, Tl * n_inner - T), (0, 0)))
  tokens = P(lead)
  # check_vma=False: the outputs are invariant over mlp_axes after the psum, and under attention
  # DP the outer shard_map runs unchecked too.
  out, ids = jax.shard_map(
      local, mesh=mesh if not manual else None, axis_names=set(inner) | set(mlp_axes),
      in_specs=(expert_specs, P(), tokens), out_specs=(tokens, tokens), check_vma=False,
  )(experts, rest, xp)
  out, ids = out[:T], ids[:T]

  if "shared" in p:  # dense on every token, outside: its weights follow the ordinary rules
    s = p["shared"]
    shared = swiglu_mlp(x, s["w_gate"], s["w_up"], s["w_down"])
    if "gate" in s:
      shared = shared * jax.nn.sigmoid(moe.router_logits(x, s["gate"])).astype(x.dtype)
    out = out + shared
  count = None if valid is None else jnp.repeat(valid.astype(jnp.int32), A)
  stats = moe.RouterStats(jnp.bincount(ids.reshape(-1), weights=count, length=E).astype(jnp.int32))
  return out, stats


DISPATCHES = ("fixed", "ragged")


@functools.lru_cache(maxsize=None)
def _ragged_all_to_all_compiles(devices: tuple) -> bool:
  mesh = jax.sharding.Mesh(np.array(devices), ("i",))
  n = len(devices)

  def probe(x):
    ones = jnp.ones((n,), jnp.int32)
    offsets = jnp.arange(n, dtype=jnp.int32)
    return jax.lax.ragged_all_to_all(x, jnp.zeros_like(x), offsets, ones,
                                     jax.lax.axis_index("i") * ones, ones, axis_name="i")

  x = jax.ShapeDtypeStruct((n * n, 1), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, P("i")))
  try:
    jax.jit(jax.shard_map(probe, mesh=mesh, in_specs=P("i"), out_specs=P("i"))).lower(x).compile()
  except Exception:  # XLA:CPU: "HLO opcode `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter"
    return False
  return True


def supports_ragged_all_to_all(devices: Sequence[Any]) -> bool:
  """Whether the backend of `devices` compiles `jax.lax.ragged_all_to_all` over them (asked by
  compiling a tiny one, once per device set): jax 0.10's XLA:CPU does not, XLA:GPU does."""
  return _ragged_all_to_all_compiles(tuple(devices))


def choose_dispatch(devices: Sequence[Any]) -> str:
  """'ragged' where the backend runs `ragged_all_to_all` (only routed rows travel), else 'fixed'."""
  return "ragged" if supports_ragged_all_to_all(devices) else "fixed"


@dataclasses.dataclass(frozen=True)
class ExpertParallelism:
  """The experts split over `expert_axes` of `mesh` (more than one device), their F over
  `mlp_axes`; `dispatch` 'fixed' or 'ragged' (`ep_moe_ffn`)."""

  mesh: Any
  expert_axes: tuple[str, ...]
  mlp_axes: tuple[str, ...] = ()
  dispatch: str = "fixed"

  @classmethod
  def from_rules(cls, mesh: Any, rules: Mapping[str, Any]) -> "ExpertParallelism | None":
    """From the sharding rules (jaxinfer.sharding), or None when the experts are not split
    (no mesh, or the 'experts' axes have one device): then moe_ffn runs as one program. The
    dispatch is the backend's best (`choose_dispatch`)."""
    from jaxinfer.sharding import mesh_axes
    if mesh is None:
      return None
    expert_axes = mesh_axes("experts", rules.get("experts"))
    if math.prod(mesh.shape[a] for a in expert_axes) == 1:
      return None
    mlp_axes = tuple(a for a in mesh_axes("mlp", rules.get("mlp")) if mesh.shape[a] > 1)
    return cls(mesh, expert_axes, mlp_axes, choose_dispatch(tuple(mesh.devices.flat)))

  @property
  def num_devices(self) -> int:
    """The EP devices (the experts' split)."""
    return math.prod(self.mesh.shape[a] for a in self.expert_axes)

  def __call__(self, p: dict[str, Any], cfg: ModelConfig, x: jax.Array, valid: jax.Array | None = None
               ) -> tuple[jax.Array, moe.RouterStats]:
    return ep_moe_ffn(p, cfg, x, valid, mesh=self.mesh, expert_axes=self.expert_axes, mlp_axes=self.mlp_axes,
                      dispatch=self.dispatch)


_ACTIVE: contextvars.ContextVar[ExpertParallelism | None] = contextvars.ContextVar("expert_parallelism",
                                                                                   default=None)


def active() -> ExpertParallelism | None:
  """The expert parallelism of the program being traced (None: experts on one device group)."""
  return _ACTIVE.get()


@contextlib.contextmanager
def expert_parallelism(ep: ExpertParallelism | None) -> Iterator[None]:
  token = _ACTIVE.set(ep)
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def tracing_with(ep: ExpertParallelism | None, fn: Callable) -> Callable:
  """fn, with `ep` active while it runs (i.e. while jit traces it)."""
  if ep is None:
    return fn

  @functools.wraps(fn)
  def run(*args, **kwargs):
    with expert_parallelism(ep):
      return fn(*args, **kwargs)
  return run
