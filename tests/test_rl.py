"""The GRPO pieces of trace_jax.rl (and experience.trainer_guidance) against plain numpy references.

Each function is small and pure, so every test runs eagerly on a few tokens: advantages,
the PPO-clip objective and its gradient, the TIS weight, the k3 KL, the mismatch metrics of
SPEC section 6 and routing agreement.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import experience, fp4, model, rl, trainer
from trace_jax.config import GRPOConfig
from trace_jax.quantizer import Guidance

RNG = np.random.default_rng(0)


# --- numpy references -----------------------------------------------------------------------


def np_masked_mean(x, mask):
  mask = np.asarray(mask, np.float64)
  return float(np.sum(x * mask) / max(mask.sum(), 1.0))


def np_k3(logp_target, logp_sample):
  log_ratio = np.asarray(logp_target, np.float64) - np.asarray(logp_sample, np.float64)
  return np.exp(log_ratio) - log_ratio - 1.0


def np_grpo_loss(logp, old_logp, rollout_logp, adv, mask, cfg: GRPOConfig, ref_logp=None):
  """The PPO-clip surrogate, token TIS and k3 KL, written out directly in float64."""
  logp, old_logp, rollout_logp = (np.asarray(a, np.float64) for a in (logp, old_logp, rollout_logp))
  adv = np.asarray(adv, np.float64)[:, None]
  ratio = np.exp(logp - old_logp)
  high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
  surrogate = np.minimum(ratio * adv, np.clip(ratio, 1 - cfg.clip_eps, 1 + high) * adv)
  weight = np.minimum(np.exp(old_logp - rollout_logp), cfg.tis_cap) if cfg.tis_cap > 0 else 1.0
  loss = np_masked_mean(-surrogate * weight, mask)
  if ref_logp is not None and cfg.kl_coef > 0:
    loss += cfg.kl_coef * np_masked_mean(np_k3(ref_logp, logp), mask)
  return loss


def np_grpo_grad(logp, old_logp, rollout_logp, adv, mask, cfg: GRPOConfig):
  """d loss / d logp of the PPO-clip + TIS loss (no KL): zero where the clip is active."""
  logp, old_logp, rollout_logp = (np.asarray(a, np.float64) for a in (logp, old_logp, rollout_logp))
  adv = np.asarray(adv, np.float64)[:, None] * np.ones_like(logp)
  ratio = np.exp(logp - old_logp)
  high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
  clipped = ((adv > 0) & (ratio > 1 + high)) | ((adv < 0) & (ratio < 1 - cfg.clip_eps))
  weight = np.minimum(np.exp(old_logp - rollout_logp), cfg.tis_cap) if cfg.tis_cap > 0 else 1.0
  mask = np.asarray(mask, np.float64)
  return np.where(clipped, 0.0, -adv * ratio) * weight * mask / max(mask.sum(), 1.0)


def loss_inputs(b=4, s=12, spread=0.4, seed=0):
  """Log-probs whose ratios fall on both sides of the clip range, and a ragged mask."""
  rng = np.random.default_rng(seed)
  old = np.log(rng.uniform(0.05, 0.9, (b, s))).astype(np.float32)
  logp = (old + rng.uniform(-spread, spread, (b, s))).astype(np.float32)
  rollout_logp = (old + rng.normal(0, 1.0, (b, s))).astype(np.float32)  # some TIS weights hit the cap
  adv = rng.normal(size=b).astype(np.float32)
  mask = np.zeros((b, s), bool)
  for i, start in enumerate(rng.integers(0, s // 2, b)):
    mask[i, start : s - i] = True
  return logp, old, rollout_logp, adv, mask


def loss_and_grad(logp, old, rollout_logp, adv, mask, cfg, ref=None):
  fn = lambda lp: rl.grpo_loss(lp, jnp.asarray(old), jnp.asarray(rollout_logp), jnp.asarray(adv), mask, cfg, ref)
  (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(logp))
  return float(loss), metrics, np.asarray(grad)


# --- group advantages -----------------------------------------------------------------------


@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_advantages_against_numpy(normalize_std):
  G = 4
  rewards = RNG.uniform(0, 1, 5 * G).astype(np.float32)
  adv = np.asarray(rl.group_advantages(jnp.asarray(rewards), G, normalize_std))
  r = rewards.reshape(-1, G).astype(np.float64)
  want = r - r.mean(1, keepdims=True)
  if normalize_std:
    want = want / (r.std(1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(adv, want.reshape(-1), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(adv.reshape(-1, G).mean(1), 0.0, atol=1e-6)  # mean zero per group
  if normalize_std:
    np.testing.assert_allclose(adv.reshape(-1, G).std(1), 1.0, rtol=1e-4)


def test_group_advantages_keep_groups_apart():
  """Groups are contiguous runs of G: each is centred on its own mean, not the batch's."""
  rewards = jnp.asarray([0.0, 1.0, 10.0, 11.0])
  np.testing.assert_allclose(rl.group_advantages(rewards, 2, normalize_std=False), [-0.5, 0.5, -0.5, 0.5])


