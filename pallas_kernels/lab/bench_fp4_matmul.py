"""Benchmark: BF16 matmul against the Pallas FP4 kernels at decode and MoE shapes (written for an H200).

  python pallas_kernels/lab/bench_fp4_matmul.py            # on a GPU: the full tables (a few minutes)
  python pallas_kernels/lab/bench_fp4_matmul.py --sweep    # + tile configs at K=N=4096 and T=8 (~5 more minutes)
  python pallas_kernels/lab/bench_fp4_matmul.py --smoke    # anywhere: tiny shapes, Pallas interpret mode
  ... --json PATH                                   # also every figure as JSON (rewritten after each row)

Dense (nn.Linear, weight [N, K]): x[M, K] bf16 with M in {1, 8, 64}, K = N in {4096, 8192}:
  bf16         jnp.dot(x, w.T) with bf16 weights (XLA / cuBLAS)
  fp4 w4a16    fp4_matmul(x, nvfp4 weight): packed codes + E4M3 scales dequantized in the kernel
  ptx          the same with ptx_decode=True (codes decoded by inline PTX byte permutes; GPU only)
  mosaic       fp4_mosaic.fp4_matmul_mosaic: the Mosaic GPU kernel on the weight packed as wgmma
               fragments (`pack_fragments`, done once outside the timing, as at weight sync; GPU only)
  fp4 w4a4     fp4_matmul with quantize_activations=True (RTN NVFP4 fake-quant prologue on x)
Grouped (MoE experts, E=128, top-8, hidden 2048, expert intermediate 768; gate_up [E, 1536, 2048]
and down [E, 2048, 768]), T tokens in {8, 64, 256} routed uniformly at random, a new routing for
every call (so nothing that depends on group_sizes is amortized across calls):
  bf16         grouped_bf16_matmul: the same kernel family (visits, tiles, K loop) on bf16 weights,
               the baseline of "speedup"
  xla          jax.lax.ragged_dot with bf16 weights [E, K, N], for reference: XLA rewrites it into a
               dense masked matmul over all experts, so a speedup against it says little
  fp4          grouped_fp4_matmul (NVFP4); ptx: with ptx_decode=True
  mosaic       fp4_mosaic.grouped_fp4_matmul_mosaic on the experts packed as wgmma fragments (GPU only)

Timing. Each jitted call runs the op on `calls` different inputs in one dispatch (no loop, so XLA
cannot hoist anything), each on its own copy of the weights (so that XLA's dot merger cannot turn
the bf16 calls that share a weight into one matmul, and every read comes from HBM): times are
HBM-bound steady state, like a decode step that walks all layers. Warmup runs first. On a GPU a time
is the kernels' own time on the device's streams, from a profiler trace of 5 calls
(pallas_kernels/lab/device_time.py): the wall clock of a call also holds its dispatch and launches (on an
H200, XLA's bf16 dot timed by wall clock reached 1.9 TB/s at M = 1, under half of HBM). --smoke (and
any backend without device streams): the median wall clock of the repetitions.

Bytes are what the op must read and write: weights (codes + scales for FP4; for grouped only the
experts that got rows, mean over the routings) + activations + output. GB/s is bytes / time,
against the measured copy bandwidth of the device (a device-to-device copy of 2 GiB: read + write)
("%copy") and the device's nominal HBM bandwidth ("%peak": 4.8 TB/s on an H200, 3.35 on an H100 SXM; NOMINAL_BW).

With requirements-gpu-compile.txt installed, each row also gets the kernel's static figures
(`pallas_kernels.gpu_compile`, compiled for sm_90a: launches per call, registers, SASS instructions
per weight in the main loop), so that timings and instruction counts sit side by side.
"speedup" is bf16 time / the fastest fp4 (w4a16, ptx or mosaic) time; "vs roof" is the bf16 roofline time
(bf16 bytes at the measured copy bandwidth) over that fp4 time. The issue's goal: >= 2.5x at M <= 16.

`err` / `ptx err` are max |kernel - jnp reference| / max |reference| (reference: fp4.dequantize +
float32 dot); about 4e-3 (one bf16 rounding of the output) is right, anything larger is a bug.
In --smoke mode the ptx columns are skipped (inline PTX cannot run in interpret mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository root importable
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from pallas_kernels import fp4_matmul as dense  # noqa: E402
from pallas_kernels import fp4_mosaic as mosaic  # noqa: E402
from pallas_kernels import grouped_fp4_matmul as grouped  # noqa: E402
from pallas_kernels.lab import device_time  # noqa: E402
from trace_jax import fp4  # noqa: E402

# Nominal HBM bandwidth by device kind (jax's device_kind), first match: the "%peak" column's denominator. An
# unlisted device gets no %peak (the measured copy bandwidth, "%copy", is there either way).
NOMINAL_BW = (
  ("GH200", float("nan")),  # HBM3 or HBM3e (4.0 or 4.9 TB/s): the name does not say which
  ("H200", 4.8e12),
  ("H100 PCIe", 2.0e12),
  ("H100 NVL", 3.9e12),
  ("H100", 3.35e12),
)


def nominal_bandwidth(device_kind: str) -> float:
  """Bytes per second of the device's HBM by its spec sheet, NaN for a device not in NOMINAL_BW."""
  return next((bw for name, bw in NOMINAL_BW if name in device_kind), float("nan"))


