"""Train state, the jitted SFT and GRPO steps, and the RL loop.

One step of the loop, top to bottom (data flows one way):
  prompts -> weight_sync(params) -> rollout.generate (tokens, log-probs, routing, guidance)
  -> rewards -> group advantages -> train step (QAT forward with guidance, GRPO loss) -> params.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from tqdm import tqdm

from trace_jax import checkpoint, data, model, qat, rl, rollout, sharding
from trace_jax.config import (
  ConfigError,
  GRPOConfig,
  ModeConfig,
  ModelConfig,
  OptimConfig,
  QuantConfig,
  SamplingConfig,
  resolve_mode,
  section,
)
from trace_jax.metrics_writer import MetricWriter, read_metrics
from trace_jax.quantizer import Guidance

# Fields a rerun in the same workdir may change (how long and how often, on which devices), not
# what is computed: a checkpoint restores onto another mesh.
RESUMABLE_FIELDS = ("steps", "checkpoint_every", "eval_every", "log_every", "mesh", "distributed")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  step: jax.Array
  params: model.Params
  opt_state: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainBatch:
  """One rollout batch in the trainer's layout: inputs [N, T-1] predict targets [N, T-1]."""

  inputs: jax.Array
  targets: jax.Array
  mask: jax.Array  # real tokens of the inputs (prompt and response)
  loss_mask: jax.Array  # response tokens among the targets
  rollout_logp: jax.Array
  advantages: jax.Array  # [N]
  old_logp: jax.Array  # the trainer's log-probs before this rollout's first update
  ref_logp: jax.Array | None
  guidance: tuple  # per layer {tensor: Guidance}
  replay_ids: tuple | None  # per layer [N, T-1, k] (R3)
  rollout_ids: tuple  # per layer [N, T-1, k], for routing agreement


# --- the run's configuration ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """The validated, frozen view of a ConfigDict that the loop runs on."""

  model: ModelConfig
  mode: ModeConfig
  sampling: SamplingConfig
  grpo: GRPOConfig
  optim: OptimConfig
  reward: data.RewardConfig

  @classmethod
  def from_config(cls, cfg: ml_collections.ConfigDict, tokenizer) -> RunConfig:
    model_cfg = section(ModelConfig, cfg.model, "model")
    if model_cfg.vocab_size < tokenizer.vocab_size:
      raise ConfigError(
        f"config.model.vocab_size: {model_cfg.vocab_size} is smaller than the tokenizer's vocabulary "
        f"({tokenizer.vocab_size}); raise it."
      )
    quant = section(QuantConfig, cfg.quant, "quant")
    mode = resolve_mode(
      cfg.mode,
      model_cfg,
      quant,
      guided_fraction=cfg.trace.guided_fraction,
      guidance_form=cfg.trace.guidance_form,
      diagnostics=cfg.trace.diagnostics,
      matmul_impl=cfg.rollout.matmul_impl,
    )
    sampling = SamplingConfig(
      max_new_tokens=cfg.rollout.max_new_tokens,
      temperature=cfg.rollout.temperature,
      top_k=cfg.rollout.top_k,
      top_p=cfg.rollout.top_p,
      eos_id=tokenizer.eos_id,
      pad_id=tokenizer.pad_id,
      vocab_size=tokenizer.vocab_size,
      banned_ids=data.never_generated_ids(tokenizer),
    )
    grpo = section(GRPOConfig, cfg.rl, "rl")
    optim = section(OptimConfig, cfg.optim, "optim")
    reward = section(data.RewardConfig, cfg.reward, "reward")
    return cls(model_cfg, mode, sampling, grpo, optim, reward)

  def qat_context(self) -> qat.QatContext:
    return qat.QatContext(self.mode.trainer_quant, self.mode.guided, jnp.bfloat16, self.mode.rollout.guided_layers)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
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


