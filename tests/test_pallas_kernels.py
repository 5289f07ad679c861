"""Pallas FP4 kernels against their jnp references: in interpret mode on CPU, compiled through
Triton when the backend is a GPU (INTERPRET), where the inline-PTX decode is checked as well.
TRACE_PALLAS_INTERPRET=0 / 1 forces compiled / interpret mode (compiled needs a GPU backend;
pallas_kernels/lab/gpu_check.py sets 0 so that a GPU run cannot fall back to the interpreter unnoticed).

Every kernel configuration is compiled once (group sizes are traced, so one compiled grouped
kernel serves several groupings). The CUDA lowering test runs the Pallas -> Triton lowering on
CPU, which catches what the Triton backend refuses (non power-of-two blocks, unsupported ops)
without a GPU.
"""

import functools
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from absl import logging

import pallas_kernels
from pallas_kernels import fp4_matmul as dense
from pallas_kernels import grouped_fp4_matmul as grouped
from trace_jax import fp4

# The kernels are written for the Triton lowering; elsewhere the Pallas interpreter runs them.
_FORCED = os.environ.get("TRACE_PALLAS_INTERPRET", "").strip().lower()
if _FORCED not in ("", "0", "1", "false", "true"):
  raise ValueError(f"TRACE_PALLAS_INTERPRET={_FORCED!r}: use 0 (compiled) or 1 (interpret), or leave it unset")
INTERPRET = jax.default_backend() != "gpu" if not _FORCED else _FORCED in ("1", "true")
if not INTERPRET and jax.default_backend() != "gpu":
  raise RuntimeError(
    f"TRACE_PALLAS_INTERPRET={_FORCED}: compiled Pallas kernels need a GPU (backend: {jax.default_backend()})"
  )

# (format, tensor scale): NVFP4 single- and two-level, MXFP4.
WEIGHT_FORMATS = [("nvfp4", False), ("nvfp4", True), ("mxfp4", False)]


# Jitted once per shape: eager jnp would compile every primitive of the quantizer separately.
_quantize = jax.jit(fp4.quantize, static_argnums=1)
_dense_reference = jax.jit(
  dense.fp4_matmul_reference, static_argnames=("quantize_activations", "activation_format", "out_dtype")
)
_grouped_reference = jax.jit(
  grouped.grouped_fp4_matmul_reference, static_argnames=("quantize_activations", "activation_format", "out_dtype")
)


def _weights(shape, fmt, with_tensor_scale, seed=0):
  w = 2.0 * np.random.default_rng(seed).standard_normal(shape, np.float32)
  amax = np.abs(w).max() if with_tensor_scale else None
  return _quantize(w, fmt, tensor_amax=amax)


def _activations(m, k, seed=1):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k), np.float32), jnp.bfloat16)


def _assert_close(actual, expected):
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  # Same exact products on both sides; only the float32 summation order differs.
  np.testing.assert_allclose(actual, expected, rtol=2e-5, atol=2e-5 * max(1.0, np.abs(expected).max()))


# --- decoding -----------------------------------------------------------------------------------

BYTES = np.arange(256, dtype=np.uint8)


def test_e2m1_decode_every_byte():
  # fp4.E2M1_VALUES is checked against ml_dtypes' float4_e2m1fn in test_fp4.py.
  expected_lo = fp4.E2M1_VALUES[BYTES & 0xF]
  expected_hi = fp4.E2M1_VALUES[BYTES >> 4]
  for nibble, expected in ((0, expected_lo), (4, expected_hi)):
    got = np.asarray(dense.e2m1_to_f16_scaled(jnp.asarray(BYTES), nibble), np.float32) * 2.0**dense.E2M1_F16_EXPONENT
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(expected))


def test_e4m3_decode_every_byte():
  expected = BYTES.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  got = np.asarray(dense.e4m3_to_f16_scaled(jnp.asarray(BYTES)), np.float32) * 2.0**dense.E4M3_F16_EXPONENT
  np.testing.assert_array_equal(got, expected)  # NaN == NaN for assert_array_equal


