"""Static figures of the FP4 kernels compiled for an H200 (sm_90a) without a GPU, and a roofline.

  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python pallas_kernels/lab/kernel_report.py --out docs/perf/kernel_report
  ... --smoke      # two small shapes
  ... --cases tests  # what tests/test_gpu_compile.py checks (TEST_CASES), in a child process

Needs `requirements-gpu-compile.txt` (the CUDA plugin, ptxas, nvdisasm); the script sets
JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 itself when run as a program. Each row is one kernel call
compiled by `pallas_kernels.gpu_compile` at the default tiles: launches per call (XLA's thunk
sequence: pads, split-K sums, the grouped kernel's metadata), registers and spills (`ptxas -v`), the
main loop's SASS instructions, its MMAs, and instructions per weight per thread (loop instructions /
(block_n * block_k / threads)).

Shapes: dense K = N = 8192 at M in {1, 8, 16, 64}; grouped (E = 128 experts, top-8, the gate_up
[E, 1536, 2048] and down [E, 2048, 768] projections of bench_fp4_matmul) at 64 and 256 tokens. For
the grouped rows the routing is sampled (uniform, seed 0) to count the expert tiles the visit grid
streams (a group of s rows: ceil(s / block_m) visits). The mosaic_int8 rows (16 and 64 tokens,
K = N = 8192) are a reference, not ours: jax's own Mosaic GPU int8 x bf16 matmul shaped for decode,
whose weights are decoded in registers as an FP4 Mosaic kernel's would be (1 byte per weight).

The roofline (an estimate, not a measurement; the GPU check measures):
  memory   bytes moved / 4.8 TB/s (weights streamed, scales, x, out, split-K partials)
  issue    weights streamed x instructions per weight / 32 lanes / (132 SMs x 4 schedulers x
           1.98 GHz): one warp instruction per scheduler per clock, the best case
  launch   2 us per launch (kernel launch and gap in a CUDA graph)
  L2       (weights streamed + x read by every block) / 7 TB/s: every block reads its x tiles
           through L2, once per weight tile it streams, shared by a cluster (fp4_mosaic's TMA
           multicast): M rows of a dense call (up to block_m), block_m of a grouped pass; 7 TB/s is
           an assumption (published H100 L2 microbenchmarks), not a measurement
  kernel time = max(memory, issue, L2) + launches x 2 us; bf16 time = its weight bytes / 4.8 TB/s + 2 us
  (the dense bf16 matmul at the roofline; grouped: the experts that got rows, once each);
  "predicted vs bf16" = bf16 time / kernel time. The grouped_bf16 rows (the benchmark's baseline,
  the same kernel on bf16 weights) are included for their instruction counts: their figure is how
  close that baseline comes to the bf16 roofline.
The instruction budget at the memory roofline is issue rate x bytes per weight / HBM bandwidth:
3.9 SASS instructions per weight for NVFP4 (0.5625 bytes per weight), before stalls.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import sys

if __name__ == "__main__":
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
if __package__ in (None, ""):  # run as a script: make the repository root importable
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import fp4_matmul as dense  # noqa: E402
from pallas_kernels import fp4_mosaic as mosaic  # noqa: E402
from pallas_kernels import gpu_compile  # noqa: E402
from pallas_kernels import grouped_fp4_matmul as grouped  # noqa: E402
from trace_jax import fp4  # noqa: E402

HBM = 4.8e12
L2 = 7e12  # assumed L2 -> SM bandwidth (published H100 microbenchmarks: 5.5-7+ TB/s); not measured here
ISSUE = 132 * 4 * 1.98e9  # warp instructions per second, whole chip
LAUNCH_S = 2e-6
BUDGET = 2.5  # the issue's goal, instructions per weight


@dataclasses.dataclass(frozen=True)
class Case:
  kind: str  # dense | grouped | grouped_bf16 (the benchmark's baseline: the same kernel on bf16 weights)
  #            | mosaic_int8 (jax's own Mosaic GPU int8 x bf16 matmul, weights decoded in registers: a reference)
  #            | mosaic_fp4 (pallas_kernels/fp4_mosaic.py: weights packed as wgmma fragments; experts > 0: grouped)
  #            | engine, engine_loop (a rollout engine decode step's launches: _engine_row)
  m: int  # rows of x (grouped: tokens x top_k)
  n: int
  k: int
  experts: int = 0
  tokens: int = 0
  fmt: str = "nvfp4"
  ptx_decode: bool = False
  compute_wgs: int = 1  # mosaic_fp4: consumer warpgroups per block (MosaicTiles.compute_wgs); 0: the default tiles'
  parts: int = 1  # mosaic_fp4: wgmma groups per warpgroup per step (MosaicTiles.parts)
  block_m: int = 0  # mosaic_fp4: x rows per tile (wgmma's N), 0: the default tiles'
  slots: int = 0  # mosaic_fp4: pipeline slots (MosaicTiles.max_concurrent_steps), 0: the default tiles'
  tensor_scale: bool = True  # nvfp4: a per-tensor scale besides the block scales
  early_exit: bool = False  # mosaic_fp4 grouped: MosaicTiles.early_exit
  ping_pong: str = ""  # mosaic_fp4: MosaicTiles.ping_pong
  overlap: bool = False  # mosaic_fp4: MosaicTiles.overlap (with parts >= 2)
  cluster: int = 0  # mosaic_fp4: blocks that share x's tiles by TMA multicast (MosaicTiles.cluster), 0: the default's
  row_tiles: int = 0  # mosaic_fp4 grouped: 64-row tiles per step (1: steps of 512, 2: of 256), 0: the default's
  label: str = ""


# What tests/test_gpu_compile.py holds to account (run in a subprocess: `--cases tests`).
TEST_CASES = [
  Case("dense", 8, 8192, 8192, ptx_decode=True, label="dense_ptx"),
  Case("dense", 8, 8192, 8192, label="dense"),
  Case("grouped", 64 * 8, 1536, 2048, experts=128, tokens=64, ptx_decode=True, label="grouped_ptx"),
  Case("grouped", 20, 64, 1024, experts=6, tokens=10, fmt="mxfp4", label="grouped_6_experts"),
  Case("grouped_bf16", 64 * 8, 1536, 2048, experts=128, tokens=64, label="grouped_bf16"),
  Case("mosaic_int8", 16, 8192, 8192, fmt="int8", label="mosaic_int8"),
  # the issue's shapes (down at 256 tokens runs gate_up's 256-token loop over K = 768: docs/perf/kernel_report.md has
  # it, left out here for the suite's time)
  Case("mosaic_fp4", 1, 8192, 8192, label="mosaic_fp4_m1"),
  Case("mosaic_fp4", 8, 8192, 8192, label="mosaic_fp4_m8"),
  Case("mosaic_fp4", 16, 8192, 8192, label="mosaic_fp4"),
  Case("mosaic_fp4", 64, 8192, 8192, label="mosaic_fp4_m64"),
  Case("mosaic_fp4", 64 * 8, 1536, 2048, experts=128, tokens=64, label="mosaic_grouped"),
  Case("mosaic_fp4", 64 * 8, 2048, 768, experts=128, tokens=64, label="mosaic_grouped_down"),
  Case("mosaic_fp4", 256 * 8, 1536, 2048, experts=128, tokens=256, label="mosaic_grouped_256"),  # two tiles per step
  Case("mosaic_fp4", 12, 256, 1024, label="mosaic_fp4_m12"),  # M > 8, not a multiple of 8: x padded
  Case("mosaic_fp4", 20, 128, 256, experts=6, tokens=10, tensor_scale=False, label="mosaic_grouped_small"),
  # two consumer warpgroups (the default at M = 16), each step in two wgmma groups (not the default: mostly slower)
  Case("mosaic_fp4", 16, 8192, 8192, compute_wgs=2, parts=2, label="mosaic_fp4_2wg"),
  # the default tiles as they are (two warpgroups, two 64-row tiles per step, 16 row units chained per block)
  Case("mosaic_fp4", 64 * 8, 2048, 768, experts=128, tokens=64, compute_wgs=0, label="mosaic_grouped_down_default"),
  # not the default: timed on a GPU next (x tiles of 8 rows, 7 slots of 512: more weight bytes in flight)
  Case("mosaic_fp4", 8, 8192, 8192, compute_wgs=2, block_m=8, slots=7, label="mosaic_fp4_bm8"),
  # not the default: a block without work ends after one load (MosaicTiles.early_exit), the default tiles else
  Case("mosaic_fp4", 64 * 8, 1536, 2048, 128, 64, compute_wgs=0, early_exit=True, label="mosaic_grouped_early_exit"),
  # not the default: the two warpgroups take turns at the MMAs (MosaicTiles.ping_pong)
  Case("mosaic_fp4", 8, 8192, 8192, compute_wgs=2, ping_pong="issued", label="mosaic_fp4_ping_pong"),
  # not the default: a step's last MMAs run on into the next step's first decode (MosaicTiles.overlap, two parts)
  Case("mosaic_fp4", 8, 8192, 8192, compute_wgs=2, parts=2, overlap=True, label="mosaic_fp4_overlap"),
  # not the default: x multicast to a cluster of 2 blocks, one warpgroup, at M = 16 (the default tiles' L2 time)
  Case("mosaic_fp4", 16, 8192, 8192, compute_wgs=1, cluster=2, label="mosaic_fp4_cluster"),
  Case("engine", 64, 2048, 768, experts=128, tokens=64, label="engine_step"),
]


def cases(which: str) -> list[Case]:
  if which == "smoke":
    return [Case("dense", 8, 256, 512, ptx_decode=True), Case("grouped", 32, 128, 1024, experts=8, tokens=8)]
  if which == "tests":
    return TEST_CASES
  out = []
  for ptx in (False, True):
    out += [Case("dense", m, 8192, 8192, ptx_decode=ptx) for m in (1, 8, 16, 64)]
    for tokens in (64, 256):
      out += [Case("grouped", tokens * 8, n, k, 128, tokens, ptx_decode=ptx) for n, k in ((1536, 2048), (2048, 768))]
  out += [Case("grouped_bf16", tokens * 8, 1536, 2048, 128, tokens) for tokens in (64, 256)]
  for wgs in (1, 2):
    out += [Case("mosaic_fp4", m, 8192, 8192, compute_wgs=wgs) for m in (1, 8, 16, 64)]
    for tokens in (64, 256):
      out += [
        Case("mosaic_fp4", tokens * 8, n, k, 128, tokens, compute_wgs=wgs) for n, k in ((1536, 2048), (2048, 768))
      ]
  # gate_up's other step shape: two 64-row tiles at 256 at 64 tokens, one at 512 at 256 tokens (the defaults' other)
  for wgs in (1, 2):
    out += [Case("mosaic_fp4", t * 8, 1536, 2048, 128, t, compute_wgs=wgs, row_tiles=2 - (t > 64)) for t in (64, 256)]
  # x multicast to clusters of 2 (not the default; timed next on a GPU): at M = 16 the default tiles are at L2 time
  out += [Case("mosaic_fp4", m, 8192, 8192, compute_wgs=wgs, cluster=2) for m, wgs in ((8, 2), (16, 1), (16, 2))]
  out += [Case("mosaic_int8", m, 8192, 8192, fmt="int8") for m in (16, 64)]
  return out + [Case(kind, 64, 2048, 768, experts=128, tokens=64) for kind in ENGINE_KINDS]


def _weight(case: Case):
  shape = (case.experts, case.n, case.k) if case.experts else (case.n, case.k)
  if case.kind == "grouped_bf16":
    return jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  amax = jnp.float32(1) if case.fmt == "nvfp4" and case.tensor_scale else None
  return jax.eval_shape(lambda a: fp4.quantize(a, case.fmt, tensor_amax=amax), jax.ShapeDtypeStruct(shape, jnp.float32))


def sampled_group_sizes(case: Case, seed: int = 0) -> np.ndarray:
  """Rows per expert for `tokens` tokens each routed to top_k distinct experts, uniformly."""
  rng = np.random.default_rng(seed)
  top_k = case.m // case.tokens
  chosen = np.stack([rng.choice(case.experts, top_k, replace=False) for _ in range(case.tokens)])
  return np.bincount(chosen.ravel(), minlength=case.experts)


def expert_streams(group_sizes: np.ndarray, block_m: int) -> tuple[int, int]:
  """(visits of a real expert, experts with rows) in the grouped kernel's visit table: each visit
  streams its expert's weight tiles once."""
  sizes = np.asarray(group_sizes)
  group, start, end = np.asarray(grouped.make_group_metadata(jnp.asarray(sizes, jnp.int32), int(sizes.sum()), block_m))
  real = (end > start) & (group < len(sizes))
  return int(real.sum()), int((sizes > 0).sum())


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
  """A Mosaic GPU matmul's tiles in the report's terms: block_n x block_k weights per warpgroup
  (num_warps = 4) per trip of the K loop; block_m tokens."""

  block_m: int
  block_n: int
  block_k: int
  k_splits: int = 1
  num_warps: int = 4
  cluster: int = 1  # blocks that share one copy of each x tile (TMA multicast)
  slots: int = 0  # pipeline slots (fp4_mosaic)
  compute_wgs: int = 1  # consumer warpgroups per block (fp4_mosaic), each with the block_k above
  parts: int = 1  # wgmma groups per warpgroup per step (fp4_mosaic)


