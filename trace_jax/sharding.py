"""Logical axis rules, meshes, shardings, resharding between meshes, and multi-host helpers.

Model code names array dimensions with *logical* axes ('batch', 'embed', 'experts', ...);
`LOGICAL_AXIS_RULES` (the one table, as in MaxText's `logical_axis_rules`) maps them to the
mesh axes `MESH_AXES`. A mesh axis that is absent, of size 1, already used by another
dimension of the same array, or that does not divide the dimension is skipped, so the same
rules serve a 1-device mesh, a tiny test model and a 256-chip pod.

Meshes: the trainer and the rollout engine each get their own (`make_meshes`), over the same
devices with different shapes, or over disjoint devices as a disaggregated deployment runs
them. Trainer params go to the engine's mesh through `weight_sync` on the trainer mesh
followed by `reshard` (only packed FP4 experts and bf16 tensors cross); the compact guidance
comes back the same way. `reshard` reports the bytes that crossed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
import optax
from absl import logging
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trace_jax import fp4
from trace_jax.expert_parallel import ExpertParallel
from trace_jax.model import AttentionParams, LayerParams, Params
from trace_jax.moe import MLPParams, MoEParams

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# logical axis -> mesh axes, in the order they are tried. The one place that says what shards how.
LOGICAL_AXIS_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
  # activations
  ("batch", ("data", "fsdp", "expert")),  # the expert axis is data parallel outside the MoE block
  ("sequence", ()),
  ("cache_sequence", ()),
  # parameters
  ("vocab", ("tensor",)),
  ("embed", ("fsdp",)),  # ZeRO-3 / FSDP: weights split along hidden, all-gathered per layer
  ("heads", ("tensor",)),
  ("kv_heads", ("tensor",)),
  ("head_dim", ()),
  ("mlp", ("tensor",)),
  ("experts", ("expert",)),
  ("norm", ()),
  ("packed", ()),  # the packed FP4 codes / block-scale axis: never split
)
_RULES = dict(LOGICAL_AXIS_RULES)


# --- meshes -----------------------------------------------------------------------------------


def mesh_shape(shape: Mapping[str, int], num_devices: int) -> dict[str, int]:
  """Complete a {axis: size} dict over MESH_AXES: missing axes are 1, one -1 takes the rest."""
  unknown = sorted(set(shape) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"Unknown mesh axes {unknown}; expected a subset of {MESH_AXES}.")
  sizes = {a: int(shape.get(a, 1)) for a in MESH_AXES}
  fill = [a for a, n in sizes.items() if n == -1]
  known = math.prod(n for n in sizes.values() if n != -1)
  if len(fill) > 1 or any(n == 0 or n < -1 for n in sizes.values()):
    raise ValueError(f"Mesh shape {dict(shape)}: sizes must be positive, with at most one -1.")
  if fill:
    if num_devices % known:
      raise ValueError(f"Mesh shape {dict(shape)} does not divide {num_devices} devices.")
    sizes[fill[0]] = num_devices // known
  if math.prod(sizes.values()) != num_devices:
    raise ValueError(f"Mesh shape {sizes} needs {math.prod(sizes.values())} devices, got {num_devices}.")
  return sizes


def make_mesh(shape: Mapping[str, int] | None = None, devices: Sequence | None = None) -> Mesh:
  """A mesh over MESH_AXES (Auto axis types, so jit/GSPMD propagates shardings); default: all data."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = mesh_shape(shape or {"data": -1}, len(devices))
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types, devices=devices)


def make_meshes(trainer: Mapping[str, int], rollout: Mapping[str, int], rollout_devices: int = 0):
  """(trainer mesh, rollout mesh). rollout_devices=0: both span every device (colocated);
  n > 0: the engine gets the first n devices and the trainer the rest (disaggregated; within
  one process, or across hosts on runtimes with cross-host transfers between device sets).
  """
  devices = jax.devices()
  if not rollout_devices:
    return make_mesh(trainer, devices), make_mesh(rollout, devices)
  if not 0 < rollout_devices < len(devices):
    raise ValueError(f"rollout_devices={rollout_devices} must leave devices to both roles ({len(devices)} devices).")
  return make_mesh(trainer, devices[rollout_devices:]), make_mesh(rollout, devices[:rollout_devices])


