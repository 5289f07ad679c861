"""GRPO pieces: group advantages, mini-batch shuffles, the PPO-clip loss with token-level TIS and
KL, and the train-rollout mismatch metrics of SPEC section 6. Pure functions over arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import fp4
from trace_jax.config import GRPOConfig


def group_advantages(rewards: jax.Array, num_generations: int, normalize_std: bool = True, eps: float = 1e-6):
  """rewards [B*G] (groups contiguous) -> advantages [B*G]: (r - group mean) / (group std + eps)."""
  r = rewards.reshape(-1, num_generations).astype(jnp.float32)
  adv = r - jnp.mean(r, axis=1, keepdims=True)
  if normalize_std:
    adv = adv / (jnp.std(r, axis=1, keepdims=True) + eps)
  return adv.reshape(-1)


def minibatch_rows(num_sequences: int, minibatches: int, seed: int, step: int, epoch: int) -> np.ndarray:
  """[minibatches, num_sequences / minibatches] rows of a rollout batch: a shuffle of its sequences,
  deterministic in (seed, step, epoch), split into equal mini-batches."""
  if num_sequences % minibatches:
    raise ValueError(f"{minibatches} mini-batches cannot split {num_sequences} sequences evenly.")
  order = np.random.default_rng([seed, step, epoch]).permutation(num_sequences).astype(np.int32)
  return order.reshape(minibatches, -1)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  mask = mask.astype(jnp.float32)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def off_policy_mask(train_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array, cfg: GRPOConfig):
  """The tokens [B, S] (float 0/1) that the sequence-level corrections keep (GRPOConfig: mis, trust_region),
  and metrics. train_logp: the trainer's log-probs before the update; mask: response tokens."""
  m = mask.astype(bool)
  log_r = jnp.where(m, train_logp.astype(jnp.float32) - rollout_logp.astype(jnp.float32), 0.0)
  keep = m
  low, high = np.log(cfg.mis_band[0]) if cfg.mis_band[0] > 0 else -np.inf, np.log(cfg.mis_band[1])
  outside = lambda lr: (lr < low) | (lr > high)
  if cfg.mis == "token":
    keep = keep & ~outside(log_r)
  elif cfg.mis == "sequence":
    keep = keep & ~outside(jnp.sum(log_r, axis=1, keepdims=True))
  if cfg.trust_region != "none":
    n = jnp.maximum(jnp.sum(m, axis=1, keepdims=True), 1)
    if cfg.trust_region == "max":
      divergence = jnp.max(jnp.where(m, jnp.expm1(log_r) - log_r, 0.0), axis=1, keepdims=True)  # k3
    else:
      divergence = jnp.abs(jnp.sum(log_r, axis=1, keepdims=True) / n)
    keep = keep & (divergence <= cfg.trust_region_delta)
  has_tokens = jnp.any(m, axis=1)
  sequence_kept = jnp.any(keep, axis=1)
  metrics = {
    "correction/token_kept_frac": masked_mean(keep.astype(jnp.float32), m),
    "correction/seq_kept_frac": masked_mean(sequence_kept.astype(jnp.float32), has_tokens),
  }
  return keep.astype(jnp.float32), metrics


def grpo_loss(
  logp: jax.Array,
  old_logp: jax.Array,
  rollout_logp: jax.Array,
  advantages: jax.Array,
  mask: jax.Array,
  cfg: GRPOConfig,
  ref_logp: jax.Array | None = None,
):
  """Token-mean GRPO objective over response tokens.

  logp: the trainer's log-probs [B, S] (differentiated); old_logp: the same before this
  update (ppo ratio denominator); rollout_logp: the engine's. TIS weight
  min(pi_old / pi_rollout, C) corrects the sampling policy to the trained one (stop-gradient).
  Returns (loss, metrics).
  """
  adv = advantages[:, None]
  correction = {}
  if cfg.mis != "none" or cfg.trust_region != "none":
    kept, correction = off_policy_mask(jax.lax.stop_gradient(old_logp), rollout_logp, mask, cfg)
    mask = mask.astype(jnp.float32) * kept
  ratio = jnp.exp(logp - old_logp)
  high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
  clipped = jnp.clip(ratio, 1 - cfg.clip_eps, 1 + high)
  pg = -jnp.minimum(ratio * adv, clipped * adv)
  if cfg.tis_cap > 0:
    tis = jax.lax.stop_gradient(jnp.minimum(jnp.exp(old_logp - rollout_logp), cfg.tis_cap))
    pg = pg * tis
  loss = masked_mean(pg, mask)
  metrics = {
    "loss/pg": loss,
    "loss/clip_frac": masked_mean(((ratio < 1 - cfg.clip_eps) | (ratio > 1 + high)).astype(jnp.float32), mask),
    **correction,
  }
  if ref_logp is not None and cfg.kl_coef > 0:
    kl = k3(ref_logp, logp)
    metrics["loss/kl_ref"] = masked_mean(kl, mask)
    loss = loss + cfg.kl_coef * metrics["loss/kl_ref"]
  return loss, metrics


