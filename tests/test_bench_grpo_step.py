"""The benchmark scripts: a smoke run finishes and writes the figures it promises.

experiments/bench_grpo_step.py --smoke times our GRPO step in `trace` mode (the one with the most
parts: FP4 engine, guidance, guided QAT) for 2 steps of 8 new tokens, Tunix skipped, in a fresh
process as a user would run it; the table and the goal lines are checked on made-up figures.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from experiments import bench_grpo_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_grpo_step_benchmark_smoke_writes_every_figure(tmp_path):
  out = tmp_path / "bench.json"
  cmd = [sys.executable, "experiments/bench_grpo_step.py", "--smoke", "--modes", "trace", "--json", str(out)]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "| ours trace |" in proc.stdout and "recompiles in the timed steps: none" in proc.stdout
  fig = json.loads(out.read_text())

  assert fig["config"]["smoke"] and fig["config"]["new_tokens"] == 8 and fig["config"]["steps"] == 2
  assert fig["host"]["backend"] == "cpu" and fig["host"]["jax"]
  assert fig["tunix"] is None and fig["tunix_status"].startswith("skipped")
  assert set(fig["ours"]) == {"trace"}
  for mode, r in fig["ours"].items():
    for key in ("first_call_s", "step_s", "step_s_min", "step_cpu_s", "rollout_s", "train_s"):
      assert r[key] > 0, (mode, key, r[key])
    assert r["first_call_s"] > r["step_s"]  # the first call compiles
    assert r["first_call_compiles"] > 0
    assert len(r["steps_s"]) == 2
    # steps 0 and 3 (the first and the last) record the diagnostics' codes; the warm-up step 1 compiles the
    # programs without them, and then nothing recompiles
    assert r["compiles_after_first"][1:] == [0, 0] and r["compiled_in_timed_steps"] == [], r["compiled_after_first"]
    # timed steps 2 (without) and 3 (with): a run's mean step weighs them 9 : 1
    assert r["diagnostics_every"] == 10 and r["step_s_without_diagnostics"] == r["steps_s"][0]
    assert r["step_s_run"] == pytest.approx((9 * r["steps_s"][0] + r["steps_s"][1]) / 10)
    assert r["last_finite"] and r["last_response_length"] == 8  # EOS off: every response is max_new_tokens long
  assert fig["ratios"] == fig["ratios_cpu_s"] == fig["meets"] == {}


def _figures(step_s, train=True):
  rows = [{"wall_s": 10.0, "cpu_s": 10.0, "rollout_s": 4.0, "compiles": 5, "compile_s": 8.0, "compiled": ["a"]}]
  rows += [
    {"wall_s": s, "cpu_s": s, "rollout_s": s / 2, "compiles": 0, "compile_s": 0.0, "compiled": []} for s in step_s
  ]
  if train:
    for r in rows:
      r["train_s"] = r["wall_s"] / 4
  return bench_grpo_step._figures(rows, warmup=1)


def test_report_prints_the_table_ratios_and_goals(capsys):
  ours = {
    "bf16": _figures([9.0, 1.0, 1.2, 0.8]),
    "qat": _figures([9.0, 2.0, 2.0, 2.0]),
    "trace": _figures([9, 2.4, 2.1, 2.2]),
  }
  tunix = {**_figures([9.0, 3.0, 2.5, 2.0], train=False), "dtype": "float32"}
  assert ours["bf16"]["step_s"] == 1.0 and ours["bf16"]["step_s_min"] == 0.8  # the warm-up step (9 s) is left out
  assert ours["bf16"]["train_s"] == 0.25 and ours["bf16"]["other_s"] == pytest.approx(0.25)
  assert tunix["other_s"] == pytest.approx(1.25) and "train_s" not in tunix
  args = bench_grpo_step._args(["--steps", "3", "--warmup", "1"])
  ratios, ratios_cpu, goals = bench_grpo_step.report(args, ours, tunix, "google-tunix 0.1.7")
  assert ratios == pytest.approx({"bf16/tunix": 0.4, "qat/tunix": 0.8, "trace/tunix": 0.88, "trace/qat": 1.1})
  assert ratios_cpu == pytest.approx(ratios)  # made-up rows: CPU seconds = wall seconds
  assert goals == {"bf16/tunix": True, "qat/tunix": False, "trace/tunix": False, "trace/qat": True}
  out = capsys.readouterr().out
  assert "| ours trace | 10.00 | 2.200 | 2.100 | 2.200 |" in out and "| tunix (float32) | 10.00 | 2.500 |" in out
  assert "ours bf16 / Tunix step: 0.400 (meets the <= 0.5 goal); CPU seconds per step: 0.400" in out
  assert "ours trace / Tunix step: 0.880 (misses the <= 0.5 goal); CPU seconds per step: 0.880" in out
  assert "TRACE / QAT step: 1.100 (meets the <= 1.1 goal); CPU seconds per step: 1.100" in out
  assert "recompiles in the timed steps: none" in out

  ratios, ratios_cpu, goals = bench_grpo_step.report(args, {"trace": ours["trace"]}, None, "skipped (--tunix=skip)")
  assert ratios == ratios_cpu == goals == {}
  assert "ours / Tunix step: not measured (Tunix skipped (--tunix=skip))" in capsys.readouterr().out


def test_a_runs_mean_step_weighs_the_diagnostic_steps_by_their_cadence():
  """diagnostics_every n: step_s_run = ((n - 1) x the median step without the codes + the median with) / n."""
  rows = [{"wall_s": 10.0, "cpu_s": 10.0, "rollout_s": 4.0, "compiles": 5, "compile_s": 8.0, "compiled": ["a"]}]
  for s, diagnosed in ((1.0, False), (1.2, False), (3.0, True), (1.1, False)):
    rows.append({"wall_s": s, "cpu_s": s, "rollout_s": s / 2, "compiles": 0, "compile_s": 0.0, "compiled": []})
    rows[-1]["diagnostics"] = diagnosed
  fig = bench_grpo_step._figures(rows, warmup=0, diagnostics_every=4)
  assert fig["step_s"] == pytest.approx(1.15) and fig["step_s_without_diagnostics"] == pytest.approx(1.1)
  assert fig["step_s_with_diagnostics"] == 3.0 and fig["step_s_run"] == pytest.approx((3 * 1.1 + 3.0) / 4)
  assert bench_grpo_step._figures(rows, warmup=0)["step_s_run"] == fig["step_s"]  # no cadence: the median


def test_tunix_is_skipped_with_install_instructions_when_it_does_not_import(tmp_path):
  args = bench_grpo_step._args(["--tunix=skip"])
  assert bench_grpo_step._tunix_python(args) == (None, "skipped (--tunix=skip)")
  if importlib.util.find_spec("tunix") is not None:
    pytest.skip("Tunix is installed in this interpreter")
  venv = str(tmp_path / "venv")  # not created: auto never installs
  args = bench_grpo_step._args(["--tunix=auto", "--tunix_python", sys.executable, "--tunix_venv", venv])
  python, status = bench_grpo_step._tunix_python(args)
  assert python is None
  assert "does not import" in status and "pip install google-tunix==0.1.7" in status and "--tunix=install" in status
  assert not os.path.exists(venv)


def test_config_overrides_parse_literals():
  assert bench_grpo_step._parse_sets(["trace.diagnostics=False", "trainer_dtype=float32", "rl.tis_cap=0"]) == {
    "trace.diagnostics": False,
    "trainer_dtype": "float32",
    "rl.tis_cap": 0,
  }
  with pytest.raises(ValueError, match="KEY=VALUE"):
    bench_grpo_step._parse_sets(["steps"])
