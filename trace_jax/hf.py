"""Hugging Face checkpoints in and out: config.json + *.safetensors <-> (ModelConfig, Params).

Supported architectures: `Qwen3MoeForCausalLM`, `MixtralForCausalLM` and the Qwen3.5-MoE text
model `Qwen3_5MoeForCausalLM` (Gated DeltaNet hybrid: `linear_attn.*` tensors split into our
q/k/v/z/b/a projections and per-channel conv taps; `self_attn.q_proj` holds query and output gate
interleaved per head, [nh, 2, D] rows, split into q and gate), in the public on-disk
layout (one tensor per expert, `model.layers.{i}.mlp.experts.{e}.gate_proj.weight` [I, H];
Mixtral: `block_sparse_moe.experts.{e}.w1/w3/w2`), single-file or sharded with
`model.safetensors.index.json`. The fused layout that transformers >= 5 holds in memory
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) is accepted too.
`save_pretrained` writes the per-expert layout, which transformers reloads.
Qwen3.5: the multi-token-prediction head of released checkpoints (`mtp.*`) is dropped at load, as
transformers drops it; a vision tower (`vision_config`, `model.visual.*`) is refused: this loader
reads the text model only.

Hugging Face linear weights are [out, in]; ours are [in, out] with heads split out:
q [H, nh, D], k/v [H, nkv, D], o [nh, D, H], experts gate/up [E, H, I], down [E, I, H],
router [H, E], embed [V, H], lm_head [H, V] (None when tied).
Loaded parameters are host numpy arrays; place them with `jax.device_put(params, shardings)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
from collections.abc import Mapping
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors can read BF16)
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from trace_jax.config import ConfigError, ModelConfig
from trace_jax.deltanet import DeltaNetParams
from trace_jax.model import AttentionParams, LayerParams, Params
from trace_jax.moe import MLPParams, MoEParams

QWEN3_MOE = "Qwen3MoeForCausalLM"
MIXTRAL = "MixtralForCausalLM"
QWEN3_5_MOE = "Qwen3_5MoeForCausalLM"
ARCHITECTURES = (QWEN3_MOE, MIXTRAL, QWEN3_5_MOE)

# transformers' defaults for the fields a config.json may omit (Qwen3MoeConfig, MixtralConfig),
# first those the two classes share.
_COMMON_DEFAULTS = dict(tie_word_embeddings=False, router_aux_loss_coef=0.001, initializer_range=0.02)
_DEFAULTS = {
  QWEN3_MOE: dict(
    _COMMON_DEFAULTS,
    num_key_value_heads=4,
    intermediate_size=6144,
    norm_topk_prob=False,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rope_theta=10_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
  ),
  MIXTRAL: dict(
    _COMMON_DEFAULTS, num_key_value_heads=8, rope_theta=1_000_000.0, rms_norm_eps=1e-5, max_position_embeddings=131072
  ),
  QWEN3_5_MOE: dict(  # Qwen3_5MoeTextConfig
    _COMMON_DEFAULTS,
    vocab_size=248320,
    hidden_size=2048,
    num_hidden_layers=40,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    rope_theta=10_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    num_experts_per_tok=8,
    num_experts=256,
    full_attention_interval=4,
  ),
}
_MODEL_TYPE = {QWEN3_MOE: "qwen3_moe", MIXTRAL: "mixtral", QWEN3_5_MOE: "qwen3_5_moe_text"}
# Per architecture: the MoE module name and the names of the expert gate/up/down projections.
_EXPERTS = {
  QWEN3_MOE: ("mlp", ("gate_proj", "up_proj", "down_proj")),
  QWEN3_5_MOE: ("mlp", ("gate_proj", "up_proj", "down_proj")),
  MIXTRAL: ("block_sparse_moe", ("w1", "w3", "w2")),
}
# Tensors some checkpoints carry that the model does not use (recomputed or redundant).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_IGNORED_PREFIXES = ("mtp.",)  # Qwen3.5's multi-token-prediction head: transformers drops it too


class HFCheckpointError(ConfigError):
  """A Hugging Face checkpoint (or export) this module cannot handle faithfully: the message names
  the field or tensor. Training checkpoints have their own `checkpoint.CheckpointError`."""


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def architecture_of(hf_config: Mapping[str, Any]) -> str:
  archs = hf_config.get("architectures") or []
  supported = [a for a in archs if a in ARCHITECTURES]
  if not supported and (hf_config.get("text_config") is not None or any("Qwen3_5Moe" in a for a in archs)):
    raise HFCheckpointError(
      f"config.json: architectures = {archs} is the vision-language checkpoint; this loader reads the text model "
      f"({QWEN3_5_MOE}) only. Save its text_config as config.json (architectures = ['{QWEN3_5_MOE}']) and its "
      "model.language_model.* tensors as model.*, without model.visual.* and mtp.*, and load that."
    )
  if not supported:
    raise HFCheckpointError(
      f"config.json: architectures = {archs} is not supported; this loader reads {list(ARCHITECTURES)}. "
      "Convert the checkpoint to one of them, or add its weight mapping to trace_jax/hf.py."
    )
  return supported[0]


def _rope_theta(hf: Mapping[str, Any], default: float) -> float:
  """transformers 5 keeps RoPE under `rope_parameters`; older configs use `rope_theta`/`rope_scaling`."""
  for field in ("rope_parameters", "rope_scaling"):
    params = hf.get(field)
    if not params:
      continue
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
      raise HFCheckpointError(
        f"config.json: {field}.rope_type = {rope_type!r} is not implemented (only plain RoPE); "
        f"set {field} to null to run without RoPE scaling, or implement {rope_type!r} in attention.rope_tables."
      )
    if "rope_theta" in params:
      return float(params["rope_theta"])
  return float(hf.get("rope_theta", default))


def _partial_rotary_factor(hf: Mapping[str, Any], default: float) -> float:
  params = hf.get("rope_parameters") or {}
  return float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default)))


def _qwen3_5_fields(hf: Mapping[str, Any], get) -> dict:
  """The Qwen3.5-MoE text model's fields (every layer MoE with a gated shared expert; hybrid mixers)."""
  if hf.get("vision_config") is not None or hf.get("text_config") is not None:
    raise HFCheckpointError(
      "config.json: vision_config / text_config present: this is the vision-language checkpoint; this loader "
      "reads the text model (Qwen3_5MoeForCausalLM) only. Save the text model (its text_config as config.json "
      "and the model.language_model.* tensors as model.*) and load that."
    )
  n = get("num_hidden_layers")
  layer_types = hf.get("layer_types")
  if layer_types is None:
    interval = get("full_attention_interval")
    layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
  return dict(
    num_experts=get("num_experts"),
    moe_intermediate_size=get("moe_intermediate_size"),
    intermediate_size=0,
    shared_expert_intermediate_size=get("shared_expert_intermediate_size"),
    norm_topk_prob=True,
    qk_norm=True,
    layer_types=tuple(layer_types),
    attention_output_gate=True,
    zero_centered_norm=True,
    partial_rotary_factor=_partial_rotary_factor(hf, 0.25),
    **{
      f: get(f)
      for f in (
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
      )
    },
  )


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
  """ModelConfig from a parsed config.json; rejects features the model does not implement."""
  arch = architecture_of(hf)
  defaults = _DEFAULTS[arch]

  def get(field: str):
    if field in hf and hf[field] is not None:
      return hf[field]
    if field in defaults:
      return defaults[field]
    raise HFCheckpointError(f"config.json: required field {field!r} is missing for {arch}; add it to config.json.")

  if hf.get("hidden_act", "silu") != "silu":
    raise HFCheckpointError(
      f"config.json: hidden_act = {hf['hidden_act']!r}; the experts implement SwiGLU ('silu') only."
    )
  if hf.get("attention_bias"):
    raise HFCheckpointError("config.json: attention_bias = true; the attention projections here have no bias.")
  window = hf.get("sliding_window") if (arch == MIXTRAL or hf.get("use_sliding_window")) else None
  if window is not None and window < get("max_position_embeddings"):
    raise HFCheckpointError(
      f"config.json: sliding_window = {window} is not implemented (full causal attention only); "
      "set it to null (or use_sliding_window = false) to load the model with full attention."
    )

  if arch == QWEN3_5_MOE:
    moe = _qwen3_5_fields(hf, get)
  elif arch == QWEN3_MOE:
    counts = {k: hf[k] for k in ("num_experts", "num_local_experts") if hf.get(k) is not None}
    if len(set(counts.values())) > 1:
      raise HFCheckpointError(f"config.json: num_experts and num_local_experts disagree ({counts}); keep one.")
    if not counts:
      raise HFCheckpointError("config.json: required field 'num_experts' is missing for Qwen3MoeForCausalLM.")
    moe = dict(
      num_experts=next(iter(counts.values())),
      moe_intermediate_size=get("moe_intermediate_size"),
      intermediate_size=get("intermediate_size"),
      norm_topk_prob=bool(get("norm_topk_prob")),
      decoder_sparse_step=get("decoder_sparse_step"),
      mlp_only_layers=tuple(get("mlp_only_layers")),
      qk_norm=True,
    )
  else:  # Mixtral: every layer sparse, top-k weights renormalized, no QK-norm
    moe = dict(
      num_experts=get("num_local_experts"),
      moe_intermediate_size=get("intermediate_size"),
      intermediate_size=0,
      norm_topk_prob=True,
      qk_norm=False,
    )
  hidden, heads = get("hidden_size"), get("num_attention_heads")
  try:
    return ModelConfig(
      vocab_size=get("vocab_size"),
      hidden_size=hidden,
      num_layers=get("num_hidden_layers"),
      num_heads=heads,
      num_kv_heads=get("num_key_value_heads"),
      head_dim=hf.get("head_dim") or defaults.get("head_dim") or hidden // heads,
      num_experts_per_tok=get("num_experts_per_tok"),
      rope_theta=_rope_theta(hf, defaults["rope_theta"]),
      rms_norm_eps=float(get("rms_norm_eps")),
      tie_word_embeddings=bool(get("tie_word_embeddings")),
      router_aux_loss_coef=float(get("router_aux_loss_coef")),
      max_position_embeddings=get("max_position_embeddings"),
      initializer_range=float(get("initializer_range")),
      **moe,
    )
  except ConfigError as e:
    raise HFCheckpointError(f"config.json describes an invalid model: {e}") from None


