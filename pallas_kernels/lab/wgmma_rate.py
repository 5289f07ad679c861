"""How fast an H200's tensor cores run the FP4 kernel's MMA shape: wgmma m64 x N x k16 (bf16 in, f32 out).

The Mosaic FP4 kernel (pallas_kernels/fp4_mosaic.py) puts 64 weight rows on the wgmma's M side and the tokens
(block_m: 16 at decode) on its N side, so that one instruction covers 64 x 16 weights whatever the tokens. Its
steady step (64 x 512 weights, 32 such instructions per SM) took 0.775 us on an H200, and 0.585 us with the decode
replaced by register moves (docs/gpu_check/h200-2026-12-04b-*, -04d-*). If a wgmma of N <= 64 costs an SM the
same time as one of N = 64 (32 cycles at the bf16 peak), 32 of them take 0.52-0.56 us (at 1.83-1.98 GHz): the
MMAs, not the bytes, would bound the step, and the kernel's floor would be that rate, whatever the decode.

`rate_kernel(n, ...)` measures it: one block per SM, each warpgroup looping `reps` times over one wgmma call of
K = 256 (16 instructions) on its own accumulator, A from registers (as the FP4 kernel's decoded weights) or from
shared memory, B (the tokens) from shared memory, and a wgmma_wait(0) per call (as the kernel's step). No
copies, no decode. mosaic_variants.py times it at N = 8..256 and reports ns per instruction per SM.

`mma_sync_rate_kernel(accumulators, ...)` does the same work per SM as N = 16 with per-warp mma.sync m16n8k16
(two per 16 of K), the form the packed weights would also serve (docs/gpu.md: the lead past the wgmma floor), in 4
or 2 accumulator chains per warp. Compiled here, ptxas issues the 4 chains' HMMAs back to back (256 in a loop of
262 instructions) and pads the 2 chains' with 127 NOPs per 256 (each HMMA waits for its chain's previous one):
a kernel of this form would keep 4 or more.

  python pallas_kernels/lab/wgmma_rate.py --compile [--first]  # no GPU: compile for sm_90a, print SASS figures (~8 s each)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import re
import sys

if __name__ == "__main__":
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
if __package__ in (None, ""):  # run as a script: make the repository root importable
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

ROWS, K_CALL = 64, 256  # wgmma M; K per call (16 instructions of k16)
REPS = 2048  # calls per warpgroup: about a millisecond a launch at 20 ns an instruction
INSTRUCTIONS_PER_CALL = K_CALL // 16


@functools.cache
def rate_kernel(n: int, *, reps: int = REPS, wgs: int = 2, a_in_smem: bool = False, blocks: int = 132):
  """A jitted function of a float32 [1] scale returning f32 [n, blocks * wgs * 64] (the accumulators times the
  scale, so that nothing is dead code): `blocks` blocks of `wgs` warpgroups, each issuing reps x 16 wgmma
  m64 x n x k16 (see the module docstring). A register operand holds ones; the shared-memory operands (one for
  the block's warpgroups) are not written: the values do not change the tensor cores' time, and the sums are
  not looked at."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  from pallas_kernels import fp4_mosaic as fm

  if n % 8 or not 8 <= n <= 256:
    raise ValueError(f"rate_kernel: n = {n} must be a multiple of 8 from 8 to 256 (wgmma's N).")
  swizzle = plgpu.find_swizzle(K_CALL * 16, "rhs")
  transforms = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
  store = fm._store_rows(n, jnp.float32)

  def kernel(scale_gmem, out_gmem, b_smem, a_smem=None):
    wg = jax.lax.axis_index("wg")
    block = jax.lax.axis_index("b")

    @functools.partial(pl.run_scoped, acc=plgpu.ACC((ROWS, n), jnp.float32))
    def _(acc):
      a = a_smem if a_in_smem else plgpu.layout_cast(jnp.ones((ROWS, K_CALL), jnp.bfloat16), plgpu.Layout.WGMMA)

      @pl.loop(0, reps)
      def _(i):
        plgpu.wgmma(acc, a, plgpu.transpose_ref(b_smem, (1, 0)))
        plgpu.wgmma_wait(0)

      zero = jnp.int32(0)
      store(acc[...], zero, zero, jnp.int32(n), (block * wgs + wg) * ROWS, scale_gmem[0], out_gmem)

  scratch = [plgpu.SMEM((n, K_CALL), jnp.bfloat16, transforms=transforms)]
  if a_in_smem:
    scratch.append(plgpu.SMEM((ROWS, K_CALL), jnp.bfloat16, transforms=transforms))
  call = plgpu.kernel(
    kernel,
    out_type=jax.ShapeDtypeStruct((n, blocks * wgs * ROWS), jnp.float32),
    grid=(blocks,),
    grid_names=("b",),
    num_threads=wgs,
    thread_name="wg",
    scratch_types=tuple(scratch),
    compiler_params=plgpu.CompilerParams(),
  )
  return jax.jit(call)


MMA_SYNC_PTX = (
  "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
  "{$10, $11, $12, $13};"
)


@functools.cache
def mma_sync_rate_kernel(accumulators: int = 2, *, reps: int = REPS, wgs: int = 2, blocks: int = 132):
  """The per-warp alternative at the FP4 kernel's shape (docs/gpu.md: the lead past the wgmma floor): each warp of
  `wgs` warpgroups per block loops `reps` times over the MMAs of one wgmma call's work, 64 x 16 x 256 per
  warpgroup, as mma.sync m16n8k16 (bf16 in, f32 out): per warp 16 chunks of k16 x 2 halves of N = 16, 32
  instructions, into `accumulators` chains of 4 f32 registers each (2: one per half of N, every chunk adding to
  the same two, as a kernel with one accumulator per output would; 4: the even and odd chunks apart too, summed
  at the end). A and B are registers made from the thread index (the kernel's A: decoded weights; its B, x's
  fragments, would come from shared memory by ldmatrix, not timed here). ns_per_instruction(..) of its time
  is per wgmma-equivalent (64 x 16 x k16), comparable with rate_kernel(16)'s. A jitted function of a float32
  [1] scale returning f32 [blocks * wgs * 128] (each thread's sum, so that nothing is dead code)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, memref, scf
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jax.experimental.pallas import mosaic_gpu as plgpu

  if accumulators not in (2, 4):
    raise ValueError(f"mma_sync_rate_kernel: accumulators = {accumulators} must be 2 or 4.")

  def body(_, scale, out_ref):
    i32, f32, index = ir.IntegerType.get_signless(32), ir.F32Type.get(), ir.IndexType.get()
    thread = mgpu_utils.thread_idx()
    # operands from the thread index (bf16 pairs near 1): A, and B for each half of N; distinct values for each
    # chain's start too, so that no compiler could prove two chains the same computation and merge them
    a = [arith.xori(thread, mgpu_utils.c(0x3F803F80 + i, i32)) for i in range(4)]
    b = [[arith.xori(thread, mgpu_utils.c(0x3F803F84 + 2 * h + i, i32)) for i in range(2)] for h in range(2)]
    starts = [arith.constant(f32, ir.FloatAttr.get(f32, float(i))) for i in range(4 * accumulators)]
    four = llvm.StructType.get_literal([f32] * 4)
    loop = scf.ForOp(mgpu_utils.c(0, index), mgpu_utils.c(reps, index), mgpu_utils.c(1, index), starts)
    with ir.InsertionPoint(loop.body):
      acc = list(loop.inner_iter_args)
      for chunk in range(K_CALL // 16):
        for half in range(2):
          chain = half + 2 * (chunk % 2) * (accumulators == 4)
          c = acc[4 * chain : 4 * chain + 4]
          out = llvm.inline_asm(four, [*a, *b[half], *c], MMA_SYNC_PTX, "=f,=f,=f,=f," + "r," * 6 + "0,1,2,3")
          acc[4 * chain : 4 * chain + 4] = [llvm.extractvalue(f32, out, [i]) for i in range(4)]
      scf.yield_(acc)
    total = loop.results[0]
    for value in list(loop.results)[1:]:
      total = arith.addf(total, value)
    block = arith.index_cast(i32, mgpu_utils.gpu.block_id(mgpu_utils.gpu.Dimension.x))
    slot = arith.addi(arith.muli(block, mgpu_utils.c(wgs * 128, i32)), thread)
    memref.store(arith.mulf(total, scale.registers.flat[0]), out_ref, [arith.index_cast(index, slot)])

  run = plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT(shape=()), plgpu.RefType()))(body)

  def kernel(scale_gmem, out_gmem):
    run(scale_gmem[0], out_gmem)

  call = plgpu.kernel(
    kernel,
    out_type=jax.ShapeDtypeStruct((blocks * wgs * 128,), jnp.float32),
    grid=(blocks,),
    grid_names=("b",),
    num_threads=wgs,
    thread_name="wg",
    compiler_params=plgpu.CompilerParams(),
  )
  return jax.jit(call)


def ns_per_instruction(device_us: float, *, reps: int, wgs: int, blocks: int = 132, sms: int = 132) -> float:
  """ns of an SM's time per wgmma instruction: a call's device time over the instructions each SM ran (the
  blocks spread evenly: one per SM at the default blocks = sms = 132, an H200's or an H100 SXM's; mosaic_variants
  passes the device's own count as both)."""
  per_sm = reps * INSTRUCTIONS_PER_CALL * wgs * -(-blocks // sms)
  return device_us * 1e3 / per_sm


# (N, warpgroups, A in shared memory): the FP4 kernel's shape (N = 16, two warpgroups, A from registers) first
VARIANTS = ((16, 2, False), (8, 2, False), (32, 2, False), (64, 2, False), (128, 2, False), (256, 2, False),
            (16, 1, False), (16, 2, True), (64, 2, True))  # fmt: skip


# (accumulator chains per warp, warpgroups) of mma_sync_rate_kernel
MMA_SYNC_VARIANTS = ((4, 2), (2, 2))


def compiled(n: int, wgs: int, a_in_smem: bool, accumulators: int = 0) -> dict:
  """SASS figures of one variant compiled for sm_90a without a GPU (pallas_kernels/gpu_compile.py);
  accumulators > 0: mma_sync_rate_kernel's (n = 16 always)."""
  from pallas_kernels import gpu_compile

  f = mma_sync_rate_kernel(accumulators, wgs=wgs) if accumulators else rate_kernel(n, wgs=wgs, a_in_smem=a_in_smem)
  program = gpu_compile.compile_for_h200(f, jax.ShapeDtypeStruct((1,), jnp.float32))
  [kernel] = program.kernels.values()
  shapes = sorted(set(re.findall(r"HG?MMA\.(\w+)\.", kernel.sass)))
  return dict(
    n=n, wgs=wgs, a_in_smem=a_in_smem, accumulators=accumulators, launches=len(program.launches),
    registers=kernel.resources.registers, spill_bytes=kernel.resources.spill_stores + kernel.resources.spill_loads,
    loop_mmas=sum(op in gpu_compile.MMA_OPCODES for op in kernel.loop), loop_instructions=len(kernel.loop),
    loop_nops=kernel.loop.count("NOP"), mma_shapes=shapes,
  )  # fmt: skip


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--compile", action="store_true", help="compile every variant for sm_90a here; print JSON lines")
  p.add_argument("--first", action="store_true", help="only the first variant (the FP4 kernel's shape)")
  args = p.parse_args(argv)
  if not args.compile:
    p.error("on a GPU, pallas_kernels/lab/mosaic_variants.py times these kernels; here, --compile")
  for variant in VARIANTS[:1] if args.first else VARIANTS:
    print(json.dumps(compiled(*variant)), flush=True)
  for accumulators, wgs in MMA_SYNC_VARIANTS[:1] if args.first else MMA_SYNC_VARIANTS:
    print(json.dumps(compiled(16, wgs, False, accumulators)), flush=True)


if __name__ == "__main__":
  main()