def test_minibatch_rows_partition_a_shuffle_deterministically():
  rows = rl.minibatch_rows(12, 3, seed=0, step=5, epoch=1)
  assert rows.shape == (3, 4) and rows.dtype == np.int32
  np.testing.assert_array_equal(np.sort(rows.reshape(-1)), np.arange(12))  # every sequence once
  np.testing.assert_array_equal(rows, rl.minibatch_rows(12, 3, seed=0, step=5, epoch=1))
  others = [rl.minibatch_rows(12, 3, *args) for args in ((1, 5, 1), (0, 6, 1), (0, 5, 2))]
  assert all(not np.array_equal(rows, o) for o in others)  # a new shuffle per seed, step and epoch
  np.testing.assert_array_equal(rl.minibatch_rows(12, 1, 0, 5, 1)[0], rows.reshape(-1))  # one shuffle, split
  with pytest.raises(ValueError, match="5 mini-batches cannot split 12"):
    rl.minibatch_rows(12, 5, 0, 0, 0)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_advantages_of_a_constant_group_are_zero(normalize_std):
  rewards = jnp.asarray([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.5])
  adv = np.asarray(rl.group_advantages(rewards, 3, normalize_std))
  assert np.all(np.isfinite(adv))
  np.testing.assert_array_equal(adv[:6], 0.0)
  assert np.abs(adv[6:]).max() > 0


# --- GRPO loss ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "cfg",
  [
    GRPOConfig(num_generations=2, tis_cap=0.0),
    GRPOConfig(num_generations=2, tis_cap=2.0),
    GRPOConfig(num_generations=2, clip_eps=0.1, clip_eps_high=0.3, tis_cap=5.0),
  ],
  ids=["no_tis", "tis2", "asymmetric_clip"],
)
def test_grpo_loss_and_gradient_against_numpy(cfg):
  logp, old, rollout_logp, adv, mask = loss_inputs()
  loss, _, grad = loss_and_grad(logp, old, rollout_logp, adv, mask, cfg)
  np.testing.assert_allclose(loss, np_grpo_loss(logp, old, rollout_logp, adv, mask, cfg), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grad, np_grpo_grad(logp, old, rollout_logp, adv, mask, cfg), rtol=1e-4, atol=1e-7)


def test_ppo_clip_zeroes_the_gradient_only_where_the_clip_binds():
  """Positive advantage: ratios above 1 + eps get no gradient, ratios below 1 - eps still do
  (the pessimistic min keeps them); negative advantage: the mirror image."""
  cfg = GRPOConfig(num_generations=2, clip_eps=0.2, tis_cap=0.0)
  ratios = np.array([0.5, 0.9, 1.1, 1.5], np.float32)
  logp = np.log(np.stack([ratios, ratios]))
  old = np.zeros_like(logp)
  adv = np.array([1.0, -1.0], np.float32)
  mask = np.ones(logp.shape, bool)
  _, metrics, grad = loss_and_grad(logp, old, old, adv, mask, cfg)
  n = mask.sum()
  np.testing.assert_allclose(grad[0], [-0.5 / n, -0.9 / n, -1.1 / n, 0.0], rtol=1e-6)  # A > 0: 1.5 is clipped
  np.testing.assert_allclose(grad[1], [0.0, 0.9 / n, 1.1 / n, 1.5 / n], rtol=1e-6)  # A < 0: 0.5 is clipped
  assert float(metrics["loss/clip_frac"]) == pytest.approx(0.5)  # 0.5 and 1.5 in both rows