def default_architecture(config: ModelConfig) -> str:
  if config.zero_centered_norm or config.linear_layers or config.attention_output_gate:
    return QWEN3_5_MOE
  return QWEN3_MOE if config.qk_norm else MIXTRAL


def config_to_hf(config: ModelConfig, architecture: str | None = None, dtype: str = "float32") -> dict[str, Any]:
  """The config.json for `config` (transformers 4.x and 5.x read it)."""
  arch = architecture or default_architecture(config)
  _check_exportable(config, arch)
  c = config
  hf = dict(
    architectures=[arch],
    model_type=_MODEL_TYPE[arch],
    vocab_size=c.vocab_size,
    hidden_size=c.hidden_size,
    num_hidden_layers=c.num_layers,
    num_attention_heads=c.num_heads,
    num_key_value_heads=c.num_kv_heads,
    head_dim=c.head_dim,
    num_experts_per_tok=c.num_experts_per_tok,
    hidden_act="silu",
    rms_norm_eps=c.rms_norm_eps,
    rope_theta=c.rope_theta,
    rope_parameters=dict(rope_type="default", rope_theta=c.rope_theta),
    tie_word_embeddings=c.tie_word_embeddings,
    router_aux_loss_coef=c.router_aux_loss_coef,
    max_position_embeddings=c.max_position_embeddings,
    initializer_range=c.initializer_range,
    attention_dropout=0.0,
    sliding_window=None,
    use_cache=True,
    dtype=dtype,
    torch_dtype=dtype,
  )
  if arch == QWEN3_5_MOE:
    hf.update(
      num_experts=c.num_experts,
      moe_intermediate_size=c.moe_intermediate_size,
      shared_expert_intermediate_size=c.shared_expert_intermediate_size,
      layer_types=[c.layer_type(i) for i in range(c.num_layers)],
      rope_parameters=dict(rope_type="default", rope_theta=c.rope_theta, partial_rotary_factor=c.partial_rotary_factor),
      linear_num_key_heads=c.linear_num_key_heads,
      linear_num_value_heads=c.linear_num_value_heads,
      linear_key_head_dim=c.linear_key_head_dim,
      linear_value_head_dim=c.linear_value_head_dim,
      linear_conv_kernel_dim=c.linear_conv_kernel_dim,
      attention_bias=False,
    )
    for field in ("rope_theta", "sliding_window"):
      hf.pop(field)
  elif arch == QWEN3_MOE:
    hf.update(
      num_experts=c.num_experts,
      moe_intermediate_size=c.moe_intermediate_size,
      intermediate_size=c.intermediate_size,
      norm_topk_prob=c.norm_topk_prob,
      decoder_sparse_step=c.decoder_sparse_step,
      mlp_only_layers=list(c.mlp_only_layers),
      attention_bias=False,
      use_sliding_window=False,
    )
  else:
    hf.update(num_local_experts=c.num_experts, intermediate_size=c.moe_intermediate_size, router_jitter_noise=0.0)
  return hf


