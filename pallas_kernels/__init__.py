"""FP4 matmul kernels for the rollout engine, and the dispatch it calls.

Kernels and references: `pallas_kernels.fp4_matmul` (dense, nn.Linear weights) and
`pallas_kernels.grouped_fp4_matmul` (MoE experts, rows sorted by expert).

`packed_matmul` / `grouped_packed_matmul` pick an implementation: the Pallas kernel on GPU
(`impl="auto"` when `jax.default_backend() == "gpu"`), the plain jnp reference elsewhere. The
choice is logged once per (function, implementation).

The rollout engine calls only `grouped_packed_matmul`: it packs the routed experts alone, and
keeps dense layers, the shared expert and attention as (fake-quantized) bf16 weights even when
they are quantization targets (`rollout.weight_sync`). `packed_matmul` and the dense kernel are
kept as the entry point for packed dense weights (FP4 dense layers or shared experts), and
because the dense kernel is the plain form of the grouped one: the decode, tiling and K loop the
grouped kernel reuses are written and tested there, against its jnp reference
(tests/test_pallas_kernels.py), and benchmarked (experiments/bench_fp4_matmul.py).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
from absl import logging

# Modules, not functions: binding `fp4_matmul` here would shadow the submodule of that name.
from pallas_kernels import fp4_matmul as dense
from pallas_kernels import grouped_fp4_matmul as grouped
from trace_jax import fp4

Impl = Literal["auto", "pallas", "reference"]

__all__ = ["grouped_packed_matmul", "packed_matmul", "select_impl"]


@functools.cache
def _log_selection(op: str, impl: str, backend: str):
  logging.info("%s: using the %s implementation (backend %s).", op, impl, backend)


def select_impl(impl: Impl, op: str = "packed_matmul") -> str:
  """'pallas' or 'reference' for `impl`; 'auto' means Pallas on GPU only."""
  if impl not in ("auto", "pallas", "reference"):
    raise ValueError(f"{op}: impl must be 'auto', 'pallas' or 'reference', got {impl!r}.")
  backend = jax.default_backend()
  chosen = ("pallas" if backend == "gpu" else "reference") if impl == "auto" else impl
  _log_selection(op, chosen, backend)
  return chosen


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
  if select_impl(impl, op) == "pallas":
    out = dense.fp4_matmul(rows, w, **common, **kernel_options)
  else:
    out = dense.fp4_matmul_reference(rows, w, **common)
  return out.reshape(*x.shape[:-1], out.shape[-1])


def grouped_packed_matmul(
  x: jax.Array,
  group_sizes: jax.Array,
  w: fp4.QuantizedArray,
  *,
  impl: Impl = "auto",
  quantize_activations: bool = False,
  activation_format: str | fp4.Fp4Format | None = None,
  out_dtype=None,
  **kernel_options,
) -> jax.Array:
  """Expert-grouped x[M, K] (rows sorted by expert, group_sizes[E]) against packed w [E, N, K] -> [M, N].

  Rows past sum(group_sizes) are zero. Options as in `packed_matmul`.
  """
  op = "grouped_packed_matmul"
  out_dtype = x.dtype if out_dtype is None else out_dtype
  common = dict(quantize_activations=quantize_activations, activation_format=activation_format, out_dtype=out_dtype)
  if select_impl(impl, op) == "pallas":
    return grouped.grouped_fp4_matmul(x, group_sizes, w, **common, **kernel_options)
  return grouped.grouped_fp4_matmul_reference(x, group_sizes, w, **common)
