"""How the engine's cost grows with the work (issue 43): new tokens/s against batch and response length.

  python experiments/bench_scaling.py [--batches 1,8,64,256] [--lengths 64,512,2048] [--steps 5]
      [--json docs/perf/bench_scaling.json] [--md docs/perf/bench_scaling.md] [--png docs/perf/bench_scaling.png]
  python experiments/bench_scaling.py --smoke      # batch 1 and 2, lengths 4 and 8, 2 steps: the plumbing

bench_rollout.py's model (hidden 256, 4 layers, 16 experts top-2, vocab 1024) and prompt (16 tokens), our BF16
engine and our FP4 engine (NVFP4 W4A4 experts + FP4 KV), beside Hugging Face transformers float32.

What is timed is one decode step, the unit a response of L new tokens repeats L times:
  ours          `rollout.generate` holds a cache of prompt + L slots from its first step and every decode step
                attends over all of them (masked past the current token; static shapes, one compiled loop), so
                each of a response's steps costs the same: the step over a cache of 16 + L slots
                (`profile_decode.decode_program`), and new tokens/s = batch / that step's time.
  transformers  DynamicCache grows by one slot a step, so a step's cost grows along the response; the mean step
                of a response of L tokens is the one at its middle, over 16 + L / 2 cached slots (filled with
                random keys and values; a step's cost does not depend on their values). Batches or lengths it
                cannot hold in memory are left out, and say so.

Each figure is the median of --steps timed steps after one untimed, systems interleaved step by step (slow
and fast minutes of a shared machine hit every system alike). `per_slot_us` is the growth of a step's time
per cached slot (least squares over the lengths), per sequence: attention over a long cache costs at most
linearly per token when that slope is flat in L, which `linear` checks (the step's time at the longest
length within 1.5x of a + b * slots fitted through the two shortest).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: make the repository root importable
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from experiments import bench_rollout, profile_decode  # noqa: E402

SYSTEMS = ("ours bf16", "ours fp4", "transformers float32")
PROMPT = bench_rollout.PROMPT_LEN


def _args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batches", default="1,8,64,256")
  p.add_argument("--lengths", default="64,512,2048", help="response lengths (new tokens)")
  p.add_argument("--steps", type=int, default=5, help="timed decode steps per system and shape")
  p.add_argument("--systems", default=",".join(SYSTEMS))
  p.add_argument("--json", default="")
  p.add_argument("--md", default="")
  p.add_argument("--png", default="")
  p.add_argument("--smoke", action="store_true")
  return p.parse_args(argv)


def _hf_step(hf_model, config, batch: int, slots: int):
  """A closure running one transformers decode step (batch, 1 token) after `slots` cached ones."""
  import torch  # noqa: PLC0415
  from transformers import DynamicCache  # noqa: PLC0415

  gen = torch.Generator().manual_seed(0)
  shape = (batch, config.num_kv_heads, slots, config.head_dim)
  layers = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(config.num_layers)]
  ids = torch.randint(3, config.vocab_size, (batch, 1), generator=gen)
  mask = torch.ones((batch, slots + 1), dtype=torch.long)
  position = torch.full((batch, 1), slots, dtype=torch.long)

  def step():
    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):  # a view of the same tensors, so each step starts from `slots`
      cache.update(k, v, i)
    with torch.inference_mode():
      return hf_model(input_ids=ids, attention_mask=mask, position_ids=position, past_key_values=cache).logits

  return step


def linear_check(slots: list[int], seconds: list[float]) -> dict:
  """a + b * slots through the two shortest lengths, against the longest: linear when the longest step takes at
  most 1.5x what the line predicts (attention over the cache growing no worse than linearly per token); None
  when the two shortest steps do not rise (noise larger than the growth: no line to extrapolate)."""
  (s0, t0), (s1, t1) = (slots[0], seconds[0]), (slots[1], seconds[1])
  slope = (t1 - t0) / (s1 - s0)
  predicted = t0 + slope * (slots[-1] - s0)
  linear = bool(seconds[-1] <= 1.5 * predicted) if slope > 0 else None
  return {"predicted_s": predicted, "measured_s": seconds[-1], "linear": linear}


def main(argv=None) -> dict:
  args = _args(argv)
  if args.smoke:
    args.batches, args.lengths, args.steps = "1,2", "4,8,16", 2
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from trace_jax import hf  # noqa: PLC0415

  batches = [int(b) for b in args.batches.split(",")]
  lengths = [int(n) for n in args.lengths.split(",")]
  systems = args.systems.split(",")
  if unknown := set(systems) - set(SYSTEMS):
    raise SystemExit(f"--systems: unknown {sorted(unknown)}; choose from {', '.join(SYSTEMS)}.")
  config = profile_decode.model_config()
  hf_model = None
  if "transformers float32" in systems:
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    from trace_jax import model  # noqa: PLC0415

    params = jax.jit(model.init_params, static_argnums=0)(config, jax.random.key(0))
    with tempfile.TemporaryDirectory() as path:
      hf.save_pretrained(path, config, params)
      hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  host = f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, jax {jax.__version__}"
  print(f"host: {host}", flush=True)

  rows = []
  for length in lengths:
    for batch in batches:
      runners, skipped = {}, {}
      for name in systems:
        try:
          if name == "transformers float32":
            slots = PROMPT + length // 2
            runners[name] = (_hf_step(hf_model, config, batch, slots), slots)
          else:
            slots = PROMPT + length
            compiled, (engine, tokens, caches, start), _ = profile_decode.decode_program(
              name.split()[1], config, batch, slots
            )
            state = {"caches": caches}

            def run(compiled=compiled, engine=engine, tokens=tokens, start=start, state=state):
              logits, state["caches"] = compiled(engine, tokens, state["caches"], start)
              return logits.block_until_ready()

            runners[name] = (run, slots)
        except (MemoryError, RuntimeError) as e:  # torch's allocation failures are RuntimeErrors
          skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
      times = {name: [] for name in runners}
      for run, _ in runners.values():
        run()  # untimed: the first call of a compiled program, torch's first allocation of these shapes
      for _ in range(args.steps):
        for name, (run, _) in runners.items():
          t0 = time.perf_counter()
          run()
          times[name].append(time.perf_counter() - t0)
      for name in systems:
        row = dict(system=name, batch=batch, length=length)
        if name in runners:
          step = statistics.median(times[name])
          row.update(slots=runners[name][1], step_s=step, tokens_per_s=batch / step)
          print(f"  {name:>21} batch {batch:4d} length {length:5d}: {step * 1e3:8.2f} ms/step, "
                f"{batch / step:9.0f} tokens/s", flush=True)  # fmt: skip
        else:
          row.update(skipped=skipped[name])
          print(f"  {name:>21} batch {batch:4d} length {length:5d}: skipped ({skipped[name]})", flush=True)
        rows.append(row)
      del runners

  growth = []
  for name in systems:
    for batch in batches:
      got = [r for r in rows if r["system"] == name and r["batch"] == batch and "step_s" in r]
      if len(got) < 3:
        continue
      slots, seconds = [r["slots"] for r in got], [r["step_s"] for r in got]
      slope = float(np.polyfit(slots, seconds, 1)[0])
      growth.append(dict(system=name, batch=batch, per_slot_us=slope / batch * 1e6, **linear_check(slots, seconds)))
  result = {
    "command": "python experiments/bench_scaling.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    "host": host,
    "prompt": PROMPT,
    "steps": args.steps,
    "rows": rows,
    "growth": growth,
  }
  md = markdown(result, batches, lengths, systems)
  print(md)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
  if args.md:
    pathlib.Path(args.md).write_text(md)
  if args.png:
    plot(result, batches, lengths, systems, args.png)
  return result


def markdown(result: dict, batches, lengths, systems) -> str:
  by = {(r["system"], r["batch"], r["length"]): r for r in result["rows"]}
  lines = [
    "# Engine cost against batch and response length (issue 43)",
    "",
    f"`{result['command']}` (host: {result['host']}). New tokens/s of one decode step (median of "
    f"{result['steps']}), prompt {result['prompt']}: ours over a cache of prompt + L slots (every step of a "
    "response of L tokens costs that), transformers float32 at the response's middle step (prompt + L / 2 "
    "cached slots). Ratios: ours / transformers at the same batch and length.",
    "",
    "| length | batch | " + " | ".join(systems) + " | bf16 / hf | fp4 / hf | fp4 time / bf16 time |",
    "|---:|---:|" + "---:|" * (len(systems) + 3),
  ]
  for length in lengths:
    for batch in batches:
      rs = [by.get((s, batch, length), {}) for s in systems]
      cells = [f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else "skipped" for r in rs]
      tps = {s: r.get("tokens_per_s") for s, r in zip(systems, rs)}
      hf_tps, bf16, fp4 = tps.get("transformers float32"), tps.get("ours bf16"), tps.get("ours fp4")
      ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"
      lines.append(
        f"| {length} | {batch} | " + " | ".join(cells) + f" | {ratio(bf16, hf_tps)} | {ratio(fp4, hf_tps)} | "
        f"{ratio(bf16, fp4)} |"
      )
  lines += [
    "",
    "Growth of a step's time per cached slot and sequence (least squares over the lengths); `linear`: the longest "
    "length's step within 1.5x of the line through the two shortest.",
    "",
    "| system | batch | us per slot per sequence | longest step, predicted / measured ms | linear |",
    "|---|---:|---:|---:|---|",
  ]
  for g in result["growth"]:
    lines.append(
      f"| {g['system']} | {g['batch']} | {g['per_slot_us']:.3f} | {g['predicted_s'] * 1e3:.1f} / "
      f"{g['measured_s'] * 1e3:.1f} | {({True: 'yes', False: 'no'}).get(g['linear'], 'n/a (no rise)')} |"
    )
  return "\n".join(lines) + "\n"


def plot(result: dict, batches, lengths, systems, path: str):
  from experiments import plotting  # noqa: PLC0415

  plt = plotting.plt
  fig, axes = plt.subplots(1, len(lengths), figsize=(4 * len(lengths), 3.4), sharey=True, squeeze=False)
  by = {(r["system"], r["batch"], r["length"]): r for r in result["rows"]}
  for ax, length in zip(axes[0], lengths):
    for name in systems:
      pts = [
        (b, by[name, b, length]["tokens_per_s"]) for b in batches if "tokens_per_s" in by.get((name, b, length), {})
      ]
      if pts:
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="batch", title=f"{length} new tokens")
    ax.grid(True, which="both", alpha=0.3)
  axes[0][0].set_ylabel("new tokens / s")
  axes[0][-1].legend(fontsize=8)
  fig.suptitle("issue 43: decode throughput against batch and response length (2 CPU cores)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  main()
