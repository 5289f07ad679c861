"""A run's policy as a Hugging Face checkpoint: what transformers, vLLM and SGLang load.

Every run writes its final policy to WORKDIR/hf/ (train.py); a checkpoint of any step exports with

  python -m trace_jax.export --workdir=W --out=DIR [--step=N]

The folder holds config.json (the init_from checkpoint's own, when the run started from one, so
that fields this project does not model, e.g. rope_scaling, survive), bf16 safetensors sharded at
5 GB with model.safetensors.index.json, generation_config.json, and the tokenizer files of the
run's tokenizer folder. A bf16 checkpoint exported after `steps=0` is bit-exact: the trainer's fp32
master weights hold bf16 values exactly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import sys

from absl import app, flags, logging

from trace_jax import checkpoint, cluster, hf, job, sharding, trainer
from trace_jax.config import ConfigError, RunConfig

SHARD_BYTES = 5 * 10**9  # as transformers' save_pretrained (max_shard_size="5GB")
TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "chat_template.jinja",
  "vocab.json",
  "merges.txt",
  "tokenizer.model",
  "added_tokens.json",
)


def tokenizer_folder(run: RunConfig) -> str:
  """The folder whose tokenizer files the export copies ('' for the tasks' character tokenizers)."""
  spec = run.data.tokenizer or run.job.init_from
  if spec and not os.path.isdir(spec):
    spec = os.path.dirname(spec)  # data.tokenizer names a tokenizer.json
  return spec


def write_hf(out: str | os.PathLike, run: RunConfig, params, tokenizer=None) -> pathlib.Path:
  """Write `params` (trainer parameters, on any mesh) as a Hugging Face checkpoint folder `out`.

  Every process takes part in gathering the parameters; the lead process writes. The folder is
  written beside `out` and moved into place, so a crash never leaves half an export under its name.
  """
  out = pathlib.Path(out)
  source = run.job.init_from
  architecture = hf.architecture_of(json.loads((pathlib.Path(source) / "config.json").read_text())) if source else None
  host = sharding.to_host(params)
  if not job.is_lead():
    return out
  partial = out.with_name(out.name + ".partial")
  shutil.rmtree(partial, ignore_errors=True)
  hf.save_pretrained(partial, run.model, host, architecture=architecture, dtype="bfloat16", max_shard_bytes=SHARD_BYTES)
  if source:  # its own config.json describes this model, with the fields ours does not hold
    config = json.loads((pathlib.Path(source) / "config.json").read_text())
    config.update(torch_dtype="bfloat16", dtype="bfloat16")
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  generation = pathlib.Path(source) / "generation_config.json" if source else None
  if generation is not None and generation.exists():
    shutil.copy(generation, partial / "generation_config.json")
  else:
    ids = dict(eos_token_id=run.sampling.eos_id, pad_token_id=run.sampling.pad_id)
    if tokenizer is not None and tokenizer.bos_id is not None:
      ids["bos_token_id"] = tokenizer.bos_id
    (partial / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
  folder = tokenizer_folder(run)
  for name in TOKENIZER_FILES if folder else ():
    if os.path.isfile(os.path.join(folder, name)):
      shutil.copy(os.path.join(folder, name), partial / name)
  shutil.rmtree(out, ignore_errors=True)
  os.replace(partial, out)
  logging.info("Exported the policy as a Hugging Face checkpoint: %s", out)
  return out


def saved_run(workdir: str) -> RunConfig:
  """The RunConfig of the run in `workdir`, from its config.json and model.json (so that a run
  started from init_from exports and evaluates even after that folder has moved)."""
  import ml_collections  # noqa: PLC0415

  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise ConfigError(f"--workdir {workdir} holds no run (no config.json); pass the --workdir of a trace_jax.main run.")
  with open(path) as f:
    cfg = ml_collections.ConfigDict(json.load(f))
  model = os.path.join(workdir, "model.json")
  if os.path.exists(model):
    with open(model) as f:
      cfg.model = json.load(f)
    cfg.init_from = ""
  run = RunConfig.from_config(cfg)
  with open(path) as f:
    init_from = json.load(f).get("init_from", "")
  return dataclasses.replace(run, job=dataclasses.replace(run.job, init_from=init_from))


def restore_params(workdir: str, run: RunConfig, step: int | None = None, mesh=None):
  """(step, trainer parameters) of the checkpoint at `step` (None: the newest) of the run in `workdir`."""
  mesh = mesh or cluster.Topology.from_config(run.mesh).trainer
  optimizer = trainer.make_optimizer(run.optim, run.job.steps)
  target = trainer.abstract_state(run.model, optimizer, mesh)
  ckpt = checkpoint.Checkpointer(workdir, max_to_keep=run.job.keep_checkpoints)
  try:
    steps = ckpt.steps()
    if not steps:
      raise checkpoint.CheckpointError(f"{ckpt.directory}: no checkpoints.")
    if step is not None and step not in steps:
      raise checkpoint.CheckpointError(f"{ckpt.directory}: no checkpoint of step {step}; it holds steps {steps}.")
    if run.grpo.max_version_diff:
      from trace_jax import async_rl  # noqa: PLC0415

      target = async_rl.VersionedState(target, (target.params,) * run.grpo.max_version_diff)
    state = ckpt.restore(steps[-1] if step is None else step, target)
  finally:
    ckpt.close()
  state = state.state if run.grpo.max_version_diff else state
  return int(state.step), state.params


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    run = saved_run(f.workdir)
    step, params = restore_params(f.workdir, run, f.step)
    write_hf(f.out, run, params)
  except (ConfigError, checkpoint.CheckpointError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(json.dumps({"workdir": f.workdir, "step": step, "out": f.out}))


if __name__ == "__main__":  # the flags are this command's own: train.py imports the module
  flags.DEFINE_string("workdir", None, "The trace_jax.main run to export.")
  flags.DEFINE_string("out", None, "The Hugging Face folder to write.")
  flags.DEFINE_integer("step", None, "The checkpoint's step (default: the newest).")
  flags.mark_flags_as_required(["workdir", "out"])
  app.run(main)
