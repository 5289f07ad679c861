"""Grouped (ragged) FP4 matmul for MoE experts: out[i] = x[i] @ dequantize(w[group(i)])^T.

Tokens arrive sorted by expert: x[M, K], group_sizes[E] (int32, sum <= M), so group g owns rows
[offsets[g], offsets[g + 1]). The expert weights are one QuantizedArray with codes [E, N, K/2] and
scales [E, N, K/bs] (nn.Linear layout per expert) and an optional NVFP4 tensor scale, either one
for all experts or one per expert (shape [E] or [E, 1, 1], as fp4.quantize gives for a per-expert
tensor_amax).

Mapping groups to tiles (the megablox / tokamax pattern, with tiles aligned to the groups):
  * "Visits" are blocks of block_m rows that start at their group's first row (then every block_m
    rows), in group order, plus the visits of a pseudo group that owns the rows past
    sum(group_sizes), so that every output row belongs to exactly one visit. Each program works
    out its own visit from group_sizes (`visit_rows`: two scans and a few reductions over E), so
    the call is one launch: no metadata kernels before it.
  * A group of s rows takes ceil(s / block_m) visits, each streaming its expert's weights once:
    a group is never split across two fixed row tiles, which streamed the expert twice (+14% weight
    bytes at 64 tokens top-8 of 128 experts; pallas_kernels/lab/kernel_report.py). block_m follows the
    mean group size (`group_tile_rows`). That is
    still at most m_tiles + E visits; the grid is (m_tiles + E, n tiles), and grid steps past the
    real number of visits do nothing.
  * A visit loads block_m rows of x from its first row (or the last block_m rows of x, when that
    block would reach past them: no padding of x, no out-of-bounds address), its expert's weight
    tile (a dynamic index into the [E, ...] arrays), runs the same K loop as the dense kernel, and
    stores only the rows of its group with a masked store. Visits own disjoint rows, so programs
    running concurrently on the GPU never write the same element; the pseudo group skips the K
    loop and stores zeros.
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


def num_visits(num_rows: int, num_groups: int, block_m: int) -> int:
  """Grid size: ceil(s / block_m) summed over E groups and the pseudo group, whose sizes add up to
  num_rows, is at most ceil(num_rows / block_m) + E."""
  return pl.cdiv(num_rows, block_m) + num_groups


def _pick(values: jax.Array, index: jax.Array) -> jax.Array:
  """values[index] for a traced scalar index, as a masked sum (a reduction Triton lowers)."""
  return jnp.sum(values * (jnp.arange(values.shape[0], dtype=jnp.int32) == index).astype(values.dtype))


def visit_rows(group_sizes: jax.Array, visit: jax.Array, num_rows: int, block_m: int):
  """(group, row_start, row_end) of one visit, computed from group_sizes [E] alone: the metadata
  pass runs inside the kernel (each program redoes this O(E) work; no launches before the kernel).

  Visits list the real groups' blocks first (ceil(size / block_m) each, in group order), then the
  pseudo group E's (rows from sum(group_sizes) to `num_rows`), then empty visits (group E, rows
  [num_rows, num_rows)). Group ends are clipped to `num_rows`. Only scans, reductions and
  arithmetic: the same code runs in jnp (`make_group_metadata`) and in the Triton kernel.
  """
  sizes = group_sizes.astype(jnp.int32)
  cumulative = jnp.cumsum(sizes)
  ends = jnp.minimum(cumulative, num_rows)
  starts = jnp.minimum(cumulative - sizes, num_rows)
  blocks = (ends - starts + block_m - 1) // block_m
  visits_end = jnp.cumsum(blocks)
  real_visits = jnp.sum(blocks)
  is_real = (visit < real_visits).astype(jnp.int32)
  group = jnp.sum((visits_end <= visit).astype(jnp.int32))  # E for the pseudo group and beyond
  g = jnp.minimum(group, sizes.shape[0] - 1)
  real_start = _pick(starts, g) + (visit - _pick(visits_end, g) + _pick(blocks, g)) * block_m
  real_end = jnp.minimum(_pick(ends, g), real_start + block_m)
  pseudo_start = jnp.minimum(_pick(ends, sizes.shape[0] - 1) + (visit - real_visits) * block_m, num_rows)
  pseudo_end = jnp.minimum(pseudo_start + block_m, num_rows)
  # Products, not jnp.where: the Triton lowering types a select of scalars like its predicate (i1).
  row_start = is_real * real_start + (1 - is_real) * pseudo_start
  row_end = is_real * real_end + (1 - is_real) * pseudo_end
  return group, row_start, row_end


def make_group_metadata(group_sizes: jax.Array, num_rows: int, block_m: int) -> jax.Array:
  """The visit table, int32 [3, num_visits]: per visit (`visit_rows`) its group and its row range
  [start, end), at most block_m rows from the group's first row on. For tests and reports: the
  kernel computes its own row of it."""
  visits = jnp.arange(num_visits(num_rows, group_sizes.shape[0], block_m), dtype=jnp.int32)
  table = jax.vmap(lambda v: visit_rows(group_sizes, v, num_rows, block_m))(visits)
  return jnp.stack(table).astype(jnp.int32)


def group_tile_rows(num_rows: int, num_groups: int) -> int:
  """The rows a tile should cover (block_m is its next power of two, 16 at least): at decode an
  expert sees a few rows, not M. Twice the mean group size from 12 rows on: with 16-row tiles,
  groups around a mean of 16 often need two visits, each streaming the expert again (188 streams
  for 128 experts at 256 tokens top-8 of 128), while 32-row tiles cost 1.2x the instructions per
  weight (pallas_kernels/lab/kernel_report.py): 18% fewer issued instructions there, and no change at 64
  tokens (mean 4)."""
  mean = pl.cdiv(num_rows, num_groups)
  return 2 * mean if mean >= 12 else mean


def _visit(sizes_ref, x_ref, tiles: dense.Tiles, num_rows: int, num_groups: int):
  """This program's visit: (group, expert, the block_m rows of x it loads, its store mask).

  sizes_ref may hold trailing empty groups (a power-of-two length for Triton): their visits never
  come, and the pseudo group's id is then >= num_groups, which is all the kernels ask."""
  group, row_start, row_end = visit_rows(sizes_ref[...], pl.program_id(0), num_rows, tiles.block_m)
  expert = jnp.minimum(group, num_groups - 1)  # the pseudo group loads nothing (zero K steps)
  # From the group's first row on (not a multiple of block_m), kept inside x's rows.
  first = jnp.minimum(row_start, x_ref.shape[0] - tiles.block_m)
  row = first + jnp.arange(tiles.block_m)
  mask = ((row >= row_start) & (row < row_end))[:, None]
  return group, expert, pl.ds(first, tiles.block_m), mask


