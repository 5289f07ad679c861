"""The experiment layer: the sweep API (runs, seeds, reuse of finished runs, separate processes),
the tables and plots of the mode comparison, and the notebooks, executed top to bottom.

Runs use the tiny overrides of the loop tests (tests/tiny.py) and 2 steps; the notebooks get
the same through a cell injected after their `parameters` cell, as papermill would.
"""

import json
import os
import re
import shutil
import struct

import nbclient
import nbformat
import numpy as np
import pytest

from configs import default
from experiments import compare_modes, plotting, sweep
from tests.tiny import TINY
from trace_jax import train
from trace_jax.config import ConfigError
from trace_jax.metrics_writer import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 2


@pytest.fixture(scope="module")
def overrides(tmp_path_factory):
  """Tiny runs of STEPS steps, evaluated only at the end, sharing one tfds data dir."""
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  return {**TINY, "steps": STEPS, "eval_every": 0, "checkpoint_every": STEPS, "data.data_dir": data_dir}


@pytest.fixture(scope="module")
def base(overrides):
  return sweep.configure(default.get_config(), overrides)


@pytest.fixture(scope="module")
def seeds_sweep(base, xla_cache, tmp_path_factory):
  """trace and bf16, seeds 0 and 1 (given as a generator: used once per grid point), in this process."""
  root = str(tmp_path_factory.mktemp("sweep"))
  seeds = (s for s in (0, 1))
  rows = sweep.sweep(base, {"mode": ["trace", "bf16"]}, root=root, seeds=seeds, metrics=compare_modes.METRICS)
  return root, rows


# --- sweep ------------------------------------------------------------------------------------


def test_configure_copies_and_names_unknown_fields():
  base = default.get_config()
  cfg = sweep.configure(base, {"rl.tis_cap": 0.0, "steps": 7})
  assert (cfg.rl.tis_cap, cfg.steps) == (0.0, 7)
  assert (base.rl.tis_cap, base.steps) == (5.0, 60)
  with pytest.raises(KeyError, match="rl.tis_capp"):
    sweep.configure(base, {"rl.tis_capp": 0.0})
  with pytest.raises(KeyError, match="'nosuch'"):
    sweep.configure(base, {"nosuch.field": 1})
  with pytest.raises(ValueError, match="seeds is empty"):
    sweep.sweep(base, {"mode": ["trace"]}, root="/nonexistent", seeds=[])


def test_expand_takes_grids_and_lists():
  assert sweep.expand({"a": [1, 2], "b.c": ["x", "y"]}) == [
    {"a": 1, "b.c": "x"},
    {"a": 1, "b.c": "y"},
    {"a": 2, "b.c": "x"},
    {"a": 2, "b.c": "y"},
  ]
  assert sweep.expand([{}, {"a": 1}]) == [{}, {"a": 1}]
  assert sweep.run_name({}) == "base"
  assert sweep.run_name({"trace.guidance_form": "full", "rl.tis_cap": 0.0}) == "trace.guidance_form=full,rl.tis_cap=0.0"


@pytest.mark.slow
def test_sweep_aggregates_seeds_from_each_runs_own_workdir(seeds_sweep):
  root, rows = seeds_sweep
  assert [r["mode"] for r in rows] == ["trace", "bf16"]
  checked = 0
  for row in rows:
    assert row["seeds"] == 2 and row["name"] == f"mode={row['mode']}" and row["overrides"] == {"mode": row["mode"]}
    assert row["workdirs"] == [os.path.join(root, f"mode={row['mode']}", f"seed{s}") for s in (0, 1)]
    late_dlogp = []
    for workdir, seed in zip(row["workdirs"], (0, 1)):
      with open(os.path.join(workdir, "config.json")) as f:
        config = json.load(f)
      assert (config["mode"], config["seed"], config["steps"]) == (row["mode"], seed, STEPS)
      steps = read_metrics(workdir)
      assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
      late_dlogp.append(steps[-1]["mismatch/logp_diff_mean"])  # the last 20% of 2 steps: the last one
    m = "last:mismatch/logp_diff_mean"
    assert row[f"{m}:values"] == late_dlogp and row[f"{m}:n"] == 2
    np.testing.assert_allclose(row[f"{m}:mean"], np.mean(late_dlogp), rtol=1e-12)
    np.testing.assert_allclose(row[f"{m}:std"], np.std(late_dlogp, ddof=1), rtol=1e-12)  # sample std
    for metric in compare_modes.METRICS:
      values = np.array(row[f"{metric}:values"])
      if np.isfinite(values).all():
        np.testing.assert_allclose(row[f"{metric}:mean"], values.mean(), rtol=1e-12)
        np.testing.assert_allclose(row[f"{metric}:std"], values.std(ddof=1), rtol=1e-12, atol=1e-15)
        checked += 1
      else:
        assert row[f"{metric}:n"] == 0 and np.isnan(row[f"{metric}:mean"])
  assert checked >= len(compare_modes.METRICS) + 6  # every metric for trace; bf16 lacks the FP4 codes
  trace, bf16 = rows
  assert late_dlogp[0] != late_dlogp[1]  # the seeds differ
  assert trace["last:guidance/bytes_per_token:mean"] > 0 and bf16["last:guidance/bytes_per_token:mean"] == 0
  assert 0 < trace["last:agreement/deep:mean"] <= 1 and np.isnan(bf16["last:agreement/deep:mean"])