GOAL = 2.5

DENSE_CONFIGS = [  # --sweep: tried on top of the defaults
  dict(block_k=128),
  dict(block_k=512),
  dict(block_n=64),
  dict(block_n=128),
  dict(k_splits=1),
  dict(k_splits=4),
  dict(num_warps=8),
  dict(num_stages=3),
]
GROUPED_CONFIGS = [dict(block_n=32), dict(block_n=128), dict(block_k=256), dict(num_warps=8), dict(num_stages=3)]
# Every configuration is tried with both decodes.
DENSE_CONFIGS = [dict(cfg, ptx_decode=ptx) for ptx in (False, True) for cfg in DENSE_CONFIGS]
GROUPED_CONFIGS = [dict(cfg, ptx_decode=ptx) for ptx in (False, True) for cfg in GROUPED_CONFIGS]


class Report:
  """Every printed figure, as JSON: rewritten after each row so that a run cut short keeps what it measured."""

  def __init__(self, path: str | None):
    self.path = path
    self.data: dict = {"complete": False}

  def set(self, **fields):
    self.data.update(fields)
    self._write()

  def add(self, table: str, row: dict):
    self.data.setdefault(table, []).append(row)
    self._write()

  def _write(self):
    if not self.path:
      return
    tmp = f"{self.path}.tmp"
    with open(tmp, "w") as f:
      json.dump(_jsonable(self.data), f, indent=1)
    os.replace(tmp, self.path)


def _jsonable(value):
  """NaN and inf -> null (strict JSON), numpy scalars -> Python numbers, tuples -> lists."""
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [_jsonable(v) for v in value]
  if isinstance(value, np.generic):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


@dataclasses.dataclass
class Setup:
  smoke: bool
  interpret: bool
  reps: int
  calls: int  # op calls per timed dispatch
  device_time: bool = False  # time the kernels on the device (profiler trace) instead of the wall clock
  nominal_bw: float = float("nan")  # the device's nominal HBM bytes per second (nominal_bandwidth)


def _median_seconds(fn, args, setup: Setup) -> float:
  if setup.device_time:
    m = device_time.measure(fn, args, reps=setup.reps, profile_reps=5)
    return (m.wall_us if m.device_us is None else m.device_us) * 1e-6 / setup.calls
  jax.block_until_ready(fn(*args))  # compile + warm up
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(setup.reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times) / setup.calls


