"""Entry point: python -m trace_jax.main --config=configs/default.py --workdir=DIR [--config.mode=trace].

Runs (or resumes, with the same --workdir) the GRPO job the config describes, writing
metrics (metrics.jsonl, TensorBoard) and orbax checkpoints to --workdir.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from trace_jax import train
from trace_jax.checkpoint import CheckpointError
from trace_jax.config import ConfigError
from trace_jax.console import setup_logging

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a get_config() file, optionally file.py:arg.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics; rerun to resume.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  setup_logging(_WORKDIR.value)  # our messages and warnings above the progress bars; all in <workdir>/log.txt
  try:
    summary = train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except (ConfigError, CheckpointError, FloatingPointError) as e:
    logging.error("%s", e)
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(json.dumps(summary, indent=2))


if __name__ == "__main__":
  app.run(main)
