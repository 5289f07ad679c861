"""GPU diagnostic of the Mosaic FP4 kernel (pallas_kernels/fp4_mosaic.py): tile variants timed side by
side with bf16 baselines, each checked against the jnp reference, on an sm_90 GPU (about 4 minutes):

  PYTHONPATH=. python experiments/mosaic_variants.py   # writes $OUT/mosaic_variants.json (or /tmp/...)

(or as a stage of the GPU check: bash experiments/gpu_check.sh --stages kernel_tests,mosaic_variants).

Every row has two times per call (experiments/device_time.py): `wall_us`, the median wall clock of a
jitted call (dispatch to block_until_ready, divided by the calls it makes), and `device_us`, the
kernels' own time on the GPU's streams from a profiler trace. The first holds dispatch and launch
costs; the second is what a kernel change moves. GB/s are from device_us where there is one.

In this order (BUDGET_S, default 270, stops it early): dense K = N = 8192 at M = 1, 8: XLA's bf16 dot;
the kernel's defaults (two compute warpgroups: `compute_wgs`, each half of every step's K), one
warpgroup, `overlap` (one warpgroup), and more weight bytes in flight per SM: 5 slots, or x tiles of 8
rows (block_m 8: wgmma N = 8) with 4, 7 or 14 slots. Grouped, 64 then 256 tokens top-8 of 128 experts,
gate_up [1536, 2048] and down [2048, 768]: the defaults, the other number of warpgroups (one at 64
tokens, two at 256), and the bf16 baselines: the Triton grouped kernel of the same family on bf16
weights (`grouped_bf16_matmul`) and (64 tokens) XLA's `lax.ragged_dot`. Then M = 64, and a wide
weight (N = 28672, M = 8): more blocks per SM. Every call reads its own weight copy (more than the 50 MB L2 in all).
A variant whose sums are off the reference (`err` above MAX_ERR) gets an "error" too: the stage fails.

A row that runs past ROW_S (a kernel that hangs) ends the process; rerun with RESUME=1 to keep the rows so
far, record that one as hung and go on (gpu_check does). Earlier runs: docs/gpu_check/h200-2026-12-04-*.json
(wall clock only), h200-2026-12-04b-*.json (device time; also `parts`, two warpgroups with `overlap`,
and the decode replaced by register moves: 13.1 us at M = 8 against 16.5) and h200-2026-12-04c-*.json
(also 8 slots of block_k 256: slower).
"""

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import device_time
from experiments.bench_fp4_matmul import copies, rel_err
from pallas_kernels import fp4_mosaic as fm
from pallas_kernels import grouped_fp4_matmul as g
from trace_jax import fp4

T = fm.MosaicTiles
F = jnp.float32
T0 = time.time()
OUT = os.environ.get("OUT", "/tmp")
BUDGET_S = float(os.environ.get("BUDGET_S", 270))  # stop starting rows after this
MAX_ERR = 1e-3  # max |kernel - reference| / max |reference| of a right kernel: the products are exact, f32 sums
ROW_S = float(os.environ.get("ROW_S", 60))  # a longer row (a kernel that hangs) ends the run, with a traceback
log = device_time.RowLog(  # a row past ROW_S ends the process; RESUME=1 records it as hung and goes on
  f"{OUT}/mosaic_variants.json",
  resume=os.environ.get("RESUME") == "1",
  row_s=ROW_S,
  key=lambda r: (r["name"], r.get("M")),
)
print(jax.__version__, jax.devices(), flush=True)


def multi(op):  # one jitted call running op over every weight copy (no XLA merging: distinct buffers)
  return jax.jit(lambda x, ws, *extra: [op(x, w, *extra) for w in ws])


def rec(name, calls, fn, args, *, check=None, weight_bytes=0, **kw):
  """Times fn(*args) (`calls` ops per call), checks one op against the reference, writes the row."""
  if time.time() - T0 > BUDGET_S or log.done((name, kw.get("M"))):
    return
  with log.row(dict(name=name, **kw)) as row:
    if check is not None:
      row["err"] = check()
      if not row["err"] <= MAX_ERR:  # a finding (the stage fails on it), and still timed
        row["error"] = f"wrong sums: relative error {row['err']:.3g} against the reference"
    m = device_time.measure(fn, args, reps=10, profile_reps=5)
    row["wall_us"] = round(m.wall_us / calls, 2)
    row["device_us"] = None if m.device_us is None else round(m.device_us / calls, 2)
    row["kernels"] = {k: round(v / calls, 2) for k, v in m.kernels.items()}
    if m.device_us is None:
      row["lines"] = m.lines
    us = row["device_us"] or row["wall_us"]
    row["gbps"] = round(weight_bytes / us / 1e3) if weight_bytes else None


# --- dense K = N = 8192 -------------------------------------------------------------------------
K = N = 8192
NW = 4  # weight copies per call: 4 x 37.7 MB FP4 (151 MB) / 4 x 134 MB bf16 > 50 MB L2


def dense_weights(n, seed):
  """NW copies of an [n, K] weight, packed FP4 and bf16 [K, n], and the FP4 weight's float32 values."""
  q = fp4.quantize(jax.random.normal(jax.random.key(seed), (n, K)), "nvfp4")
  wb = [jax.random.normal(jax.random.key(seed + 1 + i), (K, n), jnp.bfloat16) for i in range(NW)]
  return copies(fm.pack_fragments(q), NW), wb, fp4.dequantize(q, F)


