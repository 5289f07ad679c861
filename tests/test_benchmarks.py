"""The GPU check (pallas_kernels/lab/gpu_check.py) on its CPU path, and the pieces it relies on: stage time
limits, failures recorded rather than raised, installs that never touch jax, the benchmarks' JSON."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from pallas_kernels.lab import bench_fp4_matmul, device_time, gpu_check

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_gpu_check_smoke_writes_every_stage(tmp_path):
  out = tmp_path / "check" / "gpu_check.json"
  cmd = [sys.executable, "pallas_kernels/lab/gpu_check.py", "--smoke", "--out", str(out)]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
  assert out.exists(), proc.stdout + proc.stderr
  report = json.loads(out.read_text())  # strict JSON: no NaN
  stages = report["stages"]
  assert list(stages) == list(gpu_check.STAGES), proc.stdout
  assert report["summary"] == {name: stage["status"] for name, stage in stages.items()}
  for name, stage in stages.items():
    assert stage["status"] in ("ok", "skipped"), (name, stage.get("stderr_tail"), stage.get("stdout_tail"))
    assert stage["seconds"] >= 0
  assert proc.returncode == 0, proc.stdout
  assert report["smoke"] and report["env"]["backend"] == "cpu" and report["env"]["jax"]
  assert stages["install"]["status"] == "skipped"

  tests = stages["kernel_tests"]["figures"]
  assert tests["interpret"] and tests["passed"] >= 3 and tests["failures"] == tests["errors"] == 0

  fp4 = stages["fp4_matmul"]["figures"]
  assert fp4["complete"] and fp4["smoke"] and fp4["copy_bw_gbps"] > 0
  for row in fp4["dense"] + fp4["grouped"]:
    assert row["err"] < 1e-2 and row["speedup"] > 0 and row["ptx_us"] is None  # no PTX in interpret mode

  main = stages["main"]["figures"]
  assert main["wall_s"] > 0 and "error" not in main["summary"] and main["summary"], main
  assert stages["main"]["command"].endswith("--config.checkpoint_every=2")  # MAIN_SMOKE's overrides

  scale = stages["rollout_scale"]["figures"]
  assert scale["smoke"] and {(r["system"], r["batch"]) for r in scale["rows"]} == {("bf16", 2), ("fp4", 2)}
  for row in scale["rows"]:
    assert row["new_tokens_per_s"] > 0 and row["compiled_memory"]["peak"] > 0
  assert set(scale["fp4_over_bf16"]) == {"2"}

  env = stages["env"]["figures"]
  assert isinstance(env["deprecation_warnings"], list), env["deprecation_warnings"]
  outcome = stages["outcome"]["figures"]  # the smoke grid within the stage's budget: bf16 first
  assert outcome["modes"]["bf16"]["seeds"] == [0] and outcome["regime"], outcome

  grpo = stages["grpo_step"]
  if os.path.exists(os.path.join(REPO, "experiments", "bench_grpo_step.py")):
    assert grpo["status"] == "ok" and grpo["figures"], grpo.get("stderr_tail")
  else:
    assert grpo["status"] == "skipped" and "not present" in grpo["reason"]
  logs = out.parent / "gpu_check_logs"
  assert (logs / "kernel_tests.xml").exists() and (logs / "main.log").exists() and (logs / "rollout_scale.log").exists()


def test_a_stage_past_its_limit_is_killed_and_recorded(tmp_path):
  # The child and its own child (the process group) are killed at the limit.
  code = "import subprocess, sys, time; print('started', flush=True); subprocess.Popen(['sleep', '60']); time.sleep(60)"
  cmd = [sys.executable, "-c", code]
  result = gpu_check._run(cmd, limit_s=2, log=tmp_path / "x.log")
  assert result["timed_out"] and result["seconds"] < 30
  stage = gpu_check._stage_record(cmd, result, 2, ok=True)
  assert stage["status"] == "timeout" and "started" in stage["stdout_tail"]

  cmd = [sys.executable, "-c", "import sys; sys.exit('it broke')"]
  stage = gpu_check._stage_record(cmd, gpu_check._run(cmd, limit_s=30, log=None), 30, ok=False)
  assert stage["status"] == "failed" and stage["returncode"] == 1 and "it broke" in stage["stderr_tail"]


ROWS_SCRIPT = """
import os, time
from pallas_kernels.lab import device_time
log = device_time.RowLog(os.environ["OUT"] + "/mosaic_variants.json", resume=os.environ.get("RESUME") == "1", row_s=1)
for name in ("fine", "hangs", "raises", "after"):
  if not log.done(name):
    with log.row(dict(name=name)) as row:
      if name == "hangs":
        time.sleep(60)  # as a kernel that never returns: faulthandler ends the process after row_s
      if name == "raises":
        raise ValueError("does not compile")
      row["device_us"] = 1.5
