"""FP4 weight matmul: x[M, K] (bf16) @ dequantize(w)^T, w packed [N, K/2] with block scales [N, K/bs].

The weight is a `trace_jax.fp4.QuantizedArray` in the torch nn.Linear layout: one row per output
feature, FP4 blocks along the input (contraction) axis, two E2M1 codes per byte with the even
element in the low nibble. NVFP4 (blocks of 16, E4M3 scales, optional FP32 tensor scale) and MXFP4
(blocks of 32, E8M0 scales) are both handled by the same kernel.

Kernel design (Pallas, Triton lowering on GPU; the same kernel runs in interpret mode on CPU):
  * Grid (m tiles, n tiles, k splits). Each program keeps a float32 [block_m, block_n] accumulator
    and walks its share of K in `block_k` steps: load x[block_m, block_k] (bf16), the codes
    [block_n, block_k/2] (uint8) and the scale bytes [block_n, block_k/bs] (uint8), decode,
    `dot(x, w^T)` with float32 accumulation.
  * Decoding uses only shifts, masks and same-width (16-bit) bitcasts: Triton and Mosaic GPU refuse
    width-changing bitcasts such as uint8 -> float4_e2m1fn. The E2M1 bits are moved onto a
    float16's (value * 2^-14, subnormal 0.5 included), the E4M3 scale bits likewise (* 2^-8), E8M0
    scale bits onto a bfloat16's exponent. The two nibbles of a byte are decoded separately and
    interleaved with `stack(..., axis=-1)` (a Triton `join`), the pattern Pallas itself uses to
    load int4. Option `ptx_decode=True` (GPU only) decodes the codes with inline PTX byte permutes
    instead (`e2m1_ptx`): about 27% fewer instructions per weight in the compiled loop.
  * Scales enter the kernel as their raw bytes (a free same-width bitcast outside the kernel) and
    are decoded inside it. Converting them to float32 outside would quadruple the scale traffic
    (0.25 instead of 0.0625 bytes per weight, +33% on top of the 0.5-byte codes) and add a pass
    over the scales per call; an in-kernel float8 astype would depend on Triton's fp8 support
    (E4M3 needs sm_89+, E8M0 is not a Triton type at all).
  * E2M1 x E4M3 and E2M1 x E8M0 products have at most 6 significant bits, so the dequantized weight
    (times a power of two) is exact in bf16 and the MMA runs bf16 x bf16 -> f32 with no rounding of
    the weight. The power of two and the NVFP4 tensor scale multiply the float32 accumulator once
    at the end instead of every weight.
  * M needs no padding: the last m tile's block reaches past x's rows, and the kernel masks its
    loads and stores there itself (an XLA pad was one more launch per call at decode). Pallas'
    Triton lowering masks nothing on its own: without the mask, the compiled kernel read past x and
    wrote past out, and with split-K into the next split's partial sums (relative error 0.6-0.7 at
    M = 1 and 8 on an H200; interpret mode pads blocks, so CPU never showed it). N and K must be
    multiples of block_n / block_k (a ValueError says which).
  * Activation quantization (W4A4) runs as a jnp prologue, `fp4.dequantize(fp4.quantize(x))`, that
    XLA fuses into one pass over x: bit-identical to the rollout's RTN quantizer by construction,
    and its values are again exact in bf16.

The engine has no packed dense weight today (it packs the routed experts only), so `fp4_matmul`
has no caller in the product: it is the entry point for FP4 dense layers or shared experts once
they are packed, and the plain form of the kernel whose decode, tiles and K loop (`accumulate`)
`grouped_fp4_matmul` reuses; tests/test_pallas_kernels.py checks it against its reference.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from trace_jax import fp4

# Triton's MMA needs every dot dimension >= 16; the same minimum holds in interpret mode so that
# what the CPU tests accept is what the GPU accepts.
MIN_BLOCK = 16
# block_k = 16 (one NVFP4 block: 8 code bytes per row) compiled through Triton gave wrong sums on an H200 (every
# element of test_fp4_matmul_smallest_tiles_and_split_k, dense and grouped; MXFP4 at 32 was right:
# docs/gpu_check/h200-2026-12-04b-gpu_check.json), so block_k starts at 32, in interpret mode too. A power of two
# >= 32 holds whole blocks of both formats (16 and 32 elements).
MIN_BLOCK_K = 32
_GPU_SM_COUNT_FALLBACK = 132  # H100 / H200 SXM


# --- arithmetic decoding (no lookup tables, no width-changing bitcasts) ---------------------------
#
# Each decoded quantity is a power of two times the true value, chosen so that it is one integer
# op away from its bytes and exact: E2M1 codes become float16 values times 2^-14, E4M3 scales
# float16 values times 2^-8 (both by moving their exponent/mantissa bits onto float16's, which
# turns their subnormals into float16 subnormals), E8M0 scales exact bfloat16. Weight times scale
# is then exact in bfloat16 (at most 6 significant bits), and the kernel multiplies the float32
# accumulator by 2^weight_exponent_offset(fmt) once at the end. This is about 2.5x fewer
# instructions per weight than assembling float32 values with compares and selects (counted in the
# SASS of the decode loop compiled for sm_90).

E2M1_F16_EXPONENT = 14  # e2m1_to_f16_scaled gives value * 2^-14
E4M3_F16_EXPONENT = 8  # e4m3_to_f16_scaled gives value * 2^-8


def _from_bits16(bits: jax.Array, dtype) -> jax.Array:
  return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), dtype)


def e2m1_to_f16_scaled(codes: jax.Array, nibble: int = 0) -> jax.Array:
  """E2M1 values of the low (nibble=0) or high (nibble=4) nibbles of uint8 `codes`, times 2^-14,
  in float16: exponent bits go to float16 bits 10-11, the mantissa bit to bit 9, the sign to 15."""
  c = codes.astype(jnp.uint16)
  return _from_bits16(((c & (7 << nibble)) << (9 - nibble)) | ((c & (8 << nibble)) << (12 - nibble)), jnp.float16)


def e4m3_to_f16_scaled(bits: jax.Array) -> jax.Array:
  """float8_e4m3fn values from their bytes, times 2^-8, in float16 (exact); 0x7f/0xff are NaN."""
  b = bits.astype(jnp.uint16)
  value = _from_bits16(((b & 0x7F) << 7) | ((b & 0x80) << 8), jnp.float16)
  return jnp.where((b & 0x7F) == 0x7F, jnp.nan, value)


def e8m0_to_bf16(bits: jax.Array) -> jax.Array:
  """float8_e8m0fnu values 2^(b - 127) from their bytes, exact in bfloat16 (2^-127 is a bfloat16
  subnormal); 0xff is NaN."""
  b = bits.astype(jnp.uint16)
  return _from_bits16(jnp.where(b == 0, 0x0040, jnp.where(b == 0xFF, 0x7FC0, b << 7)), jnp.bfloat16)


def weight_exponent_offset(fmt: fp4.Fp4Format) -> int:
  """`dequantize_tile` returns weights times 2^-offset."""
  return E2M1_F16_EXPONENT + (E4M3_F16_EXPONENT if fmt.name == "nvfp4" else 0)


def _bytes_word(values) -> str:
  return f"{int(values[0] | values[1] << 8 | values[2] << 16 | values[3] << 24):#010x}"


def e2m1_ptx(nibble: int) -> str:
  """PTX for Triton's elementwise inline asm (pack=4): the four codes packed in $2 -> the bf16
  values times 2^-14 of their low (nibble=0) or high (nibble=4) nibbles, pairs in $0 and $1.

  A byte-permute (prmt) lookup: the 3-bit magnitude indices of the four nibbles become the four
  selector nibbles of a prmt over an 8-byte table, once for the high and once for the low bytes
  of the bf16 results; the sign bits are or-ed in, and two more prmts interleave the bytes into
  bf16 pairs: 11 instructions per 4 weights, and no per-byte unpacking by Triton. In the compiled
  decode loop (sm_90, 32 x 256 tiles) that is 7.3 instead of 10.1 SASS instructions per weight.
  The table values (E2M1 * 2^-14) are normal bf16 numbers, so unlike the float16 route this does
  not rely on subnormal handling. GPU only: interpret mode cannot run inline asm.
  """
  bits = (np.array(fp4.E2M1_MAGNITUDES, np.float32) * 2.0**-E2M1_F16_EXPONENT).astype(jnp.bfloat16)
  bits = bits.view(np.uint16).astype(np.uint32)
  hi, lo = bits >> 8, bits & 0xFF
  index = "and.b32 i, $2, 0x07070707;" if nibble == 0 else "shr.b32 i, $2, 4;\nand.b32 i, i, 0x07070707;"
  sign = "shl.b32 s, $2, 4;\nand.b32 s, s, 0x80808080;" if nibble == 0 else "and.b32 s, $2, 0x80808080;"
  return f"""{{
.reg .b32 i, j, s, h, l;
{index}
shr.b32 j, i, 4;
or.b32 i, i, j;
prmt.b32 i, i, 0, 0x0020;
prmt.b32 h, {_bytes_word(hi[:4])}, {_bytes_word(hi[4:])}, i;
prmt.b32 l, {_bytes_word(lo[:4])}, {_bytes_word(lo[4:])}, i;
{sign}
or.b32 h, h, s;
prmt.b32 $0, l, h, 0x5140;
prmt.b32 $1, l, h, 0x7362;
}}"""


def e2m1_to_bf16_scaled_ptx(codes: jax.Array, nibble: int) -> jax.Array:
  """What `e2m1_to_f16_scaled(codes, nibble).astype(bfloat16)` gives, by `e2m1_ptx`."""
  # One call per nibble: Pallas' Triton lowering of multi-result inline asm is broken in jax 0.10.
  [values] = plgpu.elementwise_inline_asm(
    e2m1_ptx(nibble),
    args=[codes],
    constraints="=r,=r,r",
    pack=4,
    result_shape_dtypes=[jax.ShapeDtypeStruct(codes.shape, jnp.bfloat16)],
  )
  return values


def dequantize_tile(codes: jax.Array, scale_bits: jax.Array, fmt: fp4.Fp4Format, *, ptx: bool = False) -> jax.Array:
  """[rows, k/2] packed codes and [rows, k/bs] scale bytes -> [rows, k] bfloat16 weights times
  2^-weight_exponent_offset(fmt), exact (except MXFP4 blocks with scales below about 2^-110,
  whose products leave bfloat16's range). `ptx`: decode the codes with `e2m1_ptx` (GPU only)."""
  rows, half = codes.shape
  num_blocks = scale_bits.shape[1]
  if fmt.name == "nvfp4":
    scales = e4m3_to_f16_scaled(scale_bits).astype(jnp.bfloat16)
  else:
    scales = e8m0_to_bf16(scale_bits)
  scales = scales[:, :, None]
  if ptx:
    decode = functools.partial(e2m1_to_bf16_scaled_ptx, codes)
  else:
    decode = lambda nibble: e2m1_to_f16_scaled(codes, nibble).astype(jnp.bfloat16)
  block_shape = (rows, num_blocks, half // num_blocks)
  lo = decode(0).reshape(block_shape) * scales
  hi = decode(4).reshape(block_shape) * scales
  # Even elements sit in the low nibble: interleave lo/hi along the last axis.
  return jnp.stack([lo, hi], axis=-1).reshape(rows, 2 * half)


# --- tiles --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Tile sizes and Triton launch options of one kernel call."""

  block_m: int
  block_n: int
  block_k: int
  k_splits: int = 1
  num_warps: int = 4
  num_stages: int = 3
  ptx_decode: bool = False  # decode codes with inline PTX (`e2m1_ptx`); GPU only


def resolve_interpret(interpret: bool | None) -> bool:
  """Interpret mode unless we are on a GPU (the kernels are written for the Triton lowering)."""
  return jax.default_backend() != "gpu" if interpret is None else bool(interpret)


def _is_power_of_two(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def _largest_power_of_two_dividing(n: int, cap: int) -> int:
  b = 1
  while b * 2 <= cap and n % (b * 2) == 0:
    b *= 2
  return b


def _sm_count() -> int:
  return getattr(jax.devices()[0], "core_count", None) or _GPU_SM_COUNT_FALLBACK


def default_tiles(
  m: int, n: int, k: int, fmt: fp4.Fp4Format, *, interpret: bool, split_k: bool = True, parallel: int = 1
) -> Tiles:
  """Default tiles for x[m, k] @ w[n, k]^T (`parallel` such products in one grid: the experts).

  GPU: block_m covers M up to 64 (16 at decode), block_k = 256 at decode (fewer loop iterations
  per weight), 128 above (register pressure of the 64-row tiles). Decoding weights is the
  bottleneck at small M (each weight tile is decoded once per m tile), so the grid should give
  every SM work: about two programs per SM, by splitting K across programs (as long as the float32
  partial sums that split K writes and reads back stay under 1/8 of the weight bytes) and by
  shrinking block_n from 64 (128 for M > 16) down to 32. At decode K is split first: the 64-row
  weight tile issues about 8% fewer instructions per weight than the 32-row one (6.8 against 7.4
  with the PTX decode, pallas_kernels/lab/kernel_report.py); above, block_n shrinks first. Interpret mode (CPU) runs
  grid steps one after another, so it takes the largest tiles that divide the shape.
  """
  if interpret:
    block_m = max(MIN_BLOCK, min(pl.next_power_of_2(m), 128))
    block_n = _largest_power_of_two_dividing(n, 256)
    block_k = _largest_power_of_two_dividing(k, 512)
    return Tiles(block_m, block_n, block_k)
  decode = m <= MIN_BLOCK
  block_m = max(MIN_BLOCK, min(pl.next_power_of_2(m), 64))
  block_n = _largest_power_of_two_dividing(n, 64 if decode else 128)
  block_k = max(_largest_power_of_two_dividing(k, 256 if decode else 128), MIN_BLOCK_K)
  # Two programs per SM: the decode loop is bound by instruction issue, which needs more than one
  # 4-warp program per SM to hide latency. Splitting K for it costs a second launch (XLA's sum of
  # the partials); pallas_kernels/gpu_compile.py counts launches.
  target = 2 * _sm_count()
  programs = lambda bn, splits: parallel * pl.cdiv(m, block_m) * max(n // bn, 1) * splits
  k_tiles = max(k // block_k, 1)
  weight_bytes = n * k * (0.5 + 1 / fmt.block_size)
  partial_bytes = lambda splits: splits * pl.cdiv(m, block_m) * block_m * n * 8
  can_split = lambda s: split_k and k_tiles % (2 * s) == 0 and partial_bytes(2 * s) <= weight_bytes / 8
  k_splits = 1
  if decode:  # split K first: a 64-row weight tile issues fewer instructions per weight than 32
    while programs(block_n, k_splits) < target and can_split(k_splits):
      k_splits *= 2
  while block_n > 32 and programs(block_n, k_splits) < target:
    block_n //= 2
  while programs(block_n, k_splits) < target and can_split(k_splits):
    k_splits *= 2
  return Tiles(block_m, block_n, block_k, k_splits, num_warps=4, num_stages=4 if decode else 3)


def make_tiles(
  m: int, n: int, k: int, fmt: fp4.Fp4Format, *, interpret: bool, split_k: bool = True, parallel: int = 1, **chosen
) -> Tiles:
  """Defaults overridden by the caller's choices (`Tiles` fields; None keeps the default), then
  checked against the shape."""
  tiles = default_tiles(m, n, k, fmt, interpret=interpret, split_k=split_k, parallel=parallel)
  tiles = dataclasses.replace(tiles, **{key: v for key, v in chosen.items() if v is not None})
  check_tiles(tiles, n, k, fmt)
  if interpret and tiles.ptx_decode:
    raise ValueError("ptx_decode=True needs the GPU (Triton) backend; interpret mode cannot run inline PTX.")
  return tiles


def check_tiles(tiles: Tiles, n: int, k: int, fmt: fp4.Fp4Format):
  where = f"weight [N={n}, K={k}] ({fmt.name}) with tiles {tiles}"
  if k % MIN_BLOCK_K:
    raise ValueError(
      f"K={k} is not a multiple of {MIN_BLOCK_K}, the kernel's smallest K step; run it through "
      f"pallas_kernels.packed_matmul / grouped_packed_matmul with impl='auto' (the reference then). {where}."
    )
  for name in ("block_m", "block_n", "block_k"):
    b, least = getattr(tiles, name), MIN_BLOCK_K if name == "block_k" else MIN_BLOCK
    if not _is_power_of_two(b) or b < least:
      raise ValueError(f"{name}={b} must be a power of two >= {least} (Triton MMA tiles); {where}.")
  if n % tiles.block_n:
    raise ValueError(f"N={n} is not a multiple of block_n={tiles.block_n}; pick a block_n dividing N. {where}.")
  if k % tiles.block_k:
    raise ValueError(f"K={k} is not a multiple of block_k={tiles.block_k}; pick a block_k dividing K. {where}.")
  k_tiles = k // tiles.block_k
  if tiles.k_splits < 1 or k_tiles % tiles.k_splits:
    raise ValueError(f"k_splits={tiles.k_splits} must divide the {k_tiles} K tiles; {where}.")


# --- shared pieces of both kernels --------------------------------------------------------------


def check_weight(w: fp4.QuantizedArray, ndim: int, what: str):
  if not isinstance(w, fp4.QuantizedArray):
    raise TypeError(f"{what}: w must be a trace_jax.fp4.QuantizedArray, got {type(w).__name__}.")
  if w.codes.ndim != ndim or w.codes.dtype != jnp.uint8:
    raise ValueError(f"{what}: w.codes must be uint8 of rank {ndim}, got {w.codes.dtype}{list(w.codes.shape)}.")
  k = w.shape[-1]
  expected = (*w.codes.shape[:-1], k // w.fmt.block_size)
  if k % w.fmt.block_size or tuple(w.scales.shape) != expected:
    raise ValueError(
      f"{what}: w.scales {list(w.scales.shape)} do not match codes {list(w.codes.shape)} "
      f"({w.fmt.name}, blocks of {w.fmt.block_size} along K={k}); expected {list(expected)}."
    )


def prepare_activations(
  x: jax.Array, quantize_activations: bool, fmt: str | fp4.Fp4Format | None, weight_fmt: fp4.Fp4Format
) -> jax.Array:
  """bf16 activations for the MMA; with `quantize_activations`, RTN FP4 fake-quant first (W4A4)."""
  if quantize_activations:
    return fp4.dequantize(fp4.quantize(x, weight_fmt if fmt is None else fmt), jnp.bfloat16)
  return x.astype(jnp.bfloat16)


def scale_bytes(w: fp4.QuantizedArray) -> jax.Array:
  return jax.lax.bitcast_convert_type(w.scales, jnp.uint8)


def tensor_scale_operand(w: fp4.QuantizedArray, shape: tuple[int, ...]) -> list[jax.Array]:
  """The tensor scale as a float32 array of `shape` (one operand), or no operand at all."""
  if w.tensor_scale is None:
    return []
  return [jnp.broadcast_to(jnp.asarray(w.tensor_scale, jnp.float32), shape)]


def accumulate(
  load: Callable[[jax.Array], tuple[jax.Array, jax.Array, jax.Array]],
  first_k_tile: jax.Array,
  num_k_tiles,
  acc: jax.Array,
  fmt: fp4.Fp4Format,
  tiles: Tiles,
) -> jax.Array:
  """acc += x_tile @ dequant(w_tile)^T over K tiles [first, first + num); `load(k_tile)` gives the
  bf16 x tile [bm, bk], the codes [bn, bk/2] and the scale bytes [bn, bk/bs]."""

  def body(i, acc):
    x, codes, scale_bits = load(first_k_tile + i)
    w = dequantize_tile(codes, scale_bits, fmt, ptx=tiles.ptx_decode)
    return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

  return jax.lax.fori_loop(0, num_k_tiles, body, acc)


def k_slices(k_tile: jax.Array, block_k: int, block_size: int):
  """Slices of x (elements), codes (bytes) and scales (blocks) for one K tile."""
  return (
    pl.ds(pl.multiple_of(k_tile * block_k, block_k), block_k),
    pl.ds(pl.multiple_of(k_tile * (block_k // 2), block_k // 2), block_k // 2),
    pl.ds(k_tile * (block_k // block_size), block_k // block_size),
  )


def compiler_params(tiles: Tiles):
  return plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def jit_kernel(fn):
  """jax.jit with every keyword-only argument static: formats, tile and launch options and the
  output dtype each select another compiled kernel."""
  options = [p.name for p in inspect.signature(fn).parameters.values() if p.kind == p.KEYWORD_ONLY]
  return jax.jit(fn, static_argnames=tuple(options))


# --- dense kernel -------------------------------------------------------------------------------


def _fp4_matmul_kernel(
  x_ref, codes_ref, scales_ref, *rest, fmt: fp4.Fp4Format, tiles: Tiles, k_tiles_per_split: int, num_rows: int
):
  *tensor_scale_ref, out_ref = rest
  # The Triton lowering does not mask a block that reaches past the array: rows >= num_rows of the
  # last m tile must be masked here (loads read past x, stores would write past out or, with split
  # K, into the next split's partial sums).
  ragged = num_rows % tiles.block_m != 0
  if ragged:
    rows = pl.program_id(0) * tiles.block_m + jnp.arange(tiles.block_m, dtype=jnp.int32)
    valid = (rows < num_rows)[:, None]

  def load(k_tile):
    xs, cs, ss = k_slices(k_tile, tiles.block_k, fmt.block_size)
    if ragged:
      x = plgpu.load(x_ref.at[:, xs], mask=jnp.broadcast_to(valid, (tiles.block_m, tiles.block_k)), other=0)
    else:
      x = x_ref[:, xs]
    return x, codes_ref[:, cs], scales_ref[:, ss]

  acc = jnp.zeros((tiles.block_m, tiles.block_n), jnp.float32)
  acc = accumulate(load, pl.program_id(2) * k_tiles_per_split, k_tiles_per_split, acc, fmt, tiles)
  acc = acc * 2.0 ** weight_exponent_offset(fmt)
  if tensor_scale_ref:
    acc = acc * tensor_scale_ref[0][0, 0]
  if ragged:
    plgpu.store(out_ref, acc.astype(out_ref.dtype), mask=jnp.broadcast_to(valid, acc.shape))
  else:
    out_ref[...] = acc.astype(out_ref.dtype)


@jit_kernel
def fp4_matmul(
  x: jax.Array,
  w: fp4.QuantizedArray,
  *,
  quantize_activations: bool = False,
  activation_format: str | fp4.Fp4Format | None = None,
  block_m: int | None = None,
  block_n: int | None = None,
  block_k: int | None = None,
  k_splits: int | None = None,
  num_warps: int | None = None,
  num_stages: int | None = None,
  ptx_decode: bool | None = None,
  out_dtype=jnp.bfloat16,
  interpret: bool | None = None,
) -> jax.Array:
  """x[M, K] @ dequantize(w)^T -> [M, N] in `out_dtype`, float32 accumulation.

  Args:
    x: activations [M, K], bf16 (other float dtypes are rounded to bf16 first).
    w: packed weight, codes [N, K/2] and scales [N, K/bs] (NVFP4 or MXFP4), optional tensor scale.
    quantize_activations: fake-quantize x with RTN to FP4 first (W4A4, as the rollout engine does).
    activation_format: FP4 format for x when quantized; default: the weight's format.
    block_m, block_n, block_k: tile sizes (powers of two >= 16, block_k >= 32; defaults from `default_tiles`).
    k_splits: split K across this many programs (partial sums added outside the kernel).
    num_warps, num_stages: Triton launch options (ignored in interpret mode).
    ptx_decode: decode the codes with inline PTX (`e2m1_ptx`, GPU only); default False.
    out_dtype: output dtype.
    interpret: run the Pallas interpreter; default: True unless the backend is GPU.
  """
  check_weight(w, 2, "fp4_matmul")
  if x.ndim != 2 or x.shape[1] != w.shape[1]:
    raise ValueError(f"fp4_matmul: x must be [M, K={w.shape[1]}] for weight {list(w.shape)}; got {list(x.shape)}.")
  (m, k), n = x.shape, w.shape[0]
  interpret = resolve_interpret(interpret)
  chosen = dict(block_m=block_m, block_n=block_n, block_k=block_k, k_splits=k_splits, ptx_decode=ptx_decode)
  tiles = make_tiles(m, n, k, w.fmt, interpret=interpret, num_warps=num_warps, num_stages=num_stages, **chosen)
  # M is not padded (no extra launch): the last m tile's block reaches past x's rows, the kernel
  # masks its loads and stores (`num_rows`), and a row of x only reaches its own output row.
  x = prepare_activations(x, quantize_activations, activation_format, w.fmt)
  m_tiles = pl.cdiv(m, tiles.block_m)
  splits = tiles.k_splits
  num_blocks = k // w.fmt.block_size

  in_specs = [
    pl.BlockSpec((tiles.block_m, k), lambda i, j, s: (i, 0)),
    pl.BlockSpec((tiles.block_n, k // 2), lambda i, j, s: (j, 0)),
    pl.BlockSpec((tiles.block_n, num_blocks), lambda i, j, s: (j, 0)),
  ]
  operands = [x, w.codes, scale_bytes(w)]
  if w.tensor_scale is not None:
    in_specs.append(pl.BlockSpec((1, 1), lambda i, j, s: (0, 0)))
    operands += tensor_scale_operand(w, (1, 1))
  if splits == 1:
    out_shape = jax.ShapeDtypeStruct((m, n), out_dtype)
    out_spec = pl.BlockSpec((tiles.block_m, tiles.block_n), lambda i, j, s: (i, j))
  else:
    out_shape = jax.ShapeDtypeStruct((splits, m, n), jnp.float32)
    out_spec = pl.BlockSpec((None, tiles.block_m, tiles.block_n), lambda i, j, s: (s, i, j))

  kernel = functools.partial(
    _fp4_matmul_kernel, fmt=w.fmt, tiles=tiles, k_tiles_per_split=k // tiles.block_k // splits, num_rows=m
  )
  out = pl.pallas_call(
    kernel,
    out_shape=out_shape,
    grid=(m_tiles, n // tiles.block_n, splits),
    in_specs=in_specs,
    out_specs=out_spec,
    compiler_params=compiler_params(tiles),
    interpret=interpret,
    name=f"fp4_matmul_{w.fmt.name}",
  )(*operands)
  if splits > 1:
    out = out.sum(axis=0).astype(out_dtype)
  return out


def fp4_matmul_reference(
  x: jax.Array,
  w: fp4.QuantizedArray,
  *,
  quantize_activations: bool = False,
  activation_format: str | fp4.Fp4Format | None = None,
  out_dtype=jnp.bfloat16,
) -> jax.Array:
  """Plain jnp: bf16 x (fake-quantized if asked) @ fp4.dequantize(w)^T in float32."""
  xq = prepare_activations(x, quantize_activations, activation_format, w.fmt).astype(jnp.float32)
  out = jnp.dot(xq, fp4.dequantize(w).T, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  return out.astype(out_dtype)
