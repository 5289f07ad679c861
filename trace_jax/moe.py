"""The MoE block: softmax router with top-k, SwiGLU experts, optional shared expert.

Expert compute has three implementations that agree (tests/test_model.py, tests/test_sharding.py):
  * 'sorted': sort the (token, slot) pairs by expert and run grouped matmuls (`grouped_dot`:
    `lax.ragged_dot` on TPU), the trainer's path; on CPU and GPU the whole expert FFN runs as batched
    matmuls in one padded tile layout (`_tiled_expert_ffn`);
  * 'dense': every expert on every selected slot, picked with a one-hot; the reference;
  * 'ep': expert parallelism over a mesh (expert_parallel.py): the sorted path's expert FFN,
    run where the experts live, with an all_to_all dispatch and a capacity.
FP4 fake-quant (W4A4 on the routed experts) goes through the `qat.QatContext` passed in: `weight`
for the expert weights, `guided_activation` for the expert input and hidden rows, whose guidance
rows follow the tokens with `qat.take_rows` / `qat.flatten_rows`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from trace_jax import qat
from trace_jax.config import MOE_HIDDEN, MOE_INPUT, ModelConfig
from trace_jax.expert_parallel import ExpertParallel, experts
from trace_jax.sharding import param_field


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLPParams:
  """SwiGLU MLP: down(silu(x @ gate) * (x @ up)). Shapes [H, I], [H, I], [I, H]."""

  gate: jax.Array = param_field("embed", "mlp")
  up: jax.Array = param_field("embed", "mlp")
  down: jax.Array = param_field("mlp", "embed")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEParams:
  """Router [H, E]; routed experts gate/up [E, H, I], down [E, I, H]; optional shared expert."""

  router: jax.Array = param_field("embed", None)
  gate: jax.Array = param_field("experts", "embed", "mlp")
  up: jax.Array = param_field("experts", "embed", "mlp")
  down: jax.Array = param_field("experts", "mlp", "embed")
  shared: MLPParams | None = None
  shared_gate: jax.Array | None = param_field("embed", None, default=None)  # [H, 1], sigmoid gate (Qwen2-MoE)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEOutput:
  out: jax.Array  # [T, H]
  router_logits: jax.Array  # [T, E] float32
  topk_ids: jax.Array  # [T, k] int32, in descending router probability
  stats: dict  # tensor name -> qat.QuantStats (rows, unmasked)
  dropped: jax.Array | None = None  # impl='ep': (token, expert) assignments over capacity, int32


def dot(x, w, compute_dtype):
  return jnp.dot(x.astype(compute_dtype), w.astype(compute_dtype), preferred_element_type=jnp.float32)


def mlp(params: MLPParams, x, ctx: qat.QatContext, target: str):
  """Dense SwiGLU MLP, W4A4 RTN fake-quant when `target` is quantized."""
  dt = ctx.compute_dtype
  gate, up, down = (ctx.weight(w, target) for w in (params.gate, params.up, params.down))
  x = ctx.activation(x, target)
  h = (jax.nn.silu(dot(x, gate, dt)) * dot(x, up, dt)).astype(dt)
  return dot(ctx.activation(h, target), down, dt)


def route(router_logits: jax.Array, config: ModelConfig, replay_ids: jax.Array | None):
  """Top-k expert ids and their combine weights (float32) from router logits [T, E]."""
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  if replay_ids is None:
    weights, ids = jax.lax.top_k(probs, config.num_experts_per_tok)
  else:  # routing replay (R3): reuse the rollout's experts, weights from our own router
    ids = replay_ids.astype(jnp.int32)
    weights = jnp.take_along_axis(probs, ids, axis=-1)
  if config.norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return ids.astype(jnp.int32), weights


GROUPED_DOT_IMPLS = ("auto", "ragged", "tiled", "capacity")


def grouped_dot_impl(impl: str = "auto", inference: bool = False) -> str:
  """The implementation `impl` names. 'auto': on CPU 'tiled' (differentiable, static) for training and
  'capacity' (no weight gather) for inference; on GPU 'tiled' for both; on TPU 'ragged' (its grouped kernel).

  Not 'ragged' on GPU: XLA:GPU (jaxlib 0.10) rewrites `lax.ragged_dot` and its transposes into dense matmuls
  over a masked [G, M, K] copy of the rows, G times the memory and the flops. Compiled for sm_90a at
  Qwen3-30B-A3B's layer shapes (docs/gpu.md), a 2-layer train step needed 489 GB with it (f32[128, 98240, 2048]
  buffers) and 65 GB tiled, which gathers [tiles, K, N] weights instead. (The engine's bf16 experts take the
  Triton grouped kernel there: `rollout.grouped_matmul`.)"""
  if impl not in GROUPED_DOT_IMPLS:
    raise ValueError(f"grouped_dot: impl must be one of {GROUPED_DOT_IMPLS}, got {impl!r}.")
  if impl == "auto":
    backend = jax.default_backend()
    if backend == "cpu":
      return "capacity" if inference else "tiled"
    return "ragged" if backend == "tpu" else "tiled"
  return impl


def tile_rows(rows: int, groups: int) -> int:
  """Rows per tile of the tiled grouped dot: about the mean group size, a power of two in [4, 1024] (at most G
  tiles' padding; a prefill of 10^6 rows over 128 experts gathers 1151 tiles' weights, not 4223)."""
  mean = max(rows // max(groups, 1), 1)
  return int(min(max(1 << (mean.bit_length() - 1), 4), 1024))


def _tiled_grouped_dot(x, w, group_sizes, transpose_w: bool):
  """`lax.ragged_dot` as batched matmuls over tiles of `tile_rows` rows, each tile within one group.

  Each group's rows are padded to whole tiles (at most ceil(R / m) + G - 1 tiles: a static shape),
  every tile takes its group's weight matrix (a gather of [tiles, K, N]) and one batched einsum
  does the arithmetic. XLA:CPU lowers `ragged_dot` to per-group masked work about 25x slower than
  a dense matmul of the same size; this runs at about the dense rate, differentiably (the
  gathers' transposes are scatter-adds), at the cost of the padding rows and the weight gather.
  Rows past sum(group_sizes) give zeros, as in ragged_dot.
  """
  r, g = x.shape[0], w.shape[0]
  m = tile_rows(r, g)
  tiles = -(-r // m) + g - 1
  group_sizes = group_sizes.astype(jnp.int32)
  tiles_per_group = -(-group_sizes // m)
  tile_end = jnp.cumsum(tiles_per_group)
  row_group, rank = _row_groups(group_sizes, r)  # rows past the last group: g
  # each tile's group (unused tiles: the last group's, with zero rows)
  tile_group = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(tiles), side="right", method="compare_all"), g - 1)
  safe = jnp.minimum(row_group, g - 1)
  dest = jnp.where(
    row_group < g, (tile_end - tiles_per_group)[safe] * m + rank, tiles * m + jnp.arange(r)
  )  # OOB: dropped
  padded = jnp.zeros((tiles * m, x.shape[1]), x.dtype).at[dest].set(x, mode="drop", unique_indices=True)
  wt = w[tile_group]  # [tiles, K, N] (transpose_w: [tiles, N, K])
  spec = "tmk,tnk->tmn" if transpose_w else "tmk,tkn->tmn"
  out = jnp.einsum(spec, padded.reshape(tiles, m, -1), wt, preferred_element_type=jnp.float32)
  return jnp.take(out.reshape(tiles * m, -1), dest, axis=0, mode="fill", fill_value=0)


def _row_groups(group_sizes, rows: int):
  """Each sorted row's group (G past the last group) and its rank within the group."""
  g = group_sizes.shape[0]
  row_end = jnp.cumsum(group_sizes)
  row_group = jnp.searchsorted(row_end, jnp.arange(rows), side="right", method="compare_all")
  rank = jnp.arange(rows) - (row_end - group_sizes)[jnp.minimum(row_group, g - 1)]
  return row_group, rank


def capacity_buckets(rows: int, groups: int) -> list[int]:
  """The capacities of `_capacity_grouped_dot`'s buckets, ascending: twice the mean group size (rounded up
  to a power of two), four times it, and the row count."""
  twice_mean = 1 << max(2 * -(-rows // groups) - 1, 0).bit_length()  # a power of two >= 2 * the mean group
  return sorted({min(twice_mean, rows), min(2 * twice_mean, rows), rows})


def _capacity_grouped_dot(x, w, group_sizes, transpose_w: bool):
  """`lax.ragged_dot` as one batched matmul [G, C, K] x [G, K, N] with no weight gather, the
  capacity C picked at run time (`lax.switch`) from three static buckets: twice the mean group size
  (rounded up to a power of two), four times it, and the row count, so no row is ever dropped.
  Each bucket is a compiled branch (more buckets fit tighter and compile longer); meant for
  inference (decode), where G * C stays within a few times the row count."""
  r, g = x.shape[0], w.shape[0]
  group_sizes = group_sizes.astype(jnp.int32)
  row_group, rank = _row_groups(group_sizes, r)
  buckets = capacity_buckets(r, g)
  spec = "gck,gnk->gcn" if transpose_w else "gck,gkn->gcn"

  def branch(c):
    def run(x, w):
      buf = jnp.zeros((g, c, x.shape[1]), x.dtype).at[row_group, rank].set(x, mode="drop")
      out = jnp.einsum(spec, buf, w, preferred_element_type=jnp.float32)
      return out.at[row_group, rank].get(mode="fill", fill_value=0)

    return run

  largest = jnp.max(group_sizes)
  index = jnp.sum(jnp.asarray(buckets[:-1], jnp.int32) < largest)
  return jax.lax.switch(index, [branch(c) for c in buckets], x, w)


def grouped_dot(x, w, group_sizes, *, transpose_w: bool = False, impl: str = "auto", inference: bool = False):
  """Rows x [R, K] sorted by group times their group's w[g] [K, N] (transpose_w: w[g] is [N, K]),
  fp32 accumulation -> [R, N] float32. group_sizes [G]; None: G equal groups (a batched matmul).

  impl: 'ragged' (`lax.ragged_dot`, the grouped kernel on GPU/TPU), 'tiled' (batched matmuls over
  row tiles), 'capacity' (one batched matmul over capacity buckets); 'auto' picks by backend and
  `inference` (see grouped_dot_impl). They agree to fp32 rounding (tests/test_model.py).
  """
  if group_sizes is None:
    xg = x.reshape(w.shape[0], -1, x.shape[-1])
    spec = "erk,enk->ern" if transpose_w else "erk,ekn->ern"
    return jnp.einsum(spec, xg, w, preferred_element_type=jnp.float32).reshape(xg.shape[0] * xg.shape[1], -1)
  impl = grouped_dot_impl(impl, inference)
  if impl == "tiled":
    return _tiled_grouped_dot(x, w, group_sizes, transpose_w)
  if impl == "capacity":
    return _capacity_grouped_dot(x, w, group_sizes, transpose_w)
  w = jnp.swapaxes(w, 1, 2) if transpose_w else w
  return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)


def _expert_ffn(ctx: qat.QatContext, weights, xs, g_rows, found, group_sizes, impl: str = "auto"):
  """SwiGLU experts on rows xs [R, H] grouped by expert (group_sizes), guided A4 on the hidden rows
  (found [R]: the rows whose guidance the rollout recorded; None = all). impl: `grouped_dot`'s."""
  dt = ctx.compute_dtype
  gate_w, up_w, down_w = weights
  xs = xs.astype(dt)
  gate = grouped_dot(xs, gate_w.astype(dt), group_sizes, impl=impl)
  up = grouped_dot(xs, up_w.astype(dt), group_sizes, impl=impl)
  h = (jax.nn.silu(gate) * up).astype(dt)
  hq, s_hidden = ctx.guided_activation(h, "experts", g_rows, MOE_HIDDEN, found)
  y = grouped_dot(hq.astype(dt), down_w.astype(dt), group_sizes, impl=impl)
  return y, s_hidden


def _tile_layout(ids: jax.Array, num_experts: int):
  """Where the tiled dispatch puts each (token, slot) assignment: the layout of `_tiled_grouped_dot`
  (each expert's rows padded to whole tiles of `tile_rows` rows, in the stable sort by expert),
  reached straight from the assignments.

  Returns (pos [A]: each assignment's row in the layout, src [tiles * m]: each layout row's
  assignment (A for padding), tile_group [tiles]: each tile's expert, m, tiles), A = T * k.
  """
  flat = ids.reshape(-1)
  a, g = flat.shape[0], num_experts
  m = tile_rows(a, g)
  tiles = -(-a // m) + g - 1
  group_sizes = jnp.bincount(flat, length=g).astype(jnp.int32)
  tiles_per_group = -(-group_sizes // m)
  tile_end = jnp.cumsum(tiles_per_group)
  order = jnp.argsort(flat, stable=True)
  row_start = jnp.cumsum(group_sizes) - group_sizes
  sorted_pos = (tile_end - tiles_per_group)[flat[order]] * m + jnp.arange(a) - row_start[flat[order]]
  pos = jnp.zeros(a, jnp.int32).at[order].set(sorted_pos.astype(jnp.int32), unique_indices=True)
  src = jnp.full(tiles * m, a, jnp.int32).at[pos].set(jnp.arange(a, dtype=jnp.int32), unique_indices=True)
  tile_group = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(tiles), side="right", method="compare_all"), g - 1)
  return pos, src, tile_group, m, tiles


def _tiled_expert_ffn(ctx: qat.QatContext, weights, xq, ids, g_hidden, found, num_experts: int):
  """The sorted path's expert FFN with every step in the tiled dispatch's layout (CPU).

  `_expert_ffn` with `grouped_dot(impl='tiled')` would scatter rows into padded tiles and gather
  them back around each of its three matmuls; here the token rows are gathered into the layout
  once, gate/up, SwiGLU, the guided A4 of the hidden rows and down all run on [tiles, m, .] blocks,
  and the outputs and per-row stats are gathered back once. Padding rows are zeros (their hidden
  rows quantize to zeros, whatever guidance they borrow) and are never read back.

  xq [T, H]; ids [T, k]; g_hidden / found: the hidden rows' guidance and coverage, [T * k] rows in
  slot order (None: none / all). Returns (y [T, k, H] float32, per-row stats [T, k]).
  """
  dt = ctx.compute_dtype
  t, k = ids.shape
  a = t * k
  pos, src, tile_group, m, tiles = _tile_layout(ids, num_experts)
  gate_w, up_w, down_w = (w.astype(dt)[tile_group] for w in weights)  # [tiles, H, I], [tiles, I, H]
  x = jnp.take(xq.astype(dt), src // k, axis=0, mode="fill", fill_value=0).reshape(tiles, m, -1)
  gate = jnp.einsum("tmh,thi->tmi", x, gate_w, preferred_element_type=jnp.float32)
  up = jnp.einsum("tmh,thi->tmi", x, up_w, preferred_element_type=jnp.float32)
  h = (jax.nn.silu(gate) * up).astype(dt).reshape(tiles * m, -1)
  rows = jnp.minimum(src, a - 1)  # padding borrows the last assignment's guidance: it rounds zeros
  found_rows = None if found is None else found[rows]
  hq, s_hidden = ctx.guided_activation(h, "experts", qat.take_rows(g_hidden, rows, a), MOE_HIDDEN, found_rows)
  y = jnp.einsum("tmi,tih->tmh", hq.astype(dt).reshape(tiles, m, -1), down_w, preferred_element_type=jnp.float32)
  y = y.reshape(tiles * m, -1)[pos].reshape(t, k, -1)
  return y, jax.tree_util.tree_map(lambda s: s[pos].reshape(t, k), s_hidden)


def _hidden_rows_by_expert(g, guidance_ids: jax.Array, ids: jax.Array):
  """The rollout's 'moe_hidden' guidance rows for this block's (token, slot) assignments, matched by expert.

  g: rows [T, k, ...] in the rollout's slot order, whose experts are guidance_ids [T, k]; ids [T, k]:
  this block's experts. Returns (rows [T * k, ...] in this block's slot order, found [T * k]: whether
  the rollout ran that expert for that token; where it did not, the row is a placeholder).
  """
  t, k = ids.shape
  same = ids[:, :, None] == guidance_ids[:, None, :]  # [T, k (ours), k (rollout's)]; a top-k has distinct experts
  rows = jnp.arange(t)[:, None] * k + jnp.argmax(same, axis=-1)
  return qat.take_rows(g, rows.reshape(-1), t * k), jnp.any(same, axis=-1).reshape(-1)


def moe_block(
  params: MoEParams,
  x: jax.Array,
  config: ModelConfig,
  ctx: qat.QatContext,
  guidance: dict,
  replay_ids: jax.Array | None = None,
  impl: str = "sorted",
  expert_parallel: ExpertParallel | None = None,
  guidance_ids: jax.Array | None = None,
  dispatch: str = "auto",
) -> MoEOutput:
  """x [T, H] -> MoEOutput. `guidance` maps 'moe_input' ([T] rows) and 'moe_hidden' ([T, k] rows).

  guidance_ids [T, k]: the experts whose hidden activations the 'moe_hidden' rows hold, slot by
  slot (the rollout's top-k). Given, each of this block's (token, expert) rows takes the rollout's
  row of the same expert, and an expert the rollout did not run for that token is rounded to
  nearest and left out of the counts. None: the rows follow this block's slots (routing replay).
  impl='ep' needs `expert_parallel` (the mesh and capacity) and reports dropped assignments.
  dispatch: the sorted path's grouped matmuls (`grouped_dot_impl`: 'auto' is 'tiled' on CPU and GPU, run in
  one padded tile layout by `_tiled_expert_ffn`, and 'ragged' elsewhere).
  """
  dt = ctx.compute_dtype
  t, k = x.shape[0], config.num_experts_per_tok
  router_logits = dot(x, params.router, dt)
  ids, weights = route(router_logits, config, replay_ids)

  gate_w, up_w, down_w = (ctx.weight(w, "experts", axis=1) for w in (params.gate, params.up, params.down))
  xq, stats_in = ctx.guided_activation(x, "experts", guidance.get(MOE_INPUT), MOE_INPUT)
  stats = {MOE_INPUT: stats_in}
  g_hidden = guidance.get(MOE_HIDDEN)
  found = None  # [T * k]: the assignments the rollout's guidance covers; None = all of them
  if g_hidden is not None and guidance_ids is not None:
    g_hidden, found = _hidden_rows_by_expert(g_hidden, guidance_ids, ids)
  dropped = None

  if impl == "sorted" and grouped_dot_impl(dispatch) == "tiled":
    y, s_hidden = _tiled_expert_ffn(ctx, (gate_w, up_w, down_w), xq, ids, g_hidden, found, config.num_experts)
  elif impl == "sorted":
    flat_ids = ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    group_sizes = jnp.bincount(flat_ids, length=config.num_experts).astype(jnp.int32)
    g_sorted = qat.take_rows(g_hidden, order, t * k)
    found_sorted = None if found is None else found[order]
    weights3 = (gate_w, up_w, down_w)
    y_sorted, s_hidden = _expert_ffn(ctx, weights3, xq[order // k], g_sorted, found_sorted, group_sizes, dispatch)
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(t, k, -1)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(t * k))
    s_hidden = jax.tree_util.tree_map(lambda a: a[inverse].reshape(t, k), s_hidden)
  elif impl == "dense":
    onehot = jax.nn.one_hot(ids, config.num_experts, dtype=jnp.float32)  # [T, k, E]
    gate = jnp.einsum("th,ehi->tei", xq.astype(dt), gate_w.astype(dt), preferred_element_type=jnp.float32)
    up = jnp.einsum("th,ehi->tei", xq.astype(dt), up_w.astype(dt), preferred_element_type=jnp.float32)
    h_all = jax.nn.silu(gate) * up  # [T, E, I]
    h = jnp.einsum("tke,tei->tki", onehot, h_all).astype(dt)  # exact: one-hot picks one expert
    g_rows = qat.flatten_rows(g_hidden, t * k)
    hq, s_hidden = ctx.guided_activation(h.reshape(t * k, -1), "experts", g_rows, MOE_HIDDEN, found)
    s_hidden = jax.tree_util.tree_map(lambda a: a.reshape(t, k), s_hidden)
    y_all = jnp.einsum("ti,eih->teh", hq.astype(dt), down_w.astype(dt), preferred_element_type=jnp.float32)
    y = jnp.einsum("tke,tkeh->tkh", onehot, y_all.reshape(t, k, config.num_experts, -1))
  elif impl == "ep":
    if expert_parallel is None:
      raise ValueError("moe_impl='ep' needs an ExpertParallel (the mesh and capacity).")
    g_rows = qat.flatten_rows(g_hidden, t * k)  # per-assignment rows travel with the tokens
    tensor_scale = None if g_rows is None else g_rows.tensor_scale
    # found as uint8: the exchange's buffers and collectives need not take booleans
    payload = (
      None if g_rows is None else dataclasses.replace(g_rows, tensor_scale=None),
      None if found is None else found.astype(jnp.uint8),
    )

    def ffn(weights, xs, rows, group_sizes, tensor_scale):
      g_local, found_local = rows
      g = None if g_local is None else dataclasses.replace(g_local, tensor_scale=tensor_scale)
      return _expert_ffn(ctx, weights, xs, g, found_local, group_sizes)

    weights3 = (gate_w, up_w, down_w)
    y, s_hidden, dropped = experts(expert_parallel, ffn, weights3, xq.astype(dt), ids, payload, tensor_scale)
    s_hidden = jax.tree_util.tree_map(lambda a: a.reshape(t, k), s_hidden)
  else:
    raise ValueError(f"Unknown MoE implementation {impl!r}: expected 'sorted', 'dense' or 'ep'.")
  stats[MOE_HIDDEN] = s_hidden

  out = jnp.sum(weights[..., None] * y, axis=1)
  if params.shared is not None:
    shared = mlp(params.shared, x, ctx, "shared_expert")
    out = out + jax.nn.sigmoid(dot(x, params.shared_gate, dt)) * shared
  return MoEOutput(out, router_logits, ids, stats, dropped)


def load_balancing_loss(router_logits: jax.Array, topk_ids: jax.Array, mask: jax.Array, num_experts: int):
  """Switch/HF auxiliary loss E * sum_e f_e * P_e over real tokens.

  router_logits [T, E], topk_ids [T, k], mask [T] (1 = real token). `model.forward` passes the
  rows of every MoE layer concatenated (mask tiled), so f_e and P_e are averaged over layers and
  tokens together, as transformers' `load_balancing_loss_func` does (tests/test_model.py).
  """
  mask = mask.astype(jnp.float32)
  denom = jnp.maximum(jnp.sum(mask), 1.0)
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  routed = jax.nn.one_hot(topk_ids, num_experts, dtype=jnp.float32)  # [T, k, E]
  tokens_per_expert = jnp.einsum("tke,t->ke", routed, mask) / denom
  prob_per_expert = jnp.einsum("te,t->e", probs, mask) / denom
  return num_experts * jnp.sum(tokens_per_expert * prob_per_expert[None, :])