def _grouped_kernel(
  sizes_ref,
  x_ref,
  codes_ref,
  scales_ref,
  *rest,
  fmt: fp4.Fp4Format,
  tiles: dense.Tiles,
  num_rows: int,
  num_groups: int,
):
  *tensor_scale_ref, out_ref = rest
  group, expert, rows, mask = _visit(sizes_ref, x_ref, tiles, num_rows, num_groups)

  def load(k_tile):
    xs, cs, ss = dense.k_slices(k_tile, tiles.block_k, fmt.block_size)
    return x_ref[rows, xs], codes_ref[expert, :, cs], scales_ref[expert, :, ss]

  k_tiles = x_ref.shape[1] // tiles.block_k
  acc = jnp.zeros((tiles.block_m, tiles.block_n), jnp.float32)
  num_k_tiles = k_tiles * (group < num_groups).astype(jnp.int32)
  acc = dense.accumulate(load, 0, num_k_tiles, acc, fmt, tiles)
  acc = acc * 2.0 ** dense.weight_exponent_offset(fmt)
  if tensor_scale_ref:
    scales = tensor_scale_ref[0]  # [1, 1] (one for all experts) or [E, 1]
    acc = acc * scales[expert if scales.shape[0] > 1 else 0, 0]
  plgpu.store(out_ref.at[rows, :], acc.astype(out_ref.dtype), mask=mask)


