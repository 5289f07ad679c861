"""Every program the GPU check's stages run, compiled for an H200 (sm_90a) on this CPU machine, with its device memory.

  python experiments/sm90_programs.py --shapes default,rollout_scale --json docs/gpu/sm90_programs.json \\
      --md docs/gpu/sm90_programs.md

Nothing is allocated: inputs are jax.ShapeDtypeStructs; each program is traced as on Hopper
(`gpu_compile.as_hopper`: the Mosaic GPU kernel where `select_impl` picks it there, moe's ragged grouped dot) and
compiled through the CUDA plugin (`gpu_compile.compile_sm90`; needs requirements-gpu-compile.txt). Per program:
its compile time and `memory_analysis()` (argument, output, alias, temp bytes; peak = argument + output - alias +
temp), against 80 GB.

  default        configs/default.py, what `python -m trace_jax.main` runs: `rollout.generate` BF16 and FP4 at
                 batch_prompts x num_generations prompts of data.max_prompt_len, and the RL train step of every
                 mode (config.MODES) on that rollout.
  rollout_scale  experiments/bench_rollout_scale.py's model (Qwen3-30B-A3B layer shapes): `generate` BF16 and FP4
                 at batch 256, prompt 512, 1024 new tokens, compiled at ENGINE_DEPTHS layers and fitted as
                 a + b * layers to the benchmark's LAYERS (the layers are identical and unrolled); the train step
                 of every mode at TRAIN_LAYERS layers, TRAIN_BATCH rollouts of the same length.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA driver here: before jax starts

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

if __package__ in (None, ""):  # run as a script: make the repository root importable
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from configs import default  # noqa: E402
from experiments import aot_compile, bench_rollout_scale  # noqa: E402
from pallas_kernels import gpu_compile  # noqa: E402
from trace_jax import config as config_lib  # noqa: E402
from trace_jax import model, rollout, trainer  # noqa: E402

GPU_BYTES = 80 * 10**9  # an 80 GB H100 (the H200 has 141 GB)
SHAPES = ("default", "rollout_scale")
ENGINE_DEPTHS = (2, 4)  # rollout_scale: generate compiled at these depths, fitted to bench_rollout_scale.LAYERS
TRAIN_LAYERS, TRAIN_BATCH = 2, 8  # rollout_scale: the train step's depth and rollouts


# Without a GPU, XLA cannot autotune its Triton GEMM fusions, and the default tiling of some (the small train
# step's attention-projection backward: "Couldn't find output tile sizes that satisfy hlo") fails to compile;
# such a program is compiled again with XLA's other GEMM emitter, and its row says so (`compiler_options`).
FALLBACK_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def _compile(fn, *args, **static) -> tuple[object, dict]:
  """(compiled, figures): compile time, memory, and the options and first error where the fallback was needed."""
  t0, extra = time.perf_counter(), {}
  try:
    compiled = gpu_compile.compile_sm90(fn, *args, **static)
  except jax.errors.JaxRuntimeError as e:
    if "tile sizes" not in str(e):
      raise
    extra = dict(compiler_options=FALLBACK_OPTIONS, default_options_error=str(e).splitlines()[0][:300])
    compiled = gpu_compile.compile_sm90(fn, *args, compiler_options=FALLBACK_OPTIONS, **static)
  return compiled, dict(compile_s=round(time.perf_counter() - t0, 1), **gpu_compile.memory_figures(compiled), **extra)


def compile_generate(model_config, rollout_config, sampling, batch: int, prompt: int) -> dict:
  """`rollout.generate` (prefill + decode loop) on an engine synced in the layout Hopper's engine uses."""
  with gpu_compile.as_hopper():
    layout = rollout.expert_layout(rollout_config, model_config)
  quant = rollout_config.quant
  params = jax.eval_shape(lambda: model.init_params(model_config, jax.random.key(0), jnp.bfloat16))
  engine = jax.eval_shape(lambda p: rollout.weight_sync(p, quant, expert_layout=layout), params)
  tokens = jax.ShapeDtypeStruct((batch, prompt), jnp.int32)
  key = jax.eval_shape(lambda: jax.random.key(0))
  fn = functools.partial(rollout.generate, model_config=model_config, rollout_config=rollout_config, sampling=sampling)
  compiled, figures = _compile(fn, engine, tokens, tokens, key)
  return dict(expert_layout=layout, expert_kernel=_expert_kernel(compiled.as_text()), **figures)


def _expert_kernel(hlo: str) -> str:
  """The routed experts' kernel, read from the compiled program: the Mosaic GPU FP4 kernel, the Triton FP4 or
  bf16 one (`pallas_kernels.grouped_bf16_matmul`: the BF16 engine's), or none of them (XLA's own matmuls)."""
  # the kernels' own names (source paths in the metadata name grouped_fp4_matmul.py for the bf16 kernel too)
  for pattern, kernel in (("grouped_bf16_matmul", "Triton bf16"), ("mosaic_gpu", "Mosaic GPU"),
                          (r"grouped_fp4_matmul_(?:nv|mx)fp4", "Triton")):  # fmt: skip
    if re.search(pattern, hlo):
      return kernel
  return "none"


