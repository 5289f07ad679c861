"""The rollout engine against the trainer: log-prob parity, weight sync, TRACE guidance, sampling.

References: the trainer's teacher-forced `model.forward` for log-probs, greedy choices,
codes and routing; the trainer's RTN fake-quantizer for the packed expert weights; plain
numpy temperature / top-k / top-p distributions (chi-square) for `rollout.sample`.
Each `generate` configuration is compiled once (module-scoped fixtures, fixed shapes, always
passing `seq_ids`). Run with `-s` to see the measured mismatch figures.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import pallas_kernels
from tests.test_fp4 import torchao_ref
from tests.tiny import tiny_model
from trace_jax import cluster, experience, fp4, model, qat, quantizer, rollout, sharding
from trace_jax.config import (
  KEY,
  MOE_INPUT,
  VALUE,
  ConfigError,
  QuantConfig,
  RolloutConfig,
  SamplingConfig,
  deeper_layers,
)
from trace_jax.experience import RolloutResult, TrainBatch, guidance_bytes_per_token
from trace_jax.expert_parallel import ExpertParallel
from trace_jax.trainer import quant_metrics

# initializer_range 3x HF's default: larger activations make the FP4 mismatch visible
CFG = tiny_model(vocab_size=40, num_layers=4, initializer_range=0.06)
L = CFG.num_layers
B, P, NEW = 4, 6, 8
PADS = (0, 2, 3, 1)  # left padding per row (row 0 unpadded)
QUANT = QuantConfig()  # NVFP4 W4A4 experts + FP4 KV cache

FP32_ENGINE = RolloutConfig(quant=None, compute_dtype="float32")
BF16_ENGINE = RolloutConfig(quant=None)
FP4_FULL = RolloutConfig(quant=QUANT, guided_layers=tuple(range(L)), guidance_form="full", record_codes=True)
FP4_COMPACT = RolloutConfig(
  quant=QUANT, guided_layers=deeper_layers(L, 0.5), guidance_form="mantissa_scale", record_codes=True
)
SAMPLE = SamplingConfig(max_new_tokens=NEW, temperature=1.0, eos_id=2)
GREEDY = SamplingConfig(max_new_tokens=NEW, temperature=0.0, eos_id=2)

TRAIN_FP32 = qat.QatContext(compute_dtype=jnp.float32)
TRAIN_BF16 = qat.QatContext()
TRAIN_RTN = qat.QatContext(QUANT, guided=False)
TRAIN_GUIDED = qat.QatContext(QUANT, guided=True)
TRAIN_TRACE = qat.QatContext(QUANT, guided=True, guided_layers=deeper_layers(L, 0.5))

QUANT2 = QuantConfig(tensor_scale="batch_amax")  # two-level NVFP4 on activations and K/V
FP4_FULL2 = dataclasses.replace(FP4_FULL, quant=QUANT2)
TRAIN_RTN2 = qat.QatContext(QUANT2, guided=False)
TRAIN_GUIDED2 = qat.QatContext(QUANT2, guided=True)


def gen(engine_params, tokens, mask, key, rollout_config, sampling, seq_ids=None):
  """generate() with seq_ids always given, so each configuration compiles once."""
  seq_ids = jnp.arange(tokens.shape[0]) if seq_ids is None else seq_ids
  return rollout.generate(
    engine_params,
    tokens,
    mask,
    key,
    model_config=CFG,
    rollout_config=rollout_config,
    sampling=sampling,
    seq_ids=seq_ids,
  )


@functools.partial(jax.jit, static_argnames=("ctx",))
def _forward(params, tokens, mask, ctx, guidance, replay_ids):
  return model.forward(params, tokens, mask, CFG, ctx=ctx, guidance=guidance, replay_ids=replay_ids)


def drop_last(tree):
  """Rollout records are laid out [B, T, ...]; the trainer sees inputs tokens[:, :-1]."""
  return jax.tree_util.tree_map(lambda a: a[:, :-1] if a.ndim >= 2 else a, tree)


def trainer(params, res: RolloutResult, ctx, guidance=None, replay=False):
  """Teacher-forced trainer on the rollout's tokens: (log-probs of tokens[:, 1:], logits, aux)."""
  replay_ids = drop_last(res.topk_ids) if replay else None
  guidance = None if guidance is None else drop_last(guidance)
  logits, aux = _forward(params, res.tokens[:, :-1], res.mask[:, :-1], ctx, guidance, replay_ids)
  return model.token_logprobs(logits, res.tokens[:, 1:]), logits, aux


def dlogp(train_logprobs, res: RolloutResult):
  """(mean, max) |logp_train - logp_rollout| over response tokens."""
  m = np.asarray(res.response_mask[:, 1:], bool)
  d = np.abs(np.asarray(train_logprobs) - np.asarray(res.logprobs[:, 1:]))[m]
  return float(d.mean()), float(d.max())


def agreement(aux, layers=None) -> tuple[int, int]:
  """(matches, total) FP4 codes over the given layers (default all) and all their tensors."""
  layers = range(L) if layers is None else layers
  s = [aux.quant_stats[i][n] for i in layers for n in aux.quant_stats[i]]
  return sum(int(x.matches) for x in s), sum(int(x.total) for x in s)


