"""Bit parity of trace_jax.fp4 with independent references: ml_dtypes (E2M1) and torchao (NVFP4, MXFP4)."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.kernels import pack_uint4
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, nvfp4_quantize, per_tensor_amax_to_scale

from trace_jax import fp4

TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
BLOCK = {"nvfp4": 16, "mxfp4": 32, "mxfp4_rceil": 32}
DTYPES = {"float32": (jnp.float32, torch.float32), "bfloat16": (jnp.bfloat16, torch.bfloat16)}
# JAX's CPU backend flushes float32 subnormals (inputs and results) to zero; torch does not.
FLUSHES_SUBNORMALS = float(jax.jit(lambda a: a * 2)(jnp.float32(1e-41))) == 0.0


def ml_e2m1(x) -> np.ndarray:
  return np.asarray(x, np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)


def u8(a) -> np.ndarray:
  """Bit pattern of a JAX or torch array of 8-bit values."""
  if isinstance(a, torch.Tensor):
    return a.contiguous().view(torch.uint8).numpy()
  return np.asarray(a).view(np.uint8)


@functools.partial(jax.jit, static_argnums=1)
def _quantize(x, fmt, tensor_amax=None):
  return fp4.quantize(x, fmt, tensor_amax=tensor_amax)


_dequantize = jax.jit(fp4.dequantize)


def ours(x: np.ndarray, fmt: str, dtype: str, two_level: bool = False):
  xj = jnp.asarray(x, DTYPES[dtype][0])
  amax = jnp.max(jnp.abs(xj.astype(jnp.float32))) if two_level else None
  return _quantize(xj, fmt, amax)


def torchao_ref(x: np.ndarray, fmt: str, dtype: str, two_level: bool = False):
  """(scales uint8, packed codes uint8, dequantized float32) from torchao."""
  xt = torch.from_numpy(np.asarray(x, np.float32)).to(DTYPES[dtype][1])
  if fmt == "nvfp4":
    pts = per_tensor_amax_to_scale(xt.float().abs().max()) if two_level else None
    scales, codes = nvfp4_quantize(xt, 16, per_tensor_scale=pts)
    deq = NVFP4Tensor.to_nvfp4(xt, 16, per_tensor_scale=pts).dequantize(torch.float32)
  else:
    assert not two_level
    mode = ScaleCalculationMode.FLOOR if fmt == "mxfp4" else ScaleCalculationMode.RCEIL
    scales, codes = to_mx(xt, torch.float4_e2m1fn_x2, 32, mode)
    deq = to_dtype(codes, scales, torch.float4_e2m1fn_x2, 32, torch.float32)
  return u8(scales).reshape(*x.shape[:-1], -1), u8(codes), deq.numpy().reshape(x.shape)


def ml_dequant(q: fp4.QuantizedArray) -> np.ndarray:
  """Independent decode: ml_dtypes E2M1 values times the float32 block scales."""
  codes = np.asarray(fp4.unpack_nibbles(q.codes)).astype(np.uint8)
  vals = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
  scales = np.asarray(q.scales).astype(np.float32)
  if q.tensor_scale is not None:
    ts = np.asarray(q.tensor_scale, np.float32)
    scales = (ts if ts.ndim == 0 else ts[..., None]) * scales
  b = q.fmt.block_size
  with np.errstate(over="ignore"):  # 6 * 2**126 is inf in float32, as in torchao
    return (vals.reshape(*vals.shape[:-1], -1, b) * scales[..., None]).reshape(vals.shape)


# --- inputs -------------------------------------------------------------------------------


def wide(rng, shape=(64, 256)):
  """Per-row magnitudes exp(U(-12, 12)): every scale regime, including NVFP4's clamps."""
  mag = np.exp(rng.uniform(-12, 12, (*shape[:-1], 1)))
  return (rng.standard_normal(shape) * mag).astype(np.float32)


def tie_rows(block: int) -> np.ndarray:
  """Blocks with amax 6*s holding every tie and grid point times s (after scaling: exact ties)."""
  vals = np.array([6.0, *TIES, *GRID, *(-t for t in TIES), *(-g for g in GRID[1:])], np.float32)
  row = np.resize(vals, block)
  row[0] = 6.0
  rows = []
  for s in (1.0, 2.0**-6, 0.5, 2.0, 8.0, 256.0, 2.0**-20, 2.0**20, 1.5, 0.875, 1.125 * 2**-3, 416.0):
    rows.append(row * np.float32(s))
    rows.append(-np.roll(row, 3) * np.float32(s))
  return np.stack(rows).astype(np.float32)


