"""Guided FP4 fake-quantization (trace_jax.quantizer): properties of guided rounding, edge cases, STE, guidance size."""

import dataclasses
import functools

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from trace_jax import fp4, qat
from trace_jax.config import MOE_INPUT, QuantConfig
from trace_jax.quantizer import (
  GUIDANCE_FORMS,
  Guidance,
  fake_quant,
  fake_quant_codes,
  guidance_from_quantized,
  make_guidance,
)

SHAPE = (4, 32)  # fixed, so each jitted function compiles once per guidance form
NBLOCKS = SHAPE[1] // 16
NV = fp4.NVFP4
PROPS = settings(max_examples=50, deadline=None, database=None)

xs = hnp.arrays(
  np.float32, SHAPE, elements=st.floats(-3e4, 3e4, width=32, allow_subnormal=False), unique=False
)  # up to 3e4: NVFP4's scale clamp at 448 (saturation) is reached too
rollout_codes = hnp.arrays(np.uint8, SHAPE, elements=st.integers(0, 15))
mantissa_bits = hnp.arrays(np.uint8, SHAPE, elements=st.integers(0, 1))
# Positive normal E4M3 scales 2**-6 .. 448, as a rollout stores them.
e4m3_scales = hnp.arrays(np.uint8, (SHAPE[0], NBLOCKS), elements=st.integers(0x08, 0x7E))


def as_e4m3(bits) -> jax.Array:
  return jnp.asarray(np.asarray(bits, np.uint8).view(jnp.float8_e4m3fn))


@functools.partial(jax.jit, static_argnames=("guided",))
def run(x, g=None, guided=True):
  """(values, stats, codes, sign, lo, hi) of the fake-quantizer; neighbours of x / scale as it uses them."""
  values, stats = fake_quant(x, "nvfp4", g, guided=guided)
  codes = fake_quant_codes(x, "nvfp4", g, guided=guided)
  blocks = fp4.to_blocks(x.astype(jnp.float32), NV)
  if g is not None and g.scales is not None:
    reciprocal = fp4.reciprocal_from_scales(g.scales, NV, g.tensor_scale)
  else:
    reciprocal = fp4.compute_scales(blocks, NV)[1]
  sign, lo, hi = fp4.neighbors(fp4.scale_blocks(blocks, reciprocal, NV))
  return values, stats, codes, *(a.reshape(x.shape) for a in (sign, lo, hi))


@functools.partial(jax.jit, static_argnames=("form",))
def guidance_of(x, form, tensor_amax=None):
  return make_guidance(x, "nvfp4", form, tensor_amax=tensor_amax)


quant = jax.jit(fake_quant, static_argnames=("fmt", "guided", "clip_gradient", "axis"))
quant_codes = jax.jit(fake_quant_codes, static_argnames=("fmt", "guided"))


def value(codes) -> np.ndarray:
  return np.asarray(fp4.e2m1_to_float(jnp.asarray(codes)))


def full_guidance(codes, scales) -> Guidance:
  return Guidance(codes=fp4.pack_nibbles(jnp.asarray(codes, jnp.uint8)), scales=scales)


# --- properties ---------------------------------------------------------------------------------


@PROPS
@given(xs)
def test_own_guidance_reproduces_rtn(x):
  """Guidance recorded from x itself gives exactly RTN, and every element matches (its code, or its mantissa bit
  where only bits were shipped)."""
  rtn_values, rtn_stats, rtn_codes, *_ = run(x)
  assert int(rtn_stats.total) == 0 and int(rtn_stats.matches) == 0  # guidance off: no stats
  for form in GUIDANCE_FORMS:
    g, _ = guidance_of(x, form)
    values, stats, codes, *_ = run(x, g)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(rtn_values), err_msg=form)
    np.testing.assert_array_equal(np.asarray(codes), np.asarray(rtn_codes), err_msg=form)
    matches, total = (stats.matches, stats.total) if form == "full" else (stats.bit_matches, stats.bit_total)
    assert int(matches) == int(total) == x.size, form
    assert int(stats.non_adjacent) == 0, form