def _mosaic_int8_matmul(case: Case):
  """(fn(w [N, K] int8, x^T [K, M] bf16) -> [N, M], its tiles): jax's Mosaic GPU mixed-type matmul
  (`hopper_mixed_type_matmul_mgpu`: int8 LHS loaded from shared memory into registers, converted
  to bf16 there, wgmma with the bf16 RHS in shared memory) shaped for decode: weights on the MMA's
  M side, tokens on N, the two compute warpgroups on different weight rows. The lightest decode
  there is (a byte per weight, no scales): what register decoding costs in Mosaic GPU."""
  import types

  from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mixed

  tiles = MosaicTiles(block_m=max(case.m, 16), block_n=64, block_k=128)  # wgmma N >= 16 here: B rows of 32+ bytes
  config = mixed.TuningConfig(
    tile_m=tiles.block_n,
    tile_n=tiles.block_m,
    tile_k=tiles.block_k,
    max_concurrent_steps=4,
    epi_tile_n=min(64, tiles.block_m),
    epi_tile_m=64,
    wg_dimension=mixed.MatmulDimension.M,
  )
  # It sizes its persistent grid by the default device's SMs; here that is the CPU: an H200 has 132.
  mixed.backend = types.SimpleNamespace(get_default_device=lambda: types.SimpleNamespace(core_count=132))
  return functools.partial(mixed.mixed_matmul_kernel, out_dtype=jnp.bfloat16, config=config), tiles


