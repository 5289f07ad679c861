"""Plots of sweep results: per-step curves averaged over seeds, and bars with a spread over seeds.

  rows = sweep.sweep(base, {"mode": [...]}, root=..., seeds=[0, 1, 2])
  fig, ax = plt.subplots(); plotting.curves(ax, rows, "reward/mean", label="mode")
  plotting.mode_comparison_figures(rows, "docs/figures")   # the README's figures
  plotting.mismatch_by_position_figure(rows, "docs/figures")  # mismatch against response position

Rows come from `sweep.sweep` (overrides, `<metric>:mean|std`, `workdirs`); per-step values are
read from each workdir's metrics.jsonl with `sweep.row_value` (so `agreement/deep` works).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np

from experiments import sweep
from trace_jax.metrics_writer import read_metrics

# One colour per mode, the same in every figure.
MODE_COLORS = {
  "bf16": "#444444",
  "fp4": "#d62728",
  "qat": "#ff7f0e",
  "qat_w4a16": "#9467bd",
  "quads": "#9467bd",  # experiments/outcome.py's name of qat_w4a16
  "qat+trm": "#8c564b",
  "trace": "#1f77b4",
  "trace_full": "#2ca02c",
}


def label_of(row: dict, label: str | Sequence[str]) -> str:
  """The row's value(s) of `label`, or its workdir `name` when it lacks them (list grids)."""
  keys = [label] if isinstance(label, str) else list(label)
  if any(k not in row for k in keys):
    return str(row.get("name", "?"))
  return ",".join(str(row[k]) for k in keys)


def _color(name: str, i: int):
  return MODE_COLORS.get(name, f"C{i % 10}")