def test_clip_fraction_counts_the_asymmetric_range():
  """With clip_eps_high, a ratio inside (1 + clip_eps, 1 + clip_eps_high] is not clipped."""
  cfg = GRPOConfig(num_generations=2, clip_eps=0.2, clip_eps_high=0.28, tis_cap=0.0)
  logp = np.log(np.array([[0.7, 0.9, 1.25, 1.3]], np.float32))
  _, metrics, _ = loss_and_grad(logp, np.zeros_like(logp), np.zeros_like(logp), np.ones(1), np.ones((1, 4)), cfg)
  assert float(metrics["loss/clip_frac"]) == pytest.approx(0.5)  # 0.7 and 1.3; 1.25 is inside


def test_tis_weight_is_capped_and_stop_gradiented():
  cap = 2.0
  with_tis = GRPOConfig(num_generations=2, tis_cap=cap)
  without = GRPOConfig(num_generations=2, tis_cap=0.0)
  logp, old, rollout_logp, adv, mask = loss_inputs(seed=1)
  weight = np.minimum(np.exp(old.astype(np.float64) - rollout_logp), cap)
  assert (weight == cap).any() and (weight < 1).any()  # both the cap and down-weighting are exercised
  _, _, grad_tis = loss_and_grad(logp, old, rollout_logp, adv, mask, with_tis)
  _, _, grad_plain = loss_and_grad(logp, old, rollout_logp, adv, mask, without)
  np.testing.assert_allclose(grad_tis, grad_plain * weight, rtol=1e-5, atol=1e-8)
  # No gradient flows into the weight: not through the rollout's log-probs ...
  fn = lambda r: rl.grpo_loss(jnp.asarray(logp), jnp.asarray(old), r, jnp.asarray(adv), mask, with_tis)[0]
  np.testing.assert_array_equal(jax.grad(fn)(jnp.asarray(rollout_logp)), 0.0)
  # ... nor through old_logp beyond the PPO ratio's own dependence on it.
  fn_old = lambda o, cfg: rl.grpo_loss(jnp.asarray(logp), o, jnp.asarray(rollout_logp), jnp.asarray(adv), mask, cfg)[0]
  g_tis = np.asarray(jax.grad(fn_old)(jnp.asarray(old), with_tis))
  g_plain = np.asarray(jax.grad(fn_old)(jnp.asarray(old), without))
  np.testing.assert_allclose(g_tis, g_plain * weight, rtol=1e-5, atol=1e-8)


def test_tis_cap_zero_disables_the_weight():
  cfg = GRPOConfig(num_generations=2, tis_cap=0.0)
  logp, old, rollout_logp, adv, mask = loss_inputs(seed=2)
  far = rollout_logp - 3.0  # would give weights up to e^3 if applied
  a, _, ga = loss_and_grad(logp, old, rollout_logp, adv, mask, cfg)
  b, _, gb = loss_and_grad(logp, old, far, adv, mask, cfg)
  assert a == b
  np.testing.assert_array_equal(ga, gb)


def test_k3_matches_the_formula_and_vanishes_on_equal_inputs():
  target = np.log(RNG.uniform(0.01, 1, 50)).astype(np.float32)
  sample = np.log(RNG.uniform(0.01, 1, 50)).astype(np.float32)
  np.testing.assert_allclose(rl.k3(jnp.asarray(target), jnp.asarray(sample)), np_k3(target, sample), rtol=1e-5)
  # Accurate at the tiny log-ratios FP4 mismatch produces (exp(x) - x - 1 in float32 is off by %).
  small = (sample + RNG.uniform(-3e-3, 3e-3, 50)).astype(np.float32)
  np.testing.assert_allclose(rl.k3(jnp.asarray(small), jnp.asarray(sample)), np_k3(small, sample), rtol=2e-3)
  np.testing.assert_array_equal(rl.k3(jnp.asarray(sample), jnp.asarray(sample)), 0.0)
  assert np.all(np.asarray(rl.k3(jnp.asarray(target), jnp.asarray(sample))) >= 0)