def per_layer_agreement(aux) -> list[str]:
  return [
    " ".join(f"{n}={int(s.matches) / max(int(s.total), 1):.3f}" for n, s in sorted(aux.quant_stats[i].items()))
    for i in range(L)
  ]


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def params():
  return jax.jit(model.init_params, static_argnums=0)(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def batch():
  tokens = jax.random.randint(jax.random.key(1), (B, P), 3, CFG.vocab_size)  # no pad/eos in prompts
  mask = (jnp.arange(P)[None, :] >= jnp.asarray(PADS)[:, None]).astype(jnp.int32)
  return tokens * mask, mask


@pytest.fixture(scope="module")
def fp32_engine(params):
  return rollout.weight_sync(params, None, jnp.float32)


@pytest.fixture(scope="module")
def fp4_engine(params):
  return rollout.weight_sync(params, QUANT)


def generated(engine: str, rollout_config, sampling):
  """A module fixture: the batch generated once by the engine fixture named `engine` (key 5)."""

  @pytest.fixture(scope="module")
  def fixture(request, batch):
    return gen(request.getfixturevalue(engine), *batch, jax.random.key(5), rollout_config, sampling)

  return fixture


fp32_sampled = generated("fp32_engine", FP32_ENGINE, SAMPLE)
greedy = generated("fp32_engine", FP32_ENGINE, GREEDY)
fp4_full = generated("fp4_engine", FP4_FULL, SAMPLE)
fp4_compact = generated("fp4_engine", FP4_COMPACT, SAMPLE)


@pytest.fixture(scope="module")
def fp4_rtn_trainer(params, fp4_full):
  """Vanilla QAT (RTN) trainer, measuring its codes against the rollout's full codes."""
  return trainer(params, fp4_full, TRAIN_RTN, fp4_full.codes, replay=True)


@pytest.fixture(scope="module")
def fp4_guided_trainer(params, fp4_full):
  """TRACE trainer guided by full codes in every layer (the trace_full ablation)."""
  return trainer(params, fp4_full, TRAIN_GUIDED, fp4_full.guidance, replay=True)


# --- BF16 engine: log-prob parity -------------------------------------------------------------


def test_fp32_engine_logprobs_equal_trainer(params, fp32_sampled):
  lp, _, _ = trainer(params, fp32_sampled, TRAIN_FP32)
  mean, mx = dlogp(lp, fp32_sampled)
  print(f"\nfp32 engine vs fp32 trainer: mean |dlogp| {mean:.2e}, max {mx:.2e}")
  assert int(fp32_sampled.response_mask.sum()) > 2 * B
  assert mx < 1e-4


def test_bf16_engine_mismatch_is_real_but_small(params, batch):
  """The bf16 engine computes differently from the trainer (the mismatch TRACE targets)."""
  res = gen(rollout.weight_sync(params, None), *batch, jax.random.key(5), BF16_ENGINE, SAMPLE)
  figures = {}
  for name, ctx in (("fp32", TRAIN_FP32), ("bf16", TRAIN_BF16)):
    lp, _, aux = trainer(params, res, ctx)
    figures[name] = dlogp(lp, res)
    real = np.asarray(res.mask[:, :-1], bool)
    routed = [
      np.mean(np.all(np.asarray(a) == np.asarray(r[:, :-1]), -1)[real]) for a, r in zip(aux.topk_ids, res.topk_ids)
    ]
    print(
      f"\nbf16 engine vs {name} trainer: mean |dlogp| {figures[name][0]:.4f}, max {figures[name][1]:.4f}; "
      f"top-k routing agreement per layer (no replay) {np.round(routed, 3).tolist()}"
    )
  for mean, mx in figures.values():
    assert 1e-4 < mx < 0.5 and mean < 0.1


# --- weight sync ------------------------------------------------------------------------------


def test_weight_sync_codes_equal_trainer_fake_quant(params, fp4_engine):
  for layer, engine_layer in zip(params.layers, fp4_engine.layers):
    for name in ("gate", "up", "down"):
      w = getattr(layer.mlp, name)  # trainer [E, K, N]
      packed = getattr(engine_layer.mlp, name)  # engine [E, N, K/2]
      codes = quantizer.fake_quant_codes(jnp.swapaxes(w, 1, 2), QUANT.fmt)  # blocks along K
      np.testing.assert_array_equal(np.asarray(packed.codes), np.asarray(fp4.pack_nibbles(codes)))
      # and the values the trainer's W4 fake-quant multiplies with are the engine's dequantized weights
      trained = TRAIN_RTN.weight(w, "experts", axis=1)
      np.testing.assert_array_equal(np.asarray(trained), np.asarray(jnp.swapaxes(fp4.dequantize(packed), 1, 2)))


# --- FP4 engine: TRACE guidance -----------------------------------------------------------------


def test_guided_trainer_reproduces_rollout_codes(fp4_rtn_trainer, fp4_guided_trainer):
  (m_rtn, t_rtn), (m_g, t_g) = agreement(fp4_rtn_trainer[2]), agreement(fp4_guided_trainer[2])
  print(f"\nFP4 code agreement, all layers and tensors: RTN {m_rtn / t_rtn:.4f}, guided(full) {m_g / t_g:.4f}")
  for i, (r, g) in enumerate(zip(per_layer_agreement(fp4_rtn_trainer[2]), per_layer_agreement(fp4_guided_trainer[2]))):
    print(f"  layer {i}: RTN {r} | guided {g}")
  assert t_g == t_rtn > 0
  assert m_g / t_g >= 0.999
  assert m_rtn < m_g


def test_guided_logprobs_closer_to_rollout(fp4_full, fp4_rtn_trainer, fp4_guided_trainer):
  rtn, guided = dlogp(fp4_rtn_trainer[0], fp4_full), dlogp(fp4_guided_trainer[0], fp4_full)
  print(
    f"\nFP4 engine vs QAT trainer |dlogp| mean/max: RTN {rtn[0]:.4f}/{rtn[1]:.4f}, guided(full) {guided[0]:.4f}/{guided[1]:.4f}"
  )
  assert guided[0] < rtn[0]


def test_routing_replay_reproduces_rollout_experts(fp4_full, fp4_rtn_trainer):
  real = np.asarray(fp4_full.mask[:, :-1], bool)
  for ids, rollout_ids in zip(fp4_rtn_trainer[2].topk_ids, fp4_full.topk_ids):
    np.testing.assert_array_equal(np.asarray(ids)[real], np.asarray(rollout_ids[:, :-1])[real])


def test_compact_guidance_bytes(fp4_full, fp4_compact):
  full = [sum(guidance_bytes_per_token([g]).values()) for g in fp4_full.guidance]
  compact = [sum(guidance_bytes_per_token([g]).values()) for g in fp4_compact.guidance]
  ratios = [c / f for c, f in zip(compact, full)]
  total = fp4_compact.guidance_bytes_per_token / fp4_full.guidance_bytes_per_token
  print(
    f"\nguidance bytes/token per layer: full {full} (total {fp4_full.guidance_bytes_per_token}), "
    f"mantissa_scale deeper half {compact} (total {fp4_compact.guidance_bytes_per_token}); "
    f"per guided layer ratio {[round(r, 4) for r in ratios]}, total ratio {total:.4f}"
  )
  assert sum(full) == fp4_full.guidance_bytes_per_token and sum(compact) == fp4_compact.guidance_bytes_per_token
  # NVFP4: 1.5 bits/element (mantissa bit + 8-bit scale per 16) against 4.5 (code + scale): 1/3 per layer
  for i in range(L):
    assert 3 * compact[i] == (full[i] if i in FP4_COMPACT.guided_layers else 0)
  # ... and guiding only the deeper half: 1/6 of full codes in every layer
  assert 6 * fp4_compact.guidance_bytes_per_token <= fp4_full.guidance_bytes_per_token


def test_compact_guidance_is_the_mantissa_of_the_codes(fp4_full, fp4_compact):
  """Recording is a side output: same tokens; the shipped bits and scales are those of the codes."""
  np.testing.assert_array_equal(np.asarray(fp4_full.tokens), np.asarray(fp4_compact.tokens))
  for i in FP4_COMPACT.guided_layers:
    for name, g in fp4_compact.guidance[i].items():
      codes = fp4_compact.codes[i][name]
      bits = fp4.pack_bits(fp4.mantissa_bit(fp4.unpack_nibbles(codes.codes)))
      np.testing.assert_array_equal(np.asarray(g.mantissa_bits), np.asarray(bits))
      np.testing.assert_array_equal(np.asarray(g.scales).view(np.uint8), np.asarray(codes.scales).view(np.uint8))
      assert g.codes is None


def with_diagnostic_codes(res: RolloutResult) -> tuple:
  """The rollout's guidance with its full codes alongside (what `experience.trainer_guidance` ships with diagnostics)."""
  return tuple(
    {
      n: dataclasses.replace(res.guidance[i][n], codes=c.codes) if i in FP4_COMPACT.guided_layers else c
      for n, c in res.codes[i].items()
    }
    for i in range(L)
  )


def test_compact_guidance_steers_the_deeper_half(params, fp4_full, fp4_compact, fp4_rtn_trainer):
  """TRACE mode: mantissa + scale in the deeper half, RTN below (codes alongside only to measure)."""
  guidance = with_diagnostic_codes(fp4_compact)
  lp, _, aux = trainer(params, fp4_compact, TRAIN_TRACE, guidance, replay=True)
  deep, shallow = FP4_COMPACT.guided_layers, [i for i in range(L) if i not in FP4_COMPACT.guided_layers]
  (m_deep, t_deep), (m_shallow, t_shallow) = agreement(aux, deep), agreement(aux, shallow)
  mean, mx = dlogp(lp, fp4_compact)
  np.testing.assert_array_equal(np.asarray(fp4_full.tokens), np.asarray(fp4_compact.tokens))  # same rollout
  rtn_mean = dlogp(fp4_rtn_trainer[0], fp4_full)[0]
  print(
    f"\nTRACE (mantissa_scale, layers {deep}): code agreement guided layers {m_deep / t_deep:.4f}, "
    f"RTN layers {m_shallow / t_shallow:.4f}; |dlogp| mean {mean:.4f} max {mx:.4f} (RTN trainer mean {rtn_mean:.4f})"
  )
  for i, row in enumerate(per_layer_agreement(aux)):
    print(f"  layer {i}: {row}")
  rtn_deep = agreement(fp4_rtn_trainer[2], deep)
  assert m_deep / t_deep >= 0.98 and m_deep / t_deep > rtn_deep[0] / rtn_deep[1] + 0.1
  assert mean < rtn_mean


def test_guided_tensor_subset(params, fp4_engine, batch, fp4_full, fp4_rtn_trainer, fp4_guided_trainer):
  """trace.tensors: the engine ships only the chosen tensors, and in the trainer the diagnostic codes
  of the other tensors are measured, never used for rounding."""
  subset = dataclasses.replace(FP4_FULL, guided_tensors=(MOE_INPUT,))
  shapes = jax.eval_shape(lambda p, t, m: gen(p, t, m, jax.random.key(5), subset, SAMPLE), fp4_engine, *batch)
  assert all(set(layer) == {MOE_INPUT} for layer in shapes.guidance)
  assert set(guidance_bytes_per_token(shapes.guidance)) == {MOE_INPUT}
  full_bytes = guidance_bytes_per_token(fp4_full.guidance)
  assert sum(guidance_bytes_per_token(shapes.guidance).values()) == full_bytes[MOE_INPUT] < sum(full_bytes.values())

  # What the trainer receives in that setting: the shipped tensor's guidance, diagnostic codes for the rest.
  guidance = tuple(
    {n: fp4_full.guidance[i][n] if n == MOE_INPUT else c for n, c in fp4_full.codes[i].items()} for i in range(L)
  )
  ctx = qat.QatContext(QUANT, guided=True, guided_tensors=(MOE_INPUT,))
  _, _, aux = trainer(params, fp4_full, ctx, guidance, replay=True)
  rtn, guided = fp4_rtn_trainer[2].quant_stats, fp4_guided_trainer[2].quant_stats
  for name in (KEY, VALUE):  # layer 0's K/V come before any guided tensor: RTN exactly
    assert int(aux.quant_stats[0][name].matches) == int(rtn[0][name].matches), name
  kv = lambda stats: sum(int(stats[i][n].matches) for i in range(L) for n in (KEY, VALUE))
  assert kv(aux.quant_stats) < kv(guided)  # K/V codes were not steered by their diagnostic codes
  share = lambda stats, i: int(stats[i][MOE_INPUT].matches) / int(stats[i][MOE_INPUT].total)
  # moe_input is steered (short of 100% where unguided K/V moved it by more than one grid step)
  assert all(share(aux.quant_stats, i) > share(rtn, i) for i in range(L))


@pytest.mark.parametrize("top_k", [0, 5])
def test_trainer_logprobs_follow_the_sampling_temperature(params, batch, top_k):
  """At temperature 0.7 (with or without top-k truncation) the trainer recomputes the log-probs of the
  policy that sampled: the BF16 engine-trainer gap stays at its temperature-1 level."""
  engine = rollout.weight_sync(params, None)
  gaps = {}
  for temperature in (1.0, 0.7):
    sampling = dataclasses.replace(SAMPLE, temperature=temperature, top_k=top_k)
    res = gen(engine, *batch, jax.random.key(5), BF16_ENGINE, sampling)
    _, logits, _ = trainer(params, res, TRAIN_BF16)
    for name, policy in (("tempered", sampling), ("untempered", None)):
      gaps[temperature, name] = dlogp(model.token_logprobs(logits, res.tokens[:, 1:], policy), res)[0]
  print(f"\ntop_k={top_k}: BF16 engine vs trainer |dlogp| mean {gaps}")
  assert gaps[0.7, "tempered"] < 2 * gaps[1.0, "tempered"] + 1e-3
  assert gaps[0.7, "untempered"] > 10 * gaps[0.7, "tempered"]


# --- two-level NVFP4 ------------------------------------------------------------------------------


def test_online_two_level_quantization_is_torchaos():
  """The engine's activation (`_act`) and K/V (`_store`) quantization with quant.tensor_scale='batch_amax'
  is torchao's two-level NVFP4 with the per-tensor scale of the whole call's batch, kept once per row."""
  rng = np.random.default_rng(3)
  for fn, shape in (
    (lambda v: rollout._act(v, QUANT2, "experts")[1], (6, 64)),
    (lambda v: rollout._store(v, QUANT2), (2, 3, 2, 32)),
  ):
    x = (rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, (*shape[:-1], 1)))).astype(np.float32)
    q = jax.jit(fn)(jnp.asarray(x, jnp.bfloat16))
    scales, codes, _ = torchao_ref(x.reshape(-1, shape[-1]), "nvfp4", "bfloat16", two_level=True)  # torchao: 2-D
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8).reshape(scales.shape), scales)
    np.testing.assert_array_equal(np.asarray(q.codes).reshape(codes.shape), codes)
    amax = np.abs(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)).max()
    np.testing.assert_array_equal(np.asarray(q.tensor_scale), np.full(shape[:-1], np.float32(amax) / np.float32(2688)))


