"""Run metrics to `<workdir>/metrics.jsonl` and TensorBoard event files (no TensorFlow)."""

from __future__ import annotations

import json
import math
import os

import numpy as np
from tensorboardX import SummaryWriter


def _plain(value):
  value = np.asarray(value)
  return value.item() if value.size == 1 else value.tolist()


class MetricWriter:
  """Appends one JSON line per step and the same scalars to TensorBoard.

  On resume (`start_step` > 0) lines from steps >= start_step are dropped first, so a run
  that was interrupted and resumed leaves the same JSONL as one that was not.
  """

  def __init__(self, workdir: str, start_step: int = 0):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(self.path):
      with open(self.path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] < start_step]
      with open(self.path, "w") as f:
        f.writelines(kept)
    self._jsonl = open(self.path, "a")  # noqa: SIM115 (held open for the run)
    self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=start_step or None)

  def write(self, step: int, metrics: dict) -> None:
    row = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
    self._jsonl.write(json.dumps(row, allow_nan=True) + "\n")
    self._jsonl.flush()
    for key, value in row.items():
      if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
        self._tb.add_scalar(key, value, step)

  def close(self) -> None:
    self._jsonl.close()
    self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]