# --- steps ----------------------------------------------------------------------------------


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
  """Where a TrainState (arrays or ShapeDtypeStructs) lives on the trainer mesh: parameters by the
  logical axis rules (sharding.py), optimizer moments like their parameters, the step replicated."""
  params = sharding.params_shardings(state.params, mesh)
  opt_state = sharding.opt_state_shardings(optimizer, state.opt_state, params, mesh)
  return TrainState(sharding.replicated(mesh), params, opt_state)


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


def make_sft_step(config: ModelConfig, optimizer, *, mesh=None):
  """Teacher-forced cross-entropy on the answer tokens (the warm start), BF16, no QAT.

  mesh: jit with explicit shardings there (state by the axis rules, batch split over the batch axes).
  """

  def loss_fn(params, tokens, mask, loss_mask):
    logits, _ = model.forward(params, tokens[:, :-1], mask[:, :-1], config)
    nll = -model.token_logprobs(logits, tokens[:, 1:])
    return rl.masked_mean(nll, loss_mask[:, 1:])

  def step(state, tokens, mask, loss_mask):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, tokens, mask, loss_mask)
    state, grad_norm, finite = _apply(state, grads, loss, optimizer)
    return state, {"sft/loss": loss, "sft/grad_norm": grad_norm, "sft/finite": finite}

  if mesh is None:
    return jax.jit(step, donate_argnums=0)
  return _sharded_step(step, optimizer, mesh, out_batch=False)


def make_rl_step(run: RunConfig, optimizer, *, mesh=None, expert_parallel=None):
  """The jitted, donated GRPO step: QAT forward (guided per the mode), loss, update, metrics.

  mesh: jit with explicit in/out shardings on the trainer mesh (a 1-device mesh is the
  single-device case). expert_parallel: the MoE layers run expert parallel over its mesh
  (moe_impl='ep'), and the dropped assignments are reported as `moe/dropped_tokens`.
  """
  ctx, grpo, config = run.qat_context(), run.grpo, run.model
  moe_impl = "sorted" if expert_parallel is None else "ep"

  def loss_fn(params, batch: TrainBatch, first: bool):
    logits, aux = model.forward(
      params,
      batch.inputs,
      batch.mask,
      config,
      ctx=ctx,
      guidance=batch.guidance,
      replay_ids=batch.replay_ids,
      moe_impl=moe_impl,
      expert_parallel=expert_parallel,
      stats_mask=measured_positions(batch),
    )
    logp = model.token_logprobs(logits, batch.targets, run.sampling)
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
    metrics.update(rl.mismatch_metrics(jax.lax.stop_gradient(logp), batch.rollout_logp, batch.loss_mask))
    for i, layer_stats in enumerate(aux.quant_stats):
      for name, s in layer_stats.items():
        metrics[f"agreement/{name}/layer{i}"] = jnp.where(s.total > 0, s.matches / jnp.maximum(s.total, 1), jnp.nan)
    for i, router_logits in enumerate(aux.router_logits):
      if router_logits is not None:
        metrics[f"routing_agreement/layer{i}"] = rl.routing_agreement(
          router_logits, batch.rollout_ids[i], measured_positions(batch)
        )
    return state, jax.lax.stop_gradient(logp), metrics

  if mesh is None:
    return jax.jit(step, donate_argnums=0, static_argnames="first")
  return _sharded_step(step, optimizer, mesh, out_batch=True)


