"""The FP4 rollout engine: weight sync, prefill, KV-cache decode, sampling, recording.

A separate execution path from the trainer's `model.forward`, computing the way inference
engines do: a bf16 residual stream and bf16 activations, RMSNorm in fp32 returning bf16,
bf16 RoPE tables, routed-expert weights stored packed FP4 (codes + block scales), expert
activations quantized online with RTN (NVFP4 optionally two-level, the tensor scale from each
call's batch), an FP4 KV cache (packed codes + scales per token and head) and decode attention
over the cached K/V with its own fp32 softmax.

Where FP4 values are used. With a Pallas kernel (GPU) the packed experts are decoded inside
the grouped matmul and the KV cache is decoded where attention reads it. On Hopper the experts
are packed at weight sync as the Mosaic kernel's wgmma fragments (`expert_layout`,
`weight_sync(..., expert_layout='fragments')`; pallas_kernels/fp4_mosaic.py), elsewhere the Triton
kernel reads the codes and scales as stored (`with_expert_layout` converts between the forms). Where there is no FP4
arithmetic (`pallas_kernels.select_impl` gives 'reference': CPU, or matmul_impl='reference'),
FP4 storage is decoded once instead of at every use: the experts once per `generate` (once per
weight sync) and each K/V slot once, when it is written, into a cache of its decoded values kept
beside the codes. The values are the same (an E2M1 code times an E4M3 or E8M0 scale is exact in
bf16; two-level weights decode to fp32), so this changes the cost, not the numerics. It returns the sampled tokens, their rollout
log-probs, per-layer top-k expert ids (routing replay) and the compact TRACE guidance,
laid out by sequence position so the trainer consumes it directly.

This module holds engine numerics only: what it returns (RolloutResult) and how the trainer
reads it are in experience.py; running it on a mesh, and weight sync across meshes, in cluster.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import pallas_kernels
from trace_jax import attention, deltanet, fp4, moe, qat
from trace_jax.config import (
  KEY,
  MOE_HIDDEN,
  MOE_INPUT,
  VALUE,
  ConfigError,
  ModelConfig,
  QuantConfig,
  RolloutConfig,
  SamplingConfig,
)
from trace_jax.deltanet import DeltaNetParams, DeltaNetState
from trace_jax.experience import RolloutResult, guidance_bytes_per_token
from trace_jax.expert_parallel import ExpertParallel, experts
from trace_jax.model import LayerParams, Params, policy_logits
from trace_jax.moe import MLPParams, MoEParams, route
from trace_jax.quantizer import guidance_from_quantized
from trace_jax.sharding import param_field

# --- parameters and weight sync -----------------------------------------------------------


# Routed experts [E, N, K] as the engine holds them: codes + scales (weight sync), the Mosaic
# kernel's fragments (packed at weight sync on Hopper) or values (decoded, or the BF16 engine).
PackedExperts = fp4.QuantizedArray | pallas_kernels.mosaic.FragmentWeight | jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EngineMoE:
  """Routed experts in the engine layout [E, N, K] (rows = outputs, blocks along K).

  gate/up: [E, I, H] and down: [E, H, I], as fp4.QuantizedArray (FP4 engine) or bf16 (the BF16
  engine); on Hopper FP4 experts are the Mosaic kernel's FragmentWeights, gate and up as one
  [E, 2I, H] weight in `gate` (`weight_sync(..., expert_layout='fragments')`). `generate` brings
  them to its backend's form (`expert_layout`, `with_expert_layout`): decoded once where there is
  no FP4 matmul.
  """

  router: jax.Array = param_field("embed", None)
  gate: PackedExperts = param_field("experts", "mlp", "embed")
  up: PackedExperts | None = param_field("experts", "mlp", "embed")  # None: gate holds gate and up
  down: PackedExperts = param_field("experts", "embed", "mlp")
  shared: MLPParams | None = None
  shared_gate: jax.Array | None = param_field("embed", None, default=None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EngineParams:
  """The engine's weights in bf16, routed experts packed. Layers are model.LayerParams with an
  EngineMoE (or a dense MLPParams) as their mlp."""

  embed: jax.Array = param_field("vocab", "embed")
  layers: tuple[LayerParams, ...]
  final_norm: jax.Array = param_field("norm")
  lm_head: jax.Array = param_field("embed", "vocab")  # [H, V]


def weight_sync(
  params: Params, quant: QuantConfig | None, dtype=jnp.bfloat16, expert_layout: str = "codes"
) -> EngineParams:
  """The engine's weights from the trainer's fp32 master weights (after every optimizer step).

  FP4 targets are quantized with RTN from the fp32 masters, blocks along the contraction
  axis, so their codes equal the trainer's fake-quant codes by construction; everything
  else is cast to bf16. expert_layout (`expert_layout(...)` of the engine that will run them):
  'fragments' packs the routed experts for the Mosaic kernel here, at weight sync, so that the
  engine holds one copy of them; 'codes' and 'values' keep the codes and scales (an engine without
  FP4 arithmetic decodes them once per `generate`: values would move 16 bits per weight, not 4.5).
  """
  if expert_layout not in EXPERT_LAYOUTS:
    raise ValueError(f"weight_sync: unknown expert_layout {expert_layout!r}; expected one of {EXPERT_LAYOUTS}.")
  cast = lambda t: jax.tree_util.tree_map(lambda a: a.astype(dtype), t)
  num_layers = len(params.layers)

  def pack_experts(w, quant):  # [E, K, N] (trainer) -> [E, N, K] packed
    w = jnp.swapaxes(w, 1, 2)
    on = quant is not None and quant.quantizes("experts") and quant.weights
    return fp4.quantize(w, quant.fmt) if on else w.astype(dtype)

  def mlp(p: MLPParams, target):
    return cast(MLPParams(*(rtn.weight(w, target) for w in (p.gate, p.up, p.down))))

  layers = []
  for i, layer in enumerate(params.layers):
    layer_quant = None if quant is None else quant.at_layer(i, num_layers)  # None: a BF16 layer
    rtn = qat.QatContext(layer_quant)  # RTN fake-quant, for targets the engine keeps as bf16 values
    a = layer.attn
    if isinstance(a, DeltaNetParams):  # blocks along the contraction axis, as model.linear_attention_block
      axes = {"q": 0, "k": 0, "v": 0, "z": 0, "b": 0, "a": 0, "out": 1}
      attn = dataclasses.replace(a, **{n: rtn.weight(getattr(a, n), "linear_attention", ax) for n, ax in axes.items()})
      # the decay's parameters stay fp32, as engines keep them (g = -exp(A_log) softplus(a + dt_bias))
      attn = dataclasses.replace(
        cast(attn), a_log=attn.a_log.astype(jnp.float32), dt_bias=attn.dt_bias.astype(jnp.float32)
      )
    else:  # blocks along the contraction axis, as model.attention_block fake-quantizes them
      axes = {"q": 0, "k": 0, "v": 0, "o": 1} | ({"gate": 0} if a.gate is not None else {})
      attn = cast(dataclasses.replace(a, **{n: rtn.weight(getattr(a, n), "attention", ax) for n, ax in axes.items()}))
    if isinstance(layer.mlp, MoEParams):
      m = layer.mlp
      shared = None if m.shared is None else mlp(m.shared, "shared_expert")
      expert_weights = tuple(pack_experts(w, layer_quant) for w in (m.gate, m.up, m.down))
      shared_gate = None if m.shared_gate is None else cast(m.shared_gate)
      engine_mlp = EngineMoE(cast(m.router), *expert_weights, shared, shared_gate)
    else:
      engine_mlp = mlp(layer.mlp, "dense_mlp")
    layers.append(LayerParams(cast(layer.input_norm), attn, cast(layer.post_attn_norm), engine_mlp))
  lm_head = params.embed.T if params.lm_head is None else params.lm_head
  engine = EngineParams(cast(params.embed), tuple(layers), cast(params.final_norm), cast(lm_head))
  return with_expert_layout(engine, "fragments", dtype) if expert_layout == "fragments" else engine


# --- the packed-weight matmul (one entry point; the Pallas kernel plugs in here) ----------


def grouped_matmul(x: jax.Array, w: PackedExperts, group_sizes: jax.Array | None, impl: str = "auto"):
  """x [M, K] (rows sorted by group) times w[g] [N, K]^T -> [M, N] in x's dtype, fp32 accumulation.
  group_sizes=None: every group has M / E rows (expert parallel's dense exchange).

  Packed FP4 weights (codes or fragments, see `expert_layout`) go through
  `pallas_kernels.grouped_packed_matmul`, the equal groups of the expert-parallel exchange included
  (never decoded to memory first): a Pallas kernel on GPU with impl='auto' (logged once), its jnp
  reference elsewhere. Decoded bf16 weights go through the same family's Triton kernel on GPU
  (`pallas_kernels.grouped_bf16_matmul`, the FP4 kernels' bf16 baseline: no weight gather, and not XLA:GPU's
  `lax.ragged_dot`, a dense matmul over every expert); other decoded weights, and every weight off GPU, through
  `moe.grouped_dot` (`grouped_dot_impl`: capacity buckets on CPU, row tiles on GPU, `lax.ragged_dot` on TPU).
  """
  packed = isinstance(w, (fp4.QuantizedArray, pallas_kernels.mosaic.FragmentWeight))
  if not packed and (
    w.dtype != jnp.bfloat16
    or pallas_kernels.select_impl(impl, "grouped_bf16_matmul", mosaic_kernel=False) == "reference"
  ):
    return moe.grouped_dot(x.astype(w.dtype), w, group_sizes, transpose_w=True, inference=True).astype(x.dtype)
  if group_sizes is None:
    group_sizes = jnp.full((w.shape[0],), x.shape[0] // w.shape[0], jnp.int32)
  if packed:
    return pallas_kernels.grouped_packed_matmul(x, group_sizes, w, impl=impl)
  return pallas_kernels.grouped_bf16_matmul(x, group_sizes, w, out_dtype=x.dtype)


def _decoded(w: fp4.QuantizedArray, dtype) -> jax.Array:
  """Packed experts [E, N, K] as values: in `dtype` when exact there (single-level scales), else fp32."""
  if w.tensor_scale is not None:  # a per-expert tensor scale broadcasts over [E, N, blocks]
    w = dataclasses.replace(w, tensor_scale=jnp.asarray(w.tensor_scale, jnp.float32).reshape(-1, 1, 1))
    return fp4.dequantize(w, jnp.float32)
  return fp4.dequantize(w, dtype)


EXPERT_LAYOUTS = ("values", "codes", "fragments")


def expert_layout(rollout_config: RolloutConfig, model_config: ModelConfig) -> str:
  """How `generate` holds the packed routed experts: 'values' (decoded once: no FP4 arithmetic on
  this backend; the KV cache is then decoded once per slot too), 'codes' (the `QuantizedArray`s of weight sync: the Triton kernel) or 'fragments'
  (`FragmentWeight`s: the Mosaic kernel, Hopper, NVFP4, N a multiple of 64 and K of 128; with
  matmul_impl='auto' other cases fall back to 'codes', with 'mosaic' they are an error)."""
  impl = pallas_kernels.select_impl(rollout_config.matmul_impl, "rollout.generate")
  if impl == "reference":
    return "values"
  if impl != "mosaic":
    return "codes"
  quant, h, i = rollout_config.quant, model_config.hidden_size, model_config.moe_intermediate_size
  if not pallas_kernels.is_hopper():
    why = f"the Mosaic kernel needs an sm_90 GPU (H100 / H200); this device is {jax.devices()[0].device_kind}"
  elif quant is None or not (quant.quantizes("experts") and quant.weights) or not model_config.num_experts:
    why = "there are no FP4 routed experts"
  else:
    unsupported = functools.partial(pallas_kernels.mosaic.unsupported, quant.format.name)
    why = unsupported(2 * i, h) or unsupported(h, i)  # gate and up as one [2I, H] weight; down [H, I]
  if why is None:
    return "fragments"
  if rollout_config.matmul_impl == "mosaic":
    raise ConfigError(f"config.quant.matmul_impl = 'mosaic': {why}. Use 'auto' or 'pallas'.")
  return "codes"


def with_expert_layout(params: EngineParams, layout: str, dtype) -> EngineParams:
  """The engine's params with their packed routed experts in `layout` (`expert_layout`), whichever
  form they come in: 'values' decodes them (in `dtype`; see the module doc), 'codes' gives the
  `QuantizedArray`s, 'fragments' the Mosaic kernel's `FragmentWeight`s, gate and up as one weight
  [E, 2I, H] in `gate` (`up` None: one call reads x once for both). Codes and fragments are
  permutations of the same 4.5 bits per weight (`pack_fragments` / `unpack_fragments`), with the
  same values. bf16 experts (the BF16 engine) stay as they are ('values': cast to `dtype`)."""
  mosaic = pallas_kernels.mosaic

  def codes(w):
    return mosaic.unpack_fragments(w) if isinstance(w, mosaic.FragmentWeight) else w

  def convert(m: EngineMoE) -> EngineMoE:
    if not isinstance(m.gate, (fp4.QuantizedArray, mosaic.FragmentWeight)):  # bf16 experts
      cast = lambda w: None if w is None else w.astype(dtype)
      return dataclasses.replace(m, gate=cast(m.gate), up=cast(m.up), down=cast(m.down)) if layout == "values" else m
    if layout == "fragments":
      if isinstance(m.gate, mosaic.FragmentWeight):
        return m
      if m.gate.tensor_scale is not None:  # weight sync gives none; gate and up would need one scale
        raise ValueError("with_expert_layout: experts with a tensor scale cannot be packed as fragments.")
      gate_up = (
        m.gate if m.up is None else jax.tree_util.tree_map(lambda g, u: jnp.concatenate([g, u], 1), m.gate, m.up)
      )
      return dataclasses.replace(m, gate=mosaic.pack_fragments(gate_up), up=None, down=mosaic.pack_fragments(m.down))
    gate, up, down = (None if w is None else codes(w) for w in (m.gate, m.up, m.down))
    if layout == "values":
      gate, up, down = (None if w is None else _decoded(w, dtype) for w in (gate, up, down))
    return dataclasses.replace(m, gate=gate, up=up, down=down)

  if layout not in EXPERT_LAYOUTS:
    raise ValueError(f"with_expert_layout: unknown layout {layout!r}; expected one of {EXPERT_LAYOUTS}.")
  layers = (
    dataclasses.replace(layer, mlp=convert(layer.mlp)) if isinstance(layer.mlp, EngineMoE) else layer
    for layer in params.layers
  )
  return dataclasses.replace(params, layers=tuple(layers))


# --- the KV cache -------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """One layer's cache.

  k / v: the FP4 cache, packed codes + scales per token and head [B, T, KV, D / 2] (None for a
  bf16 cache). k_values [B, KV, D, T] / v_values [B, KV, T, D]: values in the layouts attention's two
  matmuls read (keys with the slots last: XLA:CPU runs q . K^T over [T, D] keys about 9x slower than over
  [D, T] ones once the cache outgrows the processor's caches, docs/performance.md), in the
  engine's carrier dtype: the bf16 cache, or the FP4 cache decoded once slot by slot (None when
  attention decodes the packed cache at every step, the path of backends with FP4 arithmetic).
  """

  k: fp4.QuantizedArray | None = param_field("batch", "cache_sequence", "kv_heads", "head_dim", default=None)
  v: fp4.QuantizedArray | None = param_field("batch", "cache_sequence", "kv_heads", "head_dim", default=None)
  k_values: jax.Array | None = param_field("batch", "kv_heads", "head_dim", "cache_sequence", default=None)
  v_values: jax.Array | None = param_field("batch", "kv_heads", "cache_sequence", "head_dim", default=None)


def init_cache(
  config: ModelConfig,
  batch: int,
  length: int,
  quant: QuantConfig | None,
  dtype,
  decoded: bool = True,
  packed_layers=None,
) -> tuple[KVCache | DeltaNetState, ...]:
  """Empty caches for every layer: a KVCache for full attention, a DeltaNetState (conv history and
  fp32 recurrent state) for a Gated DeltaNet layer. dtype: the engine's compute dtype; the K/V values
  are held in its carrier (`carrier_dtype`). decoded=False keeps an FP4 cache packed only (attention
  decodes it at every step). packed_layers (with decoded): the layers whose FP4 cache also keeps its
  packed codes, for the guidance or the diagnostics that read them (`kv_code_layers`); the others hold
  the FP4 values only (the same numbers, without writing the codes). None: every FP4 layer."""
  caches = _kv_caches(config, batch, length, quant, dtype, decoded, packed_layers)
  state = deltanet.init_state(config, batch, dtype) if config.linear_layers else None
  return tuple(state if i in config.linear_layers else cache for i, cache in enumerate(caches))


def kv_code_layers(rollout_config: RolloutConfig, model_config: ModelConfig) -> tuple[int, ...]:
  """The layers whose packed K/V codes `generate` reads back: every layer with record_codes (the
  diagnostics), else the guided layers when the guidance names K or V."""
  if rollout_config.record_codes:
    return tuple(range(model_config.num_layers))
  if not {KEY, VALUE} & set(rollout_config.guided_tensors):
    return ()
  return tuple(rollout_config.guided_layers)


def _kv_caches(
  config: ModelConfig, batch: int, length: int, quant: QuantConfig | None, dtype, decoded: bool, packed_layers=None
):
  """One KVCache a layer: packed FP4 (+ decoded values unless not `decoded`) where the layer's KV is FP4,
  else values only (BF16, or FP8 values rounded as they are written: `_cache_update`)."""
  dtype = carrier_dtype(dtype)
  keys = jnp.zeros((batch, config.num_kv_heads, config.head_dim, length), dtype)
  values = jnp.zeros((batch, config.num_kv_heads, length, config.head_dim), dtype)
  if quant is None or not quant.fp4_kv:
    return tuple(KVCache(None, None, keys, values) for _ in range(config.num_layers))
  shape = (batch, length, config.num_kv_heads, config.head_dim)
  fmt = quant.format
  packed = fp4.QuantizedArray(
    jnp.zeros((*shape[:-1], shape[-1] // 2), jnp.uint8),
    jnp.zeros((*shape[:-1], shape[-1] // fmt.block_size), fmt.scale_dtype),
    jnp.zeros(shape[:-1], jnp.float32) if quant.two_level else None,  # each slot keeps its step's scale
    fmt,
  )
  bf16 = quant.bf16_layer_set(config.num_layers)
  fp4_cache = KVCache(packed, packed, keys if decoded else None, values if decoded else None)
  values_only = KVCache(None, None, keys, values)  # BF16 values, or (decoded, codes unread) FP4 values
  unpacked = set() if not decoded or packed_layers is None else set(range(config.num_layers)) - set(packed_layers)
  return tuple(values_only if i in bf16 or i in unpacked else fp4_cache for i in range(config.num_layers))


def _write(buffer, value, start):
  """Write `value` [B, S, ...] into `buffer` [B, T, ...] at slot `start` (leaves of a pytree).

  One-byte floats (FP8 block scales) are written as their bits: XLA:CPU would run the update through
  fp32 and copy the whole buffer at every step.
  """

  def write(b, v):
    v = v.astype(b.dtype)
    if b.dtype.itemsize == 1 and jnp.issubdtype(b.dtype, jnp.floating):
      bits = jax.lax.dynamic_update_slice_in_dim(
        jax.lax.bitcast_convert_type(b, jnp.uint8), jax.lax.bitcast_convert_type(v, jnp.uint8), start, axis=1
      )
      return jax.lax.bitcast_convert_type(bits, b.dtype)
    return jax.lax.dynamic_update_slice_in_dim(b, v, start, axis=1)

  return jax.tree_util.tree_map(write, buffer, value)


def _quantize_online(x: jax.Array, quant: QuantConfig, values_dtype=None):
  """RTN of an activation or K/V as engines quantize online. Two-level NVFP4: the tensor scale is
  the amax of this call's batch (the prefill, or one decode step), kept once per row, so that
  rows quantized in different calls (the KV cache's slots, the recorded guidance) keep theirs.
  Per-token: the amax of each row, kept with it.
  values_dtype given: returns (QuantizedArray, its values in that dtype)."""
  amax = qat.tensor_amax(x, quant)
  q, values = fp4.quantize_with_values(x, quant.fmt, tensor_amax=amax, dtype=values_dtype or jnp.float32)
  if quant.two_level:
    q = dataclasses.replace(q, tensor_scale=jnp.broadcast_to(q.tensor_scale, q.scales.shape[:-1]))
  return q if values_dtype is None else (q, values)


def _store(x: jax.Array, quant: QuantConfig | None):
  """What the cache stores for new K or V [B, S, KV, D]: FP4 RTN, FP8 E4M3 values, or x as it is."""
  if quant is not None and quant.fp4_kv:
    return _quantize_online(x, quant)
  if quant is not None and quant.quantizes("kv"):  # kv_format='fp8_e4m3'
    return fp4.e4m3_round(x)
  return x


def carrier_dtype(dtype) -> jnp.dtype:
  """The dtype the KV cache's values are held in: the compute dtype, except on XLA:CPU, where bf16
  values are held in fp32 (exactly: bf16 is fp32 with fewer mantissa bits). XLA:CPU runs bf16
  dynamic-update-slices through fp32 and back (a copy of the whole cache per step); in fp32 they
  run in place. Values are rounded to bf16 where the engine rounds (`_carry`), and a matmul of
  bf16 values in fp32 with fp32 accumulation is the bf16 matmul up to the order of accumulation."""
  dtype = jnp.dtype(dtype)
  return jnp.dtype(jnp.float32) if dtype == jnp.bfloat16 and jax.default_backend() == "cpu" else dtype


def _carry(x: jax.Array, dtype) -> jax.Array:
  """x's values held in `dtype`: a bf16 array in the fp32 carrier is rounded to bf16 explicitly
  (`reduce_precision`), since XLA may keep excess precision through a bf16 -> fp32 convert."""
  if x.dtype == jnp.bfloat16 and dtype == jnp.float32:
    return jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)
  return x.astype(dtype)


def _cache_update(cache: KVCache, k, v, start, st: EngineSettings):
  """Write new K/V [B, S, KV, D] at slot `start`; returns (cache, keys [B, KV, D, T], values [B, KV, T, D]).

  An FP4 cache's new slots are RTN-quantized online, as engines do; their values are taken from the codes
  before packing (`fp4.quantize_with_values`, bit-identical to decoding the packed slots), and the packed
  codes are written only where the cache keeps them (`kv_code_layers`)."""
  carrier = st.carrier
  if st.quant is not None and st.quant.fp4_kv:
    (k_q, k), (v_q, v) = _quantize_online(k, st.quant, st.dtype), _quantize_online(v, st.quant, st.dtype)
    if cache.k is not None:
      cache = dataclasses.replace(cache, k=_write(cache.k, k_q, start), v=_write(cache.v, v_q, start))
    if cache.k_values is None:  # decode the whole cache where attention reads it
      keys = _carry(jnp.transpose(_load(cache.k, st.dtype), (0, 2, 3, 1)), carrier)
      return cache, keys, _carry(jnp.swapaxes(_load(cache.v, st.dtype), 1, 2), carrier)
  else:  # BF16 as it is, or FP8 E4M3 values
    k, v = _store(k, st.quant), _store(v, st.quant)
  # the new slots' values, once: keys as [B, KV, D, S], values as [B, KV, S, D]
  write = lambda buffer, a, axes: jax.lax.dynamic_update_slice_in_dim(
    buffer, _carry(jnp.transpose(a, axes), buffer.dtype), start, axis=axes.index(1)
  )
  cache = dataclasses.replace(
    cache, k_values=write(cache.k_values, k, (0, 2, 3, 1)), v_values=write(cache.v_values, v, (0, 2, 1, 3))
  )
  return cache, cache.k_values, cache.v_values


def _load(stored, dtype) -> jax.Array:
  return fp4.dequantize(stored, dtype) if isinstance(stored, fp4.QuantizedArray) else stored


# --- one layer, for prefill (S = prompt length) and decode (S = 1) --------------------------


@dataclasses.dataclass(frozen=True)
class EngineSettings:
  """What one engine program is compiled for (static under jit): the model, the engine's
  numerics and recording, and the expert-parallel layout of its routed experts."""

  model: ModelConfig
  rollout: RolloutConfig
  expert_parallel: ExpertParallel | None = None

  @property
  def quant(self):
    return self.rollout.quant

  @property
  def dtype(self):
    return jnp.dtype(self.rollout.compute_dtype)

  @property
  def carrier(self):
    return carrier_dtype(self.dtype)

  def at_layer(self, layer: int) -> EngineSettings:
    """The settings of one layer: a layer of `quant.bf16_layers` runs as the BF16 engine's."""
    if self.quant is None or self.quant.at_layer(layer, self.model.num_layers) is not None:
      return self
    bf16 = dataclasses.replace(self.rollout, quant=None, guided_layers=(), record_codes=False)
    return dataclasses.replace(self, rollout=bf16)

  def records(self, layer: int) -> bool:
    quant = self.at_layer(layer).quant
    if quant is None or not quant.quantizes("experts") or not quant.activations:
      return False
    return self.rollout.record_codes or layer in self.rollout.guided_layers


def _dot(x, w):
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _act(x, quant: QuantConfig | None, target: str):
  """Online RTN activation quantization: (values in x's dtype, QuantizedArray or None)."""
  if quant is None or not quant.quantizes(target) or not quant.activations:
    return x, None
  with jax.named_scope("act_quant"):
    q, values = _quantize_online(x, quant, x.dtype)
  return values, q


def _attention(p, x, cache: KVCache, start, positions, slot_mask, st: EngineSettings):
  """Engine attention: write new K/V into the cache at `start`, attend over the cache's slots up to start + S
  (the whole cache where start is traced: decode)."""
  c, quant, dt = st.model, st.quant, st.dtype
  b, s, _ = x.shape
  with jax.named_scope("qkv"):
    xa, _ = _act(x, quant, "attention")
    q = jnp.einsum("bsh,hnd->bsnd", xa, p.q, preferred_element_type=jnp.float32).astype(dt)
    k = jnp.einsum("bsh,hnd->bsnd", xa, p.k, preferred_element_type=jnp.float32).astype(dt)
    v = jnp.einsum("bsh,hnd->bsnd", xa, p.v, preferred_element_type=jnp.float32).astype(dt)
    if p.q_norm is not None:
      norm = lambda a, w: attention.rms_norm(a, w, c.rms_norm_eps, offset=c.norm_offset)
      q, k = norm(q, p.q_norm), norm(k, p.k_norm)
    cos, sin = attention.rope_tables(positions, c.rotary_dim, c.rope_theta, dtype=dt)
    q, k = attention.apply_rope(q, cos, sin), attention.apply_rope(k, cos, sin)
  with jax.named_scope("kv_cache"):
    cache, keys, values = _cache_update(cache, k, v, start, st)  # keys [B, KV, D, T], values [B, KV, T, D]
  # Prefill (a static start): the slots past start + S are masked, so they are not read. The f32 scores
  # [B, KV, G*S, T] of batch 256, 32 heads, prompt 512 are 8.6 GB a layer so, 25.8 GB over a cache of 1536.
  if isinstance(start, int):
    keys, values = keys[..., : start + s], values[:, :, : start + s]
  return _attend(p, xa, q, keys, values, start, slot_mask, st), cache


def _attend(p, xa, q, keys, values, start, slot_mask, st: EngineSettings):
  """Queries [B, S, N, D] over the cache's keys [B, KV, D, T] and values [B, KV, T, D] (slots past a query's
  own masked), then the output projection: [B, S, H]."""
  c, quant, dt = st.model, st.quant, st.dtype
  b, s = q.shape[:2]
  t = values.shape[2]
  groups = c.num_heads // c.num_kv_heads
  with jax.named_scope("scores"):
    # queries [B, KV, groups * S, D]: batch axes first, as the matmuls want them
    qg = q.reshape(b, s, c.num_kv_heads, groups, c.head_dim).transpose(0, 2, 3, 1, 4)
    qg = _carry(qg.reshape(b, c.num_kv_heads, groups * s, c.head_dim), keys.dtype)
    scores = jnp.einsum("bkqd,bkdt->bkqt", qg, keys, preferred_element_type=jnp.float32) * (c.head_dim**-0.5)
    query_slot = jnp.tile(start + jnp.arange(s), groups)  # [groups * S], group-major
    allowed = (jnp.arange(t)[None, :] <= query_slot[:, None])[None] & slot_mask[:, None, :t].astype(bool)
    scores = jnp.where(allowed[:, None], scores, attention.NEG_INF)
    probs = _carry(jax.nn.softmax(scores, axis=-1).astype(dt), values.dtype)
    out = jnp.einsum("bkqt,bktd->bkqd", probs, values, preferred_element_type=jnp.float32).astype(dt)
    out = out.reshape(b, c.num_kv_heads, groups, s, c.head_dim).transpose(0, 3, 1, 2, 4)
    out = out.reshape(b, s, c.num_heads, c.head_dim)
  with jax.named_scope("out"):
    if p.gate is not None:  # gated attention (Qwen3.5)
      gate = jnp.einsum("bsh,hnd->bsnd", xa, p.gate, preferred_element_type=jnp.float32).astype(dt)
      out = out * jax.nn.sigmoid(gate)
    out, _ = _act(out, quant, "attention")
    return jnp.einsum("bsnd,ndh->bsh", out, p.o, preferred_element_type=jnp.float32).astype(dt)


def _mlp(p: MLPParams, x, quant, target):
  xq, _ = _act(x, quant, target)
  h = (jax.nn.silu(_dot(xq, p.gate).astype(jnp.float32)) * _dot(xq, p.up)).astype(x.dtype)
  hq, _ = _act(h, quant, target)
  return _dot(hq, p.down)


def _experts(weights, xs, group_sizes, st: EngineSettings):
  """Packed-FP4 SwiGLU experts on rows grouped by expert: (out rows, hidden QuantizedArray rows | None).

  group_sizes=None: every expert has the same number of rows (expert parallel's dense exchange).
  """
  gate_w, up_w, down_w = weights
  impl = st.rollout.matmul_impl
  if up_w is None:  # gate and up as one weight [E, 2I, H] (`pack_fragments_once`)
    gate_up = grouped_matmul(xs, gate_w, group_sizes, impl)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    gate = gate.astype(jnp.float32)
  else:
    gate = grouped_matmul(xs, gate_w, group_sizes, impl).astype(jnp.float32)
    up = grouped_matmul(xs, up_w, group_sizes, impl)
  h = (jax.nn.silu(gate) * up).astype(st.dtype)
  hq, q_hidden = _act(h, st.quant, "experts")
  return grouped_matmul(hq, down_w, group_sizes, impl), q_hidden


def _fused_capacity(weights, st: EngineSettings) -> bool:
  """Whether the routed experts run as one capacity-bucketed SwiGLU (`_capacity_experts`): the decoded
  weights (gate and up apart) that `grouped_matmul` would send to `moe.grouped_dot`'s capacity buckets
  (XLA:CPU's inference path), so that the tokens are scattered into the buckets once, not around each
  of the three matmuls."""
  gate_w, up_w, down_w = weights
  if up_w is None or not all(isinstance(w, jax.Array) for w in weights):
    return False
  if (
    gate_w.dtype == jnp.bfloat16
    and pallas_kernels.select_impl(st.rollout.matmul_impl, "grouped_bf16_matmul", mosaic_kernel=False) != "reference"
  ):
    return False  # the Triton bf16 kernel (GPU)
  return moe.grouped_dot_impl("auto", inference=True) == "capacity"


def _capacity_experts(weights, xq, ids, st: EngineSettings):
  """The routed SwiGLU of each (token, slot) assignment, for ids [N, k] and rows xq [N, H]: each expert's
  rows go into a bucket [E, C, H] (C picked at run time from `moe.capacity_buckets`, so none is dropped),
  the three batched matmuls and the hidden activation's RTN run on the buckets, and the outputs come
  back in assignment order. Returns (out [N * k, H], hidden QuantizedArray rows [N * k, ...] | None).

  The same numbers as `_experts` over `grouped_matmul` (moe's capacity buckets, row by row: each
  output row is the same dot products, and the hidden activation's rounding is per row, a batch amax
  unchanged by the buckets' zero rows), with one scatter and one gather in place of three of each."""
  gate_w, up_w, down_w = weights
  n, k = ids.shape
  e, dt = gate_w.shape[0], st.dtype
  flat = ids.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
  _, sorted_rank = moe._row_groups(group_sizes, n * k)
  rank = jnp.zeros_like(sorted_rank).at[order].set(sorted_rank)  # each assignment's row in its bucket
  rows = xq[jnp.arange(n * k) // k].astype(gate_w.dtype)
  mm = lambda a, w: jnp.einsum("gck,gnk->gcn", a, w, preferred_element_type=jnp.float32).astype(dt)

  def branch(c):
    def run(rows, gate_w, up_w, down_w):
      buf = jnp.zeros((e, c, rows.shape[1]), rows.dtype).at[flat, rank].set(rows, mode="drop")
      h = (jax.nn.silu(mm(buf, gate_w).astype(jnp.float32)) * mm(buf, up_w)).astype(dt)
      hq, q_hidden = _act(h, st.quant, "experts")
      out = mm(hq.astype(down_w.dtype), down_w)[flat, rank]
      return out, jax.tree_util.tree_map(lambda a: a[flat, rank], q_hidden)

    return run

  buckets = moe.capacity_buckets(n * k, e)
  index = jnp.sum(jnp.asarray(buckets[:-1], jnp.int32) < jnp.max(group_sizes))
  return jax.lax.switch(index, [branch(c) for c in buckets], rows, gate_w, up_w, down_w)


def _moe(p: EngineMoE, x, st: EngineSettings, record: bool):
  """x [N, H] -> (out [N, H], topk ids [N, k], {name: QuantizedArray rows} if record)."""
  c, quant, dt = st.model, st.quant, st.dtype
  n, k = x.shape[0], c.num_experts_per_tok
  with jax.named_scope("router"):
    router_logits = _dot(x, p.router)  # engines keep router logits in the activation dtype
    ids, weights = route(router_logits, c, None)
  xq, q_in = _act(x, quant, "experts")
  hidden = None  # the hidden codes as [N * k] rows: slot j = the token's j-th expert
  if st.expert_parallel is None and _fused_capacity((p.gate, p.up, p.down), st):
    with jax.named_scope("experts"):
      y, hidden = _capacity_experts((p.gate, p.up, p.down), xq, ids, st)
      y = y.reshape(n, k, -1)
  elif st.expert_parallel is None:
    with jax.named_scope("dispatch"):
      flat = ids.reshape(-1)
      order = jnp.argsort(flat, stable=True)
      group_sizes = jnp.bincount(flat, length=c.num_experts).astype(jnp.int32)
      xs = xq[order // k]
    with jax.named_scope("experts"):
      y_sorted, q_hidden = _experts((p.gate, p.up, p.down), xs, group_sizes, st)
    with jax.named_scope("combine"):
      inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k))
      y = y_sorted[inverse].reshape(n, k, -1)
      if record:
        hidden = jax.tree_util.tree_map(lambda a: a[inverse], q_hidden)
  else:  # experts where they live; an engine never drops a token: capacity for the worst case
    layout = st.expert_parallel
    n_ep = dict(layout.mesh.shape).get(layout.expert_axis, 1)
    layout = dataclasses.replace(layout, capacity_factor=max(c.num_experts / k, n_ep))

    def ffn(weights, xs, _payload, group_sizes, _replicated):
      out, q = _experts(weights, xs, group_sizes, st)
      return out, ({"codes": q.codes, "scales": q.scales} if record else {})

    y, rows, _ = experts(layout, ffn, (p.gate, p.up, p.down), xq, ids, None)
    if record:
      hidden = fp4.QuantizedArray(rows["codes"], rows["scales"], None, quant.format)
  with jax.named_scope("combine"):
    out = jnp.sum(weights[..., None] * y.astype(jnp.float32), axis=1).astype(dt)
  if p.shared is not None:
    gate_s = jax.nn.sigmoid(_dot(x, p.shared_gate).astype(jnp.float32))
    out = (out + gate_s * _mlp(p.shared, x, quant, "shared_expert")).astype(dt)
  records = {}
  if record:
    unflatten = lambda a: a.reshape(n, k, *a.shape[1:])
    records = {MOE_INPUT: q_in, MOE_HIDDEN: jax.tree_util.tree_map(unflatten, hidden)}
  return out, ids, records


def _forward(params: EngineParams, tokens, caches, start, positions, slot_mask, st: EngineSettings):
  """Engine forward of tokens [B, S] at cache slots [start, start + S): logits of the last one."""
  b, s = tokens.shape
  c = st.model
  with jax.named_scope("embed"):
    x = params.embed[tokens]  # residual stream in the engine dtype (bf16)
  new_caches, topk, records = [], [], []
  norm = lambda a, w: attention.rms_norm(a, w, c.rms_norm_eps, offset=c.norm_offset)  # fp32 inside, dtype out
  for i, layer in enumerate(params.layers):
    record, st_i = st.records(i), st.at_layer(i)
    h = norm(x, layer.input_norm)
    if isinstance(layer.attn, DeltaNetParams):  # Gated DeltaNet: prefill chunked, decode recurrent
      pads = jax.lax.dynamic_slice_in_dim(slot_mask, start, s, axis=1)
      act = lambda a, quant=st_i.quant: _act(a, quant, "linear_attention")[0]
      attn_out, cache = deltanet.mix(layer.attn, h, c, mask=pads, state=caches[i], dtype=st.dtype, act=act)
      attn_out = attn_out.astype(st.dtype)
    else:
      with jax.named_scope("attention"):
        attn_out, cache = _attention(layer.attn, h, caches[i], start, positions, slot_mask, st_i)
    new_caches.append(cache)
    x = x + attn_out
    h = norm(x, layer.post_attn_norm)
    if isinstance(layer.mlp, EngineMoE):
      with jax.named_scope("moe"):
        out, ids, rec = _moe(layer.mlp, h.reshape(b * s, -1), st_i, record)
      topk.append(ids.reshape(b, s, -1))
      records.append(
        {name: jax.tree_util.tree_map(lambda a: a.reshape(b, s, *a.shape[1:]), q) for name, q in rec.items()}
      )
      x = x + out.reshape(b, s, -1)
    else:
      x = x + _mlp(layer.mlp, h, st_i.quant, "dense_mlp")
      topk.append(None)
      records.append({})
  with jax.named_scope("lm_head"):
    last = norm(x[:, -1], params.final_norm)
    logits = jnp.dot(last, params.lm_head, preferred_element_type=jnp.float32)
  return logits, tuple(new_caches), tuple(topk), tuple(records)


# --- sampling -----------------------------------------------------------------------------


def _argmax(x: jax.Array) -> jax.Array:
  """jnp.argmax over the last axis (the first maximum; int32) as two plain reductions: XLA:CPU runs
  argmax's (value, index) reduction 2-3x slower than a max and a min."""
  first = jnp.where(x == jnp.max(x, axis=-1, keepdims=True), jnp.arange(x.shape[-1]), x.shape[-1])
  return jnp.min(first, axis=-1).astype(jnp.int32)


def sample(logits: jax.Array, keys: jax.Array, cfg: SamplingConfig):
  """Sample one token per row; returns (tokens [B], log-probs [B]).

  The policy's logits (model.policy_logits: temperature, and the ids it never samples masked, as
  the trainer computes them), then top-k and top-p truncation. The log-prob is of the policy
  before truncation (what the trainer recomputes with model.token_logprobs); greedy
  (temperature 0) reports the temperature-1 log-prob.
  """
  scaled = policy_logits(logits, cfg)
  if cfg.temperature == 0:
    tokens = _argmax(scaled)
    return tokens.astype(jnp.int32), jnp.take_along_axis(jax.nn.log_softmax(scaled), tokens[:, None], -1)[:, 0]
  logp = jax.nn.log_softmax(scaled)
  filtered = scaled
  if cfg.top_k:
    kth = jax.lax.top_k(scaled, cfg.top_k)[0][:, -1:]
    filtered = jnp.where(scaled < kth, -jnp.inf, filtered)
  if cfg.top_p < 1:
    sorted_logits = jnp.sort(filtered, axis=-1)[:, ::-1]
    cum = jnp.cumsum(jax.nn.softmax(sorted_logits), axis=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always survives)
    cutoff_index = jnp.sum(cum - jax.nn.softmax(sorted_logits) < cfg.top_p, axis=-1, keepdims=True) - 1
    cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
    filtered = jnp.where(filtered < cutoff, -jnp.inf, filtered)
  # jax.random.categorical's Gumbel-max, with its noise, and the argmax below
  gumbel = jax.vmap(lambda k: jax.random.gumbel(k, filtered.shape[-1:], filtered.dtype))(keys)
  tokens = _argmax(gumbel + filtered)
  return tokens, jnp.take_along_axis(logp, tokens[:, None], -1)[:, 0]


# --- generate -----------------------------------------------------------------------------


def _record_buffers(st: EngineSettings, batch: int, length: int):
  """Zeroed full-code buffers [B, T, ...] for the recorded MoE tensors of each layer."""
  c, fmt = st.model, st.quant.format if st.quant is not None else None
  buffers = []
  for i in range(c.num_layers):
    if not (c.is_moe_layer(i) and st.records(i)):
      buffers.append({})
      continue
    rows = {
      MOE_INPUT: ((batch, length), c.hidden_size),
      MOE_HIDDEN: ((batch, length, c.num_experts_per_tok), c.moe_intermediate_size),
    }
    buffers.append(
      {
        name: fp4.QuantizedArray(
          jnp.zeros((*lead, dim // 2), jnp.uint8),
          jnp.zeros((*lead, dim // fmt.block_size), fmt.scale_dtype),
          jnp.zeros(lead, jnp.float32) if st.quant.two_level else None,
          fmt,
        )
        for name, (lead, dim) in rows.items()
      }
    )
  return tuple(buffers)


def _finish_guidance(st: EngineSettings, buffers, caches):
  """Per-layer guidance in the configured form, and full codes when diagnostics are on."""
  guidance, codes = [], []
  for i in range(st.model.num_layers):
    tensors = dict(buffers[i])
    kv = isinstance(caches[i], KVCache) and caches[i].k is not None  # an FP4 cache
    if kv and (st.rollout.record_codes or i in st.rollout.guided_layers):
      tensors.update({KEY: caches[i].k, VALUE: caches[i].v})
    guided = {n: q for n, q in tensors.items() if n in st.rollout.guided_tensors and i in st.rollout.guided_layers}
    guidance.append({n: guidance_from_quantized(q, st.rollout.guidance_form) for n, q in guided.items()})
    codes.append({n: guidance_from_quantized(q, "full") for n, q in tensors.items()} if st.rollout.record_codes else {})
  return tuple(guidance), tuple(codes)


@functools.partial(jax.jit, static_argnames=("model_config", "rollout_config", "sampling", "expert_parallel"))
def generate(
  params: EngineParams,
  prompts: jax.Array,
  prompt_mask: jax.Array,
  rng: jax.Array,
  *,
  model_config: ModelConfig,
  rollout_config: RolloutConfig,
  sampling: SamplingConfig,
  seq_ids: jax.Array | None = None,
  expert_parallel: ExpertParallel | None = None,
) -> RolloutResult:
  """Prefill left-padded prompts [B, P], then decode up to max_new_tokens with the KV cache.

  Randomness is per sequence: row b draws from fold_in(rng, seq_ids[b]) and the slot, so a
  sequence's sample does not depend on where it sits in the batch. Compiles once per
  (B, P, configs). expert_parallel: the routed experts stay split over its mesh's 'expert'
  axis and the tokens travel to them (never dropped: an engine samples every token).
  """
  st = EngineSettings(model_config, rollout_config, expert_parallel)
  if expert_parallel is not None and rollout_config.quant is not None and rollout_config.quant.two_level:
    raise ConfigError("config.quant.tensor_scale: two-level scaling is not implemented with expert parallelism.")
  if any(i >= model_config.num_layers for i in rollout_config.guided_layers):
    raise ConfigError(
      f"config.rollout.guided_layers: {rollout_config.guided_layers} names layers beyond num_layers = "
      f"{model_config.num_layers}."
    )
  if rollout_config.quant is not None:
    rollout_config.quant.check_dims(model_config)
  b, p = prompts.shape
  total = p + sampling.max_new_tokens
  seq_ids = jnp.arange(b) if seq_ids is None else seq_ids
  row_keys = jax.vmap(lambda i: jax.random.fold_in(rng, i))(seq_ids)
  prompt_mask = prompt_mask.astype(jnp.int32)
  slot_mask = jnp.concatenate([prompt_mask, jnp.ones((b, sampling.max_new_tokens), jnp.int32)], axis=1)
  prompt_positions = attention.positions_from_mask(prompt_mask)
  prompt_len = jnp.sum(prompt_mask, axis=1)

  layout = expert_layout(rollout_config, model_config)
  params = with_expert_layout(params, layout, st.dtype)  # a no-op when weight sync gave this layout
  caches = init_cache(
    model_config,
    b,
    total,
    rollout_config.quant,
    st.dtype,
    decoded=layout == "values",
    packed_layers=kv_code_layers(rollout_config, model_config),
  )
  buffers = _record_buffers(st, b, total)
  topk_buf = tuple(
    jnp.zeros((b, total, model_config.num_experts_per_tok), jnp.int32) if model_config.is_moe_layer(i) else None
    for i in range(model_config.num_layers)
  )

  def record(buffers, topk_buf, topk, records, start):
    buffers = tuple({n: _write(buf[n], rec[n], start) for n in buf} for buf, rec in zip(buffers, records))
    topk_buf = tuple(None if t is None else _write(t, ids, start) for t, ids in zip(topk_buf, topk))
    return buffers, topk_buf

  logits, caches, topk, records = _forward(params, prompts, caches, 0, prompt_positions, slot_mask, st)
  buffers, topk_buf = record(buffers, topk_buf, topk, records, 0)
  keys = jax.vmap(lambda k: jax.random.fold_in(k, p))(row_keys)
  first, first_logp = sample(logits, keys, sampling)
  tokens = jnp.concatenate([prompts, jnp.full((b, sampling.max_new_tokens), sampling.pad_id, jnp.int32)], axis=1)
  tokens = tokens.at[:, p].set(first)
  logprobs = jnp.zeros((b, total), jnp.float32).at[:, p].set(first_logp)
  done = first == sampling.eos_id

  def cond(carry):
    t, done = carry[0], carry[1]
    return (t < total - 1) & ~jnp.all(done)

  def body(carry):
    t, done, tokens, logprobs, caches, buffers, topk_buf = carry
    positions = (prompt_len + t - p)[:, None]
    step_tokens = jax.lax.dynamic_slice_in_dim(tokens, t, 1, axis=1)
    logits, caches, topk, records = _forward(params, step_tokens, caches, t, positions, slot_mask, st)
    buffers, topk_buf = record(buffers, topk_buf, topk, records, t)
    keys = jax.vmap(lambda k: jax.random.fold_in(k, t + 1))(row_keys)
    nxt, nxt_logp = sample(logits, keys, sampling)
    nxt = jnp.where(done, sampling.pad_id, nxt)
    nxt_logp = jnp.where(done, 0.0, nxt_logp)
    tokens = jax.lax.dynamic_update_slice_in_dim(tokens, nxt[:, None], t + 1, axis=1)
    logprobs = jax.lax.dynamic_update_slice_in_dim(logprobs, nxt_logp[:, None], t + 1, axis=1)
    return t + 1, done | (nxt == sampling.eos_id), tokens, logprobs, caches, buffers, topk_buf

  carry = (jnp.asarray(p, jnp.int32), done, tokens, logprobs, caches, buffers, topk_buf)
  _, _, tokens, logprobs, caches, buffers, topk_buf = jax.lax.while_loop(cond, body, carry)

  # response: slots >= P up to and including the first EOS
  generated = tokens[:, p:]
  is_eos = (generated == sampling.eos_id).astype(jnp.int32)
  response = (jnp.cumsum(is_eos, axis=1) - is_eos == 0).astype(jnp.int32)  # up to the first EOS
  response_mask = jnp.concatenate([jnp.zeros_like(prompt_mask), response], axis=1)
  guidance, codes = _finish_guidance(st, buffers, caches)
  return RolloutResult(
    tokens=tokens,
    mask=jnp.concatenate([prompt_mask, response], axis=1),
    response_mask=response_mask,
    logprobs=logprobs * response_mask,
    topk_ids=topk_buf,
    guidance=guidance,
    codes=codes,
    guidance_bytes_per_token=sum(guidance_bytes_per_token(guidance).values()),
  )


def decode_step(
  params: EngineParams,
  tokens,
  caches,
  start,
  positions,
  slot_mask,
  *,
  model_config,
  rollout_config,
  expert_parallel: ExpertParallel | None = None,
):
  """One engine step of tokens [B, S] at cache slots [start, start + S) (S = 1: a decode step).

  Returns (logits of the last token [B, V], caches, per-layer top-k ids, per-layer records).
  """
  st = EngineSettings(model_config, rollout_config, expert_parallel)
  return _forward(params, tokens, caches, start, positions, slot_mask, st)
