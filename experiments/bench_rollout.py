"""Rollout throughput: trace_jax's engine (BF16 and FP4) against Hugging Face transformers `generate`.

  python experiments/bench_rollout.py [--threads N] [--batches 8,64] [--new_tokens 64] [--repeats 2]
                                      [--hf_dtypes float32,bfloat16] [--json PATH] [--smoke]

--json writes every figure below as JSON; --smoke is a quick functional check (batch 2, 4 new
tokens, 1 repeat, transformers float32 only, no untimed fp32 engine): its timings mean nothing.

One process, one tiny-but-not-trivial Qwen3-MoE (hidden 256, 4 layers, 8 heads / 4 KV heads,
head_dim 32, 16 experts top-2, moe_intermediate 128, vocab 1024), initialized by
`model.init_params` and exported with `trace_jax.hf.save_pretrained`, so both sides hold the
same weights. Every system decodes the same prompts (16 tokens, unpadded) greedily for exactly
`new_tokens` tokens: our engine with EOS disabled (eos_id -1), transformers with
`max_new_tokens = min_new_tokens = new_tokens` and no EOS token.

  ours bf16         rollout.generate, quant=None: bf16 weights, activations and KV cache.
  ours fp4          rollout.generate, NVFP4 W4A4 routed experts + FP4 KV cache (no guidance
                    recorded). On CPU the packed experts are decoded once per generate (no FP4
                    arithmetic: this measures the overhead of FP4 storage and online activation
                    quantization); on a GPU the FP4 grouped kernel, the Mosaic GPU one on Hopper
                    (`rollout.expert_layout`, printed).
  ours fp4 triton   (Hopper only) the same with quant.matmul_impl='pallas': the Pallas-Triton kernel.
  transformers dt   Qwen3MoeForCausalLM.generate in dtype dt with its default experts and attention
                    implementations (printed), DynamicCache, torch.inference_mode.

Threads: `--threads` (default: all cores) sets torch.set_num_threads and XLA:CPU's intra-op pool
(XLA_FLAGS, before jax is imported). On a machine shared with other jobs, multi-threaded torch
stalls badly at its OpenMP barriers; run with --threads 1 as well to see both sides uncontended.

Ours compiles once per (batch, config): the first call (compile + run) is reported apart from the
steady state. transformers is warmed up with a 2-token generate. The timed runs are interleaved
(round r runs every system at every batch before round r + 1) and the median is reported. Ratios
are against the fastest transformers dtype at each batch. Besides wall-clock new tokens/s, each
run's process CPU seconds are shown: wall time includes waiting for a core, CPU time does not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: make the repository root importable
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

GOAL = 3.0  # ours / transformers at every batch (issue 14)
PROMPT_LEN = 16


def model_config():
  """The benchmark's model (the module doc); experiments/profile_decode.py profiles the same one."""
  from trace_jax.config import ModelConfig  # noqa: PLC0415  (imported late: XLA_FLAGS first)

  return ModelConfig(
    vocab_size=1024,
    hidden_size=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
  )


def _args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch and XLA:CPU threads")
  p.add_argument("--batches", default="8,64", help="comma-separated batch sizes")
  p.add_argument("--new_tokens", type=int, default=64)
  p.add_argument("--repeats", type=int, default=2, help="timed runs per system and batch, after the first")
  p.add_argument("--hf_dtypes", default="float32,bfloat16", help="transformers dtypes to time")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", metavar="PATH", help="write every figure here as JSON")
  p.add_argument("--smoke", action="store_true", help="batch 2, 4 new tokens, 1 repeat, transformers float32 only")
  args = p.parse_args(argv)
  if args.smoke:
    args.batches, args.new_tokens, args.repeats, args.hf_dtypes = "2", 4, 1, "float32"
  return args