@pytest.fixture(scope="module")
def fp4_two_level(fp4_engine, batch):
  return gen(fp4_engine, *batch, jax.random.key(5), FP4_FULL2, SAMPLE)


def test_two_level_scales_are_per_engine_batch_and_guide_the_trainer(params, fp4_two_level):
  """The engine's tensor scale is the amax of each forward call: one for the whole prefill, one per
  decode step, the same for every row of a call. Shipped with the guidance, it lets the guided
  trainer reproduce the rollout's codes as in single-level NVFP4."""
  res = fp4_two_level
  ran = int(np.asarray(res.mask).sum(1).max()) - 1  # slots fed back through the engine: [0, ran)
  for i in range(L):
    for name, g in res.codes[i].items():
      ts = np.asarray(g.tensor_scale).reshape(B, res.tokens.shape[1], -1)[:, :ran]
      assert np.all(ts > 0), (i, name)
      assert np.all(ts[:, :P] == ts[0, 0, 0]), (i, name)  # the prefill: one batch
      assert np.all(ts[:, P:] == ts[:1, P:, :1]), (i, name)  # a decode step: one batch
      assert len(np.unique(ts)) > 1, (i, name)
  lp, _, aux = trainer(params, res, TRAIN_GUIDED2, res.guidance, replay=True)
  rtn_lp, _, rtn_aux = trainer(params, res, TRAIN_RTN2, res.codes, replay=True)
  (m_g, t_g), (m_rtn, t_rtn) = agreement(aux), agreement(rtn_aux)
  print(
    f"\ntwo-level NVFP4: code agreement RTN (own batch amax) {m_rtn / t_rtn:.4f}, guided(full) {m_g / t_g:.4f}; "
    f"|dlogp| mean RTN {dlogp(rtn_lp, res)[0]:.4f}, guided {dlogp(lp, res)[0]:.4f}"
  )
  assert t_g == t_rtn > 0 and m_g / t_g >= 0.999 and m_rtn < m_g