def trainer_guidance(result: rollout.RolloutResult) -> tuple[dict[str, Guidance], ...]:
  """The rollout's per-layer guidance in the trainer's layout ([N, T-1, ...]).

  Guided layers get the configured form; where diagnostic full codes exist they ride along
  (measured, never used for rounding when mantissa bits are present). Other layers get the
  codes alone, without the rollout's scales, so the trainer's numerics are untouched.
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


# --- the loop -------------------------------------------------------------------------------


def _check_workdir(cfg: ml_collections.ConfigDict, workdir: str) -> None:
  """A workdir holds one run: refuse to resume a run of another config (nothing is touched)."""
  path = os.path.join(workdir, "config.json")
  current = json.loads(cfg.to_json_best_effort())
  if os.path.exists(path):
    with open(path) as f:
      saved = json.load(f)
    differs = sorted(
      k for k in set(saved) | set(current) if k not in RESUMABLE_FIELDS and saved.get(k) != current.get(k)
    )
    if differs:
      raise ConfigError(
        f"--workdir {workdir} holds a run of another config (fields {differs} differ from its config.json). "
        "Use a new --workdir, or rerun with the saved config to resume."
      )
  os.makedirs(workdir, exist_ok=True)
  if jax.process_index() == 0:  # one writer; atomic, so other processes never read half a file
    with open(path + ".tmp", "w") as f:
      json.dump(current, f, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)


def load_data(cfg: ml_collections.ConfigDict):
  """(tokenizer, train source, test source) for the configured task."""
  tokenizer = data.load_tokenizer(cfg.data.tokenizer or None)
  if cfg.data.jsonl_train:
    train = data.JsonlSource(cfg.data.jsonl_train)
    test = data.JsonlSource(cfg.data.jsonl_test) if cfg.data.jsonl_test else train
    return tokenizer, train, test
  kwargs = dict(
    data_dir=cfg.data.data_dir or None,
    levels=tuple(cfg.data.levels),
    num_train=cfg.data.num_train,
    num_test=cfg.data.num_test,
    seed=cfg.data.seed,
  )
  return tokenizer, data.arithmetic_source("train", **kwargs), data.arithmetic_source("test", **kwargs)


def sft_warm_start(params, cfg, run: RunConfig, tokenizer, source, *, mesh=None):
  """A few hundred steps of supervised training so RL starts from partial reward (on `mesh`)."""
  steps = cfg.sft.steps
  if steps <= 0:
    return params
  cache = _sft_cache_path(cfg)
  if cache and os.path.exists(cache):
    logging.info("SFT warm start: loading cached parameters from %s", cache)
    return checkpoint.load_tree(cache, params)
  optimizer = make_optimizer(section(OptimConfig, cfg.sft.optim, "sft.optim"), steps)
  mesh = mesh or sharding.Topology.single_device().trainer
  state = fresh_state(params, optimizer, mesh)
  step_fn = make_sft_step(run.model, optimizer, mesh=mesh)
  batcher = data.SFTBatcher(
    source, tokenizer, cfg.sft.batch_size, cfg.data.max_prompt_len, cfg.rollout.max_new_tokens - 1, seed=cfg.seed
  )
  for i in tqdm(range(steps), desc="sft", leave=False, disable=jax.process_index() > 0):
    b = batcher.batch_at(i)
    host = (b.tokens, b.mask, b.loss_mask)
    state, m = step_fn(state, *sharding.host_to_global(host, sharding.batch_shardings(host, mesh)))
    if not bool(m["sft/finite"]):
      raise FloatingPointError(f"SFT loss is not finite at step {i}; lower config.sft.optim.learning_rate.")
  logging.info("SFT warm start: %d steps, final loss %.4f", steps, float(m["sft/loss"]))
  if cache:
    checkpoint.save_tree(cache, state.params)
  return state.params


def _sft_cache_path(cfg) -> str:
  """Where cached SFT parameters live: keyed by everything that determines them."""
  if not cfg.sft.cache_dir:
    return ""
  keyed = {k: json.loads(cfg[k].to_json_best_effort()) for k in ("model", "sft", "data", "rollout")}
  keyed["sft"].pop("cache_dir")
  keyed["seed"] = cfg.seed
  digest = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]
  return os.path.join(cfg.sft.cache_dir, f"sft-{digest}")


def evaluate(params, run: RunConfig, quant: QuantConfig | None, tokenizer, source, cfg, rng, topology=None) -> float:
  """Greedy accuracy on the first `eval_prompts` test prompts with a BF16 or FP4 engine."""
  topology = topology or sharding.Topology.single_device()
  n = min(cfg.eval_prompts, len(source))
  batcher = data.PromptBatcher(source, tokenizer, n, cfg.data.max_prompt_len, seed=0, shuffle=False)
  b = batcher.batch_at(0)
  engine = rollout.RolloutConfig(quant=quant, matmul_impl=cfg.rollout.matmul_impl)
  greedy = dataclasses.replace(run.sampling, temperature=0.0)
  ep, _ = rollout.make_weight_sync(quant, topology.trainer, topology.rollout)(params)
  host = (b.tokens, b.mask)
  prompts, mask = sharding.host_to_global(host, sharding.batch_shardings(host, topology.rollout))
  generate = rollout.make_generate(topology.rollout)
  res = generate(
    ep,
    prompts,
    mask,
    rng,
    None,
    model_config=run.model,
    rollout_config=engine,
    sampling=greedy,
    expert_parallel=topology.rollout_expert_parallel,
  )
  responses = sharding.to_host(res.tokens)[:, b.tokens.shape[1] :]
  correct = data.RewardConfig(run.reward.verifier, correct_reward=1.0, format_reward=0.0)
  return float(np.mean(data.batch_rewards(b.answers, responses, tokenizer, correct)))


class _NoWriter:
  """The metric writer of processes other than the first."""

  def write(self, step, metrics):
    pass

  def close(self):
    pass


class _Preempted:
  """SIGTERM sets a flag; the loop checkpoints after the current step and exits cleanly."""

  def __init__(self):
    self.flag = False
    self._previous = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    logging.warning("SIGTERM: saving a checkpoint after this step, then exiting.")
    self.flag = True

  def restore(self):
    signal.signal(signal.SIGTERM, self._previous)


def train_and_evaluate(cfg: ml_collections.ConfigDict, workdir: str) -> dict:
  """Run (or resume) the RL job described by `cfg` in `workdir`; returns the final summary.

  Devices come from `cfg.mesh` (trainer and rollout meshes, MoE dispatch) and, for several
  hosts, `cfg.distributed` or the JAX_* environment (sharding.initialize_distributed).
  """
  dist = cfg.get("distributed") or {}
  sharding.initialize_distributed(
    dist.get("coordinator_address", ""), dist.get("num_processes", 0), dist.get("process_id", -1)
  )
  tokenizer, train_source, test_source = load_data(cfg)
  run = RunConfig.from_config(cfg, tokenizer)
  topology = sharding.Topology.from_config(cfg)
  _check_workdir(cfg, workdir)
  root = jax.random.key(cfg.seed)
  init_key, rollout_key, eval_key = jax.random.split(root, 3)

  optimizer = make_optimizer(run.optim, cfg.steps)
  state = init_state(run.model, optimizer, init_key, topology.trainer)
  ckpt = checkpoint.Checkpointer(workdir, max_to_keep=cfg.keep_checkpoints)
  # The KL anchor is the policy RL starts from; a resumed run's own parameters have moved on.
  reference_path = os.path.join(workdir, "reference_params")
  start, state = ckpt.restore_latest(state)
  if start is None:
    logging.info("Starting a new run in %s (mode %s).", workdir, run.mode.name)
    params = sft_warm_start(state.params, cfg, run, tokenizer, train_source, mesh=topology.trainer)
    state = fresh_state(params, optimizer, topology.trainer)
    if run.grpo.kl_coef > 0:  # before checkpoint 0, so that every resumable run has it
      checkpoint.save_tree(reference_path, state.params, force=True)
    ckpt.save(0, state, force=True)
    start = 0
  else:
    logging.info("Resuming %s from step %d.", workdir, start)
  reference = checkpoint.load_tree(reference_path, state.params) if run.grpo.kl_coef > 0 else None

  lead = jax.process_index() == 0  # one process writes metrics and summaries
  writer = MetricWriter(workdir, start_step=start + 1) if lead else _NoWriter()
  batcher = data.PromptBatcher(train_source, tokenizer, cfg.batch_prompts, cfg.data.max_prompt_len, seed=cfg.seed)
  step_fn = make_rl_step(run, optimizer, mesh=topology.trainer, expert_parallel=topology.expert_parallel)
  sync = rollout.make_weight_sync(run.mode.rollout.quant, topology.trainer, topology.rollout)
  ref_logp_fn = jax.jit(
    lambda p, b: model.token_logprobs(model.forward(p, b.inputs, b.mask, run.model)[0], b.targets, run.sampling)
  )
  preempted = _Preempted()
  summary: dict = {}
  bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=f"rl[{run.mode.name}]", disable=not lead)
  try:
    for step in bar:
      state, metrics = _rl_step(
        step, state, run, batcher, tokenizer, sync, step_fn, ref_logp_fn, reference, rollout_key, topology=topology
      )
      if not metrics["finite"]:
        raise FloatingPointError(
          f"Loss or gradients are not finite at step {step + 1}; the update was skipped and the run stopped. "
          f"The last good checkpoint is step {ckpt.steps()[-1]} in {ckpt.directory}."
        )
      if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
        metrics["eval/accuracy"] = evaluate(
          state.params, run, run.mode.rollout.quant, tokenizer, test_source, cfg, eval_key, topology
        )
      writer.write(step + 1, metrics)
      bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", dlogp=f"{metrics['mismatch/logp_diff_mean']:.4f}")
      if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps or preempted.flag:
        ckpt.save(step + 1, state, force=True)
      if preempted.flag:
        break
    ckpt.wait()
    summary = _summary(workdir, run, state, cfg, tokenizer, test_source, eval_key, topology)
  finally:
    preempted.restore()
    writer.close()
    ckpt.close()
  return summary


def measured_positions(batch: TrainBatch) -> jax.Array:
  """Input positions the engine ran through its forward: real tokens followed by a real token.

  The last real token of a sequence (EOS, or the max-length token) feeds no prediction, and
  the engine stops before it, so it has no recorded codes or routing to compare against.
  """
  next_real = jnp.concatenate([batch.mask[:, 1:], batch.loss_mask[:, -1:]], axis=1)
  return batch.mask * next_real


def train_batch_from_rollout(result: rollout.RolloutResult, advantages, routing_replay: bool) -> TrainBatch:
  """The trainer's batch from a rollout (inputs [N, T-1] predict targets [N, T-1]), on its mesh."""
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