"""


def test_a_row_that_hangs_costs_that_row_not_the_run(tmp_path):
  # gpu_check's mosaic_variants stage reruns the script (RESUME=1) after a row ends the process.
  script = tmp_path / "rows.py"
  script.write_text(ROWS_SCRIPT)
  stage = gpu_check.stage_mosaic_variants(120, tmp_path, smoke=False, gpu=True, script=str(script))
  assert stage["runs"] == 2 and stage["returncode"] == 0, stage["stderr_tail"]
  rows = {r["name"]: r for r in stage["figures"]["rows"]}
  assert list(rows) == ["fine", "hangs", "raises", "after"]
  assert rows["fine"]["device_us"] == rows["after"]["device_us"] == 1.5
  assert rows["hangs"]["error"].startswith("no result: the process ended during this row (a hang past 1")
  assert rows["raises"]["error"] == "ValueError: does not compile"
  assert stage["status"] == "failed"  # a row with an error is a finding to look at
  assert not os.path.exists(device_time.pending_path(str(tmp_path / "mosaic_variants.json")))


def test_a_missing_benchmark_is_skipped(tmp_path):
  stage = gpu_check._bench_stage("nope", "experiments/no_such_bench.py", [], 10, tmp_path)
  assert stage["status"] == "skipped" and "not present" in stage["reason"]


def test_install_never_installs_jax_and_pins_what_is_installed(tmp_path, monkeypatch):
  installed = gpu_check._installed()
  assert "jax" in installed
  missing = {"tqdm", "torch", "ruff", "jax", "jaxlib"}
  monkeypatch.setattr(gpu_check, "_installed", lambda: {k: v for k, v in installed.items() if k not in missing})
  calls = []

  def fake_pip(args, constraints, limit_s, log):
    with open(constraints) as f:
      calls.append((args, dict(line.strip().split("==") for line in f)))
    return dict(returncode=0, timed_out=False, seconds=0.0, stdout="", stderr="")

  monkeypatch.setattr(gpu_check, "_pip", fake_pip)
  # A GPU jax: no CUDA plugin; ruff (dev tool), jax and jaxlib are left out; torch from the CPU index.
  stage = gpu_check.stage_install(60, tmp_path, {"nvidia_smi": {"query": "H200"}, "probe": {"backend": "gpu"}})
  assert stage["status"] == "ok" and stage["figures"]["cuda_plugin"] == []
  packages = [arg for args, _ in calls for arg in args]
  assert any(p.startswith("tqdm==") for p in packages) and any(p.startswith("torch==") for p in packages)
  assert not any(p.startswith(("jax", "ruff")) for p in packages)
  assert gpu_check.TORCH_CPU_INDEX in packages
  for _, pins in calls:
    assert pins["numpy"] == installed["numpy"] and "tqdm" not in pins

  # A GPU seen by nvidia-smi but a CPU-only jax: the CUDA plugin at the installed jax version.
  monkeypatch.setattr(gpu_check, "_installed", lambda: {k: v for k, v in installed.items() if k != "tqdm"})
  calls.clear()
  stage = gpu_check.stage_install(60, tmp_path, {"nvidia_smi": {"query": "H200"}, "probe": {"backend": "cpu"}})
  assert calls[0][0] == [f"jax[cuda12]=={installed['jax']}"] and "jax" not in calls[0][1]
  # Without a GPU nothing CUDA is installed, and nothing at all when nothing is missing.
  monkeypatch.setattr(gpu_check, "_installed", lambda: installed)
  calls.clear()
  stage = gpu_check.stage_install(60, tmp_path, {"nvidia_smi": None, "probe": {"backend": "cpu"}})
  assert stage["status"] == "ok" and calls == []


def test_junit_figures(tmp_path):
  xml = tmp_path / "junit.xml"
  xml.write_text(
    '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">'
    '<testcase classname="t" name="a" time="0.5"/><testcase classname="t" name="b" time="2">'
    '<failure message="assert 1 == 2">...</failure></testcase>'
    '<testcase classname="t" name="c" time="0"><skipped/></testcase><testcase classname="t" name="d" time="1"/>'
    "</testsuite></testsuites>"
  )
  figures = gpu_check._junit_figures(xml)
  assert (figures["tests"], figures["passed"], figures["failures"], figures["skipped"]) == (4, 2, 1, 1)
  assert figures["failed_tests"] == [dict(test="t::b", kind="failure", message="assert 1 == 2")]
  assert figures["slowest"][0] == dict(test="t::b", seconds=2.0)
  assert "error" in gpu_check._junit_figures(tmp_path / "missing.xml")
  # A run cut off at its limit writes no xml: the -v lines are counted instead.
  stdout = "tests/t.py::test_a[1-x y] PASSED   [ 10%]\ntests/t.py::test_b FAILED [ 20%]\ntests/t.py::test_c PASSED\n"
  assert gpu_check._pytest_outcomes(stdout) == {"passed": 2, "failed": 1, "failed_tests": ["tests/t.py::test_b"]}
  xdist = "[gw0] [ 10%] PASSED tests/t.py::test_a[1-x]\n[gw3] [ 20%] FAILED tests/t.py::test_b\n[gw1] [100%] SKIPPED tests/t.py::c\n"
  assert gpu_check._pytest_outcomes(xdist) == {
    "passed": 1, "failed": 1, "skipped": 1, "failed_tests": ["tests/t.py::test_b"]
  }  # fmt: skip


def test_fp4_report_is_strict_json_and_rewritten_per_row(tmp_path):
  path = tmp_path / "fp4.json"
  report = bench_fp4_matmul.Report(str(path))
  report.set(copy_bw_gbps=np.float32(2.5))
  report.add("dense", dict(m=1, ptx_us=float("nan"), speedup=np.float64(3.0), config=(1, 2)))
  assert json.loads(path.read_text()) == {
    "complete": False,
    "copy_bw_gbps": 2.5,
    "dense": [dict(m=1, ptx_us=None, speedup=3.0, config=[1, 2])],
  }
  report.add("dense", dict(m=8, speedup=math.inf))
  assert json.loads(path.read_text())["dense"][1] == dict(m=8, speedup=None)


def test_device_time_counts_the_gpu_streams_kernels_once():
  # A hand-made trace in the profiler's shape: a GPU's stream line, its XLA Ops summary line (the same
  # kernels again) and the host. Only the stream's kernels count, per call.
  meta = lambda ph_name, pid, name, tid=None: dict(ph="M", name=ph_name, pid=pid, tid=tid, args=dict(name=name))
  events = [
    meta("process_name", 1, "/device:GPU:0"),
    meta("thread_name", 1, "Stream #14(Kernel)", tid=7),
    meta("thread_name", 1, "XLA Ops", tid=8),
    meta("process_name", 2, "/host:CPU"),
    meta("thread_name", 2, "python", tid=1),
  ]
  for _ in range(2):  # two calls
    events += [
      dict(ph="X", pid=1, tid=7, name="kernel_mosaic_gpu_kernel", dur=60.0),
      dict(ph="X", pid=1, tid=7, name="loop_convert_fusion", dur=4.0),
      dict(ph="X", pid=1, tid=8, name="custom-call.1", dur=64.0),
      dict(ph="X", pid=2, tid=1, name="PjitFunction", dur=500.0),
    ]
  device_us, kernels, lines = device_time.parse_trace(events, reps=2)
  assert device_us == 64.0 and kernels == {"kernel_mosaic_gpu_kernel": 60.0, "loop_convert_fusion": 4.0}
  assert lines["/device:GPU:0 | XLA Ops"] == 64.0 and lines["/host:CPU | python"] == 500.0
  assert device_time.parse_trace(events[3:5] + events[-1:], reps=1)[0] is None  # no GPU: no device time


def test_device_time_measures_a_cpu_call():
  import jax
  import jax.numpy as jnp

  f = jax.jit(lambda a: jnp.tanh(a @ a))
  m = device_time.measure(f, (jnp.ones((64, 64)),), reps=3, profile_reps=2)
  assert m.wall_us > 0 and m.device_us is None and m.kernels == {}
  assert any(line.startswith("/host:CPU") for line in m.lines)  # the trace was read


def test_nominal_bandwidth_follows_the_device_kind():
  """%peak divides by the device's own HBM figure: an H100 SXM's 3.35 TB/s, not the H200's 4.8 (jax's
  device_kind strings); a device not listed gets NaN (no %peak) rather than another device's figure."""
  bw = bench_fp4_matmul.nominal_bandwidth
  assert bw("NVIDIA H200") == 4.8e12
  assert bw("NVIDIA H100 80GB HBM3") == 3.35e12
  assert bw("NVIDIA H100 PCIe") == 2.0e12
  assert bw("NVIDIA H100 NVL") == 3.9e12
  assert np.isnan(bw("NVIDIA A100-SXM4-80GB")) and np.isnan(bw("cpu")) and np.isnan(bw("NVIDIA GH200 480GB"))
