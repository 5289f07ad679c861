"""Job plumbing around the RL loop: the workdir, the SFT cache, preemption, metrics and the summary file.

None of it changes what is computed; train.py calls it so that its loop reads top to bottom.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal

import jax
import ml_collections
from absl import logging

from trace_jax.config import ConfigError
from trace_jax.metrics_writer import MetricWriter

# Fields a rerun in the same workdir may change (how long and how often, on which devices), not
# what is computed: a checkpoint restores onto another mesh.
RESUMABLE_FIELDS = ("steps", "checkpoint_every", "eval_every", "log_every", "mesh", "distributed")


def is_lead() -> bool:
  """The one process (of several hosts) that writes metrics, summaries and config files."""
  return jax.process_index() == 0


def write_json(path: str, obj) -> None:
  """Atomically, from the lead process: other processes, and a crash, never see half a file."""
  if not is_lead():
    return
  with open(path + ".tmp", "w") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
  os.replace(path + ".tmp", path)


def check_workdir(cfg: ml_collections.ConfigDict, workdir: str) -> None:
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
  write_json(path, current)


def sft_cache_path(cfg: ml_collections.ConfigDict) -> str:
  """Where cached SFT parameters live ('' = no cache): keyed by everything that determines them."""
  if not cfg.sft.cache_dir:
    return ""
  keyed = {k: json.loads(cfg[k].to_json_best_effort()) for k in ("model", "sft", "data", "rollout")}
  keyed["sft"].pop("cache_dir")
  sft_seed = keyed["sft"].pop("seed", -1)
  keyed["seed"] = cfg.seed if sft_seed < 0 else sft_seed  # runs of other seeds from one warm start share it
  if cfg.get("init_from"):  # SFT from a pretrained checkpoint: keyed by the checkpoint too
    keyed["init_from"] = os.path.abspath(cfg.init_from)
  digest = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]
  return os.path.join(cfg.sft.cache_dir, f"sft-{digest}")


class _NoWriter:
  """The metric writer of processes other than the first."""

  def write(self, step, metrics):
    pass

  def close(self):
    pass


def metric_writer(workdir: str, start_step: int):
  """JSONL + TensorBoard on the lead process; a no-op elsewhere."""
  return MetricWriter(workdir, start_step=start_step) if is_lead() else _NoWriter()


class Preempted:
  """SIGTERM sets a flag; the loop checkpoints after the current step and exits cleanly.

  A context manager: the previous handler is restored on exit.
  """

  def __init__(self):
    self.flag = False

  def __enter__(self):
    self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def __exit__(self, *exc):
    signal.signal(signal.SIGTERM, self._previous)

  def _handle(self, signum, frame):
    logging.warning("SIGTERM: saving a checkpoint after this step, then exiting.")
    self.flag = True
