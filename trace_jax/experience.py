"""What crosses from the rollout engine to the trainer: `RolloutResult` and `TrainBatch`.

The engine (rollout.py) fills a RolloutResult by sequence slot; `train_batch_from_rollout`
turns it into the trainer's teacher-forced layout (inputs [N, T-1] predict targets [N, T-1]),
with the guidance, the routing to replay and the positions whose codes can be compared.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from trace_jax.quantizer import Guidance


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RolloutResult:
  """Everything the trainer needs, by sequence slot t in [0, P + max_new_tokens).

  tokens: prompt (left-padded) then response (pad after EOS). mask: real tokens.
  response_mask: generated tokens up to and including EOS. logprobs: rollout log-prob of
  tokens[:, t] (0 outside the response). topk_ids: per layer [B, T, k] expert ids (None for
  dense layers). guidance: per layer {tensor: Guidance} for the guided layers, in the
  configured form. codes: per layer {tensor: Guidance('full')} when record_codes is on.
  Slot T-1 is never fed back through the engine, so its activations are not recorded.
  """

  tokens: jax.Array
  mask: jax.Array
  response_mask: jax.Array
  logprobs: jax.Array
  topk_ids: tuple
  guidance: tuple
  codes: tuple
  guidance_bytes_per_token: int = dataclasses.field(metadata=dict(static=True), default=0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainBatch:
  """One rollout batch in the trainer's layout: inputs [N, T-1] predict targets [N, T-1]."""

  inputs: jax.Array
  targets: jax.Array
  mask: jax.Array  # real tokens of the inputs (prompt and response)
  loss_mask: jax.Array  # response tokens among the targets
  rollout_logp: jax.Array
  advantages: jax.Array | None  # [N]
  old_logp: jax.Array  # the trainer's log-probs before this rollout's first update
  ref_logp: jax.Array | None
  guidance: tuple  # per layer {tensor: Guidance}
  replay_ids: tuple | None  # per layer [N, T-1, k] (R3)
  rollout_ids: tuple  # per layer [N, T-1, k], for routing agreement and the expert of each 'moe_hidden' guidance row


def guidance_bytes_per_token(guidance) -> dict[str, int]:
  """Bytes of guidance one sequence position costs, per tensor name, summed over layers.

  guidance: per layer {tensor: Guidance} with leaves laid out [B, T, ...] (arrays or shapes).
  """
  out: dict[str, int] = {}
  for layer in guidance:
    for name, g in layer.items():
      leaves = [x for x in jax.tree_util.tree_leaves(g) if x.ndim >= 2]
      out[name] = out.get(name, 0) + sum(x.size * x.dtype.itemsize // (x.shape[0] * x.shape[1]) for x in leaves)
  return out


def trainer_guidance(result: RolloutResult) -> tuple[dict[str, Guidance], ...]:
  """The rollout's per-layer guidance in the trainer's layout ([N, T-1, ...]).

  Guided layers get the configured form; where diagnostic full codes exist they ride along
  (measured, never used for rounding when mantissa bits are present). Other layers get the
  codes alone, without the rollout's block or tensor scales, so the trainer's numerics are
  untouched.
  """
  cut = lambda a: a[:, :-1] if a is not None and a.ndim >= 2 else a
  layers = []
  for guided, codes in zip(result.guidance, result.codes):
    layer = {}
    for name in set(guided) | set(codes):
      g = guided.get(name, Guidance())
      if name in codes and g.codes is None:
        g = dataclasses.replace(g, codes=codes[name].codes)
      layer[name] = jax.tree_util.tree_map(cut, g)
    layers.append(layer)
  return tuple(layers)


def rollout_inputs(batch: TrainBatch) -> dict:
  """What the trainer's forward takes from the rollout besides the tokens (`model.forward`'s keywords): the
  guidance, the routing to replay, the positions the engine recorded, and each row's rollout id (its
  guidance row, where mini-batches shuffle the rows)."""
  return dict(
    guidance=batch.guidance,
    replay_ids=batch.replay_ids,
    stats_mask=measured_positions(batch),
    guidance_ids=batch.rollout_ids,
  )


def measured_positions(batch: TrainBatch) -> jax.Array:
  """Input positions the engine ran through its forward: real tokens followed by a real token.

  The last real token of a sequence (EOS, or the max-length token) feeds no prediction, and
  the engine stops before it, so it has no recorded codes or routing to compare against.
  """
  next_real = jnp.concatenate([batch.mask[:, 1:], batch.loss_mask[:, -1:]], axis=1)
  return batch.mask * next_real


def train_batch_from_rollout(result: RolloutResult, advantages, routing_replay: bool) -> TrainBatch:
  """The trainer's batch from a rollout (inputs [N, T-1] predict targets [N, T-1]), on the rollout's mesh."""
  rollout_ids = tuple(None if t is None else t[:, :-1] for t in result.topk_ids)
  return TrainBatch(
    inputs=result.tokens[:, :-1],
    targets=result.tokens[:, 1:],
    mask=result.mask[:, :-1],
    loss_mask=result.response_mask[:, 1:],
    rollout_logp=result.logprobs[:, 1:],
    advantages=advantages,
    old_logp=jnp.zeros_like(result.logprobs[:, 1:]),
    ref_logp=None,
    guidance=trainer_guidance(result),
    replay_ids=rollout_ids if routing_replay else None,
    rollout_ids=rollout_ids,
  )
