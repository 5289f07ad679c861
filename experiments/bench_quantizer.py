"""Micro-benchmark of the FP4 fake-quantizer: RTN against TRACE's guided rounding (and qwix's NVFP4 QAT).

  python experiments/bench_quantizer.py [--shapes 1024x1024,4096x4096] [--iters N]

Everything runs in one process on the default JAX backend (CPU here), on bf16 inputs, jitted and
compiled ahead of timing. Each timed call ends in `block_until_ready`; variants are interleaved
round robin (the order rotates every round) so that drift and neighbours' load hit all of them
alike, and the median over rounds is reported. Variants, NVFP4 with blocks along the last axis:

  bf16 x*2 (floor)   `x * 2` in bf16: one read and one write of x. Not a quantizer: the
                     memory-bound floor of any elementwise pass over the tensor.
  RTN                fake_quant(x): round to nearest, scales computed from x.
  guided m+scale     fake_quant(x, guidance) with 'mantissa_scale' guidance (1 bit per element +
                     the rollout's E4M3 scales), returning the agreement stats too.
  guided full        the same with 'full' guidance (4-bit rollout codes + scales).

fwd+bwd is `jax.value_and_grad` of sum(fake_quant(x) * dy) with clip_gradient=True (so the
backward needs the forward's in-range mask). The goal for guided/RTN is <= 1.15.

If qwix is importable, its NVFP4 QAT dot_general (qwix._src.core.dot_general_qt, both operands
NVFP4, tile 16) is timed against ours: fake_quant of both operands (blocks along the contraction
axis) + jnp.dot, same shapes as [M, K] @ [K, N] with M = K = N = rows. Skipped otherwise.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository root importable
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from trace_jax.quantizer import fake_quant, make_guidance  # noqa: E402

GOAL = 1.15


def parse_shapes(text: str) -> list[tuple[int, int]]:
  shapes = []
  for item in text.split(","):
    rows, cols = item.lower().split("x")
    shapes.append((int(rows), int(cols)))
  return shapes


def timeit(fns: dict[str, tuple[Callable, tuple]], iters: int, warmup: int) -> dict[str, float]:
  """Median wall-clock ms per call, variants interleaved round robin."""
  compiled = {name: (jax.jit(fn).lower(*args).compile(), args) for name, (fn, args) in fns.items()}
  for fn, args in compiled.values():
    for _ in range(warmup):
      jax.block_until_ready(fn(*args))
  names = list(compiled)
  times: dict[str, list[float]] = {name: [] for name in names}
  for i in range(iters):
    for name in names[i % len(names) :] + names[: i % len(names)]:
      fn, args = compiled[name]
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(1e3 * (time.perf_counter() - t0))
  return {name: statistics.median(t) for name, t in times.items()}


def inputs(shape, seed=0):
  """bf16 activations with per-row magnitudes over a few decades, the rollout's (slightly different) copy."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp(rng.uniform(-3, 3, (shape[0], 1)))
  x_rollout = x * (1 + 0.05 * rng.standard_normal(shape))
  return jnp.asarray(x, jnp.bfloat16), jnp.asarray(x_rollout, jnp.bfloat16)


def quantizer_table(shape, iters, warmup):
  x, x_rollout = inputs(shape)
  dy = jnp.asarray(np.random.default_rng(1).standard_normal(shape), jnp.bfloat16)
  g_ms = jax.jit(lambda v: make_guidance(v, "nvfp4", "mantissa_scale")[0])(x_rollout)
  g_full = jax.jit(lambda v: make_guidance(v, "nvfp4", "full")[0])(x_rollout)

  baseline = lambda v, g: v * 2
  rtn = lambda v, g: fake_quant(v, "nvfp4", clip_gradient=True)[0]
  guided = lambda v, g: fake_quant(v, "nvfp4", g, clip_gradient=True)
  variants = {
    "bf16 x*2 (floor)": (baseline, None),
    "RTN": (rtn, None),
    "guided m+scale": (guided, g_ms),
    "guided full": (guided, g_full),
  }

  def fwd(f):
    return lambda v, g: f(v, g)

  def fwd_bwd(f):
    def loss(v, g, dy):
      out = f(v, g)
      out = out[0] if isinstance(out, tuple) else out
      return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32))

    return lambda v, g, dy: jax.value_and_grad(loss)(v, g, dy)

  t_fwd = timeit({k: (fwd(f), (x, g)) for k, (f, g) in variants.items()}, iters, warmup)
  t_bwd = timeit({k: (fwd_bwd(f), (x, g, dy)) for k, (f, g) in variants.items()}, iters, warmup)
  return t_fwd, t_bwd, {"mantissa_scale": g_ms.nbytes, "full": g_full.nbytes}