@PROPS
@given(xs, rollout_codes, mantissa_bits, e4m3_scales)
def test_guided_code_is_a_neighbour(x, r_codes, bits, scale_bits):
  """Whatever the rollout says, the trainer's code is one of the two E2M1 neighbours of x / scale."""
  scales = as_e4m3(scale_bits)
  for g in (
    full_guidance(r_codes, scales),
    Guidance(mantissa_bits=fp4.pack_bits(jnp.asarray(bits)), scales=scales),
    Guidance(mantissa_bits=fp4.pack_bits(jnp.asarray(bits))),
  ):
    codes, sign, lo, hi = (np.asarray(a) for a in run(x, g)[2:])
    mag = codes & 7
    assert np.all((mag == lo) | (mag == hi))
    np.testing.assert_array_equal(codes >> 3, sign)


@PROPS
@given(xs, rollout_codes, e4m3_scales)
def test_guided_is_never_farther_from_the_rollout_than_rtn(x, r_codes, scale_bits):
  """|guided - rollout| <= |RTN - rollout| elementwise, on the rollout's scales; so it matches at least as often."""
  g = full_guidance(r_codes, as_e4m3(scale_bits))
  guided, stats, *_ = run(x, g)
  rtn, rtn_stats, *_ = run(x, g, guided=False)
  rollout = fp4.dequantize(fp4.QuantizedArray(g.codes, g.scales, None, NV))
  d_guided = np.abs(np.asarray(guided, np.float64) - np.asarray(rollout, np.float64))
  d_rtn = np.abs(np.asarray(rtn, np.float64) - np.asarray(rollout, np.float64))
  assert np.all(d_guided <= d_rtn)
  assert int(stats.matches) >= int(rtn_stats.matches)


@PROPS
@given(xs, st.floats(1e-3, 0.3), st.integers(0, 2**31 - 1))
def test_compact_guidance_reproduces_rollout_neighbours(x, noise, seed):
  """Rollout = RTN of a perturbed x. Wherever its code is a neighbour of x / scale, mantissa-only guidance
  (with the rollout's scales) and full guidance both reproduce it exactly."""
  rng = np.random.default_rng(seed)
  x_rollout = (x * (1 + noise * rng.standard_normal(x.shape))).astype(np.float32)
  g_full, q = guidance_of(x_rollout, "full")
  g_bits, _ = guidance_of(x_rollout, "mantissa_scale")
  r_codes = np.asarray(fp4.unpack_nibbles(q.codes))
  for g in (g_bits, g_full):
    _, stats, *arrays = run(x, g)
    codes, sign, lo, hi = (np.asarray(a) for a in arrays)
    r_mag, r_sign = r_codes & 7, r_codes >> 3
    neighbour = ((r_mag == lo) | (r_mag == hi)) & ((r_sign == sign) | (r_mag == 0))
    np.testing.assert_array_equal(value(codes)[neighbour], value(r_codes)[neighbour])
    if g is g_full:  # full codes: matches count exactly the elements equal by value
      assert int(stats.matches) == int(np.sum(value(codes) == value(r_codes)))
      assert int(stats.total) == x.size
    else:  # mantissa bits: bit_matches count the elements whose mantissa bit is the rollout's
      assert int(stats.bit_matches) == int(np.sum((codes & 1) == (r_codes & 1)))
      assert int(stats.bit_total) == x.size