def _check_exportable(config: ModelConfig, arch: str):
  if arch not in ARCHITECTURES:
    raise HFCheckpointError(f"architecture {arch!r} is not supported; expected one of {list(ARCHITECTURES)}.")
  problems = []
  if arch == QWEN3_5_MOE:
    required = dict(
      zero_centered_norm=True, attention_output_gate=True, qk_norm=True, norm_topk_prob=True, tie_word_embeddings=None
    )
    for field, value in required.items():
      if value is not None and getattr(config, field) != value:
        problems.append(f"{field} = {getattr(config, field)} (Qwen3.5-MoE has {value})")
    if not config.shared_expert_intermediate_size:
      problems.append("shared_expert_intermediate_size = 0 (Qwen3.5-MoE has a gated shared expert)")
    if len(config.moe_layers) != config.num_layers:
      problems.append("dense MLP layers (Qwen3.5-MoE is sparse in every layer)")
  else:
    if config.linear_layers or config.zero_centered_norm or config.attention_output_gate:
      problems.append("Qwen3.5 features (linear_attention layers, zero-centred norms or gated attention)")
    if config.shared_expert_intermediate_size:
      problems.append("shared_expert_intermediate_size > 0 (neither architecture has a shared expert)")
  if arch == QWEN3_MOE and not config.qk_norm:
    problems.append("qk_norm = False (Qwen3-MoE always has QK-norm)")
  if arch == MIXTRAL:
    if config.qk_norm:
      problems.append("qk_norm = True (Mixtral has no QK-norm)")
    if not config.norm_topk_prob:
      problems.append("norm_topk_prob = False (Mixtral renormalizes the top-k weights)")
    if len(config.moe_layers) != config.num_layers:
      problems.append("dense MLP layers (Mixtral is sparse in every layer)")
  if problems:
    raise HFCheckpointError(f"cannot export as {arch}: config.model has " + "; ".join(problems) + ".")


