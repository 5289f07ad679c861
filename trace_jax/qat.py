"""The trainer's QAT policy: which tensors get FP4 fake-quant, and with what guidance.

`QatContext` is static (hashable) and travels through the model's forward; it applies
`quantizer.fake_quant` to the configured targets (SPEC section 2.5): W4 on weights, A4 on
activations (RTN, or rollout-guided for the guided tensors), K/V as stored in the FP4 cache.
Guided tensors report per-row code agreement so the model can mask out padding.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from trace_jax import fp4
from trace_jax.config import QuantConfig
from trace_jax.quantizer import Guidance, QuantStats, fake_quant


def tensor_amax(x: jax.Array, quant: QuantConfig) -> jax.Array | None:
  """The amax behind two-level NVFP4's FP32 tensor scale (`quant.tensor_scale`), as the engine and the
  trainer both take it: None (single-level), the whole tensor's ('batch_amax': a scalar) or each row's
  ('per_token': [...], x's rows)."""
  if quant.tensor_scale == "batch_amax":
    return jnp.max(jnp.abs(x)).astype(jnp.float32)
  if quant.tensor_scale == "per_token":
    return jnp.max(jnp.abs(x), axis=-1).astype(jnp.float32)
  return None


def fake_e4m3(x: jax.Array) -> jax.Array:
  """FP8 E4M3 fake-quant of the FP8 KV cache (`quant.kv_format='fp8_e4m3'`): the engine's values,
  with a straight-through gradient."""
  return x + jax.lax.stop_gradient(fp4.e4m3_round(x) - x)


@dataclasses.dataclass(frozen=True)
class QatContext:
  """quant=None: plain BF16 trainer. guided=False: guidance (if any) is only measured.

  guided_layers / guided_tensors: the layers and tensors (config.GUIDED_TENSORS names) whose
  guidance steers rounding when `guided` (None = all); guidance given for others is only measured
  (the engine's diagnostic full codes must never steer a tensor that is not shipped as guidance).
  """

  quant: QuantConfig | None = None
  guided: bool = False
  compute_dtype: type = jnp.bfloat16
  guided_layers: tuple[int, ...] | None = None
  guided_tensors: tuple[str, ...] | None = None

  def for_layer(self, layer: int, num_layers: int) -> QatContext:
    """The context of one layer: no fake-quant in a layer of `quant.bf16_layers`."""
    guided = self.guided and (self.guided_layers is None or layer in self.guided_layers)
    quant = None if self.quant is None else self.quant.at_layer(layer, num_layers)
    return dataclasses.replace(self, quant=quant, guided=guided and quant is not None, guided_layers=None)

  def _on(self, target: str, kind: str) -> bool:
    return self.quant is not None and self.quant.quantizes(target) and getattr(self.quant, kind)

  def weight(self, w: jax.Array, target: str, axis: int = 0) -> jax.Array:
    """W4 fake-quant with blocks along the contraction `axis` (RTN: weights agree by construction)."""
    if not self._on(target, "weights"):
      return w
    return fake_quant(w, self.quant.fmt, axis=axis, clip_gradient=self.quant.clip_gradient)[0]

  def _batch_amax(self, x: jax.Array) -> jax.Array | None:
    """The tensor amax of two-level NVFP4 (`tensor_amax`): 'batch_amax' over this batch, as the engine
    takes it over each of its own; 'per_token' each row's; None: single-level."""
    return tensor_amax(x, self.quant)

  def activation(self, x: jax.Array, target: str) -> jax.Array:
    """A4 RTN fake-quant along the last axis (unguided targets)."""
    if not self._on(target, "activations"):
      return x
    q = self.quant
    return fake_quant(x, q.fmt, tensor_amax=self._batch_amax(x), clip_gradient=q.clip_gradient)[0]

  def guided_activation(
    self, x: jax.Array, target: str, guidance: Guidance | None, tensor: str, found: jax.Array | None = None
  ):
    """Fake-quant x [..., K] row by row; returns (values, QuantStats with per-row counts [...]).

    tensor: which guided tensor x is (config.GUIDED_TENSORS), for `guided_tensors`.

    The 'kv' target ignores the `activations` switch: the FP4 KV cache is its own choice.
    Guidance given for a tensor that this trainer does not fake-quantize (the `fp4` and
    `qat_w4a16` modes) is only measured: x comes back unchanged, with its agreement counts.
    Two-level NVFP4: rows whose guidance carries the rollout's tensor scale use it, others the
    amax of this batch.
    found [...] (x's rows, nonzero = true; None = all): rows whose guidance the rollout recorded.
    The others (an expert the rollout did not run for that token) hold placeholder guidance: they
    are rounded to nearest on their own scales and left out of the counts.
    """
    rows = x.shape[:-1]
    zeros = QuantStats(*(jnp.zeros(rows, jnp.int32) for _ in dataclasses.fields(QuantStats)))
    q = self.quant
    enabled = q is not None and q.quantizes(target) and (target == "kv" or q.activations)
    if enabled and target == "kv" and not q.fp4_kv:  # the FP8 cache: rounded to nearest, no guidance
      return fake_e4m3(x), zeros
    if guidance is None or q is None:
      if not enabled:
        return x, zeros
      return fake_quant(x, q.fmt, tensor_amax=self._batch_amax(x), clip_gradient=q.clip_gradient)[0], zeros
    n = math.prod(rows)
    g = flatten_rows(guidance, n)
    axes = Guidance(**{k: None if v is None or v.ndim == 0 else 0 for k, v in vars(g).items()})
    guided = self.guided and enabled and (self.guided_tensors is None or tensor in self.guided_tensors)
    amax = self._batch_amax(x)
    if amax is not None and amax.ndim:  # per token: each row's
      amax = amax.reshape(n)
    one = lambda xr, gr, a: fake_quant(xr, q.fmt, gr, tensor_amax=a, guided=guided, clip_gradient=q.clip_gradient)
    amax_axis = None if amax is None or not amax.ndim else 0
    values, stats = jax.vmap(one, in_axes=(0, axes, amax_axis))(x.reshape(n, x.shape[-1]), g, amax)
    if found is not None:
      found = found.reshape(n).astype(bool)
      stats = jax.tree_util.tree_map(lambda a: jnp.where(found, a, 0), stats)
      if enabled:
        rtn = fake_quant(x.reshape(n, x.shape[-1]), q.fmt, tensor_amax=amax, clip_gradient=q.clip_gradient)[0]
        values = jnp.where(found[:, None], values, rtn)
    stats = jax.tree_util.tree_map(lambda a: a.reshape(rows), stats)
    return (values.reshape(x.shape) if enabled else x), stats


def _per_row_fields(g: Guidance):
  """The fields laid out by row: all but a scalar tensor scale."""
  return {
    f.name: getattr(g, f.name)
    for f in dataclasses.fields(g)
    if f.name != "tensor_scale" or (g.tensor_scale is not None and g.tensor_scale.ndim)
  }


def flatten_rows(g: Guidance | None, n: int) -> Guidance | None:
  """Reshape every per-element field of the guidance to [n, -1] rows (a per-row tensor scale to [n])."""
  if g is None:
    return None
  shape = lambda k: (n,) if k == "tensor_scale" else (n, -1)
  fields = {k: None if v is None else v.reshape(shape(k)) for k, v in _per_row_fields(g).items()}
  return dataclasses.replace(g, **fields)


def take_rows(g: Guidance | None, index: jax.Array, n: int) -> Guidance | None:
  """Rows of the guidance in a new order (the MoE block's sort by expert)."""
  g = flatten_rows(g, n)
  if g is None:
    return None
  return dataclasses.replace(g, **{k: None if v is None else v[index] for k, v in _per_row_fields(g).items()})
