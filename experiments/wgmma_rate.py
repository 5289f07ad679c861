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

  python experiments/wgmma_rate.py --compile [--first]  # no GPU: compile for sm_90a, print SASS figures (~8 s each)
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
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

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


def ns_per_instruction(device_us: float, *, reps: int, wgs: int, blocks: int = 132, sms: int = 132) -> float:
  """ns of an SM's time per wgmma instruction: a call's device time over the instructions each SM ran (the
  blocks spread evenly: one per SM at the default blocks = 132)."""
  per_sm = reps * INSTRUCTIONS_PER_CALL * wgs * -(-blocks // sms)
  return device_us * 1e3 / per_sm


# (N, warpgroups, A in shared memory): the FP4 kernel's shape (N = 16, two warpgroups, A from registers) first
VARIANTS = ((16, 2, False), (8, 2, False), (32, 2, False), (64, 2, False), (128, 2, False), (256, 2, False),
            (16, 1, False), (16, 2, True), (64, 2, True))  # fmt: skip


def compiled(n: int, wgs: int, a_in_smem: bool) -> dict:
  """SASS figures of one variant compiled for sm_90a without a GPU (pallas_kernels/gpu_compile.py)."""
  from pallas_kernels import gpu_compile

  program = gpu_compile.compile_for_h200(
    rate_kernel(n, wgs=wgs, a_in_smem=a_in_smem), jax.ShapeDtypeStruct((1,), jnp.float32)
  )
  [kernel] = program.kernels.values()
  shapes = sorted(set(re.findall(r"HGMMA\.(\d+x\d+x\d+)", kernel.sass)))
  return dict(
    n=n, wgs=wgs, a_in_smem=a_in_smem, launches=len(program.launches), registers=kernel.resources.registers,
    spill_bytes=kernel.resources.spill_stores + kernel.resources.spill_loads,
    loop_mmas=sum(op in gpu_compile.MMA_OPCODES for op in kernel.loop), loop_instructions=len(kernel.loop),
    hgmma_shapes=shapes,
  )  # fmt: skip


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--compile", action="store_true", help="compile every variant for sm_90a here; print JSON lines")
  p.add_argument("--first", action="store_true", help="only the first variant (the FP4 kernel's shape)")
  args = p.parse_args(argv)
  if not args.compile:
    p.error("on a GPU, experiments/mosaic_variants.py times these kernels; here, --compile")
  for variant in VARIANTS[:1] if args.first else VARIANTS:
    print(json.dumps(compiled(*variant)), flush=True)


if __name__ == "__main__":
  main()
