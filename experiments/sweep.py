"""Programmatic runs and sweeps over configs, each run in its own workdir.

  from configs import default
  from experiments import sweep
  table = sweep.sweep(default.get_config(), {"mode": ["fp4", "qat", "trace"]}, root="/tmp/sweep", seeds=[0, 1, 2])
  sweep.write_table(table, "/tmp/sweep/table")   # CSV + JSON, mean and std over seeds

A run whose workdir already holds a summary.json is finished and is read, not rerun.
`processes=True` runs each in a fresh `python -m trace_jax.main` process (isolation, and the
only way to change XLA flags per run); otherwise runs share this process and its compile cache.
"""

from __future__ import annotations

import copy
import csv
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np

from trace_jax.metrics_writer import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def configure(base: ml_collections.ConfigDict, overrides: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """A copy of `base` with {dotted.key: value} overrides; an unknown key is an error naming it."""
  cfg = copy.deepcopy(base)
  for dotted, value in overrides.items():
    node = cfg
    *parents, leaf = dotted.split(".")
    for i, p in enumerate(parents):
      if p not in node:
        raise KeyError(f"config has no section {'.'.join(parents[: i + 1])!r} (override {dotted!r}).")
      node = node[p]
    if leaf not in node:
      raise KeyError(f"config has no field {dotted!r}; fields here: {sorted(node.keys())}.")
    node[leaf] = value
  return cfg


def run_name(overrides: Mapping[str, Any]) -> str:
  """The workdir name of a grid point under a sweep's root, e.g. 'mode=trace,tis_cap=0.0' ('base' for {})."""
  parts = [f"{k.split('.')[-1]}={v}" for k, v in overrides.items()]
  return ",".join(parts).replace("/", "_").replace(" ", "") or "base"


def run(config: ml_collections.ConfigDict, workdir: str, *, processes: bool = False) -> dict:
  """Run one config to completion in `workdir` (or read its finished result).

  Returns {"summary": summary.json, "metrics": list of per-step rows}.
  """
  summary_path = os.path.join(workdir, "summary.json")
  if not os.path.exists(summary_path):
    if processes:
      _run_subprocess(config, workdir)
    else:
      from trace_jax import train  # noqa: PLC0415 (jax is imported only when a run happens here)

      train.train_and_evaluate(config, workdir)
  with open(summary_path) as f:
    summary = json.load(f)
  return {"summary": summary, "metrics": read_metrics(workdir)}


def _run_subprocess(config: ml_collections.ConfigDict, workdir: str) -> None:
  os.makedirs(workdir, exist_ok=True)
  cfg_file = os.path.join(workdir, "sweep_config.py")
  with open(cfg_file, "w") as f:
    f.write(
      "import json\nimport ml_collections\n\n\ndef get_config():\n"
      f"  return ml_collections.ConfigDict(json.loads({config.to_json_best_effort()!r}))\n"
    )
  cmd = [sys.executable, "-m", "trace_jax.main", f"--config={cfg_file}", f"--workdir={workdir}"]
  subprocess.run(cmd, cwd=REPO, check=True)


def expand(grid: Mapping[str, Sequence[Any]] | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """All combinations of a {dotted.key: [values]} grid, in order; a list of overrides is kept as is."""
  if not isinstance(grid, Mapping):
    return [dict(point) for point in grid]
  keys = list(grid)
  return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def sweep(
  base: ml_collections.ConfigDict,
  grid: Mapping[str, Sequence[Any]] | Sequence[Mapping[str, Any]],
  *,
  root: str,
  seeds: Iterable[int] = (0,),
  processes: bool = False,
  metrics: Sequence[str] | None = None,
) -> list[dict]:
  """Run every grid point for every seed under `root`; one row per grid point.

  `grid` is {dotted.key: [values]} (every combination) or a list of override dicts (one-factor
  ablations; `{}` is the base config). Each row holds the overrides, per metric its mean and std
  over seeds, `seeds` and `workdirs` (one per seed, for per-step curves). A metric is a
  summary.json key, or `last:<key>` (mean of the last 20% of steps in metrics.jsonl).
  """
  metrics = list(metrics or DEFAULT_METRICS)
  rows = []
  for overrides in expand(grid):
    per_seed, workdirs = [], []
    for seed in seeds:
      cfg = configure(base, overrides)
      cfg.seed = seed
      workdirs.append(os.path.join(root, run_name(overrides), f"seed{seed}"))
      result = run(cfg, workdirs[-1], processes=processes)
      per_seed.append({m: extract(result, m) for m in metrics})
    row = dict(overrides)
    for m in metrics:
      values = np.array([s[m] for s in per_seed], np.float64)
      row[f"{m}:mean"] = float(np.nanmean(values)) if np.isfinite(values).any() else float("nan")
      row[f"{m}:std"] = float(np.nanstd(values)) if np.isfinite(values).any() else float("nan")
    row["seeds"] = len(per_seed)
    row["workdirs"] = workdirs
    rows.append(row)
  return rows


DEFAULT_METRICS = (
  "final/accuracy_bf16_engine",
  "final/accuracy_fp4_engine",
  "last:reward/mean",
  "last:mismatch/logp_diff_mean",
  "last:mismatch/kl_k3",
  "last:agreement/deep",
  "last:agreement/shallow",
  "last:routing_agreement",
  "last:guidance/bytes_per_token",
)


def extract(result: dict, metric: str) -> float:
  """A summary value, or the late-run mean of a per-step metric.

  `agreement/deep` / `agreement/shallow`: codeword agreement averaged over tensors in the
  deeper / shallower half of the layers; `routing_agreement`: averaged over layers.
  """
  if not metric.startswith("last:"):
    return float(result["summary"].get(metric, float("nan")))
  key, rows = metric[5:], result["metrics"]
  if not rows:
    return float("nan")
  rows = rows[-max(1, len(rows) // 5) :]
  values = [row_value(r, key) for r in rows]
  values = [v for v in values if np.isfinite(v)]
  return float(np.mean(values)) if values else float("nan")


def row_value(row: dict, key: str) -> float:
  """One step's value of `key` from a metrics.jsonl row (NaN when absent), with the layer
  averages `agreement/deep`, `agreement/shallow` and `routing_agreement`."""
  if key in ("agreement/deep", "agreement/shallow", "routing_agreement"):
    prefix = "routing_agreement/layer" if key == "routing_agreement" else "agreement/"
    layers = {}
    for k, v in row.items():
      if k.startswith(prefix) and v is not None and np.isfinite(v):
        layers.setdefault(int(k.rsplit("layer", 1)[1]), []).append(v)
    if not layers:
      return float("nan")
    n = max(layers) + 1
    if key == "agreement/deep":
      layers = {i: v for i, v in layers.items() if i >= n // 2}
    elif key == "agreement/shallow":
      layers = {i: v for i, v in layers.items() if i < n // 2}
    return float(np.mean([x for v in layers.values() for x in v])) if layers else float("nan")
  value = row.get(key)
  return float(value) if value is not None else float("nan")


def write_table(rows: list[dict], path_prefix: str) -> None:
  """`<prefix>.csv` and `<prefix>.json`."""
  os.makedirs(os.path.dirname(os.path.abspath(path_prefix)), exist_ok=True)
  with open(path_prefix + ".json", "w") as f:
    json.dump(rows, f, indent=2)
  keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k != "workdirs"]
  with open(path_prefix + ".csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)


def format_cell(row: dict, metric: str) -> str:
  """`mean ± std` over seeds (just the mean for one seed; `n/a` when no run measured it)."""
  mean, std = row[f"{metric}:mean"], row[f"{metric}:std"]
  if not np.isfinite(mean):
    return "n/a"
  return f"{mean:.4g} ± {std:.2g}" if row["seeds"] > 1 else f"{mean:.4g}"


def markdown(rows: list[dict], metrics: Sequence[str], keys: Sequence[str], headers: Mapping[str, str] | None = None):
  """A markdown table: one row per grid point, `mean ± std` per metric (`headers` renames columns)."""
  headers = headers or {}
  head = "| " + " | ".join([*keys, *(headers.get(m, m) for m in metrics)]) + " |"
  sep = "|" + "---|" * (len(keys) + len(metrics))
  lines = [head, sep]
  for r in rows:
    cells = [str(r[k]) for k in keys] + [format_cell(r, m) for m in metrics]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)