def special_rows(rng, block: int) -> np.ndarray:
  """All-zero, -0, mixed zero/normal, subnormal-only (1e-41) and subnormal+normal blocks."""
  x = rng.standard_normal((8, 4 * block)).astype(np.float32)
  x[0] = 0.0
  x[1] = -0.0
  x[2, :block] = 0.0
  x[3, block : 2 * block] = 1e-41 * np.sign(rng.standard_normal(block))
  x[4] = 1e-41
  x[5, ::2] = -1e-41
  x[6, :block] = rng.choice([0.0, -0.0, 1e-41, -1e-41], block)
  return x


def cases(fmt: str):
  rng = np.random.default_rng(0)
  block = BLOCK[fmt]
  return {
    "wide": wide(rng),
    "wide3d": wide(rng, (4, 8, 128)),
    "ties": tie_rows(block),
    "special": special_rows(rng, block),
    "inf": (
      np.where(rng.uniform(size=(4, 4 * block)) < 0.05, np.inf, 1.0) * rng.standard_normal((4, 4 * block))
    ).astype(np.float32),
  }


# --- E2M1 casts -----------------------------------------------------------------------------


def test_e2m1_cast_matches_ml_dtypes():
  """Dense sweep, exact ties and the float32 neighbours of every tie, specials."""
  ties = np.array(TIES + GRID, np.float32)
  near = np.concatenate([np.nextafter(ties, np.float32(-np.inf)), ties, np.nextafter(ties, np.float32(np.inf))])
  x = np.concatenate(
    [
      np.linspace(-8, 8, 160_001, dtype=np.float32),
      near,
      -near,
      [0.0, -0.0, np.inf, -np.inf, 6.0001, 7.0, 1e30, -1e30, 1e-41, -1e-41, np.nan],
    ]
  ).astype(np.float32)
  got = np.asarray(jax.jit(fp4.float_to_e2m1)(x))
  want = ml_e2m1(x)
  np.testing.assert_array_equal(got, want)
  assert want[-1] == 8  # NaN -> code 8


def test_e2m1_cast_matches_xla_convert_including_negative_nan():
  """XLA's own float4 convert agrees everywhere, and gives 8 for NaN of either sign (ml_dtypes: -NaN -> 0)."""
  nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], np.uint32).view(np.float32)
  x = np.concatenate([np.linspace(-8, 8, 16_001, dtype=np.float32), np.array(TIES, np.float32), nans])
  to_f4 = lambda v: jax.lax.bitcast_convert_type(v.astype(jnp.float4_e2m1fn)[:, None].repeat(2, axis=1), jnp.uint8)
  xla = np.asarray(jax.jit(to_f4)(x)) & 0xF
  np.testing.assert_array_equal(np.asarray(jax.jit(fp4.float_to_e2m1)(x)), xla)
  np.testing.assert_array_equal(xla[-4:], fp4.NAN_CODE)
  np.testing.assert_array_equal(ml_e2m1(nans), [8, 0, 8, 0])  # as the module docstring says


def test_e2m1_exact_ties_round_to_even():
  """Round half to even: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4 (and mirrored)."""
  t = np.array(TIES, np.float32)
  want_mag = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0], np.float32)
  got = np.asarray(jax.jit(lambda v: fp4.e2m1_to_float(fp4.float_to_e2m1(v)))(np.concatenate([t, -t])))
  np.testing.assert_array_equal(got, np.concatenate([want_mag, -want_mag]))


def test_e2m1_decode_and_mantissa_bit():
  codes = np.arange(16, dtype=np.uint8)
  np.testing.assert_array_equal(
    np.asarray(fp4.e2m1_to_float(jnp.asarray(codes))), codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
  )
  np.testing.assert_array_equal(fp4.E2M1_VALUES, codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32))
  # Along the magnitude ladder the mantissa bit alternates: adjacent grid points always differ in it.
  np.testing.assert_array_equal(np.asarray(fp4.mantissa_bit(jnp.asarray(codes))), codes % 2)


