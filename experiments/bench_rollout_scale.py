"""Rollout at scale on one GPU: our BF16 engine against our FP4 engine, end to end, at Qwen3-30B-A3B's layer shapes.

  python experiments/bench_rollout_scale.py [--layers 28] [--batches 256,64] [--prompt 512] [--new_tokens 1024]
                                            [--repeats 1] [--json PATH]
  python experiments/bench_rollout_scale.py --smoke --json /tmp/scale.json   # CPU: a tiny model, seconds

The model: Qwen3-30B-A3B's layers (configs/models.py, via experiments/aot_compile.scaled_config: hidden 2048,
128 experts top-8 of FFN 768, 32 query / 4 KV heads of head_dim 128, vocab 151936), LAYERS of them: as many as
fit one 80 GB GPU in BF16 at the largest batch (the deviceless sm_90a compile's memory, docs/gpu/sm90_programs.md).
Random weights (`model.init_params` in bf16, the same key for both engines), so the tokens mean nothing; every
sequence decodes exactly --new_tokens tokens (EOS off, temperature 1) after a prompt of --prompt random tokens.

  bf16   rollout.generate, quant=None: bf16 weights, activations and KV cache.
  fp4    rollout.generate with NVFP4 W4A4 routed experts and the FP4 KV cache, in the expert layout the engine
         picks on this device (`rollout.expert_layout`: the Mosaic GPU kernel's fragments on Hopper).

Per system and batch: the compile (apart), the compiled program's device memory (`memory_analysis()`: arguments,
temporaries, peak), one untimed run, then --repeats timed runs (new tokens/s from the fastest), and the device's
`peak_bytes_in_use` so far (cumulative over the process). Batches in the order given (256 first by default),
both systems at each, so a run cut short has a ratio; each engine is built
from its own bf16 parameters, donated to weight sync, so the parameters and the engine are never both held.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository root importable
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

# As many as fit in BF16 at batch 256, prompt 512 + 1024 new, within 60 GB (JAX's default 75% of an 80 GB GPU): the
# sm_90a compile (docs/gpu/sm90_programs.md) needs 18.3 GB at 2 layers and 21.5 GB at 4, so 59.7 GB at 28.
LAYERS = 28
BATCHES = (256, 64)  # the paper's batch first
PROMPT, NEW_TOKENS = 512, 1024
SYSTEMS = ("bf16", "fp4")


def scale_config(num_layers: int = LAYERS, smoke: bool = False):
  """Qwen3-30B-A3B with `num_layers` layers; smoke: a tiny model (NVFP4's dims: multiples of 16)."""
  from experiments import aot_compile

  config = aot_compile.scaled_config(num_layers)
  if smoke:
    config = dataclasses.replace(
      config, vocab_size=256, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8,
      num_experts_per_tok=2, moe_intermediate_size=32, num_layers=2,
    )  # fmt: skip
  return config


def rollout_config(system: str):
  from trace_jax.config import QuantConfig, RolloutConfig

  return RolloutConfig(quant=QuantConfig() if system == "fp4" else None)


def sampling(new_tokens: int):
  from trace_jax.config import SamplingConfig

  return SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, eos_id=-1)  # no EOS: exactly new_tokens


def _args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--layers", type=int, default=LAYERS)
  p.add_argument("--batches", default=",".join(map(str, BATCHES)))
  p.add_argument("--prompt", type=int, default=PROMPT)
  p.add_argument("--new_tokens", type=int, default=NEW_TOKENS)
  p.add_argument("--repeats", type=int, default=1, help="timed runs per system and batch, after an untimed one")
  p.add_argument("--systems", default=",".join(SYSTEMS))
  p.add_argument("--json", metavar="PATH", help="write the figures here (rewritten after every row)")
  p.add_argument("--smoke", action="store_true", help="a tiny model, batch 2, prompt 8, 4 new tokens")
  args = p.parse_args(argv)
  if args.smoke:
    args.batches, args.prompt, args.new_tokens = "2", 8, 4
  return args


def main(argv=None) -> dict:
  args = _args(argv)
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels import gpu_compile
  from trace_jax import model, rollout

  config = scale_config(args.layers, args.smoke)
  device = jax.devices()[0]
  stats = lambda: device.memory_stats() or {}
  report = dict(
    smoke=args.smoke, layers=config.num_layers, prompt=args.prompt, new_tokens=args.new_tokens, repeats=args.repeats,
    jax=jax.__version__, backend=jax.default_backend(), device=device.device_kind,
    bytes_limit=stats().get("bytes_limit"), model=dataclasses.asdict(config), rows=[],
  )  # fmt: skip

  def save():
    if args.json:
      pathlib.Path(args.json).write_text(json.dumps(report, indent=1))

  init = jax.jit(lambda key: model.init_params(config, key, jnp.bfloat16))
  rng = np.random.default_rng(0)
  systems = {}  # system -> (rollout config, expert layout, jitted weight sync)
  for system in args.systems.split(","):
    rc = rollout_config(system)
    layout = rollout.expert_layout(rc, config)
    sync = jax.jit(functools.partial(rollout.weight_sync, quant=rc.quant, expert_layout=layout), donate_argnums=0)
    systems[system] = rc, layout, sync
  # batch by batch, both systems at each (a run cut short still has a ratio); one engine held at a time
  for batch in [int(b) for b in args.batches.split(",")]:
    prompts = jnp.asarray(rng.integers(3, config.vocab_size, (batch, args.prompt)), jnp.int32)
    for system, (rc, layout, sync) in systems.items():
      engine = sync(init(jax.random.key(0)))
      row = dict(system=system, batch=batch, expert_layout=layout)
      report["rows"].append(row)
      fn = functools.partial(
        rollout.generate, model_config=config, rollout_config=rc, sampling=sampling(args.new_tokens)
      )
      t0 = time.perf_counter()
      compiled = jax.jit(fn).lower(engine, prompts, jnp.ones_like(prompts), jax.random.key(1)).compile()
      row["compile_s"] = round(time.perf_counter() - t0, 2)
      row["compiled_memory"] = gpu_compile.memory_figures(compiled)
      save()
      runs = []
      for r in range(args.repeats + 1):
        t0 = time.perf_counter()
        out = compiled(engine, prompts, jnp.ones_like(prompts), jax.random.key(r))
        jax.block_until_ready(out.tokens)
        runs.append(time.perf_counter() - t0)
      del out
      row.update(
        first_run_s=round(runs[0], 3), timed_runs_s=[round(t, 3) for t in runs[1:]],
        new_tokens_per_s=round(batch * args.new_tokens / min(runs[1:] or runs), 1),
        peak_bytes_in_use_so_far=stats().get("peak_bytes_in_use"),
      )  # fmt: skip
      print(f"{system} batch {batch}: {row['new_tokens_per_s']:.0f} new tokens/s, compile {row['compile_s']} s, "
            f"compiled peak {row['compiled_memory']['peak'] / 2**30:.2f} GiB ({layout})", flush=True)  # fmt: skip
      save()
      del engine
  speed = {(r["system"], r["batch"]): r["new_tokens_per_s"] for r in report["rows"]}
  report["fp4_over_bf16"] = {
    str(b): round(speed["fp4", b] / speed["bf16", b], 3) for s, b in speed if s == "fp4" and ("bf16", b) in speed
  }
  print(f"fp4 / bf16 tokens/s: {report['fp4_over_bf16']}")
  save()
  return report


if __name__ == "__main__":
  main()
