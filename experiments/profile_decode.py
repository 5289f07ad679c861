"""Where one engine decode step's time goes, by part of the model and by XLA op (issue 43).

  python experiments/profile_decode.py [--batch 64] [--cache 80] [--steps 20] [--json PATH] [--md PATH]

bench_rollout.py's model (hidden 256, 4 layers, 16 experts top-2, expert FFN 128, vocab 1024), its BF16
engine and its FP4 engine (NVFP4 W4A4 routed experts + FP4 KV cache). One decode step (`rollout.decode_step`,
batch B of random tokens, one new token each, a cache of --cache slots, the new token at slot cache - 1) is compiled once per engine
and run --steps times under `jax.profiler`; XLA:CPU reports every thunk it runs (fusions, custom calls, the
conditionals of the capacity-bucket grouped matmul) by its HLO name. Each thunk's self time (its children's
time removed) is attributed to the part of the model it came from: the `jax.named_scope` stack that
rollout.py puts on its ops (embed, attention/{qkv,kv_cache,scores,out}, moe/{router,dispatch,experts,
combine}, act_quant, lm_head), read from the compiled HLO's metadata. A thunk without metadata (a fusion
XLA made of a convert) takes its parent's part.

Beside the profile: the step's useful work (FLOPs of the matmuls it needs; bytes of the weights and the KV
cache it must read) and this machine's limits, measured in the same process: a large bf16 and fp32 matmul's
FLOP/s and a large array reduction's bytes/s. The ratio of the step's time to max(FLOPs / peak,
bytes / bandwidth) says how far from its bound the step runs: a small model's decode step at these shapes is
bound by launch and dispatch overhead, not arithmetic or memory.

The figures are shares of one process's time; on a machine shared with other jobs, the shares hold better
than the absolute times (run it alone for those).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import pathlib
import re
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: make the repository root importable
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

# The parts of the model, most specific last: a thunk is attributed to the last of these in its scope stack.
PARTS = (
  "embed",
  "attention",
  "qkv",
  "kv_cache",
  "scores",
  "out",
  "moe",
  "router",
  "dispatch",
  "experts",
  "combine",
  "act_quant",
  "lm_head",
)


def _args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--cache", type=int, default=80, help="KV cache slots (bench_rollout: 16 prompt + 64 new)")
  p.add_argument("--steps", type=int, default=20, help="profiled decode steps per engine")
  p.add_argument("--engines", default="bf16,fp4")
  p.add_argument("--json", default="", help="write every figure here")
  p.add_argument("--md", default="", help="write the tables here (markdown)")
  p.add_argument("--smoke", action="store_true", help="batch 2, cache 8, 2 steps, small limit probes")
  return p.parse_args(argv)


def model_config():
  """bench_rollout.py's model."""
  from experiments import bench_rollout  # noqa: PLC0415

  return bench_rollout.model_config()


def useful_work(config, batch: int, cache: int, fp4_weights: bool, fp4_kv: bool, block_size: int = 16) -> dict:
  """FLOPs of the matmuls one decode step needs (k experts per token, attention over `cache` slots) and the
  bytes it must read, ideally: every weight once (the routed experts in FP4 with one-byte block scales per
  `block_size` where fp4_weights), the B embedding rows, the KV cache (FP4 + scales where fp4_kv), bf16
  otherwise. On CPU the engine holds its experts decoded (bf16) and the cache's values in an fp32 carrier
  (rollout.expert_layout, rollout.carrier_dtype), so it reads more than this."""
  c, b = config, batch
  h, d, kv, nh = c.hidden_size, c.head_dim, c.num_kv_heads, c.num_heads
  attn_w = h * d * (nh + 2 * kv) + nh * d * h
  expert_w = 3 * h * c.moe_intermediate_size
  flops_layer = 2 * b * (attn_w + h * c.num_experts + c.num_experts_per_tok * expert_w) + 2 * 2 * b * nh * cache * d
  flops = c.num_layers * flops_layer + 2 * b * h * c.vocab_size
  fp4_bytes = 0.5 + 1 / block_size
  w_bytes = lambda n, fp4: n * fp4_bytes if fp4 else 2 * n
  bytes_layer = w_bytes(attn_w + h * c.num_experts, False) + w_bytes(c.num_experts * expert_w, fp4_weights)
  kv_bytes = c.num_layers * 2 * b * kv * cache * d * (fp4_bytes if fp4_kv else 2)
  total_bytes = c.num_layers * bytes_layer + 2 * (b * h + h * c.vocab_size) + kv_bytes  # embed rows, LM head
  return {"flops": float(flops), "bytes": float(total_bytes), "kv_bytes": float(kv_bytes)}