# ---------------------------------------------------------------------------------------------
# Tensor names and layouts


def _moe_module(arch: str, layer: int, reader: _Reader | None = None) -> str:
  """Mixtral checkpoints re-saved by transformers >= 5 without conversion use `mlp`."""
  module = _EXPERTS[arch][0]
  prefix = f"model.layers.{layer}."
  if reader is not None and not reader.has(f"{prefix}{module}.gate.weight") and reader.has(f"{prefix}mlp.gate.weight"):
    module = "mlp"
  return prefix + module


class _Reader:
  """Tensors of a (possibly sharded) safetensors checkpoint, read lazily, with shape checks."""

  def __init__(self, path: pathlib.Path, stack: contextlib.ExitStack):
    self.path = path
    index = path / "model.safetensors.index.json"
    if index.exists():
      files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
      files = sorted(path.glob("*.safetensors"))
    if not files:
      raise HFCheckpointError(f"{path}: no *.safetensors files (and no model.safetensors.index.json).")
    self._where = {}
    for file in files:
      if not file.exists():
        raise HFCheckpointError(f"{index}: shard {file.name} is listed in weight_map but missing; copy it into {path}.")
      handle = stack.enter_context(safe_open(file, framework="numpy"))
      for name in handle.keys():
        if name in self._where:
          raise HFCheckpointError(f"{path}: tensor {name!r} appears in more than one shard.")
        self._where[name] = handle
    self.unused = set(self._where)

  def has(self, name: str) -> bool:
    return name in self._where

  def get(self, name: str, shape: tuple[int, ...], hint: str, rows: slice | None = None) -> np.ndarray:
    """The tensor, checked against `shape`; rows: only these rows of its leading axis are read."""
    if name not in self._where:
      raise HFCheckpointError(
        f"{self.path}: tensor {name!r} is missing (expected shape {shape}, from config.json {hint}). "
        "Re-export the checkpoint with all its tensors, or fix config.json if it describes another model."
      )
    actual = tuple(self._where[name].get_slice(name).get_shape())
    if actual != shape:
      raise HFCheckpointError(
        f"{self.path}: tensor {name!r} has shape {actual}, but config.json ({hint}) implies {shape}; "
        "make config.json match the checkpoint."
      )
    self.unused.discard(name)
    if rows is not None:
      return self._where[name].get_slice(name)[rows]
    return self._where[name].get_tensor(name)


def _attention_shapes(c: ModelConfig):
  hint = "hidden_size, num_attention_heads, num_key_value_heads, head_dim"
  return hint, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim


