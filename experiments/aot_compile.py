"""Ahead-of-time compile of a Qwen3-30B-A3B- or Qwen3.5-35B-A3B-shaped train step and decode step on a device mesh.

Nothing is allocated: inputs are jax.ShapeDtypeStructs carrying their NamedShardings, and
`jax.jit(...).lower(...).compile()` reports the compiled per-device memory
(`memory_analysis()`) and FLOPs (`cost_analysis()`). Compiling needs concrete devices (an
AbstractMesh lowers but does not compile), so the mesh is built from simulated CPU devices
(--devices sets --xla_force_host_platform_device_count before jax is imported); the numbers
are XLA:CPU's for the SPMD-partitioned per-device program.

  python experiments/aot_compile.py --devices=64 --trainer=fsdp=8,expert=8 --rollout=data=8,expert=8 \\
      --layers=2,4 --batch=64 --seq=1024 --decode_batch=64 --cache=2048
  python experiments/aot_compile.py --model=qwen3_5_35b_a3b --layers=4,8 ...

With several --layers values the figures are fitted as a + b * layers and extrapolated to the
model's depth (the layers are identical, unrolled: per-layer cost is additive). The Qwen3.5 hybrid
repeats a block of 4 layers (3 Gated DeltaNet, 1 gated full attention), so its depths must be
multiples of 4: the scaled model keeps the pattern and the fit is per block. The guidance bytes
per token are printed for the full depth, for each setting of GUIDANCE_SETTINGS.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parse_mesh(text: str) -> dict[str, int]:
  return {k: int(v) for k, v in (item.split("=") for item in text.split(",") if item)}


MODELS = {"qwen3_30b_a3b": "Qwen3-30B-A3B", "qwen3_5_35b_a3b": "Qwen3.5-35B-A3B"}  # configs/models.py presets
DEFAULT_LAYERS = {"qwen3_30b_a3b": "2,4", "qwen3_5_35b_a3b": "4,8"}


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="qwen3_30b_a3b", choices=sorted(MODELS), help="the preset (configs/models.py)")
  p.add_argument("--devices", type=int, default=64, help="simulated CPU devices")
  p.add_argument("--trainer", default="fsdp=8,expert=8", help="trainer mesh, axis=size,...")
  p.add_argument("--rollout", default="data=8,expert=8", help="rollout engine mesh")
  p.add_argument(
    "--layers",
    default="",
    help="comma-separated depths to compile (default: 2,4 for Qwen3-30B-A3B, 48 = the full model; "
    "4,8 for Qwen3.5-35B-A3B, multiples of 4, 40 = the full model)",
  )
  p.add_argument("--batch", type=int, default=64, help="train sequences per step")
  p.add_argument("--seq", type=int, default=1024, help="train sequence length (prompt + response)")
  p.add_argument("--decode_batch", type=int, default=64, help="sequences decoded together")
  p.add_argument("--cache", type=int, default=2048, help="KV cache length of the decode step")
  p.add_argument("--capacity_factor", type=float, default=1.25)
  p.add_argument("--out", default="", help="write the report as JSON here")
  return p.parse_args(argv)


if __name__ == "__main__":
  _ARGS = _args(sys.argv[1:])
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_ARGS.devices}"

import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from configs import models  # noqa: E402
from pallas_kernels import gpu_compile  # noqa: E402
from trace_jax import config as config_lib  # noqa: E402
from trace_jax import experience, model, rollout, sharding, trainer  # noqa: E402
from trace_jax.config import (  # noqa: E402
  GUIDED_TENSORS,
  KEY,
  LINEAR_ATTENTION,
  MOE_HIDDEN,
  MOE_INPUT,
  VALUE,
  ModelConfig,
  RunConfig,
  TraceConfig,
  model_config,
)
from trace_jax.expert_parallel import ExpertParallel  # noqa: E402


def scaled_config(num_layers: int | None = None, preset: str = "qwen3_30b_a3b") -> ModelConfig:
  """A configs/models.py preset (Qwen3-30B-A3B or Qwen3.5-35B-A3B), optionally with fewer layers.

  Qwen3-30B-A3B's layers are identical, so any depth works. The hybrid repeats a block of
  `full_attention_interval` layers (Qwen3.5: 3 Gated DeltaNet, then 1 full attention), so its depth
  must be a multiple of that block; layer_types are built for the scaled depth, keeping the 3:1 ratio.
  """
  if preset not in MODELS:
    raise ValueError(f"Unknown model {preset!r}; expected one of {sorted(MODELS)}.")
  c = model_config(models.get_config(preset))
  if num_layers is None or num_layers == c.num_layers:
    return c
  if not c.linear_layers:
    return dataclasses.replace(c, num_layers=num_layers)
  types = tuple(c.layer_type(i) for i in range(c.num_layers))
  period = c.full_attention_interval or (c.attention_layers[0] + 1 if c.attention_layers else 0)
  if not period or c.num_layers % period or any(t != types[i % period] for i, t in enumerate(types)):
    raise ValueError(f"{MODELS[preset]}'s layer types do not repeat a fixed block; its depth cannot be scaled.")
  if num_layers <= 0 or num_layers % period:
    linear = sum(t == LINEAR_ATTENTION for t in types[:period])
    raise ValueError(
      f"{MODELS[preset]} repeats a block of {period} layers ({linear} Gated DeltaNet, {period - linear} full "
      f"attention): --layers must be multiples of {period} to keep that pattern, got {num_layers}."
    )
  return dataclasses.replace(c, num_layers=num_layers, layer_types=tuple(types[i % period] for i in range(num_layers)))


def _with_shardings(abstract, shardings):
  return jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def _report(compiled, seconds: float) -> dict:
  mem = gpu_compile.memory_figures(compiled)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  gib = lambda n: round(n / 2**30, 3)
  return {
    "compile_s": round(seconds, 1),
    **{f"{k}_gib": gib(mem[k]) for k in ("argument", "output", "alias", "temp")},
    "peak_estimate_gib": gib(mem["peak"]),
    "tflops_per_device": round(float(cost.get("flops", 0.0)) / 1e12, 4),
    "hbm_gib_accessed_per_device": gib(float(cost.get("bytes accessed", 0.0))),
  }


def run_config(config: ModelConfig, new_tokens: int, mode: str = "trace", **trace) -> RunConfig:
  """The mode at the defaults, 16 samples per prompt, without diagnostic codes; `trace` overrides."""
  cfg = config_lib.defaults()
  cfg.mode = mode
  cfg.model = config_lib.to_config_dict(config)
  cfg.rollout.max_new_tokens = new_tokens
  cfg.rl.num_generations = 16
  cfg.trace.update(diagnostics=False, **trace)
  return RunConfig.from_config(cfg)


# Guidance settings whose bytes per token are reported: the guided tensor set (trace.tensors) in
# the default form and depth (mantissa + block scales, deeper half), and trace_full.
GUIDANCE_SETTINGS = {
  "moe_input (the paper's accounting)": ("trace", {"tensors": (MOE_INPUT,)}),
  "moe_input + key/value": ("trace", {"tensors": (MOE_INPUT, KEY, VALUE)}),
  "moe_input + moe_hidden": ("trace", {"tensors": (MOE_INPUT, MOE_HIDDEN)}),
  "all four": ("trace", {"tensors": GUIDED_TENSORS}),
  "trace_full: full codes, all four, every layer": ("trace_full", {}),
}


def guidance_bytes(config: ModelConfig) -> dict:
  """Guidance bytes per token, per tensor, of each GUIDANCE_SETTINGS entry (from the engine's output shapes)."""
  out = {}
  for name, (mode, trace) in GUIDANCE_SETTINGS.items():
    run = run_config(config, 1, mode, **trace)
    params = jax.eval_shape(lambda run=run: model.init_params(run.model, jax.random.key(0)))
    engine = jax.eval_shape(lambda p, run=run: rollout.weight_sync(p, run.mode.rollout.quant), params)
    prompt = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    result = jax.eval_shape(
      lambda e, t, run=run: rollout.generate(
        e, t, t, jax.random.key(0), model_config=run.model, rollout_config=run.mode.rollout, sampling=run.sampling
      ),
      engine,
      prompt,
    )
    per_tensor = experience.guidance_bytes_per_token(result.guidance)
    out[name] = {"total": sum(per_tensor.values()), **per_tensor}
  return out


def train_step_inputs(run: RunConfig, batch: int, seq: int, mesh=None):
  """(optimizer, state, batch) of the GRPO step, abstract (ShapeDtypeStructs; with a mesh, carrying its
  shardings): `batch` rollouts of `seq` tokens, prompt and response (the response: max_new_tokens)."""
  optimizer = trainer.make_optimizer(run.optim, 1000)
  config = run.model

  def init():
    params = model.init_params(config, jax.random.key(0))
    return trainer.TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))

  state = jax.eval_shape(init)
  if mesh is not None:
    state = _with_shardings(state, trainer.state_shardings(state, optimizer, mesh))
  prompt = seq + 1 - run.sampling.max_new_tokens

  def rollout_batch(engine, prompts, mask):  # shapes only: what the engine hands the trainer
    result = rollout.generate(
      engine,
      prompts,
      mask,
      jax.random.key(0),
      model_config=config,
      rollout_config=run.mode.rollout,
      sampling=run.sampling,
    )
    return experience.train_batch_from_rollout(result, jnp.zeros((batch,)), run.grpo.routing_replay)

  engine = jax.eval_shape(lambda p: rollout.weight_sync(p, run.mode.rollout.quant), state.params)
  tokens = jax.ShapeDtypeStruct((batch, prompt), jnp.int32)
  abstract_batch = jax.eval_shape(rollout_batch, engine, tokens, tokens)
  if mesh is not None:
    abstract_batch = _with_shardings(abstract_batch, sharding.batch_shardings(abstract_batch, mesh))
  return optimizer, state, abstract_batch


