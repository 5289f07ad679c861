"""GPU diagnostic of the Mosaic FP4 kernel (pallas_kernels/fp4_mosaic.py): tile variants timed side by
side with bf16 baselines, each checked against the jnp reference, on an sm_90 GPU (about 4 minutes):

  PYTHONPATH=. python pallas_kernels/lab/mosaic_variants.py   # writes $OUT/mosaic_variants.json (or /tmp/...)

(or as a stage of the GPU check: bash pallas_kernels/lab/gpu_check.sh --stages kernel_tests,mosaic_variants).

Every row has two times per call (pallas_kernels/lab/device_time.py): `wall_us`, the median wall clock of a
jitted call (dispatch to block_until_ready, divided by the calls it makes), and `device_us`, the
kernels' own time on the GPU's streams from a profiler trace. The first holds dispatch and launch
costs; the second is what a kernel change moves. GB/s are from device_us where there is one.

In this order (BUDGET_S, default 270, stops it early): a dense call, M = 8, K = N = 8192: XLA's bf16 dot, the
default tiles, the same with the two compute warpgroups taking turns at the MMAs (`ping_pong` "issued" and
"done"), with a step's last MMAs running into the next step's decode (`overlap`, two parts), with x multicast
to clusters of 2 blocks, without the decode, and without decode and MMAs; M = 16: the bf16 dot, the default
tiles and the cluster of 2; grouped, 64 tokens top-8 of 128 experts, gate_up [1536, 2048] and down
[2048, 768]: the default tiles (one block per expert and pass lane, its row units chained), at gate_up with
two 64-row tiles per 256-wide step, with `early_exit` (a block without work ends after one load), with turns,
and the Triton kernel of the same family on bf16 weights (`grouped_bf16_matmul`); the tensor cores' rate at
the kernel's MMA shape (pallas_kernels/lab/wgmma_rate.py: ns per wgmma m64 x N x k16 per SM, N = 8..256), and the
same work as per-warp mma.sync m16n8k16 (2 or 4 accumulator chains a warp); gate_up
where expert 0, then expert 120, takes two x tiles (an early and a late block in the grid); 256 tokens, with
one tile at 512 at gate_up, with early exit and with one lane; M = 8, K = 32768, the same rows as at 8192 (a
block's fixed cost and its steady rate). Every call reads its own weight copy (more than the 50 MB L2 in all).
A variant whose sums are off the reference (`err` above MAX_ERR) gets an "error" too: the stage fails.

A row that runs past ROW_S (a kernel that hangs) ends the process; rerun with RESUME=1 to keep the rows so
far, record that one as hung and go on (gpu_check does). Earlier runs, docs/gpu_check/h200-2026-12-04*:
  (none) wall clock only; x multicast to a cluster slower everywhere.
  b, c   device time: two compute warpgroups faster than one at every shape; `parts`, `overlap` in one part
         (wrong sums with two warpgroups, NaN at block_m 64: it writes registers in flight, since refused);
         the decode replaced by register moves: 13.1 us at M = 8 against 16.5; 8 slots of block_k 256:
         slower; XLA's `lax.ragged_dot` 5.3x and 4.6x slower than the kernel at 64 tokens.
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

from pallas_kernels import fp4_mosaic as fm
from pallas_kernels import grouped_fp4_matmul as g
from pallas_kernels.lab import device_time, wgmma_rate
from pallas_kernels.lab.bench_fp4_matmul import copies, rel_err
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
SM_COUNT = getattr(jax.devices()[0], "core_count", 132)  # the rate probes' blocks: one per SM (132 on an H200)


def multi(op):  # one jitted call running op over every weight copy (no XLA merging: distinct buffers)
  return jax.jit(lambda x, ws, *extra: [op(x, w, *extra) for w in ws])


# A row of these variants that hung (recorded by a rerun) skips the variant's later rows: each would hang too.
UNTIMED = ("ping-pong", "early exit", "overlap", "cluster")


def hung(name):
  tags = [t for t in UNTIMED if t in name]
  return any(t in r["name"] and str(r.get("error", "")).startswith("no result") for t in tags for r in log.rows)


def rec(name, calls, fn, args, *, check=None, weight_bytes=0, **kw):
  """Times fn(*args) (`calls` ops per call), checks one op against the reference, writes the row."""
  if time.time() - T0 > BUDGET_S or log.done((name, kw.get("M"))) or hung(name):
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
# x tiles (13% of calls at 64 tokens, 30% at 256) does not double its one block's time (run f: 87.7 us against
# 155.7 with one lane, expert 0 taking two). This run: the default with early exit and with turns, and a two-pass
# expert early and late in the grid (blocks start in grid order).
def two_pass_sizes(sizes, expert, block_m=16):
  """`sizes` (the same total) with `expert` given block_m + 1 rows from an 8-row boundary: two x tiles, the only
  expert with two. The boundary is made by taking rows from the largest groups before it, the total kept by the
  groups after it."""
  sizes = np.array(sizes)
  total, after = sizes.sum(), slice(expert + 1, None)
  assert expert + 1 < len(sizes), "two_pass_sizes: the total is kept by the groups after the expert"
  sizes[expert] = block_m + 1
  while sizes[:expert].sum() % 8:
    sizes[np.argmax(sizes[:expert])] -= 1
  while sizes.sum() != total:
    i = expert + 1 + (np.argmax(sizes[after]) if sizes.sum() > total else np.argmin(sizes[after]))
    sizes[i] += 1 if sizes.sum() < total else -1
  passes = fm.passes(sizes, block_m)
  assert sizes.min() >= 0 and passes[expert] == 2 and np.sum(passes > 1) == 1, sizes
  return sizes


def grouped(tokens, variants=(), two_pass=()):
  """gate_up [1536, 2048] and down [2048, 768], `tokens` top-8 of 128 experts (sampled): the default tiles,
  `variants` (name, fields changed from the default, or a function of the default and K giving the tiles) and the
  bf16 Triton grouped kernel of the same family. With `two_pass` (experts), gate_up's default only, on group sizes
  where each of those experts in turn takes two x tiles (`two_pass_sizes`)."""
  for n, k in ((1536, 2048),) if two_pass else ((1536, 2048), (2048, 768)):
    if time.time() - T0 > BUDGET_S:
      break
    qe = fp4.quantize(jax.random.normal(jax.random.key(3), (E, n, k)), "nvfp4")
    weights = (qe, fm.pack_fragments(qe))
    ids = np.random.default_rng(0).integers(0, E, tokens * 8)
    sampled = np.bincount(ids, minlength=E)
    x = jax.random.normal(jax.random.key(4), (tokens * 8, k), jnp.bfloat16)
    default = fm.default_grouped_tiles(tokens * 8, E, k, n)
    label = f"grouped {tokens} tokens [{n},{k}] "
    for expert in two_pass:
      grouped_rows(
        label + f"two-pass expert {expert} ", x, weights, two_pass_sizes(sampled, expert), [("default", default)]
      )
    if two_pass:
      continue
    tiles = [("default", default)]
    for name, fields in variants:  # fields: a dict, or a function of (default, k) giving tiles or None (no row)
      t = fields(default, k) if callable(fields) else dataclasses.replace(default, **fields)
      tiles += [(name, t)] if t else []
    grouped_rows(label, x, weights, sampled, tiles)
    sizes = jnp.asarray(sampled, jnp.int32)
    wbs = [jax.random.normal(jax.random.key(20 + i), (E, n, k), jnp.bfloat16) for i in range(2)]
    bf16_ref = np.asarray(
      jax.lax.ragged_dot(x.astype(F), jnp.swapaxes(wbs[0], 1, 2).astype(F), sizes, precision="highest")
    )
    triton = lambda x, w, sizes: g.grouped_bf16_matmul(x, sizes, w, out_dtype=F)
    rec(
      label + "bf16 triton (grouped_bf16_matmul)", 2, multi(triton), (x, wbs, sizes),
      weight_bytes=int(np.sum(sampled > 0)) * n * k * 2,
      check=lambda triton=triton, x=x, w=wbs[0], sizes=sizes, want=bf16_ref: rel_err(triton(x, w, sizes), want),
    )  # fmt: skip
    wbs = None  # free the copies before the next shape


def grouped_rows(label, x, weights, sizes, tiles):
  """The Mosaic kernel at each of `tiles` (name, MosaicTiles) on these group sizes, two weight copies a call."""
  qe, we = weights
  sizes = jnp.asarray(sizes, jnp.int32)
  ref = np.asarray(g.grouped_fp4_matmul_reference(x, sizes, qe, out_dtype=F))
  wes = copies(we, 2)
  touched = int(np.sum(np.asarray(sizes) > 0))
  n, k = we.shape[1:]
  for name, t in tiles:
    f = lambda x, w, sizes, t=t: fm.grouped_fp4_matmul_mosaic(x, sizes, w, tiles=t, out_dtype=F)
    rec(
      label + name, 2, multi(f), (x, wes, sizes), check=lambda f=f: rel_err(f(x, we, sizes), ref),
      tiles=str(t), weight_bytes=touched * n * k * 0.5625, experts_with_rows=touched,
      max_passes=int(fm.passes(np.asarray(sizes), t.block_m).max()),
    )  # fmt: skip


# --- the tensor cores' rate at the kernel's MMA shape ------------------------------------------------------


def wgmma_rates(variants=wgmma_rate.VARIANTS):
  """ns of an SM's time per wgmma m64 x N x k16 (pallas_kernels/lab/wgmma_rate.py: no copies, no decode), at N = 8..256,
  one or two warpgroups, A from registers (the FP4 kernel's) or shared memory. The FP4 kernel's steady step issues
  32 of N = 16 per SM and took 0.775 us (0.60 without the decode): 24 ns (19) each. A rate near that says the MMAs
  bound the step; one N = 16 as slow as N = 64 says that tokens are free up to 64 and weights per instruction
  are what counts."""
  for n, wgs, a_in_smem in variants:
    name = f"wgmma rate N={n} wgs={wgs} A in " + ("smem" if a_in_smem else "registers")
    if time.time() - T0 > BUDGET_S or log.done((name, None)):
      continue
    f = wgmma_rate.rate_kernel(n, wgs=wgs, a_in_smem=a_in_smem, blocks=SM_COUNT)
    with log.row(dict(name=name, n=n, wgs=wgs, a_in_smem=a_in_smem, reps=wgmma_rate.REPS)) as row:
      ns = _time_rate(f, wgs, row)
      row["ns_per_wgmma_per_sm"] = round(ns, 2)
      row["weights_per_ns_per_sm"] = round(wgmma_rate.ROWS * 16 / ns, 1)  # weights (m64 x k16) an instruction covers


def _time_rate(f, wgs, row):
  """Times a rate probe of wgmma_rate (one block per SM) into `row`; returns ns per wgmma(-equivalent) per SM."""
  m = device_time.measure(f, (jnp.ones(1, F),), reps=5, profile_reps=3)
  row["wall_us"] = round(m.wall_us, 2)
  row["device_us"] = None if m.device_us is None else round(m.device_us, 2)
  us = row["device_us"] or row["wall_us"]
  return wgmma_rate.ns_per_instruction(us, reps=wgmma_rate.REPS, wgs=wgs, blocks=SM_COUNT, sms=SM_COUNT)


def mma_sync_rates(variants=wgmma_rate.MMA_SYNC_VARIANTS):
  """The same work per SM as wgmma N = 16 (64 x 16 x k16 a unit) as per-warp mma.sync m16n8k16, in 2 or 4
  accumulator chains per warp (wgmma_rate.mma_sync_rate_kernel): ns per unit, beside the wgmma rows. Its operands
  stay in registers: a kernel of this form would also load x's fragments from shared memory (an ldmatrix per 16 of
  K per warp), which wgmma reads itself. Clearly faster than wgmma at N = 16 would make that kernel worth building
  (docs/gpu.md: the lead past the wgmma floor)."""
  for accumulators, wgs in variants:
    name = f"mma.sync rate N=16 wgs={wgs} accumulators={accumulators}"
    if time.time() - T0 > BUDGET_S or log.done((name, None)):
      continue
    f = wgmma_rate.mma_sync_rate_kernel(accumulators, wgs=wgs, blocks=SM_COUNT)
    with log.row(dict(name=name, wgs=wgs, accumulators=accumulators, reps=wgmma_rate.REPS)) as row:
      row["ns_per_wgmma_equivalent_per_sm"] = round(_time_rate(f, wgs, row), 2)


# the questions that matter most first (BUDGET_S may stop the run): a dense call with the warpgroups taking turns
# at the MMAs, and where its time goes (without the decode, and without decode and MMAs); M = 16, the issue's
# largest decode shape, never timed (3 rows: the roofline's one shape below 2.5x); the MoE layers at decode,
# with empty blocks ending early and with turns; the tensor cores' rate; a two-pass expert early and late in the
# grid; 256 tokens; a dense call at K = 32768 (a block's fixed cost and its steady rate, with the K = 8192 rows).
# Run d has M = 1, more slots and x tiles of 8 rows, and the wide weight.
def candidates(m, k, n):
  """The default tiles with the warpgroups taking turns, with a step's MMAs running on into the next step, and
  with x multicast to clusters of 2 blocks (x's L2 reads halved: at M = 8, K = N = 8192 every block reads 8 x 8192
  bf16 of x, 16.8 MB over 128 blocks against 37.7 MB of FP4 weights; without the decode the step moved 5.8 TB/s
  of both through L2 (run b: 12.9 us, 3.5 fixed), or the weights alone from HBM at 4.0: either may bound it.
  Cluster 2 was timed only in the first run, in wall clock and with one warpgroup, where it was slower)."""
  t = fm.default_tiles(m, k, n)
  overlap = ("overlap 2 parts", dataclasses.replace(t, parts=2, overlap=True))
  turns = [(f"ping-pong {when}", dataclasses.replace(t, ping_pong=when)) for when in PING_PONG]
  return [*turns, overlap, cluster_2(m, k, n)]


def cluster_2(m, k, n):
  return ("cluster 2", dataclasses.replace(fm.default_tiles(m, k, n), cluster=2))


def other_step(row_tiles):
  """A variant of a grouped default: steps on `row_tiles` 64-row tiles (1: of 512, 2: of 256; the same rows chained
  per block), none where that is the default or `fm.with_row_tiles` refuses it (down: K = 768 has no two steps of
  512)."""

  def tiles(default, k):
    if default.row_tiles == row_tiles:
      return None
    try:
      return fm.with_row_tiles(default, row_tiles, k)
    except ValueError:  # K has no two such steps
      return None

  return tiles


PING_PONG = ("issued", "done")
EARLY_EXIT = ("early exit", dict(early_exit=True))
ONE_TILE, TWO_TILES = ("one tile at 512", other_step(1)), ("two tiles at 256", other_step(2))
dense(8, variants=candidates(8, K, N), diagnostics=True)
# M = 16 (never timed: block_m 16 like M = 8, twice x's rows): the roofline (pallas_kernels/lab/kernel_report.py) puts it at
# its L2 time, x's reads 0.89x the weight bytes (10.2 us against 8.0 of memory time, 2.47x bf16), where a cluster
# of 2 halves them (3.0x); the row says whether that limit holds.
dense(16, variants=[cluster_2(16, K, N)])
# gate_up's step shape: at 64 tokens (x tiles of 16 rows) the default is one tile at 512, and two tiles at 256 (x
# read once per 128 weight rows) were 4.8% slower in run e with 8 slots (90.7 us against 86.6 at 12 tiles a block);
# with 4 slots untimed. At 256 tokens (x tiles of 32 rows, 1.78x the weight bytes with one tile) the default is two
# tiles, never timed with its units chained: one tile beside it.
grouped(64, variants=[TWO_TILES, EARLY_EXIT, ("ping-pong issued", dict(ping_pong="issued"))])
wgmma_rates()
mma_sync_rates()
grouped(64, two_pass=(0, 120))
grouped(256, variants=[ONE_TILE, EARLY_EXIT, ("1 lane", dict(pass_lanes=1))])
dense(8, k=32768, variants=candidates(8, 32768, N), diagnostics=True)

print("total", round(time.time() - T0), "s", flush=True)