def test_neighbors_bracket_the_value():
  x = np.concatenate([np.linspace(-7, 7, 20_001, dtype=np.float32), np.array(GRID + TIES, np.float32)])
  sign, lo, hi = (np.asarray(a) for a in jax.jit(fp4.neighbors)(x))
  mags = np.array(GRID, np.float32)
  a = np.minimum(np.abs(x), 6)
  np.testing.assert_array_equal(mags[lo], [mags[mags <= v].max() for v in a])
  np.testing.assert_array_equal(mags[hi], [mags[mags >= v].min() for v in a])
  np.testing.assert_array_equal(sign, np.signbit(x))
  on_grid = np.isin(a, mags)
  assert np.all((lo == hi) == on_grid) and on_grid.sum() >= len(GRID)


@pytest.mark.parametrize(
  "fmt,two_level,dtype", [("nvfp4", False, "bfloat16"), ("nvfp4", True, "float32"), ("mxfp4", False, "bfloat16")]
)
def test_quantize_with_values_is_quantize_then_dequantize(fmt, two_level, dtype):
  """The engine's online quantization takes values from the unpacked codes: the same bits."""
  for name, x in cases(fmt).items():
    if two_level and name in ("special", "inf"):
      continue
    xj = jnp.asarray(x, DTYPES[dtype][0])
    amax = jnp.max(jnp.abs(xj.astype(jnp.float32))) if two_level else None
    q, values = fp4.quantize_with_values(xj, fmt, tensor_amax=amax, dtype=xj.dtype)
    ref = fp4.quantize(xj, fmt, tensor_amax=amax)
    np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(ref.codes), err_msg=name)
    np.testing.assert_array_equal(u8(q.scales), u8(ref.scales), err_msg=name)
    got = np.asarray(values.astype(jnp.float32))
    want = np.asarray(fp4.dequantize(ref, xj.dtype).astype(jnp.float32))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=name)


