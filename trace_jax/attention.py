"""RMSNorm, RoPE and grouped-query attention (the trainer's full-sequence form).

The rollout engine (rollout.py) has its own decode attention over the KV cache; it reuses
the pure primitives here with engine dtypes (bf16 RoPE tables), as inference engines do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so fully masked rows (left padding) give a uniform softmax, not NaN


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, compute_dtype=jnp.float32, offset: float = 0.0) -> jax.Array:
  """RMSNorm computed in `compute_dtype` (trainers: fp32), returned in x's dtype.

  offset: added to the weight (1 for Qwen3.5's zero-centred norms, `(1 + w) * x`; ModelConfig.norm_offset).
  """
  h = x.astype(compute_dtype)
  h = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + eps)
  w = weight.astype(compute_dtype)
  return ((w + offset if offset else w) * h).astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float, dtype=jnp.float32):
  """cos/sin tables [..., head_dim] for integer positions (HF's rotate-half layout); partial RoPE
  passes its rotary_dim as head_dim."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B, S, heads, head_dim]; cos/sin [B, S, rotary_dim]. Computed in the tables' dtype.

  rotary_dim < head_dim (partial RoPE, Qwen3.5): the first rotary_dim dims rotate, the rest pass.
  """
  dtype, rot = x.dtype, cos.shape[-1]
  x, rest = x[..., :rot].astype(cos.dtype), x[..., rot:]
  half = rot // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  out = (x * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(dtype)
  return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


def positions_from_mask(mask: jax.Array) -> jax.Array:
  """Positions for a left-padded batch: 0 at the first real token (pads get 0 too)."""
  return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def causal_attention(q, k, v, mask, *, scale: float, compute_dtype=jnp.bfloat16) -> jax.Array:
  """Full-sequence causal GQA attention.

  q [B, S, H, D], k/v [B, S, KV, D], mask [B, S] (1 = real token). Scores and softmax in
  fp32 (the trainer's numerics); matmul inputs in `compute_dtype`.
  """
  b, s, h, d = q.shape
  groups = h // k.shape[2]
  q = q.reshape(b, s, k.shape[2], groups, d).astype(compute_dtype)
  scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k.astype(compute_dtype), preferred_element_type=jnp.float32) * scale
  causal = jnp.tril(jnp.ones((s, s), bool))
  allowed = causal[None, :, :] & mask.astype(bool)[:, None, :]
  scores = jnp.where(allowed[:, None, None], scores, NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum(
    "bkgqs,bskd->bqkgd", probs.astype(compute_dtype), v.astype(compute_dtype), preferred_element_type=jnp.float32
  )
  return out.reshape(b, s, h, d)
