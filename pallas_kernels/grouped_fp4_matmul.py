"""Grouped (ragged) FP4 matmul for MoE experts: out[i] = x[i] @ dequantize(w[group(i)])^T.

Tokens arrive sorted by expert: x[M, K], group_sizes[E] (int32, sum <= M), so group g owns rows
[offsets[g], offsets[g + 1]). The expert weights are one QuantizedArray with codes [E, N, K/2] and
scales [E, N, K/bs] (nn.Linear layout per expert) and an optional NVFP4 tensor scale, either one
for all experts or one per expert (shape [E] or [E, 1, 1], as fp4.quantize gives for a per-expert
tensor_amax).

Mapping groups to tiles (the megablox / tokamax pattern, adapted to a GPU grid):
  * A metadata pass in jnp lists "visits": (m tile, group) pairs whose row ranges intersect, in
    group order, plus the visits of a pseudo group that owns the rows past sum(group_sizes) (and
    the padding rows), so that every output row belongs to exactly one visit.
  * Since groups are contiguous and tile the rows, there are at most m_tiles + E such visits
    (every group adds at most one tile that it shares with its predecessor); the grid is
    (m_tiles + E, n tiles), and grid steps past the real number of visits do nothing.
  * A visit loads its expert's weight tile (a dynamic index into the [E, ...] arrays), runs the same
    K loop as the dense kernel, and stores only the rows of its group with a masked store. Two
    visits of the same m tile write disjoint rows, so programs running concurrently on the GPU
    never write the same element; the pseudo group skips the K loop and stores zeros.
  * Visits of one group are adjacent along grid axis 0, so programs that read the same expert
    tile run close together and share it through L2.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import fp4_matmul as dense
from trace_jax import fp4

# Rows of the int32 visit table passed to the kernel.
_TILE, _GROUP, _ROW_START, _ROW_END = range(4)


def make_group_metadata(group_sizes: jax.Array, num_rows: int, num_padded_rows: int, block_m: int) -> jax.Array:
  """The visit table, int32 [4, m_tiles + E]: per visit its m tile, group, and row range.

  The group id is E for the pseudo group (rows from sum(group_sizes) up to `num_padded_rows`) and
  for unused trailing visits, whose row range is empty. Group ends are clipped to `num_rows`.
  """
  num_groups = group_sizes.shape[0]
  m_tiles = num_padded_rows // block_m
  ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), num_rows)
  starts = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]])
  starts = jnp.append(starts, ends[-1])  # the pseudo group
  ends = jnp.append(ends, num_padded_rows)

  nonempty = ends > starts
  first_tile = starts // block_m
  tiles_per_group = jnp.where(nonempty, (ends - 1) // block_m - first_tile + 1, 0)
  visits_end = jnp.cumsum(tiles_per_group)
  visit = jnp.arange(m_tiles + num_groups, dtype=jnp.int32)
  # compare_all: one [visits, E] comparison; the default binary search compiles to a while loop
  # of ~50 tiny kernels on GPU (pallas_kernels/gpu_compile.py counts the launches).
  group = jnp.searchsorted(visits_end, visit, side="right", method="compare_all").astype(jnp.int32)
  used = visit < visits_end[-1]
  g = jnp.minimum(group, num_groups)
  tile = first_tile[g] + visit - (visits_end[g] - tiles_per_group[g])
  row_start = jnp.maximum(starts[g], tile * block_m)
  row_end = jnp.minimum(ends[g], (tile + 1) * block_m)
  return jnp.stack(
    [
      jnp.where(used, tile, 0),
      jnp.where(used, g, num_groups),
      jnp.where(used, row_start, 0),
      jnp.where(used, row_end, 0),
    ]
  ).astype(jnp.int32)


def _grouped_kernel(
  meta_ref, x_ref, codes_ref, scales_ref, *rest, fmt: fp4.Fp4Format, tiles: dense.Tiles, num_groups: int
):
  *tensor_scale_ref, out_ref = rest
  v = pl.program_id(0)
  tile = meta_ref[_TILE, v]
  group = meta_ref[_GROUP, v]
  row_start = meta_ref[_ROW_START, v]
  row_end = meta_ref[_ROW_END, v]
  expert = jnp.minimum(group, num_groups - 1)  # the pseudo group loads nothing (zero K steps)
  rows = pl.ds(pl.multiple_of(tile * tiles.block_m, tiles.block_m), tiles.block_m)

  def load(k_tile):
    xs, cs, ss = dense.k_slices(k_tile, tiles.block_k, fmt.block_size)
    return x_ref[rows, xs], codes_ref[expert, :, cs], scales_ref[expert, :, ss]

  k_tiles = x_ref.shape[1] // tiles.block_k
  acc = jnp.zeros((tiles.block_m, tiles.block_n), jnp.float32)
  # A product, not jnp.where: the Triton lowering types a select of two literals like its predicate (i1).
  num_k_tiles = k_tiles * (group < num_groups).astype(jnp.int32)
  acc = dense.accumulate(load, 0, num_k_tiles, acc, fmt, tiles)
  acc = acc * 2.0 ** dense.weight_exponent_offset(fmt)
  if tensor_scale_ref:
    acc = acc * tensor_scale_ref[0][expert, 0]
  row = tile * tiles.block_m + jnp.arange(tiles.block_m)
  mask = ((row >= row_start) & (row < row_end))[:, None]
  plgpu.store(out_ref.at[rows, :], acc.astype(out_ref.dtype), mask=mask)


@dense.jit_kernel
def grouped_fp4_matmul(
  x: jax.Array,
  group_sizes: jax.Array,
  w: fp4.QuantizedArray,
  *,
  quantize_activations: bool = False,
  activation_format: str | fp4.Fp4Format | None = None,
  block_m: int | None = None,
  block_n: int | None = None,
  block_k: int | None = None,
  num_warps: int | None = None,
  num_stages: int | None = None,
  ptx_decode: bool | None = None,
  out_dtype=jnp.bfloat16,
  interpret: bool | None = None,
) -> jax.Array:
  """out[M, N]: row i of x (sorted by group) times the dequantized weight of its group, transposed.

  Rows past sum(group_sizes) are zero. Arguments as in `fp4_matmul`, plus `group_sizes` [E] int32;
  K is not split (MoE layers already give many programs: visits x n tiles).
  """
  dense.check_weight(w, 3, "grouped_fp4_matmul")
  num_groups, n, k = w.shape
  if x.ndim != 2 or x.shape[1] != k:
    raise ValueError(f"grouped_fp4_matmul: x must be [M, K={k}] for weight {list(w.shape)}; got {list(x.shape)}.")
  if group_sizes.shape != (num_groups,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(
      f"grouped_fp4_matmul: group_sizes must be integer [{num_groups}] (one per expert); "
      f"got {group_sizes.dtype}{list(group_sizes.shape)}."
    )
  tensor_scale = w.tensor_scale
  if tensor_scale is not None and jnp.size(tensor_scale) not in (1, num_groups):
    raise ValueError(
      f"grouped_fp4_matmul: tensor_scale must hold 1 or {num_groups} (one per expert) values, "
      f"got shape {jnp.shape(tensor_scale)}."
    )
  m = x.shape[0]
  interpret = dense.resolve_interpret(interpret)
  # Tiles cover the rows of one group: at decode an expert sees a few rows, not M.
  tiles = dense.make_tiles(
    pl.cdiv(m, num_groups),
    n,
    k,
    w.fmt,
    interpret=interpret,
    block_m=block_m,
    block_n=block_n,
    block_k=block_k,
    num_warps=num_warps,
    num_stages=num_stages,
    ptx_decode=ptx_decode,
    split_k=False,
    parallel=num_groups,
  )
  x = dense.pad_rows(dense.prepare_activations(x, quantize_activations, activation_format, w.fmt), tiles.block_m)
  m_padded = x.shape[0]
  meta = make_group_metadata(group_sizes, m, m_padded, tiles.block_m)
  num_visits = meta.shape[1]

  full = lambda shape: pl.BlockSpec(shape, lambda v, j: (0,) * len(shape))
  in_specs = [
    full(meta.shape),
    full((m_padded, k)),
    pl.BlockSpec((num_groups, tiles.block_n, k // 2), lambda v, j: (0, j, 0)),
    pl.BlockSpec((num_groups, tiles.block_n, k // w.fmt.block_size), lambda v, j: (0, j, 0)),
  ]
  operands = [meta, x, w.codes, dense.scale_bytes(w)]
  if tensor_scale is not None:
    in_specs.append(full((num_groups, 1)))
    operands.append(jnp.broadcast_to(jnp.asarray(tensor_scale, jnp.float32).reshape(-1, 1), (num_groups, 1)))

  kernel = functools.partial(_grouped_kernel, fmt=w.fmt, tiles=tiles, num_groups=num_groups)
  out = pl.pallas_call(
    kernel,
    out_shape=jax.ShapeDtypeStruct((m_padded, n), out_dtype),
    grid=(num_visits, n // tiles.block_n),
    in_specs=in_specs,
    out_specs=pl.BlockSpec((m_padded, tiles.block_n), lambda v, j: (0, j)),
    compiler_params=dense.compiler_params(tiles),
    interpret=interpret,
    name=f"grouped_fp4_matmul_{w.fmt.name}",
  )(*operands)
  return out[:m]


def grouped_fp4_matmul_reference(
  x: jax.Array,
  group_sizes: jax.Array,
  w: fp4.QuantizedArray,
  *,
  quantize_activations: bool = False,
  activation_format: str | fp4.Fp4Format | None = None,
  out_dtype=jnp.bfloat16,
) -> jax.Array:
  """Plain jnp: `lax.ragged_dot` of bf16 x (fake-quantized if asked) with fp4.dequantize(w) in float32."""
  if w.tensor_scale is not None:  # a per-expert tensor scale broadcasts over [E, N, blocks]
    w = dataclasses.replace(w, tensor_scale=jnp.asarray(w.tensor_scale, jnp.float32).reshape(-1, 1, 1))
  weights = jnp.swapaxes(fp4.dequantize(w), 1, 2)  # [E, K, N] float32
  xq = dense.prepare_activations(x, quantize_activations, activation_format, w.fmt).astype(jnp.float32)
  out = jax.lax.ragged_dot(
    xq, weights, group_sizes.astype(jnp.int32), precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
  )
  return out.astype(out_dtype)