def k3(logp_target: jax.Array, logp_sample: jax.Array) -> jax.Array:
  """Schulman's k3 estimator of KL(sample || target), per token, from samples of `sample`."""
  log_ratio = logp_target - logp_sample
  # expm1: exp(x) - 1 - x cancels to float32 noise at the |x| ~ 1e-3 that FP4 mismatch gives.
  return jnp.expm1(log_ratio) - log_ratio


def mismatch_metrics(train_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array) -> dict:
  """SPEC section 6 over response tokens: |logp diff| mean/max, k3 KL, IS-ratio statistics."""
  m = mask.astype(bool)
  diff = jnp.abs(train_logp - rollout_logp)
  ratio = jnp.exp(train_logp - rollout_logp)
  return {
    "mismatch/logp_diff_mean": masked_mean(diff, m),
    "mismatch/logp_diff_max": jnp.max(jnp.where(m, diff, 0.0)),
    "mismatch/kl_k3": masked_mean(k3(train_logp, rollout_logp), m),
    "mismatch/is_ratio_mean": masked_mean(ratio, m),
    "mismatch/is_ratio_outside_0.5_2": masked_mean(((ratio < 0.5) | (ratio > 2.0)).astype(jnp.float32), m),
  }


FIRST_POSITION_BIN = 8  # response positions [0, 8), then one bin per power of two: [8, 16), [16, 32), ...


def position_bins(length: int) -> list[tuple[int, int]]:
  """The static response-position bins [start, end) that cover positions 0 .. length - 1: [0, 8),
  then [2**k, 2**(k+1)) for k >= 3. The edges do not depend on `length` (the last bin keeps its
  full width), so runs of different lengths share their bins."""
  bins, start, end = [], 0, FIRST_POSITION_BIN
  while start < length:
    bins.append((start, end))
    start, end = end, 2 * end
  return bins


def position_bin_names(length: int) -> list[str]:
  """`pos{start}-{end - 1}` per position_bins(length), zero-padded to at least 3 digits (more where
  the last bin needs them, the same width for every bin) so that the names sort by position."""
  width = _name_width(length)
  return [f"pos{start:0{width}d}-{end - 1:0{width}d}" for start, end in position_bins(length)]


def _name_width(length: int) -> int:
  """The digits of the last bin's end (at least 3), shared by every bin and prefix name."""
  return max(3, len(str(position_bins(length)[-1][1] - 1)))


def position_mismatch_metrics(train_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array, tis_cap) -> dict:
  """Train-rollout mismatch along the response (issue 16): per response-position bin and per sequence.

  train_logp, rollout_logp, mask: [N, T], mask the loss mask (response tokens; a left-padded prompt
  and padding after the response are 0). A token's response position is its index among its
  sequence's response tokens (0 = the first one: the cumulative sum of the mask minus 1), binned by
  position_bins(T) (static: [0, 8), [8, 16), [16, 32), ... up to the bin holding T - 1).
  tis_cap: C of the TIS weight min(exp(train - rollout), C) (0: the raw ratio); a float or a scalar
  array. Jittable.

  Keys, per bin named `pos{start}-{end - 1}` (position_bin_names: zero-padded, e.g. pos000-007,
  pos008-015, ..., pos128-255):
    mismatch/by_position/logp_diff_mean/{bin}: mean |logp_train - logp_rollout| over the bin's tokens.
    mismatch/by_position/tis_weight_mean/{bin}: mean TIS weight over the bin's tokens.
    Both NaN where no response token falls in the bin.
  Per sequence, s = sum over its response tokens of (logp_train - logp_rollout), the log of the
  sequence-level importance ratio, over the sequences with at least one response token (NaN if none):
    mismatch/seq_log_ratio_mean: mean of s.
    mismatch/seq_log_ratio_abs_mean: mean of |s|.
    mismatch/seq_ratio_outside_0.5_2: share of sequences whose ratio exp(s) lies outside [0.5, 2].
  How the sequence-level ratio grows with length, per prefix length L among the bin ends that fit
  in T (8, 16, 32, ...; named `len{L}`, zero-padded like the bins): s_L = the sum over a sequence's
  first L response tokens, over the sequences with at least L response tokens (NaN if none):
    mismatch/by_length/log_ratio_abs_mean/{len}: mean of |s_L|.
    mismatch/by_length/ratio_outside_0.5_2/{len}: share whose exp(s_L) lies outside [0.5, 2].
  """
  m = mask.astype(bool)
  weight = m.astype(jnp.float32)
  # where, not a product: padding log-probs can be anything, and exp of them inf
  log_ratio = jnp.where(m, train_logp.astype(jnp.float32) - rollout_logp.astype(jnp.float32), 0.0)
  ratio = jnp.exp(log_ratio)
  tis = jnp.where(tis_cap > 0, jnp.minimum(ratio, tis_cap), ratio)

  bins = position_bins(train_logp.shape[1])
  position = jnp.cumsum(m.astype(jnp.int32), axis=1) - 1  # -1 before the response: weight 0
  starts = jnp.asarray([start for start, _ in bins[1:]], jnp.int32)
  index = jnp.sum(position[..., None] >= starts, axis=-1).reshape(-1)
  per_bin = lambda x: jax.ops.segment_sum(x.reshape(-1), index, num_segments=len(bins))
  count = per_bin(weight)
  bin_mean = lambda x: jnp.where(count > 0, per_bin(jnp.where(m, x, 0.0)) / jnp.maximum(count, 1.0), jnp.nan)
  diff_mean, tis_mean = bin_mean(jnp.abs(log_ratio)), bin_mean(tis)

  out = {}
  for i, name in enumerate(position_bin_names(train_logp.shape[1])):
    out[f"mismatch/by_position/logp_diff_mean/{name}"] = diff_mean[i]
    out[f"mismatch/by_position/tis_weight_mean/{name}"] = tis_mean[i]

  seq = jnp.sum(log_ratio, axis=1)
  has = jnp.any(m, axis=1)
  seq_mean = lambda x: _masked_mean(x, has)
  out["mismatch/seq_log_ratio_mean"] = seq_mean(seq)
  out["mismatch/seq_log_ratio_abs_mean"] = seq_mean(jnp.abs(seq))
  # exp(s) < 0.5 or > 2, compared in log space (exp of a long sequence's sum overflows)
  out["mismatch/seq_ratio_outside_0.5_2"] = seq_mean((jnp.abs(seq) > np.log(2.0)).astype(jnp.float32))

  response_len = jnp.sum(weight, axis=1)
  for length, name in prefix_lengths(train_logp.shape[1]):
    s = jnp.sum(jnp.where(position < length, log_ratio, 0.0), axis=1)  # log_ratio is 0 outside the mask
    full = response_len >= length
    out[f"mismatch/by_length/log_ratio_abs_mean/{name}"] = _masked_mean(jnp.abs(s), full)
    out[f"mismatch/by_length/ratio_outside_0.5_2/{name}"] = _masked_mean(
      (jnp.abs(s) > np.log(2.0)).astype(jnp.float32), full
    )
  return out


