"""Every program of the GPU check's main and rollout_scale stages, compiled for an H200 (sm_90a) on this CPU
machine, fits an 80 GB GPU: a shape that does not, or a program that does not compile, is found here rather than
in a GPU window.

One child process per shape runs experiments/sm90_programs.py (the same script makes docs/gpu/sm90_programs.md),
with JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 set before its jax starts. Needs requirements-gpu-compile.txt; skipped,
with what is missing, without it.
  default        configs/default.py (what `python -m trace_jax.main` runs): ~3 min on 2 cores, 8 programs.
  rollout_scale  experiments/bench_rollout_scale.py's Qwen3-30B-A3B-shaped model: `generate` at 2 and 4 layers,
                 fitted to the benchmark's layer count; the train step at 2 layers (slow).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from pallas_kernels import gpu_compile
from trace_jax.config import MODES

ROOT = pathlib.Path(__file__).resolve().parents[1]
MISSING = gpu_compile.missing(check_env=False)  # the child process gets the variable
GPU_BYTES = 80 * 10**9
SHAPES = ("default", pytest.param("rollout_scale", marks=pytest.mark.slow))

needs_toolchain = pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING))

_ROWS: dict[str, list[dict]] = {}


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
  """shape -> its rows, compiled once per module (each shape in its own child process)."""

  def rows(shape: str) -> list[dict]:
    if shape not in _ROWS:
      out = tmp_path_factory.mktemp("sm90") / f"{shape}.json"
      cmd = [sys.executable, "experiments/sm90_programs.py", "--shapes", shape, "--json", str(out)]
      env = {**os.environ, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "PYTHONPATH": str(ROOT)}
      proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
      assert proc.returncode == 0, proc.stderr[-4000:]
      _ROWS[shape] = json.loads(out.read_text())
    return _ROWS[shape]

  return rows


def _fits(row: dict):
  assert row["peak"] == row["argument"] + row["output"] - row["alias"] + row["temp"]
  assert 0 < row["peak"] < GPU_BYTES, f"{row['program']} {row['system']} needs {row['peak'] / 1e9:.1f} GB: {row}"


@needs_toolchain
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("system", ("bf16", "fp4"))
def test_sm90_compile_engine_generate(programs, shape, system):
  """`rollout.generate` (prefill + decode loop) of the BF16 and the FP4 engine, with the expert kernel Hopper picks
  (read from the compiled program): for FP4 the Mosaic GPU kernel where its shapes allow (rollout_scale), the
  Triton kernel otherwise (the tiny default); for BF16 the Triton bf16 grouped kernel."""
  rows = [r for r in programs(shape) if r["program"] == "generate" and r["system"] == system]
  assert rows
  for row in rows:
    _fits(row)
  if system == "fp4":
    assert {r["expert_kernel"] for r in rows} == {"Mosaic GPU" if shape == "rollout_scale" else "Triton"}
  else:  # the same family's bf16 kernel, not XLA:GPU's ragged_dot (a dense matmul over every expert)
    assert {r["expert_kernel"] for r in rows} == {"Triton bf16"}
  if shape == "rollout_scale":  # two depths compiled, one fitted to the benchmark's layer count
    from experiments import bench_rollout_scale

    assert [r["layers"] for r in rows] == [2, 4, bench_rollout_scale.LAYERS] and rows[-1]["fitted_from"] == [2, 4]
    assert rows[-1]["peak"] > rows[1]["peak"] > rows[0]["peak"]


@needs_toolchain
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", MODES)
def test_sm90_compile_rl_train_step(programs, shape, mode):
  """The RL train step (trainer.make_rl_step: the mode's QAT forward, GRPO loss, backward, AdamW) of every mode."""
  [row] = [r for r in programs(shape) if r["program"] == "rl_train_step" and r["system"] == mode]
  _fits(row)


def test_the_committed_table_lists_every_program():
  table = (ROOT / "docs" / "gpu" / "sm90_programs.md").read_text()
  for mode in MODES:
    assert f"| default | rl_train_step | {mode} |" in table and f"| rollout_scale | rl_train_step | {mode} |" in table
  for shape in ("default", "rollout_scale"):
    for system in ("bf16", "fp4"):
      assert f"| {shape} | generate | {system} |" in table