def _read_layer(r: _Reader, c: ModelConfig, arch: str, i: int, dtype, experts: slice | None = None) -> LayerParams:
  h, p = c.hidden_size, f"model.layers.{i}."
  cast = lambda a: np.ascontiguousarray(a, dtype=dtype)
  hint, q_out, kv_out = _attention_shapes(c)
  get = lambda name, shape, why=hint: r.get(p + name, shape, why)
  if i in c.linear_layers:
    attn = _read_deltanet(r, c, i, cast)
  else:
    gated = c.attention_output_gate  # q_proj rows [nh, 2, D]: each head's query, then its gate
    q_rows = get("self_attn.q_proj.weight", (q_out * (2 if gated else 1), h)).T.reshape(h, c.num_heads, -1)
    attn = AttentionParams(
      q=cast(q_rows[..., : c.head_dim]),
      k=cast(get("self_attn.k_proj.weight", (kv_out, h)).T.reshape(h, c.num_kv_heads, c.head_dim)),
      v=cast(get("self_attn.v_proj.weight", (kv_out, h)).T.reshape(h, c.num_kv_heads, c.head_dim)),
      o=cast(get("self_attn.o_proj.weight", (h, q_out)).T.reshape(c.num_heads, c.head_dim, h)),
      q_norm=cast(get("self_attn.q_norm.weight", (c.head_dim,), "head_dim")) if c.qk_norm else None,
      k_norm=cast(get("self_attn.k_norm.weight", (c.head_dim,), "head_dim")) if c.qk_norm else None,
      gate=cast(q_rows[..., c.head_dim :]) if gated else None,
    )
  if c.is_moe_layer(i):
    mlp = _read_experts(r, c, arch, i, cast, experts)
  else:  # a dense SwiGLU layer (Qwen3 mlp_only_layers / decoder_sparse_step)
    n, why = c.intermediate_size, "hidden_size, intermediate_size"
    mlp = MLPParams(
      gate=cast(get("mlp.gate_proj.weight", (n, h), why).T),
      up=cast(get("mlp.up_proj.weight", (n, h), why).T),
      down=cast(get("mlp.down_proj.weight", (h, n), why).T),
    )
  return LayerParams(
    input_norm=cast(get("input_layernorm.weight", (h,), "hidden_size")),
    attn=attn,
    post_attn_norm=cast(get("post_attention_layernorm.weight", (h,), "hidden_size")),
    mlp=mlp,
  )


def _deltanet_dims(c: ModelConfig):
  nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
  return nk, nv, dk, dv, c.linear_conv_kernel_dim, 2 * nk * dk + nv * dv


def _read_deltanet(r: _Reader, c: ModelConfig, i: int, cast) -> DeltaNetParams:
  """linear_attn.*: in_proj_qkv [C, H] (q, k, v rows), in_proj_z [nv dv, H], in_proj_b/a [nv, H],
  conv1d.weight [C, 1, Kc], dt_bias/A_log [nv], norm.weight [dv], out_proj.weight [H, nv dv]."""
  h, p = c.hidden_size, f"model.layers.{i}.linear_attn."
  nk, nv, dk, dv, kc, channels = _deltanet_dims(c)
  why = "hidden_size, linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim"
  get = lambda name, shape, hint=why: r.get(p + name, shape, hint)
  qkv = get("in_proj_qkv.weight", (channels, h)).T
  conv = get("conv1d.weight", (channels, 1, kc), why + ", linear_conv_kernel_dim")[:, 0].T  # [Kc, C]
  split = lambda a: (a[..., : nk * dk], a[..., nk * dk : 2 * nk * dk], a[..., 2 * nk * dk :])
  (q, k, v), (cq, ck, cv) = split(qkv), split(conv)
  return DeltaNetParams(
    q=cast(q.reshape(h, nk, dk)),
    k=cast(k.reshape(h, nk, dk)),
    v=cast(v.reshape(h, nv, dv)),
    z=cast(get("in_proj_z.weight", (nv * dv, h)).T.reshape(h, nv, dv)),
    b=cast(get("in_proj_b.weight", (nv, h)).T),
    a=cast(get("in_proj_a.weight", (nv, h)).T),
    conv_q=cast(cq.reshape(kc, nk, dk)),
    conv_k=cast(ck.reshape(kc, nk, dk)),
    conv_v=cast(cv.reshape(kc, nv, dv)),
    a_log=cast(get("A_log", (nv,))),
    dt_bias=cast(get("dt_bias", (nv,))),
    norm=cast(get("norm.weight", (dv,))),
    out=cast(get("out_proj.weight", (h, nv * dv)).T.reshape(nv, dv, h)),
  )


def _deltanet_state_dict(p: str, a: DeltaNetParams, c: ModelConfig) -> dict[str, np.ndarray]:
  host = np.asarray
  kc = c.linear_conv_kernel_dim
  flat = lambda *ws: np.concatenate([host(w).reshape(w.shape[0], -1) for w in ws], axis=-1)
  return {
    p + "in_proj_qkv.weight": flat(a.q, a.k, a.v).T,
    p + "in_proj_z.weight": host(a.z).reshape(c.hidden_size, -1).T,
    p + "in_proj_b.weight": host(a.b).T,
    p + "in_proj_a.weight": host(a.a).T,
    p + "conv1d.weight": flat(a.conv_q, a.conv_k, a.conv_v).T.reshape(-1, 1, kc),
    p + "A_log": host(a.a_log),
    p + "dt_bias": host(a.dt_bias),
    p + "norm.weight": host(a.norm),
    p + "out_proj.weight": host(a.out).reshape(-1, c.hidden_size).T,
  }