def test_sweep_refuses_ambiguous_grids(base):
  with pytest.raises(ValueError, match="share the workdir name"):
    sweep.sweep(base, [{"rl.tis_cap": 0.0}, {"rl.tis_cap": 0.0}], root="/nonexistent")
  with pytest.raises(ValueError, match="pass seeds"):
    sweep.sweep(base, {"seed": [1, 2]}, root="/nonexistent")


@pytest.mark.slow
def test_run_reads_back_resumes_or_refuses(seeds_sweep, base, tmp_path, monkeypatch):
  """Finished under this config: read back. Fewer steps than asked (stopped, or extended):
  resumed. Another config: refused, naming the fields, nothing touched."""
  _, rows = seeds_sweep
  workdir = str(tmp_path / "run")
  shutil.copytree(rows[0]["workdirs"][0], workdir)
  cfg = sweep.configure(base, {"mode": "trace"})
  calls = []
  monkeypatch.setattr(train, "train_and_evaluate", lambda c, w: calls.append((c.steps, w)))
  assert sweep.run(cfg, workdir)["summary"]["steps"] == STEPS and calls == []
  with pytest.raises(ConfigError, match=r"\['rl'\]"):
    sweep.run(sweep.configure(cfg, {"rl.tis_cap": 0.0}), workdir)
  sweep.run(sweep.configure(cfg, {"steps": STEPS + 2}), workdir)
  assert calls == [(STEPS + 2, workdir)]
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump({**summary, "steps": STEPS - 1}, f)  # as a run stopped by SIGTERM leaves it
  sweep.run(cfg, workdir)
  assert calls[-1] == (STEPS, workdir)
  with pytest.raises(FileNotFoundError, match="no finished run"):
    sweep.run(None, str(tmp_path))


def test_extract_averages_the_last_fifth_and_the_layer_halves():
  rows = [
    {"step": i, "x": float(i), "agreement/moe_input/layer0": 0.5, "agreement/moe_input/layer1": 1.0} for i in range(10)
  ]
  result = {"summary": {"final/acc": 0.25}, "metrics": rows}
  assert sweep.extract(result, "last:x") == 8.5  # steps 8 and 9
  assert sweep.extract(result, "first:x") == 0.5  # steps 0 and 1
  assert sweep.extract(result, "final/acc") == 0.25
  assert np.isnan(sweep.extract(result, "nosuch"))
  assert sweep.extract(result, "last:agreement/deep") == 1.0
  assert sweep.extract(result, "last:agreement/shallow") == 0.5


@pytest.mark.slow
def test_finished_runs_are_read_back_not_rerun(seeds_sweep, base, monkeypatch):
  root, rows = seeds_sweep

  def fail(*args, **kwargs):
    raise AssertionError("a finished run was started again")

  monkeypatch.setattr(train, "train_and_evaluate", fail)
  again = sweep.sweep(base, {"mode": ["trace", "bf16"]}, root=root, seeds=[0, 1], metrics=compare_modes.METRICS)
  assert json.dumps(again) == json.dumps(rows)  # NaN included


