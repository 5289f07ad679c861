"""FP4 matmul kernels for the rollout engine, and the dispatch it calls.

Kernels and references: `pallas_kernels.fp4_matmul` (dense, nn.Linear weights) and
`pallas_kernels.grouped_fp4_matmul` (MoE experts, rows sorted by expert), in Pallas-Triton, any
FP4 format; `pallas_kernels.fp4_mosaic` (both, one Mosaic GPU kernel for Hopper, NVFP4 weights
packed as wgmma fragments: `FragmentWeight`).

`packed_matmul` / `grouped_packed_matmul` pick an implementation (`select_impl`): on GPU the
Mosaic kernel on Hopper (sm_90) and the Triton kernel elsewhere (`impl="auto"`), the plain jnp
reference on other backends. A `FragmentWeight` goes to the Mosaic kernel (or, with 'reference',
to the grouped reference of its unpacked weight); a `QuantizedArray` to the Triton kernel. The
choice is logged once per (function, implementation).

The rollout engine calls only `grouped_packed_matmul`: it packs the routed experts alone, and
keeps dense layers, the shared expert and attention as (fake-quantized) bf16 weights even when
they are quantization targets (`rollout.weight_sync`). `packed_matmul` and the dense kernel are
kept as the entry point for packed dense weights (FP4 dense layers or shared experts), and
because the dense kernel is the plain form of the grouped one: the decode, tiling and K loop the
grouped kernel reuses are written and tested there, against its jnp reference
(tests/test_pallas_kernels.py), and benchmarked (pallas_kernels/lab/bench_fp4_matmul.py).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
from absl import logging

# Modules, not functions: binding `fp4_matmul` here would shadow the submodule of that name.
from pallas_kernels import fp4_matmul as dense
from pallas_kernels import fp4_mosaic as mosaic
from pallas_kernels import grouped_fp4_matmul as grouped
from trace_jax import fp4

Impl = Literal["auto", "pallas", "mosaic", "reference"]
IMPLS = ("auto", "pallas", "mosaic", "reference")

__all__ = ["grouped_bf16_matmul", "grouped_packed_matmul", "packed_matmul", "select_impl", "is_hopper"]

grouped_bf16_matmul = grouped.grouped_bf16_matmul  # the engine's bf16 experts on GPU (trace_jax.rollout)


@functools.cache
def _log_selection(op: str, impl: str, backend: str):
  logging.info("%s: using the %s implementation (backend %s).", op, impl, backend)


@functools.cache
def _log_k_fallback(op: str, k: int):
  logging.warning(
    "%s: K = %d is not a multiple of %d, the Triton kernels' smallest K step: using the reference.",
    op, k, dense.MIN_BLOCK_K,
  )  # fmt: skip


def _triton_takes(w: fp4.QuantizedArray, impl: Impl, op: str) -> bool:
  """Whether the Triton kernel runs w. With impl 'auto' or 'mosaic', a K it cannot step through
  (a multiple of 16 but not of 32: NVFP4's block is 16) runs the reference instead, logged once;
  'pallas' asks for the kernel, which then says why it cannot."""
  k = w.shape[-1]
  if impl != "pallas" and k % dense.MIN_BLOCK_K:
    _log_k_fallback(op, k)
    return False
  return True


def is_hopper() -> bool:
  """Whether the default device is an sm_90 GPU (H100 / H200): the Mosaic kernel's wgmma."""
  device = jax.devices()[0]
  return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")


def select_impl(impl: Impl, op: str = "packed_matmul", mosaic_kernel: bool = True) -> str:
  """'mosaic', 'pallas' (Triton) or 'reference' for `impl`; 'auto': the Mosaic kernel on Hopper, the
  Triton one on other GPUs, the reference elsewhere. (Callers whose weights the Mosaic kernel cannot
  take, see `fp4_mosaic.unsupported`, fall back to the Triton kernel; mosaic_kernel=False: an op that
  has none, where 'auto' and 'mosaic' mean the Triton kernel.)"""
  if impl not in IMPLS:
    raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}.")
  backend = jax.default_backend()
  if impl == "auto":
    impl = ("mosaic" if is_hopper() else "pallas") if backend == "gpu" else "reference"
  if impl == "mosaic" and not mosaic_kernel:
    impl = "pallas"
  _log_selection(op, impl, backend)
  return impl


def packed_matmul(
  x: jax.Array,
  w: fp4.QuantizedArray,
  *,
  impl: Impl = "auto",
  quantize_activations: bool = False,
  activation_format: str | fp4.Fp4Format | None = None,
  out_dtype=None,
  **kernel_options,
) -> jax.Array:
  """x[..., K] @ dequantize(w)^T for a packed nn.Linear weight w [N, K] -> [..., N].

  Leading axes of x are flattened into rows. `out_dtype` defaults to x's dtype.
  `kernel_options` (block_m, block_n, block_k, k_splits, num_warps, num_stages, interpret) go
  to the Pallas kernel and are ignored by the reference.
  """
  op = "packed_matmul"
  out_dtype = x.dtype if out_dtype is None else out_dtype
  rows = x.reshape(-1, x.shape[-1])
  common = dict(quantize_activations=quantize_activations, activation_format=activation_format, out_dtype=out_dtype)
  if select_impl(impl, op, mosaic_kernel=False) != "reference" and _triton_takes(w, impl, op):  # the Triton kernel
    out = dense.fp4_matmul(rows, w, **common, **kernel_options)
  else:
    out = dense.fp4_matmul_reference(rows, w, **common)
  return out.reshape(*x.shape[:-1], out.shape[-1])


def grouped_packed_matmul(
  x: jax.Array,
  group_sizes: jax.Array,
  w: fp4.QuantizedArray | mosaic.FragmentWeight,
  *,
  impl: Impl = "auto",
  quantize_activations: bool = False,
  activation_format: str | fp4.Fp4Format | None = None,
  out_dtype=None,
  **kernel_options,
) -> jax.Array:
  """Expert-grouped x[M, K] (rows sorted by expert, group_sizes[E]) against packed w [E, N, K] -> [M, N].

  Rows past sum(group_sizes) are zero. Options as in `packed_matmul`.

  A `FragmentWeight` (`fp4_mosaic.pack_fragments` of NVFP4 experts) runs the Mosaic kernel ('auto',
  'mosaic' or 'pallas'; bf16 x: it does not quantize activations) or the reference of its unpacked
  weight ('reference', or 'auto' off GPU); a `QuantizedArray` the Triton kernel ('pallas', or 'auto'
  and 'mosaic' on GPU: its format and shapes may be ones the Mosaic kernel does not take).
  """
  op = "grouped_packed_matmul"
  out_dtype = x.dtype if out_dtype is None else out_dtype
  common = dict(quantize_activations=quantize_activations, activation_format=activation_format, out_dtype=out_dtype)
  chosen = select_impl(impl, op)
  if isinstance(w, mosaic.FragmentWeight):
    if chosen == "reference":
      return grouped.grouped_fp4_matmul_reference(x, group_sizes, mosaic.unpack_fragments(w), **common)
    if quantize_activations:
      raise ValueError(f"{op}: the Mosaic kernel takes bf16 activations; quantize them before the call.")
    return mosaic.grouped_fp4_matmul_mosaic(x, group_sizes, w, out_dtype=out_dtype, **kernel_options)
  if chosen != "reference" and _triton_takes(w, impl, op):
    return grouped.grouped_fp4_matmul(x, group_sizes, w, **common, **kernel_options)
  return grouped.grouped_fp4_matmul_reference(x, group_sizes, w, **common)