def _read_experts(r: _Reader, c: ModelConfig, arch: str, i: int, cast, experts: slice | None = None) -> MoEParams:
  """experts: read only these experts (the ones this process holds); gate/up/down then stack just them."""
  e, h, n = c.num_experts, c.hidden_size, c.moe_intermediate_size
  experts = experts or slice(0, e)
  module = _moe_module(arch, i, r)
  why = "num_experts, hidden_size, moe_intermediate_size"
  router = cast(r.get(f"{module}.gate.weight", (e, h), "num_experts, hidden_size").T)
  names = _EXPERTS[arch][1]
  fused = f"{module}.experts.gate_up_proj"
  if not r.has(f"{module}.experts.0.{names[0]}.weight") and r.has(fused):
    gate_up = r.get(fused, (e, 2 * n, h), why, rows=experts)
    gate, up = gate_up[:, :n].transpose(0, 2, 1), gate_up[:, n:].transpose(0, 2, 1)
    down = r.get(f"{module}.experts.down_proj", (e, h, n), why, rows=experts).transpose(0, 2, 1)
  else:
    wanted = range(e)[experts]
    for j in sorted(set(range(e)) - set(wanted)):  # another process's: checked to exist, not read
      for name, shape in zip(names, ((n, h), (n, h), (h, n))):
        r.get(f"{module}.experts.{j}.{name}.weight", shape, why, rows=slice(0, 0))
    stack = lambda name, shape: np.stack([r.get(f"{module}.experts.{j}.{name}.weight", shape, why).T for j in wanted])
    gate, up, down = stack(names[0], (n, h)), stack(names[1], (n, h)), stack(names[2], (h, n))
  shared = shared_gate = None
  if c.shared_expert_intermediate_size:  # Qwen3.5 / Qwen2-MoE: mlp.shared_expert + mlp.shared_expert_gate
    m, why_s = c.shared_expert_intermediate_size, "hidden_size, shared_expert_intermediate_size"
    get = lambda name, shape: cast(r.get(f"{module}.{name}.weight", shape, why_s).T)
    shared = MLPParams(
      get("shared_expert.gate_proj", (m, h)),
      get("shared_expert.up_proj", (m, h)),
      get("shared_expert.down_proj", (h, m)),
    )
    shared_gate = get("shared_expert_gate", (1, h))
  return MoEParams(router=router, gate=cast(gate), up=cast(up), down=cast(down), shared=shared, shared_gate=shared_gate)


def _hf_config(path: pathlib.Path) -> dict[str, Any]:
  if not path.is_dir():
    raise HFCheckpointError(f"{path}: no such directory; init_from / load_pretrained take a Hugging Face model folder.")
  config_file = path / "config.json"
  if not config_file.exists():
    raise HFCheckpointError(f"{path}: no config.json; a Hugging Face checkpoint directory needs one.")
  try:
    return json.loads(config_file.read_text())
  except json.JSONDecodeError as e:
    raise HFCheckpointError(f"{config_file}: not valid JSON ({e.msg}, line {e.lineno}).") from None


def read_config(path: str | pathlib.Path) -> ModelConfig:
  """The ModelConfig of a Hugging Face checkpoint directory (its config.json), without reading weights."""
  hf = _hf_config(pathlib.Path(path))
  architecture_of(hf)
  return config_from_hf(hf)


# ModelConfig fields that are ours, not the checkpoint's (how the trainer computes, not what the model is).
OWN_MODEL_FIELDS = ("linear_chunk_size",)


def with_pretrained_model(cfg):
  """A copy of a run's ConfigDict whose `model` section is its init_from checkpoint's (config.json).

  A field the section sets (not None: a preset, or a --config.model.* override) must agree with the
  checkpoint; one that contradicts it is a ConfigError naming the field. The fields of
  OWN_MODEL_FIELDS are taken from the section. Without init_from, `cfg` is returned as it is.
  """
  import ml_collections  # noqa: PLC0415

  init_from = cfg.get("init_from", "")
  if not init_from:
    return cfg
  model = read_config(init_from)
  given = cfg.model.to_dict() if cfg.get("model") is not None else {}
  unknown = sorted(set(given) - {f.name for f in dataclasses.fields(ModelConfig)})
  if unknown:
    raise ConfigError(f"config.model.{unknown[0]}: unknown field of ModelConfig.")
  own = {k: given[k] for k in OWN_MODEL_FIELDS if given.get(k) is not None}
  model = dataclasses.replace(model, **own)
  for name, value in sorted(given.items()):
    value = tuple(value) if isinstance(value, list) else value
    if value is not None and value != getattr(model, name):
      raise ConfigError(
        f"config.model.{name}: is {value!r}, but init_from={init_from} says {getattr(model, name)!r} (its "
        "config.json): the model section comes from the checkpoint. Drop the preset or the override "
        "(configs/hf_math.py leaves the model section unset)."
      )
  out = ml_collections.ConfigDict(cfg.to_dict())
  out.model = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(model).items()}
  return out


