"""Programmatic runs and sweeps over configs, each run in its own workdir.

  from configs import default
  from experiments import sweep
  table = sweep.sweep(default.get_config(), {"mode": ["fp4", "qat", "trace"]}, root="/tmp/sweep", seeds=[0, 1, 2])
  sweep.write_table(table, "/tmp/sweep/table")   # CSV + JSON, mean and sample std over seeds

A run whose workdir holds a summary.json of all its steps, under the same config, is read back,
not rerun; one with fewer steps (stopped, or asked for more) is resumed; one of another config
is refused, naming the fields that differ. `processes=True` runs each in a fresh
`python -m trace_jax.main` process (isolation; `env` sets e.g. XLA_FLAGS per run); otherwise runs
share this process and its compile cache.
"""

from __future__ import annotations

import ast
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

from trace_jax.config import deeper_layers
from trace_jax.metrics_writer import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def configure(base: ml_collections.ConfigDict, overrides: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """A copy of `base` with {dotted.key: value} overrides; an unknown key is an error naming it."""
  cfg = copy.deepcopy(base)
  for dotted, value in overrides.items():
    node = cfg
    *parents, leaf = dotted.split(".")
    for i, p in enumerate(parents):
      if not isinstance(node, ml_collections.ConfigDict) or p not in node:
        raise KeyError(f"config has no section {'.'.join(parents[: i + 1])!r} (override {dotted!r}).")
      node = node[p]
    if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
      fields = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
      raise KeyError(f"config has no field {dotted!r}; fields here: {fields}.")
    node[leaf] = value
  return cfg


def run_name(overrides: Mapping[str, Any]) -> str:
  """The workdir name of a grid point under a sweep's root, e.g. 'mode=trace,rl.tis_cap=0.0' ('base' for {})."""
  show = lambda v: "+".join(map(str, v)) if isinstance(v, tuple | list) else str(v)  # tensors=a+b
  parts = [f"{k}={show(v)}" for k, v in overrides.items()]
  return ",".join(parts).replace("/", "_").replace(" ", "") or "base"


def run(
  config: ml_collections.ConfigDict | None,
  workdir: str,
  *,
  processes: bool = False,
  env: Mapping[str, str] | None = None,
) -> dict:
  """Run one config to completion in `workdir`, resume it, or read its finished result back.

  config=None only reads a finished run. Returns {"summary": summary.json, "metrics": per-step
  rows, "config": config.json}.
  """
  summary_path = os.path.join(workdir, "summary.json")
  if config is not None and not _finished(config, workdir):
    if processes:
      _run_subprocess(config, workdir, env)
    else:
      from trace_jax import train  # noqa: PLC0415 (jax is imported only when a run happens here)

      train.train_and_evaluate(config, workdir)
  if not os.path.exists(summary_path):
    raise FileNotFoundError(f"{workdir} holds no finished run (no summary.json); pass its config to run it.")
  with open(summary_path) as f:
    summary = json.load(f)
  with open(os.path.join(workdir, "config.json")) as f:
    saved = json.load(f)
  return {"summary": summary, "metrics": read_metrics(workdir), "config": saved}


def _finished(config: ml_collections.ConfigDict, workdir: str) -> bool:
  """True when `workdir` holds every step of this config; a run of another config is an error."""
  summary_path, config_path = os.path.join(workdir, "summary.json"), os.path.join(workdir, "config.json")
  if not os.path.exists(config_path):
    return False
  from trace_jax import job  # noqa: PLC0415
  from trace_jax.config import ConfigError  # noqa: PLC0415

  with open(config_path) as f:
    saved = json.load(f)
  current = json.loads(config.to_json_best_effort())
  differs = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
  if [k for k in differs if k not in job.RESUMABLE_FIELDS]:
    raise ConfigError(
      f"{workdir} holds a run of another config (fields {differs} differ from its config.json); "
      "use another root, or delete the workdir to rerun it."
    )
  if not os.path.exists(summary_path):
    return False
  with open(summary_path) as f:
    summary = json.load(f)
  return summary.get("steps") == config.steps and not differs


def _run_subprocess(config: ml_collections.ConfigDict, workdir: str, env: Mapping[str, str] | None) -> None:
  os.makedirs(workdir, exist_ok=True)
  literal = repr(config.to_dict())
  try:
    ast.literal_eval(literal)
  except (ValueError, SyntaxError) as e:
    raise ValueError(f"processes=True needs a config of Python literals only; this one is not: {e}") from e
  cfg_file = os.path.join(workdir, "sweep_config.py")
  with open(cfg_file, "w") as f:
    f.write(f"import ml_collections\n\n\ndef get_config():\n  return ml_collections.ConfigDict({literal})\n")
  cmd = [sys.executable, "-m", "trace_jax.main", f"--config={cfg_file}", f"--workdir={workdir}"]
  subprocess.run(cmd, cwd=REPO, check=True, env=None if env is None else {**os.environ, **env})


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
  seeds: Iterable[int] | None = None,
  processes: bool = False,
  metrics: Sequence[str] | None = None,
  env: Mapping[str, str] | None = None,
  verbose: bool = True,
) -> list[dict]:
  """Run every grid point for every seed under `root`; one row per grid point.

  `grid` is {dotted.key: [values]} (every combination) or a list of override dicts (one-factor
  ablations; `{}` is the base config). seeds: default [base.seed]. A metric is a summary.json
  key, or `last:<key>` (mean of the last 20% of steps in metrics.jsonl).

  Each row holds the overrides (also as `overrides`), `name` (its workdir under root), per
  metric `<m>:values` (one per seed, in order), `<m>:mean`, `<m>:std` (sample std, ddof=1; 0 for
  one value) and `<m>:n` (seeds that measured it), and `seeds` and `workdirs`.
  verbose: print one line per run (which, where, and whether it is read back).
  """
  metrics, points = list(metrics or DEFAULT_METRICS), expand(grid)
  seeds = [int(s) for s in (seeds if seeds is not None else [base.seed])]
  if not seeds:
    raise ValueError("sweep: seeds is empty; pass at least one seed, e.g. seeds=[0].")
  names = [run_name(p) for p in points]
  for point, name in zip(points, names):
    if "seed" in point:
      raise ValueError(f"sweep: grid point {point} sets 'seed'; pass seeds=[...] instead.")
    if names.count(name) > 1:
      raise ValueError(f"sweep: two grid points share the workdir name {name!r}; make them distinct.")
  rows, total = [], len(points) * len(seeds)
  for overrides, name in zip(points, names):
    per_seed, workdirs = [], []
    for seed in seeds:
      cfg = configure(base, overrides)
      cfg.seed = seed
      workdirs.append(os.path.join(root, name, f"seed{seed}"))
      if verbose:
        index = len(rows) * len(seeds) + len(workdirs)
        print(f"[sweep {index}/{total}] {workdirs[-1]}", flush=True)
      result = run(cfg, workdirs[-1], processes=processes, env=env)
      per_seed.append({m: extract(result, m) for m in metrics})
    row = {**overrides, "name": name, "overrides": dict(overrides)}
    for m in metrics:
      values = np.array([s[m] for s in per_seed], np.float64)
      finite = values[np.isfinite(values)]
      row[f"{m}:values"] = [float(v) for v in values]
      row[f"{m}:n"] = int(finite.size)
      row[f"{m}:mean"] = float(finite.mean()) if finite.size else float("nan")
      row[f"{m}:std"] = float(finite.std(ddof=1)) if finite.size > 1 else (0.0 if finite.size else float("nan"))
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
  """A summary value, or the late-run (`last:<key>`) or early-run (`first:<key>`) mean of a per-step metric:
  the last or the first 20% of the steps.

  `agreement/deep` / `agreement/shallow`: codeword agreement averaged over tensors in the
  deeper / shallower half of the layers (`config.deeper_layers(n, 0.5)`, TRACE's default guided
  set); `routing_agreement`: averaged over layers.
  """
  if not metric.startswith(("last:", "first:")):
    return float(result["summary"].get(metric, float("nan")))
  where, key = metric.split(":", 1)
  rows = result["metrics"]
  if not rows:
    return float("nan")
  num_layers = result.get("config", {}).get("model", {}).get("num_layers")
  fifth = max(1, len(rows) // 5)
  rows = rows[-fifth:] if where == "last" else rows[:fifth]
  values = [row_value(r, key, num_layers) for r in rows]
  values = [v for v in values if np.isfinite(v)]
  return float(np.mean(values)) if values else float("nan")


def row_value(row: dict, key: str, num_layers: int | None = None) -> float:
  """One step's value of `key` from a metrics.jsonl row (NaN when absent), with the layer
  averages `agreement/deep`, `agreement/shallow` and `routing_agreement` (num_layers: the
  model's, for the halves; default: one more than the highest layer in the row)."""
  if key == "routing_agreement" or key.endswith(("agreement/deep", "agreement/shallow")):
    # also prefixed, e.g. at_rollout_version/agreement/deep
    prefix = "routing_agreement/layer" if key == "routing_agreement" else key.rsplit("/", 1)[0] + "/"
    layers, present = {}, set()
    for k, v in row.items():
      if k.startswith(prefix):
        present.add(int(k.rsplit("layer", 1)[1]))
        if v is not None and np.isfinite(v):
          layers.setdefault(int(k.rsplit("layer", 1)[1]), []).append(v)
    if not layers:
      return float("nan")
    n = num_layers or max(present) + 1
    deep = set(deeper_layers(n, 0.5))
    if key.endswith("agreement/deep"):
      layers = {i: v for i, v in layers.items() if i in deep}
    elif key.endswith("agreement/shallow"):
      layers = {i: v for i, v in layers.items() if i not in deep}
    return float(np.mean([x for v in layers.values() for x in v])) if layers else float("nan")
  value = row.get(key)
  return float(value) if value is not None else float("nan")


def write_table(rows: list[dict], path_prefix: str) -> None:
  """`<prefix>.json` (every field; NaN as null) and `<prefix>.csv` (overrides and statistics)."""
  os.makedirs(os.path.dirname(os.path.abspath(path_prefix)), exist_ok=True)
  clean = lambda v: None if isinstance(v, float) and not np.isfinite(v) else v
  with open(path_prefix + ".json", "w") as f:
    json.dump(
      [{k: [clean(x) for x in v] if isinstance(v, list) else clean(v) for k, v in r.items()} for r in rows], f, indent=2
    )
  skip = lambda k: k in ("workdirs", "overrides") or k.endswith(":values")
  keys = [k for k in dict.fromkeys(k for r in rows for k in r) if not skip(k)]
  with open(path_prefix + ".csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)


def format_cell(row: dict, metric: str) -> str:
  """`mean ± std` over the seeds that measured it (just the mean for one; `n/a` for none)."""
  mean, std, n = row[f"{metric}:mean"], row[f"{metric}:std"], row.get(f"{metric}:n", row["seeds"])
  if not np.isfinite(mean):
    return "n/a"
  cell = f"{mean:.4g} ± {std:.2g}" if n > 1 else f"{mean:.4g}"
  return cell if n == row["seeds"] else f"{cell} ({n}/{row['seeds']} seeds)"


def markdown(rows: list[dict], metrics: Sequence[str], keys: Sequence[str], headers: Mapping[str, str] | None = None):
  """A markdown table: one row per grid point, `mean ± std` per metric (`headers` renames columns;
  a key a row lacks shows its `name`)."""
  headers = headers or {}
  head = "| " + " | ".join([*keys, *(headers.get(m, m) for m in metrics)]) + " |"
  sep = "|" + "---|" * (len(keys) + len(metrics))
  lines = [head, sep]
  for r in rows:
    cells = [str(r.get(k, r.get("name", ""))) for k in keys] + [format_cell(r, m) for m in metrics]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def final_policy_table(rows: list[dict]) -> str:
  """The policy each mode trained, evaluated greedily with an FP4 engine (and a BF16 one).

  Differences are paired by seed (every mode of a seed starts from the same SFT policy): the
  FP4-engine minus BF16-engine accuracy of the same policy, and its FP4-engine accuracy minus
  that of post-hoc PTQ of the bf16-trained policy; mean ± sample std over seeds.
  """
  fp4_key, bf16_key = "final/accuracy_fp4_engine", "final/accuracy_bf16_engine"
  values = lambda r, k: np.array(r[f"{k}:values"], np.float64)
  ptq = next((values(r, fp4_key) for r in rows if r["mode"] == "bf16"), None)

  def paired(diff):
    if not np.isfinite(diff).all():
      return "n/a"
    std = f" ± {diff.std(ddof=1):.3f}" if diff.size > 1 else ""
    return f"{diff.mean():+.3f}{std} ({int((diff > 0).sum())}/{diff.size} seeds > 0)"

  lines = [
    "| policy | FP4-engine accuracy | BF16-engine accuracy | FP4 - BF16 engine, same policy | "
    "FP4 engine - PTQ of bf16, same seed |",
    "|---|---|---|---|---|",
  ]
  for r in rows:
    name = "bf16-trained, post-hoc PTQ" if r["mode"] == "bf16" else f"{r['mode']}-trained"
    name += "".join(f", {k}={v}" for k, v in r.get("overrides", {}).items() if k != "mode")
    gap = paired(values(r, fp4_key) - values(r, bf16_key))
    if r["mode"] == "bf16":
      vs_ptq = "(reference)"
    else:
      vs_ptq = "n/a (no bf16 run)" if ptq is None else paired(values(r, fp4_key) - ptq)
    cells = [name, format_cell(r, fp4_key), format_cell(r, bf16_key), gap, vs_ptq]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)
