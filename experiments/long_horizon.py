"""The long-horizon comparison of issue 16: every mode on the running-sum task, same config and seeds.

  python -m experiments.long_horizon --root=/tmp/long --seeds=0,1,2 --out=docs/figures/long_horizon
  python -m experiments.long_horizon --sft_seed=0 ...  # every RL seed from seed 0's warm start
  python -m experiments.long_horizon --terms=64 --steps=150 ...   # longer responses, more steps
  python -m experiments.long_horizon --smoke --root=/tmp/long_smoke  # a tiny model, 2 steps, 1 seed

The settings (every one from the same SFT warm start per seed, the same config otherwise):
  bf16             BF16 rollouts and trainer (the reference)
  fp4              FP4 rollouts, BF16 trainer, TIS (cap 5)
  fp4, no TIS      FP4 rollouts, BF16 trainer, rl.tis_cap=0
  qat              FP4 rollouts, W4A4 QAT trainer rounding to nearest
  qat_w4a16        FP4 rollouts, weight-only QAT trainer (the trainer side of QUADS)
  trace            FP4 rollouts, QAT trainer guided by the rollout's codes
The base is configs/long_horizon.py (task=long: every response writes `terms` partial sums, so a
response is terms * (digits + 1) tokens). Written under --out:
  table.md            reward, held-out accuracy, mismatch (token and sequence level), agreement, per setting
  final_policy.md     each trained policy, greedy, with an FP4 and a BF16 engine; bf16: post-hoc PTQ
  mismatch_by_length.md  how the sequence-level log-ratio grows with the response length, its power
                      law and the length at which half the sequences' ratios would leave [0.5, 2]
  curves.png, summary.png, final_policy.png, mismatch_by_position.png
Finished runs are read back, not rerun.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from configs import default, long_horizon
from experiments import plotting, sweep

SETTINGS = {
  "bf16": {"mode": "bf16"},
  "fp4": {"mode": "fp4"},
  "fp4_no_tis": {"mode": "fp4", "rl.tis_cap": 0.0},
  "qat": {"mode": "qat"},
  "qat_w4a16": {"mode": "qat_w4a16"},
  "trace": {"mode": "trace"},
}
HEADERS = {
  "last:reward/mean": "late reward",
  "last:eval/accuracy": "late held-out acc. (its rollout engine)",
  "final/accuracy_fp4_engine": "final acc., FP4 engine",
  "final/accuracy_bf16_engine": "final acc., BF16 engine",
  "last:response/length_mean": "response tokens",
  "last:mismatch/logp_diff_mean": "late \\|dlogp\\|",
  "last:mismatch/seq_log_ratio_abs_mean": "late \\|sequence log-ratio\\|",
  "last:mismatch/seq_ratio_outside_0.5_2": "sequences with ratio outside [0.5, 2]",
  "last:agreement/deep": "codeword agreement, deeper half",
  "last:routing_agreement": "routing agreement",
  "last:guidance/bytes_per_token": "guidance B/token",
}
SMOKE = {  # configs/default.py's smallest run, 2 steps
  **default.SMOKE,
  "steps": 2,
  "checkpoint_every": 2,
  "eval_every": 2,
  "eval_prompts": 8,
  "data.num_train": 200,
  "data.num_test": 20,
}


def compare(
  base, *, root: str, out: str | None = None, seeds=(0, 1, 2), settings=tuple(SETTINGS), processes=False, sft_seed=-1
):
  """Run (or read back) every setting x seed from one SFT warm start per seed (sft_seed >= 0: one
  warm start, of that seed, for every seed); write the tables and figures under `out`; return the
  sweep rows."""
  out = out or root
  base = sweep.configure(base, {"sft.cache_dir": os.path.join(root, "sft_cache"), "sft.seed": sft_seed})
  grid = [SETTINGS[s] for s in settings]
  metrics = tuple(HEADERS)
  rows = sweep.sweep(base, grid, root=root, seeds=list(seeds), processes=processes, metrics=metrics)
  sweep.write_table(rows, os.path.join(root, "table"))
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "table.md"), "w") as f:
    f.write(sweep.markdown(rows, metrics, ["name"], headers=HEADERS) + "\n")
  with open(os.path.join(out, "final_policy.md"), "w") as f:
    f.write(sweep.final_policy_table(rows) + "\n")
  plotting.mode_comparison_figures(rows, out, label="name")
  plotting.mismatch_by_position_figure(rows, out, label="name")
  scaling = length_scaling(rows)
  with open(os.path.join(out, "mismatch_by_length.md"), "w") as f:
    f.write(length_markdown(scaling) + "\n")
  with open(os.path.join(root, "mismatch_by_length.json"), "w") as f:
    json.dump(scaling, f, indent=1)
  return rows


LENGTH_PREFIX = "mismatch/by_length/"
# |s| of a zero-mean normal s is sigma * sqrt(2 / pi) on average, and half of such s lie beyond
# 0.6745 sigma: half the sequences have |s| > log 2 once sigma = log 2 / 0.6745, i.e. once the
# mean |s| reaches this.
HALF_OUTSIDE_ABS_MEAN = np.log(2.0) / 0.6745 * np.sqrt(2.0 / np.pi)


def length_scaling(rows, label="name", fraction: float = 0.2) -> list[dict]:
  """Per row (setting): the late mean |sequence log-ratio| s_L over the first L tokens for each L
  (rl.position_mismatch_metrics' by_length keys), its power law |s_L| ~ L**alpha (least squares in
  log-log over the seeds' means; 0.5: independent per-token errors that partly cancel, 1: a
  systematic bias), the share of sequences whose ratio over the longest L leaves [0.5, 2], and the
  length at which, extrapolated along that power law with s zero-mean normal, half of them would
  (HALF_OUTSIDE_ABS_MEAN). Rows without the metrics are left out."""
  out = []
  for row in rows:
    abs_mean = plotting.late_by_position(row["workdirs"], "log_ratio_abs_mean", prefix=LENGTH_PREFIX, fraction=fraction)
    outside = plotting.late_by_position(row["workdirs"], "ratio_outside_0.5_2", prefix=LENGTH_PREFIX, fraction=fraction)
    if len(abs_mean) < 2:
      continue
    lengths = np.array(sorted(abs_mean), np.float64)
    means = np.array([np.mean(abs_mean[n]) for n in sorted(abs_mean)])
    alpha, log_c = np.polyfit(np.log(lengths), np.log(means), 1)
    half = np.exp((np.log(HALF_OUTSIDE_ABS_MEAN) - log_c) / alpha) if alpha > 0 else float("inf")
    longest = int(lengths[-1])
    out.append(
      {
        "setting": plotting.label_of(row, label),
        "abs_log_ratio": {int(n): float(m) for n, m in zip(lengths, means)},
        "outside_at_longest": float(np.mean(outside.get(longest, [np.nan]))),
        "longest": longest,
        "alpha": float(alpha),
        "half_outside_length": float(half),
      }
    )
  return out


def length_markdown(scaling: list[dict]) -> str:
  """length_scaling's rows as a markdown table."""
  if not scaling:
    return ""
  lengths = sorted({n for s in scaling for n in s["abs_log_ratio"]})
  head = [
    "setting",
    *(f"\\|s\\| over {n}" for n in lengths),
    f"ratio outside [0.5, 2] over {lengths[-1]}",
    "alpha in \\|s\\| ~ L^alpha",
    "L where half leave [0.5, 2] (extrapolated)",
  ]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for s in scaling:
    cells = [
      s["setting"],
      *(f"{s['abs_log_ratio'].get(n, float('nan')):.3g}" for n in lengths),
      f"{s['outside_at_longest']:.3f}",
      f"{s['alpha']:.2f}",
      f"{s['half_outside_length']:.3g}",
    ]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def base_config(terms: int, digits: int, smoke: bool = False):
  base = long_horizon.get_config(f"trace,terms={terms},digits={digits}")
  return sweep.configure(base, SMOKE) if smoke else base