def test_kl_to_the_reference_is_added_with_its_coefficient():
  cfg = GRPOConfig(num_generations=2, tis_cap=5.0, kl_coef=0.3)
  logp, old, rollout_logp, adv, mask = loss_inputs(seed=3)
  ref = (logp + RNG.normal(0, 0.3, logp.shape)).astype(np.float32)
  loss, metrics, grad = loss_and_grad(logp, old, rollout_logp, adv, mask, cfg, jnp.asarray(ref))
  np.testing.assert_allclose(loss, np_grpo_loss(logp, old, rollout_logp, adv, mask, cfg, ref), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["loss/kl_ref"]), np_masked_mean(np_k3(ref, logp), mask), rtol=1e-5)
  # d k3(ref, logp) / d logp = 1 - exp(ref - logp), token-averaged.
  kl_grad = cfg.kl_coef * (1 - np.exp(ref.astype(np.float64) - logp)) * mask / mask.sum()
  want = np_grpo_grad(logp, old, rollout_logp, adv, mask, cfg) + kl_grad
  np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-7)
  # ref == logp: the KL term and its metric are exactly zero.
  same, metrics_same, _ = loss_and_grad(logp, old, rollout_logp, adv, mask, cfg, jnp.asarray(logp))
  assert float(metrics_same["loss/kl_ref"]) == 0.0
  assert same == pytest.approx(np_grpo_loss(logp, old, rollout_logp, adv, mask, cfg), rel=1e-6)
  # kl_coef = 0: a reference is ignored.
  off = dataclasses.replace(cfg, kl_coef=0.0)
  _, metrics_off, _ = loss_and_grad(logp, old, rollout_logp, adv, mask, off, jnp.asarray(ref))
  assert "loss/kl_ref" not in metrics_off


def test_loss_is_a_token_mean_over_the_mask():
  cfg = GRPOConfig(num_generations=2, tis_cap=5.0)
  logp, old, rollout_logp, adv, mask = loss_inputs(seed=4)
  loss, _, grad = loss_and_grad(logp, old, rollout_logp, adv, mask, cfg)
  np.testing.assert_array_equal(grad[~mask], 0.0)
  # Whatever sits at masked positions is ignored.
  junk = lambda a: np.where(mask, a, np.float32(-3.0))
  loss_junk, _, grad_junk = loss_and_grad(junk(logp), junk(old), junk(rollout_logp), adv, mask, cfg)
  assert loss_junk == pytest.approx(loss, rel=1e-6)
  np.testing.assert_allclose(grad_junk[mask], grad[mask], rtol=1e-6)
  # A token mean, not a sequence mean: one long row weighs more than one short row.
  rows = np.zeros((2, 6), bool)
  rows[0, :1], rows[1, :] = True, True
  per_token = np_grpo_loss(logp[:2, :6], old[:2, :6], rollout_logp[:2, :6], adv[:2], rows, cfg)
  got, _, _ = loss_and_grad(logp[:2, :6], old[:2, :6], rollout_logp[:2, :6], adv[:2], rows, cfg)
  np.testing.assert_allclose(got, per_token, rtol=1e-5)
  # An empty mask gives zero, not NaN.
  empty, _, grad_empty = loss_and_grad(logp, old, rollout_logp, adv, np.zeros_like(mask), cfg)
  assert empty == 0.0
  np.testing.assert_array_equal(grad_empty, 0.0)


# --- mismatch metrics -----------------------------------------------------------------------


def np_mismatch(train_logp, rollout_logp, mask):
  t, r = np.asarray(train_logp, np.float64)[mask], np.asarray(rollout_logp, np.float64)[mask]
  diff, ratio = np.abs(t - r), np.exp(t - r)
  return {
    "mismatch/logp_diff_mean": diff.mean(),
    "mismatch/logp_diff_max": diff.max(),
    "mismatch/kl_k3": np_k3(t, r).mean(),
    "mismatch/is_ratio_mean": ratio.mean(),
    "mismatch/is_ratio_outside_0.5_2": np.mean((ratio < 0.5) | (ratio > 2)),
  }


def test_mismatch_metrics_against_numpy():
  train_logp = np.log(RNG.uniform(0.02, 1, (6, 10))).astype(np.float32)
  rollout_logp = (train_logp + RNG.normal(0, 0.6, train_logp.shape)).astype(np.float32)
  mask = RNG.uniform(size=train_logp.shape) < 0.7
  # The largest |difference| and an extreme ratio sit at masked positions: they must not count.
  rollout_logp[~mask] = train_logp[~mask] + 20.0
  got = rl.mismatch_metrics(jnp.asarray(train_logp), jnp.asarray(rollout_logp), jnp.asarray(mask))
  want = np_mismatch(train_logp, rollout_logp, mask)
  assert set(got) == set(want)
  for key, value in want.items():
    np.testing.assert_allclose(float(got[key]), value, rtol=1e-5, atol=1e-7, err_msg=key)
  assert 0 < want["mismatch/is_ratio_outside_0.5_2"] < 1  # both sides of the test are exercised