def step_values(workdirs: Sequence[str], key: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps, values [seeds, steps]) of a per-step metric; NaN where a run lacks a step."""
  runs = [{r["step"]: sweep.row_value(r, key) for r in read_metrics(w)} for w in workdirs]
  steps = np.array(sorted({s for run in runs for s in run}), np.int64)
  values = np.array([[run.get(s, np.nan) for s in steps] for run in runs], np.float64)
  return steps, values


def smooth(values: np.ndarray, window: int) -> np.ndarray:
  """Trailing moving average along the last axis, ignoring NaN (window 1: unchanged)."""
  if window <= 1:
    return values
  out = np.full_like(values, np.nan)
  for t in range(values.shape[-1]):
    chunk = values[..., max(0, t - window + 1) : t + 1]
    with np.errstate(invalid="ignore"):
      count = np.sum(np.isfinite(chunk), axis=-1)
      out[..., t] = np.where(count > 0, np.nansum(chunk, axis=-1) / np.maximum(count, 1), np.nan)
  return out


def curves(ax, rows: Sequence[dict], key: str, *, label="mode", window: int = 5, logy: bool = False, title=None):
  """One line per row: the seed mean of `key` per step (moving average), shaded min..max over seeds."""
  for i, row in enumerate(rows):
    steps, values = step_values(row["workdirs"], key)
    if not np.isfinite(values).any():
      continue
    values = smooth(values, window)
    name = label_of(row, label)
    with np.errstate(invalid="ignore"):
      mean = np.nanmean(values, axis=0)
    ax.plot(steps, mean, color=_color(name, i), label=name)
    if values.shape[0] > 1:
      ax.fill_between(steps, np.nanmin(values, axis=0), np.nanmax(values, axis=0), color=_color(name, i), alpha=0.15)
  if logy:
    ax.set_yscale("log")
  ax.set_xlabel("RL step")
  ax.set_title(title or key + (f" (moving avg {window})" if window > 1 else ""))
  ax.grid(alpha=0.3)


def bars(ax, rows: Sequence[dict], metric: str, *, label="mode", logy: bool = False, title=None, fmt="{:.3g}"):
  """One bar per row: the seed mean of `metric` with a +/- std error bar, value printed on top."""
  names = [label_of(r, label) for r in rows]
  means = np.array([r[f"{metric}:mean"] for r in rows], np.float64)
  stds = np.array([r[f"{metric}:std"] for r in rows], np.float64)
  shown = np.where(np.isfinite(means), means, 0.0)
  x = np.arange(len(rows))
  ax.bar(
    x, shown, yerr=np.where(np.isfinite(stds), stds, 0.0), capsize=3, color=[_color(n, i) for i, n in enumerate(names)]
  )
  for xi, m in zip(x, means):
    ax.annotate(
      "n/a" if not np.isfinite(m) else fmt.format(m),
      (xi, m if np.isfinite(m) and m > 0 else 0),
      ha="center",
      va="bottom",
      fontsize=7,
      xytext=(0, 2),
      textcoords="offset points",
    )
  ax.set_xticks(x, names, rotation=30, ha="right")
  if logy:
    ax.set_yscale("log")
  ax.set_title(title or metric)
  ax.grid(axis="y", alpha=0.3)


def final_policy(ax, rows: Sequence[dict], *, label="mode"):
  """Greedy test accuracy of each trained policy with a BF16 and an FP4 engine.

  The `bf16` row's FP4 bar is post-hoc PTQ of the BF16-trained policy; the other FP4 bars are
  policies trained for (or with) the FP4 engine.
  """
  names = [label_of(r, label) for r in rows]
  x, width = np.arange(len(rows)), 0.38
  for offset, key, hatch, what in (
    (-width / 2, "final/accuracy_bf16_engine", "", "BF16 engine"),
    (width / 2, "final/accuracy_fp4_engine", "//", "FP4 engine"),
  ):
    means = np.array([r[f"{key}:mean"] for r in rows], np.float64)
    stds = np.array([r[f"{key}:std"] for r in rows], np.float64)
    ax.bar(
      x + offset,
      means,
      width,
      yerr=stds,
      capsize=3,
      hatch=hatch,
      label=what,
      color=[_color(n, i) for i, n in enumerate(names)],
      edgecolor="white",
    )
    for xi, m in zip(x + offset, means):
      ax.annotate(f"{m:.3f}", (xi, m), ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
  lo = np.nanmin([r[f"{k}:mean"] for r in rows for k in ("final/accuracy_bf16_engine", "final/accuracy_fp4_engine")])
  ax.set_ylim(max(0.0, lo - 0.1), 1.0)
  ax.set_xticks(x, [f"{n}\n(PTQ)" if n == "bf16" else n for n in names])
  ax.set_title("final greedy accuracy (left: BF16 engine, right: FP4 engine)")
  ax.grid(axis="y", alpha=0.3)


def late_per_layer(workdirs: Sequence[str], prefix: str = "agreement/", fraction: float = 0.2) -> dict[int, float]:
  """{layer: mean of the `<prefix>...layer<i>` metrics} over the last `fraction` of steps, all seeds
  and tensors (prefix `routing_agreement/` for routing)."""
  per_layer: dict[int, list[float]] = {}
  for workdir in workdirs:
    rows = read_metrics(workdir)
    for row in rows[-max(1, int(len(rows) * fraction)) :]:
      for key, value in row.items():
        if key.startswith(prefix) and value is not None and np.isfinite(value):
          per_layer.setdefault(int(key.rsplit("layer", 1)[1]), []).append(value)
  return {layer: float(np.mean(v)) for layer, v in sorted(per_layer.items())}


def layer_profile(ax, rows: Sequence[dict], *, label="mode", prefix: str = "agreement/", title=None):
  """One line per row: late agreement per layer (rows with nothing measured are skipped)."""
  for i, row in enumerate(rows):
    profile = late_per_layer(row["workdirs"], prefix)
    if profile:
      name = label_of(row, label)
      ax.plot(list(profile), list(profile.values()), "o-", color=_color(name, i), label=name)
  ax.set_xlabel("layer")
  ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
  ax.set_title(title or f"late {prefix.rstrip('/')} per layer")
  ax.grid(alpha=0.3)


POSITION_BIN = re.compile(r"/(?:pos(\d+)-\d+|len(\d+))$")  # rl.position_bin_names, rl.prefix_lengths


def late_by_position(
  workdirs: Sequence[str], metric: str = "logp_diff_mean", *, prefix="mismatch/by_position/", fraction: float = 0.2
) -> dict[int, list[float]]:
  """{bin start: [one value per run]}: each run's mean of `<prefix><metric>/pos<start>-<end>` over
  its last `fraction` of steps (NaN steps, i.e. empty bins, skipped; runs without the bin left out).
  prefix `mismatch/quant_part/by_position/` for the quantization part of asynchronous runs;
  `mismatch/by_length/` for the prefix metrics (`.../len<L>`: keyed by L)."""
  out: dict[int, list[float]] = {}
  for workdir in workdirs:
    rows = read_metrics(workdir)
    per_bin: dict[int, list[float]] = {}
    for row in rows[-max(1, int(len(rows) * fraction)) :]:
      for key, value in row.items():
        match = POSITION_BIN.search(key)
        if match and key.startswith(f"{prefix}{metric}/") and value is not None and np.isfinite(value):
          per_bin.setdefault(int(match.group(1) or match.group(2)), []).append(value)
    for start, values in per_bin.items():
      out.setdefault(start, []).append(float(np.mean(values)))
  return dict(sorted(out.items()))


def mismatch_by_position(
  ax,
  rows: Sequence[dict],
  label="mode",
  metric: str = "logp_diff_mean",
  *,
  prefix: str = "mismatch/by_position/",
  fraction: float = 0.2,
  logy: bool = False,
  title=None,
  xlabel: str = "response position (bin start)",
):
  """One line per row: the late-run mismatch `metric` (`logp_diff_mean`: |logp_train -
  logp_rollout|, `tis_weight_mean`: the TIS weight) per response-position bin, against the bin's
  start (log scale; linear below 8, so that the first bin [0, 8) shows at 0). Seed mean, shaded
  min..max over seeds; rows without the metric are skipped."""
  starts = set()
  for i, row in enumerate(rows):
    late = late_by_position(row["workdirs"], metric, prefix=prefix, fraction=fraction)
    if not late:
      continue
    name, x = label_of(row, label), np.array(list(late), np.float64)
    ax.plot(x, [np.mean(v) for v in late.values()], "o-", color=_color(name, i), label=name)
    if max(len(v) for v in late.values()) > 1:
      lo, hi = [np.min(v) for v in late.values()], [np.max(v) for v in late.values()]
      ax.fill_between(x, lo, hi, color=_color(name, i), alpha=0.15)
    starts |= set(late)
  ax.set_xscale("symlog", base=2, linthresh=8, linscale=0.5)
  if starts:
    ax.set_xticks(sorted(starts), [str(s) for s in sorted(starts)])
  ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
  if logy:
    ax.set_yscale("log")
  ax.set_xlabel(xlabel)
  ax.set_title(title or f"late {prefix}{metric}")
  ax.grid(alpha=0.3)


def mismatch_by_position_figure(
  rows: Sequence[dict], out_dir: str, *, label="mode", name: str = "mismatch_by_position.png"
) -> str:
  """`name` under `out_dir`, one line per row (mode); returns its path. Top: late |logp_train -
  logp_rollout| and TIS weight against the response position. Bottom: how the sequence-level ratio
  grows with length, |sum of the first L log-ratios| and the share of sequences whose ratio over
  their first L tokens leaves [0.5, 2] (rl.position_mismatch_metrics)."""
  os.makedirs(out_dir, exist_ok=True)
  fig, axes = plt.subplots(2, 2, figsize=(11, 8))
  mismatch_by_position(axes[0, 0], rows, label, "logp_diff_mean", logy=True, title="|logp_train - logp_rollout|")
  mismatch_by_position(axes[0, 1], rows, label, "tis_weight_mean", title="TIS weight")
  by_length = dict(prefix="mismatch/by_length/", xlabel="response length L (first L tokens)")
  mismatch_by_position(
    axes[1, 0],
    rows,
    label,
    "log_ratio_abs_mean",
    logy=True,
    title="|sequence log-ratio| over the first L tokens",
    **by_length,
  )
  mismatch_by_position(
    axes[1, 1], rows, label, "ratio_outside_0.5_2", title="sequences with ratio outside [0.5, 2]", **by_length
  )
  axes[0, 0].legend(fontsize=8)
  fig.suptitle("mismatch by response position: mean of the last 20% of steps, over seeds (shaded: min..max)")
  return _save(fig, out_dir, name)


SUMMARY_PANELS = (
  ("last:reward/mean", "late reward", False),
  ("last:mismatch/logp_diff_mean", "late |logp_train - logp_rollout|", True),
  ("last:agreement/deep", "codeword agreement, deeper half", False),
  ("last:routing_agreement", "routing agreement", False),
  ("last:guidance/bytes_per_token", "guidance bytes / token", False),
)


def mode_comparison_figures(rows: Sequence[dict], out_dir: str, *, label="mode", window: int = 5) -> list[str]:
  """curves.png (reward, mismatch), summary.png (one bar panel per SUMMARY_PANELS metric) and
  final_policy.png under `out_dir`; returns their paths."""
  os.makedirs(out_dir, exist_ok=True)
  paths = []

  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  curves(axes[0], rows, "reward/mean", label=label, window=window, title="reward (moving avg)")
  curves(
    axes[1],
    rows,
    "mismatch/logp_diff_mean",
    label=label,
    window=window,
    logy=True,
    title="|logp_train - logp_rollout| (moving avg)",
  )
  curves(axes[2], rows, "agreement/deep", label=label, window=window, title="codeword agreement, deeper half")
  axes[0].legend(fontsize=8)
  paths.append(_save(fig, out_dir, "curves.png"))

  fig, axes = plt.subplots(1, len(SUMMARY_PANELS), figsize=(4 * len(SUMMARY_PANELS), 4))
  for ax, (metric, title, logy) in zip(axes, SUMMARY_PANELS):
    bars(ax, rows, metric, label=label, logy=logy, title=title)
  seeds = sorted({r["seeds"] for r in rows})
  fig.suptitle(f"late = mean of the last 20% of steps; mean +/- sample std over {','.join(map(str, seeds))} seed(s)")
  paths.append(_save(fig, out_dir, "summary.png"))

  fig, ax = plt.subplots(figsize=(8, 4))
  final_policy(ax, rows, label=label)
  paths.append(_save(fig, out_dir, "final_policy.png"))
  return paths


def _save(fig, out_dir: str, name: str) -> str:
  path = os.path.join(out_dir, name)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
