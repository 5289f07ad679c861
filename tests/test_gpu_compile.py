"""The FP4 kernels compiled for an H200 (sm_90a) on this CPU machine: they compile, spill nothing,
launch what we expect, and their decode loop stays within its instruction figures.

Needs requirements-gpu-compile.txt (the CUDA plugin, ptxas, nvdisasm); skipped, with what is
missing, without it. conftest.py sets JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before jax starts. The
parsers are also checked on hand-written compiler output, which needs nothing.

The ceilings below are today's figures (experiments/kernel_report.py, docs/perf/kernel_report.md),
a regression guard: the issue's budget of 2.5 instructions per weight is not met yet, and
`report_row(...)["within_budget"]` says so.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import kernel_report
from pallas_kernels import gpu_compile
from pallas_kernels import grouped_fp4_matmul as grouped

MISSING = gpu_compile.missing()
needs_toolchain = pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING))

THUNKS = """\
001: kCustomKernel [source       | next=002 (1)] loop_pad_fusion grid: [1024, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
002: kCustomKernel [prev=001 (1) | next=003 (1)] fp4_matmul_nvfp4 grid: [1, 256, 2] threads: [128, 1, 1]  shared_memory: 38400 bytes
003: kKernel [prev=002 (1) | sink        ] loop_slice_fusion grid: [64, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
"""

SASS = """\
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LOP3.LUT R2, R3, 0x7, RZ, 0xc0, !PT ;
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0030*/                   PRMT R5, R6, 0x5410, R7 ;
        /*0040*/               @P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0050*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0060*/              @!P1 BRA `(.L_x_1) ;
        /*0070*/                   EXIT ;
"""

PTXAS = """ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 69 registers, used 1 barriers"""


def test_parse_launches():
  launches = gpu_compile.parse_launches(THUNKS)
  assert [launch.name for launch in launches] == ["loop_pad_fusion", "fp4_matmul_nvfp4", "loop_slice_fusion"]
  assert launches[1] == gpu_compile.Launch("kCustomKernel", "fp4_matmul_nvfp4", (1, 256, 2), (128, 1, 1), 38400)


def test_main_loop_is_the_loop_with_the_mma():
  assert gpu_compile.main_loop(SASS) == ["LOP3", "HMMA", "PRMT", "BRA"]
  with pytest.raises(ValueError, match="no loop with an MMA"):
    gpu_compile.main_loop(SASS.replace("HMMA", "FFMA"))


def test_parse_ptxas():
  assert gpu_compile.parse_ptxas(PTXAS) == gpu_compile.Resources(69, 4, 12, 8)
  with pytest.raises(ValueError, match="no resource usage"):
    gpu_compile.parse_ptxas("ptxas fatal")


def test_expert_streams_one_per_group_of_at_most_block_m_rows():
  # Rows [10, 20) straddle the 16-row tiles but are one visit; 20 rows take two.
  assert kernel_report.expert_streams(np.array([10, 0, 10]), 16) == (2, 2)
  assert kernel_report.expert_streams(np.array([20, 1]), 16) == (3, 2)


# --- compiled for sm_90a -----------------------------------------------------------------------

DENSE = kernel_report.Case("dense", 8, 8192, 8192, ptx_decode=True)
DENSE_DEFAULT = kernel_report.Case("dense", 8, 8192, 8192)
GROUPED = kernel_report.Case("grouped", 64 * 8, 1536, 2048, experts=128, tokens=64, ptx_decode=True)


@pytest.fixture(scope="module")
def rows():
  return {case: kernel_report.report_row(case) for case in (DENSE, DENSE_DEFAULT, GROUPED)}


@needs_toolchain
@pytest.mark.parametrize("case", [DENSE, DENSE_DEFAULT, GROUPED], ids=["dense_ptx", "dense", "grouped_ptx"])
def test_kernel_compiles_without_spills(rows, case):
  row = rows[case]
  assert row["spill_bytes"] == 0 and row["registers"] <= 168  # 3 programs of 128 threads per SM
  assert row["loop_mmas"] > 0


@needs_toolchain
def test_decode_launches(rows):
  # M is not padded outside the kernel any more; split K still sums its partials in a second launch.
  assert rows[DENSE]["launch_names"] == ["fp4_matmul_nvfp4", "loop_reduce_fusion"]
  # The grouped kernel works out its visits itself: one launch (it was 16: metadata, pad, broadcast).
  assert rows[GROUPED]["launch_names"] == ["grouped_fp4_matmul_nvfp4"]
  # Tiles start at group boundaries: each of the 126 experts with rows is streamed once.
  assert rows[GROUPED]["expert_streams"] == rows[GROUPED]["experts_with_rows"] == 126


@needs_toolchain
def test_grouped_kernel_compiles_for_any_number_of_experts():
  # Triton's arrays have power-of-two sizes: 6 experts' group sizes are padded with empty groups.
  case = kernel_report.Case("grouped", 20, 64, 1024, experts=6, tokens=10, fmt="mxfp4")
  row = kernel_report.report_row(case)
  assert row["launch_names"] == ["loop_pad_fusion", "grouped_fp4_matmul_mxfp4"] and row["spill_bytes"] == 0


@needs_toolchain
def test_decode_instructions_per_weight(rows):
  # Today's figures (+5%): the inline-PTX decode 7.36 (dense) and 6.68 (grouped), the plain one 10.4.
  assert rows[DENSE]["instructions_per_weight"] <= 7.75
  assert rows[GROUPED]["instructions_per_weight"] <= 7.0
  assert rows[DENSE_DEFAULT]["instructions_per_weight"] <= 11.0
  assert not rows[DENSE]["within_budget"]  # when this fails, the budget is met: tighten the ceilings


@needs_toolchain
def test_report_smoke(tmp_path):
  rows = kernel_report.main(["--smoke", "--out", str(tmp_path / "report")])
  assert len(rows) == 2 and (tmp_path / "report.md").read_text().count("\n") == 4


@needs_toolchain
def test_grouped_bf16_baseline_compiles():
  # The benchmarks' bf16 baseline is the same kernel family: it compiles to one launch, no spills.
  x = jax.ShapeDtypeStruct((512, 2048), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((128,), jnp.int32)
  w = jax.ShapeDtypeStruct((128, 1536, 2048), jnp.bfloat16)
  program = gpu_compile.compile_for_h200(functools.partial(grouped.grouped_bf16_matmul, interpret=False), x, sizes, w)
  assert [launch.name for launch in program.launches] == ["grouped_bf16_matmul"]
  [kernel] = program.kernels.values()
  assert kernel.resources.spill_stores == 0