@pytest.mark.slow
def test_a_run_in_its_own_process_matches_the_in_process_run(seeds_sweep, base, tmp_path, monkeypatch, xla_cache):
  _, rows = seeds_sweep
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", xla_cache)
  monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  cfg = sweep.configure(base, {"mode": "trace"})
  result = sweep.run(cfg, str(tmp_path / "run"), processes=True)
  assert os.path.exists(tmp_path / "run" / "sweep_config.py")
  strip = lambda ms: [json.dumps({k: v for k, v in m.items() if not k.startswith("time/")}, sort_keys=True) for m in ms]
  in_process = sweep.run(None, rows[0]["workdirs"][0])
  assert strip(result["metrics"]) == strip(in_process["metrics"])
  assert result["summary"] == in_process["summary"] and result["config"] == in_process["config"]


@pytest.mark.slow
def test_tables_and_figures(seeds_sweep, tmp_path):
  _, rows = seeds_sweep
  table = sweep.markdown(rows, compare_modes.METRICS, ["mode"], headers=compare_modes.HEADERS)
  lines = table.splitlines()
  assert len(lines) == 4 and "codeword agreement, deeper half" in lines[0] and "±" in lines[2]
  assert lines[3].startswith("| bf16 |") and "n/a" in lines[3]  # no FP4 engine, no codes to compare
  final = compare_modes.final_policy_table(rows)
  assert "bf16-trained, post-hoc PTQ" in final and "(reference)" in final and "/2 seeds > 0)" in final
  trace_fp4, ptq = (r["final/accuracy_fp4_engine:mean"] for r in rows)
  assert f"{trace_fp4 - ptq:+.3f}" in final.splitlines()[2]

  sweep.write_table(rows, str(tmp_path / "table"))
  with open(tmp_path / "table.json") as f:
    text = f.read()
  assert "NaN" not in text  # strict JSON: NaN is written as null
  saved = json.loads(text)
  assert saved[0]["last:reward/mean:mean"] == rows[0]["last:reward/mean:mean"]
  assert saved[1]["last:agreement/deep:mean"] is None and saved[1]["workdirs"] == rows[1]["workdirs"]
  with open(tmp_path / "table.csv") as f:
    header = f.readline().strip().split(",")
  assert header[0] == "mode" and "last:reward/mean:mean" in header and "workdirs" not in header

  paths = plotting.mode_comparison_figures(rows, str(tmp_path / "figures"))
  assert [os.path.basename(p) for p in paths] == ["curves.png", "summary.png", "final_policy.png"]
  for path in paths:
    with open(path, "rb") as f:
      head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert width > 400 and height > 200


@pytest.mark.slow
def test_smoothing_and_per_layer_profiles(seeds_sweep):
  values = np.array([[1.0, np.nan, 3.0, 5.0]])
  np.testing.assert_allclose(plotting.smooth(values, 2), [[1.0, 1.0, 3.0, 4.0]])
  _, rows = seeds_sweep
  profile = plotting.late_per_layer(rows[0]["workdirs"])
  assert sorted(profile) == [0, 1] and all(0 < v <= 1 for v in profile.values())
  # trace guides the deeper of the two layers (the experts' input and K/V; their hidden activation is
  # rounded to nearest): nearly every code matches
  assert profile[1] >= 0.999
  assert plotting.late_per_layer(rows[1]["workdirs"]) == {}


# --- notebooks --------------------------------------------------------------------------------


def execute_notebook(name, parameters: str, tmp_path, env):
  """Run experiments/<name> top to bottom (cwd experiments/), with `parameters` injected after
  the cell tagged 'parameters'; returns the executed notebook."""
  nb = nbformat.read(os.path.join(REPO, "experiments", name), as_version=4)
  index = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
  assert len(index) == 1, f"{name} needs exactly one cell tagged 'parameters'"
  nb.cells.insert(index[0] + 1, nbformat.v4.new_code_cell(parameters))
  client = nbclient.NotebookClient(
    nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": os.path.join(REPO, "experiments")}}
  )
  inherited = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}  # the kernel's inline backend shows figures
  client.execute(env={**inherited, **env})
  nbformat.write(nb, str(tmp_path / name))  # kept for a look when something fails
  return nb


def outputs_text(nb) -> str:
  texts = []
  for cell in nb.cells:
    for out in cell.get("outputs", []):
      texts.append(out.get("text", "") + str(out.get("data", {}).get("text/plain", "")))
  return "\n".join(texts)


@pytest.fixture
def kernel_env(xla_cache):
  return {
    "JAX_COMPILATION_CACHE_DIR": xla_cache,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.2",
    "JAX_PLATFORMS": "cpu",
  }