def copies(tree, n: int):
  """n distinct device copies of an array pytree (a fresh buffer each)."""
  return [tree] + [jax.tree.map(jnp.copy, tree) for _ in range(n - 1)]


def _num_copies(setup: Setup) -> int:
  """One weight copy per call: XLA's GPU dot merger turns dots that share an operand into one dot, so
  calls cycling over fewer copies let the bf16 baseline read each copy once for several calls (on an
  H200: 7 TB/s at K = N = 8192, above HBM's 4.8). Distinct copies also keep every read from HBM."""
  return 2 if setup.smoke else setup.calls


def _time_op(op, xs, weights, setup: Setup, *extra) -> float:
  """Seconds per op(x, w, *extra) with x cycling over xs and w over weights."""

  @jax.jit
  def run(xs, weights, *extra):
    return tuple(op(x, weights[i % len(weights)], *extra) for i, x in enumerate(xs))

  return _median_seconds(run, (xs, weights, *extra), setup)


def rel_err(actual, expected) -> float:
  a, e = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  return float(np.abs(a - e).max() / max(np.abs(e).max(), 1e-30))


def _error(kernel, *, args, expected) -> float:
  return rel_err(kernel(*args), expected)


def measure_copy_bandwidth(setup: Setup) -> float:
  n = 2**20 if setup.smoke else 2**30  # bf16 elements: 2 GiB on a GPU
  a = jnp.ones((n,), jnp.bfloat16)
  copy = jax.jit(lambda a: a + 1)  # one read + one write
  seconds = _median_seconds(copy, (a,), dataclasses.replace(setup, calls=1))
  return 2 * a.nbytes / seconds


def _fmt_row(cols, widths):
  return "  ".join(str(c).rjust(w) for c, w in zip(cols, widths))


def _us(seconds: float) -> str:
  return "n/a" if math.isnan(seconds) else f"{seconds * 1e6:.1f}"


def _sweep(name, kernel, xs, weights, setup: Setup, configs, fp4_bytes, bf16_t, check, *extra, report, shape):
  for cfg in configs:
    try:
      t = _time_op(functools.partial(kernel, **cfg), xs, weights, setup, *extra)
      err = check(functools.partial(kernel, **cfg))
      print(f"      {name} {cfg}: {t * 1e6:.1f} us, {fp4_bytes / t / 1e9:.0f} GB/s, {bf16_t / t:.2f}x, err {err:.1e}")
      row = dict(us=t * 1e6, gbps=fp4_bytes / t / 1e9, speedup=bf16_t / t, err=err)
    except Exception as e:  # a configuration the backend refuses: say so and go on
      print(f"      {name} {cfg}: failed: {type(e).__name__}: {str(e)[:300]}")
      row = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    report.add("sweep", dict(kernel=name, **shape, config=cfg, **row))


