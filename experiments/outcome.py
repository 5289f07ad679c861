"""The outcome experiment of issue 41: does TRACE keep BF16-level reward where QAT loses it?

  python -m experiments.outcome                        # REGIME, 5 seeds x 7 modes x 300 steps
  python -m experiments.outcome --seeds 0,1 &  python -m experiments.outcome --seeds 2,3,4 &   # two processes
  python -m experiments.outcome --report               # tables and figures from the finished runs only
  python -m experiments.outcome --smoke --root /tmp/outcome_smoke --out /tmp/outcome_smoke/out
  python -m experiments.outcome --gpu --root /tmp/outcome_gpu --out /tmp/outcome_gpu/out   # GPU_REGIME, one GPU

Every seed has its own SFT warm start (sft.seed = the seed), shared between the modes of that seed
(the SFT cache under ROOT/sft_cache). Modes (MODES): bf16, fp4 (BF16 trainer, TIS), qat (RTN W4A4
QAT), qat + the sequence-level correction (QAT_CORRECTION: rl.mis / rl.trust_region), trace,
trace_full, and quads (the trainer side of QUADS: weight-only QAT, mode qat_w4a16; its rollout-side
compensation is not public, SPEC section 7). Runs resume run by run: a finished run (summary.json of
all its steps under the same config) is read back; ROOT keeps only each run's JSON and JSONL in git
(ROOT/.gitignore), so a later session continues where this one stopped.

Written under OUT (docs/results/outcome): table.md, table.json and curves.png. table.json holds
"regime" (the config overrides), "ptq_cost" (the BF16 engine's greedy accuracy minus the FP4 engine's
on the SFT policies, a fraction, mean over seeds), and per mode "seeds", "steps", "late_reward",
"final_acc_fp4", "final_acc_bf16" and "late_abs_dlogp" (per-seed lists), "dlogp_by_position",
"agreement_by_layer" and "routing_by_layer"; "comparison" gives trace - qat (and trace - bf16) late
reward, paired by seed: mean, 95% t-interval, and whether it separates from 0.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from configs import long_horizon
from experiments import plotting, sweep

# The regime (experiments/regime.py, docs/results/regime/table.md): its overrides of configs/long_horizon.py.
# Width 128 (expert FFN 64, head_dim 32), the running sum of 22 one-digit terms (66-token responses), 250 SFT
# steps: the SFT policy (seed 0) is 34% right (63% partial), NVFP4 W4A4 experts + FP4 KV cost it 11.7 points.
REGIME = {
  "model.hidden_size": 128,
  "model.moe_intermediate_size": 64,
  "model.head_dim": 32,
  "data.sum_terms": 22,
  "data.term_digits": 1,
  "reward.partial_credit": True,
  "sft.steps": 250,
  "eval_every": 100,
  "trace.diagnostics_every": 1,  # agreement on every step, as the committed runs measured it
}
# Trust-region masking (arXiv 2512.23075) on the largest token divergence; chosen a priori, not tuned here.
QAT_CORRECTION = {"rl.trust_region": "max", "rl.trust_region_delta": 0.1}
MODES = {  # in the order a seed runs them: the main comparison (bf16, qat, trace) first
  "bf16": {"mode": "bf16"},
  "qat": {"mode": "qat"},
  "trace": {"mode": "trace"},
  "qat+trm": {"mode": "qat", **QAT_CORRECTION},
  "fp4": {"mode": "fp4"},
  "quads": {"mode": "qat_w4a16"},
  "trace_full": {"mode": "trace_full"},
}
SEEDS, STEPS = (0, 1, 2, 3, 4), 300
# The same protocol at GPU scale (--gpu): 8 layers of 16 experts at hidden 512 and 132-token responses (44 terms),
# 32 prompts x 8 samples a step; each run is sized to about 9 minutes on one H100 / H200 (not yet measured on
# one: docs/gpu.md). pallas_kernels/lab/gpu_check.py's outcome stage runs it within its budget (BUDGET_S).
GPU_REGIME = {
  "model.hidden_size": 512,
  "model.num_layers": 8,
  "model.num_heads": 8,
  "model.num_kv_heads": 4,
  "model.head_dim": 64,
  "model.num_experts": 16,
  "model.num_experts_per_tok": 4,
  "model.moe_intermediate_size": 256,
  "model.max_position_embeddings": 512,
  "data.sum_terms": 44,
  "data.term_digits": 1,
  "reward.partial_credit": True,
  "sft.steps": 300,
  "batch_prompts": 32,
  "eval_every": 50,
  "eval_prompts": 512,
}
GPU_STEPS = 150
GPU_MODE_ORDER = ("bf16", "trace", "qat", "qat+trm", "fp4", "trace_full", "quads")  # what a short budget runs first
METRICS = (
  "last:reward/mean",
  "first:reward/mean",
  "final/accuracy_fp4_engine",
  "final/accuracy_bf16_engine",
  "last:mismatch/logp_diff_mean",
  "last:agreement/deep",
  "last:routing_agreement",
)
SMOKE = {
  "model.num_layers": 2,
  "data.sum_terms": 4,
  "sft.steps": 10,
  "steps": 2,
  "batch_prompts": 2,
  "rl.num_generations": 2,
  "eval_prompts": 4,
  "eval_every": 0,
  "checkpoint_every": 2,
  "data.num_train": 100,
  "data.num_test": 10,
}
# Only each run's config, summary and metrics (and the SFT policies' PTQ figures) are kept in git.
GITIGNORE = """# experiments/outcome.py: what a later session needs to read finished runs back
*
!.gitignore
!sft_ptq.json
!*/
!*/seed*/config.json
!*/seed*/summary.json
!*/seed*/metrics.jsonl
"""


def base_config(regime=REGIME, smoke: bool = False, steps: int = STEPS):
  terms, digits = regime.get("data.sum_terms", 13), regime.get("data.term_digits", 2)
  if smoke:
    terms = SMOKE["data.sum_terms"]
  base = long_horizon.get_config(f"bf16,terms={terms},digits={digits}")  # the lengths that fit the task
  rest = {k: v for k, v in regime.items() if k not in ("data.sum_terms", "data.term_digits")}
  base = sweep.configure(base, {**rest, **({k: v for k, v in SMOKE.items() if k != "data.sum_terms"} if smoke else {})})
  base.steps = base.steps if smoke else steps
  return base


def run_all(base, root: str, seeds, modes, deadline: float | None = None) -> list[dict]:
  """Every (seed, mode) run, seed by seed; with a deadline (time.monotonic()), no run starts after it."""
  base = sweep.configure(base, {"sft.cache_dir": os.path.join(root, "sft_cache")})
  base.sft.seed = -1  # each seed its own warm start
  os.makedirs(root, exist_ok=True)
  with open(os.path.join(root, ".gitignore"), "w") as f:
    f.write(GITIGNORE)
  for seed in seeds:  # seed by seed: every finished seed has all its modes, for the paired comparisons
    for name in modes:
      if deadline is not None and time.monotonic() > deadline:
        print(f"outcome: the budget is spent; {name} seed {seed} and later runs not started", flush=True)
        return finished_rows(root, modes)
      sweep.sweep(base, [MODES[name]], root=root, seeds=[seed], metrics=METRICS)
  return finished_rows(root, modes)


def finished_rows(root: str, modes) -> list[dict]:
  """The rows of the runs finished so far (read back, never run)."""
  rows = []
  for name in modes:
    mode_dir = os.path.join(root, sweep.run_name(MODES[name]))
    workdirs = sorted(
      (os.path.join(mode_dir, d) for d in os.listdir(mode_dir) if d.startswith("seed"))
      if os.path.isdir(mode_dir)
      else [],
      key=lambda w: int(w.rsplit("seed", 1)[1]),
    )
    results = []
    for w in workdirs:
      try:
        results.append((w, sweep.run(None, w)))
      except FileNotFoundError:
        continue
    if not results:
      continue
    row = {
      "name": name,
      "workdirs": [w for w, _ in results],
      "seeds": [int(w.rsplit("seed", 1)[1]) for w, _ in results],
    }
    for m in METRICS:
      row[f"{m}:values"] = [sweep.extract(r, m) for _, r in results]
    row["steps"] = [int(r["summary"].get("steps", 0)) for _, r in results]
    rows.append(row)
  return rows


def t_interval(diffs) -> tuple[float, float, float]:
  """(mean, low, high) of a 95% t-interval of the mean of `diffs` (NaN for fewer than 2)."""
  from scipy import stats  # noqa: PLC0415

  d = np.asarray(diffs, np.float64)
  if d.size < 2:
    return float(d.mean()) if d.size else float("nan"), float("nan"), float("nan")
  half = stats.t.ppf(0.975, d.size - 1) * d.std(ddof=1) / np.sqrt(d.size)
  return float(d.mean()), float(d.mean() - half), float(d.mean() + half)


def paired(rows, a: str, b: str, key="last:reward/mean") -> dict:
  """a - b of `key`, paired by seed (the seeds both finished); `separated` when the 95% t-interval excludes 0,
  called from 3 seeds on (two equal differences would give an interval of width 0)."""
  by = {r["name"]: dict(zip(r["seeds"], r[f"{key}:values"])) for r in rows}
  if a not in by or b not in by:
    return {}
  seeds = sorted(set(by[a]) & set(by[b]))
  mean, low, high = t_interval([by[a][s] - by[b][s] for s in seeds])
  separated = bool(len(seeds) >= 3 and np.isfinite(low) and (low > 0 or high < 0))  # 2 seeds: no call
  return {"seeds": seeds, "mean": mean, "ci95": [low, high], "separated": separated}


def sft_ptq_cost(root: str, base, seeds) -> dict:
  """BF16 engine minus FP4 engine greedy accuracy of each seed's SFT policy (PTQ of the warm start),
  measured once per seed and kept in ROOT/sft_ptq.json."""
  path = os.path.join(root, "sft_ptq.json")
  saved = json.load(open(path)) if os.path.exists(path) else {}
  todo = [s for s in seeds if str(s) not in saved]
  if todo:
    import jax  # noqa: PLC0415

    from trace_jax import train  # noqa: PLC0415

    for seed in todo:
      cfg = sweep.configure(base, {"sft.cache_dir": os.path.join(root, "sft_cache")})
      cfg.seed = seed
      run, tokenizer, train_source, test_source = train.run_data(train.run_config(cfg))
      params = train.starting_policy(cfg, run, tokenizer, train_source)
      eval_key = jax.random.split(jax.random.key(run.job.seed), 3)[2]
      acc = {
        name: train.evaluate(params, run, quant, tokenizer, test_source, eval_key)
        for name, quant in (("bf16", None), ("fp4", run.quant))
      }
      saved[str(seed)] = acc
      with open(path, "w") as f:
        json.dump(saved, f, indent=1)
  return {s: saved[str(s)] for s in seeds if str(s) in saved}


def report(rows: list[dict], out: str, regime: dict, ptq: dict) -> dict:
  os.makedirs(out, exist_ok=True)
  costs = [v["bf16"] - v["fp4"] for v in ptq.values()]
  table = {
    "regime": regime,
    "ptq_cost": float(np.mean(costs)) if costs else None,
    "ptq_cost_per_seed": {str(s): v["bf16"] - v["fp4"] for s, v in ptq.items()},
    "sft_accuracy_bf16_engine": {str(s): v["bf16"] for s, v in ptq.items()},
    "modes": {},
  }
  for r in rows:
    table["modes"][r["name"]] = {
      "seeds": r["seeds"],
      "steps": r["steps"],
      "late_reward": r["last:reward/mean:values"],
      # condition (c): what RL gained, the last 20% of the steps against the first 20%
      "reward_gain": [a - b for a, b in zip(r["last:reward/mean:values"], r["first:reward/mean:values"])],
      "final_acc_fp4": r["final/accuracy_fp4_engine:values"],
      "final_acc_bf16": r["final/accuracy_bf16_engine:values"],
      "late_abs_dlogp": r["last:mismatch/logp_diff_mean:values"],
      "dlogp_by_position": {str(k): v for k, v in plotting.late_by_position(r["workdirs"]).items()},
      "agreement_by_layer": plotting.late_per_layer(r["workdirs"], "agreement/"),
      "routing_by_layer": plotting.late_per_layer(r["workdirs"], "routing_agreement/"),
    }
  table["comparison"] = {
    "trace - qat": paired(rows, "trace", "qat"),
    "trace - bf16": paired(rows, "trace", "bf16"),
    "qat - bf16": paired(rows, "qat", "bf16"),
    "trace final FP4 acc. - PTQ of bf16": paired(rows, "trace", "bf16", "final/accuracy_fp4_engine"),
  }
  clean = lambda o: (
    {k: clean(v) for k, v in o.items()}
    if isinstance(o, dict)
    else [clean(v) for v in o]
    if isinstance(o, list)
    else (None if isinstance(o, float) and not np.isfinite(o) else o)
  )
  with open(os.path.join(out, "table.json"), "w") as f:
    json.dump(clean(table), f, indent=1)
  with open(os.path.join(out, "table.md"), "w") as f:
    f.write(markdown(table) + "\n")
  if rows:
    figure(rows, out)
  return table


def figure(rows: list[dict], out: str) -> str:
  """curves.png: reward with seed bands (min..max), |dlogp| by response position, codeword and routing
  agreement per layer."""
  plt = plotting.plt
  fig, axes = plt.subplots(2, 2, figsize=(12, 8))
  plotting.curves(axes[0, 0], rows, "reward/mean", label="name", window=10, title="reward (moving avg 10)")
  plotting.mismatch_by_position(axes[0, 1], rows, "name", logy=True, title="late |logp_train - logp_rollout|")
  plotting.layer_profile(axes[1, 0], rows, label="name", prefix="agreement/", title="late codeword agreement")
  plotting.layer_profile(axes[1, 1], rows, label="name", prefix="routing_agreement/", title="late routing agreement")
  axes[0, 0].legend(fontsize=8)
  fig.suptitle("issue 41 outcome: seed mean, shaded min..max over seeds; late = last 20% of steps")
  return plotting._save(fig, out, "curves.png")


def _ms(values) -> str:
  v = np.asarray([x for x in values if x is not None and np.isfinite(x)], np.float64)
  if not v.size:
    return "-"
  return f"{v.mean():.3f} ± {v.std(ddof=1):.3f}" if v.size > 1 else f"{v.mean():.3f}"


def markdown(table: dict) -> str:
  cost = "-" if table["ptq_cost"] is None else f"{table['ptq_cost']:.3f}"
  lines = [
    "# The outcome (issue 41)",
    "",
    f"Regime: `{json.dumps(table['regime'])}` over configs/long_horizon.py. FP4 PTQ cost of the SFT policies "
    f"(BF16 minus FP4 engine, greedy): {cost}.",
    "Command: `python -m experiments.outcome` (mean ± sample std over seeds). Late: the last 20% of the steps; "
    "reward gain: late reward minus that of the first 20% (the issue's condition (c) asks BF16 for >= 0.10).",
    "",
    "| mode | seeds | steps | late reward | reward gain | final acc. FP4 engine | final acc. BF16 engine | "
    "late \\|dlogp\\| |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for name, m in table["modes"].items():
    lines.append(
      f"| {name} | {len(m['seeds'])} | {min(m['steps'], default=0)} | {_ms(m['late_reward'])} | "
      f"{_ms(m.get('reward_gain', []))} | "
      f"{_ms(m['final_acc_fp4'])} | {_ms(m['final_acc_bf16'])} | {_ms(m['late_abs_dlogp'])} |"
    )
  lines += ["", "| paired by seed | seeds | mean | 95% CI | separated |", "|---|---|---|---|---|"]
  for name, c in table["comparison"].items():
    if c:
      low, high = c["ci95"]
      ci = "-" if low is None or not np.isfinite(low) else f"[{low:+.3f}, {high:+.3f}]"
      lines.append(f"| {name} | {len(c['seeds'])} | {c['mean']:+.3f} | {ci} | {'yes' if c['separated'] else 'no'} |")
  return "\n".join(lines)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--root", default="docs/results/outcome/runs")
  p.add_argument("--out", default="docs/results/outcome")
  p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
  p.add_argument("--modes", default=",".join(MODES))
  p.add_argument("--report", action="store_true", help="no runs: tables and figures from the finished ones")
  p.add_argument("--smoke", action="store_true", help="2 layers, 4 terms, 2 RL steps, one seed: the plumbing")
  p.add_argument("--gpu", action="store_true", help=f"GPU_REGIME, {GPU_STEPS} steps a run, modes in GPU_MODE_ORDER")
  p.add_argument("--json", default="", help="also write the table here (pallas_kernels/lab/gpu_check.py)")
  p.add_argument("--budget_s", type=float, default=float(os.environ.get("BUDGET_S", 0)), help="no run starts later")
  args = p.parse_args(argv)
  seeds = [0] if args.smoke else [int(s) for s in args.seeds.split(",")]
  modes = [m.strip() for m in args.modes.split(",") if m.strip()]
  unknown = sorted(set(modes) - set(MODES))
  if unknown:
    raise SystemExit(f"--modes: unknown {unknown}; expected some of {list(MODES)}.")
  regime = GPU_REGIME if args.gpu else REGIME
  if args.gpu:
    modes = [m for m in GPU_MODE_ORDER if m in modes]
  base = base_config(regime, args.smoke, GPU_STEPS if args.gpu else STEPS)
  deadline = time.monotonic() + args.budget_s if args.budget_s > 0 else None
  if not args.report:
    run_all(base, args.root, seeds, modes, deadline)
  done_seeds = sorted({s for r in finished_rows(args.root, modes) for s in r["seeds"]})
  ptq = sft_ptq_cost(args.root, base, done_seeds if deadline is None else [])  # from the SFT cache, kept once
  table = report(finished_rows(args.root, modes), args.out, regime, ptq)
  print(markdown(table))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(json.load(open(os.path.join(args.out, "table.json"))), f, indent=1)
  return table


if __name__ == "__main__":
  main()