def test_mismatch_metrics_of_identical_policies():
  logp = jnp.asarray(np.log(RNG.uniform(0.02, 1, (3, 5))), jnp.float32)
  got = rl.mismatch_metrics(logp, logp, jnp.ones((3, 5), bool))
  assert {k: float(v) for k, v in got.items()} == {
    "mismatch/logp_diff_mean": 0.0,
    "mismatch/logp_diff_max": 0.0,
    "mismatch/kl_k3": 0.0,
    "mismatch/is_ratio_mean": 1.0,
    "mismatch/is_ratio_outside_0.5_2": 0.0,
  }


# --- routing agreement ----------------------------------------------------------------------


def logits_choosing(ids, num_experts):
  """Router logits [B, S, E] whose top-k is exactly `ids` [B, S, k] (no ties)."""
  logits = np.tile(-np.arange(num_experts, dtype=np.float32) * 0.01, (*ids.shape[:-1], 1))
  np.put_along_axis(logits, ids, 10.0 + np.arange(ids.shape[-1], dtype=np.float32), axis=-1)
  return jnp.asarray(logits)


def test_scale_floor_fractions_count_measured_blocks_at_the_e4m3_floor():
  """Rollout layout [N, T, ...]: the last slot is dropped, masked positions are not counted, MXFP4 is skipped."""
  tiny, one = fp4.E4M3_TINY, 1.0
  scales = np.full((2, 4, 2, 3), one, np.float32)  # [N, T, k, blocks], e.g. moe_hidden
  scales[0, 0, 0, :2] = tiny  # 2 of the 6 blocks at (0, 0)
  scales[1, 1] = tiny  # all 6 blocks at (1, 1), a masked position
  scales[:, 3] = tiny  # the last slot, never fed back
  positions = np.array([[1, 1, 1], [1, 0, 1]], np.int32)  # [N, T-1]
  e8m0 = jax.lax.bitcast_convert_type(jnp.full((2, 4, 1), 127, jnp.uint8), jnp.float8_e8m0fnu)
  codes = (
    {"moe_hidden": Guidance(scales=jnp.asarray(scales, jnp.float8_e4m3fn))},
    {"moe_input": Guidance(scales=e8m0)},
  )
  out = rl.scale_floor_fractions(codes, jnp.asarray(positions))
  assert set(out) == {"quant/scale_floor_frac/moe_hidden/layer0"}
  assert float(out["quant/scale_floor_frac/moe_hidden/layer0"]) == pytest.approx(2 / (5 * 6))


def test_routing_agreement():
  B, S, E, k = 2, 5, 8, 2
  ids = np.stack([RNG.permutation(E)[:k] for _ in range(B * S)]).reshape(B, S, k)
  logits = logits_choosing(ids, E)
  mask = np.ones((B, S), bool)
  assert float(rl.routing_agreement(logits, jnp.asarray(ids), mask)) == 1.0
  assert float(rl.routing_agreement(logits, jnp.asarray(ids[..., ::-1]), mask)) == 1.0  # order-insensitive
  disjoint = np.stack([np.setdiff1d(np.arange(E), row)[:k] for row in ids.reshape(-1, k)]).reshape(B, S, k)
  assert float(rl.routing_agreement(logits, jnp.asarray(disjoint), mask)) == 0.0
  # One of the two experts shared in every token: 1/2.
  half = np.concatenate([ids[..., :1], disjoint[..., :1]], -1)
  assert float(rl.routing_agreement(logits, jnp.asarray(half), mask)) == pytest.approx(0.5)
  # Masked tokens do not count: agree on the first 3 positions, disagree on the last 2.
  mixed = np.concatenate([ids[:, :3], disjoint[:, 3:]], 1)
  mask3 = np.zeros((B, S), bool)
  mask3[:, :3] = True
  assert float(rl.routing_agreement(logits, jnp.asarray(mixed), mask3)) == 1.0
  assert float(rl.routing_agreement(logits, jnp.asarray(mixed), mask)) == pytest.approx(0.6)