def bench_dense(setup: Setup, copy_bw: float, sweep: bool, report: Report):
  shapes = [(1, 256), (8, 256)] if setup.smoke else [(m, k) for k in (4096, 8192) for m in (1, 8, 64)]
  header = ["M", "K=N", "bf16 us", "GB/s", "w4a16 us", "GB/s", "%copy", "ptx us", "GB/s", "w4a4 us", "speedup"]
  header += ["vs roof", "err", "ptx err", "%peak", "instr/w", "mosaic us", "GB/s", "mos err", "mos i/w"]
  widths = [4, 6, 9, 7, 9, 7, 6, 8, 7, 9, 8, 8, 8, 8, 6, 8, 10, 7, 8, 8]
  print("\nDense  x[M,K] @ w[N,K]^T  (NVFP4 weights, bf16 out)")
  print(_fmt_row(header, widths))
  rng = np.random.default_rng(0)
  for m, k in shapes:
    n = k
    w = jnp.asarray(rng.standard_normal((n, k), np.float32))
    w_bf16 = w.astype(jnp.bfloat16)
    wq = jax.jit(fp4.quantize, static_argnums=1)(w, "nvfp4")
    del w
    xs = [jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16) for _ in range(setup.calls)]
    act_bytes = m * k * 2 + m * n * 2
    bf16_bytes = n * k * 2 + act_bytes
    fp4_bytes = wq.nbytes + act_bytes

    bf16_t = _time_op(lambda x, w: jnp.dot(x, w.T), xs, copies(w_bf16, _num_copies(setup)), setup)
    del w_bf16
    fp4_weights = copies(wq, _num_copies(setup))
    kernel = functools.partial(dense.fp4_matmul, interpret=setup.interpret)
    expected = dense.fp4_matmul_reference(xs[0], wq)
    check = functools.partial(_error, args=(xs[0], wq), expected=expected)
    w4a16_t, err = _time_op(kernel, xs, fp4_weights, setup), check(kernel)
    ptx_t, ptx_err = float("nan"), float("nan")
    mosaic_t, mosaic_err = float("nan"), float("nan")
    if not setup.interpret:
      ptx = functools.partial(kernel, ptx_decode=True)
      ptx_t, ptx_err = _time_op(ptx, xs, fp4_weights, setup), check(ptx)
      packed = mosaic.pack_fragments(wq)
      mosaic_copies = copies(packed, _num_copies(setup))
      mosaic_t = _time_op(mosaic.fp4_matmul_mosaic, xs, mosaic_copies, setup)
      mosaic_err = rel_err(mosaic.fp4_matmul_mosaic(xs[0], packed), expected)
      del mosaic_copies
    w4a4_t = _time_op(functools.partial(kernel, quantize_activations=True), xs, fp4_weights, setup)
    best = np.nanmin([w4a16_t, ptx_t, mosaic_t])
    row = [m, k, _us(bf16_t), f"{bf16_bytes / bf16_t / 1e9:.0f}", _us(w4a16_t), f"{fp4_bytes / w4a16_t / 1e9:.0f}"]
    row += [f"{100 * fp4_bytes / best / copy_bw:.0f}", _us(ptx_t), f"{fp4_bytes / ptx_t / 1e9:.0f}", _us(w4a4_t)]
    row += [f"{bf16_t / best:.2f}x", f"{bf16_bytes / copy_bw / best:.2f}x", f"{err:.1e}", f"{ptx_err:.1e}"]
    figures = static_figures("dense", m, n, k, not setup.interpret)
    row += [f"{100 * fp4_bytes / best / setup.nominal_bw:.0f}"]
    row += ["n/a" if not figures or "error" in figures else figures["instructions_per_weight"]]
    mosaic_figures = static_figures("mosaic_fp4", m, n, k, False)
    row += [_us(mosaic_t), f"{fp4_bytes / mosaic_t / 1e9:.0f}", f"{mosaic_err:.1e}"]
    row += ["n/a" if not mosaic_figures or "error" in mosaic_figures else mosaic_figures["instructions_per_weight"]]
    print(_fmt_row(row, widths))
    report.add(
      "dense",
      dict(m=m, k=k, n=n, bf16_bytes=bf16_bytes, fp4_bytes=fp4_bytes, bf16_us=bf16_t * 1e6,
           bf16_gbps=bf16_bytes / bf16_t / 1e9, w4a16_us=w4a16_t * 1e6, w4a16_gbps=fp4_bytes / w4a16_t / 1e9,
           pct_copy=100 * fp4_bytes / best / copy_bw, ptx_us=ptx_t * 1e6, ptx_gbps=fp4_bytes / ptx_t / 1e9,
           w4a4_us=w4a4_t * 1e6, speedup=bf16_t / best, vs_roof=bf16_bytes / copy_bw / best, err=err, ptx_err=ptx_err,
           pct_peak=100 * fp4_bytes / best / setup.nominal_bw, static=figures, mosaic_us=mosaic_t * 1e6,
           mosaic_gbps=fp4_bytes / mosaic_t / 1e9, mosaic_err=mosaic_err, mosaic_static=mosaic_figures),
    )  # fmt: skip
    if sweep and (k == shapes[0][1]):
      tiles = dense.default_tiles(m, n, k, wq.fmt, interpret=setup.interpret)
      print(f"      defaults {tiles}")
      report.add("sweep", dict(kernel="dense", m=m, k=k, n=n, config="defaults", tiles=str(tiles)))
      configs = [c for c in DENSE_CONFIGS if not (setup.interpret and c["ptx_decode"])]
      shape = dict(m=m, k=k, n=n)
      _sweep("dense", kernel, xs, fp4_weights, setup, configs, fp4_bytes, bf16_t, check, report=report, shape=shape)