def compile_train_step(run: RunConfig, mesh, ep: ExpertParallel | None, batch: int, seq: int) -> dict:
  """The GRPO step (QAT forward guided by TRACE guidance, backward, AdamW) on the trainer mesh."""
  optimizer, state, abstract_batch = train_step_inputs(run, batch, seq, mesh)
  step = trainer.make_rl_step(run, optimizer, mesh=mesh, expert_parallel=ep)
  t0 = time.perf_counter()
  compiled = step.lower(state, abstract_batch, first=True).compile()
  out = _report(compiled, time.perf_counter() - t0)
  out["guidance_gib_per_step"] = round(sharding.tree_nbytes(abstract_batch.guidance) / 2**30, 3)
  out["state_gib_total"] = round(sharding.tree_nbytes(state) / 2**30, 3)
  return out


def compile_decode_step(run: RunConfig, mesh, ep: ExpertParallel | None, batch: int, cache: int) -> dict:
  """One engine decode step (FP4 packed experts, FP4 KV cache of `cache` slots) on the rollout mesh."""
  config, engine_cfg = run.model, run.mode.rollout
  params = jax.eval_shape(lambda: model.init_params(config, jax.random.key(0)))
  engine = jax.eval_shape(lambda p: rollout.weight_sync(p, engine_cfg.quant), params)
  engine_sh = sharding.logical_shardings(engine, mesh)
  # packed only (decoded=False): the path of a GPU engine, whose Pallas kernels read FP4 storage
  caches = jax.eval_shape(lambda: rollout.init_cache(config, batch, cache, engine_cfg.quant, jnp.bfloat16, False))
  cache_sh = sharding.logical_shardings(caches, mesh)
  column = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
  slot_mask = jax.ShapeDtypeStruct((batch, cache), jnp.int32)
  start = jax.ShapeDtypeStruct((), jnp.int32)
  rows = lambda x: sharding.batch_shardings(x, mesh)

  def step(engine, tokens, caches, start, positions, slot_mask):
    logits, caches, _, _ = rollout.decode_step(
      engine,
      tokens,
      caches,
      start,
      positions,
      slot_mask,
      model_config=config,
      rollout_config=engine_cfg,
      expert_parallel=ep,
    )
    return logits, caches

  logits = jax.ShapeDtypeStruct((batch, config.vocab_size), jnp.float32)
  jitted = jax.jit(
    step,
    in_shardings=(engine_sh, rows(column), cache_sh, sharding.replicated(mesh), rows(column), rows(slot_mask)),
    out_shardings=(rows(logits), cache_sh),
    donate_argnums=2,
  )
  t0 = time.perf_counter()
  compiled = jitted.lower(engine, column, caches, start, column, slot_mask).compile()
  out = _report(compiled, time.perf_counter() - t0)
  out["engine_params_gib_total"] = round(sharding.tree_nbytes(engine) / 2**30, 3)
  kv = [c for i, c in enumerate(caches) if i not in config.linear_layers]
  out["kv_cache_gib_total"] = round(sharding.tree_nbytes(kv) / 2**30, 3)
  if config.linear_layers:  # the Gated DeltaNet layers' conv history and fp32 recurrent state
    states = [caches[i] for i in config.linear_layers]
    out["deltanet_state_gib_total"] = round(sharding.tree_nbytes(states) / 2**30, 3)
  return out