def test_without_codes_only_bit_agreement_is_reported(params, fp4_compact):
  """trace.diagnostics=False ships mantissa bits and scales, no codes: codeword agreement is not reported (NaN), and
  mantissa-bit agreement, which guided rounding forces, is reported under its own name."""
  _, _, aux = trainer(params, fp4_compact, TRAIN_TRACE, fp4_compact.guidance, replay=True)
  metrics = jax.device_get(quant_metrics(aux.quant_stats, drop_last(fp4_compact.guidance)))
  for i in range(L):
    for n in aux.quant_stats[i]:
      assert np.isnan(metrics[f"agreement/{n}/layer{i}"]), (i, n)
      if i in FP4_COMPACT.guided_layers:
        assert 0.99 <= metrics[f"bit_agreement/{n}/layer{i}"] <= 1, (i, n)
      else:
        assert f"bit_agreement/{n}/layer{i}" not in metrics
  assert not any(key.startswith("guidance/") for key in metrics)  # non-adjacent counts need the codes


@functools.partial(jax.jit, static_argnames=("ctx",))
def trainer_stats(params, batch: TrainBatch, ctx):
  """The trainer's code counts over the positions the engine recorded, as trainer.make_rl_step takes them."""
  _, aux = model.forward(params, batch.inputs, batch.mask, CFG, ctx=ctx, **experience.rollout_inputs(batch))
  return aux.quant_stats