def _results(args, batches, names, hf_names, first, runs, best, greedy) -> dict:
  """Every printed figure as one JSON-able dict; keys are "<system> @ <batch>" where a table row is."""
  import jax
  import torch
  import transformers

  finite = lambda v: v if math.isfinite(v) else None
  median_wall = lambda name, b: statistics.median(w for w, _ in runs[name, b])
  rows = []
  for b in batches:
    for name in names:
      walls, cpus = [w for w, _ in runs[name, b]], [c for _, c in runs[name, b]]
      wall, cpu = median_wall(name, b), statistics.median(cpus)
      speed, best_speed = b * args.new_tokens / wall, b * args.new_tokens / median_wall(best[b], b)
      rows.append(
        dict(
          system=name, batch=b, first_call_s=first[name, b], first_call_is_compile=name not in hf_names,
          steady_s=wall, steady_runs_s=walls, new_tokens_per_s=finite(speed), cpu_s=cpu, cpu_runs_s=cpus,
          new_tokens_per_cpu_s=finite(b * args.new_tokens / cpu) if cpu > 0 else None,
          vs_fastest_transformers=finite(speed / best_speed), fastest_transformers=best[b],
        )
      )  # fmt: skip
  largest = max(batches)
  goal = {name: next(r["vs_fastest_transformers"] for r in rows if r["system"] == name and r["batch"] == largest)
          for name in ("ours bf16", "ours fp4")}  # fmt: skip
  return dict(
    smoke=args.smoke, new_tokens=args.new_tokens, prompt_len=PROMPT_LEN, batches=batches, repeats=args.repeats,
    threads=args.threads, hf_dtypes=hf_names, seed=args.seed, host=platform.machine(), cores=os.cpu_count(),
    load_average=os.getloadavg()[0], xla_flags=os.environ.get("XLA_FLAGS", ""), jax=jax.__version__,
    backend=jax.default_backend(), device=jax.devices()[0].device_kind, torch=torch.__version__,
    transformers=transformers.__version__, rows=rows, goal=GOAL, largest_batch=largest,
    ratio_at_largest_batch=goal, meets_goal={n: r is not None and r >= GOAL for n, r in goal.items()},
    greedy_agreement=greedy,
  )  # fmt: skip


def _write_json(path: str, result: dict):
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  print(f"figures written to {path}")


def _set_xla_threads(threads: int):
  """XLA:CPU reads its thread pool size from XLA_FLAGS once, when jax initializes its backend."""
  flags = f"--xla_cpu_multi_thread_eigen={'false' if threads == 1 else 'true'} intra_op_parallelism_threads={threads}"
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()


