"""The Mosaic GPU NVFP4 kernel's packed layout (pallas_kernels/fp4_mosaic.py).

On CPU: the packing and the instruction-by-instruction emulation of the kernel's register decode
are checked bit for bit against `fp4.dequantize` (every code in every slot, every E4M3 scale byte,
random weights with zero, negative, subnormal and NaN scales). On a GPU (pallas_kernels/lab/gpu_check.py
runs this file there): the compiled kernel against its jnp reference. The kernel's compiled figures
(one launch, no spills, instructions per weight) are checked by tests/test_gpu_compile.py.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import fp4_matmul as dense
from pallas_kernels import fp4_mosaic as fm
from pallas_kernels import grouped_fp4_matmul as grouped
from trace_jax import fp4

ON_GPU = jax.default_backend() == "gpu"


def _weight(codes: np.ndarray, scale_bytes: np.ndarray, tensor_scale=None) -> fp4.QuantizedArray:
  packed = (codes[:, 0::2] | codes[:, 1::2] << 4).astype(np.uint8)
  scales = jnp.asarray(scale_bytes.astype(np.uint8).view(jnp.float8_e4m3fn))
  return fp4.QuantizedArray(jnp.asarray(packed), scales, tensor_scale, fp4.NVFP4)


def _expected(w: fp4.QuantizedArray) -> np.ndarray:
  """What the kernel's registers hold: the weight times 2^-7, without the tensor scale."""
  values = fp4.dequantize(fp4.QuantizedArray(w.codes, w.scales, None, w.fmt))
  return np.asarray(values).astype(np.float64) * 2.0**-fm.RESULT_EXPONENT


def _assert_same(got: np.ndarray, want: np.ndarray):
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  ok = ~np.isnan(want)
  np.testing.assert_array_equal(got[ok], want[ok])  # (a zero block's zeros may lose their signs)