def _masked_mean(x: jax.Array, where: jax.Array) -> jax.Array:
  """The mean of x over `where` (NaN if it is empty)."""
  n = jnp.sum(where.astype(jnp.float32))
  return jnp.where(n > 0, jnp.sum(jnp.where(where, x, 0.0)) / jnp.maximum(n, 1.0), jnp.nan)


def prefix_lengths(length: int) -> list[tuple[int, str]]:
  """(L, 'len{L}') for the position bins' ends L <= length (8, 16, 32, ...), zero-padded as
  position_bin_names pads (so that they sort)."""
  width = _name_width(length)
  return [(end, f"len{end:0{width}d}") for _, end in position_bins(length) if end <= length]


@jax.jit
def scale_floor_fractions(codes: tuple, positions: jax.Array) -> dict:
  """Per layer and tensor, the share of the rollout's NVFP4 block scales at the E4M3 floor (2**-6):
  blocks whose amax / 6 (over the tensor scale, two-level) fell to or below it, where FP4 loses
  resolution. codes: RolloutResult.codes ([N, T, ...] per tensor); positions [N, T-1]: the
  positions the engine ran (experience.measured_positions). MXFP4 (E8M0 scales) is skipped.
  """
  out = {}
  for i, layer in enumerate(codes):
    for name, g in sorted(layer.items()):
      if g.scales.dtype != jnp.float8_e4m3fn:
        continue
      at_floor = (g.scales[:, :-1].astype(jnp.float32) == fp4.E4M3_TINY).astype(jnp.float32)
      mask = jnp.broadcast_to(positions.reshape(positions.shape + (1,) * (at_floor.ndim - 2)), at_floor.shape)
      out[f"quant/scale_floor_frac/{name}/layer{i}"] = masked_mean(at_floor, mask)
  return out


def routing_agreement(router_logits: jax.Array, rollout_ids: jax.Array, mask: jax.Array) -> jax.Array:
  """Fraction of the rollout's top-k experts that the trainer's own router also picks.

  router_logits [B, S, E] (the trainer's, whatever was replayed), rollout_ids [B, S, k].
  """
  return expert_overlap(jax.lax.top_k(router_logits, rollout_ids.shape[-1])[1], rollout_ids, mask)


def expert_overlap(ids: jax.Array, rollout_ids: jax.Array, mask: jax.Array) -> jax.Array:
  """Fraction of the rollout's top-k experts among `ids` (both [B, S, k], distinct per token), over `mask`."""
  k = rollout_ids.shape[-1]
  hits = jnp.sum(ids[..., :, None] == rollout_ids[..., None, :], axis=(-1, -2)) / k
  return masked_mean(hits.astype(jnp.float32), mask)