def main(argv=None):
  args = _args(argv)
  _set_xla_threads(args.threads)
  # Imported here so that XLA_FLAGS above takes effect.
  import jax
  import jax.numpy as jnp
  import numpy as np
  import torch
  import transformers

  from trace_jax import hf, model, rollout
  from trace_jax.config import QuantConfig, RolloutConfig, SamplingConfig

  config = model_config()

  def ours(params, quant, dtype="bfloat16"):
    rollout_config = RolloutConfig(quant=quant, compute_dtype=dtype)
    layout = rollout.expert_layout(rollout_config, config)  # synced as the engine runs them, as train.py does
    engine = rollout.weight_sync(params, quant, jnp.dtype(dtype), expert_layout=layout)
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=0.0, eos_id=-1)  # no EOS

    def run(prompts, new_tokens=None):
      del new_tokens  # always sampling.max_new_tokens
      tokens = jnp.asarray(prompts)
      res = rollout.generate(
        engine,
        tokens,
        jnp.ones_like(tokens),
        jax.random.key(0),
        model_config=config,
        rollout_config=rollout_config,
        sampling=sampling,
      )
      return np.asarray(res.tokens[:, PROMPT_LEN:])  # blocks until done

    return run

  def theirs(hf_model):
    def run(prompts, new_tokens=args.new_tokens):
      ids = torch.from_numpy(prompts.astype(np.int64))
      with torch.inference_mode():
        out = hf_model.generate(
          input_ids=ids,
          attention_mask=torch.ones_like(ids),
          max_new_tokens=new_tokens,
          min_new_tokens=new_tokens,
          do_sample=False,
          eos_token_id=None,
          pad_token_id=0,
        )
      return out[:, PROMPT_LEN:].numpy()

    return run

  def timed(fn, *fn_args):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*fn_args)
    return out, time.perf_counter() - wall, time.process_time() - cpu

  torch.set_num_threads(args.threads)
  batches = [int(b) for b in args.batches.split(",")]
  print(
    f"host: {platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
    f"threads: torch {torch.get_num_threads()}, XLA_FLAGS={os.environ['XLA_FLAGS']!r}; jax {jax.__version__} "
    f"({jax.default_backend()}), torch {torch.__version__}, transformers {transformers.__version__}"
  )
  params = jax.jit(model.init_params, static_argnums=0)(config, jax.random.key(args.seed))
  systems = {"ours bf16": ours(params, None), "ours fp4": ours(params, QuantConfig())}
  fp4_layout = rollout.expert_layout(RolloutConfig(quant=QuantConfig()), config)
  print(f"ours fp4: routed experts as {fp4_layout} (rollout.expert_layout)")
  if fp4_layout == "fragments":  # Hopper: the Mosaic kernel; the Triton kernel beside it
    systems["ours fp4 triton"] = ours(params, QuantConfig(matmul_impl="pallas"))
  hf_names = []
  with tempfile.TemporaryDirectory() as path:
    hf.save_pretrained(path, config, params)
    for dtype in args.hf_dtypes.split(","):
      hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
      name = f"transformers {dtype}"
      print(
        f"{name}: {type(hf_model).__name__}, experts={hf_model.config._experts_implementation}, "
        f"attention={hf_model.config._attn_implementation}"
      )
      systems[name] = theirs(hf_model)
      hf_names.append(name)
  rng = np.random.default_rng(args.seed)
  prompts = {b: rng.integers(3, config.vocab_size, (b, PROMPT_LEN)).astype(np.int32) for b in batches}

  first, runs, outputs = {}, {}, {}
  for b in batches:  # first calls: our compiles, transformers' warm-up (2 tokens)
    for name, fn in systems.items():
      _, first[name, b], _ = timed(fn, prompts[b], 2)
      print(f"  first call {name:>22} batch {b:3d}: {first[name, b]:7.2f} s", flush=True)
  for r in range(args.repeats):
    for b in batches:
      for name, fn in systems.items():
        out, wall, cpu = timed(fn, prompts[b])
        assert out.shape == (b, args.new_tokens), out.shape
        outputs[name, b] = out
        runs.setdefault((name, b), []).append((wall, cpu))
        print(f"  round {r} {name:>22} batch {b:3d}: {wall:7.2f} s wall, {cpu:7.2f} s CPU", flush=True)

  wall = {k: statistics.median(w for w, _ in v) for k, v in runs.items()}
  cpu = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
  speed = {(name, b): b * args.new_tokens / wall[name, b] for name, b in runs}
  best = {b: max(hf_names, key=lambda n: speed[n, b]) for b in batches}
  print(
    f"\n{args.new_tokens} new tokens per sequence, prompt {PROMPT_LEN}, greedy, {args.threads} thread(s); "
    f"median of {args.repeats} runs\n"
    "| system | batch | first call s | steady s | new tokens/s | CPU s/run | new tokens/CPU-s | vs fastest transformers |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|"
  )
  for b in batches:
    for name in systems:
      first_call = f"{first[name, b]:.2f}" if name not in hf_names else "-"
      print(
        f"| {name} | {b} | {first_call} | {wall[name, b]:.3f} | {speed[name, b]:.0f} | {cpu[name, b]:.2f} | "
        f"{b * args.new_tokens / cpu[name, b]:.0f} | {speed[name, b] / speed[best[b], b]:.2f}x |"
      )
  for b in batches:
    for name in ("ours bf16", "ours fp4"):
      ratio = speed[name, b] / speed[best[b], b]
      cpu_ratio = (b * args.new_tokens / cpu[name, b]) / (b * args.new_tokens / cpu[best[b], b])
      verdict = "meets" if ratio >= GOAL else "misses"
      print(
        f"{name} / {best[b]} at batch {b}: {ratio:.2f}x ({verdict} the {GOAL:.0f}x goal); "
        f"per CPU second {cpu_ratio:.2f}x"
      )
    print(
      f"ours fp4 time / ours bf16 time at batch {b}: {wall['ours fp4', b] / wall['ours bf16', b]:.2f} (goal <= 1.2)"
    )

  # Same model on both sides: compare greedy tokens. bf16 flips near-ties of this random model's flat
  # logits; an fp32 engine (untimed) should reproduce transformers float32 token for token.
  b = batches[0]
  compared = {"ours bf16": outputs["ours bf16", b]}
  reference = "transformers float32" if "transformers float32" in hf_names else hf_names[0]
  if reference == "transformers float32" and not args.smoke:  # --smoke: one compile less
    compared["ours fp32 (untimed)"] = ours(params, None, "float32")(prompts[b])
  greedy = []
  for name, tokens in compared.items():
    theirs_tokens = outputs[reference, b]
    differ = tokens != theirs_tokens
    diverge = np.where(differ.any(1), differ.argmax(1), tokens.shape[1])
    print(
      f"greedy tokens, {name} vs {reference}, batch {b}: {np.mean(~differ):.1%} equal, "
      f"{np.mean(diverge == tokens.shape[1]):.0%} of rows identical, mean first divergence at token {diverge.mean():.1f}"
    )
    greedy.append(
      dict(system=name, reference=reference, batch=b, tokens_equal=float(np.mean(~differ)),
           rows_identical=float(np.mean(diverge == tokens.shape[1])), mean_first_divergence=float(diverge.mean()))
    )  # fmt: skip
  if args.json:
    _write_json(args.json, _results(args, batches, list(systems), hf_names, first, runs, best, greedy))


if __name__ == "__main__":
  main()