@PROPS
@given(xs, rollout_codes, e4m3_scales)
def test_compact_guidance_against_any_rollout_code(x, r_codes, scale_bits):
  """What holds for the compact form, whatever the rollout's codes (full codes ride along to measure): the chosen
  code is a neighbour of x / scale; it is the rollout's wherever the rollout's code is a neighbour; every other
  element is a miss, counted as non-adjacent, though its mantissa bit may agree. Full-code guidance hits the same
  elements."""
  scales = as_e4m3(scale_bits)
  g_full = full_guidance(r_codes, scales)
  g_both = dataclasses.replace(g_full, mantissa_bits=fp4.pack_bits(jnp.asarray(r_codes & 1)))
  r_mag, r_sign = r_codes & 7, r_codes >> 3
  for g in (g_both, g_full):
    _, stats, *arrays = run(x, g)
    codes, sign, lo, hi = (np.asarray(a) for a in arrays)
    mag = codes & 7
    assert np.all((mag == lo) | (mag == hi))
    neighbour = ((r_mag == lo) | (r_mag == hi)) & ((r_sign == sign) | (r_mag == 0))
    hit = value(codes) == value(r_codes)
    np.testing.assert_array_equal(hit, neighbour)
    assert int(stats.non_adjacent) == int(np.sum(~neighbour))
    assert int(stats.matches) == int(stats.total) - int(stats.non_adjacent) == int(np.sum(neighbour))
  assert int(run(x, g_both)[1].bit_matches) >= int(run(x, g_both)[1].matches)


def test_compact_guidance_can_land_farther_than_rtn():
  """x / scale = 1.4 (neighbours 1 and 1.5, RTN 1.5), rollout 2, two steps up: its mantissa bit (0) picks 1,
  farther from 2 than RTN; the bit agrees, the code does not, and the element counts as non-adjacent. Full codes
  pick 1.5, the neighbour nearest to 2."""
  x = jnp.zeros((1, 16), jnp.float32).at[0, 0].set(1.4 * 2.0)
  r_codes = np.zeros((1, 16), np.uint8)
  r_codes[0, 0] = 4  # 2.0
  scales = jnp.full((1, 1), 2.0, jnp.float8_e4m3fn)
  g_full = full_guidance(r_codes, scales)
  g_both = dataclasses.replace(g_full, mantissa_bits=fp4.pack_bits(jnp.asarray(r_codes & 1)))
  assert value(quant_codes(x, "nvfp4", g_both))[0, 0] == 1.0
  rtn = quant_codes(x, "nvfp4", g_full, guided=False)  # on the rollout's scales
  assert value(quant_codes(x, "nvfp4", g_full))[0, 0] == value(rtn)[0, 0] == 1.5
  stats = quant(x, "nvfp4", g_both)[1]
  assert (int(stats.bit_matches), int(stats.matches), int(stats.non_adjacent)) == (16, 15, 1)


def test_bit_agreement_is_not_code_agreement():
  """Mantissa bits alone give no codeword agreement (total 0): they count as bit agreement, which guided rounding
  forces. With the diagnostic codes alongside, code agreement is measured and is lower."""
  rng = np.random.default_rng(5)
  x = rng.standard_normal(SHAPE).astype(np.float32)
  g_full, q = guidance_of((x * (1 + 0.5 * rng.standard_normal(SHAPE))).astype(np.float32), "full")
  g_bits = guidance_from_quantized(q, "mantissa_scale")
  stats = run(x, g_bits)[1]
  assert int(stats.matches) == int(stats.total) == int(stats.non_adjacent) == 0
  assert int(stats.bit_total) == x.size and int(stats.bit_matches) > 0.99 * x.size
  both = run(x, dataclasses.replace(g_bits, codes=g_full.codes))[1]
  assert int(both.total) == x.size and int(both.bit_matches) == int(stats.bit_matches)
  assert int(both.matches) == x.size - int(both.non_adjacent) < int(both.bit_matches)


# --- edge cases (SPEC section 2) ------------------------------------------------------------------


