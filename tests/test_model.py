"""The trainer's model: MoE dispatch, masking, routing replay, QAT gradients, config checks.

References: the dense MoE dispatch for the sorted one, the unpadded / unperturbed sequence
for padding and causality, transformers' `load_balancing_loss_func` for the aux loss.
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from pallas_kernels import gpu_compile
from tests.tiny import tiny_model
from trace_jax import model, moe, qat, quantizer, sharding
from trace_jax.config import MOE_HIDDEN, ConfigError, ModelConfig, QuantConfig, section
from trace_jax.expert_parallel import ExpertParallel

TINY = tiny_model(initializer_range=0.1)  # O(1) logits and decisive routing
FP32 = qat.QatContext(compute_dtype=jnp.float32)
QAT32 = qat.QatContext(QuantConfig(), compute_dtype=jnp.float32)
GUIDED32 = qat.QatContext(QuantConfig(), guided=True, compute_dtype=jnp.float32)
B, S = 2, 12


@functools.partial(jax.jit, static_argnums=(3, 4, 7))
def _forward(params, tokens, mask, config, ctx, guidance, replay_ids, moe_impl, guidance_ids):
  return model.forward(
    params,
    tokens,
    mask,
    config,
    ctx=ctx,
    guidance=guidance,
    replay_ids=replay_ids,
    moe_impl=moe_impl,
    guidance_ids=guidance_ids,
  )


def fwd(params, tokens, mask, config, ctx=FP32, guidance=None, replay_ids=None, moe_impl="sorted", guidance_ids=None):
  """One calling convention, so equal arguments hit the same compiled function."""
  return _forward(params, tokens, mask, config, ctx, guidance, replay_ids, moe_impl, guidance_ids)


@pytest.fixture(scope="module")
def params():
  return model.init_params(TINY, jax.random.key(0))


@pytest.fixture(scope="module")
def batch():
  tokens = jax.random.randint(jax.random.key(1), (B, S), 0, TINY.vocab_size)
  mask = jnp.ones((B, S), jnp.int32).at[1, :4].set(0)  # row 1 is left-padded
  return tokens, mask


def random_guidance(config: ModelConfig, key) -> tuple[dict, ...]:
  """Mantissa-bit guidance for every guided tensor, laid out by position (as the rollout ships it)."""
  k, d = config.num_experts_per_tok, config.head_dim
  shapes = {
    "moe_input": (B, S, config.hidden_size),
    "moe_hidden": (B, S, k, config.moe_intermediate_size),
    "key": (B, S, config.num_kv_heads, d),
    "value": (B, S, config.num_kv_heads, d),
  }
  layers = []
  for layer_key in jax.random.split(key, config.num_layers):
    keys = dict(zip(shapes, jax.random.split(layer_key, len(shapes))))
    layers.append(
      {n: quantizer.make_guidance(jax.random.normal(keys[n], s), form="mantissa")[0] for n, s in shapes.items()}
    )
  return tuple(layers)


@pytest.mark.parametrize("ctx_name", ["fp32", "qat", "qat_guided"])
def test_sorted_and_dense_moe_agree(params, batch, ctx_name):
  ctx = {"fp32": FP32, "qat": QAT32, "qat_guided": GUIDED32}[ctx_name]
  guidance = random_guidance(TINY, jax.random.key(2)) if ctx.guided else None
  out = {impl: fwd(params, *batch, TINY, ctx, guidance, moe_impl=impl) for impl in ("sorted", "dense")}
  (l_sorted, a_sorted), (l_dense, a_dense) = out["sorted"], out["dense"]
  np.testing.assert_allclose(l_sorted, l_dense, atol=2e-5, rtol=1e-5)
  for t_sorted, t_dense in zip(a_sorted.topk_ids, a_dense.topk_ids):
    np.testing.assert_array_equal(t_sorted, t_dense)
  # Guidance rows follow their (token, slot) through the sort: the code agreement counts match.
  chex.assert_trees_all_equal(a_sorted.quant_stats, a_dense.quant_stats)
  if ctx.guided:
    hidden = a_sorted.quant_stats[0]["moe_hidden"]
    assert int(hidden.bit_total) == int(batch[1].sum()) * TINY.num_experts_per_tok * TINY.moe_intermediate_size
    # Guided rounding finds the rollout's mantissa bit except where one neighbour exists (a block's
    # amax lands on 6; the random guidance may ask for the other bit there).
    assert int(hidden.bit_matches) >= 0.9 * int(hidden.bit_total)
    assert int(hidden.total) == 0  # no full codes: no codeword agreement to count


@pytest.mark.parametrize("ctx", [FP32, QAT32], ids=["fp32", "qat"])
def test_left_padding_leaves_real_tokens_unchanged(params, batch, ctx):
  tokens, mask = batch
  pad = 4
  row = tokens[1, pad:][None]
  unpadded, _ = fwd(params, row, jnp.ones_like(row), TINY, ctx)
  padded, _ = fwd(params, tokens, mask, TINY, ctx)
  np.testing.assert_allclose(padded[1, pad:], unpadded[0], atol=1e-5, rtol=1e-5)


def test_causal_masking(params, batch):
  tokens, mask = batch
  j = 8
  changed = tokens.at[:, j].set((tokens[:, j] + 1) % TINY.vocab_size)
  before, _ = fwd(params, tokens, mask, TINY)
  after, _ = fwd(params, changed, mask, TINY)
  real = np.asarray(mask, bool)[..., None]  # pad rows attend uniformly to every key: not compared
  np.testing.assert_allclose(np.where(real, before, 0)[:, :j], np.where(real, after, 0)[:, :j], atol=1e-6, rtol=0)
  assert np.abs(before[:, j:] - after[:, j:]).max() > 1e-3


@pytest.mark.parametrize("ctx", [FP32, QAT32], ids=["fp32", "qat"])
def test_routing_replay_with_own_ids_is_exact(params, batch, ctx):
  logits, aux = fwd(params, *batch, TINY, ctx)
  replayed, aux_replayed = fwd(params, *batch, TINY, ctx, replay_ids=aux.topk_ids)
  np.testing.assert_array_equal(logits, replayed)
  np.testing.assert_array_equal(aux.topk_ids[0], aux_replayed.topk_ids[0])


# --- 'moe_hidden' guidance matched by expert (no routing replay) ------------------------------------

T_MOE = 12  # tokens of the MoE-block cases
EP_ONE_DEVICE = ExpertParallel(  # capacity for every assignment: nothing dropped
  sharding.make_mesh({}, jax.local_devices()[:1]), capacity_factor=TINY.num_experts / TINY.num_experts_per_tok
)


@functools.partial(jax.jit, static_argnames="impl")
def moe_hidden_guided(p, x, g_hidden, guidance_ids, impl):
  ep = EP_ONE_DEVICE if impl == "ep" else None
  guidance = {"moe_hidden": g_hidden}
  return moe.moe_block(p, x, TINY, GUIDED32, guidance, impl=impl, expert_parallel=ep, guidance_ids=guidance_ids)


@pytest.fixture(scope="module")
def moe_case(params):
  """(layer-0 MoE params, x [T, H], the experts the trainer's router picks [T, k], in its order)."""
  p = params.layers[0].mlp
  x = jax.random.normal(jax.random.key(9), (T_MOE, TINY.hidden_size))
  return p, x, np.asarray(moe.moe_block(p, x, TINY, GUIDED32, {}).topk_ids)


def hidden_guidance(form: str) -> quantizer.Guidance:
  shape = (T_MOE, TINY.num_experts_per_tok, TINY.moe_intermediate_size)
  return quantizer.make_guidance(jax.random.normal(jax.random.key(10), shape), form=form)[0]


def in_slot_order(g: quantizer.Guidance, perm: np.ndarray) -> quantizer.Guidance:
  """Rows [T, k, ...] with each token's slots permuted: row (t, j) <- (t, perm[t, j])."""
  return jax.tree_util.tree_map(lambda a: a[np.arange(T_MOE)[:, None], perm] if a.ndim >= 2 else a, g)


@pytest.mark.parametrize("form", ["full", "mantissa_scale"])
def test_hidden_guidance_is_matched_by_expert(moe_case, form):
  """The rollout ranked the trainer's experts in another order (reversed, every other token): each (token, expert)
  row takes the rollout's row of that expert, bit for bit as if the rollout had ranked them the trainer's way, in
  every implementation. Taken slot by slot, the reversed tokens would get the other expert's rows."""
  p, x, ids = moe_case
  k = TINY.num_experts_per_tok
  g = hidden_guidance(form)  # laid out by the trainer's slots
  perm = np.where((np.arange(T_MOE) % 2 == 0)[:, None], np.arange(k)[::-1], np.arange(k))
  rollout_ids, rollout_g = np.take_along_axis(ids, perm, axis=1), in_slot_order(g, perm)
  for impl in ("sorted", "dense", "ep"):
    want = moe_hidden_guided(p, x, g, None, impl)
    got = moe_hidden_guided(p, x, rollout_g, jnp.asarray(rollout_ids), impl)
    np.testing.assert_array_equal(got.out, want.out, err_msg=impl)
    chex.assert_trees_all_equal(got.stats, want.stats)
  by_slot = moe_hidden_guided(p, x, rollout_g, None, "sorted").out
  assert np.abs(by_slot - moe_hidden_guided(p, x, g, None, "sorted").out).max() > 1e-3


def test_expert_the_rollout_did_not_run_is_unmatched(moe_case):
  """An expert the rollout did not pick for a token has no guidance row: it is left out of the counts (and rounded to
  nearest, test_rows_without_guidance_round_to_nearest); the matched rows are guided as before. The three
  implementations agree (sorted and ep exactly)."""
  p, x, ids = moe_case
  g = hidden_guidance("full")
  rollout_ids = ids.copy()
  for t in range(0, T_MOE, 3):  # the rollout's first expert is one the trainer did not pick
    rollout_ids[t, 0] = min(set(range(TINY.num_experts)) - set(ids[t]))
  found = np.any(ids[:, :, None] == rollout_ids[:, None, :], axis=-1)
  assert np.sum(~found) == T_MOE // 3
  matched = moe_hidden_guided(p, x, g, None, "sorted").stats["moe_hidden"]
  got = {impl: moe_hidden_guided(p, x, g, jnp.asarray(rollout_ids), impl) for impl in ("sorted", "dense", "ep")}
  for impl, out in got.items():
    s = out.stats["moe_hidden"]
    assert not np.any(np.asarray(s.total)[~found]) and not np.any(np.asarray(s.matches)[~found]), impl
    np.testing.assert_array_equal(np.asarray(s.total)[found], TINY.moe_intermediate_size)
  np.testing.assert_array_equal(
    np.asarray(got["sorted"].stats["moe_hidden"].matches)[found], np.asarray(matched.matches)[found]
  )
  np.testing.assert_array_equal(got["ep"].out, got["sorted"].out)
  chex.assert_trees_all_equal(got["ep"].stats, got["sorted"].stats)
  np.testing.assert_allclose(got["dense"].out, got["sorted"].out, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("ctx_name", ["fp32", "qat_guided"])
def test_tile_layout_ffn_matches_ragged_dot(moe_case, ctx_name):
  """The sorted path on CPU runs the whole expert FFN in the tiled dispatch's padded layout (_tiled_expert_ffn);
  its outputs, per-row stats and gradients are lax.ragged_dot's (dispatch='ragged'), with guidance matched by
  expert and an expert the rollout did not run. A skewed routing puts most rows on one expert, so groups span
  several tiles and some tiles are padding."""
  p, x, ids = moe_case
  ctx = {"fp32": FP32, "qat_guided": GUIDED32}[ctx_name]
  rollout_ids = ids.copy()
  rollout_ids[::4, 0] = [min(set(range(TINY.num_experts)) - set(row)) for row in ids[::4]]
  guidance = {"moe_hidden": hidden_guidance("full")} if ctx.quant else {}
  gids = jnp.asarray(rollout_ids) if ctx.quant else None
  skew = dataclasses.replace(p, router=p.router.at[:, 0].add(3.0))

  def run(p, x, dispatch):
    return moe.moe_block(p, x, TINY, ctx, guidance, guidance_ids=gids, dispatch=dispatch)

  assert moe.grouped_dot_impl("tiled") == "tiled"
  for params in (p, skew):
    got, want = (jax.jit(run, static_argnums=2)(params, x, d) for d in ("tiled", "ragged"))
    np.testing.assert_allclose(got.out, want.out, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_equal(got.stats, want.stats)
    loss = lambda d: lambda p, x: jnp.sum(jnp.sin(run(p, x, d).out))
    g_tiled, g_ragged = (jax.jit(jax.grad(loss(d), argnums=(0, 1)))(params, x) for d in ("tiled", "ragged"))
    chex.assert_trees_all_close(g_tiled, g_ragged, rtol=1e-4, atol=1e-5)
  counts = np.bincount(np.asarray(run(skew, x, "tiled").topk_ids).ravel(), minlength=TINY.num_experts)
  assert counts.max() > moe.tile_rows(ids.size, TINY.num_experts)  # a group spans more than one tile


def test_rows_without_guidance_round_to_nearest():
  """QatContext.guided_activation with `found`: found rows are guided and counted as without it; the others are
  rounded to nearest on their own scales and not counted."""
  x = jax.random.normal(jax.random.key(11), (6, 32))
  g = quantizer.make_guidance(x * 1.3 + 0.1, form="full")[0]
  found = jnp.asarray([1, 0, 1, 1, 0, 1], bool)
  run = jax.jit(GUIDED32.guided_activation, static_argnums=(1, 3))
  values, stats = run(x, "experts", g, MOE_HIDDEN, found)
  guided, guided_stats = run(x, "experts", g, MOE_HIDDEN)
  rtn = quantizer.fake_quant(x)[0]
  np.testing.assert_array_equal(values, jnp.where(found[:, None], guided, rtn))
  assert np.any(np.asarray(guided != rtn)[~np.asarray(found)])  # the case is not vacuous
  want = jax.tree_util.tree_map(lambda a: jnp.where(found, a, 0), guided_stats)
  chex.assert_trees_all_equal(stats, want)
  assert int(stats.total.sum()) == 4 * 32


def test_routing_replay_path_ignores_guidance_ids(params, batch):
  """With R3 the trainer runs the rollout's experts in the rollout's order, so guidance rows line up slot by slot and
  the forward ignores `guidance_ids` (the R3 path is unchanged); without replay they decide which row is whose."""
  guidance = random_guidance(TINY, jax.random.key(2))
  _, aux = fwd(params, *batch, TINY, GUIDED32, guidance)
  replay = aux.topk_ids
  reversed_ids = tuple(ids[..., ::-1] for ids in replay)
  want = fwd(params, *batch, TINY, GUIDED32, guidance, replay_ids=replay)
  got = fwd(params, *batch, TINY, GUIDED32, guidance, replay_ids=replay, guidance_ids=reversed_ids)
  chex.assert_trees_all_equal(got, want)
  _, unreplayed = fwd(params, *batch, TINY, GUIDED32, guidance, guidance_ids=reversed_ids)
  assert int(unreplayed.quant_stats[0]["moe_hidden"].bit_matches) != int(aux.quant_stats[0]["moe_hidden"].bit_matches)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_route_matches_numpy(norm_topk_prob):
  config = dataclasses.replace(TINY, norm_topk_prob=norm_topk_prob)
  logits = np.asarray(jax.random.normal(jax.random.key(3), (16, TINY.num_experts)))
  ids, weights = moe.route(jnp.asarray(logits), config, None)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  want_ids = np.argsort(-probs, axis=-1)[:, : TINY.num_experts_per_tok]
  want = np.take_along_axis(probs, want_ids, -1)
  if norm_topk_prob:
    want = want / want.sum(-1, keepdims=True)
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_allclose(weights, want, rtol=1e-6)


def test_norm_topk_prob_changes_logits(params, batch):
  on, _ = fwd(params, *batch, TINY)
  off, _ = fwd(params, *batch, dataclasses.replace(TINY, norm_topk_prob=False))
  assert np.abs(on - off).max() > 1e-3


def test_shared_expert_adds_gated_mlp():
  config = dataclasses.replace(TINY, shared_expert_intermediate_size=32)
  p = model.init_params(config, jax.random.key(4)).layers[0].mlp
  x = jax.random.normal(jax.random.key(5), (10, config.hidden_size))
  with_shared = moe.moe_block(p, x, config, FP32, {}).out
  without = moe.moe_block(dataclasses.replace(p, shared=None, shared_gate=None), x, config, FP32, {}).out
  gated = jax.nn.sigmoid(x @ p.shared_gate) * moe.mlp(p.shared, x, FP32, "shared_expert")
  assert np.abs(with_shared - without).max() > 1e-3
  np.testing.assert_allclose(with_shared - without, gated, atol=1e-6)


def test_shared_expert_forward(batch):
  config = dataclasses.replace(TINY, shared_expert_intermediate_size=32)
  p = model.init_params(config, jax.random.key(4))
  logits, _ = fwd(p, *batch, config)
  layers = tuple(
    dataclasses.replace(layer, mlp=dataclasses.replace(layer.mlp, shared=None, shared_gate=None)) for layer in p.layers
  )
  without, _ = fwd(dataclasses.replace(p, layers=layers), *batch, config)
  assert np.isfinite(logits).all() and np.abs(logits - without).max() > 1e-3


@pytest.mark.parametrize(
  "overrides, moe_layers",
  [(dict(mlp_only_layers=(0,)), (1,)), (dict(decoder_sparse_step=2), (1,)), (dict(mlp_only_layers=(1,)), (0,))],
)
def test_dense_layers(batch, overrides, moe_layers):
  config = dataclasses.replace(TINY, intermediate_size=48, **overrides)
  assert config.moe_layers == moe_layers
  p = model.init_params(config, jax.random.key(6))
  logits, aux = fwd(p, *batch, config)
  for i, layer in enumerate(p.layers):
    assert isinstance(layer.mlp, moe.MoEParams if i in moe_layers else moe.MLPParams)
    assert layer.mlp.gate.shape == ((8, 64, 32) if i in moe_layers else (64, 48))
    assert (aux.router_logits[i] is None) == (i not in moe_layers)
  assert np.isfinite(logits).all() and np.isfinite(aux.aux_loss)


def test_sparse_step_selects_layers():
  config = dataclasses.replace(TINY, num_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,), intermediate_size=48)
  assert config.moe_layers == (1, 5)


@pytest.mark.parametrize(
  "make, field",
  [
    (lambda: dataclasses.replace(TINY, num_experts_per_tok=9), "model.num_experts_per_tok"),
    (lambda: dataclasses.replace(TINY, num_experts_per_tok=0), "model.num_experts_per_tok"),
    (lambda: dataclasses.replace(TINY, num_heads=6, num_kv_heads=4), "model.num_heads"),
    (lambda: dataclasses.replace(TINY, head_dim=33), "model.head_dim"),
    (lambda: dataclasses.replace(TINY, mlp_only_layers=(5,)), "model.mlp_only_layers"),
    (lambda: dataclasses.replace(TINY, mlp_only_layers=(0,)), "model.intermediate_size"),
    (
      lambda: QuantConfig().check_dims(dataclasses.replace(TINY, moe_intermediate_size=24)),
      "model.moe_intermediate_size",
    ),
    (lambda: QuantConfig().check_dims(dataclasses.replace(TINY, head_dim=40)), "model.head_dim"),
    (
      lambda: QuantConfig(fmt="mxfp4").check_dims(dataclasses.replace(TINY, moe_intermediate_size=48)),
      "model.moe_intermediate_size",
    ),
    (lambda: QuantConfig(targets=("experts", "lm_head")), "quant.targets"),
    (lambda: QuantConfig(fmt="nvfp8"), "quant.fmt"),
    (lambda: section(QuantConfig, {"fmt": "nvfp4", "target": ["kv"]}, "quant"), "quant.target"),
  ],
)
def test_config_errors_name_the_field(make, field):
  with pytest.raises(ConfigError, match=rf"config\.{field}\b"):
    make()


def test_quant_dims_pass_on_tiny():
  QuantConfig().check_dims(TINY)
  QuantConfig(targets=("experts", "kv", "attention")).check_dims(TINY)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_grads_flow_through_qat(batch, dtype):
  tokens, mask = batch
  config = dataclasses.replace(TINY, num_layers=1)  # one layer has every quantized tensor; compiles faster
  params = model.init_params(config, jax.random.key(8))
  ctx = qat.QatContext(QuantConfig(targets=("experts", "kv", "attention")), guided=True, compute_dtype=dtype)
  guidance = random_guidance(config, jax.random.key(7))

  @jax.jit
  @jax.value_and_grad
  def loss_and_grad(p):
    logits, aux = model.forward(p, tokens, mask, config, ctx=ctx, guidance=guidance)
    logp = model.token_logprobs(logits[:, :-1], tokens[:, 1:])
    m = mask[:, 1:].astype(jnp.float32)
    return -jnp.sum(logp * m) / jnp.sum(m) + config.router_aux_loss_coef * aux.aux_loss

  loss, grads = loss_and_grad(params)
  assert np.isfinite(loss)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    name = jax.tree_util.keystr(path)
    assert np.isfinite(g).all(), name
    assert np.abs(g).max() > 0, f"zero gradient for {name}"


def test_aux_loss_matches_transformers(params, batch):
  tokens, mask = batch
  for m in (mask, jnp.ones_like(mask)):
    _, aux = fwd(params, tokens, m, TINY)
    gate_logits = tuple(torch.tensor(np.asarray(r).reshape(B * S, -1)) for r in aux.router_logits)
    attention_mask = None if bool(m.all()) else torch.tensor(np.asarray(m))
    want = load_balancing_loss_func(gate_logits, TINY.num_experts, TINY.num_experts_per_tok, attention_mask)
    np.testing.assert_allclose(aux.aux_loss, want.item(), rtol=1e-6)


# --- grouped_dot: the CPU dispatches against lax.ragged_dot ----------------------------------


@pytest.mark.parametrize(
  "sizes",
  [
    [8] * 16,  # balanced: the smallest capacity bucket
    [0, 0, 40, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 0, 0, 0],  # one large group: the middle bucket
    [128] + [0] * 15,  # every row in one group: the last bucket
    [3, 0, 5, 1] + [0] * 12,  # rows past sum(group_sizes) give zeros
  ],
)
@pytest.mark.parametrize("impl", ["tiled", "capacity"])
def test_grouped_dot_matches_ragged_dot(impl, sizes):
  rows, k, n = 128, 64, 32
  x = jax.random.normal(jax.random.key(0), (rows, k))
  w = jax.random.normal(jax.random.key(1), (16, k, n))
  gs = jnp.asarray(sizes, jnp.int32)
  ref = np.asarray(jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32))
  f = jax.jit(lambda x, w, gs, t: moe.grouped_dot(x, jnp.swapaxes(w, 1, 2) if t else w, gs, transpose_w=t, impl=impl),
              static_argnums=3)  # fmt: skip
  for transpose_w in (False, True):
    got = np.asarray(f(x, w, gs, transpose_w))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert np.all(got[int(sum(sizes)) :] == 0)
  if impl == "tiled":  # the trainer's: its gradients are ragged_dot's
    loss = lambda impl_: lambda x, w: jnp.sum(jnp.sin(moe.grouped_dot(x, w, gs, impl=impl_)))
    got = jax.jit(jax.grad(loss("tiled"), argnums=(0, 1)))(x, w)
    want = jax.grad(loss("ragged"), argnums=(0, 1))(x, w)
    for a, b in zip(got, want):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_grouped_dot_picks_by_backend_and_refuses_unknown_impls():
  assert moe.grouped_dot_impl("auto") == ("ragged" if jax.default_backend() == "tpu" else "tiled")
  want = {"cpu": "capacity", "tpu": "ragged"}.get(jax.default_backend(), "tiled")
  assert moe.grouped_dot_impl("auto", inference=True) == want
  with gpu_compile.as_hopper():  # XLA:GPU's ragged_dot is a dense [G, M, K] matmul: the tiled layout there
    assert moe.grouped_dot_impl("auto") == moe.grouped_dot_impl("auto", inference=True) == "tiled"
  with pytest.raises(ValueError, match="impl must be one of"):
    moe.grouped_dot_impl("megablox")
