"""GPU diagnostic of the Mosaic FP4 kernel (pallas_kernels/fp4_mosaic.py): tile variants timed side by
side with bf16 baselines, each checked against the jnp reference, on an sm_90 GPU (about 4 minutes):

  PYTHONPATH=. python experiments/mosaic_variants.py   # writes $OUT/mosaic_variants.json (or /tmp/...)

(or as a stage of the GPU check: bash experiments/gpu_check.sh --stages kernel_tests,mosaic_variants).

Every row has two times per call (experiments/device_time.py): `wall_us`, the median wall clock of a
jitted call (dispatch to block_until_ready, divided by the calls it makes), and `device_us`, the
kernels' own time on the GPU's streams from a profiler trace. The first holds dispatch and launch
costs; the second is what a kernel change moves. GB/s are from device_us where there is one.

In this order (BUDGET_S, default 270, stops it early): grouped, 64 tokens top-8 of 128 experts, gate_up
[1536, 2048] and down [2048, 768]: the default tiles (one block per expert and pass lane, its row units
chained) and the Triton grouped kernel of the same family on bf16 weights (`grouped_bf16_matmul`); gate_up on
group sizes where one expert's rows take two x tiles, with two pass lanes (the default) and one; 256 tokens,
the same with one lane too; then where a dense call's time goes: M = 8, K = 8192 and 32768 (a block's fixed
cost and its steady rate), each also without the decode and without decode and MMAs. Every call reads its
own weight copy (more than the 50 MB L2 in all). A variant whose sums are off the reference (`err` above
MAX_ERR) gets an "error" too: the stage fails.

A row that runs past ROW_S (a kernel that hangs) ends the process; rerun with RESUME=1 to keep the rows so
far, record that one as hung and go on (gpu_check does). Earlier runs, docs/gpu_check/h200-2026-12-04*:
  (none) wall clock only; x multicast to a cluster slower everywhere.
  b, c   device time: two compute warpgroups faster than one at every shape; `parts`, `overlap` (wrong sums
         with two warpgroups, NaN at block_m 64); the decode replaced by register moves: 13.1 us at M = 8
         against 16.5; 8 slots of block_k 256: slower; XLA's `lax.ragged_dot` 5.3x and 4.6x slower than
         the kernel at 64 tokens.
  d      more weight bytes in flight per SM (5 slots; x tiles of 8 rows with 4, 7, 14 slots): none faster;
         K = 32768: 3.0 TB/s steady, 3.5 us fixed per block; a wide weight (N = 28672) and M = 1.
  e      tiles_per_block 4 -> 8, 12, 24 (gate_up) and 4 -> 8, 16 (down): 101.0 -> 82.6 us, 56.5 -> 45.6 us.
  f      the new default (two pass lanes): 87.8 and 53.4 us (2.35x, 2.78x the bf16 Triton grouped kernel);
         with an expert's rows in two x tiles 87.7 us, against 155.7 with one lane.
"""

import contextlib
import dataclasses
import functools
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


@functools.cache
def weights(n, k):
  """NW copies of an [n, k] weight, packed FP4 and bf16 [k, n], and the FP4 weight's float32 values (made once)."""
  seed = 0 if (n, k) == (N, K) else 30
  q = fp4.quantize(jax.random.normal(jax.random.key(seed), (n, k)), "nvfp4")
  wb = [jax.random.normal(jax.random.key(seed + 1 + i), (k, n), jnp.bfloat16) for i in range(NW)]
  return copies(fm.pack_fragments(q), NW), wb, fp4.dequantize(q, F)