def test_every_code_in_every_slot_decodes_to_its_bf16_bits():
  # decode_word on words holding one code in one of the 8 slots: bits (code & 7) << 6 | sign << 15.
  n, k = fm.ROWS, fm.SCALE_GROUP_K
  for code in range(16):
    codes = np.full((n, k), code, np.uint8)
    w = fm.pack_fragments(_weight(codes, np.full((n, k // 16), 0x38)))  # scale 1.0
    regs = np.stack(fm.decode_word(np.asarray(w.codes).view(np.uint32)), -1)
    halves = np.concatenate([regs & 0xFFFF, regs >> 16])
    assert np.all(halves == ((code & 7) << 6 | (code & 8) << 12)), code


def _mosaic_wgmma_layout(k: int) -> dict:
  """(warp, lane, register index, vector element) -> (row, col) of a [64, k] array in Mosaic's
  WGMMA_LAYOUT, from its tiling and dims (Mosaic's own definition, not our packing's)."""
  from jax.experimental.mosaic.gpu import fragmented_array as fa

  layout = fa.WGMMA_LAYOUT
  idx = np.stack(np.meshgrid(np.arange(64), np.arange(k), indexing="ij"), -1)  # [64, k, (row, col)]
  for tile in layout.tiling.tiles:  # each tile unfolds the trailing dims: (a, b) -> (a/ta, b/tb, ta, tb)
    lead, n = idx.shape[: -1 - len(tile)], len(tile)
    split = [d for size, t in zip(idx.shape[-1 - n : -1], tile) for d in (size // t, t)]
    idx = idx.reshape(*lead, *split, 2)
    order = list(range(len(lead))) + [len(lead) + 2 * i for i in range(n)] + [len(lead) + 2 * i + 1 for i in range(n)]
    idx = idx.transpose(*order, len(order))
  dims = idx.ndim - 1
  warp_dim, (lane_row, lane_col), vector = dims + layout.warp_dims[0], [dims + d for d in layout.lane_dims], dims - 1
  mapping = {}
  for pos in np.ndindex(*idx.shape[:-1]):
    lane = pos[lane_row] * idx.shape[lane_col] + pos[lane_col]
    register = tuple(0 if d in (warp_dim, lane_row, lane_col, vector) else p for d, p in enumerate(pos))
    mapping[pos[warp_dim], lane, register, pos[vector]] = tuple(idx[pos])
  return mapping


def test_packing_matches_mosaic_wgmma_layout():
  # Where the kernel puts register o of chunk kk (`_decode_tile`: register index (0, 2 kk + o // 2, 0, 0,
  # o % 2, ...)) must be where Mosaic's layout says that register's weights are: the (row, col) that
  # `_fragment_order` packed into that slot of that thread's word.
  k = fm.GROUP_K
  mosaic = _mosaic_wgmma_layout(k)
  rows, cols = np.meshgrid(np.arange(64), np.arange(k), indexing="ij")
  where = np.asarray(fm._fragment_order(jnp.asarray(rows * k + cols), 64, k))[0, 0]  # [thread, chunk, o, e]
  for thread, chunk, o, e in np.ndindex(*where.shape):
    register = (0, 2 * chunk + o // 2, 0, 0, o % 2, 0, 0, 0, 0)
    assert mosaic[thread // 32, thread % 32, register, e] == divmod(int(where[thread, chunk, o, e]), k)


def test_passes_counts_the_x_tiles_a_group_touches():
  # Groups [5, 0, 12, 30] start at rows 0, 5, 5, 17: tiles start at multiples of 8.
  np.testing.assert_array_equal(fm.passes(np.array([5, 0, 12, 30]), 16), [1, 0, 2, 2])
  np.testing.assert_array_equal(fm.passes(np.array([5, 0, 12, 30]), 32), [1, 0, 1, 1])
  np.testing.assert_array_equal(fm.passes(np.array([7, 2]), 16), [1, 1])  # rows 7, 8: one tile [0, 16)


@pytest.mark.parametrize(
  "m, k, n, want",
  [
    (1, 8192, 8192, fm.MosaicTiles(16, 512, 4, compute_wgs=2)),
    (16, 8192, 8192, fm.MosaicTiles(16, 512, 4, compute_wgs=2)),
    (32, 8192, 8192, fm.MosaicTiles(32, 512, 4)),  # two warpgroups not yet timed at block_m 32
    (64, 8192, 8192, fm.MosaicTiles(64, 512, 2, compute_wgs=2)),  # x's 64 KB per step leave room for 2 slots
    (16, 768, 2048, fm.MosaicTiles(16, 384, 2)),  # 2 steps: the slots divide them; 192 per warpgroup: one
    (64, 256, 192, fm.MosaicTiles(64, 128, 2)),  # 2 steps of 128
    (32, 128, 128, fm.MosaicTiles(32, 128, 1)),
  ],
)
def test_default_tiles(m, k, n, want):
  # No x multicast by default (cluster 1): measured slower on an H200; two compute warpgroups where each
  # takes whole 128-wide scale groups: measured faster (see default_tiles).
  assert fm.default_tiles(m, k, n) == want


def test_default_grouped_tiles_chain_an_experts_units_while_its_blocks_fit_one_round():
  # 64 and 256 tokens top-8 of 128 experts: one block per (expert, pass lane), its 24 units chained (one round of
  # 125-128 streaming blocks; at 256 tokens 12 units of two 64-row tiles), two pass lanes (a group can take two x
  # tiles)
  T = fm.MosaicTiles
  assert fm.default_grouped_tiles(64 * 8, 128, 2048, 1536) == T(16, 512, 4, 1, 24, compute_wgs=2, pass_lanes=2)
  assert fm.default_grouped_tiles(256 * 8, 128, 2048, 1536) == T(32, 256, 4, 1, 12, 2, pass_lanes=2)
  # down [2048, 768]: steps of 256 on two 64-row tiles (3 steps, 3 slots) instead of one tile at 384
  assert fm.default_grouped_tiles(64 * 8, 128, 768, 2048) == T(
    16, 256, 3, 1, 16, row_tiles=2, compute_wgs=2, pass_lanes=2
  )
  assert fm.default_grouped_tiles(256 * 8, 128, 768, 2048) == T(32, 256, 3, 1, 16, row_tiles=2, pass_lanes=2)
  assert fm.default_tiles(16, 768, 2048).row_tiles == 1  # dense: 32 blocks for 132 SMs already
  # One token (8 rows, 8 experts with rows, one pass each): 2 units per block keeps 96 blocks in one round
  # (1 unit: 192 blocks, two rounds); one lane.
  assert fm.default_grouped_tiles(8, 128, 768, 2048) == T(16, 384, 2, tiles_per_block=2)
  assert fm.default_grouped_tiles(8, 128, 2048, 1536) == T(16, 512, 4, tiles_per_block=2, compute_wgs=2)
  assert fm.default_grouped_tiles(1, 128, 2048, 1536).tiles_per_block == 1  # 24 blocks: one unit each
  # two passes need more rows than block_m (a group spans start % 8 + size <= M rows from an 8-row boundary)
  assert fm.default_grouped_tiles(16, 128, 2048, 1536).pass_lanes == 1
  assert fm.default_grouped_tiles(17, 128, 2048, 1536).pass_lanes == 2
  # prefill-like: 32 rows per expert take two x tiles of 32 mostly: both lanes stream, a round each
  assert fm.default_grouped_tiles(4096, 128, 2048, 1536) == T(32, 256, 4, 1, 12, 2, pass_lanes=2)


def test_default_grouped_tiles_read_x_tiles_of_32_rows_once_per_128_weight_rows():
  """Where a step's x tile has more bytes than a 64-row tile's weights (block_m 32: 1.78x), two 64-row tiles per
  step share it (x's L2 reads halved for the same weights per step), if K and N allow and the blocks do not
  change (the block model ties). Not at block_m 16 (0.89x), where an H200 timed two tiles no faster (run e)."""
  for m, k, n in [(256 * 8, 2048, 1536), (4096, 2048, 1536), (256 * 8, 1024, 512)]:
    assert fm.default_grouped_tiles(m, 128, k, n).row_tiles == 2
  for m, k, n in [(64 * 8, 2048, 1536), (8, 2048, 1536), (1, 2048, 1536), (256 * 8, 640, 1536), (256 * 8, 2048, 1472)]:
    assert fm.default_grouped_tiles(m, 128, k, n).row_tiles == 1  # block_m 16; K or N does not divide
  # fewer blocks than SMs (6 experts with rows): two tiles per step would halve them
  assert fm.default_grouped_tiles(40, 6, 2048, 1536).row_tiles == 1
  # the other step shape, the same 64-row tiles per block: the earlier default (as timed on an H200) and back
  T, one = fm.MosaicTiles, fm.default_grouped_tiles(64 * 8, 128, 2048, 1536)
  two = fm.with_row_tiles(one, 2, 2048)
  assert two == T(16, 256, 4, 1, 12, 2, compute_wgs=2, pass_lanes=2) and fm.with_row_tiles(two, 1, 2048) == one
  assert fm.with_row_tiles(fm.default_grouped_tiles(256 * 8, 128, 2048, 1536), 1, 2048) == T(
    32, 512, 4, 1, 24, pass_lanes=2
  )
  for bad in [(one, 1, 768), (one, 1, 512), (one, 3, 2048), (dataclasses.replace(one, tiles_per_block=3), 2, 2048)]:
    with pytest.raises(ValueError, match="with_row_tiles"):  # 512 does not divide 768; one step; 3 tiles in pairs
      fm.with_row_tiles(*bad)


@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_blocks_run_each_pass_of_each_expert_once(lanes):
  """What the grouped kernel's blocks stream (`block_work`, its prologue's arithmetic): every x tile an
  expert's rows touch (`passes`) once, from the right start, over `lanes` pass lanes; and `block_may_work`
  (MosaicTiles.early_exit) ends none of the blocks that have work."""
  rng = np.random.default_rng(7)
  skipped = 0
  for block_m in (8, 16, 32):
    for _ in range(5):
      e = 9
      sizes = rng.integers(0, 3 * block_m, e) * (rng.random(e) < 0.7)
      starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
      seen = []
      for expert in range(e):
        for lane in range(lanes):
          start, size, count, pass_of = fm.block_work(
            lambda g, sizes=sizes: jnp.int32(sizes[g]), e, jnp.int32(expert), jnp.int32(lane), block_m, lanes
          )
          assert (int(start), int(size)) == (starts[expert], sizes[expert])
          seen += [(expert, int(pass_of(jnp.int32(q)))) for q in range(int(count))]
          # early_exit ends a block from its expert's rows alone: never one with a pass or the zero-fill to run
          may_work = bool(fm.block_may_work(jnp.int32(sizes[expert]), e, jnp.int32(expert), jnp.int32(lane), block_m))
          assert may_work or (int(count) == 0 and not (expert == e - 1 and lane == 0)), (sizes, expert, lane)
          skipped += int(not may_work)
      want = fm.passes(sizes, block_m)
      assert sorted(seen) == [(g, p) for g in range(e) for p in range(want[g])], (sizes, block_m)
  # and it does end blocks: experts without rows, and lanes past a group's passes
  assert skipped > 0


def test_every_e4m3_scale_byte():
  # All 256 bytes, as one weight's block scales: values, zero blocks, NaN, negative (folded into the codes).
  rng = np.random.default_rng(0)
  n, k = fm.ROWS, 4 * fm.SCALE_GROUP_K  # 64 rows x 32 blocks = 2048 scales: each byte 8 times
  codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
  scale_bytes = np.tile(np.arange(256), 8).reshape(n, k // 16)
  w = _weight(codes, scale_bytes)
  _assert_same(fm.decode_fragments_numpy(fm.pack_fragments(w)), _expected(w))
  _assert_unpacks(w)


def _assert_unpacks(w: fp4.QuantizedArray):
  """unpack_fragments(pack_fragments(w)): w's values; w's code and scale bytes wherever its scale is positive."""
  back = fm.unpack_fragments(fm.pack_fragments(w))
  _assert_same(np.asarray(fp4.dequantize(back), np.float64), np.asarray(fp4.dequantize(w), np.float64))
  positive = np.asarray(w.scales.astype(jnp.float32) > 0)
  np.testing.assert_array_equal(
    np.asarray(back.scales).view(np.uint8)[positive], np.asarray(w.scales).view(np.uint8)[positive]
  )
  blocks = lambda q: np.asarray(fp4.to_blocks(fp4.unpack_nibbles(q.codes), q.fmt))
  np.testing.assert_array_equal(blocks(back)[positive], blocks(w)[positive])


def test_ue5m3_is_the_scale_times_2_119():
  # Every E4M3 byte: |scale| * 2^119 as bf16 0x7000 | u << 4 (NaN stays NaN), with its sign and zero flags.
  byte = np.arange(256, dtype=np.uint8)
  e4m3 = jnp.asarray(byte.view(jnp.float8_e4m3fn))
  u, negative, zero = (np.asarray(a) for a in fm.ue5m3_from_e4m3(e4m3))
  values = ((fm.SCALE_BIAS_BITS | u << 4).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
  scale = np.asarray(e4m3.astype(jnp.float32), np.float64)
  finite = ~np.isnan(scale) & (scale != 0)
  np.testing.assert_array_equal(values[finite], np.abs(scale[finite]) * 2.0**fm.SCALE_EXPONENT)
  np.testing.assert_array_equal(np.isnan(values), np.isnan(scale))
  np.testing.assert_array_equal(negative, scale < 0)
  np.testing.assert_array_equal(zero, (byte & 0x7F) == 0)


@settings(max_examples=25, deadline=None)
@given(
  st.integers(0, 2**32 - 1),
  st.sampled_from([(64, 128), (128, 256), (64, 384)]),
  st.floats(-14.0, 8.0),
)
def test_packed_weights_decode_to_dequantize(seed, shape, log2_range):
  # Random weights over a random range (down to subnormal E4M3 scales), a zero block, a negative scale.
  rng = np.random.default_rng(seed)
  n, k = shape
  x = rng.standard_normal((n, k)).astype(np.float32) * np.float32(2.0**log2_range)
  x *= np.exp2(rng.uniform(-6, 0, (n, 1))).astype(np.float32)
  x[rng.integers(n), :16] = 0
  q = fp4.quantize(jnp.asarray(x), "nvfp4")
  scale_bytes = np.asarray(q.scales).view(np.uint8).copy()
  scale_bytes[rng.integers(n), rng.integers(k // 16)] |= 0x80
  w = _weight(np.asarray(fp4.unpack_nibbles(q.codes)), scale_bytes)
  _assert_same(fm.decode_fragments_numpy(fm.pack_fragments(w)), _expected(w))
  _assert_unpacks(w)


def test_tensor_scale_is_carried():
  w = fp4.quantize(jnp.ones((64, 128)), "nvfp4", tensor_amax=jnp.float32(3.0))
  packed = fm.pack_fragments(w)
  assert packed.tensor_scale.shape == () and packed.shape == (64, 128)
  assert packed.nbytes == 64 * 128 * 9 // 16  # 4.5 bits per weight, as the QuantizedArray


@pytest.mark.parametrize(
  "make, match",
  [
    (lambda: fp4.quantize(jnp.ones((64, 128)), "mxfp4"), "NVFP4"),
    (lambda: fp4.quantize(jnp.ones((48, 128)), "nvfp4"), "multiple of 64"),
    (lambda: fp4.quantize(jnp.ones((64, 96)), "nvfp4"), "K of 128"),
    (lambda: fp4.quantize(jnp.ones((2, 2, 64, 128)), "nvfp4"), "or experts"),
    (lambda: fp4.quantize(jnp.ones((64, 128)), "nvfp4", tensor_amax=jnp.ones((64,))), "per-row tensor scale"),
  ],
)
def test_pack_fragments_rejects(make, match):
  with pytest.raises(ValueError, match=match):
    fm.pack_fragments(make())


def test_kernel_rejects_bad_calls():
  w = fm.pack_fragments(fp4.quantize(jnp.ones((64, 128)), "nvfp4"))
  with pytest.raises(ValueError, match="does not match"):
    fm.fp4_matmul_mosaic(jnp.ones((1, 256), jnp.bfloat16), w)
  with pytest.raises(NotImplementedError, match="M = 65"):
    fm.fp4_matmul_mosaic(jnp.ones((65, 128), jnp.bfloat16), w)


# --- on a GPU -----------------------------------------------------------------------------------


@pytest.mark.skipif(not ON_GPU, reason="Mosaic GPU kernels need an sm_90 GPU (the layout is tested above)")
@pytest.mark.parametrize("m", [1, 8, 12, 16, 64])
@pytest.mark.parametrize("tensor_amax", [None, 3.0])
def test_kernel_matches_reference(m, tensor_amax):
  rng = np.random.default_rng(m)
  n, k = 256, 1024
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  amax = None if tensor_amax is None else jnp.float32(tensor_amax)
  w = fp4.quantize(jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32), "nvfp4", tensor_amax=amax)
  want = dense.fp4_matmul_reference(x, w, out_dtype=jnp.float32)
  bm = 16 if m <= 16 else 64
  # overlap: a step's first decode runs while the previous step's last MMAs do (in two parts or more);
  # compute_wgs: two warpgroups, each half of every step's K, their sums added at the end
  for tiles in (
    None,  # two compute warpgroups at block_k 512 (default_tiles)
    fm.MosaicTiles(bm, 512, 2),  # one
    fm.MosaicTiles(bm, 256, 4, parts=2, overlap=True),
    fm.MosaicTiles(bm, 512, 4, compute_wgs=2, parts=2, overlap=True),  # (in one part: wrong sums, now refused)
    *([fm.MosaicTiles(8, 256, 3, compute_wgs=2), fm.MosaicTiles(8, 512, 1)] if m <= 8 else []),  # wgmma N = 8
    fm.MosaicTiles(bm, 256, 3, compute_wgs=2),  # slots that do not divide the 4 steps (one item per block)
    fm.MosaicTiles(bm, 512, 2, parts=4),  # a step in 4 wgmma groups, each part's decode overlapping the last one's MMAs
    fm.MosaicTiles(bm, 1024, 1, compute_wgs=2, parts=2),
  ):
    got = fm.fp4_matmul_mosaic(x, fm.pack_fragments(w), tiles=tiles, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=str(tiles))


@pytest.mark.skipif(not ON_GPU, reason="Mosaic GPU kernels need an sm_90 GPU (the layout is tested above)")
@pytest.mark.parametrize("m", [1, 8])
def test_kernel_many_slots(m):
  # mosaic_variants' candidates for more weight bytes in flight: one item per block, so the slots need
  # not divide K's steps (K = 4096: 8 steps of 512, 16 of 256); x tiles of 16 or 8 rows. And overlap in two
  # parts as mosaic_variants times it, its MMAs carried across 7 step boundaries with every slot reused.
  rng = np.random.default_rng(m)
  n, k = 128, 4096
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = fp4.quantize(jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32), "nvfp4")
  want = dense.fp4_matmul_reference(x, w, out_dtype=jnp.float32)
  for tiles in (
    fm.MosaicTiles(16, 512, 5, compute_wgs=2),
    fm.MosaicTiles(8, 512, 7, compute_wgs=2),
    fm.MosaicTiles(8, 256, 14, compute_wgs=2),
    fm.MosaicTiles(16, 512, 4, compute_wgs=2, parts=2, overlap=True),
  ):
    got = fm.fp4_matmul_mosaic(x, fm.pack_fragments(w), tiles=tiles, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=str(tiles))


@pytest.mark.skipif(not ON_GPU, reason="Mosaic GPU kernels need an sm_90 GPU (the layout is tested above)")
def test_kernel_every_scale_byte_and_bf16_output():
  # Tiny (subnormal) E4M3 scales, zero blocks, NaN blocks, negative scales: the products are exact
  # bf16 values whatever the scale, so an f32 matmul of them matches the reference closely.
  rng = np.random.default_rng(1)
  n, k = fm.ROWS, 4 * fm.SCALE_GROUP_K
  codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
  w = _weight(codes, np.tile(np.arange(256), 8).reshape(n, k // 16))
  x = jnp.asarray(rng.standard_normal((16, k)), jnp.bfloat16)
  got = np.asarray(fm.fp4_matmul_mosaic(x, fm.pack_fragments(w), out_dtype=jnp.float32))
  want = np.asarray(dense.fp4_matmul_reference(x, w, out_dtype=jnp.float32))
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  ok = ~np.isnan(want)
  np.testing.assert_allclose(got[ok], want[ok], rtol=1e-4, atol=1e-30)
  bf16 = fm.fp4_matmul_mosaic(x, fm.pack_fragments(w))
  assert bf16.dtype == jnp.bfloat16


def test_stacked_experts_pack_one_by_one():
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((3, 64, 128)), jnp.float32)
  w = fp4.quantize(x, "nvfp4", tensor_amax=jnp.max(jnp.abs(x), axis=(1, 2), keepdims=True))
  packed = fm.pack_fragments(w)
  assert packed.shape == (3, 64, 128) and packed.tensor_scale.shape == (3,)
  for e in range(3):
    one = fm.pack_fragments(fp4.QuantizedArray(w.codes[e], w.scales[e], w.tensor_scale[e], w.fmt))
    np.testing.assert_array_equal(np.asarray(packed.words[e]), np.asarray(one.words))
    assert float(packed.tensor_scale[e]) == float(one.tensor_scale)
  back = fm.unpack_fragments(packed)
  np.testing.assert_array_equal(np.asarray(fp4.dequantize(back)), np.asarray(fp4.dequantize(w)))


def _experts(rng, e, n, k, per_expert_scale):
  x = jnp.asarray(rng.standard_normal((e, n, k)) * 0.05, jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=(1, 2), keepdims=True) if per_expert_scale else None
  return fp4.quantize(x, "nvfp4", tensor_amax=amax)


def test_grouped_reference_is_one_matmul_per_group():
  # The GPU tests hold the kernel to the Triton kernels' references: the grouped one is a matmul per
  # group, with zeros past the groups (what the kernel writes there).
  rng = np.random.default_rng(4)
  w = _experts(rng, 3, 64, 128, True)
  sizes = np.array([2, 0, 3])
  x = jnp.asarray(rng.standard_normal((6, 128)), jnp.bfloat16)  # the last row belongs to no group
  got = np.asarray(grouped.grouped_fp4_matmul_reference(x, jnp.asarray(sizes), w, out_dtype=jnp.float32))
  one = lambda e, rows: dense.fp4_matmul_reference(
    x[rows], fp4.QuantizedArray(w.codes[e], w.scales[e], w.tensor_scale[e], w.fmt), out_dtype=jnp.float32
  )
  np.testing.assert_allclose(got[:2], np.asarray(one(0, slice(0, 2))), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got[2:5], np.asarray(one(2, slice(2, 5))), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[5], 0)


def test_warpgroup_registers_fit_the_launch_pool():
  # setmaxnreg only moves registers within the block's pool: asking for more hangs the block on a GPU.
  assert all(fm._registers_fit(wgs) for wgs in fm.MEMORY_REGISTERS)
  saved = fm.MEMORY_REGISTERS[2]
  try:
    fm.MEMORY_REGISTERS[2] = 64  # 64 + 2 x 224 > 3 x 168: the hang this guards against
    assert not fm._registers_fit(2)
  finally:
    fm.MEMORY_REGISTERS[2] = saved


def test_grouped_kernel_rejects_bad_calls():
  w = fm.pack_fragments(_experts(np.random.default_rng(0), 2, 64, 128, False))
  x = jnp.ones((4, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="do not match"):
    fm.grouped_fp4_matmul_mosaic(x, jnp.array([4, 0, 0]), w)
  with pytest.raises(ValueError, match="stacked experts"):
    fm.grouped_fp4_matmul_mosaic(x, jnp.array([4]), fm.pack_fragments(fp4.quantize(jnp.ones((64, 128)), "nvfp4")))
  with pytest.raises(ValueError, match="tiles_per_block x tiles.row_tiles = 2 x 1 x 1 does not divide N / 64 = 1"):
    fm.grouped_fp4_matmul_mosaic(x, jnp.array([4, 0]), w, tiles=fm.MosaicTiles(16, 128, 1, cluster=2))
  with pytest.raises(ValueError, match="= 1 x 1 x 2 does not divide N / 64 = 1"):
    fm.grouped_fp4_matmul_mosaic(x, jnp.array([4, 0]), w, tiles=fm.MosaicTiles(16, 128, 1, row_tiles=2))
  with pytest.raises(ValueError, match="overlap needs one item per block"):  # 24 rows: two passes
    fm.grouped_fp4_matmul_mosaic(
      jnp.ones((24, 128), jnp.bfloat16), jnp.array([24, 0]), w, tiles=fm.MosaicTiles(16, 128, 1, overlap=True)
    )
  with pytest.raises(ValueError, match="ping_pong = 'issued' needs compute_wgs = 2"):
    fm.grouped_fp4_matmul_mosaic(x, jnp.array([4, 0]), w, tiles=fm.MosaicTiles(16, 128, 1, ping_pong="issued"))
  with pytest.raises(ValueError, match="ping_pong = 'yes': use 'issued', 'done' or ''"):
    fm.grouped_fp4_matmul_mosaic(x, jnp.array([4, 0]), w, tiles=fm.MosaicTiles(16, 256, 1, ping_pong="yes"))
  with pytest.raises(ValueError, match="pass_lanes = 0 must be 1 or more"):
    fm.grouped_fp4_matmul_mosaic(x, jnp.array([4, 0]), w, tiles=fm.MosaicTiles(16, 128, 1, pass_lanes=0))
  with pytest.raises(ValueError, match="block_m = 12 must be a multiple of 8 from 8 to 64"):
    fm.grouped_fp4_matmul_mosaic(x, jnp.array([4, 0]), w, tiles=fm.MosaicTiles(12, 128, 1))
  w2 = fm.pack_fragments(_experts(np.random.default_rng(0), 2, 64, 256, False))
  with pytest.raises(ValueError, match="must divide the 2 steps of K when a block chains items"):  # 24 rows: 2 items
    fm.grouped_fp4_matmul_mosaic(
      jnp.ones((24, 256), jnp.bfloat16), jnp.array([24, 0]), w2, tiles=fm.MosaicTiles(16, 128, 3)
    )
  with pytest.raises(ValueError, match="overlap with parts = 1: overlap needs parts >= 2"):
    fm.grouped_fp4_matmul_mosaic(
      jnp.ones((4, 256), jnp.bfloat16), jnp.array([4, 0]), w2, tiles=fm.MosaicTiles(16, 256, 1, overlap=True)
    )
  with pytest.raises(
    ValueError, match="compute_wgs = 2 must be 1 or 2, each taking a multiple of 128 of the block_k = 128"
  ):
    fm.grouped_fp4_matmul_mosaic(x, jnp.array([4, 0]), w, tiles=fm.MosaicTiles(16, 128, 1, compute_wgs=2))
  with pytest.raises(ValueError, match="parts = 2 must split a warpgroup's 128 of K per step into multiples of 128"):
    fm.grouped_fp4_matmul_mosaic(x, jnp.array([4, 0]), w, tiles=fm.MosaicTiles(16, 128, 1, parts=2))
  with pytest.raises(ValueError, match="compute_wgs = 3 must be 1 or 2"):
    fm.grouped_fp4_matmul_mosaic(x, jnp.array([4, 0]), w, tiles=fm.MosaicTiles(16, 128, 1, compute_wgs=3))


@pytest.mark.skipif(not ON_GPU, reason="Mosaic GPU kernels need an sm_90 GPU (the layout is tested above)")
@pytest.mark.parametrize("per_expert_scale", [False, True])
def test_grouped_kernel_matches_reference(per_expert_scale):
  # Empty groups, a group longer than block_m (two passes), rows past the groups (zeros).
  rng = np.random.default_rng(5)
  e, n, k = 6, 128, 512
  w = _experts(rng, e, n, k, per_expert_scale)
  sizes = jnp.asarray([3, 0, 40, 1, 0, 7], jnp.int32)
  x = jnp.asarray(rng.standard_normal((56, k)), jnp.bfloat16)
  want = grouped.grouped_fp4_matmul_reference(x, sizes, w, out_dtype=jnp.float32)
  packed = fm.pack_fragments(w)
  # the defaults (one tile per block), x multicast to a cluster of 2, 2 chained tiles per block, both
  # 64-row tiles in each step (one x tile for two weight tiles), and passes shared by 2 or 3 lanes
  for tiles in (
    None,
    fm.MosaicTiles(16, 256, 2, cluster=2),
    fm.MosaicTiles(16, 256, 2, tiles_per_block=2),
    fm.MosaicTiles(32, 128, 4),
    fm.MosaicTiles(16, 256, 2, row_tiles=2),
    fm.MosaicTiles(16, 256, 2, tiles_per_block=2, compute_wgs=2),  # chained: the sums meet once per item
    fm.MosaicTiles(16, 256, 2, row_tiles=2, compute_wgs=2),
    fm.MosaicTiles(16, 256, 2, tiles_per_block=2, parts=2),
    fm.MosaicTiles(16, 512, 1, row_tiles=2, compute_wgs=2, parts=2),
    fm.MosaicTiles(16, 256, 2, tiles_per_block=2, pass_lanes=2),  # the 40-row group's 3 passes in 2 lanes
    fm.MosaicTiles(16, 256, 2, compute_wgs=2, pass_lanes=3, cluster=2),
    fm.MosaicTiles(16, 256, 2, tiles_per_block=2, pass_lanes=2, early_exit=True),  # empty blocks end at once
    fm.MosaicTiles(16, 256, 2, compute_wgs=2, pass_lanes=3, cluster=2, early_exit=True),
  ):
    got = fm.grouped_fp4_matmul_mosaic(x, sizes, packed, tiles=tiles, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=str(tiles))
    assert np.all(np.asarray(got)[51:] == 0)
  # early_exit where the last expert has no rows: its lane 0 still zero-fills the rows past the groups
  sizes = jnp.asarray([3, 0, 40, 1, 7, 0], jnp.int32)
  want = grouped.grouped_fp4_matmul_reference(x, sizes, w, out_dtype=jnp.float32)
  tiles = fm.MosaicTiles(16, 256, 2, pass_lanes=2, early_exit=True)
  got = fm.grouped_fp4_matmul_mosaic(x, sizes, packed, tiles=tiles, out_dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=str(tiles))
  assert np.all(np.asarray(got)[51:] == 0)


@pytest.mark.skipif(not ON_GPU, reason="Mosaic GPU kernels need an sm_90 GPU (the layout is tested above)")
def test_ping_pong_matches_reference():
  """MosaicTiles.ping_pong (the two compute warpgroups take turns at the MMAs, by named barriers), dense and
  grouped (chained items, two row tiles, pass lanes). A test of its own: a turn that never comes is a hang,
  which pytest-timeout ends here without taking the other kernel tests with it."""
  rng = np.random.default_rng(11)
  n, k = 256, 1024
  x = jnp.asarray(rng.standard_normal((8, k)), jnp.bfloat16)
  w = fp4.quantize(jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32), "nvfp4", tensor_amax=jnp.float32(3))
  want = dense.fp4_matmul_reference(x, w, out_dtype=jnp.float32)
  for tiles in (
    fm.MosaicTiles(16, 512, 2, compute_wgs=2, ping_pong="issued"),
    fm.MosaicTiles(16, 256, 3, compute_wgs=2, ping_pong="done"),
  ):
    got = fm.fp4_matmul_mosaic(x, fm.pack_fragments(w), tiles=tiles, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=str(tiles))
  e, n, k = 6, 128, 512
  w = _experts(rng, e, n, k, True)
  sizes = jnp.asarray([3, 0, 40, 1, 0, 7], jnp.int32)
  x = jnp.asarray(rng.standard_normal((56, k)), jnp.bfloat16)
  want = grouped.grouped_fp4_matmul_reference(x, sizes, w, out_dtype=jnp.float32)
  for tiles in (
    fm.MosaicTiles(16, 256, 2, tiles_per_block=2, compute_wgs=2, pass_lanes=2, ping_pong="issued"),  # chained items
    fm.MosaicTiles(16, 256, 2, row_tiles=2, compute_wgs=2, ping_pong="done"),
  ):
    got = fm.grouped_fp4_matmul_mosaic(x, sizes, fm.pack_fragments(w), tiles=tiles, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=str(tiles))
    assert np.all(np.asarray(got)[51:] == 0)


@pytest.mark.skipif(not ON_GPU, reason="Mosaic GPU kernels need an sm_90 GPU (the layout is tested above)")
def test_grouped_kernel_four_row_tiles_per_step():
  """Four 64-row tiles per step (one x tile for 256 weight rows: twice the weight bytes in flight per SM of
  the defaults, in the same shared memory), chained two units per block, with one and two warpgroups."""
  _five_experts_match_reference(
    6,
    768,
    (
      fm.MosaicTiles(16, 256, 3, tiles_per_block=2, row_tiles=4, compute_wgs=2),
      fm.MosaicTiles(16, 128, 6, tiles_per_block=2, row_tiles=4),
      fm.MosaicTiles(16, 256, 3, row_tiles=4, compute_wgs=2),
    ),
  )


def _five_experts_match_reference(seed, k, tilings):
  """The grouped kernel at each of `tilings` against the reference: 5 experts of [512, k] (one without rows), 36
  rows in groups of 9, 0, 20, 3 and 4, then 4 rows past the groups (zeros)."""
  rng = np.random.default_rng(seed)
  w = _experts(rng, 5, 512, k, True)
  sizes = jnp.asarray([9, 0, 20, 3, 4], jnp.int32)
  x = jnp.asarray(rng.standard_normal((40, k)), jnp.bfloat16)
  want = grouped.grouped_fp4_matmul_reference(x, sizes, w, out_dtype=jnp.float32)
  packed = fm.pack_fragments(w)
  for tiles in tilings:
    got = fm.grouped_fp4_matmul_mosaic(x, sizes, packed, tiles=tiles, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=str(tiles))
    assert np.all(np.asarray(got)[36:] == 0)


@pytest.mark.skipif(not ON_GPU, reason="Mosaic GPU kernels need an sm_90 GPU (the layout is tested above)")
def test_grouped_kernel_two_row_tiles_chained():
  """Two 64-row tiles per 256-wide step (the grouped default at block_m 32, and down's at 16), every row unit of an
  expert chained in one block, two pass lanes; two warpgroups at block_m 16, one at 32."""
  _five_experts_match_reference(7, 1024, TWO_ROW_TILES_CHAINED)


TWO_ROW_TILES_CHAINED = (
  fm.MosaicTiles(16, 256, 4, tiles_per_block=4, row_tiles=2, compute_wgs=2, pass_lanes=2),
  fm.MosaicTiles(32, 256, 4, tiles_per_block=4, row_tiles=2, pass_lanes=2),
)


def test_two_row_tiles_chained_tiles_are_valid():
  """What test_grouped_kernel_two_row_tiles_chained runs on a GPU passes the kernel's checks of its tiles (traced
  here, not run); a unit count that does not divide the row tiles, or a block_k that does not divide K, does not."""
  rng = np.random.default_rng(7)
  packed = jax.eval_shape(fm.pack_fragments, _experts(rng, 5, 512, 1024, True))
  x = jax.ShapeDtypeStruct((40, 1024), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((5,), jnp.int32)
  for tiles in TWO_ROW_TILES_CHAINED:
    out = jax.eval_shape(functools.partial(fm.grouped_fp4_matmul_mosaic, tiles=tiles), x, sizes, packed)
    assert out.shape == (40, 512)
  with pytest.raises(ValueError, match="does not divide N / 64 = 8"):  # 3 units of 2 tiles in 8 tiles
    bad = dataclasses.replace(TWO_ROW_TILES_CHAINED[0], tiles_per_block=3)
    jax.eval_shape(functools.partial(fm.grouped_fp4_matmul_mosaic, tiles=bad), x, sizes, packed)
  with pytest.raises(ValueError, match="block_k = 384 does not divide K = 1024"):  # its steps would leave 256 out
    bad = fm.MosaicTiles(16, 384, 1)
    jax.eval_shape(functools.partial(fm.grouped_fp4_matmul_mosaic, tiles=bad), x, sizes, packed)
