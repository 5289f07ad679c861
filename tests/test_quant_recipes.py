"""The NVFP4 RL recipes of issue 41, engine against trainer and against independent references.

- quant.tensor_scale='per_token': torchao's two-level NVFP4 with each row's amax as its per-tensor
  scale, bit-identical between the engine's online quantization and the trainer's fake-quant, and
  guiding the trainer onto the rollout's codes.
- quant.kv_format='fp8_e4m3': ml_dtypes' E4M3 with one FP32 scale per token and head, the same values
  in the engine's cache and the trainer's fake-quant (straight-through gradient), no K/V guidance.
- quant.bf16_layers: those layers run exactly as the BF16 engine and the BF16 trainer run them.
- rl.mis / rl.trust_region: the masking rules on hand-made ratios.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests.test_fp4 import torchao_ref
from tests.tiny import tiny_model
from trace_jax import fp4, model, qat, rl, rollout
from trace_jax.config import KEY, MOE_INPUT, VALUE, ConfigError, GRPOConfig, QuantConfig, RolloutConfig, SamplingConfig

CFG = tiny_model(vocab_size=40, initializer_range=0.06)  # 2 layers
B, P, NEW = 4, 6, 8
PADS = (0, 2, 3, 1)
SAMPLE = SamplingConfig(max_new_tokens=NEW, temperature=1.0, eos_id=2)

PER_TOKEN = QuantConfig(tensor_scale="per_token")
FP8_KV = QuantConfig(kv_format="fp8_e4m3")


def full_engine(quant):
  return RolloutConfig(quant=quant, guided_layers=(0, 1), guidance_form="full", record_codes=True)


@pytest.fixture(scope="module")
def params():
  return jax.jit(model.init_params, static_argnums=0)(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def batch():
  tokens = jax.random.randint(jax.random.key(1), (B, P), 3, CFG.vocab_size)
  mask = (jnp.arange(P)[None, :] >= jnp.asarray(PADS)[:, None]).astype(jnp.int32)
  return tokens * mask, mask


def gen(params, batch, rollout_config, cfg=CFG):
  engine = rollout.weight_sync(params, rollout_config.quant, jnp.dtype(rollout_config.compute_dtype))
  return rollout.generate(
    engine, *batch, jax.random.key(5), model_config=cfg, rollout_config=rollout_config, sampling=SAMPLE
  )


@functools.partial(jax.jit, static_argnames=("ctx", "cfg"))
def _forward(params, tokens, mask, guidance, replay_ids, ctx, cfg=CFG):
  return model.forward(params, tokens, mask, cfg, ctx=ctx, guidance=guidance, replay_ids=replay_ids)


def drop_last(tree):
  return jax.tree_util.tree_map(lambda a: a[:, :-1] if a.ndim >= 2 else a, tree)


def trainer(params, res, ctx, guidance=None, cfg=CFG):
  """Teacher-forced log-probs of the response, and aux (per-layer code agreement)."""
  guidance = None if guidance is None else drop_last(guidance)
  logits, aux = _forward(params, res.tokens[:, :-1], res.mask[:, :-1], guidance, drop_last(res.topk_ids), ctx, cfg)
  return model.token_logprobs(logits, res.tokens[:, 1:]), aux


def agreement(aux) -> tuple[int, int]:
  s = [st for layer in aux.quant_stats for st in layer.values()]
  return sum(int(x.matches) for x in s), sum(int(x.total) for x in s)


def wide_rows(shape, seed=3):
  """Rows whose magnitudes span e^-6..e^6: a batch amax would crush the small rows' scales."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, (*shape[:-1], 1)))
  return jnp.asarray(x.astype(np.float32), jnp.bfloat16)


# --- per-token two-level NVFP4 ------------------------------------------------------------


def test_per_token_scaling_is_torchaos_two_level_row_by_row():
  """Each row gets torchao's two-level NVFP4 with its own amax as the per-tensor scale."""
  for fn, shape in (
    (lambda v: rollout._act(v, PER_TOKEN, "experts")[1], (6, 64)),
    (lambda v: rollout._store(v, PER_TOKEN), (2, 3, 2, 32)),
  ):
    x = wide_rows(shape)
    q = jax.jit(fn)(x)
    rows = np.asarray(x, np.float32).reshape(-1, shape[-1])
    for r, row in enumerate(rows):
      scales, codes, _ = torchao_ref(row[None], "nvfp4", "bfloat16", two_level=True)
      np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8).reshape(len(rows), -1)[r], scales[0])
      np.testing.assert_array_equal(np.asarray(q.codes).reshape(len(rows), -1)[r], codes[0])
    np.testing.assert_array_equal(
      np.asarray(q.tensor_scale).reshape(-1), np.abs(rows).max(-1).astype(np.float32) / np.float32(2688)
    )