# --- NVFP4 / MXFP4 parity with torchao ---------------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("fmt,two_level", [("nvfp4", False), ("nvfp4", True), ("mxfp4", False), ("mxfp4_rceil", False)])
def test_quantize_matches_torchao(fmt, two_level, dtype):
  for name, x in cases(fmt).items():
    if two_level and name in ("special", "inf"):
      continue  # a zero or infinite tensor amax has no meaningful two-level scale
    q = ours(x, fmt, dtype, two_level)
    scales, codes, deq = torchao_ref(x, fmt, dtype, two_level)
    np.testing.assert_array_equal(u8(q.scales), scales, err_msg=f"{fmt} {name} scales")
    np.testing.assert_array_equal(np.asarray(q.codes), codes, err_msg=f"{fmt} {name} codes")
    ours_deq = np.asarray(_dequantize(q))
    np.testing.assert_array_equal(ours_deq, deq, err_msg=f"{fmt} {name} dequantize vs torchao")
    np.testing.assert_array_equal(ours_deq, ml_dequant(q), err_msg=f"{fmt} {name} dequantize vs ml_dtypes")
    assert q.codes.shape == (*x.shape[:-1], x.shape[-1] // 2)
    assert q.scales.shape == (*x.shape[:-1], x.shape[-1] // BLOCK[fmt])


def test_ties_after_scaling_are_exercised():
  """The tie inputs really land on ties after scaling by 1 (the parity test relies on them)."""
  for fmt in BLOCK:
    q = ours(tie_rows(BLOCK[fmt])[:2], fmt, "float32")
    assert np.all(np.asarray(q.scales).astype(np.float32) == 1.0)
    codes = np.asarray(fp4.unpack_nibbles(q.codes))
    row = tie_rows(BLOCK[fmt])[0]
    np.testing.assert_array_equal(codes[0], ml_e2m1(row))


def test_nvfp4_scale_divides_by_six():
  """amax just below 6 * 1.1875 (an E4M3 midpoint): amax / 6 rounds to scale 1.125, amax * fl(1/6) to 1.25.
  XLA rewrites x / 6 into the latter unless kept from it; torchao divides."""
  amax = np.nextafter(np.float32([7.125, 14.25, 3.5625]), np.float32(0))
  x = np.zeros((3, 16), np.float32)
  x[:, 7] = amax
  x[:, 3] = -1.0
  q = ours(x, "nvfp4", "float32")
  np.testing.assert_array_equal(np.asarray(q.scales).astype(np.float32)[:, 0], [1.125, 2.25, 0.5625])
  scales, codes, _ = torchao_ref(x, "nvfp4", "float32")
  np.testing.assert_array_equal(u8(q.scales), scales)
  np.testing.assert_array_equal(np.asarray(q.codes), codes)


def test_rceil_is_an_exact_ceiling():
  """RCEIL's scale is the smallest power of two >= amax/6, also just above powers of two."""
  rng = np.random.default_rng(1)
  k = rng.integers(-100, 100, 256)
  amax = np.float32(6.0) * np.ldexp(np.float32(1.0), k).astype(np.float32)
  amax = np.stack([amax, np.nextafter(amax, np.float32(np.inf)), amax * rng.uniform(1, 2, 256).astype(np.float32)])
  amax = amax.reshape(-1).astype(np.float32)
  x = np.zeros((amax.size, 32), np.float32)
  x[:, 5] = amax
  q = ours(x, "mxfp4_rceil", "float32")
  scale = np.asarray(q.scales).astype(np.float64)[:, 0]
  descale = (amax / np.float32(6.0)).astype(np.float64)
  assert np.all(scale >= descale) and np.all(scale / 2 < descale)


def test_flushed_subnormals_are_documented():
  """Where XLA flushes subnormals (CPU), a subnormal in an MXFP4 block of tiny amax quantizes as zero;
  torchao keeps it. Elsewhere the two agree. (The module docstring states this.)"""
  x = np.zeros((1, 32), np.float32)
  x[0, 0] = 1.5 * 2.0**-125  # normal amax; scale 2^-127
  x[0, 1] = 1.5 * 2.0**-127  # subnormal; torchao: 0.75 -> tie -> 1.0 (code 2)
  _, want, _ = torchao_ref(x, "mxfp4", "float32")
  got = np.asarray(ours(x, "mxfp4", "float32").codes)
  assert np.asarray(fp4.unpack_nibbles(want))[0, 1] == 2
  if FLUSHES_SUBNORMALS:
    assert np.asarray(fp4.unpack_nibbles(got))[0, 1] == 0
  else:
    np.testing.assert_array_equal(got, want)


# --- dequantization error ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(BLOCK))
def test_dequantize_error_is_at_most_half_a_grid_step(fmt):
  """|dequant - x| <= half the local grid step times the scale (plus the clip, beyond 6)."""
  rng = np.random.default_rng(2)
  x = (rng.standard_normal((64, 256)) * np.exp(rng.uniform(-5, 5, (64, 1)))).astype(np.float32)
  q = ours(x, fmt, "float32")
  err = np.abs(np.asarray(_dequantize(q), np.float64) - x)
  s = np.repeat(np.asarray(q.scales).astype(np.float64), BLOCK[fmt], axis=-1)
  scaled = np.abs(x) / s
  half_step = np.where(scaled < 2, 0.25, np.where(scaled < 4, 0.5, 1.0))
  bound = np.where(scaled <= 6, half_step * s, np.abs(x) - 6 * s) + 1e-6 * np.abs(x)
  assert np.all(err <= bound)
  assert np.mean(err > 0.9 * half_step * s) > 0.001  # the bound is nearly attained somewhere: not vacuous


# --- packing ----------------------------------------------------------------------------------


def test_pack_nibbles_layout_matches_xla_bitcast_and_torchao():
  """Even element in the low nibble: the byte XLA's float4 bitcast and torchao's pack_uint4 produce."""
  rng = np.random.default_rng(3)
  codes = rng.integers(0, 16, (3, 4, 64)).astype(np.uint8)
  packed = np.asarray(fp4.pack_nibbles(jnp.asarray(codes)))
  np.testing.assert_array_equal(packed, codes[..., 0::2] | (codes[..., 1::2] << 4))
  f4 = jnp.asarray(codes.view(ml_dtypes.float4_e2m1fn).reshape(3, 4, 32, 2))
  np.testing.assert_array_equal(packed, np.asarray(jax.lax.bitcast_convert_type(f4, jnp.uint8)))
  np.testing.assert_array_equal(packed, pack_uint4(torch.from_numpy(codes)).numpy())
  np.testing.assert_array_equal(np.asarray(fp4.unpack_nibbles(jnp.asarray(packed))), codes)
  # One byte by hand: codes (1.0 -> 2, -6.0 -> 15) pack to 0xF2.
  assert int(fp4.pack_nibbles(jnp.asarray(ml_e2m1([1.0, -6.0])))[0]) == 0xF2


def test_pack_bits_little_endian_roundtrip():
  rng = np.random.default_rng(4)
  bits = rng.integers(0, 2, (5, 128)).astype(np.uint8)
  packed = np.asarray(fp4.pack_bits(jnp.asarray(bits)))
  np.testing.assert_array_equal(packed, np.packbits(bits, axis=-1, bitorder="little"))
  np.testing.assert_array_equal(np.asarray(fp4.unpack_bits(jnp.asarray(packed))), bits)
  assert int(fp4.pack_bits(jnp.asarray([1, 0, 0, 0, 0, 0, 0, 1]))[0]) == 0x81


# --- errors -----------------------------------------------------------------------------------


def test_errors():
  with pytest.raises(ValueError, match=r"\(4, 24\).*nvfp4 block size 16"):
    fp4.quantize(jnp.zeros((4, 24)), "nvfp4")
  with pytest.raises(ValueError, match=r"\(2, 48\).*mxfp4 block size 32"):
    fp4.quantize(jnp.zeros((2, 48)), "mxfp4")
  with pytest.raises(ValueError, match=r"'nvfp8'.*\['mxfp4', 'mxfp4_rceil', 'nvfp4'\]"):
    fp4.quantize(jnp.zeros((2, 32)), "nvfp8")
  with pytest.raises(ValueError, match="NVFP4"):
    fp4.quantize(jnp.ones((2, 32)), "mxfp4", tensor_amax=jnp.float32(1.0))
  with pytest.raises(ValueError, match="scalar"):
    fp4.quantize(jnp.float32(1.0))
  with pytest.raises(ValueError, match=r"\(3, 7\)"):
    fp4.pack_nibbles(jnp.zeros((3, 7), jnp.uint8))
  with pytest.raises(ValueError, match=r"\(3, 12\)"):
    fp4.pack_bits(jnp.zeros((3, 12), jnp.uint8))


# --- non-finite inputs (module docstring) ----------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(BLOCK))
def test_nan_poisons_only_its_block(fmt):
  b = BLOCK[fmt]
  x = np.random.default_rng(5).standard_normal((2, 2 * b)).astype(np.float32)
  x[0, 3] = np.nan
  q = ours(x, fmt, "float32")
  scales = u8(q.scales)
  assert scales[0, 0] == (0x7F if fmt == "nvfp4" else 0xFF)
  assert np.asarray(fp4.unpack_nibbles(q.codes))[0, 3] == fp4.NAN_CODE
  deq = np.asarray(_dequantize(q))
  assert np.all(np.isnan(deq[0, :b])) and np.all(np.isfinite(deq[0, b:])) and np.all(np.isfinite(deq[1]))
  # The NaN block's scale (and every other block) as torchao gives it; other blocks' codes too.
  t_scales, t_codes, _ = torchao_ref(x, fmt, "float32")
  np.testing.assert_array_equal(scales, t_scales)
  np.testing.assert_array_equal(np.asarray(q.codes)[:, b // 2 :], t_codes[:, b // 2 :])
  np.testing.assert_array_equal(np.asarray(q.codes)[1], t_codes[1])


@pytest.mark.parametrize("fmt", sorted(BLOCK))
def test_inf_saturates(fmt):
  b = BLOCK[fmt]
  x = np.linspace(-1, 1, b, dtype=np.float32)[None].repeat(2, 0)
  x[0, 1], x[1, 2] = np.inf, -np.inf
  q = ours(x, fmt, "float32")
  want_scale = {"nvfp4": 448.0, "mxfp4": 2.0**126, "mxfp4_rceil": 2.0**127}[fmt]
  np.testing.assert_array_equal(np.asarray(q.scales).astype(np.float32), want_scale)
  codes = np.asarray(fp4.unpack_nibbles(q.codes))
  assert codes[0, 1] == 7 and codes[1, 2] == 15  # +/-6
  with np.errstate(over="ignore"):
    want = np.float32(6) * np.float32(want_scale)  # inf for MXFP4: 6 * 2**126 overflows float32, as in torchao
  np.testing.assert_array_equal(np.asarray(_dequantize(q))[[0, 1], [1, 2]], [want, -want])
  np.testing.assert_array_equal(np.asarray(q.codes), torchao_ref(x, fmt, "float32")[1])


def test_two_level_with_a_tensor_scale_per_row_quantizes_each_row_alone():
  """Rows quantized in different batches keep their own tensor scale (the engine's KV cache and
  recorded guidance): one amax per row gives, row by row, torchao's two-level codes, scales and values."""
  x = wide(np.random.default_rng(8), (6, 64))
  q = jax.jit(lambda v, a: fp4.quantize(v, "nvfp4", tensor_amax=a))(jnp.asarray(x), jnp.asarray(np.abs(x).max(-1)))
  assert q.tensor_scale.shape == (6,) and q.nbytes == 6 * 32 + 6 * 4 + 6 * 4
  deq = np.asarray(_dequantize(q))
  for r in range(6):
    scales, codes, want = torchao_ref(x[r : r + 1], "nvfp4", "float32", two_level=True)
    np.testing.assert_array_equal(u8(q.scales)[r : r + 1], scales, err_msg=f"row {r} scales")
    np.testing.assert_array_equal(np.asarray(q.codes)[r : r + 1], codes, err_msg=f"row {r} codes")
    np.testing.assert_array_equal(deq[r : r + 1], want, err_msg=f"row {r} dequantize")
  np.testing.assert_array_equal(deq, ml_dequant(q))


# --- jit and leading axes -----------------------------------------------------------------------


def test_eager_equals_jit():
  """Op-by-op dispatch and one fused program agree (XLA's rewrites differ between them), two-level NVFP4."""
  x = jnp.asarray(wide(np.random.default_rng(6), (4, 64)))
  amax = jnp.max(jnp.abs(x))
  eager = fp4.quantize(x, "nvfp4", tensor_amax=amax)
  jitted = _quantize(x, "nvfp4", amax)
  for a, b in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(jitted), strict=True):
    np.testing.assert_array_equal(np.asarray(a).reshape(-1).view(np.uint8), np.asarray(b).reshape(-1).view(np.uint8))


@pytest.mark.parametrize("fmt", sorted(BLOCK))
def test_jit_and_leading_axes(fmt):
  """Quantizing [a, b, K] equals quantizing each [K] row on its own; vmap over rows agrees too."""
  x = wide(np.random.default_rng(6), (3, 2, 64))
  jitted = _quantize(jnp.asarray(x), fmt)
  vmapped = jax.jit(jax.vmap(jax.vmap(lambda r: fp4.quantize(r[None], fmt))))(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(vmapped.codes)[:, :, 0], np.asarray(jitted.codes))
  np.testing.assert_array_equal(u8(vmapped.scales)[:, :, 0], u8(jitted.scales))
  row = _quantize(jnp.asarray(x[1, 1][None]), fmt)
  np.testing.assert_array_equal(np.asarray(jitted.codes)[1, 1], np.asarray(row.codes)[0])
  np.testing.assert_array_equal(u8(jitted.scales)[1, 1], u8(row.scales)[0])
  assert jitted.shape == x.shape
  np.testing.assert_array_equal(
    np.asarray(_dequantize(jitted))[1, 1], np.asarray(_dequantize(row))[0], err_msg="dequantize rows"
  )


def test_two_level_under_jit_with_traced_amax():
  x = wide(np.random.default_rng(7), (8, 64))
  f = jax.jit(lambda v, a: fp4.quantize(v, "nvfp4", tensor_amax=a))
  q = f(jnp.asarray(x), jnp.float32(np.abs(x).max()))
  scales, codes, _ = torchao_ref(x, "nvfp4", "float32", two_level=True)
  np.testing.assert_array_equal(u8(q.scales), scales)
  np.testing.assert_array_equal(np.asarray(q.codes), codes)
  assert q.nbytes == 8 * 32 + 8 * 4 + 4
