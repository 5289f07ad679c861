"""GPU diagnostic of the Mosaic FP4 kernel (pallas_kernels/fp4_mosaic.py): tile variants timed side by
side with XLA's bf16 dot, each checked against the jnp reference, on an sm_90 GPU (about 4 minutes):

  PYTHONPATH=. python experiments/mosaic_variants.py      # writes $OUT/diag.json (or /tmp/diag.json)

Dense K = N = 8192 at M = 1, 8, 64 (defaults, x multicast clusters, block_k, overlap), the same with
the decode replaced by register moves ("nodecode": the copies and MMAs alone; wrong values, timing
only), and the grouped gate_up / down projections at 64 tokens top-8 of 128 experts. Every call
reads its own weight copy (4 dense, 2 grouped: more than the 50 MB L2). The results of 2026-12-04
are docs/gpu_check/h200-2026-12-04-mosaic_variants.json.
"""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import fp4_mosaic as fm
from pallas_kernels import grouped_fp4_matmul as g
from trace_jax import fp4

T = fm.MosaicTiles
F = jnp.float32
T0 = time.time()
OUT = os.environ.get("OUT", "/tmp")
rows = []
print(jax.__version__, jax.devices(), flush=True)


def timeit(f, args, reps=30):
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t)
  return float(np.median(ts)) * 1e6


def multi(op, n_w):  # one jitted call running op over n_w weight copies (no XLA merging: custom calls)
  return jax.jit(lambda x, ws: [op(x, w) for w in ws])


def rec(name, us, err=None, **kw):
  r = dict(name=name, us=round(us, 2), err=err, **kw)
  rows.append(r)
  print(json.dumps(r), flush=True)
  json.dump(rows, open(f"{OUT}/diag.json", "w"), indent=1)


# --- dense K = N = 8192 -------------------------------------------------------------------------
K = N = 8192
NW = 4  # weight copies per call: 4 x 37.7 MB FP4 (151 MB) / 4 x 134 MB bf16 > 50 MB L2
q = fp4.quantize(jax.random.normal(jax.random.key(0), (N, K)), "nvfp4")
ws = [fm.pack_fragments(q)] + [None] * (NW - 1)
for i in range(1, NW):
  ws[i] = jax.tree.map(jnp.copy, ws[0])
wb = [jax.random.normal(jax.random.key(10 + i), (K, N), jnp.bfloat16) for i in range(NW)]
ref_w = fp4.dequantize(q, F)
for M in (1, 8, 64):
  x = jax.random.normal(jax.random.key(2), (M, K), jnp.bfloat16)
  ref = np.asarray(x.astype(F) @ ref_w.T)
  us = timeit(multi(lambda x, w: jnp.dot(x, w), NW), (x, wb)) / NW
  rec("bf16 dot [K,N]", us, M=M, gbps=round(K * N * 2 / us / 1e3))
  bm = 16 if M <= 16 else 64
  variants = [("default", None)] + [
    (f"c{c} bk{bk} s{s}", T(bm, bk, s, c))
    for c, bk, s in ((1, 512, 4 if bm == 16 else 2), (2, 512, 4 if bm == 16 else 2), (1, 256, 4), (4, 512, 2))
    if not (bm == 16 and c == 4)
  ]
  if M <= 16:
    variants += [
      ("overlap c1", T(16, 512, 4, 1, overlap=True)),
      ("overlap c1 bk256", T(16, 256, 4, 1, overlap=True)),
      ("overlap c2", T(16, 512, 4, 2, overlap=True)),
    ]
  for name, t in variants:
    if time.time() - T0 > 200:
      break
    try:
      f = lambda x, w, t=t: fm.fp4_matmul_mosaic(x, w, tiles=t, out_dtype=F)
      err = float(np.abs(np.asarray(f(x, ws[0])) - ref).max() / np.abs(ref).max())
      us = timeit(multi(f, NW), (x, ws)) / NW
      rec(
        "mosaic " + name, us, err, M=M, tiles=str(t or fm.default_tiles(M, K, N)), gbps=round(K * N * 0.5625 / us / 1e3)
      )
    except Exception as e:
      rec("mosaic " + name, float("nan"), M=M, error=str(e)[:300])

# no decode arithmetic: the same loads, scales' loads and MMAs (wrong values, timing only)
saved = fm._DECODE_PTX, fm._SCALE_PTX
fm._DECODE_PTX = "{ mov.b32 $0, $4; mov.b32 $1, $4; mov.b32 $2, $4; mov.b32 $3, $4; }"
fm._SCALE_PTX = "{ mov.b32 $0, $4; mov.b32 $1, $4; mov.b32 $2, $4; mov.b32 $3, $4; }"
jax.clear_caches()
x = jax.random.normal(jax.random.key(2), (8, K), jnp.bfloat16)
for name, t in (
  ("nodecode default", None),
  ("nodecode c1", T(16, 512, 4, 1)),
  ("nodecode overlap c1", T(16, 512, 4, 1, overlap=True)),
):
  try:
    f = lambda x, w, t=t: fm.fp4_matmul_mosaic(x, w, tiles=t, out_dtype=F)
    us = timeit(multi(f, NW), (x, ws)) / NW
    rec(name, us, M=8, gbps=round(K * N * 0.5625 / us / 1e3))
  except Exception as e:
    rec(name, float("nan"), M=8, error=str(e)[:300])
fm._DECODE_PTX, fm._SCALE_PTX = saved
jax.clear_caches()

# --- grouped: 64 tokens top-8 of 128 experts -----------------------------------------------------
E = 128
for n, k in ((2048, 768), (1536, 2048)):
  if time.time() - T0 > 230:
    break
  qe = fp4.quantize(jax.random.normal(jax.random.key(3), (E, n, k)), "nvfp4")
  we = fm.pack_fragments(qe)
  wes = [we, jax.tree.map(jnp.copy, we)]
  ids = np.random.default_rng(0).integers(0, E, 512)
  sizes = jnp.asarray(np.bincount(ids, minlength=E), jnp.int32)
  x = jax.random.normal(jax.random.key(4), (512, k), jnp.bfloat16)
  ref = np.asarray(g.grouped_fp4_matmul_reference(x, sizes, qe, out_dtype=F))
  for name, t in (
    ("default", None),
    ("c1 tpb1", T(16, 512 if k % 512 == 0 else 384, 4 if k % 512 == 0 else 2, 1)),
    ("c1 tpb4", T(16, 512 if k % 512 == 0 else 384, 4 if k % 512 == 0 else 2, 1, 4)),
    ("c1 rt2", T(16, 256, 4 if k % 1024 == 0 else 3, 1, 4, 2)),
  ):
    try:
      f = lambda x, w, t=t, sizes=sizes: fm.grouped_fp4_matmul_mosaic(x, sizes, w, tiles=t, out_dtype=F)
      err = float(np.abs(np.asarray(f(x, we)) - ref).max() / np.abs(ref).max())
      us = timeit(multi(f, 2), (x, wes)) / 2
      streamed = int(np.sum(np.asarray(sizes) > 0)) * n * k * 0.5625
      rec(
        f"grouped [{n},{k}] " + name,
        us,
        err,
        tiles=str(t or fm.default_grouped_tiles(512, E, k, n)),
        gbps=round(streamed / us / 1e3),
      )
    except Exception as e:
      rec(f"grouped [{n},{k}] " + name, float("nan"), error=str(e)[:300])
print("total", round(time.time() - T0), "s", flush=True)
