"""The trainer: train state, optimizer, state shardings, and the jitted SFT and GRPO steps.

Each step is a pure function of (state, batch), jitted with the state donated, on one device
or with explicit shardings on the trainer mesh (parameters by their declared logical axes,
optimizer moments like their parameters, batches split along the batch axes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from trace_jax import model, qat, rl, sharding
from trace_jax.config import MOE_HIDDEN, ModelConfig, OptimConfig, RunConfig
from trace_jax.experience import TrainBatch, measured_positions, rollout_inputs
from trace_jax.quantizer import Guidance, QuantStats


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  step: jax.Array
  params: model.Params
  opt_state: Any


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
  """AdamW with linear warmup then cosine decay to `end_lr_fraction`, after global-norm clipping."""
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0 if cfg.warmup_steps else cfg.learning_rate,
    peak_value=cfg.learning_rate,
    warmup_steps=cfg.warmup_steps,
    decay_steps=max(total_steps, cfg.warmup_steps + 1),
    end_value=cfg.learning_rate * cfg.end_lr_fraction,
  )
  chain = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip else []
  chain.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))
  return optax.chain(*chain)


def qat_context(run: RunConfig, guided: bool = True) -> qat.QatContext:
  """The trainer's fake-quant for the run's mode, in the run's trainer dtype.

  guided=False: the guidance is only measured (round to nearest), e.g. guidance too old to use.
  """
  mode = run.mode
  rollout = mode.rollout
  return qat.QatContext(
    mode.trainer_quant, mode.guided and guided, run.trainer_dtype, rollout.guided_layers, rollout.guided_tensors
  )


def _apply(state: TrainState, grads, loss, optimizer) -> tuple[TrainState, jax.Array, jax.Array]:
  """Optimizer update that keeps the old state when the loss or gradients are not finite."""
  grad_norm = optax.global_norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  keep = lambda new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)
  new = TrainState(
    state.step + finite.astype(state.step.dtype), keep(params, state.params), keep(opt_state, state.opt_state)
  )
  return new, grad_norm, finite


def state_shardings(state: TrainState, optimizer, mesh) -> TrainState:
  """Where a TrainState (arrays or ShapeDtypeStructs) lives on the trainer mesh: parameters by their
  declared logical axes, optimizer moments like their parameters, the step replicated."""
  params = sharding.logical_shardings(state.params, mesh)
  opt_state = sharding.opt_state_shardings(optimizer, state.opt_state, params, mesh)
  return TrainState(sharding.replicated(mesh), params, opt_state)


def abstract_state(config: ModelConfig, optimizer, mesh) -> TrainState:
  """The TrainState's shapes, dtypes and shardings on the mesh (ShapeDtypeStructs): what a checkpoint
  restores into, without allocating the state first."""

  def init():
    params = model.init_params(config, jax.random.key(0))
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))

  shapes = jax.eval_shape(init)
  return jax.tree_util.tree_map(
    lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where),
    shapes,
    state_shardings(shapes, optimizer, mesh),
  )


def init_state(config: ModelConfig, optimizer, rng: jax.Array, mesh) -> TrainState:
  """A fresh TrainState created in place on the mesh (no host copy of the full parameters)."""

  def init():
    params = model.init_params(config, rng)
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))

  return jax.jit(init, out_shardings=state_shardings(jax.eval_shape(init), optimizer, mesh))()


def fresh_state(params, optimizer, mesh) -> TrainState:
  """Step 0 and a new optimizer state for `params`, all on the mesh."""
  init = lambda p: TrainState(jnp.zeros((), jnp.int32), p, optimizer.init(p))
  out = state_shardings(jax.eval_shape(init, params), optimizer, mesh)
  return jax.jit(init, in_shardings=(out.params,), out_shardings=out)(params)


def _sharded_step(step, optimizer, mesh, out_batch: bool) -> sharding.ShardedJit:
  """step(state, *batch) -> (state, [batch-shaped], metrics) with explicit shardings on `mesh`."""
  state_sh = lambda state: state_shardings(state, optimizer, mesh)

  def out_shardings(state, *batch, out_shape):
    logp = (sharding.batch_shardings(out_shape[1], mesh),) if out_batch else ()
    return (state_sh(state), *logp, sharding.replicated(mesh))  # metrics: replicated scalars

  return sharding.ShardedJit(
    step,
    in_shardings=lambda state, *batch: (state_sh(state), *sharding.batch_shardings(batch, mesh)),
    out_shardings=out_shardings,
    donate_argnums=0,
  )


def make_sft_step(run: RunConfig, optimizer, *, mesh=None):
  """Teacher-forced cross-entropy on the answer tokens (the warm start), no QAT.

  mesh: jit with explicit shardings there (state by the axis rules, batch split over the batch axes).
  """
  ctx = qat.QatContext(compute_dtype=run.trainer_dtype)

  def loss_fn(params, tokens, mask, loss_mask):
    logits, _ = model.forward(params, tokens[:, :-1], mask[:, :-1], run.model, ctx=ctx)
    nll = -model.token_logprobs(logits, tokens[:, 1:])
    return rl.masked_mean(nll, loss_mask[:, 1:])

  def step(state, tokens, mask, loss_mask):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, tokens, mask, loss_mask)
    state, grad_norm, finite = _apply(state, grads, loss, optimizer)
    return state, {"sft/loss": loss, "sft/grad_norm": grad_norm, "sft/finite": finite}

  if mesh is None:
    return jax.jit(step, donate_argnums=0)
  return _sharded_step(step, optimizer, mesh, out_batch=False)


def make_reference_logprobs(run: RunConfig):
  """(reference params, batch) -> log-probs of the targets under the KL anchor, without QAT."""
  ctx = qat.QatContext(compute_dtype=run.trainer_dtype)

  def ref_logprobs(params, batch: TrainBatch):
    logits, _ = model.forward(params, batch.inputs, batch.mask, run.model, ctx=ctx)
    return model.token_logprobs(logits, batch.targets, run.sampling)

  return jax.jit(ref_logprobs)


def _fraction(part, whole):
  return jnp.where(whole > 0, part / jnp.maximum(whole, 1), jnp.nan)


def quant_metrics(quant_stats: tuple[dict[str, QuantStats], ...], guidance: tuple[dict[str, Guidance], ...]) -> dict:
  """Per layer and tensor, how the trainer's FP4 codes compare with the rollout's.

  Which metrics exist follows what the rollout shipped (`guidance`, static):
    agreement/{tensor}/layer{i}: share of codes equal to the rollout's full codes (NaN without
      them: mantissa bits alone cannot tell, guided rounding forces them).
    bit_agreement/{tensor}/layer{i}: share of mantissa bits equal to the rollout's, where shipped.
    guidance/non_adjacent_frac/{tensor}/layer{i}, where codes exist: share of elements whose
      rollout code is neither neighbour of the trainer's value (no rounding reaches it).
    guidance/adjacent_share_of_mismatches/{tensor}/layer{i}: share of the code mismatches that
      are one codeword apart (NaN without mismatches).
  The last two are also pooled over every layer and tensor with codes (no `/{tensor}/layer{i}`).
  """
  metrics = {}
  pooled = dict(total=0.0, mismatches=0.0, non_adjacent=0.0)
  for i, layer_stats in enumerate(quant_stats):
    for name, s in layer_stats.items():
      shipped = guidance[i].get(name, Guidance())
      metrics[f"agreement/{name}/layer{i}"] = _fraction(s.matches, s.total)
      if shipped.mantissa_bits is not None:
        metrics[f"bit_agreement/{name}/layer{i}"] = _fraction(s.bit_matches, s.bit_total)
      if shipped.codes is not None:
        mismatches = s.total - s.matches
        metrics[f"guidance/non_adjacent_frac/{name}/layer{i}"] = _fraction(s.non_adjacent, s.total)
        metrics[f"guidance/adjacent_share_of_mismatches/{name}/layer{i}"] = _fraction(
          mismatches - s.non_adjacent, mismatches
        )
        # float sums: element counts over every layer can pass 2**31
        for key, count in (("total", s.total), ("mismatches", mismatches), ("non_adjacent", s.non_adjacent)):
          pooled[key] = pooled[key] + count.astype(jnp.float32)
  if any(key.startswith("guidance/non_adjacent_frac/") for key in metrics):
    metrics["guidance/non_adjacent_frac"] = _fraction(pooled["non_adjacent"], pooled["total"])
    metrics["guidance/adjacent_share_of_mismatches"] = _fraction(
      pooled["mismatches"] - pooled["non_adjacent"], pooled["mismatches"]
    )
  return metrics


def _rl_forward(run: RunConfig, expert_parallel, guided: bool = True):
  """(params, batch) -> (log-probs of the targets, ForwardAux): the QAT forward (guided per the mode,
  unless guided=False)."""
  ctx, config = qat_context(run, guided), run.model
  moe_impl = "sorted" if expert_parallel is None else "ep"

  def forward(params, batch: TrainBatch):
    logits, aux = model.forward(
      params,
      batch.inputs,
      batch.mask,
      config,
      ctx=ctx,
      moe_impl=moe_impl,
      expert_parallel=expert_parallel,
      **rollout_inputs(batch),
    )
    return model.token_logprobs(logits, batch.targets, run.sampling), aux  # the policy that sampled

  return forward


def _behaviour_metrics(logp, aux, batch: TrainBatch, tis_cap: float) -> dict:
  """Train-rollout mismatch (per token, and by response position and per sequence, with TIS weights
  capped at `tis_cap`: rl.position_mismatch_metrics), per-layer code agreement and routing agreement
  of one forward."""
  logp = jax.lax.stop_gradient(logp)
  metrics = rl.mismatch_metrics(logp, batch.rollout_logp, batch.loss_mask)
  metrics.update(rl.position_mismatch_metrics(logp, batch.rollout_logp, batch.loss_mask, tis_cap))
  metrics.update(quant_metrics(aux.quant_stats, batch.guidance))
  measured = measured_positions(batch)
  for i, router_logits in enumerate(aux.router_logits):
    if router_logits is not None:
      metrics[f"routing_agreement/layer{i}"] = rl.routing_agreement(router_logits, batch.rollout_ids[i], measured)
    if router_logits is not None and MOE_HIDDEN in batch.guidance[i]:
      # the trainer's (token, expert) rows with no rollout row: rounded to nearest, outside the counts
      metrics[f"guidance/unmatched_expert_frac/layer{i}"] = 1 - rl.expert_overlap(
        aux.topk_ids[i], batch.rollout_ids[i], measured
      )
  return metrics


def make_rl_step(run: RunConfig, optimizer, *, mesh=None, expert_parallel=None, guided: bool = True):
  """The jitted, donated GRPO step: QAT forward (guided per the mode), loss, update, metrics.

  `step(state, batch, first)` -> (state, log-probs before the update, metrics). first=True: the
  PPO ratio's old log-probs are this forward's own (the batch's first update); else batch.old_logp.
  mesh: jit with explicit in/out shardings on the trainer mesh (a 1-device mesh is the
  single-device case). expert_parallel: the MoE layers run expert parallel over its mesh
  (moe_impl='ep'), and the dropped assignments are reported as `moe/dropped_tokens`.
  guided=False: round to nearest even in a guided mode (the guidance is only measured).
  """
  grpo, forward = run.grpo, _rl_forward(run, expert_parallel, guided)

  def loss_fn(params, batch: TrainBatch, first: bool):
    logp, aux = forward(params, batch)
    old = jax.lax.stop_gradient(logp) if first else batch.old_logp
    loss, metrics = rl.grpo_loss(logp, old, batch.rollout_logp, batch.advantages, batch.loss_mask, grpo, batch.ref_logp)
    if grpo.aux_loss_coef:
      loss = loss + grpo.aux_loss_coef * aux.aux_loss
    metrics["loss/aux_load_balance"] = aux.aux_loss
    if aux.dropped_tokens is not None:
      metrics["moe/dropped_tokens"] = aux.dropped_tokens
    return loss, (logp, aux, metrics)

  def step(state: TrainState, batch: TrainBatch, first: bool):
    (loss, (logp, aux, metrics)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, first)
    state, grad_norm, finite = _apply(state, grads, loss, optimizer)
    metrics.update({"loss/total": loss, "grad_norm": grad_norm, "finite": finite})
    metrics.update(_behaviour_metrics(logp, aux, batch, grpo.tis_cap))
    return state, jax.lax.stop_gradient(logp), metrics

  if mesh is None:
    return jax.jit(step, donate_argnums=0, static_argnames="first")
  return _sharded_step(step, optimizer, mesh, out_batch=True)


def make_rl_logprobs(run: RunConfig, *, mesh=None, expert_parallel=None, guided: bool = True):
  """(params, batch) -> (log-probs, metrics): the QAT forward of a rollout batch before any update.

  With mini-batches, later updates see moved parameters, so the PPO ratio's old log-probs (and
  the TIS weight built on them) come from this pass, as do the mismatch and agreement metrics.
  guided=False: as in make_rl_step.
  """
  forward = _rl_forward(run, expert_parallel, guided)

  def logprobs(params, batch: TrainBatch):
    logp, aux = forward(params, batch)
    metrics = _behaviour_metrics(logp, aux, batch, run.grpo.tis_cap)
    if aux.dropped_tokens is not None:
      metrics["moe/dropped_tokens"] = aux.dropped_tokens
    return logp, metrics

  if mesh is None:
    return jax.jit(logprobs)
  return sharding.ShardedJit(
    logprobs,
    in_shardings=lambda params, batch: (
      sharding.logical_shardings(params, mesh),
      sharding.batch_shardings(batch, mesh),
    ),
    out_shardings=lambda params, batch, out_shape: (
      sharding.batch_shardings(out_shape[0], mesh),
      sharding.replicated(mesh),
    ),
  )


def make_take_rows(mesh=None):
  """(batch, rows [M]) -> the batch's rows `rows` (a mini-batch), laid out on `mesh` like a batch."""

  def take(batch: TrainBatch, rows):
    return jax.tree_util.tree_map(lambda a: a[rows] if a.ndim else a, batch)

  if mesh is None:
    return jax.jit(take)
  return sharding.ShardedJit(
    take,
    in_shardings=lambda batch, rows: (sharding.batch_shardings(batch, mesh), sharding.replicated(mesh)),
    out_shardings=lambda batch, rows, out_shape: sharding.batch_shardings(out_shape, mesh),
  )