def test_per_token_engine_and_trainer_fake_quant_are_bit_identical():
  """The same inputs give the same values in the engine (online RTN) and the trainer (fake-quant),
  for activations and for K / V, at per-token and at every other tensor scale."""
  x, kv = wide_rows((16, 64)), wide_rows((2, 5, 2, 32), seed=4)
  for quant in (PER_TOKEN, QuantConfig(tensor_scale="none"), QuantConfig(tensor_scale="batch_amax")):
    ctx = qat.QatContext(quant)
    engine_x = jax.jit(lambda v, q=quant: rollout._act(v, q, "experts")[0])(x)
    np.testing.assert_array_equal(
      np.asarray(engine_x), np.asarray(jax.jit(lambda v, c=ctx: c.activation(v, "experts"))(x))
    )
    engine_kv = fp4.dequantize(jax.jit(lambda v, q=quant: rollout._store(v, q))(kv), jnp.float32).astype(jnp.bfloat16)
    trainer_kv = jax.jit(lambda v, c=ctx: c.guided_activation(v, "kv", None, KEY)[0])(kv)
    np.testing.assert_array_equal(np.asarray(engine_kv), np.asarray(trainer_kv))
  # per-token scales keep the small rows: the batch amax flushes them towards the E4M3 floor
  err = lambda q: float(jnp.mean(jnp.abs(rollout._act(x, q, "experts")[0] - x) / jnp.abs(x).max(-1, keepdims=True)))
  assert err(PER_TOKEN) < err(QuantConfig(tensor_scale="batch_amax"))


@pytest.fixture(scope="module")
def per_token_rollout(params, batch):
  return gen(params, batch, full_engine(PER_TOKEN))


def test_per_token_scales_are_per_row_and_guide_the_trainer(params, per_token_rollout):
  """The rollout keeps each row's tensor scale (rows of one call differ); shipped with the guidance, it
  lets the guided trainer reproduce the rollout's codes, where RTN on the trainer's own rows does not."""
  res = per_token_rollout
  ts = np.asarray(res.codes[0][MOE_INPUT].tensor_scale).reshape(B, -1)[:, :P]
  assert len(np.unique(ts[np.asarray(batch_mask(res))[:, :P]])) > B  # one per token, not one per call
  guided_lp, aux = trainer(params, res, qat.QatContext(PER_TOKEN, guided=True), res.guidance)
  rtn_lp, rtn_aux = trainer(params, res, qat.QatContext(PER_TOKEN, guided=False), res.codes)
  (m_g, t_g), (m_r, t_r) = agreement(aux), agreement(rtn_aux)
  assert t_g == t_r > 0 and m_g / t_g >= 0.999 and m_r < m_g, (m_g / t_g, m_r / t_r)
  m = np.asarray(res.response_mask[:, 1:], bool)
  d = lambda lp: float(np.abs(np.asarray(lp) - np.asarray(res.logprobs[:, 1:]))[m].mean())
  assert d(guided_lp) < d(rtn_lp)


def batch_mask(res):
  return np.asarray(res.mask, bool)


# --- FP8 E4M3 KV cache --------------------------------------------------------------------


