"""The mode comparison of SPEC section 7 at our scale: same seeds, same budget per mode.

  python -m experiments.compare_modes --root=/tmp/modes --seeds=0,1,2 --out=docs/figures
  python -m experiments.compare_modes --modes=qat,trace --max_version_diff=0,2 --root=/tmp/async_modes

--max_version_diff=0,2 runs each mode synchronously and with rollouts up to 2 policy versions old
(rl.max_version_diff, exact staleness: trace_jax/async_rl.py); the table then also splits the
train-rollout mismatch into its quantization and staleness parts.

Runs every mode for every seed under <root> (finished runs are read back, not rerun), from one
SFT warm start per seed shared by all modes, and writes:
  <root>/table.{csv,json}   every metric's mean and std over seeds, per mode
  <out>/table.md            the mismatch / agreement / reward / guidance table
  <out>/final_policy.md     FP4-engine accuracy of each trained policy; for `bf16`, post-hoc PTQ
  <out>/curves.png, summary.png, final_policy.png
"""

from __future__ import annotations

import os

from absl import app, flags

from configs import default
from experiments import plotting, sweep
from experiments.sweep import final_policy_table  # noqa: F401 (compare_modes.final_policy_table, as before)
from trace_jax.config import MODES

_ROOT = flags.DEFINE_string("root", "/tmp/trace_modes", "Where the runs and the full table go.")
_OUT = flags.DEFINE_string("out", None, "Where the markdown tables and PNG figures go (default: --root).")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds per mode.")
_MODES = flags.DEFINE_list("modes", list(MODES), "Modes to compare.")
_STEPS = flags.DEFINE_integer("steps", None, "RL steps per run (default: the config's).")
_EVAL_PROMPTS = flags.DEFINE_integer("eval_prompts", 512, "Test prompts for the final greedy accuracy.")
_PROCESSES = flags.DEFINE_bool("processes", False, "Run each mode in its own process.")
_MODEL = flags.DEFINE_string("model", "tiny", "A preset of configs/models.py (e.g. tiny_hybrid: the Qwen3.5 hybrid).")
_MAX_VERSION_DIFF = flags.DEFINE_list(
  "max_version_diff", ["0"], "rl.max_version_diff values to run each mode with (0 = synchronous)."
)

# The metrics of the comparison (sweep.extract keys), in table order, with their column headers.
HEADERS = {
  "last:mismatch/logp_diff_mean": "late \\|logp_train - logp_rollout\\|",
  "last:mismatch/kl_k3": "late k3 KL",
  "last:agreement/deep": "codeword agreement, deeper half",
  "last:agreement/shallow": "codeword agreement, shallower half",
  "last:routing_agreement": "routing agreement",
  "last:guidance/bytes_per_token": "guidance B/token",
  "last:reward/mean": "late reward",
  "final/accuracy_bf16_engine": "final acc., BF16 engine",
  "final/accuracy_fp4_engine": "final acc., FP4 engine",
}
METRICS = tuple(HEADERS)
# With asynchronous runs: the staleness and the two parts of the mismatch (trace_jax/train.py, RLStep.learn).
ASYNC_HEADERS = {
  "last:staleness/version_diff": "late staleness (versions)",
  "last:mismatch/quant_part/logp_diff_mean": "late \\|dlogp\\|, quantization part",
  "last:mismatch/staleness_part/logp_diff_mean": "late \\|dlogp\\|, staleness part",
  "last:at_rollout_version/agreement/deep": "codeword agreement, deeper half, at the rollout's version",
}


def compare(
  base,
  *,
  root: str,
  out: str | None = None,
  seeds=(0, 1, 2),
  modes=MODES,
  processes: bool = False,
  max_version_diffs=(0,),
) -> list[dict]:
  """Run (or read back) every mode x seed of `base` (x rl.max_version_diff when more than 0 is given);
  write the tables and figures; return the rows."""
  out = out or root
  # every mode of a seed starts from the same SFT policy
  base = sweep.configure(base, {"sft.cache_dir": os.path.join(root, "sft_cache")})
  grid, keys, headers = {"mode": list(modes)}, ["mode"], dict(HEADERS)
  if list(max_version_diffs) != [0]:
    grid["rl.max_version_diff"] = [int(d) for d in max_version_diffs]
    keys.append("rl.max_version_diff")
    headers.update(ASYNC_HEADERS)
  metrics = tuple(headers)
  rows = sweep.sweep(base, grid, root=root, seeds=list(seeds), processes=processes, metrics=metrics)
  sweep.write_table(rows, os.path.join(root, "table"))
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "table.md"), "w") as f:
    f.write(sweep.markdown(rows, metrics, keys, headers=headers) + "\n")
  with open(os.path.join(out, "final_policy.md"), "w") as f:
    f.write(sweep.final_policy_table(rows) + "\n")
  plotting.mode_comparison_figures(rows, out, label="mode" if len(keys) == 1 else "name")
  return rows


def main(argv):
  del argv
  base = default.get_config(f"trace,model={_MODEL.value}")
  if _STEPS.value is not None:
    base.steps = _STEPS.value
  base.eval_prompts = _EVAL_PROMPTS.value
  out = _OUT.value or _ROOT.value
  compare(
    base,
    root=_ROOT.value,
    out=out,
    seeds=[int(s) for s in _SEEDS.value],
    modes=_MODES.value,
    processes=_PROCESSES.value,
    max_version_diffs=[int(d) for d in _MAX_VERSION_DIFF.value],
  )
  for name in ("table.md", "final_policy.md"):
    with open(os.path.join(out, name)) as f:
      print(f.read())


if __name__ == "__main__":
  app.run(main)
