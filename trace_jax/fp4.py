"""FP4 numerics: E2M1 codes, NVFP4 / MXFP4 block quantization, nibble and bit packing.

Everything here is bit-exact against references (tests/test_fp4.py):
  * E2M1 casts match ml_dtypes.float4_e2m1fn and XLA's convert (round to nearest even,
    saturate at +/-6; NaN: see below);
  * NVFP4 codes and scales match torchao's `nvfp4_quantize`, single-level and two-level;
  * MXFP4 codes and scales match torchao's `to_mx` (FLOOR; RCEIL with an exact ceil, see below).

Layout. Blocks run along the last axis (the contraction axis), any number of leading axes.
Codes are packed two per uint8 with the *even* element in the low nibble (the layout of
ml_dtypes bitcasts, torchao's `pack_uint4` and public MXFP4 checkpoints). A code is
sign(1) exponent(2) mantissa(1); its magnitude index (code & 7) walks the ladder
0, 0.5, 1, 1.5, 2, 3, 4, 6, so the mantissa bit is `code & 1`.

Non-finite inputs. +/-inf in a block saturates the scale (NVFP4: 448; MXFP4: the largest
exponent torchao gives) and the inf element to +/-6. A NaN in a block makes that block's
scale NaN (E4M3 0x7f; E8M0 0xff), so the whole block dequantizes to NaN; the NaN element's
own code is 0x8 (-0), as XLA's convert to float4_e2m1fn gives for any NaN and ml_dtypes for a
positive one (ml_dtypes gives 0x0 for a negative NaN). torchao leaves those codes unspecified.

Subnormals. JAX's CPU backend flushes float32 subnormals to zero (inputs and results of
arithmetic); torch on CPU does not. So on CPU a subnormal input quantizes as a signed zero,
and MXFP4 blocks whose amax is below about 2**-122 (where subnormals, scaled by up to 2**126,
would reach a nonzero code, or RCEIL's amax / 6 is itself subnormal) and two-level NVFP4
tensors whose amax is below about 2**-114 (a subnormal tensor scale) can differ from torchao.
Single-level NVFP4 scales are at least 2**-6: subnormals give a signed zero there either way.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

# --- E2M1 ---------------------------------------------------------------------------------

E2M1_MAX = 6.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# code -> value for all 16 codes (index 8 is -0).
E2M1_VALUES = np.array(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), np.float32)

E4M3_MAX = 448.0
E4M3_TINY = 2.0**-6  # smallest normal E4M3 (torch.finfo(float8_e4m3fn).tiny)
F32_MIN_NORMAL = 2.0**-126
E8M0_BIAS = 127
NAN_CODE = 0x8  # what ml_dtypes gives for a NaN cast to E2M1 (-0)


def magnitude_value(index: jax.Array) -> jax.Array:
  """E2M1 magnitude for a magnitude index 0..7, by arithmetic (no table gather)."""
  i = index.astype(jnp.float32)
  return jnp.where(i < 4, i * 0.5, jnp.where(i < 7, i - 2.0, E2M1_MAX))


def floor_index(magnitude: jax.Array) -> jax.Array:
  """Index of the largest E2M1 magnitude <= `magnitude` (float32 in [0, 6]; NaN -> 7)."""
  a = magnitude
  idx = jnp.where(a < 2, jnp.floor(2 * a), jnp.where(a < 4, jnp.floor(a) + 2, jnp.where(a < 6, 6.0, 7.0)))
  return idx.astype(jnp.uint8)


def neighbors(scaled: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The two E2M1 grid points around `scaled` (float32, already divided by the block scale).

  Returns (sign, toward_zero, away_from_zero): the sign bit (uint8, 0 or 1) and the
  magnitude indices of the neighbour nearer to and farther from zero. They are equal when
  `scaled` lies on the grid or beyond +/-6 (saturation). Adjacent magnitude indices always
  differ in their low bit, the mantissa bit: that is what makes 1-bit guidance sufficient.
  """
  sign = jnp.signbit(scaled).astype(jnp.uint8)
  a = jnp.minimum(jnp.abs(scaled), E2M1_MAX)
  lo = floor_index(a)
  hi = lo + (a > magnitude_value(lo)).astype(jnp.uint8)
  return sign, lo, hi