def _route(tokens: int, num_experts: int, top_k: int, rng) -> np.ndarray:
  """Group sizes of `tokens` tokens each routed to top_k distinct experts uniformly at random."""
  experts = np.argsort(rng.random((tokens, num_experts)), axis=1)[:, :top_k]
  return np.bincount(experts.ravel(), minlength=num_experts).astype(np.int32)


def _time_grouped(op, xs, weights, routings, setup: Setup) -> float:
  """Seconds per op(x, w, group_sizes), call i with x_i, weight copy i % copies and routing i."""

  @jax.jit
  def run(xs, weights, routings):
    return tuple(op(x, weights[i % len(weights)], routings[i]) for i, x in enumerate(xs))

  return _median_seconds(run, (xs, weights, routings), setup)


def static_figures(kind: str, m: int, n: int, k: int, ptx: bool, **grouped_shape) -> dict | None:
  """The kernel's figures compiled for sm_90a (pallas_kernels/lab/kernel_report.py), or None without the
  toolchain (requirements-gpu-compile.txt)."""
  from pallas_kernels import gpu_compile
  from pallas_kernels.lab import kernel_report

  if gpu_compile.missing():
    return None
  try:
    row = kernel_report.report_row(kernel_report.Case(kind, m, n, k, ptx_decode=ptx, **grouped_shape))
  except Exception as e:  # a figure we could not read is reported, not fatal
    return dict(error=f"{type(e).__name__}: {str(e)[:200]}")
  return {key: row[key] for key in ("launches", "registers", "spill_bytes", "instructions_per_weight")}


