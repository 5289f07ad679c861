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

from trace_jax.config import QuantConfig
from trace_jax.quantizer import Guidance, QuantStats, fake_quant


@dataclasses.dataclass(frozen=True)
class QatContext:
  """quant=None: plain BF16 trainer. guided=False: guidance (if any) is only measured.

  guided_layers: the layers whose guidance steers rounding when `guided` (None = all);
  guidance given for other layers is only measured (per-layer agreement diagnostics).
  """

  quant: QuantConfig | None = None
  guided: bool = False
  compute_dtype: type = jnp.bfloat16
  guided_layers: tuple[int, ...] | None = None

  def for_layer(self, layer: int) -> QatContext:
    guided = self.guided and (self.guided_layers is None or layer in self.guided_layers)
    return dataclasses.replace(self, guided=guided, guided_layers=None)

  def _on(self, target: str, kind: str) -> bool:
    return self.quant is not None and self.quant.quantizes(target) and getattr(self.quant, kind)

  def weight(self, w: jax.Array, target: str, axis: int = 0) -> jax.Array:
    """W4 fake-quant with blocks along the contraction `axis` (RTN: weights agree by construction)."""
    if not self._on(target, "weights"):
      return w
    return fake_quant(w, self.quant.fmt, axis=axis, clip_gradient=self.quant.clip_gradient)[0]

  def activation(self, x: jax.Array, target: str) -> jax.Array:
    """A4 RTN fake-quant along the last axis (unguided targets)."""
    if not self._on(target, "activations"):
      return x
    return fake_quant(x, self.quant.fmt, clip_gradient=self.quant.clip_gradient)[0]

  def guided_activation(self, x: jax.Array, target: str, guidance: Guidance | None, found: jax.Array | None = None):
    """Fake-quant x [..., K] row by row; returns (values, QuantStats with per-row counts [...]).

    The 'kv' target ignores the `activations` switch: the FP4 KV cache is its own choice.
    Guidance given for a tensor that this trainer does not fake-quantize (the `fp4` and
    `quads` modes) is only measured: x comes back unchanged, with its agreement counts.
    found [...] (x's rows, nonzero = true; None = all): rows whose guidance the rollout recorded.
    The others (an expert the rollout did not run for that token) hold placeholder guidance: they
    are rounded to nearest on their own scales and left out of the counts.
    """
    rows = x.shape[:-1]
    zeros = QuantStats(*(jnp.zeros(rows, jnp.int32) for _ in dataclasses.fields(QuantStats)))
    q = self.quant
    enabled = q is not None and q.quantizes(target) and (target == "kv" or q.activations)
    if guidance is None or q is None:
      return (fake_quant(x, q.fmt, clip_gradient=q.clip_gradient)[0] if enabled else x), zeros
    n = math.prod(rows)
    g = flatten_rows(guidance, n)
    axes = Guidance(**{k: None if v is None or v.ndim == 0 else 0 for k, v in vars(g).items()})
    guided = self.guided and enabled
    one = lambda xr, gr: fake_quant(xr, q.fmt, gr, guided=guided, clip_gradient=q.clip_gradient)
    values, stats = jax.vmap(one, in_axes=(0, axes))(x.reshape(n, x.shape[-1]), g)
    if found is not None:
      found = found.reshape(n).astype(bool)
      stats = jax.tree_util.tree_map(lambda a: jnp.where(found, a, 0), stats)
      if enabled:
        rtn = fake_quant(x.reshape(n, x.shape[-1]), q.fmt, clip_gradient=q.clip_gradient)[0]
        values = jnp.where(found[:, None], values, rtn)
    stats = jax.tree_util.tree_map(lambda a: a.reshape(rows), stats)
    return (values.reshape(x.shape) if enabled else x), stats


def _per_row_fields(g: Guidance):
  return {f.name: getattr(g, f.name) for f in dataclasses.fields(g) if f.name != "tensor_scale"}


def flatten_rows(g: Guidance | None, n: int) -> Guidance | None:
  """Reshape every per-element field of the guidance to [n, -1] rows."""
  if g is None:
    return None
  fields = {k: None if v is None else v.reshape(n, -1) for k, v in _per_row_fields(g).items()}
  return dataclasses.replace(g, **fields)


def take_rows(g: Guidance | None, index: jax.Array, n: int) -> Guidance | None:
  """Rows of the guidance in a new order (the MoE block's sort by expert)."""
  g = flatten_rows(g, n)
  if g is None:
    return None
  return dataclasses.replace(g, **{k: None if v is None else v[index] for k, v in _per_row_fields(g).items()})