@contextlib.contextmanager
def without(part):
  """The kernel with its decode arithmetic ("decode": the same loads and MMAs, register moves for the
  decode) or its decode and MMAs ("compute": the copy pipeline alone, the consumer only waiting for each
  step and releasing it) taken out: wrong values, timing only."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # the kernel looks its wgmma up there when traced

  saved = fm._DECODE_PTX, fm._SCALE_PTX, fm._decode_tile, plgpu.wgmma
  moves = "{ mov.b32 $0, $4; mov.b32 $1, $4; mov.b32 $2, $4; mov.b32 $3, $4; }"
  fm._DECODE_PTX = fm._SCALE_PTX = moves
  if part == "compute":
    fm._decode_tile = lambda *_, **__: lambda words_smem: None
    plgpu.wgmma = lambda *_, **__: None
  jax.clear_caches()
  try:
    yield
  finally:
    fm._DECODE_PTX, fm._SCALE_PTX, fm._decode_tile, plgpu.wgmma = saved
    jax.clear_caches()


def dense(M, n=N, k=K, variants=(), diagnostics=False):
  """bf16 dot, the default tiles and `variants` for x [M, k] times an [n, k] weight (diagnostics: also
  without the decode, and without decode and MMAs)."""
  x = jax.random.normal(jax.random.key(2), (M, k), jnp.bfloat16)
  ws_, wb_, ref_w_ = weights(n, k)
  ref = np.asarray(x.astype(F) @ ref_w_.T)
  label = "".join(f" {a}={v}" for a, v in (("N", n), ("K", k)) if v != 8192)  # wider: more blocks per SM
  rec("bf16 dot [K,N]" + label, NW, multi(jnp.dot), (x, wb_), M=M, weight_bytes=k * n * 2)
  for name, t in [("default", None), *variants]:
    f = lambda x, w, t=t: fm.fp4_matmul_mosaic(x, w, tiles=t, out_dtype=F)
    rec(
      "mosaic " + name + label, NW, multi(f), (x, ws_), check=lambda f=f, x=x, ref=ref, w=ws_[0]: rel_err(f(x, w), ref),
      M=M, tiles=str(t or fm.default_tiles(M, k, n)), weight_bytes=k * n * 0.5625,
    )  # fmt: skip
  for part in ("decode", "compute") if diagnostics else ():
    with without(part):
      f = lambda x, w: fm.fp4_matmul_mosaic(x, w, out_dtype=F)
      rec(f"no {part} default" + label, NW, multi(f), (x, ws_), M=M, weight_bytes=k * n * 0.5625)


# --- grouped: top-8 of 128 experts ----------------------------------------------------------------
E = 128


# Run d (docs/gpu_check/h200-2026-12-04d-*): four 64-row tiles per step (row_tiles 4) or 8 slots, twice the
# weight bytes in flight, were 8% faster at gate_up, 64 tokens, and slower at down; both also halve the blocks.
# Run e (-04e-*): chaining more of an expert's units per block (tiles_per_block 4 -> 8, 12, 24 at gate_up; 4 -> 8,
# 16 at down) took 101.0 -> 90.2, 86.6, 82.6 us and 56.5 -> 49.1, 45.6 us: a block's fixed cost paid less often.
# That is the default now (`default_grouped_tiles`), with two pass lanes so that an expert whose rows take two
# x tiles (13% of calls at 64 tokens, 30% at 256) does not double its one block's time. This run: the default,
# and on group sizes where expert 0 has 17 rows (two passes) the default and one lane.
def two_pass_sizes(sizes):
  """sizes with expert 0 given 17 rows (two x tiles of 16), the rows taken from the largest other groups."""
  sizes = np.array(sizes)
  extra = 17 - sizes[0]
  assert extra >= 0, sizes[0]
  sizes[0] = 17
  while extra > 0:
    sizes[1 + np.argmax(sizes[1:])] -= 1
    extra -= 1
  return sizes


def grouped(tokens, two_pass=False):
  for n, k in ((1536, 2048), (2048, 768)) if not two_pass else ((1536, 2048),):
    if time.time() - T0 > BUDGET_S:
      break
    qe = fp4.quantize(jax.random.normal(jax.random.key(3), (E, n, k)), "nvfp4")
    we = fm.pack_fragments(qe)
    wes = copies(we, 2)
    ids = np.random.default_rng(0).integers(0, E, tokens * 8)
    sizes = np.bincount(ids, minlength=E)
    sizes = jnp.asarray(two_pass_sizes(sizes) if two_pass else sizes, jnp.int32)
    x = jax.random.normal(jax.random.key(4), (tokens * 8, k), jnp.bfloat16)
    ref = np.asarray(g.grouped_fp4_matmul_reference(x, sizes, qe, out_dtype=F))
    touched = int(np.sum(np.asarray(sizes) > 0))
    fp4_bytes, bf16_bytes = touched * n * k * 0.5625, touched * n * k * 2
    default = fm.default_grouped_tiles(tokens * 8, E, k, n)
    label = f"grouped {tokens} tokens [{n},{k}] " + ("two-pass expert " if two_pass else "")
    variants = [("default", default)]
    if two_pass or tokens == 256:  # what the second lane costs where it is empty, and saves where it is not
      variants.append(("1 lane", dataclasses.replace(default, pass_lanes=1)))
    for name, t in variants:
      f = lambda x, w, sizes, t=t: fm.grouped_fp4_matmul_mosaic(x, sizes, w, tiles=t, out_dtype=F)
      rec(
        label + name, 2, multi(f), (x, wes, sizes), check=lambda f=f, x=x, we=we, ref=ref, sizes=sizes: rel_err(f(x, we, sizes), ref),
        tiles=str(t), weight_bytes=fp4_bytes, experts_with_rows=touched,
        max_passes=int(fm.passes(np.asarray(sizes), t.block_m).max()),
      )  # fmt: skip
    if not two_pass:
      wbs = [jax.random.normal(jax.random.key(20 + i), (E, n, k), jnp.bfloat16) for i in range(2)]
      bf16_ref = np.asarray(
        jax.lax.ragged_dot(x.astype(F), jnp.swapaxes(wbs[0], 1, 2).astype(F), sizes, precision="highest")
      )
      triton = lambda x, w, sizes: g.grouped_bf16_matmul(x, sizes, w, out_dtype=F)
      rec(
        label + "bf16 triton (grouped_bf16_matmul)", 2, multi(triton), (x, wbs, sizes), weight_bytes=bf16_bytes,
        check=lambda triton=triton, x=x, w=wbs[0], sizes=sizes, want=bf16_ref: rel_err(triton(x, w, sizes), want),
      )  # fmt: skip
    wes = wbs = None  # free the copies before the next shape


# the questions that matter most first (BUDGET_S may stop the run): the MoE layers at decode (and a two-pass
# expert), 256 tokens, then where a dense call's time goes (a block's fixed cost and its steady rate, from two
# K; the same without the decode, and without decode and MMAs). Run d has M = 1, more slots and x tiles of 8
# rows, and the wide weight.
grouped(64)
grouped(64, two_pass=True)
grouped(256)
dense(8, diagnostics=True)
dense(8, k=32768, diagnostics=True)

print("total", round(time.time() - T0), "s", flush=True)
