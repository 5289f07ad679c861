"""Evaluate a policy on a problem file with the BF16 or the FP4 engine: greedy accuracy, pass@k, mean@k.

  python -m trace_jax.evaluate --workdir=W [--step=N] --data=test.jsonl --engine=fp4 --k=8 --temperature=1.0
  python -m trace_jax.evaluate --hf=/models/Qwen3-30B-A3B --data=math500.jsonl --engine=bf16 --k=16

--workdir: a trace_jax.main run (its newest checkpoint, or --step's) with the run's own settings
(task, verifier, lengths, FP4 format, mesh); --hf: a Hugging Face model folder with
configs/hf_math.py's settings (the math task and verifier), loaded into the trainer's shardings.
--data: JSONL or Parquet problems (default: the run's test set). It reports, over the problems:

  greedy/accuracy          one greedy response each
  pass@j (j = 1, 2, 4 .. k) the unbiased estimator from k samples at --temperature (Chen et al. 2021)
  mean@k                   the mean reward-1 rate of those samples
  response/length_mean, response/truncated_frac   over the samples (no EOS within max_new_tokens)

and writes them to OUT/results.json, OUT/metrics.jsonl and TensorBoard (OUT/tensorboard, at the
checkpoint's step), with every prompt, response and reward in OUT/samples.jsonl. OUT defaults
to WORKDIR/eval/step_N (or ./eval/<folder name> for --hf).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import jax
import numpy as np
from absl import app, flags, logging
from tqdm import tqdm

from trace_jax import checkpoint, cluster, data, export, hf, job, train
from trace_jax.config import ConfigError, RunConfig
from trace_jax.metrics_writer import MetricWriter


def pass_at_k(n: int, c: int, k: int) -> float:
  """The unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def ks(k: int) -> list[int]:
  """1, 2, 4, ... up to k, and k."""
  return sorted({2**i for i in range(int(math.log2(k)) + 1)} | {k})


def _text(tokenizer, ids: np.ndarray, eos_id: int) -> str:
  """A response's text, up to its EOS."""
  end = np.flatnonzero(ids == eos_id)
  return tokenizer.decode(ids[: end[0]] if end.size else ids)


def evaluate_policy(
  params,
  run: RunConfig,
  tokenizer,
  source,
  *,
  engine: str = "fp4",
  k: int = 8,
  temperature: float = 1.0,
  batch_prompts: int = 32,
  seed: int = 0,
  topology=None,
  samples_path: str | None = None,
) -> dict[str, float]:
  """The figures of the module docstring for trainer `params` on every problem of `source`."""
  if engine not in ("bf16", "fp4"):
    raise ConfigError(f"--engine: must be 'bf16' or 'fp4', got {engine!r}.")
  if k < 1 or not temperature > 0:
    raise ConfigError(f"--k must be >= 1 and --temperature > 0 (got {k}, {temperature}); greedy is always reported.")
  topology = topology or cluster.Topology.single_device()
  n = len(source)
  batch_prompts = min(batch_prompts, n)
  engine_state = train.engine_for(params, run, run.quant if engine == "fp4" else None, topology)
  sampling = dataclasses.replace(run.sampling, temperature=temperature)
  reward = train.correct_only(run)
  batcher = data.PromptBatcher(source, tokenizer, batch_prompts, run.data.max_prompt_len, seed=0, shuffle=False)
  key = jax.random.key(seed)
  greedy, sampled, lengths, truncated = [], [], [], []
  out = open(samples_path, "w") if samples_path and job.is_lead() else None  # noqa: SIM115 (closed below)
  try:
    for i in tqdm(range(math.ceil(n / batch_prompts)), desc=f"evaluate[{engine}]", disable=not job.is_lead()):
      b = batcher.batch_at(i)
      rows = min(batch_prompts, n - i * batch_prompts)  # the last batch wraps around: its tail is not new
      g, _ = train.respond(engine_state, run, b, jax.random.fold_in(key, 2 * i), topology)
      s, ended = train.respond(engine_state, run, b, jax.random.fold_in(key, 2 * i + 1), topology, sampling, k)
      g_reward = data.batch_rewards(b.answers, g, tokenizer, reward)
      s_reward = data.batch_rewards([a for a in b.answers for _ in range(k)], s, tokenizer, reward).reshape(-1, k)
      length = (np.cumsum(s == run.sampling.eos_id, axis=1) == 0).sum(1) + ended  # tokens up to and with EOS
      greedy.extend(g_reward[:rows])
      sampled.extend(s_reward[:rows])
      lengths.extend(length[: rows * k])
      truncated.extend(~ended[: rows * k])
      decode = lambda ids: _text(tokenizer, ids, run.sampling.eos_id)
      for r in range(rows if out else 0):
        record = dict(
          index=int(b.indices[r]),
          prompt=b.prompts[r],
          answer=b.answers[r],
          greedy=dict(response=decode(g[r]), reward=float(g_reward[r])),
          samples=[dict(response=decode(s[r * k + j]), reward=float(s_reward[r, j])) for j in range(k)],
        )
        out.write(json.dumps(record) + "\n")
  finally:
    if out:
      out.close()
  sampled = np.asarray(sampled)
  correct = (sampled >= 1.0).sum(1)
  figures = {"greedy/accuracy": float(np.mean(np.asarray(greedy) >= 1.0)), f"mean@{k}": float(sampled.mean())}
  for j in ks(k):
    figures[f"pass@{j}"] = float(np.mean([pass_at_k(k, int(c), j) for c in correct]))
  figures["response/length_mean"] = float(np.mean(lengths))
  figures["response/truncated_frac"] = float(np.mean(truncated))
  figures["problems"] = float(n)
  return figures