def _rl_step(
  step, state, run: RunConfig, batcher, tokenizer, sync, step_fn, ref_logp_fn, reference, rollout_key, *, topology
):
  """One RL step: rollout, rewards, advantages, update. Returns (state, metrics as floats).

  The engine runs on the rollout mesh; its results (tokens, log-probs, routing, guidance) are
  resharded onto the trainer mesh, and the bytes that crossed are reported.
  """
  G = run.grpo.num_generations
  batch = batcher.batch_at(step)
  host = (np.repeat(batch.tokens, G, axis=0), np.repeat(batch.mask, G, axis=0))
  prompts, prompt_mask = sharding.host_to_global(host, sharding.batch_shardings(host, topology.rollout))
  answers = [a for a in batch.answers for _ in range(G)]

  t0 = time.perf_counter()
  engine_params, sync_bytes = sync(state.params)
  result = rollout.make_generate(topology.rollout)(
    engine_params,
    prompts,
    prompt_mask,
    jax.random.fold_in(rollout_key, step),
    None,
    model_config=run.model,
    rollout_config=run.mode.rollout,
    sampling=run.sampling,
    expert_parallel=topology.rollout_expert_parallel,
  )
  tokens = sharding.to_host(result.tokens)
  t_rollout = time.perf_counter() - t0

  p = batch.tokens.shape[1]
  rewards = data.batch_rewards(answers, tokens[:, p:], tokenizer, run.reward)
  advantages = np.asarray(rl.group_advantages(jnp.asarray(rewards), G, run.grpo.normalize_std))
  train_batch = train_batch_from_rollout(result, None, run.grpo.routing_replay)  # on the rollout mesh
  targets = sharding.batch_shardings(train_batch, topology.trainer)
  guidance_bytes = sharding.crossing_bytes(train_batch.guidance, targets.guidance)
  train_batch, batch_bytes = sharding.reshard(train_batch, targets)
  advantages = sharding.host_to_global(advantages, sharding.batch_shardings(advantages, topology.trainer))
  train_batch = dataclasses.replace(train_batch, advantages=advantages)
  if reference is not None:
    train_batch = dataclasses.replace(train_batch, ref_logp=ref_logp_fn(reference, train_batch))

  t0 = time.perf_counter()
  metrics = {}
  for epoch in range(run.grpo.ppo_epochs):
    state, logp, m = step_fn(state, train_batch, first=epoch == 0)
    if epoch == 0:
      metrics = m  # mismatch metrics: the policy the rollout was synced from
      train_batch = dataclasses.replace(train_batch, old_logp=logp)
    else:
      metrics.update({k: v for k, v in m.items() if k.startswith("loss/") or k in ("grad_norm", "finite")})
  metrics = jax.device_get(metrics)
  t_train = time.perf_counter() - t0

  response_mask = sharding.to_host(result.response_mask)
  metrics = {k: float(v) for k, v in metrics.items()}
  metrics.update(
    {
      "reward/mean": float(rewards.mean()),
      "reward/accuracy": float(np.mean(rewards >= run.reward.correct_reward)),
      "response/length_mean": float(response_mask.sum(1).mean()),
      "response/invalid_frac": float(np.mean(data.invalid_responses(tokens[:, p:], tokenizer))),
      "guidance/bytes_per_token": float(result.guidance_bytes_per_token),
      "transfer/weight_sync_bytes": float(sync_bytes),
      "transfer/rollout_to_trainer_bytes": float(batch_bytes),
      "transfer/guidance_bytes": float(guidance_bytes),
      "time/rollout_s": t_rollout,
      "time/train_s": t_train,
      "finite": bool(metrics["finite"]),
    }
  )
  return state, metrics