ENGINE_LAYERS = 2
ENGINE_KINDS = ("engine", "engine_loop")
ENGINE_SLOTS = 1024  # engine: decode_step's KV cache slots
ENGINE_PROMPT, ENGINE_NEW_TOKENS = 16, 32  # engine_loop: prompts of 16 tokens, 32 new (the first from the prefill)


def _engine_row(case: Case) -> dict:
  """A decode step of the rollout engine (`case.tokens` sequences) on a Qwen3-30B-A3B-shaped model of
  ENGINE_LAYERS layers (hidden n, 128 experts of moe_intermediate k, top-8) with NVFP4 experts in the Mosaic
  kernel's layout, as on Hopper: its launches, and the copies and Mosaic GPU calls among them (2 per MoE
  layer: gate and up as one weight, then down).
  kind "engine": `rollout.decode_step` alone (an FP4 KV cache of ENGINE_SLOTS), the caches donated, as `generate`'s
  while loop carries them and XLA updates them in place (without donation the step copies each cache it
  writes first: 9 more copies at 2 layers).
  kind "engine_loop": `generate` itself (a cache of ENGINE_PROMPT + ENGINE_NEW_TOKENS = 48 slots), one trip of its
  decode loop (condition and body): the step above plus sampling, the token and log-prob writes and the guidance
  records."""
  from unittest import mock

  import pallas_kernels
  from trace_jax import model, rollout
  from trace_jax.config import ModelConfig, QuantConfig, RolloutConfig, SamplingConfig

  cfg = ModelConfig(
    vocab_size=4096,
    hidden_size=case.n,
    num_layers=ENGINE_LAYERS,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    num_experts=case.experts,
    num_experts_per_tok=8,
    moe_intermediate_size=case.k,
  )
  quant = QuantConfig(matmul_impl="mosaic")
  config = RolloutConfig(quant=quant)
  params = jax.eval_shape(
    lambda: rollout.weight_sync(model.init_params(cfg, jax.random.key(0)), quant, expert_layout="fragments")
  )
  b = case.tokens
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  if case.kind == "engine_loop":
    sampling = SamplingConfig(max_new_tokens=ENGINE_NEW_TOKENS)
    fn = functools.partial(rollout.generate, model_config=cfg, rollout_config=config, sampling=sampling)
    prompts, key = i32(b, ENGINE_PROMPT), jax.eval_shape(lambda: jax.random.key(0))
    # generate picks the Mosaic layout on Hopper: the program is compiled for an H200, this process runs on a CPU
    with mock.patch.object(pallas_kernels, "is_hopper", lambda: True):
      program = gpu_compile.compile_for_h200(fn, params, prompts, prompts, key, kernel_names=("",))
    launches = program.loop_launches
  else:
    slots = ENGINE_SLOTS
    caches = jax.eval_shape(lambda: rollout.init_cache(cfg, b, slots, quant, jnp.bfloat16, decoded=False))
    step = functools.partial(rollout.decode_step, model_config=cfg, rollout_config=config)
    program = gpu_compile.compile_for_h200(
      step, params, i32(b, 1), caches, i32(), i32(b, 1), i32(b, slots), kernel_names=("",), donate_argnums=(2,)
    )
    launches = program.launches
  names = [launch.name for launch in launches]
  mosaic_calls = names.count("kCustomCall")
  if mosaic_calls != 2 * ENGINE_LAYERS:  # e.g. a loop other than the decode loop was counted
    raise RuntimeError(f"{case.kind}: {mosaic_calls} Mosaic calls, not 2 per layer: {names}")
  return dict(
    **dataclasses.asdict(case),
    layers=ENGINE_LAYERS,
    launches=len(names),
    launch_names=names,
    mosaic_calls=mosaic_calls,
    copies=names.count("kCopy"),
  )