def test_expert_overlap_of_the_experts_run():
  """The share of the rollout's experts among those the trainer ran (what `guidance/unmatched_expert_frac` is one
  minus): order-insensitive, masked."""
  B, S, E, k = 2, 5, 8, 2
  ids = np.stack([RNG.permutation(E)[:k] for _ in range(B * S)]).reshape(B, S, k)
  other = np.stack([np.setdiff1d(np.arange(E), row)[:1] for row in ids.reshape(-1, k)]).reshape(B, S, 1)
  one_swapped = np.concatenate([ids[..., ::-1][..., :1], other], -1)  # first slot: ids' second expert
  mask = np.ones((B, S), bool)
  assert float(rl.expert_overlap(jnp.asarray(ids), jnp.asarray(ids[..., ::-1]), mask)) == 1.0
  assert float(rl.expert_overlap(jnp.asarray(ids), jnp.asarray(one_swapped), mask)) == pytest.approx(0.5)
  mask[:, 2:] = False
  assert float(rl.expert_overlap(jnp.asarray(ids), jnp.asarray(np.where(mask[..., None], ids, other)), mask)) == 1.0


# --- trainer_guidance -----------------------------------------------------------------------


def fake_rollout(guidance, codes, n=3, t=7):
  zeros = jnp.zeros((n, t), jnp.int32)
  return experience.RolloutResult(zeros, zeros > 0, zeros > 0, zeros.astype(jnp.float32), (None,) * 3, guidance, codes)