def round_to_nearest_index(scaled: jax.Array, lo: jax.Array, hi: jax.Array) -> jax.Array:
  """Round-to-nearest-even choice between the neighbour indices `lo` <= `hi`."""
  a = jnp.minimum(jnp.abs(scaled), E2M1_MAX)
  # Midpoints of adjacent grid points are exact in float32, so this comparison is exact.
  mid = 0.5 * (magnitude_value(lo) + magnitude_value(hi))
  up = (a > mid) | ((a == mid) & ((hi & 1) == 0))
  return jnp.where(up, hi, lo)


def encode(sign: jax.Array, magnitude_index: jax.Array, scaled: jax.Array) -> jax.Array:
  """Assemble unpacked uint8 codes; NaN inputs give NAN_CODE as ml_dtypes does."""
  codes = (sign << 3) | magnitude_index
  return jnp.where(jnp.isnan(scaled), jnp.uint8(NAN_CODE), codes)


def float_to_e2m1(x: jax.Array) -> jax.Array:
  """Cast to unpacked E2M1 codes (uint8 0..15): nearest even, saturating, like ml_dtypes."""
  x = x.astype(jnp.float32)
  sign, lo, hi = neighbors(x)
  return encode(sign, round_to_nearest_index(x, lo, hi), x)


def e2m1_to_float(codes: jax.Array, dtype=jnp.float32) -> jax.Array:
  """Value of unpacked E2M1 codes."""
  codes = codes.astype(jnp.uint8)
  mag = magnitude_value(codes & 7)
  return jnp.where((codes >> 3) == 1, -mag, mag).astype(dtype)


def mantissa_bit(codes: jax.Array) -> jax.Array:
  """The mantissa bit (0/1, uint8) of unpacked codes."""
  return codes.astype(jnp.uint8) & 1


# --- packing ------------------------------------------------------------------------------


def _check_divisible(shape, n: int, what: str):
  if not shape or shape[-1] % n:
    raise ValueError(f"{what}: the last axis of shape {tuple(shape)} must be a multiple of {n}.")


def pack_nibbles(codes: jax.Array) -> jax.Array:
  """[..., K] codes 0..15 -> [..., K/2] uint8, element 2i in the low nibble."""
  _check_divisible(codes.shape, 2, "pack_nibbles")
  c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], -1, 2)
  return c[..., 0] | (c[..., 1] << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
  """[..., K/2] uint8 -> [..., K] codes, inverse of `pack_nibbles`."""
  p = packed.astype(jnp.uint8)
  return jnp.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)