def report_row(case: Case) -> dict:
  if case.kind in ENGINE_KINDS:
    return _engine_row(case)
  if case.kind == "mosaic_int8":
    return _mosaic_int8_row(case)
  if case.kind == "mosaic_fp4":
    return _mosaic_fp4_row(case)
  w = _weight(case)
  fmt = fp4.get_format(case.fmt)
  x = jax.ShapeDtypeStruct((case.m, case.k), jnp.bfloat16)
  options = dict(interpret=False, ptx_decode=case.ptx_decode)
  if case.kind == "dense":
    tiles = dense.make_tiles(case.m, case.n, case.k, fmt, interpret=False, ptx_decode=case.ptx_decode)
    program = gpu_compile.compile_for_h200(functools.partial(dense.fp4_matmul, **options), x, w)
    streamed = distinct = 1
    partial_bytes = 0 if tiles.k_splits == 1 else 2 * tiles.k_splits * case.m * case.n * 4
  else:  # grouped, grouped_bf16: the same tiles
    tiles = grouped.grouped_tiles(case.m, w, False, ptx_decode=case.ptx_decode)
    sizes = jax.ShapeDtypeStruct((case.experts,), jnp.int32)
    if case.kind == "grouped_bf16":
      fn = functools.partial(grouped.grouped_bf16_matmul, interpret=False)
    else:
      fn = functools.partial(grouped.grouped_fp4_matmul, **options)
    program = gpu_compile.compile_for_h200(fn, x, sizes, w)
    streamed, distinct = expert_streams(sampled_group_sizes(case), tiles.block_m)
    partial_bytes = 0
  return _row(
    case,
    program,
    tiles,
    streamed,
    distinct,
    partial_bytes,
    2 if case.kind == "grouped_bf16" else 0.5 + 1 / fmt.block_size,
  )