def compile_train_step(run: config_lib.RunConfig, batch: int, seq: int) -> dict:
  """The mode's RL train step (trainer.make_rl_step, first update) on `batch` rollouts of `seq` tokens."""
  optimizer, state, train_batch = aot_compile.train_step_inputs(run, batch, seq)
  return _compile(trainer.make_rl_step(run, optimizer), state, train_batch, first=True)[1]


def _fit(rows: list[dict], layers: int) -> dict:
  """Each byte figure of rows (compiled at rows[i]['layers']) fitted as a + b * layers, at `layers`."""
  (x0, r0), (x1, r1) = [(r["layers"], r) for r in rows[:2]]
  keys = ("argument", "output", "alias", "temp", "peak")
  return {k: int(r0[k] + (r1[k] - r0[k]) * (layers - x0) / (x1 - x0)) for k in keys}


def programs(shape: str, log=print) -> list[dict]:
  rows = []

  def add(row):
    row = dict(shape=shape, **row)
    rows.append(row)
    log(json.dumps(row))

  if shape == "default":
    runs = {mode: config_lib.RunConfig.from_config(default.get_config(mode)) for mode in config_lib.MODES}
    base = runs["trace"]
    batch, prompt = base.job.batch_prompts * base.grpo.num_generations, base.data.max_prompt_len
    new = base.sampling.max_new_tokens
    for system in ("bf16", "fp4"):  # the engines of the bf16 and fp4 modes
      row = compile_generate(base.model, runs[system].mode.rollout, base.sampling, batch, prompt)
      add(dict(program="generate", system=system, layers=base.model.num_layers, batch=batch, prompt=prompt,
               new_tokens=new, **row))  # fmt: skip
    for mode, run in runs.items():
      row = compile_train_step(run, batch, prompt + new - 1)
      add(dict(program="rl_train_step", system=mode, layers=run.model.num_layers, batch=batch, seq=prompt + new - 1,
               **row))  # fmt: skip
    return rows
  b, p, n = max(bench_rollout_scale.BATCHES), bench_rollout_scale.PROMPT, bench_rollout_scale.NEW_TOKENS
  for system in bench_rollout_scale.SYSTEMS:
    fitted = []
    for layers in ENGINE_DEPTHS:
      config = bench_rollout_scale.scale_config(layers)
      row = compile_generate(config, bench_rollout_scale.rollout_config(system), bench_rollout_scale.sampling(n), b, p)
      fitted.append(dict(program="generate", system=system, layers=layers, batch=b, prompt=p, new_tokens=n, **row))
      add(fitted[-1])
    full = bench_rollout_scale.LAYERS
    add(dict(fitted[-1], layers=full, compile_s=None, fitted_from=list(ENGINE_DEPTHS), **_fit(fitted, full)))
  for mode in config_lib.MODES:
    run = aot_compile.run_config(bench_rollout_scale.scale_config(TRAIN_LAYERS), n, mode)
    row = compile_train_step(run, TRAIN_BATCH, p + n - 1)
    add(dict(program="rl_train_step", system=mode, layers=TRAIN_LAYERS, batch=TRAIN_BATCH, seq=p + n - 1, **row))
  return rows


def markdown(rows: list[dict], command: str) -> str:
  gb = lambda v: f"{v / 1e9:.2f}"
  lines = [
    "# The GPU check's programs, compiled for sm_90a without a GPU",
    "",
    f"Made by `{command}` (jax {jax.__version__}, the CUDA plugin's deviceless H200 topology): every program the "
    "GPU check's `main` and `rollout_scale` stages run, traced as on Hopper and compiled by XLA's GPU pipeline. "
    "Device memory from `compiled.memory_analysis()`, in GB (10^9 bytes); peak = argument + output - alias + temp, "
    f"held to {GPU_BYTES / 1e9:.0f} GB (an H100). A row with `fitted` is a + b * layers through the two compiled "
    "depths before it. tests/test_sm90_programs.py compiles the same programs and checks these bounds.",
    "",
    "| shape | program | system | layers | batch | tokens | expert kernel | argument | output | alias | temp | peak | "
    "compile s |",
    "|---|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    tokens = f"{r['prompt']} + {r['new_tokens']}" if "prompt" in r else f"{r['seq']}"
    compile_s = f"fitted {r['fitted_from']}" if r.get("fitted_from") else f"{r['compile_s']}"
    lines.append(
      f"| {r['shape']} | {r['program']} | {r['system']} | {r['layers']} | {r['batch']} | {tokens} | "
      f"{r.get('expert_kernel', '-')} | {gb(r['argument'])} | {gb(r['output'])} | {gb(r['alias'])} | {gb(r['temp'])} | "
      f"**{gb(r['peak'])}** | {compile_s}{' (triton gemm off)' if r.get('compiler_options') else ''} |"
    )
  return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES))
  p.add_argument("--json", help="write the rows here")
  p.add_argument("--md", help="write the markdown table here")
  args = p.parse_args(argv)
  if problems := gpu_compile.missing():
    raise SystemExit("experiments/sm90_programs.py: " + "; ".join(problems))
  rows = [row for shape in args.shapes.split(",") for row in programs(shape)]
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
  if args.md:
    pathlib.Path(args.md).write_text(
      markdown(rows, "python experiments/sm90_programs.py " + " ".join(argv or sys.argv[1:]))
    )
  return rows


if __name__ == "__main__":
  main()