def qwix_table(shape, iters, warmup):
  try:
    from qwix._src.core import dot_general_qt as qwix_qt
  except Exception as e:  # noqa: BLE001  (any import failure means: no qwix here)
    return None, f"qwix not importable ({type(e).__name__}: {e})"
  n = shape[0]
  a, _ = inputs((n, n), seed=2)
  b, _ = inputs((n, n), seed=3)
  dy = jnp.asarray(np.random.default_rng(4).standard_normal((n, n)), jnp.bfloat16)
  cfg = qwix_qt.DotGeneralQtConfig(lhs_qtype="nvfp4", rhs_qtype="nvfp4", tile_size=16)
  dnums = (((1,), (0,)), ((), ()))
  qwix_dot = lambda a, b: qwix_qt.dot_general_qt(a, b, dnums, cfg)
  ours_dot = lambda a, b: jnp.dot(fake_quant(a, "nvfp4")[0], fake_quant(b, "nvfp4", axis=0)[0])
  plain_dot = lambda a, b: jnp.dot(a, b)

  def fwd_bwd(f):
    loss = lambda a, b: jnp.sum(f(a, b).astype(jnp.float32) * dy.astype(jnp.float32))
    return lambda a, b: jax.value_and_grad(loss, argnums=(0, 1))(a, b)

  dots = {"bf16 dot (no quant)": plain_dot, "ours fake_quant+dot": ours_dot, "qwix dot_general_qt": qwix_dot}
  # Sanity check: both NVFP4 products should sit at the same (FP4-sized) distance from the exact one.
  exact = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
  err = lambda f: float(np.abs(np.asarray(jax.jit(f)(a, b), np.float32) - exact).mean() / np.abs(exact).mean())
  diff = {"ours": err(ours_dot), "qwix": err(qwix_dot)}
  t_fwd = timeit({k: (f, (a, b)) for k, f in dots.items()}, iters, warmup)
  t_bwd = timeit({k: (fwd_bwd(f), (a, b)) for k, f in dots.items()}, iters, warmup)
  return (t_fwd, t_bwd, diff), None


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", default="1024x1024,4096x4096", help="comma-separated ROWSxCOLS (bf16)")
  parser.add_argument("--iters", type=int, default=20, help="timed rounds per variant")
  parser.add_argument("--warmup", type=int, default=2, help="untimed calls per variant after compiling")
  parser.add_argument("--dot-iters", type=int, default=5, help="timed rounds for the qwix matmul comparison")
  parser.add_argument("--no-qwix", action="store_true", help="skip the qwix comparison")
  args = parser.parse_args()

  print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), ", end="")
  print(f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}; bf16 inputs, NVFP4, median ms")
  print(f"iters={args.iters} warmup={args.warmup}, variants interleaved round robin; ", end="")
  print(f"load average at start {os.getloadavg()[0]:.1f}\n")
  for shape in parse_shapes(args.shapes):
    t_fwd, t_bwd, nbytes = quantizer_table(shape, args.iters, args.warmup)
    mib = lambda n: f"{n / 2**20:.2f} MiB"
    print(f"== {shape[0]}x{shape[1]} ({mib(shape[0] * shape[1] * 2)} bf16; ", end="")
    print(f"guidance: m+scale {mib(nbytes['mantissa_scale'])}, full {mib(nbytes['full'])})")
    print(f"{'variant':<20}{'fwd ms':>10}{'fwd+bwd ms':>13}{'fwd/RTN':>10}{'f+b/RTN':>10}")
    for name in t_fwd:
      r_f, r_b = t_fwd[name] / t_fwd["RTN"], t_bwd[name] / t_bwd["RTN"]
      flag = "  <- over goal" if name.startswith("guided") and max(r_f, r_b) > GOAL else ""
      print(f"{name:<20}{t_fwd[name]:>10.2f}{t_bwd[name]:>13.2f}{r_f:>10.3f}{r_b:>10.3f}{flag}")
    worst = max(max(t_fwd[k] / t_fwd["RTN"], t_bwd[k] / t_bwd["RTN"]) for k in t_fwd if k.startswith("guided"))
    print(f"worst guided/RTN {worst:.3f} (goal <= {GOAL})\n")

  for shape in [] if args.no_qwix else parse_shapes(args.shapes):
    result, why = qwix_table(shape, args.dot_iters, 1)
    if result is None:
      print(f"qwix comparison skipped: {why}")
      break
    t_fwd, t_bwd, diff = result
    n = shape[0]
    print(f"== NVFP4 QAT matmul [{n}x{n}] @ [{n}x{n}], bf16 (mean relative error vs the exact product: ", end="")
    print(f"ours {diff['ours']:.4f}, qwix {diff['qwix']:.4f})")
    print(f"{'variant':<22}{'fwd ms':>10}{'fwd+bwd ms':>13}")
    for name in t_fwd:
      print(f"{name:<22}{t_fwd[name]:>10.1f}{t_bwd[name]:>13.1f}")
    ours, qwix = "ours fake_quant+dot", "qwix dot_general_qt"
    print(f"qwix/ours: fwd {t_fwd[qwix] / t_fwd[ours]:.3f}, fwd+bwd {t_bwd[qwix] / t_bwd[ours]:.3f}\n")
  print(f"load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
  main()