def compile_all(
  config: ModelConfig,
  trainer_shape: dict,
  rollout_shape: dict | None = None,
  *,
  batch: int = 64,
  seq: int = 1024,
  decode_batch: int | None = None,
  cache: int = 2048,
  capacity_factor: float = 1.25,
  new_tokens: int | None = None,
) -> dict:
  """Compile both steps for `config` on meshes over all devices; returns the figures."""
  trainer, rollout_mesh = sharding.make_meshes(trainer_shape, rollout_shape or trainer_shape)
  ep = lambda mesh: ExpertParallel(mesh, capacity_factor=capacity_factor) if dict(mesh.shape)["expert"] > 1 else None
  run = run_config(config, new_tokens or max(1, seq // 2))
  return {
    "config": dataclasses.asdict(config),
    "num_layers": config.num_layers,
    "devices": jax.device_count(),
    "trainer_mesh": dict(trainer.shape),
    "rollout_mesh": dict(rollout_mesh.shape),
    "train_step": compile_train_step(run, trainer, ep(trainer), batch, seq),
    "decode_step": compile_decode_step(run, rollout_mesh, ep(rollout_mesh), decode_batch or batch, cache),
  }


def extrapolate(reports: list[dict], num_layers: int) -> dict:
  """Fit value = a + b * layers per figure (two or more depths) and evaluate at `num_layers`."""
  out = {}
  for step in ("train_step", "decode_step"):
    xs = [r["num_layers"] for r in reports]
    fitted = {}
    for key, value in reports[0][step].items():
      if not isinstance(value, (int, float)):
        continue
      ys = [r[step][key] for r in reports]
      n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
      var = sum((x - mx) ** 2 for x in xs)
      b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
      fitted[key] = round(my + b * (num_layers - mx), 3)
      del n
    out[step] = fitted
  return out


def main(args) -> dict:
  name = MODELS[args.model]
  full = scaled_config(preset=args.model)
  depths = [int(x) for x in (args.layers or DEFAULT_LAYERS[args.model]).split(",")]
  for layers in depths:  # fail on a bad depth before compiling anything
    try:
      scaled_config(layers, args.model)
    except ValueError as e:
      raise SystemExit(f"experiments/aot_compile.py: {e}") from None
  reports = []
  for layers in depths:
    report = compile_all(
      scaled_config(layers, args.model),
      _parse_mesh(args.trainer),
      _parse_mesh(args.rollout),
      batch=args.batch,
      seq=args.seq,
      decode_batch=args.decode_batch,
      cache=args.cache,
      capacity_factor=args.capacity_factor,
    )
    report.pop("config")
    print(json.dumps(report), flush=True)
    reports.append(report)
  summary = {"model": name, "full_layers": full.num_layers, "compiled": reports}
  summary["guidance_bytes_per_token"] = guidance_bytes(full)
  print(f"guidance bytes per token ({name}, mantissa + scale in the deeper half unless noted):")
  default = ("trace", TraceConfig().tensors)
  for setting, row in summary["guidance_bytes_per_token"].items():
    mode, trace = GUIDANCE_SETTINGS[setting]
    label = setting + (" (default)" if (mode, tuple(trace.get("tensors", ()))) == default else "")
    print(f"  {label:58s} {row['total']:>7,d} B  " + ", ".join(f"{k} {v:,d}" for k, v in row.items() if k != "total"))
  if len(reports) > 1 and all(r["num_layers"] != full.num_layers for r in reports):
    summary[f"extrapolated_to_{full.num_layers}_layers"] = extrapolate(reports, full.num_layers)
  print(json.dumps(summary, indent=2))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(summary, f, indent=2)
  return summary


if __name__ == "__main__":
  main(_ARGS)
