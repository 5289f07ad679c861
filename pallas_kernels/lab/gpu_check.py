"""One GPU check: every GPU figure this project needs, in one run that stops itself at --total_s.

On the GPU machine, from the repository root (writes $OUT/gpu_check.json if $OUT is set, else
gpu_check.json in the repository root, and the stages' logs beside it in gpu_check_logs/):

  bash pallas_kernels/lab/gpu_check.sh                 # = python pallas_kernels/lab/gpu_check.py --out ${OUT:-.}/gpu_check.json

Through the device tool, within a 15-minute lease, run it once within about 9.5 minutes:
run(command="bash pallas_kernels/lab/gpu_check.sh --total_s 570", timeout_s=600). The RL job comes first (the
figures that matter most), the kernel work last: the run stops itself after --total_s plus a few seconds, and
stages past it are recorded as "out of time". It exits 0 when every stage is "ok" or "skipped". If the machine
reaches no package index, the install stage fails in seconds and the env stage's figures.missing_for_stage
name what each stage lacks. Every program of the main and rollout_scale stages was compiled for sm_90a
beforehand, without a GPU (experiments/sm90_programs.py, docs/gpu/sm90_programs.md, tests/test_sm90_programs.py).

Then commit the JSON as docs/gpu_check/<device>-<date>-gpu_check.json and quote in the README's performance
page: rollout_scale's tokens/s BF16 and FP4 and their ratio (fp4_over_bf16), main's wall time, the GRPO step
time. A stage that failed or ran out of time keeps its stderr / stdout tail (and the whole log under
gpu_check_logs/); the benchmarks keep the rows they measured before they were cut off. Rerun a subset with
--stages main,rollout_scale.

  python pallas_kernels/lab/gpu_check.py --smoke --out /tmp/gpu_check.json   # CPU path: no installs, tiny sizes (~4 min, 2 cores)

Stages, in order, each in its own process with its own time limit (a stage's limit is cut so that
every later stage keeps at least --reserve_s of --total_s; one that fails or times out is recorded
and the run goes on):

  env           jax / jaxlib versions, backend and devices (probed in a child process, so that this
                process never holds the GPU), nvidia-smi, the versions of every required package; and the
                DeprecationWarnings / FutureWarnings of importing the RL job and running a tiny engine
                (a child under -W always::DeprecationWarning; `jax`: from jax), since the GPU image's jax
                (0.11) is newer than this machine's (0.10.2).
  install       (not with --smoke or --no_install) pip-installs the packages of requirements.txt and
                requirements-test.txt that are not installed at all, under a constraints file that
                pins every installed distribution: nothing installed changes version, jax above all
                (the GPU image's jax 0.11 stays). jax and jaxlib are never installed from the
                requirements; `jax[cuda12]` at the installed jax version only if nvidia-smi sees a
                GPU and jax has no GPU backend. torch comes from the CPU wheel index.
                Dev-only tools (ruff, notebooks) are left out.
  main          the README's main command, `python -m trace_jax.main --config=configs/default.py
                --workdir=gpu_check_logs/main_workdir` (--smoke: MAIN_SMOKE's tiny overrides, 2 steps); it must
                finish; figures: summary.json and the wall time.
  rollout_scale experiments/bench_rollout_scale.py --json: our BF16 engine against our FP4 engine end to end at
                Qwen3-30B-A3B's layer shapes (as many layers as fit 80 GB in BF16), batch 64 and 256, prompt
                512, 1024 new tokens: tokens/s, the compiled programs' memory, peak device memory (--smoke: tiny).
  grpo_step     experiments/bench_grpo_step.py --json --modes bf16,qat,trace --tunix auto
                (--smoke: --smoke --tunix skip --modes bf16).
  outcome       experiments/outcome.py --gpu --json, BUDGET_S in its environment: the outcome issue's GPU-scale
                protocol (GPU_REGIME), the modes in GPU_MODE_ORDER as fit (--smoke: --smoke --modes bf16).
  kernel_tests  tests/test_fp4_mosaic.py and tests/test_pallas_kernels.py with TRACE_PALLAS_INTERPRET=0
                (4 pytest-xdist processes; a test past 90 s, a kernel that hangs, ends its process and the
                others go on) on a GPU: the Pallas kernels compiled through Triton (and the inline-PTX decode)
                and the Mosaic GPU kernel against their jnp references. --smoke: interpret mode, a few tests.
  mosaic_variants  pallas_kernels/lab/mosaic_variants.py (GPU only): the Mosaic kernel's variants and the bf16
                baselines, dense and grouped, each with its wall-clock and device (profiler) time; figures.rows.
                A row that hangs is recorded as such and the script is rerun from the next row.
  fp4_matmul    pallas_kernels/lab/bench_fp4_matmul.py --json (BF16 against the FP4 kernels; --smoke: tiny).

The JSON: {"stages": {name: {"status": "ok" | "failed" | "timeout" | "skipped", "seconds",
"limit_s", "command", "returncode", "figures", "stdout_tail", "stderr_tail", ...}}, "summary":
{name: status}, "env": {...}, "git": {...}, ...}; it is rewritten after every stage.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from importlib import metadata

REPO = pathlib.Path(__file__).resolve().parents[2]
STAGES = (
  "env", "install", "main", "rollout_scale", "grpo_step", "outcome", "kernel_tests", "mosaic_variants", "fp4_matmul"
)  # fmt: skip
# Upper limits in seconds on one H200 (each is also cut to leave --reserve_s to every later stage).
LIMITS = {
  "env": 60, "install": 120, "main": 180, "rollout_scale": 200, "grpo_step": 100, "outcome": 120,
  "kernel_tests": 150, "mosaic_variants": 240, "fp4_matmul": 90,
}  # fmt: skip
SMOKE_LIMITS = {
  "env": 90, "install": 0, "main": 300, "rollout_scale": 120, "grpo_step": 180, "outcome": 180, "kernel_tests": 90,
  "mosaic_variants": 10, "fp4_matmul": 120,
}  # fmt: skip
# main under --smoke: configs/default.py's SMOKE model and batch (2 layers, 2 prompts x 2), 2 RL steps, 2 SFT
# steps, a small eval (the flags of `python -m trace_jax.main --config.FIELD=VALUE`).
MAIN_SMOKE = (
  "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
  "model.num_experts=4", "model.num_experts_per_tok=2", "model.moe_intermediate_size=16", "batch_prompts=2",
  "rl.num_generations=2", "sft.steps=2", "sft.batch_size=8", "steps=2", "eval_prompts=4", "checkpoint_every=2",
)  # fmt: skip
# --smoke: a few interpret-mode kernel tests (dense, grouped, the decodes, dispatch), ~10 s on 2 cores.
SMOKE_KERNEL_TESTS = (
  "e2m1_decode_every_byte or e4m3_decode_every_byte or fp4_matmul_bf16_output or grouped_fp4_matmul_shapes"
  " or grouped_packed_matmul_dispatch"
)
NEVER_INSTALL = {"jax", "jaxlib"}  # the image's jax (with its CUDA plugins) stays as it is
NOT_NEEDED = {"ruff", "nbclient", "nbformat", "ipykernel"}  # dev tools: no stage uses them
# The distributions each stage imports besides jax (checked by the env stage, without importing them).
NEEDS = {
  "kernel_tests": ["pytest", "absl-py", "ml-dtypes", "numpy"],
  "fp4_matmul": ["absl-py", "ml-dtypes", "numpy"],
  "main": ["absl-py", "ml-dtypes", "numpy", "ml-collections", "optax"],
  "rollout_scale": ["absl-py", "ml-dtypes", "numpy", "ml-collections", "optax"],
}
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TAIL = 4000  # characters of stdout / stderr kept per stage

PROBE = r"""
import json, platform, sys
from importlib import metadata
import jax
devices = jax.devices()
info = dict(python=sys.version.split()[0], platform=platform.platform(), jax=jax.__version__,
            jaxlib=metadata.version("jaxlib"), backend=jax.default_backend(),
            devices=[f"{d.platform}:{d.id} {d.device_kind}" for d in devices], device_count=len(devices),
            device_kind=devices[0].device_kind)