@dataclasses.dataclass(frozen=True)
class Topology:
  """The run's devices: the trainer's mesh, the engine's mesh, and the trainer's MoE dispatch."""

  trainer: Mesh
  rollout: Mesh
  expert_parallel: ExpertParallel | None = None  # trainer MoE; None: the 'sorted' MoE under GSPMD
  rollout_expert_parallel: ExpertParallel | None = None  # the engine's routed experts

  @classmethod
  def from_config(cls, cfg) -> Topology:
    """From `config.mesh` (see configs/default.py); a config without it runs data parallel."""
    m = cfg.get("mesh") or {}
    plain = lambda d: dict(d.to_dict() if hasattr(d, "to_dict") else d)
    trainer, rollout = make_meshes(
      plain(m.get("trainer", {"data": -1})), plain(m.get("rollout", {"data": -1})), m.get("rollout_devices", 0)
    )
    moe_impl = m.get("moe_impl", "sorted")
    if moe_impl not in ("sorted", "ep"):
      raise ValueError(f"config.mesh.moe_impl: unknown {moe_impl!r}; expected 'sorted' or 'ep'.")
    if moe_impl == "sorted":
      return cls(trainer, rollout)
    ep = lambda mesh: ExpertParallel(mesh, capacity_factor=m.get("capacity_factor", 2.0), a2a=m.get("a2a", "auto"))
    return cls(trainer, rollout, ep(trainer), ep(rollout))

  @classmethod
  def single_device(cls) -> Topology:
    mesh = make_mesh({}, jax.local_devices()[:1])
    return cls(mesh, mesh)


# --- logical axes -> shardings ----------------------------------------------------------------


def logical_to_spec(logical: Sequence[str | None], shape: Sequence[int], mesh) -> P:
  """The mesh PartitionSpec for an array of `shape` whose dimensions are named `logical`."""
  if len(logical) != len(shape):
    raise ValueError(f"Logical axes {tuple(logical)} do not match the array's rank {len(shape)}.")
  sizes, used, spec = dict(mesh.shape), set(), []
  for name, dim in zip(logical, shape):
    if name is not None and name not in _RULES:
      raise ValueError(f"No rule for logical axis {name!r}; add it to LOGICAL_AXIS_RULES.")
    chosen, split = [], 1
    for axis in _RULES.get(name, ()) if name else ():
      n = sizes.get(axis, 1)
      if n > 1 and axis not in used and dim % (split * n) == 0:
        chosen.append(axis)
        split *= n
    used.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
  return P(*spec)


def _is_axes(x) -> bool:
  return isinstance(x, P)


def shardings_from_axes(axes_tree, values_tree, mesh) -> object:
  """NamedShardings for `values_tree` (arrays or ShapeDtypeStructs) from a mirroring tree of P(logical...)."""
  return jax.tree_util.tree_map(
    lambda axes, v: NamedSharding(mesh, logical_to_spec(tuple(axes), v.shape, mesh)),
    axes_tree,
    values_tree,
    is_leaf=_is_axes,
  )


def _mlp_axes() -> MLPParams:
  return MLPParams(gate=P("embed", "mlp"), up=P("embed", "mlp"), down=P("mlp", "embed"))


def _attention_axes(a: AttentionParams) -> AttentionParams:
  norm = lambda x: None if x is None else P("head_dim")
  return AttentionParams(
    q=P("embed", "heads", "head_dim"),
    k=P("embed", "kv_heads", "head_dim"),
    v=P("embed", "kv_heads", "head_dim"),
    o=P("heads", "head_dim", "embed"),
    q_norm=norm(a.q_norm),
    k_norm=norm(a.k_norm),
  )