def bench_grouped(setup: Setup, copy_bw: float, sweep: bool, report: Report):
  if setup.smoke:
    num_experts, top_k, hidden, inter, token_counts = 8, 2, 256, 64, (8,)
  else:
    num_experts, top_k, hidden, inter, token_counts = 128, 8, 2048, 768, (8, 64, 256)
  layers = {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}  # (N, K)
  header = ["layer", "T", "rows", "experts", "bf16 us", "GB/s", "fp4 us", "GB/s", "%copy", "%peak", "ptx us"]
  header += ["speedup", "xla us", "err", "ptx err", "instr/w", "mosaic us", "mos err", "mos i/w"]
  widths = [7, 4, 5, 7, 9, 7, 9, 7, 6, 6, 8, 8, 9, 8, 8, 8, 10, 8, 8]
  print(f"\nGrouped MoE  E={num_experts} top-{top_k} hidden={hidden} expert intermediate={inter}  (NVFP4, bf16 out)")
  print(_fmt_row(header, widths))
  rng = np.random.default_rng(1)
  for name, (n, k) in layers.items():
    w = jax.random.normal(jax.random.PRNGKey(0), (num_experts, n, k), jnp.float32)
    w_bf16 = w.astype(jnp.bfloat16)  # [E, N, K] for the grouped kernels
    wq = jax.jit(fp4.quantize, static_argnums=1)(w, "nvfp4")
    del w
    packed = None if setup.interpret else mosaic.pack_fragments(wq)
    for tokens in token_counts:
      sizes = [_route(tokens, num_experts, top_k, rng) for _ in range(setup.calls)]
      routings = [jnp.asarray(s) for s in sizes]
      rows, active = int(sizes[0].sum()), float(np.mean([(s > 0).sum() for s in sizes]))
      xs = [jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.bfloat16) for _ in range(setup.calls)]
      act_bytes = rows * k * 2 + rows * n * 2
      bf16_bytes = active * n * k * 2 + act_bytes
      fp4_bytes = active * (n * k // 2 + n * k // wq.fmt.block_size) + act_bytes

      bf16_weights = copies(w_bf16, _num_copies(setup))
      bf16_kernel = lambda x, w, g: grouped.grouped_bf16_matmul(x, g, w, interpret=setup.interpret)
      bf16_t = _time_grouped(bf16_kernel, xs, bf16_weights, routings, setup)
      try:
        ragged = lambda x, w, g: jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), g)
        xla_t = _time_grouped(ragged, xs, bf16_weights, routings, setup)
      except Exception as e:  # report it and go on with the kernels
        print(f"      bf16 ragged_dot failed: {type(e).__name__}: {str(e)[:200]}")
        xla_t = float("nan")
      del bf16_weights
      fp4_weights = copies(wq, _num_copies(setup))
      kernel = lambda x, w, g, **cfg: grouped.grouped_fp4_matmul(x, g, w, interpret=setup.interpret, **cfg)
      expected = grouped.grouped_fp4_matmul_reference(xs[0], routings[0], wq)
      check = functools.partial(_error, args=(xs[0], wq, routings[0]), expected=expected)
      fp4_t, err = _time_grouped(kernel, xs, fp4_weights, routings, setup), check(kernel)
      ptx_t, ptx_err = float("nan"), float("nan")
      mosaic_t, mosaic_err = float("nan"), float("nan")
      if not setup.interpret:
        ptx = functools.partial(kernel, ptx_decode=True)
        ptx_t, ptx_err = _time_grouped(ptx, xs, fp4_weights, routings, setup), check(ptx)
        mosaic_weights = copies(packed, _num_copies(setup))
        mosaic_kernel = lambda x, w, g: mosaic.grouped_fp4_matmul_mosaic(x, g, w)
        mosaic_t = _time_grouped(mosaic_kernel, xs, mosaic_weights, routings, setup)
        mosaic_err = rel_err(mosaic_kernel(xs[0], packed, routings[0]), expected)
        del mosaic_weights
      best = np.nanmin([fp4_t, ptx_t, mosaic_t])
      shape = dict(experts=num_experts, tokens=tokens)
      figures = static_figures("grouped", rows, n, k, not setup.interpret, **shape)
      ipw = "n/a" if not figures or "error" in figures else figures["instructions_per_weight"]
      row = [name, tokens, rows, f"{active:.0f}", _us(bf16_t), f"{bf16_bytes / bf16_t / 1e9:.0f}", _us(fp4_t)]
      row += [f"{fp4_bytes / fp4_t / 1e9:.0f}", f"{100 * fp4_bytes / best / copy_bw:.0f}"]
      row += [f"{100 * fp4_bytes / best / setup.nominal_bw:.0f}", _us(ptx_t), f"{bf16_t / best:.2f}x", _us(xla_t)]
      row += [f"{err:.1e}", f"{ptx_err:.1e}", ipw, _us(mosaic_t), f"{mosaic_err:.1e}"]
      mosaic_figures = static_figures("mosaic_fp4", rows, n, k, False, **shape)
      row += ["n/a" if not mosaic_figures or "error" in mosaic_figures else mosaic_figures["instructions_per_weight"]]
      print(_fmt_row(row, widths))
      report.add(
        "grouped",
        dict(layer=name, experts=num_experts, top_k=top_k, n=n, k=k, tokens=tokens, rows=rows, active_experts=active,
             bf16_bytes=bf16_bytes, fp4_bytes=fp4_bytes, bf16_us=bf16_t * 1e6, bf16_gbps=bf16_bytes / bf16_t / 1e9,
             fp4_us=fp4_t * 1e6, fp4_gbps=fp4_bytes / fp4_t / 1e9, pct_copy=100 * fp4_bytes / best / copy_bw,
             pct_peak=100 * fp4_bytes / best / setup.nominal_bw, ptx_us=ptx_t * 1e6, speedup=bf16_t / best,
             xla_ragged_dot_us=xla_t * 1e6, speedup_vs_xla=xla_t / best, err=err, ptx_err=ptx_err, static=figures,
             mosaic_us=mosaic_t * 1e6, mosaic_err=mosaic_err, mosaic_static=mosaic_figures),
      )  # fmt: skip
      if sweep and tokens == token_counts[0]:
        configs = [c for c in GROUPED_CONFIGS if not (setup.interpret and c["ptx_decode"])]
        shape = dict(layer=name, tokens=tokens, n=n, k=k)
        _sweep(name, kernel, xs, fp4_weights, setup, configs, fp4_bytes, bf16_t, check, routings[0], report=report,
               shape=shape)  # fmt: skip
      del fp4_weights
    del w_bf16, wq


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--smoke", action="store_true", help="tiny shapes in Pallas interpret mode (any backend)")
  parser.add_argument("--sweep", action="store_true", help="also time tile configurations (K=N=4096, T=8)")
  parser.add_argument("--reps", type=int, default=20, help="timed repetitions per measurement")
  parser.add_argument("--calls", type=int, default=16, help="op calls per timed dispatch")
  parser.add_argument("--only", choices=["dense", "grouped"], help="run one table")
  parser.add_argument("--json", metavar="PATH", help="write every figure here as JSON (rewritten after each row)")
  args = parser.parse_args(argv)
  report = Report(args.json)

  backend = jax.default_backend()
  if not args.smoke and backend != "gpu":
    sys.exit(f"No GPU (JAX backend: {backend}). Run with --smoke for a functional check in interpret mode.")
  device_kind = jax.devices()[0].device_kind
  nominal_bw = nominal_bandwidth(device_kind)
  if args.smoke:
    setup = Setup(smoke=True, interpret=True, reps=2, calls=2, nominal_bw=nominal_bw)
    print(f"SMOKE MODE on {backend}: tiny shapes, Pallas interpret mode. Timings are NOT meaningful;")
    print("this checks that the benchmark runs end to end and that the kernels match their references.")
  else:
    setup = Setup(
      smoke=False, interpret=False, reps=args.reps, calls=args.calls, device_time=True, nominal_bw=nominal_bw
    )
  print(f"jax {jax.__version__}, device: {device_kind} ({backend})")
  report.set(
    jax=jax.__version__, backend=backend, device=device_kind, smoke=setup.smoke,
    interpret=setup.interpret, reps=setup.reps, calls=setup.calls, goal_speedup=GOAL, nominal_bw_gbps=nominal_bw / 1e9,
    timing="device: kernels on the GPU's streams (profiler, 5 calls)" if setup.device_time else "wall clock, median",
    units="us: microseconds per op call (median); gbps: GB/s; err: max |kernel - reference| / max |reference|",
  )  # fmt: skip

  copy_bw = measure_copy_bandwidth(setup)
  print(
    f"copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s measured; nominal {nominal_bw / 1e9:.0f} GB/s ({device_kind})"
  )
  report.set(copy_bw_gbps=copy_bw / 1e9)
  if args.only in (None, "dense"):
    bench_dense(setup, copy_bw, args.sweep, report)
  if args.only in (None, "grouped"):
    bench_grouped(setup, copy_bw, args.sweep, report)
  print(f"\nGoal: fp4 / bf16 speedup >= {GOAL}x at M <= 16 (dense) and at decode-sized T (grouped).")
  report.set(complete=True)


if __name__ == "__main__":
  main()