def test_non_adjacent_rollout_codes_are_counted(params, fp4_compact):
  """With the diagnostic codes (TRACE's trainer batch): in the guided layers every code mismatch is a rollout code
  that is not a neighbour of the trainer's value, since the compact guidance reproduces every neighbour; in the RTN
  layers most mismatches are one codeword apart (about 80% here: this config's large activations diverge more)."""
  batch = experience.train_batch_from_rollout(fp4_compact, jnp.zeros((B,), jnp.float32), routing_replay=True)
  stats = trainer_stats(params, batch, TRAIN_TRACE)
  metrics = jax.device_get(quant_metrics(stats, batch.guidance))
  print("\nnon-adjacent share of the codes / adjacent share of the mismatches (TRACE trainer):")
  shallow = {"mismatches": 0, "non_adjacent": 0}
  for i in range(L):
    for n, s in stats[i].items():
      key = f"{n}/layer{i}"
      non_adjacent = metrics[f"guidance/non_adjacent_frac/{key}"]
      print(f"  layer {i} {n:10s} {non_adjacent:.5f} / {metrics[f'guidance/adjacent_share_of_mismatches/{key}']:.3f}")
      assert non_adjacent == int(s.non_adjacent) / int(s.total)
      if i in FP4_COMPACT.guided_layers:
        assert int(s.total) - int(s.matches) == int(s.non_adjacent), key
      else:
        shallow["mismatches"] += int(s.total) - int(s.matches)
        shallow["non_adjacent"] += int(s.non_adjacent)
  assert shallow["mismatches"] > 0 and shallow["non_adjacent"] < 0.5 * shallow["mismatches"]
  print(f"  pooled over every layer: {metrics['guidance/adjacent_share_of_mismatches']:.4f} of mismatches adjacent")


# --- greedy decoding, EOS, padding, per-sequence RNG --------------------------------------------


def test_greedy_tokens_are_trainer_argmax(params, greedy):
  lp, logits, _ = trainer(params, greedy, TRAIN_FP32)
  response = np.asarray(greedy.response_mask[:, 1:], bool)
  np.testing.assert_array_equal(
    np.asarray(jnp.argmax(logits, -1))[response], np.asarray(greedy.tokens[:, 1:])[response]
  )
  assert dlogp(lp, greedy)[1] < 1e-4  # greedy reports the temperature-1 log-prob


def test_left_padding_keeps_the_greedy_continuation(fp32_engine, batch, greedy):
  """Two more pad slots (holding garbage tokens) on the left of every row change nothing."""
  tokens, mask = batch
  extra = jnp.full((B, 2), 17, jnp.int32)
  padded = gen(
    fp32_engine,
    jnp.concatenate([extra, tokens], 1),
    jnp.concatenate([jnp.zeros_like(extra), mask], 1),
    jax.random.key(5),
    FP32_ENGINE,
    GREEDY,
  )
  np.testing.assert_array_equal(np.asarray(padded.tokens[:, P + 2 :]), np.asarray(greedy.tokens[:, P:]))
  np.testing.assert_array_equal(np.asarray(padded.response_mask[:, 2:]), np.asarray(greedy.response_mask))
  np.testing.assert_allclose(np.asarray(padded.logprobs[:, 2:]), np.asarray(greedy.logprobs), atol=1e-5)


def test_eos_ends_the_response(params, batch, greedy):
  """Params whose EOS column copies (x1.01) a token that greedy emits: EOS then wins there."""
  eos, pad = GREEDY.eos_id, GREEDY.pad_id
  favored = int(greedy.tokens[0, P + 2])
  assert favored != eos
  eos_params = dataclasses.replace(params, lm_head=params.lm_head.at[:, eos].set(1.01 * params.lm_head[:, favored]))
  res = gen(rollout.weight_sync(eos_params, None, jnp.float32), *batch, jax.random.key(5), FP32_ENGINE, GREEDY)
  tokens, resp = np.asarray(res.tokens), np.asarray(res.response_mask)
  logprobs, mask = np.asarray(res.logprobs), np.asarray(res.mask)
  ends = []
  for b in range(B):
    hits = np.flatnonzero(tokens[b, P:] == eos)
    end = P + (hits[0] + 1 if hits.size else NEW)  # one past the last response slot
    ends.append(int(end))
    assert np.all(tokens[b, end:] == pad)
    assert np.all(resp[b, :P] == 0) and np.all(resp[b, P:end] == 1) and np.all(resp[b, end:] == 0)
    np.testing.assert_array_equal(mask[b], np.concatenate([np.asarray(batch[1][b]), resp[b, P:]]))
    assert np.all(logprobs[b, :P] == 0) and np.all(logprobs[b, end:] == 0) and np.all(logprobs[b, P:end] < 0)
  print(f"\nEOS run: response ends (exclusive) per row {ends} of {P + NEW}")
  assert min(ends) < P + NEW - 1  # an early EOS, followed by pads, is exercised
  lp, _, _ = trainer(eos_params, res, TRAIN_FP32)
  assert dlogp(lp, res)[1] < 1e-4  # the EOS token's log-prob included


def test_sampling_is_per_sequence(fp32_engine, batch, fp32_sampled):
  """A sequence's samples follow its seq_id, not its batch row."""
  tokens, mask = batch
  perm = jnp.asarray([2, 0, 3, 1])
  moved = gen(fp32_engine, tokens[perm], mask[perm], jax.random.key(5), FP32_ENGINE, SAMPLE, seq_ids=perm)
  np.testing.assert_array_equal(np.asarray(moved.tokens), np.asarray(fp32_sampled.tokens[perm]))
  np.testing.assert_allclose(np.asarray(moved.logprobs), np.asarray(fp32_sampled.logprobs[perm]), atol=1e-5)
  other = gen(fp32_engine, tokens, mask, jax.random.key(5), FP32_ENGINE, SAMPLE, seq_ids=jnp.arange(B) + B)
  assert not np.array_equal(np.asarray(other.tokens), np.asarray(fp32_sampled.tokens))


# --- sample(): temperature, top-k, top-p ------------------------------------------------------

PROBS = np.array([0.06, 0.25, 0.04, 0.4, 0.1, 0.15])  # unsorted on purpose
N_DRAWS = 20_000


def expected_distribution(logits, temperature, top_k, top_p):
  """Temperature, then top-k, then top-p on the renormalized rest (Hugging Face's warper order)."""
  z = logits / temperature
  p = np.exp(z - z.max())
  p /= p.sum()
  order = np.argsort(-p, kind="stable")
  if top_k:
    p[order[top_k:]] = 0
    p /= p.sum()
  if top_p < 1:
    cum = np.cumsum(p[order])
    keep = int(np.argmax(cum >= top_p)) + 1  # the smallest prefix with mass >= top_p
    p[order[keep:]] = 0
    p /= p.sum()
  return p


