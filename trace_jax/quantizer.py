"""The rollout-guided FP4 fake-quantizer (a custom_vjp) and the guidance it consumes.

The rollout engine quantizes an activation with round-to-nearest (RTN) and records, per
element, which E2M1 codeword it used. The trainer's QAT forward then rounds *its own*
activation, divided by the (rollout's) block scale, to whichever of its two E2M1 neighbours
agrees with the rollout (SPEC section 2), instead of to the nearest. Adjacent E2M1 grid points
always differ in the mantissa bit, so one bit per element is enough to pick the neighbour:

  form              what the rollout ships per element            bits/element (NVFP4)
  'mantissa'        mantissa bit                                   1
  'mantissa_scale'  mantissa bit + the rollout's block scales      1.5
  'full'            full 4-bit code + block scales (diagnostics)   4.5

With full codes, guided rounding is never farther from the rollout's code than RTN: it takes the
neighbour nearest to the rollout's value. With mantissa bits alone that holds only where the
rollout's code is one of the two neighbours (the bit then picks it exactly). Where the rollout's
code lies two or more grid steps away, the bit can pick the farther neighbour (x / scale = 1.4,
rollout 2: the bit 0 picks 1, RTN gives 1.5), and the bit still agrees: mantissa-bit agreement
says nothing about codeword agreement, which `QuantStats` counts apart, with the non-adjacent
cases, wherever full codes are at hand.

Backward: straight-through; with `clip_gradient=True` the gradient is zeroed where the
input, divided by its scale, lay beyond the representable +/-6.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp

from trace_jax import fp4

GuidanceForm = Literal["mantissa", "mantissa_scale", "full"]
GUIDANCE_FORMS = ("mantissa", "mantissa_scale", "full")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Guidance:
  """What the rollout recorded for one quantized tensor. Unused fields are None.

  mantissa_bits: uint8 [..., K/8], the rollout code's mantissa bit, 8 elements per byte.
  codes:         uint8 [..., K/2], full rollout codes (two per byte), for 'full' guidance;
                 alongside mantissa_bits they only serve to measure agreement.
  scales:        [..., K/block] the rollout's block scales; None = trainer computes its own.
  tensor_scale:  float32, the rollout's NVFP4 second-level scale if it used one: a scalar, or one
                 per row [...] (the engine's amax differs between its batches: prefill, each
                 decode step). Without scales the trainer computes its block scales under it.
  """

  mantissa_bits: jax.Array | None = None
  codes: jax.Array | None = None
  scales: jax.Array | None = None
  tensor_scale: jax.Array | None = None

  @property
  def nbytes(self) -> int:
    leaves = jax.tree_util.tree_leaves(self)
    return int(sum(leaf.size * leaf.dtype.itemsize for leaf in leaves))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantStats:
  """How the trainer's codes compare with the rollout's, for one tensor (int32 scalars).

  matches / total: elements whose code equals the rollout's full code (by value, so +0 == -0),
    counted only where the guidance carries full codes; 0 / 0 without them.
  bit_matches / bit_total: elements whose mantissa bit equals the rollout's, where the guidance
    carries mantissa bits. Guided rounding forces the bit wherever x / scale has two neighbours,
    so this is no measure of codeword agreement.
  non_adjacent: among `total`, elements whose rollout code is neither E2M1 neighbour of
    x / scale (the paths diverged by two or more grid steps, or x / scale sits on the grid next
    to a rollout code off it): no rounding of x reproduces it. Every such element is a mismatch,
    so `total - matches - non_adjacent` mismatches are one codeword apart.
  With guidance off every count is 0.
  """

  matches: jax.Array
  total: jax.Array
  bit_matches: jax.Array
  bit_total: jax.Array
  non_adjacent: jax.Array


def guidance_from_quantized(q: fp4.QuantizedArray, form: GuidanceForm = "mantissa_scale") -> Guidance:
  """The rollout side: what to cache for the trainer, from the rollout's RTN quantization."""
  if form not in GUIDANCE_FORMS:
    raise ValueError(f"Unknown guidance form {form!r}: expected one of {GUIDANCE_FORMS}.")
  if form == "full":
    return Guidance(codes=q.codes, scales=q.scales, tensor_scale=q.tensor_scale)
  bits = fp4.pack_bits(fp4.mantissa_bit(fp4.unpack_nibbles(q.codes)))
  if form == "mantissa":  # the trainer's own block scales sit under the rollout's tensor scale
    return Guidance(mantissa_bits=bits, tensor_scale=q.tensor_scale)
  return Guidance(mantissa_bits=bits, scales=q.scales, tensor_scale=q.tensor_scale)