def _grouped_bf16_kernel(sizes_ref, x_ref, w_ref, out_ref, *, tiles: dense.Tiles, num_rows: int, num_groups: int):
  """The same visits, tiles and K loop on bf16 weights [E, N, K]: the baseline of the same family."""
  group, expert, rows, mask = _visit(sizes_ref, x_ref, tiles, num_rows, num_groups)

  def body(k_tile, acc):
    ks = pl.ds(pl.multiple_of(k_tile * tiles.block_k, tiles.block_k), tiles.block_k)
    x, w = x_ref[rows, ks], w_ref[expert, :, ks]
    return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

  num_k_tiles = (x_ref.shape[1] // tiles.block_k) * (group < num_groups).astype(jnp.int32)
  acc = jax.lax.fori_loop(0, num_k_tiles, body, jnp.zeros((tiles.block_m, tiles.block_n), jnp.float32))
  plgpu.store(out_ref.at[rows, :], acc.astype(out_ref.dtype), mask=mask)


def _padded_sizes(group_sizes: jax.Array) -> jax.Array:
  """int32 group sizes, with empty groups appended up to a power of two (Triton's array sizes)."""
  sizes = group_sizes.astype(jnp.int32)
  num_groups = sizes.shape[0]
  return jnp.pad(sizes, (0, pl.next_power_of_2(num_groups) - num_groups)) if num_groups & (num_groups - 1) else sizes


def _check_group_sizes(group_sizes: jax.Array, num_groups: int, what: str):
  if group_sizes.shape != (num_groups,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(
      f"{what}: group_sizes must be integer [{num_groups}] (one per expert); "
      f"got {group_sizes.dtype}{list(group_sizes.shape)}."
    )


def grouped_tiles(m: int, w, interpret: bool, **chosen) -> dense.Tiles:
  """The tiles of both grouped kernels for x [m, K] and w [E, N, K] (packed or bf16): rows from
  `group_tile_rows`, K not split (MoE layers already give many programs: visits x n tiles)."""
  num_groups, n, k = w.shape
  fmt = w.fmt if isinstance(w, fp4.QuantizedArray) else fp4.NVFP4  # bf16: the FP4 kernel's defaults
  return dense.make_tiles(
    group_tile_rows(m, num_groups), n, k, fmt, interpret=interpret, split_k=False, parallel=num_groups, **chosen
  )


def _whole(shape):
  """A block that is the whole array, for every program of the (visit, n tile) grid."""
  return pl.BlockSpec(shape, lambda v, j: (0,) * len(shape))


def _visit_grid_call(kernel, x, group_sizes, weight_specs, weight_operands, n, tiles, out_dtype, interpret, name):
  """`kernel(sizes_ref, x_ref, *weight_refs, out_ref)` over the (visit, n tile) grid: the group
  sizes (`_padded_sizes`) and x whole, then the weight operands with their specs. x shorter than
  one block is padded to it (a few rows at most); out is [M, N]."""
  m, k = x.shape
  if m < tiles.block_m:
    x = jnp.pad(x, ((0, tiles.block_m - m), (0, 0)))
  m_padded = x.shape[0]
  sizes = _padded_sizes(group_sizes)
  out = pl.pallas_call(
    functools.partial(kernel, tiles=tiles, num_rows=m, num_groups=group_sizes.shape[0]),
    out_shape=jax.ShapeDtypeStruct((m_padded, n), out_dtype),
    grid=(num_visits(m, group_sizes.shape[0], tiles.block_m), n // tiles.block_n),
    in_specs=[_whole(sizes.shape), _whole((m_padded, k)), *weight_specs],
    out_specs=pl.BlockSpec((m_padded, tiles.block_n), lambda v, j: (0, j)),
    compiler_params=dense.compiler_params(tiles),
    interpret=interpret,
    name=name,
  )(sizes, x, *weight_operands)
  return out[:m] if m_padded > m else out


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
  _check_group_sizes(group_sizes, num_groups, "grouped_fp4_matmul")
  tensor_scale = w.tensor_scale
  if tensor_scale is not None and jnp.size(tensor_scale) not in (1, num_groups):
    raise ValueError(
      f"grouped_fp4_matmul: tensor_scale must hold 1 or {num_groups} (one per expert) values, "
      f"got shape {jnp.shape(tensor_scale)}."
    )
  interpret = dense.resolve_interpret(interpret)
  chosen = dict(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
  tiles = grouped_tiles(x.shape[0], w, interpret, ptx_decode=ptx_decode, **chosen)
  x = dense.prepare_activations(x, quantize_activations, activation_format, w.fmt)
  specs = [
    pl.BlockSpec((num_groups, tiles.block_n, k // 2), lambda v, j: (0, j, 0)),
    pl.BlockSpec((num_groups, tiles.block_n, k // w.fmt.block_size), lambda v, j: (0, j, 0)),
  ]
  operands = [w.codes, dense.scale_bytes(w)]
  if tensor_scale is not None:  # [1, 1] or [E, 1]: a reshape, no broadcast (no launch)
    tensor_scale = jnp.asarray(tensor_scale, jnp.float32).reshape(-1, 1)
    specs.append(_whole(tensor_scale.shape))
    operands.append(tensor_scale)
  kernel = functools.partial(_grouped_kernel, fmt=w.fmt)
  return _visit_grid_call(
    kernel, x, group_sizes, specs, operands, n, tiles, out_dtype, interpret, f"grouped_fp4_matmul_{w.fmt.name}"
  )


@dense.jit_kernel
def grouped_bf16_matmul(
  x: jax.Array,
  group_sizes: jax.Array,
  w: jax.Array,
  *,
  block_m: int | None = None,
  block_n: int | None = None,
  block_k: int | None = None,
  num_warps: int | None = None,
  num_stages: int | None = None,
  out_dtype=jnp.bfloat16,
  interpret: bool | None = None,
) -> jax.Array:
  """`grouped_fp4_matmul` on bf16 weights w [E, N, K]: the same visits, default tiles and K loop,
  only the weight tile is loaded instead of decoded. The honest bf16 baseline for the FP4 kernel
  (benchmarks): XLA rewrites `lax.ragged_dot` into a dense masked matmul over all experts."""
  if w.ndim != 3 or x.ndim != 2 or x.shape[1] != w.shape[2]:
    raise ValueError(
      f"grouped_bf16_matmul: x [M, K] and w [E, N, K] expected; got {list(x.shape)} and {list(w.shape)}."
    )
  num_groups, n, k = w.shape
  _check_group_sizes(group_sizes, num_groups, "grouped_bf16_matmul")
  interpret = dense.resolve_interpret(interpret)
  chosen = dict(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
  tiles = grouped_tiles(x.shape[0], w, interpret, **chosen)
  specs = [pl.BlockSpec((num_groups, tiles.block_n, k), lambda v, j: (0, j, 0))]
  return _visit_grid_call(
    _grouped_bf16_kernel, x.astype(jnp.bfloat16), group_sizes, specs, [w.astype(jnp.bfloat16)], n, tiles, out_dtype,
    interpret, "grouped_bf16_matmul",
  )  # fmt: skip


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