def _mosaic_int8_row(case: Case) -> dict:
  fn, tiles = _mosaic_int8_matmul(case)
  w = jax.ShapeDtypeStruct((case.n, case.k), jnp.int8)
  xt = jax.ShapeDtypeStruct((case.k, tiles.block_m), jnp.bfloat16)
  return _row(case, gpu_compile.compile_for_h200(fn, w, xt), tiles, 1, 1, 0, 1)


def _mosaic_fp4_row(case: Case) -> dict:
  """fp4_mosaic's kernel: dense (experts = 0) or grouped, the weight packed as wgmma fragments."""
  w = jax.eval_shape(mosaic.pack_fragments, _weight(case))
  x = jax.ShapeDtypeStruct((case.m, case.k), jnp.bfloat16)
  options = dict(parts=case.parts, early_exit=case.early_exit, ping_pong=case.ping_pong, overlap=case.overlap)
  fields = (
    ("compute_wgs", case.compute_wgs),
    ("block_m", case.block_m),
    ("max_concurrent_steps", case.slots),
    ("cluster", case.cluster),
  )
  options.update({k: v for k, v in fields if v})
  if case.experts:
    t = mosaic.default_grouped_tiles(case.m, case.experts, case.k, case.n)
    if case.row_tiles and case.row_tiles != t.row_tiles:
      t = mosaic.with_row_tiles(t, case.row_tiles, case.k)
    t = dataclasses.replace(t, **options)
    sizes = jax.ShapeDtypeStruct((case.experts,), jnp.int32)
    program = gpu_compile.compile_for_h200(functools.partial(mosaic.grouped_fp4_matmul_mosaic, tiles=t), x, sizes, w)
    group_sizes = sampled_group_sizes(case)
    streamed, distinct = int(np.sum(mosaic.passes(group_sizes, t.block_m))), int(np.sum(group_sizes > 0))
  else:
    t = dataclasses.replace(mosaic.default_tiles(case.m, case.k, case.n), **options)
    program = gpu_compile.compile_for_h200(functools.partial(mosaic.fp4_matmul_mosaic, tiles=t), x, w)
    streamed = distinct = 1
  tiles = MosaicTiles(  # a compute warpgroup's weights per pipeline step: row_tiles x 64 rows x its share of block_k
    block_m=t.block_m,
    block_n=mosaic.ROWS * t.row_tiles,
    block_k=t.block_k // t.compute_wgs,
    cluster=t.cluster,
    slots=t.max_concurrent_steps,
    compute_wgs=t.compute_wgs,
    parts=t.parts,
  )
  return _row(case, program, tiles, streamed, distinct, 0, 0.5 + 1 / 16)