def test_trainer_guidance_slices_and_merges():
  n, t, h = 3, 7, 32

  def arr(*shape, dtype=jnp.uint8):
    return jnp.asarray(RNG.integers(0, 255, shape), dtype)

  mantissa = Guidance(mantissa_bits=arr(n, t, h // 8), scales=arr(n, t, h // 16), tensor_scale=jnp.float32(0.5))
  full = Guidance(codes=arr(n, t, h // 2), scales=arr(n, t, h // 16))
  diag = {"moe_input": Guidance(codes=arr(n, t, h // 2), scales=arr(n, t, h // 16))}
  result = fake_rollout(
    guidance=({}, {"moe_input": mantissa}, {"moe_input": full}),  # layer 0 unguided; 1 compact; 2 full
    codes=(diag, diag, diag),
  )
  layers = experience.trainer_guidance(result)
  assert len(layers) == 3
  # Unguided layer: the diagnostic codes alone (no rollout scales to steer the trainer).
  g0 = layers[0]["moe_input"]
  assert g0.mantissa_bits is None and g0.scales is None and g0.tensor_scale is None
  np.testing.assert_array_equal(g0.codes, diag["moe_input"].codes[:, :-1])
  # Compact guidance: mantissa bits and scales cut to T-1, the diagnostic codes ride along.
  g1 = layers[1]["moe_input"]
  np.testing.assert_array_equal(g1.mantissa_bits, mantissa.mantissa_bits[:, :-1])
  np.testing.assert_array_equal(g1.scales, mantissa.scales[:, :-1])
  np.testing.assert_array_equal(g1.codes, diag["moe_input"].codes[:, :-1])
  assert float(g1.tensor_scale) == 0.5  # a scalar is not sliced
  # Full guidance keeps its own codes, not the diagnostic copy.
  g2 = layers[2]["moe_input"]
  np.testing.assert_array_equal(g2.codes, full.codes[:, :-1])
  np.testing.assert_array_equal(g2.scales, full.scales[:, :-1])


def test_trainer_guidance_without_recording():
  result = fake_rollout(guidance=({}, {}, {}), codes=({}, {}, {}))
  assert experience.trainer_guidance(result) == ({}, {}, {})


# --- mismatch by response position and per sequence -----------------------------------------


def np_position_mismatch(train_logp, rollout_logp, mask, tis_cap, edges):
  """Token by token in float64: each response token's position (its index among the sequence's
  response tokens), its bin among `edges`, and the per-bin and per-sequence statistics."""
  diffs, weights = [[] for _ in edges[:-1]], [[] for _ in edges[:-1]]
  sums = []
  for t_row, r_row, m_row in zip(train_logp, rollout_logp, mask):
    position, total = 0, 0.0
    for t, r, m in zip(t_row.astype(np.float64), r_row.astype(np.float64), m_row):
      if not m:
        continue
      b = max(i for i, e in enumerate(edges[:-1]) if e <= position)
      diffs[b].append(abs(t - r))
      weights[b].append(min(np.exp(t - r), tis_cap) if tis_cap > 0 else np.exp(t - r))
      total += t - r
      position += 1
    if position:
      sums.append(total)
  mean = lambda v: float(np.mean(v)) if v else float("nan")
  sums = np.array(sums)
  return (
    [mean(v) for v in diffs],
    [mean(v) for v in weights],
    sums,
    float(np.mean((np.exp(sums) < 0.5) | (np.exp(sums) > 2.0))),
  )


def np_prefix_mismatch(train_logp, rollout_logp, mask, length):
  """Over the sequences with >= `length` response tokens: mean |sum of their first `length` log-ratios|
  and the share of those sums outside [log 0.5, log 2], in float64 (NaN, NaN if there are none)."""
  sums = []
  for t_row, r_row, m_row in zip(train_logp.astype(np.float64), rollout_logp.astype(np.float64), mask):
    diffs = (t_row - r_row)[m_row]
    if len(diffs) >= length:
      sums.append(diffs[:length].sum())
  if not sums:
    return float("nan"), float("nan")
  sums = np.array(sums)
  return float(np.abs(sums).mean()), float(np.mean(np.abs(sums) > np.log(2.0)))


def ragged_position_inputs(seed=0, n=12, t=80, spread=0.12, padding=-100.0):
  """Left-padded prompts of 2..12 tokens, responses of 0..60 tokens (then padding): no response
  reaches position 64, so the last bin of T=80 ([64, 128)) is empty; one sequence has no response.
  Outside the mask the rollout's log-probs are the trainer's plus `padding` (-100: exp of the
  difference overflows float32)."""
  rng = np.random.default_rng(seed)
  train_logp = np.log(rng.uniform(0.05, 1, (n, t))).astype(np.float32)
  rollout_logp = (train_logp + rng.normal(0, spread, (n, t))).astype(np.float32)
  mask = np.zeros((n, t), bool)
  lengths = rng.integers(1, 61, n)
  lengths[0], lengths[1], lengths[2] = 0, 60, 1
  for i, (prompt, length) in enumerate(zip(rng.integers(2, 13, n), lengths)):
    mask[i, prompt - 1 : prompt - 1 + length] = True  # targets: the first response token follows the prompt
  rollout_logp[~mask] = train_logp[~mask] + padding
  return train_logp, rollout_logp, mask


def test_position_bins_are_static_powers_of_two_with_sorting_names():
  assert rl.position_bins(1) == [(0, 8)] and rl.position_bins(8) == [(0, 8)]
  assert rl.position_bins(9) == [(0, 8), (8, 16)]
  assert rl.position_bins(80) == [(0, 8), (8, 16), (16, 32), (32, 64), (64, 128)]
  assert rl.position_bin_names(80) == ["pos000-007", "pos008-015", "pos016-031", "pos032-063", "pos064-127"]
  assert rl.position_bin_names(512)[-1] == "pos256-511"
  assert rl.position_bin_names(513)[:2] == ["pos0000-0007", "pos0008-0015"]  # a 4-digit end widens every name
  names = rl.position_bin_names(2000)
  assert names[0] == "pos0000-0007" and names[-1] == "pos1024-2047" and sorted(names) == names
  assert rl.prefix_lengths(80) == [(8, "len008"), (16, "len016"), (32, "len032"), (64, "len064")]
  assert rl.prefix_lengths(64)[-1] == (64, "len064") and rl.prefix_lengths(7) == []
  assert [n for _, n in rl.prefix_lengths(1024)][-2:] == ["len0512", "len1024"]


@pytest.mark.parametrize("tis_cap", [1.1, 0.0])
def test_position_mismatch_metrics_against_numpy(tis_cap):
  train_logp, rollout_logp, mask = ragged_position_inputs()
  got = jax.jit(rl.position_mismatch_metrics)(
    jnp.asarray(train_logp), jnp.asarray(rollout_logp), jnp.asarray(mask), jnp.float32(tis_cap)
  )
  got = {k: float(v) for k, v in got.items()}
  names = rl.position_bin_names(80)
  diff, tis, sums, outside = np_position_mismatch(train_logp, rollout_logp, mask, tis_cap, [0, 8, 16, 32, 64, 128])
  assert set(got) == {
    *(f"mismatch/by_position/{stat}/{name}" for stat in ("logp_diff_mean", "tis_weight_mean") for name in names),
    "mismatch/seq_log_ratio_mean",
    "mismatch/seq_log_ratio_abs_mean",
    "mismatch/seq_ratio_outside_0.5_2",
    *(
      f"mismatch/by_length/{stat}/len{n:03d}"
      for stat in ("log_ratio_abs_mean", "ratio_outside_0.5_2")
      for n in (8, 16, 32, 64)
    ),
  }
  for length in (8, 16, 32, 64):
    abs_mean, outside_l = np_prefix_mismatch(train_logp, rollout_logp, mask, length)
    np.testing.assert_allclose(got[f"mismatch/by_length/log_ratio_abs_mean/len{length:03d}"], abs_mean, rtol=1e-5)
    assert got[f"mismatch/by_length/ratio_outside_0.5_2/len{length:03d}"] == pytest.approx(outside_l, nan_ok=True)
  assert np.isnan(got["mismatch/by_length/log_ratio_abs_mean/len064"])  # no response reaches 64 tokens
  assert got["mismatch/by_length/log_ratio_abs_mean/len032"] > got["mismatch/by_length/log_ratio_abs_mean/len008"]
  for name, d, w in zip(names, diff, tis):
    np.testing.assert_allclose(got[f"mismatch/by_position/logp_diff_mean/{name}"], d, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(got[f"mismatch/by_position/tis_weight_mean/{name}"], w, rtol=1e-5, err_msg=name)
  assert np.isnan(diff[-1]) and all(np.isfinite(diff[:-1]))  # [64, 128): no response is that long
  assert len(sums) == 11  # the sequence without a response is left out
  np.testing.assert_allclose(got["mismatch/seq_log_ratio_mean"], sums.mean(), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(got["mismatch/seq_log_ratio_abs_mean"], np.abs(sums).mean(), rtol=1e-5)
  assert got["mismatch/seq_ratio_outside_0.5_2"] == pytest.approx(outside) and 0 < outside < 1
  if tis_cap:  # the cap binds on some tokens of every populated bin
    token_ratio = np.exp(train_logp[mask].astype(np.float64) - rollout_logp[mask])
    assert (token_ratio > tis_cap).any()
    assert all(w <= tis_cap for w in tis[:-1])


def test_position_mismatch_metrics_with_a_python_cap_and_identical_policies():
  logp = jnp.asarray(np.log(RNG.uniform(0.02, 1, (3, 20))), jnp.float32)
  mask = jnp.asarray(np.arange(20) >= np.array([[2], [5], [20]]))  # the last row has no response
  got = {k: float(v) for k, v in rl.position_mismatch_metrics(logp, logp, mask, 5.0).items()}
  assert got["mismatch/by_position/logp_diff_mean/pos000-007"] == 0.0
  assert got["mismatch/by_position/tis_weight_mean/pos016-031"] == 1.0  # the first row reaches position 17
  assert got["mismatch/seq_log_ratio_abs_mean"] == 0.0 and got["mismatch/seq_ratio_outside_0.5_2"] == 0.0
  nothing = rl.position_mismatch_metrics(logp, logp + 1.0, jnp.zeros((3, 20), bool), 5.0)
  assert all(np.isnan(float(v)) for v in nothing.values())


def test_behaviour_metrics_of_an_rl_step_hold_the_position_metrics():
  """trainer._behaviour_metrics (what make_rl_step and make_rl_logprobs report) on a synthetic
  batch of a model without layers: the per-token and the position metrics, the cap passed through."""
  # padding 0: rl.mismatch_metrics multiplies by the mask, so it needs finite values outside it
  train_logp, rollout_logp, mask = ragged_position_inputs(seed=1, padding=0.0)
  n, t = mask.shape
  batch = experience.TrainBatch(
    inputs=jnp.zeros((n, t), jnp.int32),
    targets=jnp.zeros((n, t), jnp.int32),
    mask=jnp.ones((n, t), bool),
    loss_mask=jnp.asarray(mask),
    rollout_logp=jnp.asarray(rollout_logp),
    advantages=None,
    old_logp=jnp.asarray(train_logp),
    ref_logp=None,
    guidance=(),
    replay_ids=None,
    rollout_ids=(),
  )
  aux = model.ForwardAux(router_logits=(), topk_ids=(), quant_stats=(), aux_loss=jnp.zeros(()))
  behaviour = jax.jit(lambda logp, aux, batch: trainer._behaviour_metrics(logp, aux, batch, 1.1))
  got = jax.device_get(behaviour(jnp.asarray(train_logp), aux, batch))
  args = (jnp.asarray(train_logp), jnp.asarray(rollout_logp), jnp.asarray(mask))
  want = {**rl.mismatch_metrics(*args), **rl.position_mismatch_metrics(*args, 1.1)}
  assert set(got) == set(want)
  for key, value in want.items():
    np.testing.assert_allclose(float(got[key]), float(value), rtol=1e-6, err_msg=key)