def load_pretrained(
  path: str | pathlib.Path, dtype=np.float32, place=None, experts: slice | None = None
) -> tuple[ModelConfig, Params]:
  """(ModelConfig, Params) from a Hugging Face checkpoint directory; weights cast to `dtype`.

  Every tensor must be used: a missing, misshaped or unexpected tensor raises HFCheckpointError.
  place: None returns host numpy arrays. Otherwise `place(name, part)` is called on each part of
  the tree as it is read ('embed', then 'layers.0', 'layers.1', ..., 'final_norm', 'lm_head') and
  its result kept, so that host memory holds one layer at a time (`load_sharded` puts each on a
  mesh). experts: read only these routed experts of every MoE layer (those this process holds).
  """
  path = pathlib.Path(path)
  hf = _hf_config(path)
  arch = architecture_of(hf)
  c = config_from_hf(hf)
  dtype = np.dtype(dtype)
  place = place or (lambda name, tree: tree)
  with contextlib.ExitStack() as stack:
    r = _Reader(path, stack)
    cast = lambda a: np.ascontiguousarray(a, dtype=dtype)
    embed = cast(r.get("model.embed_tokens.weight", (c.vocab_size, c.hidden_size), "vocab_size, hidden_size"))
    embed = place("embed", embed)
    layers = tuple(place(f"layers.{i}", _read_layer(r, c, arch, i, dtype, experts)) for i in range(c.num_layers))
    final_norm = cast(r.get("model.norm.weight", (c.hidden_size,), "hidden_size"))
    if c.tie_word_embeddings:
      lm_head = None
      r.unused.discard("lm_head.weight")  # some exporters write the tied copy anyway
    else:
      why = "vocab_size, hidden_size, tie_word_embeddings = false"
      lm_head = place("lm_head", cast(r.get("lm_head.weight", (c.vocab_size, c.hidden_size), why).T))
    final_norm = place("final_norm", final_norm)
    visual = sorted(n for n in r.unused if n.startswith(("model.visual.", "visual.")))
    if visual:
      raise HFCheckpointError(
        f"{path}: tensor {visual[0]!r} (and {len(visual) - 1} more) belong to a vision tower; this loader reads "
        f"the text model only. Remove the vision tensors (model.visual.*) to load the language model."
      )
    ignored = lambda n: n.endswith(_IGNORED_SUFFIXES) or (arch == QWEN3_5_MOE and n.startswith(_IGNORED_PREFIXES))
    unexpected = sorted(n for n in r.unused if not ignored(n))
    if unexpected:
      raise HFCheckpointError(
        f"{path}: {len(unexpected)} unexpected tensor(s) that {arch} as implemented here does not use, e.g. "
        f"{unexpected[:5]}. The checkpoint holds parts this model lacks (biases, extra modules, or more "
        "layers/experts than config.json says); fix config.json or remove them."
      )
  return c, Params(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


def load_sharded(path: str | pathlib.Path, mesh, dtype=np.float32) -> tuple[ModelConfig, Params]:
  """(ModelConfig, Params) with every parameter placed straight into its trainer shardings on `mesh`.

  One layer at a time is read into host memory, then handed to `jax.make_array_from_callback`
  (each device takes its slice); each process reads only the routed experts its devices hold (the
  experts axis is the bulk of an MoE's bytes) and the dense tensors whole.
  """
  import jax  # noqa: PLC0415 (the host loader stays usable without a backend)

  from trace_jax import model, sharding  # noqa: PLC0415

  config = read_config(path)
  abstract = jax.eval_shape(lambda: model.init_params(config, jax.random.key(0), dtype=dtype))
  shardings = sharding.logical_shardings(abstract, mesh)
  experts = None
  moe = next((layer.mlp for layer in abstract.layers if isinstance(layer.mlp, MoEParams)), None)
  if moe is not None:
    moe_sharding = next(layer.mlp for layer in shardings.layers if isinstance(layer.mlp, MoEParams)).gate
    experts = sharding.process_rows(moe_sharding, moe.gate.shape)

  def put(host, shape, where):
    offset = experts.start if host.shape != shape.shape else 0  # the experts this process holds
    host = np.asarray(host, dtype=shape.dtype)

    def shard(index):
      if offset or host.shape != shape.shape:
        first = index[0]
        stop = shape.shape[0] if first.stop is None else first.stop
        index = (slice((first.start or 0) - offset, stop - offset), *index[1:])
      return host[index]

    return jax.make_array_from_callback(shape.shape, where, shard)

  def part(name: str):
    node_shape, node_where = abstract, shardings
    for key in name.split("."):
      node_shape, node_where = (
        (node_shape[int(key)], node_where[int(key)])
        if key.isdigit()
        else (getattr(node_shape, key), getattr(node_where, key))
      )
    return node_shape, node_where

  def place(name, tree):
    shapes, where = part(name)
    return jax.tree_util.tree_map(put, tree, shapes, where)

  return load_pretrained(path, dtype, place=place, experts=experts)


# ---------------------------------------------------------------------------------------------
# Export


def state_dict(params: Params, config: ModelConfig, architecture: str | None = None) -> dict[str, np.ndarray]:
  """Hugging Face tensor names -> [out, in] float arrays, experts one tensor each (the on-disk layout)."""
  arch = architecture or default_architecture(config)
  _check_exportable(config, arch)
  c = config
  host = lambda a: np.asarray(a)
  out = {"model.embed_tokens.weight": host(params.embed), "model.norm.weight": host(params.final_norm)}
  if params.lm_head is not None:
    out["lm_head.weight"] = host(params.lm_head).T
  elif not c.tie_word_embeddings:
    raise HFCheckpointError("params.lm_head is None but config.model.tie_word_embeddings is False.")
  for i, layer in enumerate(params.layers):
    p, a = f"model.layers.{i}.", layer.attn
    out[p + "input_layernorm.weight"] = host(layer.input_norm)
    out[p + "post_attention_layernorm.weight"] = host(layer.post_attn_norm)
    if isinstance(layer.mlp, MoEParams) and layer.mlp.shared is not None:
      module = _moe_module(arch, i)
      for name in ("gate", "up", "down"):
        out[f"{module}.shared_expert.{name}_proj.weight"] = host(getattr(layer.mlp.shared, name)).T
      out[f"{module}.shared_expert_gate.weight"] = host(layer.mlp.shared_gate).T
    if isinstance(a, DeltaNetParams):
      out.update(_deltanet_state_dict(p + "linear_attn.", a, c))
    else:
      q = host(a.q) if a.gate is None else np.stack([host(a.q), host(a.gate)], axis=2)  # [H, nh, 2, D]
      out[p + "self_attn.q_proj.weight"] = q.reshape(c.hidden_size, -1).T
      out[p + "self_attn.k_proj.weight"] = host(a.k).reshape(c.hidden_size, -1).T
      out[p + "self_attn.v_proj.weight"] = host(a.v).reshape(c.hidden_size, -1).T
      out[p + "self_attn.o_proj.weight"] = host(a.o).reshape(-1, c.hidden_size).T
      if a.q_norm is not None:
        out[p + "self_attn.q_norm.weight"] = host(a.q_norm)
        out[p + "self_attn.k_norm.weight"] = host(a.k_norm)
    if isinstance(layer.mlp, MoEParams):
      module, names = _moe_module(arch, i), _EXPERTS[arch][1]
      out[f"{module}.gate.weight"] = host(layer.mlp.router).T
      for weights, name in zip((layer.mlp.gate, layer.mlp.up, layer.mlp.down), names):
        for j, w in enumerate(host(weights)):
          out[f"{module}.experts.{j}.{name}.weight"] = w.T
    else:
      for name in ("gate", "up", "down"):
        out[f"{p}mlp.{name}_proj.weight"] = host(getattr(layer.mlp, name)).T
  return out


def save_pretrained(
  path: str | pathlib.Path,
  config: ModelConfig,
  params: Params,
  *,
  architecture: str | None = None,
  dtype: str = "float32",
  max_shard_bytes: int | None = None,
):
  """Write config.json + model.safetensors (or shards + model.safetensors.index.json).

  architecture: default Qwen3MoeForCausalLM with QK-norm, MixtralForCausalLM without.
  dtype: 'float32' (exact) or 'bfloat16'.
  """
  arch = architecture or default_architecture(config)
  np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}.get(dtype)
  if np_dtype is None:
    raise HFCheckpointError(f"dtype {dtype!r} is not supported for export; use 'float32' or 'bfloat16'.")
  tensors = {k: np.ascontiguousarray(v, dtype=np_dtype) for k, v in state_dict(params, config, arch).items()}
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(config_to_hf(config, arch, dtype), indent=2) + "\n")
  metadata = {"format": "pt"}  # transformers refuses safetensors files without it
  shards = [[]]
  size = 0
  for name, t in tensors.items():
    if max_shard_bytes is not None and shards[-1] and size + t.nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += t.nbytes
  if len(shards) == 1:
    save_file(tensors, str(path / "model.safetensors"), metadata=metadata)
    return
  weight_map = {}
  for n, names in enumerate(shards, 1):
    file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
    save_file({k: tensors[k] for k in names}, str(path / file), metadata=metadata)
    weight_map.update(dict.fromkeys(names, file))
  total = sum(t.nbytes for t in tensors.values())
  index = {"metadata": {"total_size": total}, "weight_map": weight_map}
  (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
