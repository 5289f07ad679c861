"""The trainer's model: a Qwen3-MoE-family decoder as pure functions over parameter pytrees.

`forward` is the teacher-forced full-sequence pass used for QAT, log-probs and gradients:
fp32 master parameters, bf16 matmuls with fp32 accumulation, fp32 norms and softmax (the
numerics of a trainer; the rollout engine in rollout.py computes as an inference engine).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import attention, deltanet, moe, qat
from trace_jax.config import KEY, MOE_HIDDEN, MOE_INPUT, VALUE, ModelConfig, SamplingConfig
from trace_jax.deltanet import DeltaNetParams
from trace_jax.moe import MLPParams, MoEParams
from trace_jax.quantizer import Guidance, QuantStats
from trace_jax.sharding import param_field


# Each weight is declared once: its field, with its logical axes (the sharding rules map them to
# mesh axes) and, in the docstring, its shape. init_params creates it; hf.py names it.
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionParams:
  """q [H, nh, D], k/v [H, nkv, D], o [nh, D, H]; q_norm/k_norm [D] (None without QK-norm);
  gate [H, nh, D]: Qwen3.5's output gate (the second half of each head of its q_proj), None without."""

  q: jax.Array = param_field("embed", "heads", "head_dim")
  k: jax.Array = param_field("embed", "kv_heads", "head_dim")
  v: jax.Array = param_field("embed", "kv_heads", "head_dim")
  o: jax.Array = param_field("heads", "head_dim", "embed")
  q_norm: jax.Array | None = param_field("head_dim", default=None)
  k_norm: jax.Array | None = param_field("head_dim", default=None)
  gate: jax.Array | None = param_field("embed", "heads", "head_dim", default=None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
  """One decoder layer. attn: the token mixer, AttentionParams (full attention) or
  deltanet.DeltaNetParams (a Qwen3.5 linear-attention layer). mlp: MoEParams | MLPParams in the
  trainer; rollout.EngineMoE | MLPParams in the engine."""

  input_norm: jax.Array = param_field("norm")  # [H]
  attn: AttentionParams | DeltaNetParams
  post_attn_norm: jax.Array = param_field("norm")  # [H]
  mlp: MoEParams | MLPParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Params:
  embed: jax.Array = param_field("vocab", "embed")  # [V, H]
  layers: tuple[LayerParams, ...]
  final_norm: jax.Array = param_field("norm")  # [H]
  lm_head: jax.Array | None = param_field("embed", "vocab", default=None)  # [H, V]; None when tied to embed


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardAux:
  """Per-layer outputs. Tuples have one entry per layer (None where it does not apply)."""

  router_logits: tuple[jax.Array | None, ...]  # [B, S, E] float32
  topk_ids: tuple[jax.Array | None, ...]  # [B, S, k] int32
  quant_stats: tuple[dict[str, QuantStats], ...]  # tensor -> matches/total over real tokens
  aux_loss: jax.Array  # load-balancing loss (unscaled)
  dropped_tokens: jax.Array | None = None  # moe_impl='ep': assignments over capacity, all layers (int32)


def init_params(config: ModelConfig, rng: jax.Array, dtype=jnp.float32) -> Params:
  """Normal(0, initializer_range) weights, unit norms (zeros for zero-centred ones), as Hugging Face
  initializes."""
  c = config
  keys = iter(jax.random.split(rng, 4 + 32 * c.num_layers))
  normal = lambda *shape: (c.initializer_range * jax.random.normal(next(keys), shape)).astype(dtype)
  ones = lambda n: jnp.full((n,), 1.0 - c.norm_offset, dtype)

  def mlp_params(inter):
    return MLPParams(normal(c.hidden_size, inter), normal(c.hidden_size, inter), normal(inter, c.hidden_size))

  layers = []
  for i in range(c.num_layers):
    if i in c.linear_layers:
      attn = deltanet.init_params(c, normal, dtype, next(keys))
    else:
      attn = AttentionParams(
        q=normal(c.hidden_size, c.num_heads, c.head_dim),
        k=normal(c.hidden_size, c.num_kv_heads, c.head_dim),
        v=normal(c.hidden_size, c.num_kv_heads, c.head_dim),
        o=normal(c.num_heads, c.head_dim, c.hidden_size),
        q_norm=ones(c.head_dim) if c.qk_norm else None,
        k_norm=ones(c.head_dim) if c.qk_norm else None,
        gate=normal(c.hidden_size, c.num_heads, c.head_dim) if c.attention_output_gate else None,
      )
    if c.is_moe_layer(i):
      e, h, m = c.num_experts, c.hidden_size, c.moe_intermediate_size
      shared = c.shared_expert_intermediate_size
      mlp = MoEParams(
        router=normal(h, e),
        gate=normal(e, h, m),
        up=normal(e, h, m),
        down=normal(e, m, h),
        shared=mlp_params(shared) if shared else None,
        shared_gate=normal(h, 1) if shared else None,
      )
    else:
      mlp = mlp_params(c.intermediate_size)
    layers.append(LayerParams(ones(c.hidden_size), attn, ones(c.hidden_size), mlp))
  return Params(
    embed=normal(c.vocab_size, c.hidden_size),
    layers=tuple(layers),
    final_norm=ones(c.hidden_size),
    lm_head=None if c.tie_word_embeddings else normal(c.hidden_size, c.vocab_size),
  )


def lm_head_weight(params: Params) -> jax.Array:
  return params.embed.T if params.lm_head is None else params.lm_head


def _masked_sum(stats: QuantStats, mask: jax.Array) -> QuantStats:
  """Sum per-row counts [B, S, ...] over real tokens only (pads compute garbage on both sides)."""

  def total(a):
    m = mask.reshape(mask.shape + (1,) * (a.ndim - mask.ndim))
    return jnp.sum(a * m.astype(a.dtype))

  return jax.tree_util.tree_map(total, stats)


def attention_block(p: AttentionParams, x, positions, mask, config: ModelConfig, ctx: qat.QatContext, guidance: dict):
  """x [B, S, H] -> (out [B, S, H], stats). K/V are fake-quantized as the FP4 cache stores them."""
  dt = ctx.compute_dtype
  q_w, k_w, v_w = (ctx.weight(w, "attention") for w in (p.q, p.k, p.v))
  o_w = ctx.weight(p.o, "attention", axis=1)  # o contracts over (heads, head_dim): blocks along head_dim
  xa = ctx.activation(x, "attention").astype(dt)
  q = jnp.einsum("bsh,hnd->bsnd", xa, q_w.astype(dt), preferred_element_type=jnp.float32)
  k = jnp.einsum("bsh,hnd->bsnd", xa, k_w.astype(dt), preferred_element_type=jnp.float32)
  v = jnp.einsum("bsh,hnd->bsnd", xa, v_w.astype(dt), preferred_element_type=jnp.float32)
  if p.q_norm is not None:
    q = attention.rms_norm(q, p.q_norm, config.rms_norm_eps, offset=config.norm_offset)
    k = attention.rms_norm(k, p.k_norm, config.rms_norm_eps, offset=config.norm_offset)
  cos, sin = attention.rope_tables(positions, config.rotary_dim, config.rope_theta)
  q, k = attention.apply_rope(q, cos, sin), attention.apply_rope(k, cos, sin)
  k, k_stats = ctx.guided_activation(k.astype(dt), "kv", guidance.get(KEY), KEY)
  v, v_stats = ctx.guided_activation(v.astype(dt), "kv", guidance.get(VALUE), VALUE)
  out = attention.causal_attention(q, k, v, mask, scale=config.head_dim**-0.5, compute_dtype=dt)
  if p.gate is not None:  # Qwen3.5's gated attention: attn * sigmoid(gate) before o_proj
    gate_w = ctx.weight(p.gate, "attention")
    gate = jnp.einsum("bsh,hnd->bsnd", xa, gate_w.astype(dt), preferred_element_type=jnp.float32)
    out = out.astype(dt) * jax.nn.sigmoid(gate.astype(dt))
  out = ctx.activation(out.astype(dt), "attention")
  out = jnp.einsum("bsnd,ndh->bsh", out.astype(dt), o_w.astype(dt), preferred_element_type=jnp.float32)
  return out, {KEY: k_stats, VALUE: v_stats}


def linear_attention_block(p: DeltaNetParams, x, mask, config: ModelConfig, ctx: qat.QatContext):
  """x [B, S, H] -> out [B, S, H] fp32: a Gated DeltaNet layer over the full sequence (chunked rule,
  fp32 state). W4/A4 fake-quant of its projections under the 'linear_attention' target."""
  axes = {"q": 0, "k": 0, "v": 0, "z": 0, "b": 0, "a": 0, "out": 1}  # blocks along the contraction
  p = dataclasses.replace(p, **{n: ctx.weight(getattr(p, n), "linear_attention", ax) for n, ax in axes.items()})
  act = lambda a: ctx.activation(a, "linear_attention")
  out, _ = deltanet.mix(p, x, config, mask=mask, dtype=ctx.compute_dtype, act=act)
  return out


def forward(
  params: Params,
  tokens: jax.Array,
  mask: jax.Array,
  config: ModelConfig,
  *,
  positions: jax.Array | None = None,
  ctx: qat.QatContext = qat.QatContext(),
  guidance: tuple[dict[str, Guidance], ...] | None = None,
  replay_ids: tuple[jax.Array | None, ...] | None = None,
  moe_impl: str = "sorted",
  expert_parallel: moe.ExpertParallel | None = None,
  stats_mask: jax.Array | None = None,
  guidance_ids: tuple[jax.Array | None, ...] | None = None,
) -> tuple[jax.Array, ForwardAux]:
  """Teacher-forced forward. tokens/mask [B, S] (left padding allowed) -> float32 logits [B, S, V].

  guidance: per layer, a dict tensor name -> Guidance laid out by position
    ('moe_input' [B, S, ...], 'moe_hidden' [B, S, k, ...], 'key'/'value' [B, S, KV, ...]);
    a missing entry means RTN. replay_ids: per layer [B, S, k] expert ids to reuse (R3).
  guidance_ids: per layer [B, S, k] the rollout's experts, in the slot order of its 'moe_hidden'
    guidance; in layers without replay the trainer's (token, expert) rows are matched to them by
    expert (moe.moe_block). None: the rows are taken slot by slot.
  stats_mask: the positions over which code agreement is counted (default: mask).
  moe_impl='ep' with `expert_parallel` (mesh, capacity): experts split over the mesh.
  """
  b, s = tokens.shape
  dt = ctx.compute_dtype
  if positions is None:
    positions = attention.positions_from_mask(mask)
  guidance = guidance if guidance is not None else ({},) * config.num_layers
  replay_ids = replay_ids if replay_ids is not None else (None,) * config.num_layers
  guidance_ids = guidance_ids if guidance_ids is not None else (None,) * config.num_layers
  x = params.embed[tokens].astype(jnp.float32)  # fp32 residual stream
  router_logits, topk_ids, layer_stats, dropped = [], [], [], []
  for i, layer in enumerate(params.layers):
    g, layer_ctx = guidance[i] or {}, ctx.for_layer(i, len(params.layers))
    h = attention.rms_norm(x, layer.input_norm, config.rms_norm_eps, offset=config.norm_offset).astype(dt)
    if isinstance(layer.attn, DeltaNetParams):
      attn_out, stats = linear_attention_block(layer.attn, h, mask, config, layer_ctx), {}
    else:
      attn_out, stats = attention_block(layer.attn, h, positions, mask, config, layer_ctx, g)
    x = x + attn_out
    h = attention.rms_norm(x, layer.post_attn_norm, config.rms_norm_eps, offset=config.norm_offset).astype(dt)
    if isinstance(layer.mlp, MoEParams):
      replay = None if replay_ids[i] is None else replay_ids[i].reshape(b * s, -1)
      # Replayed experts are the rollout's, in its order: its guidance rows line up slot by slot.
      match = None if replay is not None or guidance_ids[i] is None else guidance_ids[i].reshape(b * s, -1)
      g_moe = {k: v for k, v in g.items() if k in (MOE_INPUT, MOE_HIDDEN)}
      out = moe.moe_block(
        layer.mlp,
        h.reshape(b * s, -1),
        config,
        layer_ctx,
        g_moe,
        replay,
        impl=moe_impl,
        expert_parallel=expert_parallel,
        guidance_ids=match,
      )
      if out.dropped is not None:
        dropped.append(out.dropped)
      x = x + out.out.reshape(b, s, -1)
      router_logits.append(out.router_logits.reshape(b, s, -1))
      topk_ids.append(out.topk_ids.reshape(b, s, -1))
      stats.update(
        {k: jax.tree_util.tree_map(lambda a: a.reshape(b, s, *a.shape[1:]), v) for k, v in out.stats.items()}
      )
    else:
      x = x + moe.mlp(layer.mlp, h, layer_ctx, "dense_mlp")
      router_logits.append(None)
      topk_ids.append(None)
    layer_stats.append({k: _masked_sum(v, mask if stats_mask is None else stats_mask) for k, v in stats.items()})
  x = attention.rms_norm(x, params.final_norm, config.rms_norm_eps, offset=config.norm_offset)
  logits = jnp.einsum(
    "bsh,hv->bsv", x.astype(dt), lm_head_weight(params).astype(dt), preferred_element_type=jnp.float32
  )

  moe_logits = [r for r in router_logits if r is not None]
  if moe_logits:
    flat_mask = jnp.tile(mask.reshape(-1), len(moe_logits))
    aux_loss = moe.load_balancing_loss(
      jnp.concatenate([r.reshape(b * s, -1) for r in moe_logits]),
      jnp.concatenate([t.reshape(b * s, -1) for t in topk_ids if t is not None]),
      flat_mask,
      config.num_experts,
    )
  else:
    aux_loss = jnp.zeros((), jnp.float32)
  dropped_tokens = sum(dropped) if dropped else None
  return logits, ForwardAux(tuple(router_logits), tuple(topk_ids), tuple(layer_stats), aux_loss, dropped_tokens)


def samplable_ids(num_logits: int, sampling: SamplingConfig | None) -> np.ndarray | None:
  """bool [num_logits]: the ids the policy may sample, or None when it may sample every id.

  A host constant built from the static config (no per-step work): ids below the tokenizer's
  vocabulary (sampling.vocab_size, 0 = all) that are not in sampling.banned_ids.
  """
  if sampling is None:
    return None
  allowed = np.ones(num_logits, bool)
  if sampling.vocab_size:
    allowed[sampling.vocab_size :] = False
  allowed[[i for i in sampling.banned_ids if i < num_logits]] = False
  return None if allowed.all() else allowed


def _tempered(logits: jax.Array, sampling: SamplingConfig | None) -> jax.Array:
  """float32 logits divided by the sampling temperature (0, greedy, and 1 leave them as they are)."""
  logits = logits.astype(jnp.float32)
  if sampling is None or sampling.temperature in (0.0, 1.0):
    return logits
  return logits / sampling.temperature


def policy_logits(logits: jax.Array, sampling: SamplingConfig | None = None) -> jax.Array:
  """The logits of the policy that samples, float32 [..., V]: divided by the temperature, and the
  ids it never samples at -inf.

  The one place the engine (rollout.sample) and the trainer (token_logprobs) shape the
  distribution, so that both compute log-probs of the same policy. sampling None: the model's own
  distribution (temperature 1, unmasked). Top-k / top-p truncation is the engine's alone: it
  samples from the truncated distribution but records the log-prob before truncation, as vLLM and
  SGLang report it, so the trainer recomputes exactly what was recorded and the mismatch metrics
  hold no truncation artefact (the truncation itself is not importance-corrected).
  """
  return _masked(_tempered(logits, sampling), sampling)


def _masked(logits: jax.Array, sampling: SamplingConfig | None) -> jax.Array:
  allowed = samplable_ids(logits.shape[-1], sampling)
  return logits if allowed is None else jnp.where(allowed, logits, -jnp.inf)


def token_logprobs(logits: jax.Array, targets: jax.Array, sampling: SamplingConfig | None = None) -> jax.Array:
  """log p(targets) from logits [..., V] under the policy that samples (policy_logits), float32.

  Equals log_softmax(policy_logits(logits))[targets] for every id the policy samples. A target it
  never samples (outside responses: BOS and left pads of prompts, pads after EOS) gets its own logit
  minus the policy's normalizer, finite rather than -inf, so that masking such positions out by
  multiplication (and its gradient) stays free of NaN.
  """
  logits = _tempered(logits, sampling)
  policy = _masked(logits, sampling)
  # log_softmax's own arithmetic, so that unmasked log-probs are bit-identical to it
  shift = jax.lax.stop_gradient(jnp.max(policy, axis=-1, keepdims=True))
  log_norm = jnp.log(jnp.sum(jnp.exp(policy - shift), axis=-1, keepdims=True))
  target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)
  return ((target_logits - shift) - log_norm)[..., 0]