@pytest.mark.parametrize(
  "temperature, top_k, top_p, support",
  [
    (1.0, 0, 1.0, 6),
    (0.5, 0, 1.0, 6),
    (2.0, 0, 1.0, 6),
    (1.0, 3, 1.0, 3),
    (1.0, 0, 0.6, 2),  # 0.4 < 0.6 <= 0.4 + 0.25
    (1.0, 0, 0.3, 1),  # the top token alone already has the mass
    (1.0, 4, 0.85, 3),  # top-p over the top-4 renormalized (over the raw probs it would keep 4)
    (0.5, 0, 0.7, 2),  # top-p after temperature (at temperature 1 it would keep 3)
  ],
)
def test_sample_distribution(temperature, top_k, top_p, support):
  cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
  logits = np.log(PROBS).astype(np.float32)
  expected = expected_distribution(logits.astype(np.float64), temperature, top_k, top_p)
  assert np.count_nonzero(expected) == support
  keys = jax.random.split(jax.random.key(int(100 * temperature + 10 * top_k + 100 * top_p)), N_DRAWS)
  tokens, logp = rollout.sample(jnp.tile(logits, (N_DRAWS, 1)), keys, cfg)
  tokens = np.asarray(tokens)
  counts = np.bincount(tokens, minlength=len(PROBS))
  assert np.all(counts[expected == 0] == 0)  # never outside the top-k / top-p set
  kept = expected > 0
  tv = 0.5 * np.abs(counts / N_DRAWS - expected).sum()
  if support > 1:
    pvalue = stats.chisquare(counts[kept], N_DRAWS * expected[kept]).pvalue
    assert pvalue > 1e-3, (counts, expected)
  assert tv < 0.015
  # the reported log-prob is of the temperature-scaled distribution before truncation
  full = jax.nn.log_softmax(jnp.asarray(logits) / temperature)
  np.testing.assert_allclose(np.asarray(logp), np.asarray(full)[tokens], atol=1e-6)


def test_sample_greedy():
  logits = jax.random.normal(jax.random.key(0), (16, 40))
  tokens, logp = rollout.sample(logits, jax.random.split(jax.random.key(1), 16), SamplingConfig(temperature=0.0))
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(jnp.argmax(logits, -1)))
  np.testing.assert_allclose(logp, jnp.max(jax.nn.log_softmax(logits), -1), atol=1e-6)


# --- config validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
  "make, field",
  [
    (lambda: RolloutConfig(compute_dtype="float16"), "rollout.compute_dtype"),
    (lambda: RolloutConfig(guidance_form="bits"), "rollout.guidance_form"),
    (lambda: QuantConfig(matmul_impl="cuda"), "quant.matmul_impl"),
    (lambda: RolloutConfig(quant=None, guided_layers=(1,)), "rollout.guided_layers"),
    (lambda: RolloutConfig(quant=None, record_codes=True), "rollout.record_codes"),
    (lambda: RolloutConfig(guided_layers=(-1,)), "rollout.guided_layers"),
    (lambda: SamplingConfig(max_new_tokens=0), "rollout.max_new_tokens"),
    (lambda: SamplingConfig(temperature=-0.5), "rollout.temperature"),
    (lambda: SamplingConfig(top_k=-1), "rollout.top_k"),
    (lambda: SamplingConfig(top_p=0.0), "rollout.top_p"),
    (lambda: SamplingConfig(top_p=1.5), "rollout.top_p"),
    (lambda: QuantConfig(tensor_scale="amax"), "quant.tensor_scale"),
    (lambda: QuantConfig(fmt="mxfp4", tensor_scale="batch_amax"), "quant.tensor_scale"),
  ],
)
def test_config_errors_name_the_field(make, field):
  with pytest.raises(ConfigError, match=rf"config\.{field}\b"):
    make()


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_grouped_matmul_equal_groups_use_the_packed_path(impl):
  # Expert parallel's dense exchange (group_sizes=None: E equal groups) goes through the packed
  # grouped matmul (the Pallas kernel on GPU), not a decode of every expert to memory first.
  rng = np.random.default_rng(0)
  w = fp4.quantize(jnp.asarray(rng.standard_normal((4, 32, 64)), jnp.float32), "nvfp4")
  x = jnp.asarray(rng.standard_normal((4 * 6, 64)), jnp.bfloat16)
  out = rollout.grouped_matmul(x, w, None, impl)
  expected = jnp.einsum(
    "gmk,gnk->gmn", x.astype(jnp.float32).reshape(4, 6, 64), fp4.dequantize(w), precision=jax.lax.Precision.HIGHEST
  ).reshape(24, 32)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected), rtol=2**-7, atol=1e-2)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(rollout.grouped_matmul(x, w, jnp.full(4, 6), impl)))


# --- the Mosaic kernel's layout (fragments), wired through the engine -----------------------------

MOSAIC_CFG = tiny_model(hidden_size=128, moe_intermediate_size=128, initializer_range=0.06)  # N % 64, K % 128


def _with_kernels_as_references(monkeypatch) -> list[str]:
  """The GPU engine's path on CPU: Hopper reported, both FP4 kernels replaced by their jnp references
  (the Mosaic one on its weight unpacked). Returns the names of the kernels called (at trace time)."""
  from pallas_kernels import fp4_mosaic, grouped_fp4_matmul

  calls = []

  def mosaic_kernel(x, group_sizes, w, *, out_dtype, **_):
    calls.append("mosaic")
    unpacked = fp4_mosaic.unpack_fragments(w)
    return grouped_fp4_matmul.grouped_fp4_matmul_reference(x, group_sizes, unpacked, out_dtype=out_dtype)

  def triton_kernel(x, group_sizes, w, **options):
    calls.append("triton")
    return grouped_fp4_matmul.grouped_fp4_matmul_reference(x, group_sizes, w, **options)

  monkeypatch.setattr(pallas_kernels, "is_hopper", lambda: True)
  monkeypatch.setattr(fp4_mosaic, "grouped_fp4_matmul_mosaic", mosaic_kernel)
  monkeypatch.setattr(grouped_fp4_matmul, "grouped_fp4_matmul", triton_kernel)
  return calls