@pytest.mark.slow
def test_notebook_quantizer_and_guidance(tmp_path, kernel_env):
  nb = execute_notebook(
    "01_quantizer_and_guidance.ipynb", "NUM_PROMPTS = 4\nMAX_NEW_TOKENS = 4\n", tmp_path, kernel_env
  )
  text = outputs_text(nb)
  assert "Traceback" not in text


@pytest.mark.slow
def test_notebook_mode_comparison(overrides, tmp_path, kernel_env):
  root = tmp_path / "runs"
  # three of the five modes: every mode runs an RL step in test_train; here the notebook is under test
  params = f"STEPS = {STEPS}\nSEEDS = [0]\nMODES = ['bf16', 'qat', 'trace']\nRUN_ROOT = {str(root)!r}\nOVERRIDES = {overrides!r}\n"
  nb = execute_notebook("02_mode_comparison.ipynb", params, tmp_path, kernel_env)
  assert sorted(d for d in os.listdir(root) if d.startswith("mode=")) == ["mode=bf16", "mode=qat", "mode=trace"]
  for mode in ("bf16", "qat", "trace"):
    assert os.path.exists(root / f"mode={mode}" / "seed0" / "summary.json")
  for name in ("table.md", "final_policy.md", "curves.png", "summary.png", "final_policy.png"):
    assert os.path.exists(root / name), name
  images = sum("image/png" in out.get("data", {}) for c in nb.cells for out in c.get("outputs", []))
  assert images >= 3


@pytest.mark.slow
def test_notebook_ablations(overrides, tmp_path, kernel_env):
  root = tmp_path / "runs"
  params = f"STEPS = {STEPS}\nSEEDS = [0]\nRUN_ROOT = {str(root)!r}\nOVERRIDES = {overrides!r}\n"
  nb = execute_notebook("03_ablations.ipynb", params, tmp_path, kernel_env)
  runs = sorted(d for d in os.listdir(root) if d not in ("sft_cache",) and os.path.isdir(root / d))
  assert runs == sorted(
    [
      "base",
      "trace.guided_fraction=0.0",
      "trace.guided_fraction=0.25",
      "trace.guided_fraction=1.0",
      "trace.guidance_form=mantissa",
      "trace.guidance_form=full",
      "rl.tis_cap=0.0",
      "rl.routing_replay=False",
      "trace.tensors=moe_input",
      "trace.tensors=moe_input+moe_hidden+key+value",
      "trace.tensors=moe_input+moe_hidden",
    ]
  )
  with open(root / "table.json") as f:
    assert len(json.load(f)) == 11
  images = sum("image/png" in out.get("data", {}) for c in nb.cells for out in c.get("outputs", []))
  assert images >= 3


