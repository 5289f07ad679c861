"""The RL job, top to bottom: data, SFT warm start, then GRPO steps; evaluation and the summary.

One RL step (data flows one way):
  prompts -> weight sync (trainer params -> engine params) -> rollout.generate (tokens,
  log-probs, routing, guidance) -> rewards -> group advantages -> train step (QAT forward with
  guidance, GRPO loss, update) -> params.

Where the parts live: the step programs in trainer.py, the engine in rollout.py, the meshes and
what crosses between them in cluster.py, the rollout -> trainer batch in experience.py, and the
workdir / SFT cache / preemption / summary plumbing in job.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from tqdm import tqdm

from trace_jax import (
  async_rl,
  checkpoint,
  cluster,
  data,
  experience,
  export,
  hf,
  job,
  model,
  rl,
  rollout,
  sharding,
  trainer,
)
from trace_jax.config import ConfigError, DataConfig, QuantConfig, RunConfig
from trace_jax.experience import measured_positions
from trace_jax.metrics_writer import read_metrics


def run_config(cfg: ml_collections.ConfigDict) -> RunConfig:
  """The RunConfig of a run's ConfigDict, its model section read from init_from's config.json where it has one."""
  return RunConfig.from_config(hf.with_pretrained_model(cfg))


def run_data(run: RunConfig):
  """(run with the task's tokenizer, tokenizer, train source, test source): the data every entry point reads."""
  tokenizer, train_source, test_source = load_data(run.data, run.sampling.max_new_tokens, run.job.init_from)
  return run.with_tokenizer(tokenizer), tokenizer, train_source, test_source


def load_data(cfg: DataConfig, max_new_tokens: int | None = None, pretrained: str = ""):
  """(tokenizer, train source, test source) for the configured task (data.task).

  The tokenizer is the task's character tokenizer (data.task_alphabet) unless data.tokenizer names
  a tokenizer.json or a model folder, or `pretrained` (config.init_from) is a model folder: then it
  is that folder's tokenizer, with its chat template (data.chat_template, data.system_prompt).
  Sources: the math task reads JSONL or Parquet problems (data.jsonl_train / jsonl_test). Otherwise the arithmetic and running-sum tasks are tfds array_record datasets
  (built once under data.data_dir), or {"prompt", "answer"} JSONL for 'arithmetic' with
  data.jsonl_train; the code tasks are lists of Examples whose answer is the hidden tests
  (data.code_sources).

  max_new_tokens: also refuse (data.check_lengths), before a generated task is built, prompts
  longer than data.max_prompt_len and answers the rollout cannot finish in max_new_tokens. The
  generated tasks are checked on their longest problems (exact for the character tokenizer), files
  and code problems one by one.
  """
  spec = cfg.tokenizer or pretrained or None
  chat = dict(chat_template=cfg.chat_template, system_prompt=cfg.system_prompt)
  tokenizer = data.load_tokenizer(spec, task=cfg.task, **(chat if spec and os.path.isdir(spec) else {}))

  def check(examples, answers: bool = True):
    if max_new_tokens is not None:
      data.check_lengths(examples, tokenizer, cfg.max_prompt_len, max_new_tokens if answers else None)

  if cfg.task in ("code_synthesis", "code_jsonl"):
    train, test = data.code_sources(cfg)
    check({f"problem {ex.metadata['name']}": ex for src in (train, test) for ex in src})
    return tokenizer, train, test
  if cfg.task == "math":
    fields = dict(prompt_field=cfg.prompt_field, answer_field=cfg.answer_field, skip_bad_rows=cfg.skip_bad_rows)
    train = data.MathSource(cfg.jsonl_train, **fields)
    test = data.MathSource(cfg.jsonl_test, **fields) if cfg.jsonl_test else train
    # from a pretrained policy (no SFT by default) the reference solutions need not fit a response
    check({f"{src.path}:{ex.metadata['line']}": ex for src in (train, test) for ex in src}, answers=not pretrained)
    return tokenizer, train, test
  generated = dict(data_dir=cfg.data_dir or None, num_train=cfg.num_train, num_test=cfg.num_test, seed=cfg.seed)
  if cfg.task == "running_sum":
    task = data.RunningSumTask(cfg.sum_terms, cfg.term_digits)
    check({f"the running sum of {task.terms} {task.digits}-digit terms": task.longest_example()})
    kwargs = dict(generated, terms=task.terms, digits=task.digits)
    return tokenizer, data.running_sum_source("train", **kwargs), data.running_sum_source("test", **kwargs)
  if cfg.jsonl_train:
    train = data.JsonlSource(cfg.jsonl_train)
    test = data.JsonlSource(cfg.jsonl_test) if cfg.jsonl_test else train
    check({f"{src.path}:{ex.metadata['line']}": ex for src in (train, test) for ex in src})
    return tokenizer, train, test
  check({f"level {level}": data.longest_example(level) for level in cfg.levels})
  kwargs = dict(generated, levels=tuple(cfg.levels))
  return tokenizer, data.arithmetic_source("train", **kwargs), data.arithmetic_source("test", **kwargs)


def sft_warm_start(params, run: RunConfig, tokenizer, source, *, cache: str = "", mesh=None):
  """A few hundred steps of supervised training so RL starts from partial reward (on `mesh`).

  cache: a path (job.sft_cache_path) where the result is saved, and read back by later runs.
  """
  steps = run.sft.steps
  if steps <= 0:
    return params
  if cache and os.path.exists(cache):
    logging.info("SFT warm start: loading cached parameters from %s", cache)
    return checkpoint.load_tree(cache, params)
  optimizer = trainer.make_optimizer(run.sft.optim, steps)
  mesh = mesh or cluster.Topology.single_device().trainer
  state = trainer.fresh_state(params, optimizer, mesh)
  step_fn = trainer.make_sft_step(run, optimizer, mesh=mesh)
  batcher = data.SFTBatcher(
    source,
    tokenizer,
    run.sft.batch_size,
    run.data.max_prompt_len,
    run.sampling.max_new_tokens,  # the rollout's response: up to max_new_tokens, EOS included
    seed=run.sft.seed_for(run.job.seed),
  )
  for i in tqdm(range(steps), desc="sft", leave=False, disable=not job.is_lead()):
    b = batcher.batch_at(i)
    host = (b.tokens, b.mask, b.loss_mask)
    state, m = step_fn(state, *sharding.host_to_global(host, sharding.batch_shardings(host, mesh)))
    if not bool(m["sft/finite"]):
      raise FloatingPointError(f"SFT loss is not finite at step {i}; lower config.sft.optim.learning_rate.")
  logging.info("SFT warm start: %d steps, final loss %.4f", steps, float(m["sft/loss"]))
  if cache:
    checkpoint.save_tree(cache, state.params)
  return state.params


def starting_policy(cfg: ml_collections.ConfigDict, run: RunConfig, tokenizer, source, mesh=None):
  """The parameters RL starts from, on `mesh` (default: one device): init_from's checkpoint, or a fresh init
  seeded by the warm start's seed (sft.seed, else the run's seed), then the SFT warm start (cached at
  job.sft_cache_path(cfg), so the modes of one seed share it). Every entry point that needs "the SFT policy of
  this config" calls this one function, with `run`, `tokenizer` and `source` from run_config and run_data,
  so that they all get the same parameters."""
  mesh = mesh or cluster.Topology.single_device().trainer
  if run.job.init_from:
    logging.info("Loading %s into the trainer's shardings.", run.job.init_from)
    params = hf.load_sharded(run.job.init_from, mesh)[1]
  else:
    init_key = jax.random.split(jax.random.key(run.sft.seed_for(run.job.seed)), 3)[0]
    optimizer = trainer.make_optimizer(run.optim, max(run.job.steps, 1))
    params = trainer.init_state(run.model, optimizer, init_key, mesh).params
  return sft_warm_start(params, run, tokenizer, source, cache=job.sft_cache_path(cfg), mesh=mesh)


def engine_for(params, run: RunConfig, quant: QuantConfig | None, topology):
  """(engine params on the rollout mesh, the engine's config) of trainer `params`: a BF16 engine
  (quant=None) or an FP4 one, as evaluation uses them."""
  engine_config = rollout.RolloutConfig(quant=quant)
  layout = rollout.expert_layout(engine_config, run.model)
  engine_params, _ = cluster.make_weight_sync(quant, topology.trainer, topology.rollout, layout)(params)
  return engine_params, engine_config


def respond(engine, run: RunConfig, prompts: data.PromptBatch, rng, topology, sampling=None, repeats: int = 1):
  """Responses to a batch of prompts, `repeats` samples each (rows prompt-major): (response tokens
  [B * repeats, R], whether each ended with EOS within rollout.max_new_tokens [B * repeats])."""
  engine_params, engine_config = engine
  host = (np.repeat(prompts.tokens, repeats, axis=0), np.repeat(prompts.mask, repeats, axis=0))
  tokens, mask = sharding.host_to_global(host, sharding.batch_shardings(host, topology.rollout))
  res = cluster.make_generate(topology.rollout)(
    engine_params,
    tokens,
    mask,
    rng,
    None,
    model_config=run.model,
    rollout_config=engine_config,
    sampling=sampling or dataclasses.replace(run.sampling, temperature=0.0),
    expert_parallel=topology.rollout_expert_parallel,
  )
  responses = sharding.to_host(res.tokens)[:, prompts.tokens.shape[1] :]
  return responses, (responses == run.sampling.eos_id).any(axis=1)


def correct_only(run: RunConfig):
  """The run's verifier scoring 1 for a correct answer and nothing else: what accuracy counts."""
  return dataclasses.replace(run.reward, correct_reward=1.0, format_reward=0.0, partial_credit=False)


def evaluate(params, run: RunConfig, quant: QuantConfig | None, tokenizer, source, rng, topology=None) -> float:
  """Greedy accuracy on the first `eval_prompts` test prompts with a BF16 (quant=None) or FP4 engine."""
  topology = topology or cluster.Topology.single_device()
  n = min(run.job.eval_prompts, len(source))
  b = data.PromptBatcher(source, tokenizer, n, run.data.max_prompt_len, seed=0, shuffle=False).batch_at(0)
  responses, _ = respond(engine_for(params, run, quant, topology), run, b, rng, topology)
  return float(np.mean(data.batch_rewards(b.answers, responses, tokenizer, correct_only(run))))


def diagnostic_step(run: RunConfig, step: int) -> bool:
  """Whether GRPO step `step` (from 0) records the agreement diagnostics' full codes: the first,
  every trace.diagnostics_every-th after it, and the run's last."""
  return run.trace.diagnostics and (step % run.trace.diagnostics_every == 0 or step + 1 == run.job.steps)


@dataclasses.dataclass(frozen=True)
class RLStep:
  """One GRPO step, `state, metrics = rl_step(step, state, prompts)`: what every step reuses.

  sync: trainer params -> (engine params on the rollout mesh, bytes). update: trainer.make_rl_step.
  logprobs / take_rows: trainer.make_rl_logprobs / make_take_rows (the old log-probs and the rows of
  mini-batches). reward_fn: (answers, response tokens [N, R]) -> (rewards [N], whether each response is
  undecodable [N]). reference: the KL anchor's params.
  """

  run: RunConfig
  topology: cluster.Topology
  sync: Callable
  update: Callable
  logprobs: Callable
  take_rows: Callable
  reward_fn: Callable
  rollout_key: jax.Array
  reference: model.Params | None = None
  reference_logprobs: Callable | None = None
  update_rtn: Callable | None = None  # update / logprobs rounding to nearest: guidance too old to steer
  logprobs_rtn: Callable | None = None

  @classmethod
  def build(cls, run: RunConfig, topology, optimizer, reward_fn, rollout_key, reference=None) -> RLStep:
    mesh, expert_parallel = topology.trainer, topology.expert_parallel
    stale_guidance = run.mode.guided and run.grpo.guidance_bound < run.grpo.max_version_diff
    rtn = dict(mesh=mesh, expert_parallel=expert_parallel, guided=False)
    return cls(
      run=run,
      topology=topology,
      sync=cluster.make_weight_sync(
        run.mode.rollout.quant,
        topology.trainer,
        topology.rollout,
        rollout.expert_layout(run.mode.rollout, run.model),
      ),
      update=trainer.make_rl_step(run, optimizer, mesh=mesh, expert_parallel=expert_parallel),
      logprobs=trainer.make_rl_logprobs(run, mesh=mesh, expert_parallel=expert_parallel),
      take_rows=trainer.make_take_rows(mesh),
      reward_fn=reward_fn,
      rollout_key=rollout_key,
      reference=reference,
      reference_logprobs=None if reference is None else trainer.make_reference_logprobs(run),
      update_rtn=trainer.make_rl_step(run, optimizer, **rtn) if stale_guidance else None,
      logprobs_rtn=trainer.make_rl_logprobs(run, **rtn) if stale_guidance else None,
    )

  def optimize(self, step: int, state: trainer.TrainState, batch, guided: bool = True):
    """rl.ppo_epochs passes over the rollout batch, each in rl.minibatches shuffled mini-batches
    (deterministic in seed and step), one update each. Returns (state, metrics as floats, the
    trainer's log-probs of the batch before the first update).

    Losses and gradient norms are averaged over the updates, `finite` holds if every update was;
    the mismatch and agreement metrics are those of the parameters before the first update.
    guided=False: round to nearest even in a guided mode (guidance too old to steer).
    """
    grpo = self.run.grpo
    update, logprobs = (self.update, self.logprobs) if guided else (self.update_rtn, self.logprobs_rtn)
    if update is None:
      raise ValueError(
        "This RLStep has no round-to-nearest programs for stale guidance: build it (RLStep.build) from a run "
        "whose rl.max_version_diff covers the staleness of the batches it gets."
      )
    behaviour = None
    if grpo.minibatches > 1:  # later mini-batches see moved parameters: take every old log-prob first
      old_logp, behaviour = logprobs(state.params, batch)
      batch = dataclasses.replace(batch, old_logp=old_logp)
    updates, n = [], batch.inputs.shape[0]
    for epoch in range(grpo.ppo_epochs):
      rows = [None] if grpo.minibatches == 1 else rl.minibatch_rows(n, grpo.minibatches, self.run.job.seed, step, epoch)
      for r in rows:
        first = behaviour is None  # one batch: its first update's forward gives the old log-probs
        state, logp, m = update(state, batch if r is None else self.take_rows(batch, r), first=first)
        if first:
          behaviour = m
          batch = dataclasses.replace(batch, old_logp=logp)
        updates.append(m)
    behaviour, updates = jax.device_get((behaviour, updates))

    def combined(key):
      if key == "finite":
        return all(bool(m[key]) for m in updates)
      if key.startswith("loss/") or key == "grad_norm":
        return float(np.mean([float(m[key]) for m in updates]))
      return float(behaviour[key])

    return state, {key: combined(key) for key in updates[0]}, batch.old_logp

  def __call__(self, step: int, state: trainer.TrainState, prompts: data.PromptBatch):
    """Rollout, then rewards, advantages and updates; returns (state, metrics as floats)."""
    result, rollout_metrics = self.rollout(step, state.params, prompts)
    state, metrics = self.learn(step, state, prompts, result)
    return state, {**metrics, **rollout_metrics}

  def rollout(self, step: int, params, prompts: data.PromptBatch):
    """The engine's half: weight sync, then G samples per prompt on the rollout mesh.

    The engine records the full codes of the agreement diagnostics on `diagnostic_step`s only.
    Returns (RolloutResult on the rollout mesh, metrics: the bytes that crossed meshes, the time).
    """
    run, topology, G = self.run, self.topology, self.run.grpo.num_generations
    engine_config = run.mode.rollout
    if engine_config.record_codes and not diagnostic_step(run, step):
      engine_config = dataclasses.replace(engine_config, record_codes=False)
    host = (np.repeat(prompts.tokens, G, axis=0), np.repeat(prompts.mask, G, axis=0))
    prompt_tokens, prompt_mask = sharding.host_to_global(host, sharding.batch_shardings(host, topology.rollout))
    t0 = time.perf_counter()
    engine_params, sync_bytes = self.sync(params)
    result = cluster.make_generate(topology.rollout)(
      engine_params,
      prompt_tokens,
      prompt_mask,
      jax.random.fold_in(self.rollout_key, step),
      None,
      model_config=run.model,
      rollout_config=engine_config,
      sampling=run.sampling,
      expert_parallel=topology.rollout_expert_parallel,
    )
    jax.block_until_ready(result.tokens)
    return result, {"transfer/weight_sync_bytes": float(sync_bytes), "time/rollout_s": time.perf_counter() - t0}

  def learn(
    self, step: int, state: trainer.TrainState, prompts: data.PromptBatch, result, version=None, version_params=None
  ):
    """The trainer's half: rewards, advantages, the batch moved onto the trainer mesh (with the
    bytes that crossed), and the updates. Returns (state, metrics as floats).

    version: the policy version that generated `result` (async_rl; None = this step's own, the
    synchronous loop), with version_params its trainer parameters. Then the metrics also hold the
    staleness, and the train-rollout mismatch split into its quantization part (the trainer at the
    rollout's version vs the engine) and its staleness part (the trainer now vs at that version).
    Guidance more than rl.guidance_max_staleness versions old rounds to nearest (counted). The split
    costs one more forward per stale batch; rl.split_mismatch=False leaves it out.
    """
    run, topology, G = self.run, self.topology, self.run.grpo.num_generations
    staleness = 0 if version is None else step - version
    guided = staleness <= run.grpo.guidance_bound or not run.mode.guided
    answers = [a for a in prompts.answers for _ in range(G)]
    tokens = sharding.to_host(result.tokens)
    rewards, invalid = self.reward_fn(answers, tokens[:, prompts.tokens.shape[1] :])
    advantages = np.asarray(rl.group_advantages(jnp.asarray(rewards), G, run.grpo.normalize_std))
    batch, crossed = cluster.to_trainer(result, run.grpo.routing_replay, topology.trainer)
    advantages = sharding.host_to_global(advantages, sharding.batch_shardings(advantages, topology.trainer))
    batch = dataclasses.replace(batch, advantages=advantages)
    if self.reference is not None:
      batch = dataclasses.replace(batch, ref_logp=self.reference_logprobs(self.reference, batch))

    t0 = time.perf_counter()
    state, metrics, logp = self.optimize(step, state, batch, guided)
    t_train = time.perf_counter() - t0
    if version is not None and run.grpo.split_mismatch:
      metrics.update(self.staleness_metrics(staleness, guided, batch, logp, metrics, version_params))
    elif version is not None:
      metrics.update({"staleness/version_diff": float(staleness), "guidance/stale_dropped": float(not guided)})
    positions = sharding.to_host(measured_positions(batch))  # to the rollout mesh, where the codes are
    positions = sharding.host_to_global(positions, sharding.batch_shardings(positions, topology.rollout))
    floor = rl.scale_floor_fractions(result.codes, positions)
    metrics.update({k: float(v) for k, v in jax.device_get(floor).items()})

    response_mask = sharding.to_host(result.response_mask)
    metrics.update(
      {
        "reward/mean": float(rewards.mean()),
        "reward/accuracy": float(np.mean(rewards >= run.reward.correct_reward)),
        "response/length_mean": float(response_mask.sum(1).mean()),
        "response/invalid_frac": float(np.mean(invalid)),
        "guidance/bytes_per_token": float(result.guidance_bytes_per_token),
        **{
          f"guidance/bytes_per_token/{name}": float(n)
          for name, n in experience.guidance_bytes_per_token(result.guidance).items()
        },
        "transfer/rollout_to_trainer_bytes": float(crossed["rollout_to_trainer"]),
        "transfer/guidance_bytes": float(crossed["guidance"]),
        "time/train_s": t_train,
      }
    )
    return state, metrics

  def staleness_metrics(self, staleness: int, guided: bool, batch, logp, metrics: dict, version_params) -> dict:
    """The staleness of a batch and the two parts of its train-rollout mismatch (see `learn`).

    metrics: the trainer's behaviour metrics now (its forward before the first update, log-probs
    `logp`). The trainer at the rollout's version runs one more forward, unless staleness is 0.
    """
    if staleness == 0:
      at_version, logp_at_version = metrics, logp
    else:
      forward = self.logprobs if guided else self.logprobs_rtn
      logp_at_version, at_version = forward(version_params, batch)
      at_version = {k: float(v) for k, v in jax.device_get(at_version).items()}
    drift = {k: float(v) for k, v in jax.device_get(_mismatch(logp, logp_at_version, batch.loss_mask)).items()}
    out = {
      "staleness/version_diff": float(staleness),
      "guidance/stale_dropped": float(not guided),
      **{f"mismatch/staleness_part/{k.removeprefix('mismatch/')}": v for k, v in drift.items()},
    }
    for key, value in at_version.items():
      if key.startswith("mismatch/"):
        out[f"mismatch/quant_part/{key.removeprefix('mismatch/')}"] = value
      elif key.startswith(("agreement/", "bit_agreement/")):
        out[f"at_rollout_version/{key}"] = value
    return out


_mismatch = jax.jit(rl.mismatch_metrics)


def train_and_evaluate(cfg: ml_collections.ConfigDict, workdir: str) -> dict:
  """Run (or resume) the RL job described by `cfg` in `workdir`; returns the final summary.

  Devices come from `cfg.mesh` (trainer and rollout meshes, MoE dispatch) and, for several
  hosts, `cfg.distributed` or the JAX_* environment (sharding.initialize_distributed).
  """
  run = run_config(cfg)  # the model section from init_from's config.json
  sharding.initialize_distributed(**dataclasses.asdict(run.distributed))
  if run.grpo.max_version_diff and jax.process_count() > 1:
    raise ConfigError(
      f"rl.max_version_diff={run.grpo.max_version_diff} runs in one process only ({jax.process_count()} here): "
      "each host's producer thread and trainer would launch collectives in their own order. Use "
      "rl.max_version_diff=0 across hosts, or one process with several devices."
    )
  run, tokenizer, train_source, test_source = run_data(run)
  topology = cluster.Topology.from_config(run.mesh)
  job.check_workdir(cfg, workdir)
  job.write_json(os.path.join(workdir, "model.json"), dataclasses.asdict(run.model))  # export and evaluate read it
  _, rollout_key, eval_key = jax.random.split(jax.random.key(run.job.seed), 3)

  # The state: a checkpoint of this run, or the starting policy (a pretrained checkpoint or a fresh init, then
  # SFT), checkpointed as step 0. A resumed run never reads init_from again.
  optimizer = trainer.make_optimizer(run.optim, run.job.steps)
  target = trainer.abstract_state(run.model, optimizer, topology.trainer)
  ckpt = checkpoint.Checkpointer(workdir, max_to_keep=run.job.keep_checkpoints)
  # The KL anchor is the policy RL starts from; a resumed run's own parameters have moved on.
  reference_path = os.path.join(workdir, "reference_params")
  d = run.grpo.max_version_diff  # > 0: rollouts from a producer ahead of the trainer (async_rl.py)
  versioned = lambda state, past: async_rl.VersionedState(state, past) if d else state
  start, restored = ckpt.restore_latest(versioned(target, (target.params,) * d))
  state, past = (restored.state, restored.past_params) if d else (restored, ())
  if start is None:
    logging.info("Starting a new run in %s (mode %s).", workdir, run.mode.name)
    params = starting_policy(cfg, run, tokenizer, train_source, topology.trainer)
    state = trainer.fresh_state(params, optimizer, topology.trainer)
    if run.grpo.kl_coef > 0:  # before checkpoint 0, so that every resumable run has it
      checkpoint.save_tree(reference_path, state.params, force=True)
    past = (async_rl.copy_params(state.params),) * d  # the train step donates state.params
    ckpt.save(0, versioned(state, past), force=True)
    start = 0
  else:
    logging.info("Resuming %s from step %d.", workdir, start)
  reference = checkpoint.load_tree(reference_path, state.params) if run.grpo.kl_coef > 0 else None

  # The loop.
  batcher = data.PromptBatcher(
    train_source, tokenizer, run.job.batch_prompts, run.data.max_prompt_len, seed=run.job.seed
  )

  # (answers, responses) -> (rewards, invalid): the task's verifier; an undecodable response scores 0 and is counted.
  reward_fn = data.make_reward_fn(run.data.task, tokenizer, run.reward)

  rl_step = RLStep.build(run, topology, optimizer, reward_fn, rollout_key, reference)
  versions = async_rl.Versions(d)
  for version, params in zip(async_rl.past_versions(start, d), past):
    versions.publish(version, params)
  if d:
    versions.publish(start, async_rl.copy_params(state.params))
  evaluate_fp4 = lambda params: evaluate(
    params, run, run.mode.rollout.quant, tokenizer, test_source, eval_key, topology
  )
  writer = job.metric_writer(workdir, start_step=start + 1)
  steps = run.job.steps
  bar = tqdm(range(start, steps), initial=start, total=steps, desc=f"rl[{run.mode.name}]", disable=not job.is_lead())
  try:
    with job.Preempted() as preempted, contextlib.ExitStack() as stack:
      producer = None
      if d:
        producer = async_rl.Producer(
          rl_step.rollout,
          batcher.batch_at,
          versions,
          start=start,
          steps=steps,
          max_version_diff=d,
          staleness=run.grpo.staleness,
        )
        stack.enter_context(producer)
      for step in bar:
        t0 = time.perf_counter()
        if producer is None:
          state, metrics = rl_step(step, state, batcher.batch_at(step))
        else:
          r = producer.get(step)
          state, metrics = rl_step.learn(step, state, r.prompts, r.result, r.version, r.params)
          metrics.update(r.metrics)
          versions.publish(step + 1, async_rl.copy_params(state.params))
        metrics["time/step_s"] = time.perf_counter() - t0
        if not metrics["finite"]:
          raise FloatingPointError(
            f"Loss or gradients are not finite at step {step + 1}; the update was skipped and the run stopped. "
            f"The last good checkpoint is step {ckpt.steps()[-1]} in {ckpt.directory}."
          )
        if run.job.eval_every and (step + 1) % run.job.eval_every == 0:
          metrics["eval/accuracy"] = evaluate_fp4(state.params)
        writer.write(step + 1, metrics)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", dlogp=f"{metrics['mismatch/logp_diff_mean']:.4f}")
        if (step + 1) % run.job.checkpoint_every == 0 or step + 1 == steps or preempted.flag:
          ckpt.save(step + 1, versioned(state, versions.past(step + 1)), force=True)
        if preempted.flag:
          break
      finished = not preempted.flag
    ckpt.wait()
    if finished:  # the final policy, for transformers / vLLM (a preempted run exports when it finishes)
      try:
        export.write_hf(os.path.join(workdir, "hf"), run, state.params, tokenizer)
      except hf.HFCheckpointError as e:  # a model no Hugging Face architecture holds: the run stands
        logging.warning("The final policy was not exported as a Hugging Face checkpoint: %s", e)
    summary = final_summary(workdir, run, state, tokenizer, test_source, eval_key, topology)
  finally:
    writer.close()
    ckpt.close()
  return summary


def final_summary(workdir, run: RunConfig, state, tokenizer, test_source, eval_key, topology=None) -> dict:
  """Final-policy check (greedy accuracy with a BF16 and an FP4 engine) and the reward / mismatch
  trend, written to `<workdir>/summary.json`."""
  rows = read_metrics(workdir)
  accuracy = lambda quant: evaluate(state.params, run, quant, tokenizer, test_source, eval_key, topology)
  summary = {
    "mode": run.mode.name,
    "steps": int(state.step),
    "final/accuracy_bf16_engine": accuracy(None),
    "final/accuracy_fp4_engine": accuracy(run.quant),
  }
  if rows:
    k = max(1, len(rows) // 5)
    for key in ("reward/mean", "mismatch/logp_diff_mean", "mismatch/kl_k3"):
      values = [r[key] for r in rows if key in r]
      if values:
        summary[f"first_{k}/{key}"] = float(np.mean(values[:k]))
        summary[f"last_{k}/{key}"] = float(np.mean(values[-k:]))
  job.write_json(os.path.join(workdir, "summary.json"), summary)
  return summary