def make_guidance(x: jax.Array, fmt="nvfp4", form: GuidanceForm = "mantissa_scale", *, tensor_amax=None):
  """Quantize `x` with RTN as the rollout does; returns (guidance, quantized array)."""
  q = fp4.quantize(x, fmt, tensor_amax=tensor_amax)
  return guidance_from_quantized(q, form), q


def _count(mask: jax.Array) -> jax.Array:
  """Number of True in `mask` [..., nblocks, block], as int32.

  Per block first, behind a barrier: XLA then fuses the rounding into a row reduction instead
  of writing a 4-byte-per-element mask and summing it (guided fake-quant ~1.4x faster on CPU).
  """
  return jnp.sum(jax.lax.optimization_barrier(jnp.sum(mask, axis=-1, dtype=jnp.int32)))


def _round(x: jax.Array, fmt: fp4.Fp4Format, guidance: Guidance | None, tensor_amax, guided: bool):
  """Forward of the fake-quantizer along the last axis.

  Returns (dequantized float32, in_range mask, QuantStats, unpacked codes).
  """
  fp4.check_blocks(x.shape, fmt, "fake_quant")
  blocks = fp4.to_blocks(x.astype(jnp.float32), fmt)
  g = guidance if guidance is not None else Guidance()
  # Checked up front: a mis-shaped field would otherwise broadcast or reshape silently.
  for name, field, want in (
    ("scales", g.scales, blocks.shape[:-1]),
    ("codes", g.codes, (*x.shape[:-1], x.shape[-1] // 2)),
    ("mantissa_bits", g.mantissa_bits, (*x.shape[:-1], x.shape[-1] // 8)),
  ):
    if field is not None and field.shape != want:
      raise ValueError(
        f"guidance.{name} has shape {field.shape} but an input of shape {x.shape} in {fmt.name} "
        f"needs {want}: guidance must be laid out like the tensor it guides."
      )
  if g.tensor_scale is not None and g.tensor_scale.ndim and g.tensor_scale.shape != x.shape[:-1]:
    raise ValueError(f"guidance.tensor_scale has shape {g.tensor_scale.shape}; one per row needs {x.shape[:-1]}.")
  if g.scales is not None:
    scales, tensor_scale = g.scales, g.tensor_scale
    reciprocal = fp4.reciprocal_from_scales(scales, fmt, tensor_scale)
  else:
    tensor_scale = g.tensor_scale
    if tensor_scale is None and tensor_amax is not None:
      tensor_scale = fp4.tensor_scale_from_amax(tensor_amax)
    scales, reciprocal = fp4.compute_scales(blocks, fmt, tensor_scale)
  scaled = fp4.scale_blocks(blocks, reciprocal, fmt)
  sign, lo, hi = fp4.neighbors(scaled)
  rtn = fp4.round_to_nearest_index(scaled, lo, hi)

  # Rounding follows the mantissa bits when present (TRACE's compact guidance), else the
  # full codes. Codeword agreement needs the full codes (diagnostics ship them alongside the
  # bits); bit agreement is counted apart.
  index = rtn
  matches = total = bit_matches = bit_total = non_adjacent = jnp.zeros((), jnp.int32)
  if g.codes is not None:
    rollout = fp4.to_blocks(fp4.unpack_nibbles(g.codes), fmt)
    r_mag, r_sign = rollout & 7, rollout >> 3
    if guided and g.mantissa_bits is None:
      # The rollout value is on our side of zero (or zero): take the neighbour nearest to it.
      # On the other side: the neighbour nearer zero is the nearer one.
      index = jnp.where(((r_sign == sign) | (r_mag == 0)) & (r_mag >= hi), hi, lo)
  if g.mantissa_bits is not None:
    bits = fp4.to_blocks(fp4.unpack_bits(g.mantissa_bits), fmt)
    if guided:
      index = jnp.where((lo & 1) == bits, lo, hi)
    bit_matches, bit_total = _count((index & 1) == bits), jnp.asarray(bits.size, jnp.int32)
  if g.codes is not None:
    same = (index == r_mag) & ((index == 0) | (r_sign == sign))  # equal values; +0 == -0
    neighbour = ((r_mag == lo) | (r_mag == hi)) & ((r_mag == 0) | (r_sign == sign))
    matches, total = _count(same), jnp.asarray(rollout.size, jnp.int32)
    non_adjacent = _count(~neighbour)
  codes = fp4.encode(sign, index, scaled)
  values = fp4.e2m1_to_float(codes) * fp4.dequant_scales(scales, tensor_scale)[..., None]
  in_range = jnp.abs(scaled) <= fp4.E2M1_MAX
  stats = QuantStats(matches, total, bit_matches, bit_total, non_adjacent)
  return values.reshape(x.shape), in_range.reshape(x.shape), stats, codes.reshape(x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 4, 5))
def _fake_quant(x, fmt, guidance, tensor_amax, guided, clip_gradient):
  values, _, stats, _ = _round(x, fmt, guidance, tensor_amax, guided)
  return values.astype(x.dtype), stats


def _fake_quant_fwd(x, fmt, guidance, tensor_amax, guided, clip_gradient):
  values, in_range, stats, _ = _round(x, fmt, guidance, tensor_amax, guided)
  return (values.astype(x.dtype), stats), (in_range if clip_gradient else None, guidance, tensor_amax)


def _fake_quant_bwd(fmt, guided, clip_gradient, residuals, cotangents):
  in_range, guidance, tensor_amax = residuals
  dy, _ = cotangents
  dx = jnp.where(in_range, dy, jnp.zeros_like(dy)) if clip_gradient else dy
  no_grad = lambda t: jax.tree_util.tree_map(jnp.zeros_like, t)  # noqa: E731  (integer leaves)
  return dx, no_grad(guidance), no_grad(tensor_amax)


_fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)


def fake_quant(
  x: jax.Array,
  fmt: str | fp4.Fp4Format = "nvfp4",
  guidance: Guidance | None = None,
  *,
  tensor_amax: jax.Array | None = None,
  guided: bool = True,
  clip_gradient: bool = False,
  axis: int = -1,
) -> tuple[jax.Array, QuantStats]:
  """FP4 fake-quantization of `x` with blocks along `axis`; returns (values in x.dtype, stats).

  guidance=None: round to nearest (vanilla QAT). With guidance and `guided=True`: TRACE's
  guided rounding, always to one of the two neighbours of x / scale; with full codes it is never
  farther from the rollout's code than RTN, with mantissa bits it reproduces the rollout's code
  wherever that code is a neighbour and can land farther than RTN elsewhere (module docstring).
  With `guided=False` the rounding is RTN and the guidance is only used to measure agreement
  (the `qat` mode's diagnostics). `tensor_amax` turns on two-level NVFP4
  scaling when the guidance carries no scales and no tensor scale. Works under jit, vmap and grad.
  """
  fmt = fp4.get_format(fmt)
  if axis not in (-1, x.ndim - 1):
    values, stats = fake_quant(
      jnp.moveaxis(x, axis, -1), fmt, guidance, tensor_amax=tensor_amax, guided=guided, clip_gradient=clip_gradient
    )
    return jnp.moveaxis(values, -1, axis), stats
  if tensor_amax is not None:
    tensor_amax = jax.lax.stop_gradient(jnp.asarray(tensor_amax, jnp.float32))
  return _fake_quant(x, fmt, guidance, tensor_amax, guided, clip_gradient)


def fake_quant_codes(x, fmt="nvfp4", guidance: Guidance | None = None, *, tensor_amax=None, guided: bool = True):
  """Unpacked codes [.., K] the fake-quantizer picks (no gradient; for tests and metrics)."""
  return _round(x, fp4.get_format(fmt), guidance, tensor_amax, guided)[3]