def _summary(workdir, run, state, cfg, tokenizer, test_source, eval_key, topology=None) -> dict:
  """Final-policy check: greedy accuracy with a BF16 and an FP4 engine; reward trend."""
  rows = read_metrics(workdir)
  fp4_quant = section(QuantConfig, cfg.quant, "quant")
  summary = {
    "mode": run.mode.name,
    "steps": int(state.step),
    "final/accuracy_bf16_engine": evaluate(state.params, run, None, tokenizer, test_source, cfg, eval_key, topology),
    "final/accuracy_fp4_engine": evaluate(
      state.params, run, fp4_quant, tokenizer, test_source, cfg, eval_key, topology
    ),
  }
  if rows:
    k = max(1, len(rows) // 5)
    for key in ("reward/mean", "mismatch/logp_diff_mean", "mismatch/kl_k3"):
      values = [r[key] for r in rows if key in r]
      if values:
        summary[f"first_{k}/{key}"] = float(np.mean(values[:k]))
        summary[f"last_{k}/{key}"] = float(np.mean(values[-k:]))
  if jax.process_index() == 0:  # atomic: a half-written summary must not look like a finished run
    path = os.path.join(workdir, "summary.json")
    with open(path + ".tmp", "w") as f:
      json.dump(summary, f, indent=2)
    os.replace(path + ".tmp", path)
  return summary