def params_logical_axes(params: Params) -> Params:
  """A Params-shaped tree of P(logical axes): the trainer's parameter layout."""

  def mlp(m):
    if isinstance(m, MLPParams):
      return _mlp_axes()
    return MoEParams(
      router=P("embed", None),
      gate=P("experts", "embed", "mlp"),
      up=P("experts", "embed", "mlp"),
      down=P("experts", "mlp", "embed"),
      shared=None if m.shared is None else _mlp_axes(),
      shared_gate=None if m.shared_gate is None else P("embed", None),
    )

  layers = tuple(
    LayerParams(P("norm"), _attention_axes(layer.attn), P("norm"), mlp(layer.mlp)) for layer in params.layers
  )
  lm_head = None if params.lm_head is None else P("embed", "vocab")
  return Params(embed=P("vocab", "embed"), layers=layers, final_norm=P("norm"), lm_head=lm_head)


def _packed_axes(w, rows: str, cols: str):
  """Engine expert weight [E, N, K]: packed FP4 (codes/scales [E, N, K/2 | K/block]) or plain."""
  if isinstance(w, fp4.QuantizedArray):
    return dataclasses.replace(
      w,
      codes=P("experts", rows, "packed"),
      scales=P("experts", rows, "packed"),
      tensor_scale=None if w.tensor_scale is None else P(),
    )
  return P("experts", rows, cols)


def engine_logical_axes(params):
  """An EngineParams-shaped tree of P(logical axes): the rollout engine's layout."""
  from trace_jax.rollout import EngineLayer, EngineMoE, EngineParams  # rollout imports nothing from here

  def mlp(m):
    if isinstance(m, MLPParams):
      return _mlp_axes()
    return EngineMoE(
      router=P("embed", None),
      gate=_packed_axes(m.gate, "mlp", "embed"),
      up=_packed_axes(m.up, "mlp", "embed"),
      down=_packed_axes(m.down, "embed", "mlp"),
      shared=None if m.shared is None else _mlp_axes(),
      shared_gate=None if m.shared_gate is None else P("embed", None),
    )

  layers = tuple(
    EngineLayer(P("norm"), _attention_axes(layer.attn), P("norm"), mlp(layer.mlp)) for layer in params.layers
  )
  return EngineParams(embed=P("vocab", "embed"), layers=layers, final_norm=P("norm"), lm_head=P("embed", "vocab"))


def params_shardings(params: Params, mesh) -> Params:
  return shardings_from_axes(params_logical_axes(params), params, mesh)


def engine_shardings(engine_params, mesh):
  return shardings_from_axes(engine_logical_axes(engine_params), engine_params, mesh)


def opt_state_shardings(optimizer: optax.GradientTransformation, opt_state, param_shardings, mesh):
  """Optimizer moments shard like their parameters; counts and other scalars are replicated."""
  replicated = NamedSharding(mesh, P())
  return optax.tree_map_params(
    optimizer,
    lambda _, s: s,
    opt_state,
    param_shardings,
    transform_non_params=lambda _: replicated,
    is_leaf=lambda x: isinstance(x, NamedSharding),
  )


def batch_shardings(tree, mesh, *, leading: str = "batch") -> object:
  """Every array laid out [B, ...] (batches, rollout results, guidance) is split along B.

  Scalars are replicated. Works on arrays and ShapeDtypeStructs.
  """

  def one(x):
    ndim = len(x.shape)
    return NamedSharding(mesh, logical_to_spec((leading,) + (None,) * (ndim - 1), x.shape, mesh) if ndim else P())

  return jax.tree_util.tree_map(one, tree)


def cache_shardings(caches, mesh):
  """KV caches [B, T, KV, D] (or packed FP4 [B, T, KV, D/2 | D/block]): batch and kv heads."""
  axes = ("batch", "cache_sequence", "kv_heads", "packed")
  return jax.tree_util.tree_map(
    lambda x: NamedSharding(mesh, logical_to_spec(axes[: x.ndim], x.shape, mesh) if x.ndim else P()), caches
  )


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


# --- jit with shardings derived from the arguments ------------------------------------------