def machine_limits(smoke: bool = False) -> dict:
  """This process's measured peak matmul FLOP/s (bf16 and fp32, n^3 matmuls) and read bandwidth (a sum
  over an array far larger than the caches), best of a few runs."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  def best(fn, *args, runs=5):
    fn(*args).block_until_ready()
    times = []
    for _ in range(runs):
      t0 = time.perf_counter()
      fn(*args).block_until_ready()
      times.append(time.perf_counter() - t0)
    return min(times)

  n = 256 if smoke else 2048
  out = {}
  for name, dt in (("bf16", jnp.bfloat16), ("fp32", jnp.float32)):
    a = jnp.ones((n, n), dt)
    mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    out[f"matmul_flops_per_s_{name}"] = 2 * n**3 / best(mm, a, a)
  big = jnp.ones(((4 if smoke else 64) * 2**20,), jnp.float32)  # 16 MiB (smoke) / 256 MiB
  out["read_bytes_per_s"] = big.nbytes / best(jax.jit(jnp.sum), big)
  return out


def _self_times(events, keep=lambda name: True, tol: float = 0.01) -> dict[str, tuple[float, str | None]]:
  """{thunk name: (total self time in us, parent thunk name)} from complete ('X') events named by `keep` (the
  module's HLO instructions; runtime events are left out, so their time stays with the thunk around them):
  an event that starts and ends within another on the same thread is its child (a conditional's branch), and
  its time is not the parent's. `tol` (us) absorbs the timestamps' rounding. Thunks on different threads are
  summed, so the total can exceed the wall time where XLA runs thunks concurrently."""
  by_thread = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and "dur" in e and keep(e.get("name")):
      by_thread[(e.get("pid"), e.get("tid"))].append(e)
  selfs, parents = collections.Counter(), {}
  for evs in by_thread.values():
    evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack = []  # (end, name)
    for e in evs:
      start, end = e["ts"], e["ts"] + e["dur"]
      while stack and (stack[-1][0] <= start + tol or end > stack[-1][0] + tol):  # ended, or not enclosing
        stack.pop()
      name = e["name"]
      selfs[name] += e["dur"]
      if stack:
        selfs[stack[-1][1]] -= e["dur"]
        parents.setdefault(name, stack[-1][1])
      stack.append((end, name))
  return {n: (t, parents.get(n)) for n, t in selfs.items()}


def hlo_parts(hlo_text: str) -> dict[str, tuple[str, str]]:
  """{HLO instruction name: (part, op)} from the compiled module's text: the part from the scope stack in its
  metadata op_name (PARTS, most specific), the op from its opcode (a fusion: its kind and the name XLA gave)."""
  out = {}
  pattern = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*? ([\w\-]+)\(")
  for line in hlo_text.splitlines():
    m = pattern.match(line)
    if not m:
      continue
    name, opcode = m.groups()
    op_name = re.search(r'op_name="([^"]*)"', line)
    scopes = op_name.group(1).split("/") if op_name else []
    part = next((s for s in reversed(scopes) if s in PARTS), None)
    kind = re.sub(r"([._](\d+|clone))+$", "", name) if opcode == "fusion" else opcode
    out[name] = (part, kind)
  return out


def decode_program(name: str, config, batch: int, cache: int):
  """One decode step of engine `name` ('bf16' | 'fp4': NVFP4 W4A4 experts + FP4 KV) compiled for batch `batch`
  over a cache of `cache` slots, the new token at the last slot: (compiled, its arguments, the expert layout).
  The compiled step donates its caches: call it as `logits, caches = compiled(engine, tokens, caches, start)`."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from trace_jax import model, rollout  # noqa: PLC0415
  from trace_jax.config import QuantConfig, RolloutConfig  # noqa: PLC0415

  quant = QuantConfig() if name == "fp4" else None
  rollout_config = RolloutConfig(quant=quant, compute_dtype="bfloat16")
  params = jax.jit(model.init_params, static_argnums=0)(config, jax.random.key(0))
  layout = rollout.expert_layout(rollout_config, config)
  engine = rollout.with_expert_layout(
    rollout.weight_sync(params, quant, jnp.dtype("bfloat16"), expert_layout=layout), layout, jnp.bfloat16
  )
  packed = rollout.kv_code_layers(rollout_config, config)  # as `generate` holds them (no codes read back here)
  caches = rollout.init_cache(
    config, batch, cache, quant, jnp.bfloat16, decoded=layout == "values", packed_layers=packed
  )
  caches = jax.tree_util.tree_map(jnp.copy, caches)  # init_cache shares its zero buffers; the step donates them
  step = jax.jit(
    lambda e, tokens, caches, start: rollout.decode_step(
      e,
      tokens,
      caches,
      start,
      jnp.full((batch, 1), start, jnp.int32),
      jnp.ones((batch, cache), jnp.int32),
      model_config=config,
      rollout_config=rollout_config,
    )[:2],
    donate_argnums=2,
  )
  # distinct tokens, so that the rows route as a batch of real sequences does (one token in every row would send
  # the whole batch to the same k experts: the capacity grouped matmul's largest bucket)
  tokens = jax.random.randint(jax.random.key(1), (batch, 1), 0, config.vocab_size, jnp.int32)
  start = jnp.asarray(cache - 1, jnp.int32)
  return step.lower(engine, tokens, caches, start).compile(), (engine, tokens, caches, start), layout


def profile_engine(name: str, config, batch: int, cache: int, steps: int) -> dict:
  """Compile one decode step of engine `name` ('bf16' | 'fp4'), run it `steps` times under the profiler,
  and attribute its thunks' self time to parts and ops."""
  import jax  # noqa: PLC0415

  compiled, (engine, tokens, caches, start), layout = decode_program(name, config, batch, cache)
  wall = []
  for i in range(steps + 1):  # timed outside the trace (the profiler slows each thunk); the first is a warm-up
    t0 = time.perf_counter()
    logits, caches = compiled(engine, tokens, caches, start)
    logits.block_until_ready()
    if i:
      wall.append(time.perf_counter() - t0)
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    for _ in range(steps):
      logits, caches = compiled(engine, tokens, caches, start)
      logits.block_until_ready()
    jax.profiler.stop_trace()
    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    events = json.load(gzip.open(path))["traceEvents"]
  parts_of = hlo_parts(compiled.as_text())
  thunks = _self_times(events, keep=lambda n: n in parts_of)

  def part(n, seen=()):
    p = parts_of[n][0]
    parent = thunks.get(n, (0, None))[1]
    if p is None and parent in parts_of and parent not in seen:
      return part(parent, (*seen, n))
    return p or "other"

  by_part, by_op, by_part_op = collections.Counter(), collections.Counter(), collections.Counter()
  for n, (t, _) in thunks.items():
    by_part[part(n)] += t / steps / 1e6
    by_op[parts_of[n][1]] += t / steps / 1e6
    by_part_op[f"{part(n)}: {parts_of[n][1]}"] += t / steps / 1e6
  launches = sum(1 for e in events if e.get("ph") == "X" and e.get("name") in parts_of) / steps
  profiled = sum(by_part.values())
  return {
    "engine": name,
    "expert_layout": layout,
    "step_s_median": sorted(wall)[len(wall) // 2],
    "thunk_s": profiled,
    "thunks_per_step": launches,
    "by_part_s": dict(by_part.most_common()),
    "by_op_s": dict(by_op.most_common(12)),
    "by_part_op_s": dict(by_part_op.most_common(15)),
  }


def markdown(result: dict) -> str:
  lim, rows = result["limits"], result["engines"]
  lines = [
    f"One decode step, batch {result['batch']}, a cache of {result['cache']} slots, {result['steps']} profiled "
    f"steps per engine (`{result['command']}`; host: {result['host']}).",
    "",
    "| engine (expert layout) | step (median, untraced) | thunk self time (all threads) | thunks / step | "
    "useful GFLOP | MB to read (ideal) | bound by peak bf16 / bandwidth | step / bound |",
    "|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    w = r["useful"]
    bound = max(w["flops"] / lim["matmul_flops_per_s_bf16"], w["bytes"] / lim["read_bytes_per_s"])
    lines.append(
      f"| {r['engine']} ({r['expert_layout']}) | {r['step_s_median'] * 1e3:.2f} ms | {r['thunk_s'] * 1e3:.2f} ms | "
      f"{r['thunks_per_step']:.0f} | {w['flops'] / 1e9:.3f} | {w['bytes'] / 1e6:.2f} | "
      f"{w['flops'] / lim['matmul_flops_per_s_bf16'] * 1e3:.3f} / {w['bytes'] / lim['read_bytes_per_s'] * 1e3:.3f} ms"
      f" | {r['step_s_median'] / bound:.0f}x |"
    )
  lines += [
    "",
    f"Limits measured in the same process: matmul {lim['matmul_flops_per_s_bf16'] / 1e9:.0f} GFLOP/s bf16, "
    f"{lim['matmul_flops_per_s_fp32'] / 1e9:.0f} GFLOP/s fp32; read {lim['read_bytes_per_s'] / 1e9:.1f} GB/s.",
    "",
  ]
  parts = list(dict.fromkeys(p for r in rows for p in r["by_part_s"]))
  lines += ["| part | " + " | ".join(f"{r['engine']} ms (share)" for r in rows) + " |"]
  lines += ["|---|" + "---:|" * len(rows)]
  for p in sorted(parts, key=lambda p: -max(r["by_part_s"].get(p, 0) for r in rows)):
    cells = [f"{r['by_part_s'].get(p, 0) * 1e3:.2f} ({r['by_part_s'].get(p, 0) / r['thunk_s']:.0%})" for r in rows]
    lines.append(f"| {p} | " + " | ".join(cells) + " |")
  for r in rows:
    lines += ["", f"Top ops, {r['engine']}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in r["by_op_s"].items())]
    lines += [
      "",
      f"Top (part: op), {r['engine']}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in r["by_part_op_s"].items()),
    ]
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  args = _args(argv)
  if args.smoke:
    args.batch, args.cache, args.steps = 2, 8, 2
  import platform  # noqa: PLC0415

  import jax  # noqa: PLC0415

  if jax.default_backend() != "cpu":
    raise SystemExit(f"profile_decode profiles XLA:CPU's thunks; this process runs on {jax.default_backend()}.")
  config = model_config()
  limits = machine_limits(args.smoke)
  engines = []
  for name in args.engines.split(","):
    if name not in ("bf16", "fp4"):
      raise SystemExit(f"--engines: unknown engine {name!r}; use bf16 and/or fp4.")
    r = profile_engine(name, config, args.batch, args.cache, args.steps)
    r["useful"] = useful_work(config, args.batch, args.cache, name == "fp4", name == "fp4")  # ideal storage
    engines.append(r)
    print(f"{name}: step {r['step_s_median'] * 1e3:.2f} ms, {r['thunks_per_step']:.0f} thunks", flush=True)
  result = {
    "command": "python experiments/profile_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    "host": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, jax {jax.__version__}",
    "batch": args.batch,
    "cache": args.cache,
    "steps": args.steps,
    "limits": limits,
    "engines": engines,
  }
  md = markdown(result)
  print(md)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
  if args.md:
    pathlib.Path(args.md).write_text("# Decode step profile (issue 43)\n\n" + md)
  return result


if __name__ == "__main__":
  main()
