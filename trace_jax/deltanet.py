"""Gated DeltaNet: the linear-attention layers of the Qwen3.5 hybrid, for the trainer and the engine.

Follows transformers' `Qwen3_5MoeGatedDeltaNet` (modeling_qwen3_5_moe.py). Per layer: q/k/v, z, b
and a projections of the (pad-zeroed) input; a depthwise causal conv (kernel 4) with SiLU over
q/k/v; beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias); L2-normalised q and k (q also
scaled by dk^-1/2); the gated delta rule with an fp32 state [dk, dv] per value head

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,    o_t = S_t^T q_t

(query/key heads shared by groups of value heads); then an RMSNorm of o gated by silu(z) per head,
and `out`. The rule has two forms that compute the same thing: `chunked_rule` for full sequences
(the trainer, the engine's prefill: a lax.scan over chunks, the work inside a chunk as matmuls with
the UT transform) and `recurrent_rule` for one token at a time (the engine's decode; also the
per-token reference of the tests). The state stays fp32 in both, as transformers keeps it.

`mix` is the whole token mixer; the trainer calls it without a state (zeros, chunked), the engine
with its `DeltaNetState` (prefill: chunked from zeros; decode: recurrent), so prefill + decode and
the trainer's forward are one computation in two orders.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from trace_jax.config import ModelConfig
from trace_jax.sharding import param_field


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeltaNetParams:
  """q/k [H, nk, dk], v/z [H, nv, dv], b/a [H, nv] (the in-projections, HF's in_proj_qkv split and
  in_proj_z/b/a); conv_q/conv_k [Kc, nk, dk], conv_v [Kc, nv, dv] (HF's depthwise conv1d.weight
  [C, 1, Kc] split by channel, tap j multiplying input t - (Kc - 1) + j); a_log, dt_bias [nv];
  norm [dv] (the gated RMSNorm, a plain weight); out [nv, dv, H]."""

  q: jax.Array = param_field("embed", "heads", "head_dim")
  k: jax.Array = param_field("embed", "heads", "head_dim")
  v: jax.Array = param_field("embed", "heads", "head_dim")
  z: jax.Array = param_field("embed", "heads", "head_dim")
  b: jax.Array = param_field("embed", "heads")
  a: jax.Array = param_field("embed", "heads")
  conv_q: jax.Array = param_field("conv", "heads", "head_dim")
  conv_k: jax.Array = param_field("conv", "heads", "head_dim")
  conv_v: jax.Array = param_field("conv", "heads", "head_dim")
  a_log: jax.Array = param_field("heads")
  dt_bias: jax.Array = param_field("heads")
  norm: jax.Array = param_field("head_dim")
  out: jax.Array = param_field("heads", "head_dim", "embed")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeltaNetState:
  """One linear layer's per-sequence state in the engine (it replaces the KV cache there).

  conv [B, Kc - 1, C]: the last Kc - 1 conv inputs (q, k, v channels concatenated), engine dtype.
  recurrent [B, nv, dk, dv]: the delta rule's state, fp32.
  """

  conv: jax.Array = param_field("batch", None, None)
  recurrent: jax.Array = param_field("batch", "heads", "head_dim", "head_dim")


def init_state(config: ModelConfig, batch: int, dtype) -> DeltaNetState:
  c = config
  channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
  return DeltaNetState(
    conv=jnp.zeros((batch, c.linear_conv_kernel_dim - 1, channels), dtype),
    recurrent=jnp.zeros((batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim), jnp.float32),
  )


def init_params(config: ModelConfig, normal: Callable, dtype, rng: jax.Array) -> DeltaNetParams:
  """HF's initialization: normal(initializer_range) projections and conv, dt_bias 1, A = U(0.01, 16),
  gated-norm weight 1. normal(*shape) draws a fresh normal array."""
  c = config
  h, nk, nv, dk, dv, kc = (
    c.hidden_size,
    c.linear_num_key_heads,
    c.linear_num_value_heads,
    c.linear_key_head_dim,
    c.linear_value_head_dim,
    c.linear_conv_kernel_dim,
  )
  a = jax.random.uniform(rng, (nv,), jnp.float32, 0.01, 16.0)
  return DeltaNetParams(
    q=normal(h, nk, dk),
    k=normal(h, nk, dk),
    v=normal(h, nv, dv),
    z=normal(h, nv, dv),
    b=normal(h, nv),
    a=normal(h, nv),
    conv_q=normal(kc, nk, dk),
    conv_k=normal(kc, nk, dk),
    conv_v=normal(kc, nv, dv),
    a_log=jnp.log(a).astype(dtype),
    dt_bias=jnp.ones((nv,), dtype),
    norm=jnp.ones((dv,), dtype),
    out=normal(nv, dv, h),
  )


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x * rsqrt(sum(x^2) + eps) over the last axis (transformers' / FLA's l2norm)."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


# --- the gated delta rule -------------------------------------------------------------------
# Inputs in fp32, heads already expanded to the value heads: q/k [B, S, nv, dk] (q L2-normalised
# and scaled, k L2-normalised), v [B, S, nv, dv], g/beta [B, S, nv]; state [B, nv, dk, dv].


def recurrent_rule(q, k, v, g, beta, state=None):
  """The per-token recurrence: (out [B, S, nv, dv], final state). A lax.scan over S."""
  b, s, h, dk = q.shape
  dv = v.shape[-1]
  state = jnp.zeros((b, h, dk, dv), jnp.float32) if state is None else state

  def step(st, inputs):
    q_t, k_t, v_t, g_t, b_t = inputs  # [B, nv, d], g_t/b_t [B, nv]
    st = st * jnp.exp(g_t)[..., None, None]
    kv_mem = jnp.sum(st * k_t[..., :, None], axis=-2)
    delta = (v_t - kv_mem) * b_t[..., None]
    st = st + k_t[..., :, None] * delta[..., None, :]
    return st, jnp.sum(st * q_t[..., :, None], axis=-2)

  seq_first = lambda a: jnp.moveaxis(a, 1, 0)
  state, out = jax.lax.scan(step, state, tuple(map(seq_first, (q, k, v, g, beta))))
  return jnp.moveaxis(out, 0, 1), state


def _unit_lower_inverse(a: jax.Array) -> jax.Array:
  """(I + strictly_lower(a))^-1 for a [..., C, C], by forward substitution row by row (transformers'
  export path, and FLA's): row i of the inverse's strict part is r_i + r_i T with r_i = -a[i, :i].
  A lax.fori_loop over rows: XLA:CPU's triangular-solve custom call hangs inside some jitted
  gradients, and this is as cheap at chunk sizes."""
  c = a.shape[-1]
  t = -jnp.tril(a, -1)

  def row(i, t):
    r = jax.lax.dynamic_index_in_dim(t, i, axis=-2, keepdims=False)  # [..., C], zero from column i on
    new = r + jnp.einsum("...k,...kj->...j", r, t, precision=jax.lax.Precision.HIGHEST)
    return jax.lax.dynamic_update_index_in_dim(t, new, i, axis=-2)

  return jax.lax.fori_loop(1, c, row, t) + jnp.eye(c, dtype=a.dtype)


def chunked_rule(q, k, v, g, beta, chunk: int, state=None):
  """The chunked form (transformers' torch_chunk_gated_delta_rule): (out [B, S, nv, dv], final state).

  The sequence is padded to whole chunks (padding leaves the state unchanged: k = v = 0, g = 0).
  Inside a chunk the delta rule's updates are condensed by the UT transform, a unit lower-triangular
  solve; across chunks a lax.scan carries the state.
  """
  b, s, h, dk = q.shape
  dv = v.shape[-1]
  pad = (-s) % chunk
  n = (s + pad) // chunk
  heads_first = lambda a: jnp.moveaxis(a, 1, 2)  # [B, nv, S, ...]
  q, k, v, g, beta = map(heads_first, (q, k, v, g, beta))
  padding = lambda a: jnp.pad(a, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 3))
  q, k, v, g, beta = map(padding, (q, k, v, g, beta))
  v_beta, k_beta = v * beta[..., None], k * beta[..., None]
  chunks = lambda a: a.reshape(b, h, n, chunk, *a.shape[3:])
  q, k, v_beta, k_beta, g = map(chunks, (q, k, v_beta, k_beta, g))

  lower = jnp.tril(jnp.ones((chunk, chunk), bool))
  cum = jnp.cumsum(g, axis=-1)  # [B, nv, n, C]: log of the decay from the chunk's start
  pairwise = cum[..., :, None] - cum[..., None, :]
  decay = jnp.where(lower, jnp.exp(jnp.where(lower, pairwise, 0.0)), 0.0)  # exp(cum_i - cum_j), j <= i
  mm = lambda x, y: jnp.einsum("...ij,...jk->...ik", x, y, precision=jax.lax.Precision.HIGHEST)
  ut = mm(k_beta, jnp.swapaxes(k, -1, -2)) * decay
  intra = mm(q, jnp.swapaxes(k, -1, -2)) * decay
  decayed_k_beta = k_beta * jnp.exp(cum)[..., None]
  inverse = _unit_lower_inverse(ut)  # (I + strictly_lower(ut))^-1: the UT transform
  new_values, k_cumdecay = mm(inverse, v_beta), mm(inverse, decayed_k_beta)
  q = q * jnp.exp(cum)[..., None]
  k = k * jnp.exp(cum[..., -1:] - cum)[..., None]
  chunk_decay = jnp.exp(cum[..., -1])[..., None, None]

  def step(st, inputs):
    new_values, k_cumdecay, q, k, intra, chunk_decay = inputs
    v_new = new_values - mm(k_cumdecay, st)
    out = mm(q, st) + mm(intra, v_new)
    st = st * chunk_decay + mm(jnp.swapaxes(k, -1, -2), v_new)
    return st, out

  state = jnp.zeros((b, h, dk, dv), jnp.float32) if state is None else state
  chunk_first = lambda a: jnp.moveaxis(a, 2, 0)
  inputs = tuple(map(chunk_first, (new_values, k_cumdecay, q, k, intra, chunk_decay)))
  state, out = jax.lax.scan(step, state, inputs)  # out [n, B, nv, C, dv]
  out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * chunk, dv)[:, :, :s]
  return jnp.moveaxis(out, 1, 2), state


# --- the token mixer --------------------------------------------------------------------------


def causal_conv(x: jax.Array, w: jax.Array, history: jax.Array | None):
  """Depthwise causal conv + SiLU: x [B, S, C], w [Kc, C], history [B, Kc - 1, C] (None: zeros).

  Returns (silu(conv) [B, S, C] in x's dtype, fp32 accumulation; the new history: the last Kc - 1 inputs).
  """
  kc = w.shape[0]
  if history is None:
    history = jnp.zeros((x.shape[0], kc - 1, x.shape[2]), x.dtype)
  full = jnp.concatenate([history.astype(x.dtype), x], axis=1)  # [B, Kc - 1 + S, C]
  s = x.shape[1]
  acc = sum(full[:, j : j + s].astype(jnp.float32) * w[j].astype(jnp.float32) for j in range(kc))
  return jax.nn.silu(acc).astype(x.dtype), full[:, full.shape[1] - (kc - 1) :]


def mix(
  p: DeltaNetParams,
  x: jax.Array,
  config: ModelConfig,
  *,
  mask: jax.Array | None = None,
  state: DeltaNetState | None = None,
  dtype=jnp.bfloat16,
  act: Callable[[jax.Array], jax.Array] = lambda a: a,
) -> tuple[jax.Array, DeltaNetState]:
  """The Gated DeltaNet token mixer: x [B, S, H] -> (out [B, S, H] fp32, the state after it).

  mask [B, S]: pads (0) are zeroed before the projections, as transformers does for left padding, so
  they leave the state as it was. state None: a fresh sequence. S = 1 with a state: the recurrent
  form (a decode step); otherwise the chunked form. dtype: the projections' input dtype (bf16, or
  fp32 for parity), accumulation fp32; the rule runs in fp32. act: the activation fake-quant /
  online quantization of the projections' inputs (the 'linear_attention' quant target).
  """
  c = config
  b, s, _ = x.shape
  nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
  if mask is not None:
    x = x * mask[..., None].astype(x.dtype)
  xa = act(x.astype(dtype)).astype(dtype)
  proj = lambda w, spec: jnp.einsum(spec, xa, w.astype(dtype), preferred_element_type=jnp.float32).astype(dtype)
  q, k, v, z = (proj(w, "bsh,hnd->bsnd") for w in (p.q, p.k, p.v, p.z))
  beta_in, a_in = proj(p.b, "bsh,hn->bsn"), proj(p.a, "bsh,hn->bsn")

  qkv = jnp.concatenate([q.reshape(b, s, -1), k.reshape(b, s, -1), v.reshape(b, s, -1)], axis=-1)
  w = jnp.concatenate([a.reshape(a.shape[0], -1) for a in (p.conv_q, p.conv_k, p.conv_v)], axis=-1)
  qkv, conv_state = causal_conv(qkv, w.astype(dtype), None if state is None else state.conv)
  q = qkv[..., : nk * dk].reshape(b, s, nk, dk)
  k = qkv[..., nk * dk : 2 * nk * dk].reshape(b, s, nk, dk)
  v = qkv[..., 2 * nk * dk :].reshape(b, s, nv, dv)

  beta = jax.nn.sigmoid(beta_in).astype(jnp.float32)
  g = -jnp.exp(p.a_log.astype(jnp.float32)) * jax.nn.softplus(a_in.astype(jnp.float32) + p.dt_bias.astype(jnp.float32))
  q = l2norm(q.astype(jnp.float32)) * dk**-0.5
  k = l2norm(k.astype(jnp.float32))
  q, k = jnp.repeat(q, nv // nk, axis=2), jnp.repeat(k, nv // nk, axis=2)
  recurrent = None if state is None else state.recurrent
  if s == 1 and state is not None:
    o, recurrent = recurrent_rule(q, k, v.astype(jnp.float32), g, beta, recurrent)
  else:
    o, recurrent = chunked_rule(q, k, v.astype(jnp.float32), g, beta, c.linear_chunk_size, recurrent)
  o = o.astype(dtype)

  # RMSNorm per head (fp32), weight in the activation dtype, gated by silu(z) in fp32 (transformers' order)
  h = o.astype(jnp.float32)
  h = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + c.rms_norm_eps)
  h = p.norm.astype(dtype) * h.astype(dtype)
  h = (h.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(dtype)
  h = act(h).astype(dtype)
  out = jnp.einsum("bsnd,ndh->bsh", h, p.out.astype(dtype), preferred_element_type=jnp.float32)
  return out, DeltaNetState(conv_state, recurrent)