class ShardedJit:
  """`jax.jit` whose in/out shardings are derived from the arguments' structure and shapes.

  in_shardings(*args) and out_shardings(*args, out_shape) give the shardings of the positional
  arguments and of the result (`out_shape` from jax.eval_shape). Keyword arguments are static
  (bound before jit, which takes no keyword arguments with in_shardings). One compiled function
  per argument structure and static values, like jax.jit. `lower(*abstract_args, **static)` is
  the AOT entry point (ShapeDtypeStructs with shardings, no allocation).
  """

  def __init__(self, fn: Callable, in_shardings: Callable, out_shardings: Callable, *, donate_argnums=()):
    self._fn, self._in, self._out, self._donate = fn, in_shardings, out_shardings, donate_argnums
    self._cache: dict = {}

  def jitted(self, *args, **static):
    avals = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    key = (jax.tree_util.tree_structure(args), tuple(jax.tree_util.tree_leaves(avals)), tuple(sorted(static.items())))
    if key not in self._cache:
      fn = functools.partial(self._fn, **static)
      self._cache[key] = jax.jit(
        fn,
        in_shardings=self._in(*args),
        out_shardings=self._out(*args, out_shape=jax.eval_shape(fn, *avals)),
        donate_argnums=self._donate,
      )
    return self._cache[key]

  def __call__(self, *args, **static):
    return self.jitted(*args, **static)(*args)

  def lower(self, *args, **static):
    return self.jitted(*args, **static).lower(*args)


# --- moving data between meshes and hosts ---------------------------------------------------


def tree_nbytes(tree) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)))


def crossing_bytes(tree, shardings) -> int:
  """Bytes of the leaves of `tree` whose layout differs from `shardings` (what a reshard moves)."""
  moved = 0
  for x, s in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(shardings)):
    if not (isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim)):
      moved += x.size * x.dtype.itemsize
  return moved


def reshard(tree, shardings) -> tuple[object, int]:
  """jax.device_put onto target shardings (another mesh too); returns (tree, bytes that crossed)."""
  return jax.device_put(tree, shardings), crossing_bytes(tree, shardings)


def initialize_distributed(coordinator_address: str = "", num_processes: int = 0, process_id: int = -1) -> None:
  """jax.distributed.initialize from the arguments, else JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
  JAX_PROCESS_ID; a no-op for one process. Call before anything touches a device.
  """
  address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
  num = num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "1"))
  pid = process_id if process_id >= 0 else int(os.environ.get("JAX_PROCESS_ID", "0"))
  if num <= 1 or jax.distributed.is_initialized():
    return
  if not address:
    raise ValueError("num_processes > 1 needs a coordinator address (config.distributed or JAX_COORDINATOR_ADDRESS).")
  logging.info("jax.distributed.initialize(%s, num_processes=%d, process_id=%d)", address, num, pid)
  jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid)


def process_rows(sharding: NamedSharding, global_shape: Sequence[int]) -> slice:
  """The contiguous rows (leading axis) of a global array that this process's devices hold."""
  index = sharding.addressable_devices_indices_map(tuple(global_shape))
  starts = [idx[0].start or 0 for idx in index.values()]
  stops = [global_shape[0] if idx[0].stop is None else idx[0].stop for idx in index.values()]
  return slice(min(starts), max(stops))


def host_to_global(tree, shardings) -> object:
  """Global arrays from host numpy batches that every process can compute (a deterministic loader).

  Each process hands over only its own rows (`jax.make_array_from_process_local_data`); in a
  real pod each host would load just those rows.
  """

  def one(x, s):
    x = np.asarray(x)
    local = x[process_rows(s, x.shape)] if x.ndim else x
    return jax.make_array_from_process_local_data(s, local, x.shape)

  return jax.tree_util.tree_map(one, tree, shardings)


def to_host(tree) -> object:
  """numpy copies of (possibly multi-host) global arrays, gathered on every process."""
  from jax.experimental import multihost_utils

  def one(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
      return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  return jax.tree_util.tree_map(one, tree)