def edge(x_scaled, r_codes, scale=2.0, form="full"):
  """One NVFP4 block: x = x_scaled * scale with rollout scale `scale`; returns (codes, matches, total)."""
  x_scaled = np.asarray(x_scaled, np.float32)
  n = x_scaled.size
  x = np.zeros((1, 16), np.float32)
  x[0, :n] = x_scaled * np.float32(scale)
  codes = np.zeros((1, 16), np.uint8)
  codes[0, :n] = r_codes
  scales = jnp.full((1, 1), scale, jnp.float8_e4m3fn)
  if form == "full":
    g = full_guidance(codes, scales)
  else:
    g = Guidance(mantissa_bits=fp4.pack_bits(jnp.asarray(codes & 1)), scales=scales)
  out, stats = quant(jnp.asarray(x), "nvfp4", g)
  got = np.asarray(quant_codes(jnp.asarray(x), "nvfp4", g))[0, :n]
  np.testing.assert_array_equal(np.asarray(out)[0, :n], value(got) * np.float32(scale))
  return got, int(stats.matches) - (16 - n), n  # the zero padding always matches


def code(v: float) -> int:
  """The E2M1 code of a grid value (-0.0 -> 8)."""
  if v == 0:
    return 8 if np.signbit(v) else 0
  return fp4.E2M1_VALUES.tolist().index(v)


def test_saturation_keeps_six():
  """Beyond +/-6 both neighbours are 6: whatever the rollout says, the code stays +/-6."""
  sign, lo, hi = jax.jit(fp4.neighbors)(jnp.asarray([7.0, -9.0, 6.0], jnp.float32))
  np.testing.assert_array_equal(np.asarray(lo), [7, 7, 7])
  np.testing.assert_array_equal(np.asarray(hi), [7, 7, 7])
  got, matches, n = edge([7.0, -9.0, 100.0, 6.5], [code(4.0), code(-3.0), code(6.0), code(0.0)])
  np.testing.assert_array_equal(got, [code(6.0), code(-6.0), code(6.0), code(6.0)])
  assert matches == 1  # only the rollout code 6 agrees


def test_on_grid_has_one_neighbour():
  got, matches, n = edge([1.5, 1.5, -3.0], [code(2.0), code(1.5), code(-4.0)])
  np.testing.assert_array_equal(got, [code(1.5), code(1.5), code(-3.0)])
  assert matches == 1


def test_signed_zeros():
  """+0 and -0 keep their sign bit; they match a rollout zero of either sign (equal by value)."""
  got, matches, n = edge([0.0, -0.0, 0.0, -0.0], [0x8, 0x0, 0x0, code(0.5)])
  np.testing.assert_array_equal(got, [0x0, 0x8, 0x0, 0x8])
  assert matches == 3


def test_sign_change_near_zero():
  """x = -0.2 * scale: its neighbours are -0 and -0.5. Rollout +0.5 -> pick 0 (nearer); rollout -0.5 -> -0.5."""
  got, matches, _ = edge([-0.2, -0.2, 0.2], [code(0.5), code(-0.5), code(-0.5)])
  np.testing.assert_array_equal(value(got), [0.0, -0.5, 0.0])
  assert matches == 1
  # One mantissa bit cannot see the sign: with compact guidance, rollout +0.5 (bit 1) selects -0.5.
  got, _, _ = edge([-0.2, -0.2], [code(0.5), code(-0.5)], form="mantissa_scale")
  np.testing.assert_array_equal(value(got), [-0.5, -0.5])


def test_non_neighbour_rollout_picks_nearer_neighbour_and_misses():
  """x = 1.2 * scale (neighbours 1, 1.5): rollout 3 -> 1.5; rollout 0 or -2 -> 1; none of them matches."""
  got, matches, n = edge([1.2, 1.2, 1.2, -1.2], [code(3.0), code(0.0), code(-2.0), code(6.0)])
  np.testing.assert_array_equal(value(got), [1.5, 1.0, 1.0, -1.0])
  assert matches == 0 and n == 4