def test_engine_runs_the_mosaic_fragments_like_the_codes(monkeypatch):
  # matmul_impl='mosaic' runs the experts as wgmma fragments, packed at weight sync or inside generate
  # (the expert-parallel exchange included), and samples exactly what the codes layout (the Triton
  # kernel's) samples.
  calls = _with_kernels_as_references(monkeypatch)
  params = jax.jit(model.init_params, static_argnums=0)(MOSAIC_CFG, jax.random.key(0))
  synced = {layout: rollout.weight_sync(params, QUANT, expert_layout=layout) for layout in ("codes", "fragments")}
  tokens = jax.random.randint(jax.random.key(1), (2, P), 3, MOSAIC_CFG.vocab_size)
  mask = jnp.ones_like(tokens)
  single = ExpertParallel(cluster.Topology.single_device().rollout, capacity_factor=1.0)

  def run(impl, expert_parallel=None, synced_as="codes"):
    config = dataclasses.replace(FP4_FULL, quant=dataclasses.replace(QUANT, matmul_impl=impl), guided_layers=(0, 1))
    assert rollout.expert_layout(config, MOSAIC_CFG) == {"mosaic": "fragments", "pallas": "codes"}[impl]
    return rollout.generate(
      synced[synced_as],
      tokens,
      mask,
      jax.random.key(5),
      model_config=MOSAIC_CFG,
      rollout_config=config,
      sampling=SAMPLE,
      seq_ids=jnp.arange(2),
      expert_parallel=expert_parallel,
    )

  codes = run("pallas")
  assert set(calls) == {"triton"}
  calls.clear()
  for expert_parallel, synced_as in ((None, "codes"), (single, "fragments")):
    other = run("mosaic", expert_parallel, synced_as)
    assert set(calls) == {"mosaic"}
    calls.clear()
    for name in ("tokens", "logprobs", "topk_ids", "codes"):
      for a, b in zip(jax.tree_util.tree_leaves(getattr(codes, name)), jax.tree_util.tree_leaves(getattr(other, name))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name} {synced_as}")


def test_weight_sync_packs_fragments_for_the_mosaic_engine():
  # Weight sync packs the experts for the Mosaic kernel where it quantizes them: gate and up as one
  # weight, the same 4.5 bits per weight crossing meshes, sharded along the experts like the codes.
  from pallas_kernels import fp4_mosaic

  params = jax.jit(model.init_params, static_argnums=0)(MOSAIC_CFG, jax.random.key(0))
  mesh = cluster.Topology.single_device().rollout
  (codes, codes_bytes), (frags, frag_bytes) = (
    cluster.make_weight_sync(QUANT, mesh, mesh, layout)(params) for layout in ("codes", "fragments")
  )
  assert frag_bytes == codes_bytes
  moe_layer = next(i for i in range(MOSAIC_CFG.num_layers) if MOSAIC_CFG.is_moe_layer(i))
  c, f = codes.layers[moe_layer].mlp, frags.layers[moe_layer].mlp
  assert isinstance(f.gate, fp4_mosaic.FragmentWeight) and f.up is None
  e, i, h = MOSAIC_CFG.num_experts, MOSAIC_CFG.moe_intermediate_size, MOSAIC_CFG.hidden_size
  assert f.gate.shape == (e, 2 * i, h) and f.down.shape == (e, h, i)
  # an engine synced as fragments runs where the Mosaic kernel does not: as codes (Triton) or values (CPU)
  back = rollout.with_expert_layout(frags, "codes", jnp.bfloat16).layers[moe_layer].mlp
  np.testing.assert_array_equal(back.gate.codes, jnp.concatenate([c.gate.codes, c.up.codes], axis=1))
  np.testing.assert_array_equal(back.down.codes, c.down.codes)
  again = rollout.with_expert_layout(rollout.with_expert_layout(frags, "codes", jnp.bfloat16), "fragments", None)
  np.testing.assert_array_equal(again.layers[moe_layer].mlp.gate.words, f.gate.words)  # fused codes pack as they are
  values = [rollout.with_expert_layout(e, "values", jnp.bfloat16).layers[moe_layer].mlp for e in (codes, frags)]
  np.testing.assert_array_equal(values[1].gate, jnp.concatenate([values[0].gate, values[0].up], axis=1))
  np.testing.assert_array_equal(values[1].down, values[0].down)
  axes = sharding.logical_axes(frags).layers[moe_layer].mlp
  assert axes.gate.words == jax.sharding.PartitionSpec("experts", "mlp", "packed", "packed", "packed")
  assert axes.down.words == jax.sharding.PartitionSpec("experts", "embed", "packed", "packed", "packed")
  with pytest.raises(ValueError, match="unknown expert_layout 'bogus'"):
    rollout.weight_sync(params, QUANT, expert_layout="bogus")


def test_expert_layout_follows_the_device_and_the_weights(monkeypatch):
  layout = lambda impl, model_config=MOSAIC_CFG, **quant: rollout.expert_layout(
    dataclasses.replace(FP4_FULL, quant=dataclasses.replace(QUANT, matmul_impl=impl, **quant)), model_config
  )
  assert layout("auto") == layout("reference") == "values"  # CPU: no FP4 arithmetic, experts decoded once
  assert layout("pallas") == "codes"
  with pytest.raises(ConfigError, match=r"config\.quant\.matmul_impl = 'mosaic': .*sm_90"):
    layout("mosaic")
  monkeypatch.setattr(pallas_kernels, "is_hopper", lambda: True)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert layout("auto") == layout("mosaic") == "fragments"
  assert layout("auto", fmt="mxfp4") == layout("auto", CFG) == layout("pallas") == "codes"  # auto falls back
  with pytest.raises(ConfigError, match=r"config\.quant\.matmul_impl = 'mosaic': .*NVFP4"):
    layout("mosaic", fmt="mxfp4")
  with pytest.raises(ConfigError, match=r"N a multiple of 64"):
    layout("mosaic", CFG)  # hidden 64, experts of 32
  monkeypatch.setattr(pallas_kernels, "is_hopper", lambda: False)
  assert layout("auto") == "codes"  # another GPU: the Triton kernel