def parse(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--root", default="/tmp/long_horizon", help="where the runs and the full table go")
  p.add_argument("--out", default=None, help="where the markdown tables and PNG figures go (default: --root)")
  p.add_argument("--seeds", default="0,1,2", help="seeds per setting")
  p.add_argument("--terms", type=int, default=long_horizon.DEFAULT_TERMS, help="running-sum terms (response length)")
  p.add_argument("--digits", type=int, default=long_horizon.DEFAULT_DIGITS, help="digits per term (work per step)")
  p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the config's)")
  p.add_argument("--eval_prompts", type=int, default=256, help="test prompts for the final greedy accuracy")
  p.add_argument("--settings", default=",".join(SETTINGS), help=f"a subset of {list(SETTINGS)}")
  p.add_argument("--processes", action="store_true", help="run each setting in its own process")
  p.add_argument(
    "--sft_seed",
    type=int,
    default=-1,
    help="every seed's RL from the SFT warm start of this seed (-1: each seed its own warm start)",
  )
  p.add_argument("--smoke", action="store_true", help="a tiny model, 2 RL steps, 1 seed, 4 terms: the plumbing")
  return p.parse_args(argv)


def main(args: argparse.Namespace) -> list[dict]:
  base = base_config(4 if args.smoke else args.terms, args.digits, args.smoke)
  if args.steps is not None:
    base.steps = args.steps
  if not args.smoke:
    base.eval_prompts = args.eval_prompts
  out = args.out or args.root
  seeds = [0] if args.smoke else [int(s) for s in args.seeds.split(",")]
  settings = [s.strip() for s in args.settings.split(",") if s.strip()]
  unknown = sorted(set(settings) - set(SETTINGS))
  if unknown:
    raise SystemExit(f"--settings: unknown {unknown}; expected some of {list(SETTINGS)}.")
  rows = compare(
    base, root=args.root, out=out, seeds=seeds, settings=settings, processes=args.processes, sft_seed=args.sft_seed
  )
  for name in ("table.md", "final_policy.md", "mismatch_by_length.md"):
    with open(os.path.join(out, name)) as f:
      print(f.read())
  return rows


if __name__ == "__main__":
  main(parse())