def test_e8m0_decode_every_byte():
  expected = BYTES.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
  got = np.asarray(dense.e8m0_to_bf16(jnp.asarray(BYTES)), np.float32)
  np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_dequantize_tile_matches_fp4_dequantize(fmt):
  w = _weights((16, 128), fmt, False)
  tile = dense.dequantize_tile(w.codes, dense.scale_bytes(w), w.fmt)
  assert tile.dtype == jnp.bfloat16
  got = np.asarray(tile, np.float32) * 2.0 ** dense.weight_exponent_offset(w.fmt)
  np.testing.assert_array_equal(got, np.asarray(fp4.dequantize(w)))


def _run_ptx(asm: str, inputs: list[np.ndarray], num_outputs: int) -> list[np.ndarray]:
  """Runs the PTX subset our inline asm uses (and/or/shl/shr/prmt .b32) on uint32 numpy arrays.

  prmt.b32 d, a, b, c (default mode): byte k of d is byte c[4k+2:4k] of the 8-byte value {b, a}
  (a = bytes 0-3), or that byte's sign bit replicated when c[4k+3] is set.
  """
  regs = {f"${num_outputs + i}": x.astype(np.uint64) for i, x in enumerate(inputs)}
  value = lambda t: regs[t] if t in regs else np.uint64(int(t, 0))
  for line in asm.splitlines():
    line = line.strip().rstrip(";")
    if line in ("{", "}") or line.startswith(".reg"):
      continue
    op, operands = line.split(None, 1)
    dst, *args = [t.strip() for t in operands.split(",")]
    a = [value(t) for t in args]
    if op == "prmt.b32":
      table, result = a[0] | (a[1] << np.uint64(32)), np.uint64(0)
      for k in range(4):
        sel = (a[2] >> np.uint64(4 * k)) & np.uint64(0xF)
        byte = (table >> ((sel & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        byte = np.where(sel & np.uint64(8), (byte >> np.uint64(7)) * np.uint64(0xFF), byte)
        result = result | (byte << np.uint64(8 * k))
    else:
      ops = {"and.b32": np.bitwise_and, "or.b32": np.bitwise_or, "shl.b32": np.left_shift, "shr.b32": np.right_shift}
      result = ops[op](a[0], a[1])
    regs[dst] = np.asarray(result, np.uint64) & np.uint64(0xFFFFFFFF)
  return [regs[f"${i}"] for i in range(num_outputs)]


@pytest.mark.parametrize("nibble", [0, 4])
def test_e2m1_ptx_decodes_every_byte(nibble):
  """The inline PTX (GPU only) against the E2M1 table, on an emulator of its instructions."""
  rng = np.random.default_rng(0)
  words = np.concatenate([BYTES.astype(np.uint64) * 0x01010101, rng.integers(0, 2**32, 1024, dtype=np.uint64)])
  pair01, pair23 = _run_ptx(dense.e2m1_ptx(nibble), [words], 2)
  got = np.stack([(pair >> np.uint64(16 * h)) & np.uint64(0xFFFF) for pair in (pair01, pair23) for h in (0, 1)], -1)
  codes = np.stack([(words >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)], -1).astype(np.uint8)
  expected = fp4.E2M1_VALUES[(codes >> nibble) & 0xF] * np.float32(2.0**-dense.E2M1_F16_EXPONENT)
  np.testing.assert_array_equal(got.astype(np.uint16), expected.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_ptx_decode_is_gpu_only():
  with pytest.raises(ValueError, match="ptx_decode=True needs the GPU"):
    dense.fp4_matmul(_activations(4, 64), _weights((32, 64), "nvfp4", False), ptx_decode=True, interpret=True)


# --- dense kernel -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,with_tensor_scale", WEIGHT_FORMATS)
@pytest.mark.parametrize(
  "m,k,n,quantize_activations",
  [(1, 64, 32, False), (8, 256, 128, True), (33, 256, 32, False), (33, 64, 128, True), (1, 256, 128, True)],
)
def test_fp4_matmul_matches_reference(m, k, n, quantize_activations, fmt, with_tensor_scale):
  w = _weights((n, k), fmt, with_tensor_scale)
  x = _activations(m, k)
  kw = dict(quantize_activations=quantize_activations, out_dtype=jnp.float32)
  out = dense.fp4_matmul(x, w, interpret=INTERPRET, **kw)
  assert out.shape == (m, n) and out.dtype == jnp.float32
  _assert_close(out, _dense_reference(x, w, **kw))


def _tiny_scale_weights(shape, fmt, seed=0):
  """Random codes with the smallest scales: E4M3 subnormals (bytes 0x01-0x07, below 2^-6; our
  quantizer never writes them, a checkpoint may) or E8M0 scales from 2^-110 to 2^-100 (below that
  the products leave bfloat16's range: `dense.dequantize_tile`'s documented limit)."""
  rng = np.random.default_rng(seed)
  fmt = fp4.get_format(fmt)
  codes = rng.integers(0, 256, (*shape[:-1], shape[-1] // 2), dtype=np.uint8)
  low, high = (1, 8) if fmt.name == "nvfp4" else (17, 28)
  scale_bytes = rng.integers(low, high, (*shape[:-1], shape[-1] // fmt.block_size), dtype=np.uint8)
  scales = jax.lax.bitcast_convert_type(jnp.asarray(scale_bytes), fmt.scale_dtype)
  return fp4.QuantizedArray(jnp.asarray(codes), scales, None, fmt)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_tiny_scales(fmt):
  # Where a GPU's flush-to-zero or a wrong conversion would show: E4M3 subnormal scales go through
  # float16 subnormals in the decode. Both kernels, and on the GPU the inline-PTX decode too.
  experts = _tiny_scale_weights((2, 32, 256), fmt)
  dense_w = jax.tree.map(lambda a: a[0], experts)
  x = _activations(9, 256)
  if fmt == "mxfp4":  # weights near 2^-110: scale x up so that the outputs are ordinary numbers
    x = (x.astype(jnp.float32) * 2.0**100).astype(jnp.bfloat16)
  expected = _dense_reference(x, dense_w, out_dtype=jnp.float32)
  assert np.abs(np.asarray(expected)).max() > 0
  for ptx in [False] if INTERPRET else [False, True]:
    _assert_close(dense.fp4_matmul(x, dense_w, ptx_decode=ptx, out_dtype=jnp.float32, interpret=INTERPRET), expected)
    _check_grouped(x, experts, [[4, 5], [0, 9]], ptx_decode=ptx)


@pytest.mark.parametrize("fmt,with_tensor_scale", WEIGHT_FORMATS)
def test_fp4_matmul_smallest_tiles_and_split_k(fmt, with_tensor_scale):
  w = _weights((32, 256), fmt, with_tensor_scale)
  x = _activations(33, 256)
  block_k = dense.MIN_BLOCK_K  # one MXFP4 block, two NVFP4 blocks
  out = dense.fp4_matmul(
    x, w, block_m=16, block_n=16, block_k=block_k, k_splits=2, out_dtype=jnp.float32, interpret=INTERPRET
  )
  _assert_close(out, _dense_reference(x, w, out_dtype=jnp.float32))


def test_fp4_matmul_bf16_output():
  w = _weights((64, 128), "nvfp4", True)
  x = _activations(8, 128)
  out = dense.fp4_matmul(x, w, interpret=INTERPRET)
  assert out.dtype == jnp.bfloat16
  expected = _dense_reference(x, w, out_dtype=jnp.float32)
  # One bf16 rounding of the same float32 value, up to summation order.
  np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=2**-7, atol=1e-3)


def test_fp4_matmul_activation_quantization_is_rtn_fake_quant():
  w = _weights((32, 64), "nvfp4", False)
  x = _activations(8, 64)
  xq = fp4.dequantize(_quantize(x, "nvfp4"), jnp.bfloat16)
  a = dense.fp4_matmul(x, w, quantize_activations=True, out_dtype=jnp.float32, interpret=INTERPRET)
  b = dense.fp4_matmul(xq, w, out_dtype=jnp.float32, interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
  "n,k,x_k,options,match",
  [
    (48, 64, 64, dict(block_n=32), r"N=48 is not a multiple of block_n=32"),
    (32, 96, 96, dict(block_k=64), r"K=96 is not a multiple of block_k=64"),
    (32, 64, 64, dict(block_m=8), r"block_m=8 must be a power of two >= 16"),
    (32, 64, 64, dict(block_k=16), r"block_k=16 must be a power of two >= 32"),
    (32, 64, 64, dict(block_n=24), r"block_n=24 must be a power of two"),
    (32, 128, 128, dict(block_k=32, k_splits=3), r"k_splits=3 must divide the 4 K tiles"),
    (32, 64, 32, dict(), r"x must be \[M, K=64\]"),
    (24, 64, 64, dict(), r"block_n=8 must be a power of two >= 16.*N=24"),
  ],
)
def test_fp4_matmul_rejects_bad_shapes(n, k, x_k, options, match):
  w = _weights((n, k), "nvfp4", False)
  with pytest.raises(ValueError, match=match):
    dense.fp4_matmul(_activations(4, x_k), w, interpret=INTERPRET, **options)


# --- grouped kernel -----------------------------------------------------------------------------

# Ragged groups with empty ones, groups off the 16-row tiles, rows past the total, everything in
# one group, nothing at all, and exactly M rows.
GROUPINGS_33 = [[5, 0, 20, 0, 3], [0, 0, 33, 0, 0], [0, 0, 0, 0, 0], [16, 16, 1, 0, 0], [1, 1, 1, 1, 1]]


def _check_grouped(x, w, groupings, **options):
  run = jax.jit(functools.partial(grouped.grouped_fp4_matmul, out_dtype=jnp.float32, interpret=INTERPRET, **options))
  quantize_activations = options.get("quantize_activations", False)
  for sizes in groupings:
    group_sizes = jnp.asarray(sizes, jnp.int32)
    out = run(x, group_sizes, w)
    expected = _grouped_reference(x, group_sizes, w, quantize_activations=quantize_activations, out_dtype=jnp.float32)
    _assert_close(out, expected)
    assert not np.asarray(out[sum(sizes) :]).any(), f"rows past the total must be zero for {sizes}"


@pytest.mark.parametrize("fmt,with_tensor_scale", WEIGHT_FORMATS)
@pytest.mark.parametrize("quantize_activations", [False, True])
def test_grouped_fp4_matmul_matches_reference(fmt, with_tensor_scale, quantize_activations):
  w = _weights((5, 32, 256), fmt, with_tensor_scale)
  x = _activations(33, 256)
  _check_grouped(x, w, GROUPINGS_33, quantize_activations=quantize_activations)


def test_grouped_fp4_matmul_per_expert_tensor_scales():
  w = 2.0 * np.random.default_rng(0).standard_normal((5, 32, 64), np.float32) * np.arange(1, 6)[:, None, None]
  w = _quantize(w, "nvfp4", tensor_amax=np.abs(w).max(axis=(1, 2), keepdims=True))  # tensor scale [E, 1, 1]
  _check_grouped(_activations(33, 64), w, GROUPINGS_33[:2])


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_grouped_fp4_matmul_smallest_tiles(fmt):
  w = _weights((5, 16, 64), fmt, False)
  block_k = dense.MIN_BLOCK_K
  _check_grouped(_activations(33, 64), w, GROUPINGS_33, block_m=16, block_n=16, block_k=block_k)


@pytest.mark.parametrize("m,k,n", [(1, 64, 128), (8, 256, 32)])
def test_grouped_fp4_matmul_shapes(m, k, n):
  w = _weights((4, n, k), "nvfp4", True)
  _check_grouped(_activations(m, k), w, [[0, m, 0, 0], [0, 0, 0, 0], [1, 0, 0, m - 1]])


def test_grouped_bf16_matmul_matches_ragged_dot():
  # The benchmarks' bf16 baseline: the same visits and K loop on bf16 weights.
  rng = np.random.default_rng(2)
  w = jnp.asarray(rng.standard_normal((5, 32, 256)), jnp.bfloat16)
  x = _activations(33, 256)
  run = jax.jit(functools.partial(grouped.grouped_bf16_matmul, out_dtype=jnp.float32, interpret=INTERPRET))
  for sizes in GROUPINGS_33:
    group_sizes = jnp.asarray(sizes, jnp.int32)
    expected = jax.lax.ragged_dot(
      x.astype(jnp.float32), jnp.swapaxes(w, 1, 2).astype(jnp.float32), group_sizes, precision="highest"
    )
    _assert_close(run(x, group_sizes, w), expected)
  with pytest.raises(ValueError, match=r"group_sizes must be integer \[5\]"):
    grouped.grouped_bf16_matmul(x, jnp.ones(4, jnp.int32), w, interpret=INTERPRET)


@pytest.mark.parametrize("sizes", [[5, 0, 20, 0, 3], [1, 1, 1, 1, 1], [0, 33, 0, 0, 0], [16, 16, 1, 0, 0], [0] * 5])
def test_group_metadata_covers_every_row_once_with_tiles_from_group_starts(sizes):
  meta = np.asarray(grouped.make_group_metadata(jnp.asarray(sizes, jnp.int32), 33, 16))
  group, start, end = meta
  assert meta.shape[1] == grouped.num_visits(33, 5, 16) == 3 + 5  # ceil(M / block_m) + E
  covered = np.zeros(33, int)
  bounds = np.concatenate([[0], np.cumsum(sizes), [33]])
  for g, s, e in zip(group, start, end):
    assert s <= e <= s + 16
    if e > s:  # inside its group (E: the rows past the total), never straddling two
      assert bounds[g] <= s and e <= bounds[g + 1] and (s - bounds[g]) % 16 == 0
    covered[s:e] += 1
  np.testing.assert_array_equal(covered, 1)
  # Each group streams its expert ceil(size / 16) times: no expert twice for a group of <= 16 rows.
  visits = np.bincount(group[end > start], minlength=6)[:5]
  np.testing.assert_array_equal(visits, [-(-s // 16) for s in sizes])


def test_grouped_fp4_matmul_rejects_bad_inputs():
  w = _weights((4, 32, 64), "nvfp4", False)
  x = _activations(8, 64)
  with pytest.raises(ValueError, match=r"group_sizes must be integer \[4\]"):
    grouped.grouped_fp4_matmul(x, jnp.ones(3, jnp.int32), w, interpret=INTERPRET)
  with pytest.raises(ValueError, match=r"N=32 is not a multiple of block_n=64"):
    grouped.grouped_fp4_matmul(x, jnp.ones(4, jnp.int32), w, block_n=64, interpret=INTERPRET)
  with pytest.raises(ValueError, match=r"codes must be uint8 of rank 3"):
    grouped.grouped_fp4_matmul(x, jnp.ones(4, jnp.int32), _weights((32, 64), "nvfp4", False), interpret=INTERPRET)


# --- dispatch -----------------------------------------------------------------------------------


def test_packed_matmul_dispatch(monkeypatch):
  w = _weights((32, 64), "nvfp4", True)
  x = _activations(6, 64).reshape(2, 3, 64)
  messages = []
  monkeypatch.setattr(logging, "info", lambda msg, *args: messages.append(msg % args))
  pallas_kernels._log_selection.cache_clear()
  auto = pallas_kernels.packed_matmul(x, w, out_dtype=jnp.float32)
  pallas_kernels.packed_matmul(x, w, out_dtype=jnp.float32)
  kernel = pallas_kernels.packed_matmul(x, w, impl="pallas", out_dtype=jnp.float32, interpret=INTERPRET)
  assert auto.shape == (2, 3, 32) and pallas_kernels.packed_matmul(x, w).dtype == jnp.bfloat16
  _assert_close(kernel, auto)
  # Once per implementation: on CPU the reference (auto, twice) then the kernel; on GPU the kernel.
  chosen = ["pallas"] if jax.default_backend() == "gpu" else ["reference", "pallas"]
  backend = jax.default_backend()
  assert messages == [f"packed_matmul: using the {impl} implementation (backend {backend})." for impl in chosen]
  with pytest.raises(ValueError, match="impl must be"):
    pallas_kernels.packed_matmul(x, w, impl="triton")


def test_a_k_the_triton_kernels_cannot_step_runs_the_reference(monkeypatch):
  # NVFP4 K = 48: whole blocks of 16, but not whole steps of the kernels' smallest block_k (32).
  w, experts = _weights((32, 48), "nvfp4", True), _weights((4, 32, 48), "nvfp4", True)
  x, sizes = _activations(6, 48), jnp.asarray([2, 0, 3, 1], jnp.int32)
  warnings = []
  monkeypatch.setattr(logging, "warning", lambda msg, *args: warnings.append(msg % args))
  pallas_kernels._log_k_fallback.cache_clear()
  for _ in range(2):  # 'mosaic' asks for a kernel: the Triton one for a QuantizedArray, on any backend
    dense_out = pallas_kernels.packed_matmul(x, w, impl="mosaic", out_dtype=jnp.float32)
    grouped_out = pallas_kernels.grouped_packed_matmul(x, sizes, experts, impl="mosaic", out_dtype=jnp.float32)
  _assert_close(dense_out, _dense_reference(x, w, out_dtype=jnp.float32))
  _assert_close(grouped_out, _grouped_reference(x, sizes, experts, out_dtype=jnp.float32))
  assert warnings == [
    f"{op}: K = 48 is not a multiple of 32, the Triton kernels' smallest K step: using the reference."
    for op in ("packed_matmul", "grouped_packed_matmul")
  ]  # once each
  with pytest.raises(ValueError, match="K=48 is not a multiple of 32, the kernel's smallest K step"):
    pallas_kernels.packed_matmul(x, w, impl="pallas", interpret=INTERPRET)


def test_grouped_packed_matmul_dispatch():
  w = _weights((4, 32, 64), "mxfp4", False)
  x = _activations(9, 64)
  sizes = jnp.asarray([3, 0, 4, 1], jnp.int32)
  auto = pallas_kernels.grouped_packed_matmul(x, sizes, w, out_dtype=jnp.float32)
  kernel = pallas_kernels.grouped_packed_matmul(x, sizes, w, impl="pallas", out_dtype=jnp.float32, interpret=INTERPRET)
  _assert_close(kernel, auto)


# --- GPU lowering without a GPU -----------------------------------------------------------------


@pytest.mark.parametrize("fmt,with_tensor_scale,ptx_decode", [("nvfp4", True, False), ("mxfp4", False, True)])
def test_kernels_lower_to_triton(fmt, with_tensor_scale, ptx_decode):
  lower = lambda f, *args: jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  x = jnp.zeros((8, 768), jnp.bfloat16)
  options = dict(interpret=False, ptx_decode=ptx_decode)
  w = _weights((256, 768), fmt, with_tensor_scale)
  text = lower(functools.partial(dense.fp4_matmul, quantize_activations=True, **options), x, w)
  assert "__gpu$xla.gpu.triton" in text
  experts = _weights((4, 64, 768), fmt, with_tensor_scale)
  text = lower(functools.partial(grouped.grouped_fp4_matmul, **options), x, jnp.ones(4, jnp.int32), experts)
  assert "__gpu$xla.gpu.triton" in text


# --- compiled on a GPU only ---------------------------------------------------------------------


@pytest.mark.skipif(INTERPRET, reason="inline PTX runs on the GPU only (its emulation is tested above)")
@pytest.mark.parametrize("fmt,with_tensor_scale", WEIGHT_FORMATS)
def test_ptx_decode_matches_reference(fmt, with_tensor_scale):
  w, experts = _weights((128, 256), fmt, with_tensor_scale), _weights((5, 32, 256), fmt, with_tensor_scale)
  x = _activations(33, 256)
  kw = dict(quantize_activations=True, out_dtype=jnp.float32)
  _assert_close(dense.fp4_matmul(x, w, ptx_decode=True, interpret=False, **kw), _dense_reference(x, w, **kw))
  _check_grouped(x, experts, GROUPINGS_33[:2], ptx_decode=True, quantize_activations=True)