def test_unguided_mode_rounds_to_nearest_but_counts_matches():
  """guided=False: RTN on the guidance's scales (the qat mode's diagnostic), matches still counted."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal(SHAPE).astype(np.float32)
  x_rollout = (x * (1 + 0.2 * rng.standard_normal(SHAPE))).astype(np.float32)
  g, q = guidance_of(x_rollout, "full")
  values, stats, codes, *_ = run(x, g, guided=False)

  # Reference RTN on the rollout's scales, from fp4 primitives.
  @jax.jit
  def reference(x, scales):
    blocks = fp4.to_blocks(x, NV)
    codes = fp4.float_to_e2m1(fp4.scale_blocks(blocks, fp4.reciprocal_from_scales(scales, NV), NV))
    return codes.reshape(SHAPE), (fp4.e2m1_to_float(codes) * scales.astype(jnp.float32)[..., None]).reshape(SHAPE)

  ref_codes, want_values = reference(jnp.asarray(x), g.scales)
  np.testing.assert_array_equal(np.asarray(codes), np.asarray(ref_codes))
  np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
  r = np.asarray(fp4.unpack_nibbles(q.codes))
  assert int(stats.matches) == int(np.sum(value(codes) == value(r))) < x.size
  assert int(stats.total) == x.size
  # Guided rounding on the same guidance agrees more often.
  assert int(run(x, g)[1].matches) > int(stats.matches)
  # Without scales in the guidance, unguided fake-quant is plain RTN.
  g_bits, _ = guidance_of(x_rollout, "mantissa")
  np.testing.assert_array_equal(np.asarray(run(x, g_bits, guided=False)[0]), np.asarray(run(x)[0]))


def test_bits_round_codes_measure():
  """Guidance with both mantissa bits and codes: rounding follows the bits, agreement is measured on the codes."""
  rng = np.random.default_rng(1)
  x = rng.standard_normal(SHAPE).astype(np.float32)
  g_full, q = guidance_of((x * (1 + 0.3 * rng.standard_normal(SHAPE))).astype(np.float32), "full")
  bits = rng.integers(0, 2, SHAPE).astype(np.uint8)
  g_bits = Guidance(mantissa_bits=fp4.pack_bits(jnp.asarray(bits)), scales=g_full.scales)
  g_both = Guidance(mantissa_bits=g_bits.mantissa_bits, codes=g_full.codes, scales=g_full.scales)
  _, stats, codes, *_ = run(x, g_both)
  np.testing.assert_array_equal(np.asarray(codes), np.asarray(run(x, g_bits)[2]))
  r = np.asarray(fp4.unpack_nibbles(q.codes))
  assert int(stats.matches) == int(np.sum(value(codes) == value(r)))


# --- straight-through gradient ----------------------------------------------------------------------


def saturating_case(dtype):
  """x, guidance whose cached scales are half of what x needs (so about half the elements saturate), mask."""
  x = jnp.asarray(np.random.default_rng(2).standard_normal(SHAPE), dtype)
  g, _ = guidance_of((x.astype(jnp.float32) * 0.5).astype(dtype), "mantissa_scale")
  blocks = fp4.to_blocks(np.asarray(x, np.float32), NV)
  scaled = blocks * (np.float32(1) / np.asarray(g.scales.astype(jnp.float32)))[..., None]  # as torchao scales
  out_of_range = (np.abs(scaled) > 6).reshape(SHAPE)
  assert 0 < out_of_range.sum() < out_of_range.size
  return x, g, out_of_range


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ste_gradient(dtype):
  x, g, out_of_range = saturating_case(dtype)
  for guidance in (None, g):
    grad = jax.jit(jax.grad(lambda v, g=guidance: fake_quant(v, "nvfp4", g)[0].astype(jnp.float32).sum()))(x)
    assert grad.dtype == dtype
    np.testing.assert_array_equal(np.asarray(grad, np.float32), 1.0)
  clip = jax.jit(jax.grad(lambda v: fake_quant(v, "nvfp4", g, clip_gradient=True)[0].astype(jnp.float32).sum()))
  np.testing.assert_array_equal(np.asarray(clip(x), np.float32), np.where(out_of_range, 0.0, 1.0))
  # Saturated elements really are +/-6 * scale (the forward the mask refers to).
  values = np.asarray(quant(x, "nvfp4", g)[0], np.float32)
  s = np.repeat(np.asarray(g.scales.astype(jnp.float32)), 16, axis=-1)
  np.testing.assert_array_equal(np.abs(values)[out_of_range], 6 * s[out_of_range])


def test_vmap_and_grad_compose():
  """vmap over rows (with per-row guidance) equals the batched call; grad under vmap is the STE."""
  x, g, out_of_range = saturating_case(jnp.float32)
  batched, stats = quant(x, "nvfp4", g)
  per_row, row_stats = jax.jit(jax.vmap(lambda v, gr: fake_quant(v, "nvfp4", gr)))(x, g)
  np.testing.assert_array_equal(np.asarray(per_row), np.asarray(batched))
  assert int(row_stats.matches.sum()) == int(stats.matches) and row_stats.matches.shape == (SHAPE[0],)
  grad_row = lambda v, gr: jax.grad(lambda u: fake_quant(u, "nvfp4", gr, clip_gradient=True)[0].sum())(v)
  grads = jax.jit(jax.vmap(grad_row))(x, g)
  np.testing.assert_array_equal(np.asarray(grads), np.where(out_of_range, 0.0, 1.0))


def test_axis_argument_equals_transposing():
  """Blocks along axis 0 are the same as transposing, quantizing along the last axis and transposing back."""
  x = jnp.asarray(np.random.default_rng(3).standard_normal((32, 6)), jnp.float32)
  g, _ = guidance_of((x.T * 1.1).astype(jnp.float32), "full")  # laid out like x.T
  for guidance in (None, g):
    got, stats = quant(x, "nvfp4", guidance, axis=0)
    want, want_stats = quant(x.T, "nvfp4", guidance)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want).T)
    assert int(stats.matches) == int(want_stats.matches)
  grad = jax.jit(jax.grad(lambda v: (fake_quant(v, "nvfp4", g, axis=0)[0] * jnp.arange(6.0)).sum()))(x)
  np.testing.assert_array_equal(np.asarray(grad), np.broadcast_to(np.arange(6.0), (32, 6)))


# --- two-level NVFP4 ------------------------------------------------------------------------------


def test_two_level_guidance_per_row_reproduces_the_rollout_in_every_form():
  """Two-level NVFP4 as the engine records it: each of T steps quantizes its B rows under the amax of
  that step, and the tensor scale is kept per row. The trainer (QatContext: rows flattened and
  vmapped) fed the same values rounds to the rollout's codes in every form; one amax for the whole
  tensor would not. Its RTN is two-level over its own batch."""
  rng = np.random.default_rng(5)
  b, t, k = 4, 3, 32
  x = (rng.standard_normal((b, t, k)) * np.exp(rng.uniform(-8, 4, (1, t, 1)))).astype(np.float32)
  steps = [fp4.quantize(jnp.asarray(x[:, i]), "nvfp4", tensor_amax=jnp.max(jnp.abs(x[:, i]))) for i in range(t)]
  stack = lambda *a: jnp.stack([jnp.broadcast_to(v, a[0].shape) for v in a], axis=1)
  per_row = lambda *ts: jnp.stack([jnp.broadcast_to(v, (b,)) for v in ts], axis=1)
  q = fp4.QuantizedArray(
    stack(*(s.codes for s in steps)), stack(*(s.scales for s in steps)), per_row(*(s.tensor_scale for s in steps)), NV
  )
  assert q.tensor_scale.shape == (b, t)
  whole = fp4.quantize(jnp.asarray(x), "nvfp4", tensor_amax=jnp.max(jnp.abs(x)))
  assert not np.array_equal(np.asarray(whole.codes), np.asarray(q.codes))  # the per-step scale matters
  ctx = qat.QatContext(QuantConfig(tensor_scale="batch_amax"), guided=True)
  run_ctx = jax.jit(lambda v, g: ctx.guided_activation(v, "experts", g, MOE_INPUT))
  for form in GUIDANCE_FORMS:
    g = dataclasses.replace(guidance_from_quantized(q, form), codes=q.codes)  # codes to measure agreement
    assert g.tensor_scale is not None, form
    values, stats = run_ctx(jnp.asarray(x), g)
    assert int(stats.matches.sum()) == int(stats.total.sum()) == x.size, form
    np.testing.assert_array_equal(np.asarray(values), np.asarray(fp4.dequantize(q)), err_msg=form)
  rtn = jax.jit(lambda v: ctx.activation(v, "experts"))(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(rtn), np.asarray(fp4.dequantize(whole)))
  single = qat.QatContext(QuantConfig(), guided=True).activation(jnp.asarray(x), "experts")
  np.testing.assert_array_equal(np.asarray(single), np.asarray(fp4.dequantize(fp4.quantize(jnp.asarray(x)))))


# --- guidance size and validation -------------------------------------------------------------------


def test_guidance_bytes():
  """[8, 1024] NVFP4: 1 bit, 1.5 bits and 4.5 bits per element."""
  x = jnp.asarray(np.random.default_rng(4).standard_normal((8, 1024)), jnp.bfloat16)
  nbytes = {form: guidance_of(x, form)[0].nbytes for form in GUIDANCE_FORMS}
  assert nbytes == {"mantissa": 1024, "mantissa_scale": 1024 + 512, "full": 4096 + 512}
  bits_per_element = {form: 8 * n / x.size for form, n in nbytes.items()}
  assert bits_per_element == {"mantissa": 1.0, "mantissa_scale": 1.5, "full": 4.5}
  assert nbytes["full"] / nbytes["mantissa"] == 4.5 and nbytes["mantissa_scale"] / nbytes["mantissa"] == 1.5
  two_level = guidance_of(x, "mantissa_scale", jnp.max(jnp.abs(x)))[0]
  assert two_level.nbytes == 1024 + 512 + 4  # + the float32 tensor scale


def test_bad_guidance_shape_is_a_clear_error():
  """Raised while tracing (eval_shape: nothing compiles)."""
  x = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
  fq = lambda g, x=x: jax.eval_shape(lambda v: fake_quant(v, "nvfp4", g), x)
  scales = jnp.ones((2, 4), jnp.float8_e4m3fn)  # from a (2, 64) tensor: same size, wrong layout
  with pytest.raises(ValueError, match=r"guidance.scales has shape \(2, 4\).*\(4, 32\).*needs \(4, 2\)"):
    fq(Guidance(codes=jnp.zeros((2, 32), jnp.uint8), scales=scales))
  with pytest.raises(ValueError, match=r"guidance.codes has shape \(1, 16\).*needs \(4, 16\)"):
    fq(Guidance(codes=jnp.zeros((1, 16), jnp.uint8)))  # would broadcast silently
  with pytest.raises(ValueError, match=r"guidance.mantissa_bits has shape \(4, 2\).*needs \(4, 4\)"):
    fq(Guidance(mantissa_bits=jnp.zeros((4, 2), jnp.uint8)))
  with pytest.raises(ValueError, match=r"\(4, 24\).*block size 16"):
    fq(None, jax.ShapeDtypeStruct((4, 24), jnp.float32))
  fq(Guidance(codes=jnp.zeros((4, 16), jnp.uint8), scales=jnp.ones((4, 2), jnp.float8_e4m3fn)))  # right shapes
