"""Expert parallelism: the MoE block's expert compute as a `jax.shard_map` over the 'expert' axis.

Inside the block the token rows are split over every mesh axis (tokens replicated across
'tensor' outside take disjoint slices here, so no device computes a row twice); experts are
split over `expert_axis`. Each (token, slot) assignment travels to the device holding its
expert, the expert FFN runs there as a grouped matmul, and the output travels back.

Three exchanges; `a2a='auto'` picks 'dense' on CPU and 'ragged' elsewhere:
  * 'dense': fixed [E, C] buffers per device and `lax.all_to_all`; C = the capacity per expert
    per source device = ceil(capacity_factor * local assignments / E). Assignments beyond C
    are dropped (their expert output is 0). Runs on every backend (CPU included).
  * 'ragged': `lax.ragged_all_to_all` of the rows sorted by expert (no padding to E * C), with
    a per-destination-device quota of ceil(capacity_factor * local assignments / n_expert)
    rows; GPU and TPU only (XLA:CPU has no ragged-all-to-all).
  * 'ragged_reference': the ragged bookkeeping over a dense emulation of ragged_all_to_all, so
    the ragged path is tested on CPU.
Dropped assignments are counted (summed over devices) and returned. With a capacity that
suffices, every path equals the single-device 'sorted' MoE.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

A2A_IMPLS = ("auto", "dense", "ragged", "ragged_reference")


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
  """How `moe_block(impl='ep')` spreads the experts over a mesh (hashable: a static jit argument)."""

  mesh: Mesh | AbstractMesh
  capacity_factor: float  # the run's is config.mesh.capacity_factor; the engine raises it so as never to drop
  expert_axis: str = "expert"
  a2a: str = "auto"

  def __post_init__(self):
    if self.a2a not in A2A_IMPLS:
      raise ValueError(f"ExpertParallel.a2a: unknown {self.a2a!r}; expected one of {A2A_IMPLS}.")
    if self.capacity_factor <= 0:
      raise ValueError(f"ExpertParallel.capacity_factor must be > 0, got {self.capacity_factor}.")

  @property
  def resolved_a2a(self) -> str:
    if self.a2a != "auto":
      return self.a2a
    platform = self.mesh.devices.flat[0].platform if isinstance(self.mesh, Mesh) else jax.default_backend()
    return "dense" if platform == "cpu" else "ragged"


# ExpertFn(weights_local, rows [R, H], payload {[R, ...]}, group_sizes, replicated) -> (out [R, H], {[R, ...]}).
# Rows come grouped by local expert: group_sizes [E_local] (ragged), or None for E_local equal groups
# (the dense exchange), which a batched matmul computes without ragged_dot's per-group masking.
ExpertFn = Callable


def experts(
  ep: ExpertParallel, expert_fn: ExpertFn, weights, x: jax.Array, ids: jax.Array, payload, replicated=None
) -> tuple[jax.Array, object, jax.Array]:
  """Run `expert_fn` on every (token, slot) assignment with the experts split over the mesh.

  x [T, H]; ids [T, k] expert ids; weights: a pytree of [E, ...] arrays (split over the expert
  axis); payload: a pytree of per-assignment rows [T * k, ...] (t-major) that travels with x;
  replicated: a pytree passed unsplit to expert_fn as its last argument (scalar weight leaves,
  such as a per-tensor scale, are passed whole too).
  Returns (expert outputs [T, k, H] (0 for dropped assignments), expert_fn's per-row outputs
  [T * k, ...] (0 where dropped), number of dropped assignments (int32 scalar)).
  """
  mesh, axis = ep.mesh, ep.expert_axis
  sizes = dict(mesh.shape)
  n_ep = sizes.get(axis, 1)
  num_experts = jax.tree_util.tree_leaves(weights)[0].shape[0]
  if num_experts % n_ep:
    raise ValueError(f"{num_experts} experts do not split over the {n_ep}-way {axis!r} mesh axis.")
  t, k = ids.shape
  token_axes = tuple(mesh.axis_names)  # size-1 axes too: every output then varies over every axis
  shards = math.prod(sizes.values())
  pad = -t % shards
  if pad:  # padded rows route nowhere (id -1): never sent, never counted as dropped
    x = jnp.pad(x, ((0, pad), (0, 0)))
    ids = jnp.pad(ids, ((0, pad), (0, 0)), constant_values=-1)
    payload = jax.tree_util.tree_map(lambda a: jnp.pad(a, ((0, pad * k),) + ((0, 0),) * (a.ndim - 1)), payload)
  rows = P(token_axes)
  impl = ep.resolved_a2a
  body = _dense if impl == "dense" else _ragged
  a2a = jax.lax.ragged_all_to_all if impl == "ragged" else ragged_all_to_all_reference

  def local(weights, x, ids, payload, replicated):
    return body(expert_fn, weights, x, ids, payload, replicated, ep.capacity_factor, axis, n_ep, a2a, token_axes)

  y, out_rows, dropped = jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(jax.tree_util.tree_map(lambda w: P(axis) if w.ndim else P(), weights), rows, rows, rows, P()),
    out_specs=(rows, rows, P()),
  )(weights, x, ids, payload, replicated)
  if pad:
    y, out_rows = y[:t], jax.tree_util.tree_map(lambda a: a[: t * k], out_rows)
  return y, out_rows, dropped


def _masked(tree, keep):
  return jax.tree_util.tree_map(lambda a: a * keep.reshape(keep.shape + (1,) * (a.ndim - 1)).astype(a.dtype), tree)


def _sort_by_expert(ids, num_experts):
  """Local assignments sorted by expert (invalid ones last): (flat ids, key, order, counts [E])."""
  e = ids.reshape(-1)
  key = jnp.where(e >= 0, e, num_experts)
  order = jnp.argsort(key, stable=True)
  counts = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  return e, key, order, counts


def _dense(expert_fn, weights, x, ids, payload, replicated, capacity_factor, axis, n_ep, a2a, token_axes):
  del a2a
  num_experts_local = jax.tree_util.tree_leaves(weights)[0].shape[0]
  num_experts = num_experts_local * n_ep
  t, k = ids.shape
  n = t * k
  capacity = max(1, min(n, math.ceil(capacity_factor * n / num_experts)))
  e, key, order, counts = _sort_by_expert(ids, num_experts)
  starts = jnp.cumsum(counts) - counts
  rank = jnp.arange(n) - jnp.concatenate([starts, jnp.zeros((1,), jnp.int32)])[key[order]]
  slot = jnp.zeros((n,), jnp.int32).at[order].set(rank.astype(jnp.int32))
  valid = e >= 0
  kept = valid & (slot < capacity)
  dest = jnp.where(kept, e, num_experts)  # out of bounds: dropped by the scatter

  def dispatch(rows):  # [n, ...] -> [E, C, ...] -> all_to_all -> [E_local, n_ep * C, ...] rows
    buf = jnp.zeros((num_experts, capacity) + rows.shape[1:], rows.dtype).at[dest, slot].set(rows, mode="drop")
    buf = jax.lax.all_to_all(buf, axis, 0, 0, tiled=True) if n_ep > 1 else buf
    buf = buf.reshape((n_ep, num_experts_local, capacity) + rows.shape[1:]).swapaxes(0, 1)
    return buf.reshape((num_experts_local * n_ep * capacity,) + rows.shape[1:])

  def combine(rows):  # the inverse of dispatch, then each assignment's row
    buf = rows.reshape((num_experts_local, n_ep, capacity) + rows.shape[1:]).swapaxes(0, 1)
    buf = buf.reshape((num_experts, capacity) + rows.shape[1:])
    buf = jax.lax.all_to_all(buf, axis, 0, 0, tiled=True) if n_ep > 1 else buf
    picked = buf[jnp.minimum(dest, num_experts - 1), jnp.minimum(slot, capacity - 1)]
    return _masked(picked, kept)

  xs = dispatch(x[jnp.arange(n) // k])
  # equal groups (n_ep * capacity rows per local expert): group_sizes=None asks for a batched matmul
  ys, out_rows = expert_fn(weights, xs, jax.tree_util.tree_map(dispatch, payload), None, replicated)
  dropped = jnp.sum(valid & ~kept).astype(jnp.int32)
  dropped = jax.lax.psum(dropped, token_axes)
  return combine(ys).reshape(t, k, -1), jax.tree_util.tree_map(combine, out_rows), dropped


def _ragged(expert_fn, weights, x, ids, payload, replicated, capacity_factor, axis, n_ep, a2a, token_axes):
  num_experts_local = jax.tree_util.tree_leaves(weights)[0].shape[0]
  num_experts = num_experts_local * n_ep
  t, k = ids.shape
  n = t * k
  quota = max(1, min(n, math.ceil(capacity_factor * n / n_ep)))  # rows one source may send one device
  e, key, order, counts = _sort_by_expert(ids, num_experts)
  me = jax.lax.axis_index(axis) if n_ep > 1 else 0
  to_device = counts.reshape(n_ep, num_experts_local).sum(1)
  input_offsets = jnp.cumsum(to_device) - to_device
  send_sizes = jnp.minimum(to_device, quota)
  # rows kept per expert after the quota cut (the cut takes a destination's highest experts)
  first = jnp.cumsum(counts) - counts - jnp.repeat(input_offsets, num_experts_local)
  kept_counts = jnp.clip(jnp.repeat(send_sizes, num_experts_local) - first, 0, counts)
  exchange = (lambda a: jax.lax.all_to_all(a, axis, 0, 0, tiled=True)) if n_ep > 1 else (lambda a: a)
  recv_sizes = exchange(send_sizes)
  recv_counts = exchange(kept_counts).reshape(n_ep, num_experts_local)  # [source, local expert]
  output_offsets = jnp.full((n_ep,), me * quota, jnp.int32)
  sorted_dest = key[order] // num_experts_local
  sorted_rank = jnp.arange(n) - jnp.concatenate([input_offsets, jnp.zeros((1,), jnp.int32)])[sorted_dest]
  sorted_kept = (key[order] < num_experts) & (sorted_rank < quota)

  def send(rows):  # [n, ...] sorted -> [n_ep * quota, ...] grouped by source
    out = jnp.zeros((n_ep * quota,) + rows.shape[1:], rows.dtype)
    return a2a(rows, out, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis)

  # received rows: region i = [i * quota, i * quota + recv_sizes[i]), sorted by local expert
  r = jnp.arange(n_ep * quota)
  src, offset = r // quota, r % quota
  bounds = jnp.cumsum(recv_counts, axis=1)  # [source, local expert]
  local_expert = jnp.sum(offset[:, None] >= bounds[src], axis=1)
  local_key = jnp.where(offset < recv_sizes[src], local_expert, num_experts_local)
  perm = jnp.argsort(local_key, stable=True)
  group_sizes = jnp.sum(recv_counts, axis=0).astype(jnp.int32)

  xs = send(x[order // k])[perm]
  pl = jax.tree_util.tree_map(lambda a: send(a[order])[perm], payload)
  ys, out_rows = expert_fn(weights, xs, pl, group_sizes, replicated)

  back_offsets = exchange(input_offsets)  # where each source keeps its rows for me

  def receive(rows):  # the inverse of send, then unsort to assignments
    buf = jnp.zeros_like(rows).at[perm].set(rows)
    out = jnp.zeros((n,) + rows.shape[1:], rows.dtype)
    out = a2a(buf, out, jnp.arange(n_ep, dtype=jnp.int32) * quota, recv_sizes, back_offsets, send_sizes, axis_name=axis)
    out = _masked(out, sorted_kept)
    return jnp.zeros_like(out).at[order].set(out)

  valid = jnp.sum(e >= 0).astype(jnp.int32)
  dropped = valid - jnp.sum(send_sizes).astype(jnp.int32)
  dropped = jax.lax.psum(dropped, token_axes)
  return receive(ys).reshape(t, k, -1), jax.tree_util.tree_map(receive, out_rows), dropped


def ragged_all_to_all_reference(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
  """`lax.ragged_all_to_all` semantics from a dense all_to_all (any backend; memory n x operand).

  This device sends operand[input_offsets[j] : + send_sizes[j]] to device j, which writes it
  at its output[output_offsets[j] : + ...]; recv_sizes[i] = rows arriving from device i.
  """
  n = input_offsets.shape[0]
  length = operand.shape[0]
  span = jnp.arange(length)
  index = jnp.minimum(input_offsets[:, None] + span[None], length - 1)
  chunks = _masked(operand[index.reshape(-1)], (span[None] < send_sizes[:, None]).reshape(-1))
  chunks = chunks.reshape((n, length) + operand.shape[1:])
  exchange = (lambda a: jax.lax.all_to_all(a, axis_name, 0, 0, tiled=True)) if n > 1 else (lambda a: a)
  received, offsets = exchange(chunks), exchange(output_offsets)
  pos = jnp.where(span[None] < recv_sizes[:, None], offsets[:, None] + span[None], output.shape[0])
  return output.at[pos.reshape(-1)].set(received.reshape((n * length,) + operand.shape[1:]), mode="drop")