def test_e4m3_round_is_ml_dtypes_with_a_scale_per_row():
  x = wide_rows((3, 4, 2, 32))
  got = np.asarray(jax.jit(fp4.e4m3_round)(x), np.float32)
  xf = np.asarray(x, np.float32)
  scale = np.abs(xf).max(-1, keepdims=True) / np.float32(448)
  want = (xf / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
  np.testing.assert_array_equal(got, want.astype(ml_dtypes.bfloat16).astype(np.float32))
  np.testing.assert_array_equal(np.asarray(fp4.e4m3_round(jnp.zeros((2, 8)))), 0)


def test_fp8_kv_cache_engine_equals_trainer_and_ships_no_kv_guidance(params, batch):
  """kv_format='fp8_e4m3': the engine's cache holds the E4M3 values the trainer fake-quantizes to
  (straight-through gradient), so an fp32 engine and an fp32 trainer agree on the log-probs up to
  accumulation order; K / V carry no guidance; the MoE tensors still do."""
  kv = wide_rows((2, 5, 2, 32))
  ctx = qat.QatContext(FP8_KV)
  np.testing.assert_array_equal(
    np.asarray(rollout._store(kv, FP8_KV)), np.asarray(ctx.guided_activation(kv, "kv", None, KEY)[0])
  )
  grad = jax.grad(lambda v: jnp.sum(ctx.guided_activation(v, "kv", None, KEY)[0] * 3.0))(kv.astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(grad), 3.0)
  kv_only = dataclasses.replace(FP8_KV, targets=("kv",))
  res = gen(params, batch, RolloutConfig(quant=kv_only, compute_dtype="float32"))
  lp, _ = trainer(params, res, qat.QatContext(kv_only, compute_dtype=jnp.float32))
  bf16_lp, _ = trainer(params, res, qat.QatContext(compute_dtype=jnp.float32))
  m = np.asarray(res.response_mask[:, 1:], bool)
  d = lambda a: float(np.abs(np.asarray(a) - np.asarray(res.logprobs[:, 1:]))[m].max())
  assert d(lp) < 1e-4 < d(bf16_lp), (d(lp), d(bf16_lp))
  full = gen(params, batch, full_engine(FP8_KV))
  assert all(KEY not in g and VALUE not in g and MOE_INPUT in g for g in full.guidance)
  assert QuantConfig(kv_format="bf16").quantizes("kv") is False


# --- BF16 layers ----------------------------------------------------------------------------


def test_bf16_layers_run_exactly_as_bf16(params, batch):
  """Layers in quant.bf16_layers are the BF16 engine's and the BF16 trainer's, bit for bit: all of them
  BF16 gives the BF16 rollout and logits; a BF16 first layer is the BF16 model's first layer; the FP4
  layers still record guidance, the BF16 ones none."""
  every = dataclasses.replace(QuantConfig(), bf16_layers=(0, -1))
  bf16_res = gen(params, batch, RolloutConfig(quant=None))
  res = gen(params, batch, RolloutConfig(quant=every))
  np.testing.assert_array_equal(np.asarray(res.tokens), np.asarray(bf16_res.tokens))
  np.testing.assert_array_equal(np.asarray(res.logprobs), np.asarray(bf16_res.logprobs))
  lp_all, _ = trainer(params, res, qat.QatContext(every))
  lp_bf16, _ = trainer(params, res, qat.QatContext())
  np.testing.assert_array_equal(np.asarray(lp_all), np.asarray(lp_bf16))

  # the first layer alone (a 1-layer model of the same weights): BF16 with bf16_layers=(0,) in a 2-layer config
  first = dataclasses.replace(QuantConfig(), bf16_layers=(0,))
  cfg1 = dataclasses.replace(CFG, num_layers=1)
  params1 = dataclasses.replace(params, layers=params.layers[:1])
  one_layer_bf16 = gen(params1, batch, RolloutConfig(quant=None), cfg1)
  one_layer = gen(params1, batch, RolloutConfig(quant=first), cfg1)
  np.testing.assert_array_equal(np.asarray(one_layer.logprobs), np.asarray(one_layer_bf16.logprobs))
  fp4_one_layer = gen(params1, batch, RolloutConfig(quant=QuantConfig()), cfg1)
  assert not np.array_equal(np.asarray(fp4_one_layer.logprobs), np.asarray(one_layer_bf16.logprobs))

  engine = rollout.weight_sync(params, first)
  assert not isinstance(engine.layers[0].mlp.gate, fp4.QuantizedArray)
  assert isinstance(engine.layers[1].mlp.gate, fp4.QuantizedArray)
  res = gen(params, batch, full_engine(first))
  assert res.guidance[0] == {} and res.codes[0] == {} and {MOE_INPUT, KEY, VALUE} <= set(res.guidance[1])
  _, aux = trainer(params, res, qat.QatContext(first, guided=True), res.guidance)
  assert agreement(aux)[1] > 0 and all(int(s.total) == 0 for s in aux.quant_stats[0].values())


def test_bf16_layers_leave_trace_unguided_there():
  from trace_jax.config import resolve_mode

  quant = QuantConfig(bf16_layers=(-1,))
  assert resolve_mode("trace", CFG, quant).rollout.guided_layers == ()  # the deeper half is layer 1, BF16
  assert resolve_mode("trace_full", CFG, quant).rollout.guided_layers == (0,)
  with pytest.raises(ConfigError, match="quant.bf16_layers"):
    resolve_mode("trace", CFG, QuantConfig(bf16_layers=(2,)))


# --- sequence-level corrections --------------------------------------------------------------


def _logps(log_ratios):
  """(train, rollout, mask) log-probs whose per-token log-ratios are `log_ratios` (NaN = padding)."""
  lr = np.asarray(log_ratios, np.float32)
  mask = ~np.isnan(lr)
  rollout_logp = np.full(lr.shape, -1.0, np.float32)
  return jnp.asarray(rollout_logp + np.nan_to_num(lr)), jnp.asarray(rollout_logp), jnp.asarray(mask)


LN2 = float(np.log(2.0))
RATIOS = [
  [0.0, 0.1, -0.1, np.nan],  # on-policy-ish
  [0.0, 1.0, 0.0, 0.0],  # one token with ratio e (outside [0.5, 2]); the sequence's product e, outside
  [0.5, 0.5, np.nan, np.nan],  # every token inside, their product e outside
  [-0.3, 0.3, -0.3, 0.3],  # tokens inside, product 1
]


def kept(cfg, ratios=RATIOS):
  keep, metrics = rl.off_policy_mask(*_logps(ratios), cfg)
  return np.asarray(keep), jax.device_get(metrics)


def test_masked_importance_sampling_on_hand_made_ratios():
  keep, metrics = kept(GRPOConfig(mis="token"))
  np.testing.assert_array_equal(keep, [[1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
  assert metrics["correction/token_kept_frac"] == pytest.approx(12 / 13)
  keep, metrics = kept(GRPOConfig(mis="sequence"))
  np.testing.assert_array_equal(keep.any(1), [True, False, False, True])
  assert metrics["correction/seq_kept_frac"] == 0.5
  keep, _ = kept(GRPOConfig(mis="sequence", mis_band=(0.2, 3.0)))  # e < 3: all kept
  np.testing.assert_array_equal(keep, ~np.isnan(np.asarray(RATIOS)))
  keep, _ = kept(GRPOConfig(mis="token"), [[LN2 - 1e-4, -LN2 + 1e-4, LN2 + 1e-4]])  # the band is closed
  np.testing.assert_array_equal(keep, [[1, 1, 0]])


def test_trust_region_masking_on_hand_made_ratios():
  k3 = lambda lr: np.expm1(lr) - lr
  # max: k3(1.0) = 0.718, k3(0.5) = 0.149, k3(+-0.3) = 0.050 / 0.041, k3(0.1) = 0.0052
  keep, _ = kept(GRPOConfig(trust_region="max", trust_region_delta=0.1))
  np.testing.assert_array_equal(keep.any(1), [True, False, False, True])
  keep, _ = kept(GRPOConfig(trust_region="max", trust_region_delta=float(k3(0.3)) - 1e-6))
  np.testing.assert_array_equal(keep.any(1), [True, False, False, False])
  # geo: |mean log r| = 0, 0.25, 0.5, 0
  keep, _ = kept(GRPOConfig(trust_region="geo", trust_region_delta=0.3))
  np.testing.assert_array_equal(keep.any(1), [True, True, False, True])
  np.testing.assert_array_equal(keep[1], [1, 1, 1, 1])  # a kept sequence keeps all its tokens


def test_corrections_leave_the_loss_of_masked_tokens_out():
  train, rollout_logp, mask = _logps(RATIOS)
  adv = jnp.asarray([1.0, -1.0, 2.0, 0.5])
  cfg = GRPOConfig(mis="sequence", tis_cap=0.0)
  loss, metrics = rl.grpo_loss(train, train, rollout_logp, adv, mask, cfg)
  # ratio pi/pi_old = 1: the pg term of a token is -adv; kept: sequences 0 (3 tokens) and 3 (4 tokens)
  assert float(loss) == pytest.approx(-(3 * 1.0 + 4 * 0.5) / 7)
  plain, _ = rl.grpo_loss(train, train, rollout_logp, adv, mask, GRPOConfig(tis_cap=0.0))
  assert float(plain) == pytest.approx(-(3 * 1.0 - 4 + 2 * 2.0 + 4 * 0.5) / 13)
  assert "correction/seq_kept_frac" in metrics


def test_bad_correction_and_recipe_fields_name_themselves():
  for field, kwargs in (
    ("rl.mis", dict(mis="seq")),
    ("rl.mis_band", dict(mis_band=(1.5, 2.0))),
    ("rl.trust_region", dict(trust_region="kl")),
    ("rl.trust_region_delta", dict(trust_region_delta=0.0)),
  ):
    with pytest.raises(ConfigError, match=field):
      GRPOConfig(**kwargs)
  with pytest.raises(ConfigError, match="quant.kv_format"):
    QuantConfig(kv_format="fp6")
  with pytest.raises(ConfigError, match="quant.tensor_scale"):
    QuantConfig(fmt="mxfp4", tensor_scale="per_token")


# --- the FP4 KV cache's attention against torchao + torch ------------------------------------------


def test_fp4_kv_attention_is_torchaos_nvfp4_then_torch_attention(params):
  """The engine's attention over an FP4 KV cache (an fp32 engine, prefill) equals an independent one: Q / K / V
  projected, QK-normed and rotated (HF's rotate-half RoPE) in torch, K and V through torchao's NVFP4 (blocks of
  16 along head_dim, per token and head, after RoPE), then causal GQA softmax attention in torch."""
  import torch
  from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

  quant = QuantConfig(targets=("kv",))
  st = rollout.EngineSettings(CFG, RolloutConfig(quant=quant, compute_dtype="float32"))
  p = rollout.weight_sync(params, quant, jnp.float32).layers[0].attn
  b, s, d = 2, 7, CFG.head_dim
  x = jax.random.normal(jax.random.key(7), (b, s, CFG.hidden_size), jnp.float32)
  positions, slot_mask = jnp.broadcast_to(jnp.arange(s), (b, s)), jnp.ones((b, s), jnp.int32)

  def engine(q):
    settings = dataclasses.replace(st, rollout=dataclasses.replace(st.rollout, quant=q))
    cache = rollout.init_cache(CFG, b, s, q, jnp.float32)[0]
    return np.asarray(jax.jit(lambda x: rollout._attention(p, x, cache, 0, positions, slot_mask, settings)[0])(x))

  t = lambda a: torch.from_numpy(np.array(a, np.float32))
  xt = t(x)
  q, k, v = (torch.einsum("bsh,hnd->bsnd", xt, t(w)) for w in (p.q, p.k, p.v))
  norm = lambda a, w: a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + CFG.rms_norm_eps) * t(w)
  q, k = norm(q, p.q_norm), norm(k, p.k_norm)
  inv = 1.0 / (CFG.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
  ang = torch.arange(s, dtype=torch.float32)[:, None] * inv
  cos, sin = torch.cat([ang, ang], -1).cos()[None, :, None], torch.cat([ang, ang], -1).sin()[None, :, None]
  rope = lambda a: a * cos + torch.cat([-a[..., d // 2 :], a[..., : d // 2]], -1) * sin
  q, k = rope(q), rope(k)

  def attend(k, v):
    g = CFG.num_heads // CFG.num_kv_heads
    kk, vv = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    scores = torch.einsum("bqnd,bknd->bnqk", q, kk) * d**-0.5
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("bnqk,bknd->bqnd", scores.softmax(-1), vv)
    return torch.einsum("bsnd,ndh->bsh", out, t(p.o)).numpy()

  nvfp4 = lambda a: NVFP4Tensor.to_nvfp4(a.reshape(-1, d).contiguous(), 16).dequantize(torch.float32).reshape(a.shape)
  want, want_bf16_kv = attend(nvfp4(k), nvfp4(v)), attend(k, v)
  got = engine(quant)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(engine(None), want_bf16_kv, rtol=1e-5, atol=1e-6)
  assert np.abs(got - want_bf16_kv).max() > 100 * np.abs(got - want).max()  # FP4 K / V change the output