def test_mismatch_by_position_from_synthetic_runs(tmp_path):
  """Late-run means per response-position bin (last 20% of steps, empty bins skipped), one line per
  mode at the bins' starts, seeds averaged; the figure is a PNG. Synthetic metrics.jsonl, no runs."""
  plt = plotting.plt

  def write_run(workdir, scale):
    os.makedirs(workdir)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
      for step in range(1, 11):
        row = {"step": step, "mismatch/logp_diff_mean": 0.1}
        for stat, base in (("logp_diff_mean", 0.01), ("tis_weight_mean", 1.0)):
          for i, name in enumerate(["pos000-007", "pos008-015", "pos016-031"]):
            value = base + scale * (i + 1) * step
            row[f"mismatch/by_position/{stat}/{name}"] = None if (i == 2 and step == 10) else value  # empty bin
        for length in (8, 16, 32):
          row[f"mismatch/by_length/log_ratio_abs_mean/len{length:03d}"] = scale * length
          row[f"mismatch/by_length/ratio_outside_0.5_2/len{length:03d}"] = min(1.0, scale * length * 10)
        f.write(json.dumps(row) + "\n")

  rows = []
  for mode, scale in (("qat", 1e-3), ("trace", 1e-4)):
    workdirs = [str(tmp_path / mode / f"seed{s}") for s in (0, 1)]
    for s, w in enumerate(workdirs):
      write_run(w, scale * (1 + s))
    rows.append({"mode": mode, "workdirs": workdirs, "seeds": 2})
  empty = tmp_path / "bf16"
  empty.mkdir()
  rows.append({"mode": "bf16", "workdirs": [str(empty)], "seeds": 1})  # no metrics: skipped

  late = plotting.late_by_position(rows[0]["workdirs"])
  assert list(late) == [0, 8, 16]
  np.testing.assert_allclose(late[0], [0.01 + 1e-3 * 9.5, 0.01 + 2e-3 * 9.5])  # steps 9 and 10
  np.testing.assert_allclose(late[16], [0.01 + 3e-3 * 9, 0.01 + 6e-3 * 9])  # step 10's bin was empty

  fig, ax = plt.subplots()
  plotting.mismatch_by_position(ax, rows, metric="tis_weight_mean")
  assert [line.get_label() for line in ax.lines] == ["qat", "trace"]
  x, y = ax.lines[1].get_xdata(), ax.lines[1].get_ydata()
  np.testing.assert_allclose(x, [0, 8, 16])
  np.testing.assert_allclose(y[1], 1.0 + 1.5 * 2e-4 * 9.5)  # trace, [8, 16): the mean over both seeds
  assert ax.get_xscale() == "symlog"
  plt.close(fig)

  by_length = plotting.late_by_position(rows[1]["workdirs"], "log_ratio_abs_mean", prefix="mismatch/by_length/")
  assert list(by_length) == [8, 16, 32]  # keyed by the prefix length L
  np.testing.assert_allclose(by_length[32], [1e-4 * 32, 2e-4 * 32])  # seeds 0 and 1

  path = plotting.mismatch_by_position_figure(rows, str(tmp_path / "figures"))
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_long_horizon_length_scaling_from_synthetic_runs(tmp_path):
  """The power law of |s_L| and the extrapolated length where half the ratios leave [0.5, 2]: a
  random walk (|s_L| = c sqrt(L)) gives alpha 0.5 and L_half = 64 (m / |s_64|)**2."""
  from experiments import long_horizon

  rows = []
  for name, c in (("walk", 0.01), ("none", None)):
    workdir = tmp_path / name / "seed0"
    os.makedirs(workdir)
    with open(workdir / "metrics.jsonl", "w") as f:
      for step in range(1, 6):
        row = {"step": step}
        if c is not None:
          for length in (8, 16, 32, 64):
            row[f"mismatch/by_length/log_ratio_abs_mean/len{length:03d}"] = c * np.sqrt(length)
            row[f"mismatch/by_length/ratio_outside_0.5_2/len{length:03d}"] = 0.01 * length / 64
        f.write(json.dumps(row) + "\n")
    rows.append({"name": name, "workdirs": [str(workdir)], "seeds": 1})
  (got,) = long_horizon.length_scaling(rows)  # "none" has no by_length metrics: left out
  assert got["setting"] == "walk" and got["longest"] == 64
  assert got["alpha"] == pytest.approx(0.5) and got["outside_at_longest"] == pytest.approx(0.01)
  m = long_horizon.HALF_OUTSIDE_ABS_MEAN
  assert m == pytest.approx(0.82, abs=0.005)  # log 2 / 0.6745 * sqrt(2 / pi)
  assert got["half_outside_length"] == pytest.approx(64 * (m / (0.01 * 8)) ** 2, rel=1e-6)
  table = long_horizon.length_markdown([got])
  cells = [len(re.split(r"(?<!\\)\|", line)) for line in table.splitlines()]  # \| is a pipe in a cell
  assert cells == [10, 10, 10] and "| walk |" in table


@pytest.mark.slow
def test_long_horizon_comparison_smoke(tmp_path):
  """experiments/long_horizon.py end to end on its smoke base (tiny model, 4 terms, 2 steps, 1 seed)."""
  from experiments import long_horizon

  args = long_horizon.parse(["--smoke", "--settings=fp4_no_tis,trace", f"--root={tmp_path}"])
  rows = long_horizon.main(args)
  assert [r["name"] for r in rows] == ["mode=fp4,rl.tis_cap=0.0", "mode=trace"]
  assert rows[0]["last:response/length_mean:mean"] > 0
  assert rows[1]["last:guidance/bytes_per_token:mean"] > 0 == rows[0]["last:guidance/bytes_per_token:mean"]
  for name in (
    "table.md",
    "final_policy.md",
    "mismatch_by_length.md",
    "curves.png",
    "summary.png",
    "mismatch_by_position.png",
  ):
    assert (tmp_path / name).exists(), name
  assert "fp4-trained, rl.tis_cap=0.0" in (tmp_path / "final_policy.md").read_text()
