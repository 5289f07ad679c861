"""Throughput of asynchronous RL: steps/s with rl.max_version_diff = 0, 1, 2, and the overlap obtained.

  python experiments/bench_async.py [--devices 8] [--rollout_devices 4] [--diffs 0,1,2] [--modes trace]
                                    [--steps 16] [--json docs/perf/bench_async.json]
  python experiments/bench_async.py --smoke --layouts=shared --diffs=2   # the tests' tiny model, 3 steps

Each run is `train.train_and_evaluate` of configs/default.py (the mode, the tiny 4-layer MoE, 8
prompts x 8 samples, 8 new tokens at most), with a short SFT and no evaluation during RL, on
`--devices` simulated CPU devices (XLA_FLAGS is set before jax is imported):
  layout 'separate'  mesh.rollout_devices = R: the engine on the first R devices, the trainer on the rest
  layout 'shared'    mesh.rollout_devices = 0: both on every device (the producer is a thread beside it)
The rollout is the producer's (weight sync + generate), the train part the trainer's (rewards,
reference log-probs, updates, and for d > 0 the forward at the rollout's version).

Per run, over the steps after the first d + 2 (which compile), means of: the step time (the
trainer's loop, `time/step_s`), the rollout (`time/rollout_s`: weight sync + generate), and the
trainer's half ("learn": rewards, batch transfer, reference log-probs, the update, the metrics, and
with rl.split_mismatch the forward at the rollout's version), i.e. step - rollout when synchronous
and step - the wait for the producer (`time/wait_s`) when not. Then steps/s = 1 / step, its ratio
to the synchronous run of the same layout (the speedup obtained), and
  overlap = (rollout + learn - step) / min(rollout, learn)
the share of the shorter half hidden behind the longer, as each half was timed (0 when
synchronous). Both halves share this machine's cores whatever the layout (simulated devices are
threads of one process), so each half runs slower while the other runs: a full overlap of halves
that each got slower is no speedup. Compiles are cached on disk under --root.
"""

from __future__ import annotations

import argparse
import os
import sys


def _parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--rollout_devices", type=int, default=4)
  p.add_argument("--layouts", default="separate,shared")
  p.add_argument("--diffs", default="0,1,2")
  p.add_argument("--modes", default="trace")
  p.add_argument("--steps", type=int, default=16)
  p.add_argument("--root", default="/tmp/bench_async")
  p.add_argument("--json", default="")
  p.add_argument("--smoke", action="store_true", help="the tests' tiny model, 3 steps")
  p.add_argument("--split_mismatch", default="true", help="rl.split_mismatch (true, false, or both)")
  return p.parse_args(argv)


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None:
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={ARGS.devices}"
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

import json  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from configs import default  # noqa: E402
from experiments import sweep  # noqa: E402
from trace_jax.metrics_writer import read_metrics  # noqa: E402

SMOKE = {  # the tests' tiny run (tests/tiny.py TINY), so that a test shares its compiled programs
  **default.SMOKE,
  "rl.kl_coef": 0.05,
  "rollout.max_new_tokens": 8,
  "data.num_train": 500,
  "data.num_test": 50,
}


def run_one(mode: str, layout: str, d: int, split: bool, args) -> dict:
  """One run; returns its mean times, steps/s and overlap."""
  workdir = os.path.join(args.root, f"{mode}-{layout}-d{d}-split{int(split)}")
  shutil.rmtree(workdir, ignore_errors=True)
  overrides = {
    "steps": args.steps,
    "sft.steps": 20,
    "eval_every": 0,
    "eval_prompts": 8,
    "checkpoint_every": args.steps,
    "rl.max_version_diff": d,
    "rl.split_mismatch": split,
    "mesh.rollout_devices": args.rollout_devices if layout == "separate" else 0,
    "data.data_dir": os.path.join(args.root, "tfds"),
    **(SMOKE if args.smoke else {}),
  }
  cfg = sweep.configure(default.get_config(mode), overrides)
  from trace_jax import train  # after XLA_FLAGS

  t0 = time.perf_counter()
  train.train_and_evaluate(cfg, workdir)
  total = time.perf_counter() - t0
  rows = read_metrics(workdir)
  steady = rows[min(d + 2, len(rows) - 1) :]
  mean = lambda key: float(np.mean([r[key] for r in steady])) if all(key in r for r in steady) else 0.0
  step, rollout, train_s, wait = mean("time/step_s"), mean("time/rollout_s"), mean("time/train_s"), mean("time/wait_s")
  learn = step - (wait if d else rollout)
  overlap = (rollout + learn - step) / min(rollout, learn) if min(rollout, learn) > 0 else float("nan")
  out = {
    "mode": mode,
    "layout": layout,
    "max_version_diff": d,
    "split_mismatch": split,
    "steps_timed": len(steady),
    "step_s": step,
    "steps_per_s": 1.0 / step,
    "rollout_s": rollout,
    "learn_s": learn,
    "train_s": train_s,
    "wait_s": wait,
    "overlap": overlap,
    "staleness_mean": float(np.mean([r.get("staleness/version_diff", 0.0) for r in rows])),
    "run_s": total,
  }
  print(json.dumps(out), flush=True)
  return out


def main(args) -> list[dict]:
  import jax
  from jax.experimental.compilation_cache import compilation_cache

  if not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    compilation_cache.set_cache_dir(os.path.join(args.root, "xla_cache"))

  print(f"{jax.device_count()} devices ({jax.devices()[0].platform}), {os.cpu_count()} CPU cores", flush=True)
  layouts, diffs = args.layouts.split(","), [int(d) for d in args.diffs.split(",")]
  if args.smoke:
    args.steps = 3
  splits = {"true": [True], "false": [False], "both": [True, False]}[args.split_mismatch]
  results = [
    run_one(mode, layout, d, split, args)
    for mode in args.modes.split(",")
    for layout in layouts
    for d in diffs
    for split in (splits if d else [True])  # the split needs d > 0
  ]
  print("\n| mode | layout | d | split | steps/s | step s | rollout s | learn s | wait s | overlap | vs d=0 |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for r in results:
    base = next(
      (b for b in results if (b["mode"], b["layout"], b["max_version_diff"]) == (r["mode"], r["layout"], 0)), None
    )
    ratio = f"{r['steps_per_s'] / base['steps_per_s']:.2f}x" if base else "n/a"
    print(
      f"| {r['mode']} | {r['layout']} | {r['max_version_diff']} | {'yes' if r['split_mismatch'] else 'no'} | "
      f"{r['steps_per_s']:.2f} | {r['step_s']:.3f} | {r['rollout_s']:.3f} | {r['learn_s']:.3f} | "
      f"{r['wait_s']:.3f} | {r['overlap']:.2f} | {ratio} |"
    )
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "cpu_count": os.cpu_count(), "runs": results}, f, indent=2)
  return results


if __name__ == "__main__":
  main(ARGS)