def pack_bits(bits: jax.Array) -> jax.Array:
  """[..., K] bits 0/1 -> [..., K/8] uint8, element 8i+j in bit j (little-endian)."""
  _check_divisible(bits.shape, 8, "pack_bits")
  b = bits.astype(jnp.uint8).reshape(*bits.shape[:-1], -1, 8)
  return jnp.sum(b << jnp.arange(8, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)


def unpack_bits(packed: jax.Array) -> jax.Array:
  """[..., K/8] uint8 -> [..., K] bits, inverse of `pack_bits`."""
  p = packed.astype(jnp.uint8)[..., None]
  return ((p >> jnp.arange(8, dtype=jnp.uint8)) & 1).reshape(*packed.shape[:-1], -1)


# --- formats ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fp4Format:
  """A block-scaled FP4 format. Hashable, so it can be a static jit argument."""

  name: str
  block_size: int
  scale_dtype: type
  scale_rounding: Literal["floor", "rceil"] = "floor"  # MXFP4 only


NVFP4 = Fp4Format("nvfp4", 16, jnp.float8_e4m3fn)
MXFP4 = Fp4Format("mxfp4", 32, jnp.float8_e8m0fnu)
FORMATS = {"nvfp4": NVFP4, "mxfp4": MXFP4, "mxfp4_rceil": dataclasses.replace(MXFP4, scale_rounding="rceil")}


def get_format(fmt: str | Fp4Format) -> Fp4Format:
  """Resolve a format name ('nvfp4', 'mxfp4', 'mxfp4_rceil') or pass a Fp4Format through."""
  if isinstance(fmt, Fp4Format):
    return fmt
  try:
    return FORMATS[fmt]
  except (KeyError, TypeError):
    raise ValueError(f"Unknown FP4 format {fmt!r}: expected one of {sorted(FORMATS)}.") from None


def check_blocks(shape, fmt: Fp4Format, what: str = "input"):
  if not shape:
    raise ValueError(f"{what}: a scalar cannot be block-quantized; give an array whose last axis holds the blocks.")
  if shape[-1] % fmt.block_size:
    raise ValueError(
      f"{what}: the last axis of shape {tuple(shape)} is not a multiple of the {fmt.name} block size "
      f"{fmt.block_size}; pad it or choose a format whose block divides it."
    )


def _div(a, b) -> jax.Array:
  """`a / b` in float32, rounded as IEEE division (as torchao computes it).

  XLA's algebraic simplifier rewrites divisions by a constant or a broadcast scalar into
  multiplications by the reciprocal, `(a / b) / c` into `a / (b * c)` and `a / (b / c)` into
  `(a * c) / b`; each is off by an ulp for a good share of inputs (x / 6: one in three).
  Both operands, broadcast together (also under vmap), pass an optimization barrier first;
  XLA expands barriers only after those rewrites (the two-level torchao parity tests fail
  without it).
  """
  a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
  ab = jax.lax.optimization_barrier(jnp.stack([a, b]))
  return ab[0] / ab[1]


def e4m3_round(x: jax.Array) -> jax.Array:
  """FP8 E4M3 round trip of x [..., D] with one FP32 scale amax / 448 per row (the FP8 KV cache:
  a token's head), in x's dtype: E4M3(x / scale) * scale, computed in float32; an all-zero row stays 0."""
  xf = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
  scale = jnp.where(amax > 0, _div(amax, E4M3_MAX), 1.0)
  q = jnp.clip(_div(xf, scale), -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
  return (q.astype(jnp.float32) * scale).astype(x.dtype)


def tensor_scale_from_amax(amax: jax.Array) -> jax.Array:
  """Second-level NVFP4 scale `amax / (448 * 6)` (torchao's per_tensor_amax_to_scale)."""
  return _div(amax, E4M3_MAX * E2M1_MAX)


def _per_block(tensor_scale: jax.Array, block_scales: jax.Array) -> jax.Array:
  """The tensor scale against block scales [..., nblocks]: one per row [...] gets a trailing axis;
  a scalar, or one that already broadcasts (e.g. per expert [E, 1, 1]), is taken as it is."""
  return tensor_scale[..., None] if jnp.ndim(tensor_scale) == jnp.ndim(block_scales) - 1 else tensor_scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
  """Block-quantized FP4 array: packed codes + block scales (+ NVFP4 tensor scale)."""

  codes: jax.Array  # uint8 [..., K/2]
  scales: jax.Array  # scale_dtype [..., K/block_size]
  # Two-level NVFP4: float32, a scalar or one per row [...] (rows quantized in different batches,
  # such as a KV cache's slots); None: single-level.
  tensor_scale: jax.Array | None
  fmt: Fp4Format = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    return (*self.codes.shape[:-1], 2 * self.codes.shape[-1])

  @property
  def nbytes(self) -> int:
    n = self.codes.size + self.scales.size
    return n + (4 * self.tensor_scale.size if self.tensor_scale is not None else 0)


def _e4m3_reciprocal(scales_f32: jax.Array, tensor_scale: jax.Array | None) -> jax.Array:
  # torchao multiplies by the reciprocal (MSLK kernel numerics), in this exact order.
  if tensor_scale is None:
    return 1.0 / scales_f32
  return _div(_div(1.0, _per_block(tensor_scale, scales_f32)), scales_f32)


def _biased_exponent(x: jax.Array) -> jax.Array:
  """The 8-bit biased exponent field of float32 values (int32)."""
  return (jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32) >> 23) & 0xFF


def _pow2(biased: jax.Array) -> jax.Array:
  """2**(biased - 127) exactly, including the float32 denormal 2**-127 for biased == 0."""
  biased = biased.astype(jnp.int32)
  normal = jax.lax.bitcast_convert_type(biased << 23, jnp.float32)
  return jnp.where(biased == 0, np.float32(2.0**-127), normal)


def compute_scales(blocks: jax.Array, fmt: Fp4Format, tensor_scale: jax.Array | None = None):
  """Block scales of float32 `blocks` [..., nblocks, block_size].

  Returns (stored_scales [..., nblocks] in fmt.scale_dtype, reciprocal [..., nblocks] float32):
  the codes are `E2M1(clip(blocks * reciprocal, -6, 6))` (see `scale_blocks`).
  """
  amax = jnp.max(jnp.abs(blocks), axis=-1)
  if fmt.name == "nvfp4":
    block_scale = _div(amax, E2M1_MAX)
    if tensor_scale is not None:
      block_scale = _div(block_scale, _per_block(tensor_scale, block_scale))
    stored = jnp.clip(block_scale, E4M3_TINY, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return stored, _e4m3_reciprocal(stored.astype(jnp.float32), tensor_scale)
  if tensor_scale is not None:
    raise ValueError("tensor_amax (two-level scaling) is an NVFP4 option; MXFP4 scales are powers of two.")
  if fmt.scale_rounding == "floor":
    # OCP MX: 2^(floor(log2 amax) - emax(E2M1) = 2), read off the float32 exponent field.
    biased = jnp.clip(_biased_exponent(amax) - E8M0_BIAS - 2, -E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS
    biased = jnp.where(jnp.isnan(amax), 255, biased)
    reciprocal = 1.0 / jnp.maximum(_pow2(biased), F32_MIN_NORMAL)
  elif fmt.scale_rounding == "rceil":
    # ceil(log2(amax / 6)), computed exactly (what the hardware's cvt.rp.ue8m0 gives);
    # torchao's eager fallback takes ceil(log2()) in float32, which agrees except where
    # log2 rounds a value just above a power of two down onto it.
    descale = _div(amax, E2M1_MAX)
    e = jnp.clip(jnp.ceil(jnp.log2(descale)), -E8M0_BIAS, E8M0_BIAS)
    e = jnp.where(jnp.isfinite(e), e, -E8M0_BIAS).astype(jnp.int32)
    e = e - (jnp.ldexp(np.float32(1.0), e - 1) >= descale).astype(jnp.int32)
    e = e + (jnp.ldexp(np.float32(1.0), e) < descale).astype(jnp.int32)
    biased = jnp.clip(e, -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    biased = jnp.where(jnp.isinf(descale), 254, jnp.where(jnp.isnan(descale), 255, biased))
    reciprocal = jnp.where(biased == 0, 1.0, jnp.where(biased == 254, 2.0**-127, _pow2(254 - biased)))
    reciprocal = jnp.where(biased == 255, jnp.nan, reciprocal)
  else:
    raise ValueError(f"Unknown MXFP4 scale_rounding {fmt.scale_rounding!r}: expected 'floor' or 'rceil'.")
  stored = jax.lax.bitcast_convert_type(biased.astype(jnp.uint8), jnp.float8_e8m0fnu)
  return stored, reciprocal.astype(jnp.float32)


def reciprocal_from_scales(scales: jax.Array, fmt: Fp4Format, tensor_scale: jax.Array | None = None) -> jax.Array:
  """The float32 multiplier that `compute_scales` pairs with these stored scales."""
  if fmt.name == "nvfp4":
    return _e4m3_reciprocal(scales.astype(jnp.float32), tensor_scale)
  biased = jax.lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.int32)
  if fmt.scale_rounding == "floor":
    r = 1.0 / jnp.maximum(_pow2(biased), F32_MIN_NORMAL)
  else:
    r = jnp.where(biased == 0, 1.0, jnp.where(biased == 254, 2.0**-127, _pow2(254 - biased)))
  return jnp.where(biased == 255, jnp.nan, r).astype(jnp.float32)


def dequant_scales(scales: jax.Array, tensor_scale: jax.Array | None = None) -> jax.Array:
  """Per-block float32 multipliers that map E2M1 values back to the input's range."""
  s = scales.astype(jnp.float32)
  return s if tensor_scale is None else s * _per_block(tensor_scale, s)


def to_blocks(x: jax.Array, fmt: Fp4Format) -> jax.Array:
  return x.reshape(*x.shape[:-1], x.shape[-1] // fmt.block_size, fmt.block_size)


_SUBNORMAL_RECIPROCAL_BITS = 0x00400000  # 2**-127: MXFP4 RCEIL's reciprocal for an infinite amax


def scale_blocks(blocks: jax.Array, reciprocal: jax.Array, fmt: Fp4Format) -> jax.Array:
  """`blocks * reciprocal[..., None]`: the input to the E2M1 cast, as torchao computes it.

  RCEIL's reciprocal for a block with an infinite amax is the subnormal 2**-127, which a
  backend that flushes subnormals (XLA:CPU) reads as 0, turning the inf into NaN; it is
  applied there as 0.5 then 2**-126, which gives the same codes. (Both factors are runtime
  values so that XLA does not fold them back into the constant 2**-127.)
  """
  if fmt.scale_rounding != "rceil":
    return blocks * reciprocal[..., None]
  subnormal = jax.lax.bitcast_convert_type(reciprocal, jnp.int32) == _SUBNORMAL_RECIPROCAL_BITS
  half = jnp.where(subnormal, 0.5, 1.0).astype(jnp.float32)
  r = jnp.where(subnormal, F32_MIN_NORMAL, reciprocal).astype(jnp.float32)
  return (blocks * half[..., None]) * r[..., None]


def _rtn_codes(x: jax.Array, fmt: Fp4Format, tensor_amax: jax.Array | None):
  """(E2M1 codes in blocks [..., blocks, block], block scales, tensor scale) of RTN on `x`."""
  check_blocks(x.shape, fmt, "quantize")
  tensor_scale = None if tensor_amax is None else tensor_scale_from_amax(tensor_amax)
  blocks = to_blocks(x.astype(jnp.float32), fmt)
  scales, reciprocal = compute_scales(blocks, fmt, tensor_scale)
  return float_to_e2m1(scale_blocks(blocks, reciprocal, fmt)), scales, tensor_scale


def quantize(x: jax.Array, fmt: str | Fp4Format = "nvfp4", *, tensor_amax: jax.Array | None = None) -> QuantizedArray:
  """Round-to-nearest block quantization of `x` (bf16 or fp32) along its last axis.

  `tensor_amax` (NVFP4 only) turns on two-level scaling with the FP32 tensor scale
  `tensor_amax / (448 * 6)`: a scalar (torchao's per_tensor_scale), or one per row [...].
  """
  fmt = get_format(fmt)
  codes, scales, tensor_scale = _rtn_codes(x, fmt, tensor_amax)
  return QuantizedArray(pack_nibbles(codes.reshape(x.shape)), scales, tensor_scale, fmt)


def quantize_with_values(
  x: jax.Array, fmt: str | Fp4Format = "nvfp4", *, tensor_amax: jax.Array | None = None, dtype=jnp.float32
) -> tuple[QuantizedArray, jax.Array]:
  """`quantize(x)` and its values `dequantize(quantize(x), dtype)`, the values taken from the codes
  before they are packed (no pack / unpack round trip; bit-identical: tests/test_fp4.py)."""
  fmt = get_format(fmt)
  codes, scales, tensor_scale = _rtn_codes(x, fmt, tensor_amax)
  values = e2m1_to_float(codes) * dequant_scales(scales, tensor_scale)[..., None]
  q = QuantizedArray(pack_nibbles(codes.reshape(x.shape)), scales, tensor_scale, fmt)
  return q, values.reshape(x.shape).astype(dtype)


def dequantize(q: QuantizedArray, dtype=jnp.float32) -> jax.Array:
  """Values of a QuantizedArray, in `dtype` (computed in float32)."""
  values = to_blocks(e2m1_to_float(unpack_nibbles(q.codes)), q.fmt)
  out = values * dequant_scales(q.scales, q.tensor_scale)[..., None]
  return out.reshape(q.shape).astype(dtype)
