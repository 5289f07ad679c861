"""The mode comparison of SPEC section 7 at our scale: same seed(s), same budget per mode.

  python -m experiments.compare_modes --root=/tmp/modes [--seeds=0,1,2] [--steps=40] [--modes=...]

Prints a markdown table (mismatch, codeword and routing agreement, guidance bytes, reward and
the final-policy check with a BF16 and an FP4 engine) and writes <root>/table.{csv,json,md}.
"""

from __future__ import annotations

import os

from absl import app, flags

from configs import default
from experiments import sweep

_ROOT = flags.DEFINE_string("root", "/tmp/trace_modes", "Where the runs and the table go.")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds per mode.")
_MODES = flags.DEFINE_list("modes", ["bf16", "fp4", "qat", "quads", "trace", "trace_full"], "Modes to compare.")
_STEPS = flags.DEFINE_integer("steps", None, "RL steps per run (default: the config's).")
_PROCESSES = flags.DEFINE_bool("processes", False, "Run each mode in its own process.")

METRICS = (
  "last:mismatch/logp_diff_mean",
  "last:mismatch/kl_k3",
  "last:agreement/deep",
  "last:agreement/shallow",
  "last:routing_agreement",
  "last:guidance/bytes_per_token",
  "last:reward/mean",
  "final/accuracy_bf16_engine",
  "final/accuracy_fp4_engine",
)


def main(argv):
  del argv
  base = default.get_config()
  if _STEPS.value is not None:
    base.steps = _STEPS.value
  base.sft.cache_dir = os.path.join(_ROOT.value, "sft_cache")  # every mode starts from the same SFT policy
  rows = sweep.sweep(
    base,
    {"mode": _MODES.value},
    root=_ROOT.value,
    seeds=[int(s) for s in _SEEDS.value],
    processes=_PROCESSES.value,
    metrics=METRICS,
  )
  sweep.write_table(rows, os.path.join(_ROOT.value, "table"))
  table = sweep.markdown(rows, METRICS, ["mode"])
  with open(os.path.join(_ROOT.value, "table.md"), "w") as f:
    f.write(table + "\n")
  print(table)


if __name__ == "__main__":
  app.run(main)