def _run_and_params(workdir: str, hf_dir: str, step: int | None, data_file: str):
  """(RunConfig, step, trainer params, tokenizer, problems) for --workdir or --hf."""
  if bool(workdir) == bool(hf_dir):
    raise ConfigError("pass one of --workdir (a trace_jax.main run) and --hf (a Hugging Face model folder).")
  if workdir:
    run = export.saved_run(workdir)
  else:
    from configs import hf_math  # noqa: PLC0415

    run = RunConfig.from_config(hf.with_pretrained_model(hf_math.get_config(f"bf16,init_from={hf_dir}")))
  if data_file:
    run = dataclasses.replace(run, data=dataclasses.replace(run.data, jsonl_train=data_file, jsonl_test=""))
  tokenizer, train_source, test_source = train.load_data(run.data, run.sampling.max_new_tokens, run.job.init_from)
  source = train_source if data_file else test_source
  run = run.with_tokenizer(tokenizer)
  topology = cluster.Topology.from_config(run.mesh)
  if workdir:
    step, params = export.restore_params(workdir, run, step, topology.trainer)
  else:
    step, params = 0, hf.load_sharded(hf_dir, topology.trainer)[1]
  return run, step, params, tokenizer, source, topology


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    run, step, params, tokenizer, source, topology = _run_and_params(f.workdir, f.hf, f.step, f.data)
    if f.max_new_tokens:
      run = dataclasses.replace(run, sampling=dataclasses.replace(run.sampling, max_new_tokens=f.max_new_tokens))
    out = f.out or (
      os.path.join(f.workdir, "eval", f"step_{step}") if f.workdir else os.path.join("eval", os.path.basename(f.hf))
    )
    os.makedirs(out, exist_ok=True)
    options = {name: getattr(f, name) for name in ("engine", "k", "temperature", "batch_prompts", "seed")}
    samples = os.path.join(out, "samples.jsonl")
    figures = evaluate_policy(params, run, tokenizer, source, topology=topology, samples_path=samples, **options)
  except (ConfigError, checkpoint.CheckpointError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  figures = {f"eval_{f.engine}/{key}": value for key, value in figures.items()}
  writer = MetricWriter(out, start_step=step) if job.is_lead() else None
  if writer:
    writer.write(step, {key.replace("@", "_at_"): value for key, value in figures.items()})  # TensorBoard names
    writer.close()
  job.write_json(os.path.join(out, "results.json"), {"step": step, **figures})
  logging.info("Evaluation written to %s", out)
  print(json.dumps({"step": step, "out": out, **figures}, indent=2))


if __name__ == "__main__":  # the flags are this command's own
  flags.DEFINE_string("workdir", "", "A trace_jax.main run to evaluate (its newest checkpoint, or --step's).")
  flags.DEFINE_string("hf", "", "A Hugging Face model folder to evaluate instead.")
  flags.DEFINE_integer("step", None, "The checkpoint's step (default: the newest).")
  flags.DEFINE_string("data", "", "JSONL or Parquet problems (default: the run's test set).")
  flags.DEFINE_enum("engine", "fp4", ["bf16", "fp4"], "The rollout engine: BF16 or the run's FP4 format.")
  flags.DEFINE_integer("k", 8, "Samples per problem for pass@k and mean@k.")
  flags.DEFINE_float("temperature", 1.0, "The samples' temperature.")
  flags.DEFINE_integer("max_new_tokens", 0, "Response length (default: the run's rollout.max_new_tokens).")
  flags.DEFINE_integer("batch_prompts", 32, "Problems per engine call (x k samples).")
  flags.DEFINE_integer("seed", 0, "The samples' seed.")
  flags.DEFINE_string("out", "", "Where to write (default: WORKDIR/eval/step_N, or ./eval/NAME for --hf).")
  app.run(main)
