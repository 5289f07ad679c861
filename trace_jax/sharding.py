"""Logical axis rules, meshes, shardings, resharding between meshes, and multi-host helpers.

The lowest layer of the distributed code: it imports nothing from the model or the engine.
Parameter containers (model.Params, rollout.EngineParams, rollout.KVCache, ...) declare the
*logical* axes of each array next to its field with `param_field('embed', 'heads', ...)`;
`logical_axes(tree)` reads those declarations, and `LOGICAL_AXIS_RULES` (the one table, as in
MaxText's `logical_axis_rules`) maps logical names to the mesh axes `MESH_AXES`. A mesh axis
that is absent, of size 1, already used by another dimension of the same array, or that does
not divide the dimension is skipped, so the same rules serve a 1-device mesh, a tiny test model
and a 256-chip pod. Packed FP4 arrays (fp4.QuantizedArray) take their field's axes with the
packed last axis ('packed') never split.

Which role runs on which mesh, and what crosses between them, is cluster.py's business.
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

from pallas_kernels import fp4_mosaic
from trace_jax import fp4

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
  ("conv", ()),  # the taps of Gated DeltaNet's causal conv
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


def param_field(*axes: str | None, **kwargs):
  """A dataclass field holding an array whose dimensions are named `axes` (logical names).

  Keyword arguments go to dataclasses.field (default=None for optional weights).
  """
  return dataclasses.field(metadata={"logical_axes": axes}, **kwargs)


def _is_axes(x) -> bool:
  return isinstance(x, P)


def logical_axes(tree, axes: tuple | None = None):
  """A tree mirroring `tree` (dataclasses declared with `param_field`) with P(logical axes) leaves.

  Packed FP4 arrays get their field's axes on codes and scales, the last one 'packed'; a tensor
  scale per row (two-level NVFP4 of a KV cache) the axes of the rows. The Mosaic kernel's fragments
  (words [E, N/64, K/128, 9, 128]) get the experts' and the rows' axes, the rest 'packed'.
  """
  if tree is None:
    return None
  if isinstance(tree, fp4_mosaic.FragmentWeight):
    lead, packed = axes[: tree.words.ndim - 4], ("packed",) * 3
    ts = tree.tensor_scale
    return fp4_mosaic.FragmentWeight(P(*lead, axes[-2], *packed), None if ts is None else P(*lead[: ts.ndim]))
  if isinstance(tree, fp4.QuantizedArray):
    packed = P(*axes[:-1], "packed")
    ts = tree.tensor_scale
    return dataclasses.replace(
      tree, codes=packed, scales=packed, tensor_scale=None if ts is None else P(*axes[:-1][: len(ts.shape)])
    )
  if dataclasses.is_dataclass(tree):
    fields = {}
    for f in dataclasses.fields(tree):
      if f.metadata.get("static"):
        continue
      fields[f.name] = logical_axes(getattr(tree, f.name), f.metadata.get("logical_axes"))
    return dataclasses.replace(tree, **fields)
  if isinstance(tree, tuple | list):
    return type(tree)(logical_axes(x, axes) for x in tree)
  if axes is None:
    raise ValueError(
      f"An array of shape {getattr(tree, 'shape', '?')} has no logical axes; declare them with param_field."
    )
  return P(*axes)


def shardings_from_axes(axes_tree, values_tree, mesh) -> object:
  """NamedShardings for `values_tree` (arrays or ShapeDtypeStructs) from a mirroring tree of P(logical...)."""
  return jax.tree_util.tree_map(
    lambda axes, v: NamedSharding(mesh, logical_to_spec(tuple(axes), v.shape, mesh)),
    axes_tree,
    values_tree,
    is_leaf=_is_axes,
  )


def logical_shardings(tree, mesh) -> object:
  """NamedShardings on `mesh` for a tree of declared parameter containers (params, engine params, caches)."""
  return shardings_from_axes(logical_axes(tree), tree, mesh)


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