def _row(case: Case, program, tiles, streamed: int, distinct: int, partial_bytes: int, bytes_per_weight: float) -> dict:
  """The report's figures of one compiled call (see the module docstring for the roofline)."""
  [kernel] = program.kernels.values()
  threads = 32 * tiles.num_warps
  ipw = gpu_compile.instructions_per_weight(kernel, tiles.block_n * tiles.block_k, threads)
  matrix = case.n * case.k
  weights_streamed = streamed * matrix
  kernel_bytes = weights_streamed * bytes_per_weight + case.m * case.k * 2 + case.m * case.n * 2 + partial_bytes
  # every block reads its x tiles through L2: its rows x K per block_n rows streamed, once per cluster. A dense
  # call's rows are M up to block_m (a TMA copy or a masked load reads no row past M; fp4_mosaic pads an M over 8
  # to a multiple of 8 first); a grouped pass reads a whole tile of real rows; jax's int8 kernel gets x^T already
  # block_m wide.
  rows = tiles.block_m
  if not case.experts and case.kind != "mosaic_int8":
    rows = min(rows, -(-case.m // 8) * 8 if case.kind == "mosaic_fp4" and case.m > 8 else case.m)
  x_l2_bytes = streamed * (case.n // tiles.block_n) * rows * case.k * 2 / getattr(tiles, "cluster", 1)  # Triton: none
  t_memory, t_issue = kernel_bytes / HBM, weights_streamed * ipw / 32 / ISSUE
  t_l2 = (weights_streamed * bytes_per_weight + x_l2_bytes) / L2
  t_kernel = max(t_memory, t_issue, t_l2) + len(program.launches) * LAUNCH_S
  t_bf16 = (distinct * matrix * 2 + case.m * (case.k + case.n) * 2) / HBM + LAUNCH_S
  return dict(
    **dataclasses.asdict(case),
    tiles=dataclasses.asdict(tiles),
    launches=len(program.launches),
    launch_names=[launch.name for launch in program.launches],
    kernel=kernel.name,
    registers=kernel.resources.registers,
    spill_bytes=kernel.resources.spill_stores + kernel.resources.spill_loads,
    loop_instructions=len(kernel.loop),
    loop_mmas=sum(op in gpu_compile.MMA_OPCODES for op in kernel.loop),
    loop_top=kernel.loop_histogram(6),
    loads_before_exit=kernel.loads_before_exit(),
    loop_named_barriers=sum(op == "BAR" for op in kernel.loop),  # bar.sync / bar.arrive in the main loop
    loop_inflight_writes=len(kernel.inflight_register_writes()),  # undefined in PTX: gpu_compile says why
    loop_wgmma_waits=kernel.wgmma_waits(),  # the wgmma groups each wait in the loop leaves in flight
    setmaxnreg=kernel.setmaxnreg(),
    tma_loads=kernel.tma_loads(),
    instructions_per_weight=round(ipw, 2),
    within_budget=ipw <= BUDGET,
    expert_streams=streamed if case.experts else None,
    experts_with_rows=distinct if case.experts else None,
    x_l2_over_weights=round(x_l2_bytes / (weights_streamed * bytes_per_weight), 2),
    roofline_us=dict(
      memory=t_memory * 1e6, issue=t_issue * 1e6, l2=t_l2 * 1e6, kernel=t_kernel * 1e6, bf16=t_bf16 * 1e6
    ),
    predicted_speedup=round(t_bf16 / t_kernel, 2),
  )


def markdown(rows: list[dict]) -> str:
  head = (
    "| kernel | shape | ptx | tiles (m, n, k, splits, cluster) | launches | regs | spills | loop instr. | MMAs "
    "| instr./weight | x from L2 / weights | issue / memory / L2 time | predicted vs bf16 |\n|" + "---|" * 13
  )
  lines = [head]
  engine = [r for r in rows if r["kind"] in ENGINE_KINDS]
  for r in rows:
    if r["kind"] in ENGINE_KINDS:
      continue
    t = r["tiles"]
    shape = f"M={r['m']} N={r['n']} K={r['k']}"
    if r["experts"]:
      shape = f"{r['tokens']} tok x top-8 of {r['experts']}, [{r['n']}, {r['k']}] (streams {r['expert_streams']} / {r['experts_with_rows']})"
    roof = r["roofline_us"]
    kind = r["kind"] + (f" ({t['compute_wgs']} warpgroups)" if t.get("compute_wgs", 1) > 1 else "")
    kind += f" ({t['parts']} parts)" if t.get("parts", 1) > 1 else ""
    kind += " (overlap)" if r.get("overlap") else ""
    kind += f" (cluster {t['cluster']})" if t.get("cluster", 1) > 1 else ""
    kind += (
      f" ({r['row_tiles']} row tile{'s' * (r['row_tiles'] > 1)} per step, not the default)"
      if r.get("row_tiles")
      else ""
    )
    lines.append(
      f"| {kind} | {shape} | {'yes' if r['ptx_decode'] else 'no'} | {t['block_m']}, {t['block_n']}, {t['block_k']}, "
      f"{t['k_splits']}, {t.get('cluster', 1)} | {r['launches']} | {r['registers']} | {r['spill_bytes']} | "
      f"{r['loop_instructions']} | {r['loop_mmas']} | {r['instructions_per_weight']} | {r['x_l2_over_weights']} | "
      f"{roof['issue']:.1f} / {roof['memory']:.1f} / {roof['l2']:.1f} us | {r['predicted_speedup']}x |"
    )
  if engine:
    lines += ["", "| engine decode step | launches | copies | Mosaic GPU calls |", "|---|---|---|---|"]
    for r in engine:
      shape = f"{r['tokens']} seq, {r['layers']} layers, hidden {r['n']}, {r['experts']} experts of {r['k']}, top-8"
      how = (
        f"one trip of `generate`'s loop ({ENGINE_PROMPT + ENGINE_NEW_TOKENS}-slot cache)"
        if r["kind"] == "engine_loop"
        else f"`decode_step` alone ({ENGINE_SLOTS} slots, caches donated)"
      )
      lines.append(f"| {how}: {shape} | {r['launches']} | {r.get('copies', '-')} | {r['mosaic_calls']} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cases", default="full", choices=["full", "smoke", "tests"], help="which shapes")
  p.add_argument("--smoke", action="store_true", help="= --cases smoke")
  p.add_argument("--out", default="", help="write OUT.json and OUT.md")
  args = p.parse_args(argv)
  if problems := gpu_compile.missing():
    sys.exit("kernel_report: cannot compile for the GPU here: " + "; ".join(problems))
  rows = []
  for case in cases("smoke" if args.smoke else args.cases):
    rows.append(report_row(case))
    r = rows[-1]
    if r["kind"] in ENGINE_KINDS:
      print(
        f"{r['kind']} step, {r['tokens']} seq x {r['layers']} layers: launches {r['launches']}, copies {r['copies']}, "
        f"Mosaic calls {r['mosaic_calls']}"
      )
      continue
    print(
      f"{r['kind']:8s} wgs={r['compute_wgs']} M={r['m']:5d} N={r['n']:5d} K={r['k']:5d} ptx={int(r['ptx_decode'])}: launches {r['launches']}, "
      f"regs {r['registers']}, spills {r['spill_bytes']}, {r['instructions_per_weight']} instr/weight, "
      f"predicted {r['predicted_speedup']}x bf16",
      flush=True,
    )
  if args.out:
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
      json.dumps(dict(jax=jax.__version__, arch=gpu_compile.ARCH, rows=rows), indent=1)
    )
    out.with_suffix(".md").write_text(markdown(rows))
  return rows


if __name__ == "__main__":
  main()