SQUARE = dense_weights(N, 0)


def dense_variants(m):
  bm = 16 if m <= 16 else 64
  slots = 4 if bm == 16 else 2
  out = [("default", None), ("1wg", T(bm, 512, slots))]  # default_tiles: two compute warpgroups
  if bm == 16:
    out += [
      ("overlap 1wg", T(bm, 512, slots, overlap=True)),  # overlap: block_m 16, one warpgroup only
      # more weight bytes in flight per SM: a fifth slot (slots need not divide the steps of a lone item), or
      # x tiles of 8 rows (wgmma N = 8: half of x's shared memory) and 7 or 14 slots
      ("2wg s5", T(16, 512, 5, compute_wgs=2)),
    ]
  if m <= 8:
    out += [
      ("bm8 2wg s4", T(8, 512, 4, compute_wgs=2)),
      ("bm8 2wg s7", T(8, 512, 7, compute_wgs=2)),
      ("bm8 2wg bk256 s14", T(8, 256, 14, compute_wgs=2)),
    ]
  return out


def dense(M, n=N):
  x = jax.random.normal(jax.random.key(2), (M, K), jnp.bfloat16)
  ws_, wb_, ref_w_ = SQUARE if n == N else dense_weights(n, 30)  # wider: more blocks per SM (N / 64 of them)
  ref = np.asarray(x.astype(F) @ ref_w_.T)
  label = "" if n == N else f" N={n}"
  rec("bf16 dot [K,N]" + label, NW, multi(jnp.dot), (x, wb_), M=M, weight_bytes=K * n * 2)
  for name, t in dense_variants(M) if n == N else [("default", None), ("1wg", T(16, 512, 4))]:
    f = lambda x, w, t=t: fm.fp4_matmul_mosaic(x, w, tiles=t, out_dtype=F)
    rec(
      "mosaic " + name + label, NW, multi(f), (x, ws_), check=lambda f=f, x=x, ref=ref, w=ws_[0]: rel_err(f(x, w), ref),
      M=M, tiles=str(t or fm.default_tiles(M, K, n)), weight_bytes=K * n * 0.5625,
    )  # fmt: skip


# --- grouped: top-8 of 128 experts ----------------------------------------------------------------
E = 128


def grouped(tokens):
  for n, k in ((1536, 2048), (2048, 768)):
    if time.time() - T0 > BUDGET_S:
      break
    qe = fp4.quantize(jax.random.normal(jax.random.key(3), (E, n, k)), "nvfp4")
    we = fm.pack_fragments(qe)
    wes = copies(we, 2)
    wbs = [jax.random.normal(jax.random.key(20 + i), (E, n, k), jnp.bfloat16) for i in range(2)]
    ids = np.random.default_rng(0).integers(0, E, tokens * 8)
    sizes = jnp.asarray(np.bincount(ids, minlength=E), jnp.int32)
    x = jax.random.normal(jax.random.key(4), (tokens * 8, k), jnp.bfloat16)
    ref = np.asarray(g.grouped_fp4_matmul_reference(x, sizes, qe, out_dtype=F))
    touched = int(np.sum(np.asarray(sizes) > 0))
    fp4_bytes, bf16_bytes = touched * n * k * 0.5625, touched * n * k * 2
    default = fm.default_grouped_tiles(tokens * 8, E, k, n)
    label = f"grouped {tokens} tokens [{n},{k}] "
    other = 3 - default.compute_wgs  # the default's other number of compute warpgroups (2 at 256 tokens: not yet timed)
    for name, t in (("default", default), (f"{other}wg", dataclasses.replace(default, compute_wgs=other))):
      f = lambda x, w, sizes, t=t: fm.grouped_fp4_matmul_mosaic(x, sizes, w, tiles=t, out_dtype=F)
      rec(
        label + name, 2, multi(f), (x, wes, sizes), check=lambda f=f, x=x, we=we, ref=ref, sizes=sizes: rel_err(f(x, we, sizes), ref),
        tiles=str(t), weight_bytes=fp4_bytes, experts_with_rows=touched,
      )  # fmt: skip
    bf16_ref = np.asarray(
      jax.lax.ragged_dot(x.astype(F), jnp.swapaxes(wbs[0], 1, 2).astype(F), sizes, precision="highest")
    )
    triton = lambda x, w, sizes: g.grouped_bf16_matmul(x, sizes, w, out_dtype=F)
    rec(
      label + "bf16 triton (grouped_bf16_matmul)", 2, multi(triton), (x, wbs, sizes), weight_bytes=bf16_bytes,
      check=lambda triton=triton, x=x, w=wbs[0], sizes=sizes, want=bf16_ref: rel_err(triton(x, w, sizes), want),
    )  # fmt: skip
    if tokens == 64:
      wbs_t = [jnp.swapaxes(w, 1, 2) for w in wbs]  # [E, K, N], made outside the timed call
      ragged = lambda x, w, sizes: jax.lax.ragged_dot(x, w, sizes, preferred_element_type=F)
      rec(label + "bf16 xla ragged_dot", 2, multi(ragged), (x, wbs_t, sizes), weight_bytes=bf16_bytes)
      wbs_t = None
    wes = wbs = None  # free the copies before the next shape


# the shapes that matter most first (BUDGET_S may stop the run): decode, then MoE, then M = 64, then a wide weight
dense(1)
dense(8)
grouped(64)
grouped(256)
dense(64)
dense(8, n=28672)

print("total", round(time.time() - T0), "s", flush=True)