try:
  info["memory_stats"] = {k: v for k, v in (devices[0].memory_stats() or {}).items() if k == "bytes_limit"}
except Exception:
  pass
print("PROBE " + json.dumps(info))
"""

# Run with -W always::DeprecationWarning: imports the RL job and runs a tiny engine (bf16), recording every
# DeprecationWarning / FutureWarning on the way (the GPU image's jax may deprecate what this one does not).
DEPRECATIONS = r"""
import json, warnings
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  import trace_jax.main, trace_jax.train
  from experiments import bench_rollout_scale
  bench_rollout_scale.main(["--smoke", "--systems", "bf16", "--repeats", "0"])
rows = [dict(category=w.category.__name__, message=str(w.message)[:300], where=f"{w.filename}:{w.lineno}",
             jax="jax" in w.filename or "jax" in str(w.message).lower())
        for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]
print("DEPRECATIONS " + json.dumps(list({(r["message"], r["where"]): r for r in rows}.values())))
"""


def _now() -> str:
  return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _tail(text: str | bytes | None, n: int = TAIL) -> str:
  if isinstance(text, bytes):
    text = text.decode(errors="replace")
  return (text or "")[-n:]


def _run(cmd: list[str], *, limit_s: float, log: pathlib.Path | None, env: dict | None = None) -> dict:
  """Runs cmd from the repository root in its own process group; kills the whole group at limit_s."""
  start = time.monotonic()
  proc = subprocess.Popen(
    cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, text=True
  )
  timed_out = False
  try:
    stdout, stderr = proc.communicate(timeout=max(limit_s, 1))
  except subprocess.TimeoutExpired:
    timed_out = True
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    stdout, stderr = proc.communicate()
  seconds = time.monotonic() - start
  if log is not None:
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}\n")
  return dict(returncode=proc.returncode, timed_out=timed_out, seconds=seconds, stdout=stdout, stderr=stderr)


def _stage_record(cmd, result, limit_s, ok: bool, **extra) -> dict:
  status = "timeout" if result["timed_out"] else ("ok" if ok else "failed")
  return dict(
    status=status,
    seconds=round(result["seconds"], 2),
    limit_s=round(limit_s, 1),
    command=" ".join(cmd),
    returncode=result["returncode"],
    stdout_tail=_tail(result["stdout"]),
    stderr_tail=_tail(result["stderr"]),
    **extra,
  )


def _child_env(**extra) -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
  env["PYTHONUNBUFFERED"] = "1"
  env.update({k: str(v) for k, v in extra.items()})
  return env


def _read_json(path: pathlib.Path):
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError) as e:
    return {"error": f"no figures: {type(e).__name__}: {e}"}


# --- env and install -----------------------------------------------------------------------------


def _nvidia_smi() -> dict | None:
  if not shutil.which("nvidia-smi"):
    return None
  out = {}
  for key, cmd in (
    ("query", ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit", "--format=csv"]),
    ("full", ["nvidia-smi"]),
  ):
    try:
      out[key] = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
      out[key] = f"{type(e).__name__}: {e}"
  return out


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _installed() -> dict[str, str]:
  versions = {}
  for dist in metadata.distributions():
    name = dist.metadata["Name"]
    if name:
      versions.setdefault(_norm(name), dist.version)
  return versions


def _requirements() -> list[tuple[str, str]]:
  """(name, requirement line) of requirements.txt and requirements-test.txt, without -r lines."""
  reqs = []
  for file in ("requirements.txt", "requirements-test.txt"):
    for line in (REPO / file).read_text().splitlines():
      line = line.split("#", 1)[0].strip()
      if not line or line.startswith("-"):
        continue
      name = re.split(r"[\s\[<>=!~;]", line, maxsplit=1)[0]
      reqs.append((_norm(name), line))
  return list(dict(reqs).items())


def stage_env(limit_s: float, logs: pathlib.Path, log_name: str = "env.log") -> dict:
  cmd = [sys.executable, "-c", PROBE]
  result = _run(cmd, limit_s=limit_s, log=logs / log_name, env=_child_env(XLA_PYTHON_CLIENT_PREALLOCATE="false"))
  probe = {}
  for line in result["stdout"].splitlines():
    if line.startswith("PROBE "):
      probe = json.loads(line[len("PROBE ") :])
  installed = _installed()
  packages = {name: installed.get(name) for name, _ in _requirements()}
  for extra in ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt", "triton", "pip"):
    if extra in installed:
      packages[extra] = installed[extra]
  missing = {stage: [d for d in needs if d not in installed] for stage, needs in NEEDS.items()}
  deprecations = _run([sys.executable, "-W", "always::DeprecationWarning", "-c", DEPRECATIONS],
                      limit_s=max(limit_s - result["seconds"], 5), log=logs / f"deprecations_{log_name}",
                      env=_child_env(XLA_PYTHON_CLIENT_PREALLOCATE="false"))  # fmt: skip
  found = [line for line in deprecations["stdout"].splitlines() if line.startswith("DEPRECATIONS ")]
  figures = dict(
    probe=probe,
    deprecation_warnings=json.loads(found[-1][len("DEPRECATIONS ") :])
    if found
    else {"error": _tail(deprecations["stderr"], 1000), "timed_out": deprecations["timed_out"]},
    missing_for_stage={stage: names for stage, names in missing.items() if names},
    python=sys.executable,
    cpu_count=os.cpu_count(),
    load_average=os.getloadavg()[0],
    packages=packages,
    nvidia_smi=_nvidia_smi(),
  )
  return _stage_record(
    cmd[:2] + ["<probe>"], result, limit_s, result["returncode"] == 0 and bool(probe), figures=figures
  )


def _pip(args: list[str], constraints: str, limit_s: float, log: pathlib.Path) -> dict:
  base = [sys.executable, "-m", "pip", "install", "--no-input", "--disable-pip-version-check", "--retries", "1"]
  base += ["--timeout", "20", "-c", constraints]
  result = _run(base + args, limit_s=limit_s, log=log)
  if result["returncode"] != 0 and "externally-managed-environment" in (result["stderr"] + result["stdout"]):
    # A container's system python under PEP 668: the constraints keep every installed version.
    result = _run(base + ["--break-system-packages"] + args, limit_s=limit_s, log=log)
  return result


def stage_install(limit_s: float, logs: pathlib.Path, env_figures: dict) -> dict:
  start = time.monotonic()
  installed = _installed()
  missing = [(name, line) for name, line in _requirements() if name not in installed and name not in NOT_NEEDED]
  missing = [(name, line) for name, line in missing if name not in NEVER_INSTALL]
  probe = env_figures.get("probe") or {}
  wants_cuda = bool(env_figures.get("nvidia_smi")) and probe.get("backend") != "gpu"
  plan = [line for name, line in missing if name != "torch"]
  torch = [line for name, line in missing if name == "torch"]
  cuda = []
  if wants_cuda:  # a GPU but no GPU jax: the CUDA plugin at the installed jax version, never another jax
    cuda = [f"jax[cuda12]=={installed['jax']}"] if "jax" in installed else ["jax[cuda12]==0.10.2"]
  figures = dict(missing=[line for _, line in missing], cuda_plugin=cuda, attempts=[])
  if not (plan or torch or cuda):
    return dict(status="ok", seconds=round(time.monotonic() - start, 2), limit_s=limit_s, figures=figures)
  with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
    pins = {name: v for name, v in installed.items() if name not in {"jax", "jaxlib"} and re.fullmatch(r"[\w.+!-]+", v)}
    f.write("".join(f"{name}=={version}\n" for name, version in pins.items()))
    if not cuda:  # jax[cuda12] pins jax itself at the installed version
      f.write("".join(f"{name}=={installed[name]}\n" for name in ("jax", "jaxlib") if name in installed))
    constraints = f.name
  groups = [("cuda", cuda, []), ("requirements", plan, []), ("torch", torch, ["--index-url", TORCH_CPU_INDEX])]
  ok = True
  stderr = []
  try:
    for label, lines, extra in groups:
      if not lines:
        continue
      left = limit_s - (time.monotonic() - start)
      if left < 5:
        figures["attempts"].append(dict(group=label, packages=lines, status="skipped: out of time"))
        ok = False
        continue
      result = _pip(lines + extra, constraints, left, logs / f"install_{label}.log")
      if result["returncode"] != 0 and len(lines) > 1 and not result["timed_out"]:  # one bad package: the others
        per = [_pip([line] + extra, constraints, limit_s - (time.monotonic() - start), logs / f"install_{label}_{i}.log")
               for i, line in enumerate(lines)]  # fmt: skip
        result = dict(
          result, returncode=max(r["returncode"] or 0 for r in per), stderr="\n".join(r["stderr"] for r in per)
        )
        status = [dict(package=line, returncode=r["returncode"]) for line, r in zip(lines, per)]
      else:
        status = result["returncode"]
      figures["attempts"].append(dict(group=label, packages=lines, result=status, timed_out=result["timed_out"]))
      ok &= result["returncode"] == 0
      stderr.append(_tail(result["stderr"], 1500))
  finally:
    os.unlink(constraints)
  figures["installed_now"] = {name: _installed().get(_norm(name)) for name, _ in missing}
  return dict(
    status="ok" if ok else "failed",
    seconds=round(time.monotonic() - start, 2),
    limit_s=limit_s,
    figures=figures,
    stderr_tail=_tail("\n".join(stderr)),
  )


# --- the measuring stages ------------------------------------------------------------------------


def _junit_figures(path: pathlib.Path) -> dict:
  try:
    root = ET.parse(path).getroot()
  except (OSError, ET.ParseError) as e:
    return {"error": f"no junit xml: {type(e).__name__}: {e}"}
  suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
  counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
  cases, failures = [], []
  for case in root.iter("testcase"):
    name = f"{case.get('classname', '')}::{case.get('name')}"
    cases.append((float(case.get("time", 0)), name))
    for tag in ("failure", "error"):
      for bad in case.iter(tag):
        failures.append(dict(test=name, kind=tag, message=(bad.get("message") or "")[:500]))
  counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
  slowest = [dict(test=name, seconds=round(t, 2)) for t, name in sorted(cases, reverse=True)[:8]]
  return dict(counts, failed_tests=failures, slowest=slowest)


_OUTCOME = r"(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)"
# pytest -v: "tests/x.py::test_y[p] PASSED  [ 3%]"; under pytest-xdist: "[gw0] [  3%] PASSED tests/x.py::test_y[p]"
_VERBOSE_LINE = re.compile(rf"^(?:(\S+::.*) {_OUTCOME}\b|\[gw\d+\] \[\s*\d+%\] {_OUTCOME} (\S+::\S+))", re.M)


def _pytest_outcomes(stdout: str) -> dict[str, int]:
  """Outcome counts from pytest -v lines, with or without pytest-xdist; "failed_tests": the failed ones."""
  counts, failed = {}, []
  for plain_test, plain_outcome, xdist_outcome, xdist_test in _VERBOSE_LINE.findall(stdout):
    outcome, test = (plain_outcome, plain_test) if plain_outcome else (xdist_outcome, xdist_test)
    counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    if outcome in ("FAILED", "ERROR"):
      failed.append(test.strip())
  out = dict(sorted(counts.items()))
  return {**out, "failed_tests": failed} if failed else out


def stage_kernel_tests(limit_s: float, logs: pathlib.Path, smoke: bool, gpu: bool) -> dict:
  xml = logs / "kernel_tests.xml"
  xml.unlink(missing_ok=True)
  # -v: a line per test, so that a run cut off at its limit still says which tests passed (no junit xml then).
  tests = ["tests/test_fp4_mosaic.py", "tests/test_pallas_kernels.py"]  # the Mosaic GPU kernel; Triton kernels
  cmd = [sys.executable, "-m", "pytest", *tests, "-v", "-rfEs", f"--junitxml={xml}"]
  if smoke:
    cmd += ["-k", SMOKE_KERNEL_TESTS]
  elif gpu and "pytest-xdist" in _installed():  # ~90 kernels to compile cold (CPU-bound: ptxas, Triton): 4 processes
    cmd += ["-n", "4", "--dist", "load"]
    if "pytest-timeout" in _installed():  # a kernel that hangs: its process ends (xdist replaces it), the rest go on
      cmd += ["--timeout", "90", "--timeout-method", "thread"]
  interpret = not gpu  # on a GPU: compiled, and the tests refuse to fall back to the interpreter
  env = _child_env(TRACE_PALLAS_INTERPRET=int(interpret), XLA_PYTHON_CLIENT_PREALLOCATE="false")  # 4 share the GPU
  result = _run(cmd, limit_s=limit_s, log=logs / "kernel_tests.log", env=env)
  figures = dict(_junit_figures(xml), interpret=interpret)
  if "error" in figures:  # cut off: count the -v lines
    figures["from_stdout"] = _pytest_outcomes(result["stdout"])
  ok = result["returncode"] == 0 and figures.get("passed", 0) > 0
  return _stage_record(cmd, result, limit_s, ok, figures=figures)


def _bench_stage(name, script, args, limit_s, logs, **env) -> dict:
  if not (REPO / script).exists():
    return dict(status="skipped", reason=f"{script} not present", seconds=0.0, limit_s=limit_s)
  out = logs / f"{name}.json"
  out.unlink(missing_ok=True)
  cmd = [sys.executable, script, *args, "--json", str(out)]
  result = _run(cmd, limit_s=limit_s, log=logs / f"{name}.log", env=_child_env(**env))
  figures = _read_json(out)
  return _stage_record(cmd, result, limit_s, result["returncode"] == 0 and "error" not in figures, figures=figures)


def stage_mosaic_variants(limit_s, logs, smoke, gpu, script="pallas_kernels/lab/mosaic_variants.py"):
  """pallas_kernels/lab/mosaic_variants.py: the Mosaic kernel's variants and the bf16 baselines, wall clock and
  device time per row (it needs an sm_90 GPU: skipped without one)."""
  if smoke or not gpu:
    return dict(status="skipped", reason="--smoke" if smoke else "no GPU backend", seconds=0.0, limit_s=limit_s)
  out = logs / "mosaic_variants.json"
  pending = pathlib.Path(f"{out}.pending")  # the row in progress: device_time.pending_path (no jax here)
  out.unlink(missing_ok=True)
  pending.unlink(missing_ok=True)
  cmd, start, runs = [sys.executable, script], time.monotonic(), 0
  while True:  # a row that hangs ends the process and leaves `pending`: rerun, keeping the rows so far
    left = limit_s - (time.monotonic() - start)
    env = _child_env(OUT=str(logs), BUDGET_S=max(left - 60, 10), RESUME=int(runs > 0))  # no new row in the last 60 s
    result = _run(cmd, limit_s=left, log=logs / f"mosaic_variants{'_' + str(runs) if runs else ''}.log", env=env)
    runs += 1
    if result["returncode"] == 0 or not pending.exists() or limit_s - (time.monotonic() - start) < 60:
      break
  result["seconds"] = time.monotonic() - start  # all runs
  rows = _read_json(out)
  rows = rows if isinstance(rows, list) else []
  if pending.exists():  # the stage's time ran out during a row, or too little was left to rerun past it
    rows.append(dict(_read_json(pending), error="no result: the stage's time ran out during this row"))
    pending.unlink()
  ok = result["returncode"] == 0 and bool(rows) and not any("error" in r for r in rows)
  return _stage_record(cmd, result, limit_s, ok, figures=dict(rows=rows), runs=runs)


def stage_fp4_matmul(limit_s, logs, smoke):
  args = ["--smoke"] if smoke else ["--reps", "10"]
  return _bench_stage("fp4_matmul", "pallas_kernels/lab/bench_fp4_matmul.py", args, limit_s, logs)


def stage_main(limit_s, logs, smoke):
  """The README's main command, `python -m trace_jax.main --config=configs/default.py --workdir=...` (--smoke:
  MAIN_SMOKE's tiny overrides): it must finish; figures: its summary.json and wall time."""
  workdir = logs / "main_workdir"
  shutil.rmtree(workdir, ignore_errors=True)
  cmd = [sys.executable, "-m", "trace_jax.main", "--config=configs/default.py", f"--workdir={workdir}"]
  cmd += [f"--config.{flag}" for flag in MAIN_SMOKE] if smoke else []
  result = _run(cmd, limit_s=limit_s, log=logs / "main.log", env=_child_env(XLA_PYTHON_CLIENT_PREALLOCATE="false"))
  summary = _read_json(workdir / "summary.json")
  figures = dict(wall_s=round(result["seconds"], 1), summary=summary)
  return _stage_record(cmd, result, limit_s, result["returncode"] == 0 and "error" not in summary, figures=figures)