def test_grouped_packed_matmul_takes_fragments():
  # A FragmentWeight's reference is the grouped reference of the weight it packs.
  from pallas_kernels import fp4_mosaic, grouped_fp4_matmul

  rng = np.random.default_rng(0)
  w = fp4.quantize(jnp.asarray(rng.standard_normal((3, 64, 128)), jnp.float32), "nvfp4")
  x = jnp.asarray(rng.standard_normal((7, 128)), jnp.bfloat16)
  sizes = jnp.asarray([2, 0, 4])
  got = pallas_kernels.grouped_packed_matmul(x, sizes, fp4_mosaic.pack_fragments(w), impl="reference")
  want = grouped_fp4_matmul.grouped_fp4_matmul_reference(x, sizes, w, out_dtype=jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert np.all(np.asarray(got[6]) == 0) and np.any(np.asarray(got[:6]) != 0)


@pytest.mark.parametrize("rollout_config", (FP4_FULL, FP4_FULL2), ids=("fp4", "fp4_two_level"))  # BF16: _act a no-op
def test_fused_capacity_experts_equal_the_grouped_matmuls(params, monkeypatch, rollout_config):
  """XLA:CPU's engine runs the routed SwiGLU in one set of capacity buckets (`rollout._capacity_experts`): the
  logits, caches and recorded hidden codes of a prefill and a decode step are those of three `grouped_matmul`s
  (moe's capacity buckets around each), bit for bit."""
  assert jax.default_backend() == "cpu"
  quant = rollout_config.quant
  layout = rollout.expert_layout(rollout_config, CFG)
  engine = rollout.with_expert_layout(rollout.weight_sync(params, quant), layout, jnp.bfloat16)
  st = rollout.EngineSettings(CFG, rollout_config)
  assert rollout._fused_capacity((engine.layers[0].mlp.gate, engine.layers[0].mlp.up, engine.layers[0].mlp.down), st)
  b, p, total = 8, 5, 7
  tokens = jax.random.randint(jax.random.key(2), (b, p + 1), 3, CFG.vocab_size)
  slot_mask = jnp.ones((b, total), jnp.int32)

  def run():
    def steps(engine, tokens):
      caches = rollout.init_cache(CFG, b, total, quant, jnp.bfloat16, decoded=layout == "values")
      step = functools.partial(rollout.decode_step, model_config=CFG, rollout_config=rollout_config)
      positions = jnp.broadcast_to(jnp.arange(p), (b, p))
      prefill = step(engine, tokens[:, :p], caches, 0, positions, slot_mask)
      decode = step(engine, tokens[:, p:], prefill[1], jnp.asarray(p), jnp.full((b, 1), p), slot_mask)
      return prefill, decode

    return jax.jit(steps)(engine, tokens)  # a fresh jit: traced with whichever path is patched in

  fused = run()
  monkeypatch.setattr(rollout, "_fused_capacity", lambda weights, st: False)
  grouped = run()
  leaves = jax.tree_util.tree_leaves(fused)
  assert len(leaves) == len(jax.tree_util.tree_leaves(grouped))
  if quant is not None:  # the hidden rows' codes are recorded, and bucket zero rows left no trace in them
    assert fused[1][3][0][rollout.MOE_HIDDEN].codes.shape == (
      b,
      1,
      CFG.num_experts_per_tok,
      CFG.moe_intermediate_size // 2,
    )
  for a, c in zip(leaves, jax.tree_util.tree_leaves(grouped)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_a_cache_without_codes_holds_the_same_fp4_values(params):
  """Layers whose K/V codes nothing reads back (`rollout.kv_code_layers`: no diagnostics, no K/V guidance) hold
  the decoded FP4 values only: a prefill and a decode step give the same logits and values as the cache that
  also keeps the codes, and generate keeps the codes exactly where guidance or diagnostics read them."""
  assert rollout.kv_code_layers(FP4_FULL, CFG) == tuple(range(L))  # record_codes
  plain = dataclasses.replace(FP4_COMPACT, record_codes=False)
  assert rollout.kv_code_layers(plain, CFG) == (tuple(plain.guided_layers) if KEY in plain.guided_tensors else ())
  no_kv = dataclasses.replace(plain, guided_tensors=(MOE_INPUT,))
  assert rollout.kv_code_layers(no_kv, CFG) == ()
  engine = rollout.with_expert_layout(rollout.weight_sync(params, QUANT), "values", jnp.bfloat16)
  b, p, total = 4, 5, 7
  tokens = jax.random.randint(jax.random.key(3), (b, p + 1), 3, CFG.vocab_size)
  slot_mask = jnp.ones((b, total), jnp.int32)
  rc = RolloutConfig(quant=QUANT)

  @functools.partial(jax.jit, static_argnames="packed")
  def steps(engine, tokens, packed):
    caches = rollout.init_cache(CFG, b, total, QUANT, jnp.bfloat16, decoded=True, packed_layers=packed)
    step = functools.partial(rollout.decode_step, model_config=CFG, rollout_config=rc)
    logits0, caches, _, _ = step(engine, tokens[:, :p], caches, 0, jnp.broadcast_to(jnp.arange(p), (b, p)), slot_mask)
    logits1, caches, _, _ = step(engine, tokens[:, p:], caches, jnp.asarray(p), jnp.full((b, 1), p), slot_mask)
    values = [(c.k_values, c.v_values) for c in caches]
    return logits0, logits1, values, [c.k is None for c in caches], [(c.k, c.v) for c in caches]

  *with_codes, has_none, codes = steps(engine, tokens, None)
  *without, none, _ = steps(engine, tokens, (1,))
  assert not any(has_none) and none == [True, False, True, True]
  for (k_codes, v_codes), (k_values, v_values) in zip(codes, with_codes[2]):  # the values are the codes' values
    decode = lambda q: np.asarray(rollout._carry(fp4.dequantize(q, jnp.bfloat16), jnp.float32))  # [B, T, KV, D]
    np.testing.assert_array_equal(decode(k_codes), np.asarray(k_values).transpose(0, 3, 1, 2))
    np.testing.assert_array_equal(decode(v_codes), np.asarray(v_values).transpose(0, 2, 1, 3))
  for a, c in zip(jax.tree_util.tree_leaves(with_codes), jax.tree_util.tree_leaves(without)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