def stage_rollout_scale(limit_s, logs, smoke):
  """experiments/bench_rollout_scale.py: our BF16 engine against our FP4 engine at Qwen3-30B-A3B layer shapes."""
  return _bench_stage(
    "rollout_scale", "experiments/bench_rollout_scale.py", ["--smoke"] if smoke else [], limit_s, logs
  )


def stage_outcome(limit_s, logs, smoke):
  """experiments/outcome.py (the outcome issue's GPU-scale protocol) with --json (and --smoke), its time in the
  environment (BUDGET_S: this stage's limit less 30 s, for as many modes and steps as fit); skipped while the
  script does not exist."""
  budget = int(max(limit_s - 30, 10))
  root = logs / "outcome"
  args = ["--root", str(root / "runs"), "--out", str(root)]
  args += ["--smoke", "--modes", "bf16"] if smoke else ["--gpu"]
  return _bench_stage("outcome", "experiments/outcome.py", args, limit_s, logs, BUDGET_S=budget)


def stage_grpo_step(limit_s, logs, smoke):
  # smoke: bf16 only (the quickest compile); tests/test_bench_grpo_step.py smoke-runs trace
  args = (
    ["--smoke", "--tunix", "skip", "--modes", "bf16"] if smoke else ["--modes", "bf16,qat,trace", "--tunix", "auto"]
  )
  return _bench_stage("grpo_step", "experiments/bench_grpo_step.py", args, limit_s, logs)


# --- the run -------------------------------------------------------------------------------------


def _git() -> dict:
  def git(*args):
    try:
      return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
      return ""

  return dict(
    commit=git("rev-parse", "HEAD"),
    branch=git("rev-parse", "--abbrev-ref", "HEAD"),
    dirty=bool(git("status", "--porcelain")),
  )


def _one_line(name: str, stage: dict) -> str:
  figures = stage.get("figures") or {}
  line = f"{name:>12}: {stage['status']:<8} {stage.get('seconds', 0):6.1f} s"
  try:
    if name == "env":
      probe = figures.get("probe") or {}
      line += (
        f"  jax {probe.get('jax')} on {probe.get('backend')}: {probe.get('device_kind')} x{probe.get('device_count')}"
      )
      for stage_name, names in figures.get("missing_for_stage", {}).items():
        line += f"; {stage_name} lacks {', '.join(names)}"
    elif name == "install" and "missing" in figures:
      line += f"  missing: {', '.join(figures['missing']) or 'nothing'}"
    elif name == "kernel_tests" and "tests" in figures:
      mode = "interpret" if figures["interpret"] else "compiled"
      line += f"  {figures['passed']} passed, {figures['failures'] + figures['errors']} failed, {figures['skipped']} skipped ({mode})"
    elif name == "mosaic_variants" and figures.get("rows"):
      rows = [r for r in figures["rows"] if r.get("device_us") or r.get("wall_us")]
      line += f"  {len(rows)} rows; " + "; ".join(
        f"{r['name']}{' M=' + str(r['M']) if 'M' in r else ''} "
        + (f"{r['device_us']} us (device)" if r.get("device_us") else f"{r.get('wall_us')} us (wall)")
        for r in rows[:4]
      )
    elif name == "fp4_matmul":
      dense = [f"M={r['m']} K={r['k']} {r['speedup']:.2f}x" for r in figures.get("dense", []) if r.get("speedup")]
      grouped = [
        f"{r['layer']} T={r['tokens']} {r['speedup']:.2f}x" for r in figures.get("grouped", []) if r.get("speedup")
      ]
      line += "  fp4/bf16: " + "; ".join(dense + grouped)
    elif name == "main" and "summary" in figures:
      line += f"  wall {figures['wall_s']} s; " + ", ".join(
        f"{k} {v:.3g}" for k, v in list((figures["summary"] or {}).items())[:6] if isinstance(v, (int, float))
      )
    elif name == "rollout_scale" and "rows" in figures:
      line += f"  {figures['layers']} layers: " + "; ".join(
        f"{r['system']} b={r['batch']} {r.get('new_tokens_per_s')} tok/s" for r in figures["rows"]
      )
      line += f"; fp4/bf16 {figures.get('fp4_over_bf16')}"
    elif name == "grpo_step" and figures:
      line += "  figures: " + ", ".join(list(figures)[:10])
    elif stage.get("reason"):
      line += f"  ({stage['reason']})"
  except (KeyError, TypeError, ValueError) as e:
    line += f"  (summary: {type(e).__name__})"
  return line


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  default_out = os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else "gpu_check.json"
  p.add_argument("--out", default=default_out, help="the JSON file (default: $OUT/gpu_check.json or ./gpu_check.json)")
  p.add_argument("--smoke", action="store_true", help="the CPU path: tiny sizes, interpret mode, no installs")
  p.add_argument("--no_install", action="store_true", help="install nothing")
  p.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of " + ",".join(STAGES))
  p.add_argument("--total_s", type=float, default=450, help="time for the whole run (stages' limits are cut to fit)")
  p.add_argument("--reserve_s", type=float, default=50, help="time kept for each later stage")
  args = p.parse_args(argv)
  stages = [s for s in args.stages.split(",") if s]
  if unknown := set(stages) - set(STAGES):
    p.error(f"unknown stages {sorted(unknown)}; choose from {STAGES}")

  out = pathlib.Path(args.out).resolve()
  out.parent.mkdir(parents=True, exist_ok=True)
  logs = out.parent / f"{out.stem}_logs"
  logs.mkdir(exist_ok=True)
  start = time.monotonic()
  report = dict(
    started=_now(), smoke=args.smoke, argv=sys.argv[1:] if argv is None else argv, git=_git(), logs=str(logs), stages={}
  )

  def save():
    report["summary"] = {name: stage["status"] for name, stage in report["stages"].items()}
    report["seconds"] = round(time.monotonic() - start, 1)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out)

  limits = SMOKE_LIMITS if args.smoke else LIMITS
  env_figures: dict = {}
  gpu = False
  order = [s for s in STAGES if s in stages or s == "env"]  # env always: the others need the backend
  for i, name in enumerate(order):
    later = len(order) - i - 1
    limit = min(limits[name], args.total_s - (time.monotonic() - start) - later * args.reserve_s)
    if name == "install" and (args.smoke or args.no_install):
      stage = dict(status="skipped", reason="--smoke" if args.smoke else "--no_install", seconds=0.0)
    elif limit < 5:
      print(f"[gpu_check] {name}: out of time", flush=True)
      stage = dict(status="skipped", reason="out of time", seconds=0.0)
    else:
      print(f"[gpu_check] {name} (limit {limit:.0f} s) ...", flush=True)
      try:
        if name == "env":
          stage = stage_env(limit, logs)
        elif name == "install":
          stage = stage_install(limit, logs, env_figures)
          if stage["figures"]["missing"] or stage["figures"]["cuda_plugin"]:  # what the later stages will see
            left = args.total_s - (time.monotonic() - start) - later * args.reserve_s
            stage["env_after"] = stage_env(min(60, max(left, 10)), logs, "env_after_install.log")["figures"]["probe"]
            gpu = stage["env_after"].get("backend") == "gpu"
        elif name == "kernel_tests":
          stage = stage_kernel_tests(limit, logs, args.smoke, gpu)
        elif name == "mosaic_variants":
          stage = stage_mosaic_variants(limit, logs, args.smoke, gpu)
        else:
          stage = globals()[f"stage_{name}"](limit, logs, args.smoke)
      except Exception as e:  # a bug here must not cost the other stages
        stage = dict(status="failed", seconds=0.0, error=f"{type(e).__name__}: {e}")
    if name == "env":
      env_figures = stage.get("figures", {})
      report["env"] = env_figures.get("probe", {})
      gpu = report["env"].get("backend") == "gpu"
      if not gpu and not args.smoke:
        print("[gpu_check] no GPU backend: kernel tests run in interpret mode; the benchmarks that need a GPU fail")
    report["stages"][name] = stage
    save()
    print(f"[gpu_check] {_one_line(name, stage)}", flush=True)

  report["finished"] = _now()
  save()
  print(f"\nGPU check, {report['seconds']:.0f} s in all -> {out} (logs: {logs})")
  for name, stage in report["stages"].items():
    print(_one_line(name, stage))
  return 0 if all(s["status"] in ("ok", "skipped") for s in report["stages"].values()) else 1


if __name__ == "__main__":
  sys.exit(main())
