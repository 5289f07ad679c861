"""Validated, frozen configs built from ml_collections ConfigDicts: the one source of defaults.

Each section of a run's ConfigDict maps to one frozen dataclass here (hashable, so they can
be static jit arguments), whose field defaults are the defaults of the job: `defaults()` builds
the ConfigDict that `configs/default.py` starts from, and `RunConfig.from_config` reads it back,
section by section, rejecting inconsistent settings with an error that names the field and the fix.

  section       dataclass        what it holds
  model         ModelConfig      the architecture (presets in configs/models.py)
  quant         QuantConfig      FP4 format, what is quantized, how packed matmuls run
  trace         TraceConfig      guided depth and form, diagnostic codes
  rollout       SamplingConfig   how the engine samples (EOS / PAD ids come from the tokenizer)
  rl            GRPOConfig       GRPO, TIS, KL, routing replay
  optim         OptimConfig      the RL optimizer
  reward        RewardConfig     the verifier
  data          DataConfig       the task, tokenizer, prompt length
  sft           SFTConfig        the supervised warm start
  mesh          MeshConfig       trainer and rollout meshes, MoE dispatch (docs/scaling.md)
  distributed   DistributedConfig  jax.distributed for several hosts
  (top level)   JobConfig        seed, mode, steps, batch size, checkpoints, evaluation
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import ml_collections

from trace_jax import fp4
from trace_jax.quantizer import GUIDANCE_FORMS


class ConfigError(ValueError):
  """An inconsistent or unknown configuration value."""


def _fail(field: str, message: str):
  raise ConfigError(f"config.{field}: {message}")


def _at_least(obj, section: str, **bounds: tuple[int, str]):
  """Each field NAME=(least, what 0 means or '') of `obj` must be >= least, else a ConfigError naming it."""
  for name, (least, note) in bounds.items():
    value = getattr(obj, name)
    if value < least:
      _fail(f"{section}{name}", f"must be >= {least}{f' ({note})' if note else ''}, got {value}.")


FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Qwen3-MoE-family decoder (also covers Qwen2-MoE shared experts and Mixtral), or the Qwen3.5-MoE
  hybrid: Gated DeltaNet layers (`layer_types`: 'linear_attention') between gated full-attention
  layers, zero-centred RMSNorm, partial RoPE and a gated shared expert (configs/models.py presets).
  """

  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  num_experts: int
  num_experts_per_tok: int
  moe_intermediate_size: int
  intermediate_size: int = 0  # dense MLP layers (mlp_only_layers / decoder_sparse_step)
  shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen3-MoE); >0: Qwen2-MoE style
  norm_topk_prob: bool = True
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  qk_norm: bool = True  # Qwen3: RMSNorm on q and k per head; Mixtral: off
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  router_aux_loss_coef: float = 0.001
  max_position_embeddings: int = 32768
  initializer_range: float = 0.02
  # Qwen3.5-MoE. layer_types: one entry per layer, 'full_attention' or 'linear_attention' (Gated
  # DeltaNet). () = the pattern of full_attention_interval: every n-th layer full attention, the
  # others linear (Qwen3.5: 4; 0 = every layer full attention), so that num_layers can be overridden.
  layer_types: tuple[str, ...] = ()
  full_attention_interval: int = 0
  attention_output_gate: bool = False  # q_proj also emits a per-head gate: attn * sigmoid(gate)
  partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * factor dims of each head
  zero_centered_norm: bool = False  # RMSNorm weights w apply as (1 + w), initialised at 0
  linear_num_key_heads: int = 0  # Gated DeltaNet: query/key heads (shared by groups of value heads)
  linear_num_value_heads: int = 0
  linear_key_head_dim: int = 0
  linear_value_head_dim: int = 0
  linear_conv_kernel_dim: int = 4  # the depthwise causal conv over q/k/v
  linear_chunk_size: int = 64  # the chunk of the trainer's (and prefill's) chunked gated delta rule

  def __post_init__(self):
    positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    for name in positive:
      if getattr(self, name) <= 0:
        _fail(f"model.{name}", f"must be positive, got {getattr(self, name)}.")
    if self.num_heads % self.num_kv_heads:
      _fail(
        "model.num_heads",
        f"{self.num_heads} query heads cannot be grouped over {self.num_kv_heads} kv heads; "
        "num_heads must be a multiple of num_kv_heads.",
      )
    if self.head_dim % 2:
      _fail("model.head_dim", f"RoPE needs an even head_dim, got {self.head_dim}.")
    if self.num_experts < 0 or self.num_experts_per_tok < 0:
      _fail("model.num_experts", "num_experts and num_experts_per_tok must be >= 0.")
    if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
      _fail(
        "model.num_experts_per_tok",
        f"top-k = {self.num_experts_per_tok} must lie in [1, num_experts = {self.num_experts}].",
      )
    if self.num_experts and self.moe_intermediate_size <= 0:
      _fail("model.moe_intermediate_size", "must be positive when num_experts > 0.")
    if self.decoder_sparse_step < 1:
      _fail("model.decoder_sparse_step", f"must be >= 1, got {self.decoder_sparse_step}.")
    bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
    if bad:
      _fail("model.mlp_only_layers", f"layers {bad} are outside [0, num_layers = {self.num_layers}).")
    if any(not self.is_moe_layer(i) for i in range(self.num_layers)) and self.intermediate_size <= 0:
      _fail(
        "model.intermediate_size", "dense MLP layers exist (mlp_only_layers / decoder_sparse_step), so it must be > 0."
      )
    if self.layer_types:
      if len(self.layer_types) != self.num_layers:
        _fail(
          "model.layer_types",
          f"has {len(self.layer_types)} entries for num_layers = {self.num_layers}; give one per layer (or none).",
        )
      unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
      if unknown:
        _fail("model.layer_types", f"unknown layer types {unknown}; expected entries of {LAYER_TYPES}.")
    if self.full_attention_interval < 0:
      _fail("model.full_attention_interval", f"must be >= 0 (0: no linear layers), got {self.full_attention_interval}.")
    if self.linear_layers:
      for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"):
        if getattr(self, name) <= 0:
          _fail(
            f"model.{name}",
            f"must be positive when layer_types has linear_attention layers, got {getattr(self, name)}.",
          )
      if self.linear_num_value_heads % self.linear_num_key_heads:
        _fail(
          "model.linear_num_value_heads",
          f"{self.linear_num_value_heads} value heads cannot share {self.linear_num_key_heads} key heads; "
          "it must be a multiple of linear_num_key_heads.",
        )
      if self.linear_conv_kernel_dim < 1 or self.linear_chunk_size < 1:
        _fail("model.linear_conv_kernel_dim", "the conv kernel and linear_chunk_size must be >= 1.")
    if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
      _fail(
        "model.partial_rotary_factor",
        f"{self.partial_rotary_factor} gives {self.rotary_dim} rotary dims of head_dim = {self.head_dim}; "
        "it must lie in (0, 1] and give an even number of dims.",
      )

  def is_moe_layer(self, layer: int) -> bool:
    """The Qwen-MoE rule for which layers are sparse."""
    return self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

  @property
  def moe_layers(self) -> tuple[int, ...]:
    return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

  def layer_type(self, layer: int) -> str:
    if self.layer_types:
      return self.layer_types[layer]
    if self.full_attention_interval and (layer + 1) % self.full_attention_interval:
      return LINEAR_ATTENTION
    return FULL_ATTENTION

  @property
  def linear_layers(self) -> tuple[int, ...]:
    """The Gated DeltaNet layers (no KV cache: a recurrent state instead)."""
    return tuple(i for i in range(self.num_layers) if self.layer_type(i) == LINEAR_ATTENTION)

  @property
  def attention_layers(self) -> tuple[int, ...]:
    """The full-attention layers (the ones with a KV cache)."""
    return tuple(i for i in range(self.num_layers) if self.layer_type(i) == FULL_ATTENTION)

  @property
  def rotary_dim(self) -> int:
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def norm_offset(self) -> float:
    """What RMSNorm adds to its weight: 1 for zero-centred norms (Qwen3.5), else 0."""
    return 1.0 if self.zero_centered_norm else 0.0


# Where FP4 fake-quant / FP4 storage applies (SPEC section 2.5); the rest stays BF16.
QUANT_TARGETS = ("experts", "kv", "attention", "dense_mlp", "shared_expert", "linear_attention")

# The activation tensors the rollout records guidance for, per layer: the routed experts' input
# (one row per token, shared by its k experts), their hidden activation (k rows per token) and
# K / V as the FP4 cache stores them. The engine, the trainer's QAT hooks and the metrics key by these.
MOE_INPUT, MOE_HIDDEN, KEY, VALUE = "moe_input", "moe_hidden", "key", "value"
GUIDED_TENSORS = (MOE_INPUT, MOE_HIDDEN, KEY, VALUE)

MATMUL_IMPLS = ("auto", "pallas", "mosaic", "reference")
TENSOR_SCALES = ("none", "batch_amax", "per_token")
KV_FORMATS = ("fp4", "fp8_e4m3", "bf16")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
  """What the trainer fake-quantizes and the rollout stores in FP4.

  targets: subset of QUANT_TARGETS. `experts` = routed-expert matmuls (weights and, when
  `activations`, their inputs); `kv` = K/V as stored in the KV cache (full-attention layers: the
  Gated DeltaNet layers of a hybrid keep an fp32 recurrent state); `linear_attention` = the Gated
  DeltaNet input and output projections (BF16 unless listed, as the paper keeps them).
  weights / activations: W4 and A4 switches (qat_w4a16 = weights only).
  matmul_impl: how the engine's packed FP4 matmuls run: 'auto' (on Hopper the Mosaic GPU kernel
  where it applies, NVFP4 experts with N a multiple of 64 and K of 128, else the Pallas-Triton
  kernel; on other GPUs the Triton kernel; elsewhere their jnp reference), 'mosaic' (an error where
  it does not apply), 'pallas' (Triton) or 'reference'.
  tensor_scale: NVFP4's second-level FP32 scale on activations and K/V (weights stay single-level).
  'none': E4M3 block scales only. 'batch_amax': amax / (448 * 6) of the tensor in the current
  batch, as engines compute it: the engine's per forward call (prefill, each decode step), shipped
  with the guidance of guided tensors so that the trainer rounds on the same grid; the trainer's
  RTN tensors take the amax of its own batch. 'per_token': amax / (448 * 6) of each activation row
  (a token's row; for K / V a token's head), as W4A4 NVFP4 engines compute it: the same function of
  the row in the engine and the trainer, so that it needs no batch and is bit-identical on the
  same inputs (tests/test_quant_recipes.py); guided rows use the rollout's.
  kv_format: what the KV cache stores where 'kv' is a target: 'fp4' (the run's `fmt`, guided like
  any activation), 'fp8_e4m3' (E4M3 values with one FP32 scale amax / 448 per token and head, as
  FP8 RL recipes run the cache; rounding to nearest in the engine and the trainer's fake-quant alike,
  no guidance) or 'bf16' (the same as leaving 'kv' out of `targets`).
  bf16_layers: layers left entirely in BF16 in the engine and the trainer (indices, negative from the
  end): the NVFP4 RL recipes of NeMo-RL and verl keep the first 2 and last 4 MoE layers so,
  `(0, 1, -4, -3, -2, -1)`. No guidance is recorded there.
  """

  fmt: str = "nvfp4"
  targets: tuple[str, ...] = ("experts", "kv")
  weights: bool = True
  activations: bool = True
  clip_gradient: bool = False
  matmul_impl: str = "auto"
  tensor_scale: str = "none"
  kv_format: str = "fp4"
  bf16_layers: tuple[int, ...] = ()

  def __post_init__(self):
    if self.kv_format not in KV_FORMATS:
      _fail("quant.kv_format", f"unknown {self.kv_format!r}; expected one of {KV_FORMATS}.")
    try:
      fp4.get_format(self.fmt)
    except ValueError as e:
      _fail("quant.fmt", str(e))
    if self.tensor_scale not in TENSOR_SCALES:
      _fail("quant.tensor_scale", f"unknown {self.tensor_scale!r}; expected one of {TENSOR_SCALES}.")
    if self.tensor_scale != "none" and self.format.name != "nvfp4":
      _fail("quant.tensor_scale", f"two-level scaling is an NVFP4 option; {self.fmt} scales are powers of two.")
    unknown = sorted(set(self.targets) - set(QUANT_TARGETS))
    if unknown:
      _fail("quant.targets", f"unknown targets {unknown}; expected a subset of {QUANT_TARGETS}.")
    if self.matmul_impl not in MATMUL_IMPLS:
      _fail("quant.matmul_impl", f"unknown {self.matmul_impl!r}; expected one of {MATMUL_IMPLS}.")

  @property
  def format(self) -> fp4.Fp4Format:
    return fp4.get_format(self.fmt)

  @property
  def two_level(self) -> bool:
    return self.tensor_scale != "none"

  def quantizes(self, target: str) -> bool:
    """Whether `target` is FP4 (for 'kv': quantized at all, in `kv_format`)."""
    if target == "kv" and self.kv_format == "bf16":
      return False
    return target in self.targets

  @property
  def fp4_kv(self) -> bool:
    """The KV cache is FP4 (packed codes the rollout can ship as guidance)."""
    return self.quantizes("kv") and self.kv_format == "fp4"

  def at_layer(self, layer: int, num_layers: int) -> QuantConfig | None:
    """This config, or None where `bf16_layers` keeps the layer in BF16."""
    return None if layer in self.bf16_layer_set(num_layers) else self

  def bf16_layer_set(self, num_layers: int) -> frozenset[int]:
    return frozenset(i % num_layers for i in self.bf16_layers)

  def check_dims(self, model: ModelConfig):
    """Every quantized contraction axis must be a whole number of blocks; bf16_layers must exist."""
    n = model.num_layers
    bad = [i for i in self.bf16_layers if not -n <= i < n]
    if bad:
      _fail("quant.bf16_layers", f"{bad} name no layer of a {n}-layer model; use indices in [-{n}, {n - 1}].")
    block = self.format.block_size
    dims = {}
    if "experts" in self.targets:
      dims.update(hidden_size=model.hidden_size, moe_intermediate_size=model.moe_intermediate_size)
    if self.fp4_kv:
      dims["head_dim"] = model.head_dim
    if "attention" in self.targets:
      dims.update(hidden_size=model.hidden_size, head_dim=model.head_dim)
    if "dense_mlp" in self.targets:
      dims.update(hidden_size=model.hidden_size, intermediate_size=model.intermediate_size)
    if "shared_expert" in self.targets:
      dims.update(hidden_size=model.hidden_size, shared_expert_intermediate_size=model.shared_expert_intermediate_size)
    if "linear_attention" in self.targets and model.linear_layers:
      dims.update(hidden_size=model.hidden_size, linear_value_head_dim=model.linear_value_head_dim)
    for name, d in dims.items():
      if d % block:
        _fail(f"model.{name}", f"{d} is not a multiple of the {self.fmt} block size {block}; FP4 needs whole blocks.")


@dataclasses.dataclass(frozen=True)
class TraceConfig:
  """TRACE: which layers get guidance and in which form.

  guided_fraction: the deepest share of the layers that is guided (0.5 = the second half).
  tensors: which recorded activations are shipped as guidance (a subset of GUIDED_TENSORS): the
  routed experts' input (once per token, shared by its k experts), their hidden activation (k rows
  per token), and K / V as the FP4 cache stores them. The default, the experts' input and K / V,
  was measured to keep most of what all four give for a third of the bytes on Qwen3-30B-A3B
  (docs/method.md, "Guided tensors"); the paper's accounting is the experts' input alone.
  diagnostics: the FP4 engine also records full codes in every layer, so that per-layer
  codeword agreement is measured in every mode (costs rollout memory and time, not guidance).
  diagnostics_every: on which GRPO steps: the first, every n-th after it and the last (0-based
  step % n == 0, or the last). The other steps run the engine without the full codes: recording
  them cost qat's rollout 193 against 150 ms a step on CPU (docs/performance.md). The first
  step with and the first without compile their own programs. 1: every step.
  """

  guided_fraction: float = 0.5
  guidance_form: str = "mantissa_scale"
  tensors: tuple[str, ...] = (MOE_INPUT, KEY, VALUE)
  diagnostics: bool = True
  diagnostics_every: int = 10

  def __post_init__(self):
    _at_least(self, "trace.", diagnostics_every=(1, "1 = every step"))
    if not 0 <= self.guided_fraction <= 1:
      _fail("trace.guided_fraction", f"must lie in [0, 1], got {self.guided_fraction}.")
    if self.guidance_form not in GUIDANCE_FORMS:
      _fail("trace.guidance_form", f"unknown form {self.guidance_form!r}; expected one of {GUIDANCE_FORMS}.")
    _check_tensors("trace.tensors", self.tensors)


def _check_tensors(field: str, tensors: tuple[str, ...]):
  unknown = sorted(set(tensors) - set(GUIDED_TENSORS))
  if unknown or not tensors:
    _fail(field, f"got {tensors}; expected a non-empty subset of {GUIDED_TENSORS}.")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How the rollout engine samples (the `rollout` section). temperature 0 = greedy; top_k 0 /
  top_p 1 = off. The rest comes from the tokenizer, filled in by RunConfig.with_tokenizer:

  eos_id / pad_id: the tokenizer's. vocab_size: the tokenizer's vocabulary; logits of ids >=
  vocab_size (embedding rows padded beyond it, model.vocab_size > vocab_size) are never sampled;
  0: every logit is a token. banned_ids: ids that are never sampled either (PAD, BOS). The
  trainer's log-probs use the same masked distribution (model.policy_logits).
  """

  max_new_tokens: int = 8
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  eos_id: int = 2
  pad_id: int = 0
  vocab_size: int = 0
  banned_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if self.vocab_size < 0:
      _fail("sampling.vocab_size", f"must be >= 0 (0 = every logit is a token), got {self.vocab_size}.")
    if any(i < 0 for i in self.banned_ids):
      _fail("sampling.banned_ids", f"ids must be >= 0, got {self.banned_ids}.")
    if self.eos_id in self.banned_ids:
      _fail("sampling.banned_ids", f"bans EOS ({self.eos_id}); a response could never end.")
    if self.vocab_size and self.eos_id >= self.vocab_size:
      _fail(
        "sampling.eos_id",
        f"{self.eos_id} lies outside the vocabulary [0, {self.vocab_size}); it could never be sampled.",
      )
    if self.vocab_size and len({i for i in self.banned_ids if i < self.vocab_size}) >= self.vocab_size:
      _fail("sampling.banned_ids", f"{self.banned_ids} bans every id of the vocabulary [0, {self.vocab_size}).")
    _at_least(self, "rollout.", max_new_tokens=(1, ""), temperature=(0, "0 = greedy"), top_k=(0, "0 = off"))
    if not 0 < self.top_p <= 1:
      _fail("rollout.top_p", f"must lie in (0, 1], got {self.top_p}.")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """The rollout engine: FP4 or BF16, and what it records for the trainer (derived from the mode).

  quant=None: the BF16 engine. guided_layers / guided_tensors: where guidance is recorded, in
  `guidance_form`. record_codes: also record full codes of every tensor in every quantized layer
  (per-layer agreement diagnostics; costs memory, not shipped as guidance).
  """

  quant: QuantConfig | None = QuantConfig()
  guided_layers: tuple[int, ...] = ()
  guided_tensors: tuple[str, ...] = GUIDED_TENSORS
  guidance_form: str = "mantissa_scale"
  record_codes: bool = False
  compute_dtype: str = "bfloat16"  # 'float32' for exact parity tests against the trainer

  def __post_init__(self):
    if self.compute_dtype not in ("bfloat16", "float32"):
      _fail("rollout.compute_dtype", f"unknown {self.compute_dtype!r}; expected 'bfloat16' or 'float32'.")
    if self.guidance_form not in GUIDANCE_FORMS:
      _fail("rollout.guidance_form", f"unknown form {self.guidance_form!r}; expected one of {GUIDANCE_FORMS}.")
    for name in ("guided_layers", "record_codes"):
      if self.quant is None and getattr(self, name):
        _fail(f"rollout.{name}", "a BF16 engine (quant=None) has no FP4 codes to record.")
    if any(i < 0 for i in self.guided_layers):
      _fail("rollout.guided_layers", f"layer indices must be >= 0, got {self.guided_layers}.")
    _check_tensors("rollout.guided_tensors", self.guided_tensors)

  @property
  def matmul_impl(self) -> str:
    return "auto" if self.quant is None else self.quant.matmul_impl


def deeper_layers(num_layers: int, fraction: float) -> tuple[int, ...]:
  """The deepest `fraction` of the layers (TRACE's selective depth; 0.5 = the second half)."""
  if not 0 <= fraction <= 1:
    _fail("trace.guided_fraction", f"must lie in [0, 1], got {fraction}.")
  n = round(num_layers * fraction)
  return tuple(range(num_layers - n, num_layers))


STALENESS_MODES = ("exact", "bounded")
MIS_MODES = ("none", "token", "sequence")
TRUST_REGIONS = ("none", "max", "geo")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """num_generations: G samples per prompt. tis_cap: C in min(pi_train / pi_rollout, C) (0 = off).

  ppo_epochs: passes over each rollout batch; minibatches: shuffled mini-batches per pass, one
  optimizer update each (as verl and Tunix do). With more than one update the PPO ratio moves
  away from 1 and the clip can act; the old log-probs of the ratio, the TIS weight and the
  mismatch metrics are the trainer's before the first update of the batch.

  Sequence-level off-policy corrections (rl.py `off_policy_mask`), beside or instead of TIS, on the
  rollout ratio r_t = pi_train(y_t) / pi_rollout(y_t) (the trainer's log-probs before the update):
  mis: masked importance sampling: 'token' drops the tokens whose r_t leaves `mis_band` = (low,
  high); 'sequence' drops the whole sequences whose ratio prod_t r_t leaves it.
  trust_region: trust-region masking (arXiv 2512.23075) drops a whole sequence whose 'max' token
  divergence max_t k3_t (k3 = r - 1 - log r, the KL(pi_rollout || pi_train) estimate at the sampled
  token) exceeds `trust_region_delta`, or whose 'geo' geometric-mean ratio |mean_t log r_t| does.
  Dropped tokens leave the loss and its token count.
  """

  num_generations: int = 8
  clip_eps: float = 0.2
  clip_eps_high: float | None = None  # asymmetric (DAPO-style) upper clip; None = clip_eps
  tis_cap: float = 5.0
  kl_coef: float = 0.0
  normalize_std: bool = True
  routing_replay: bool = True  # R3
  aux_loss_coef: float = 0.0
  ppo_epochs: int = 1
  minibatches: int = 1
  # Asynchronous RL (trace_jax/async_rl.py): batch t is generated by a policy version >= t - max_version_diff
  # by a producer that runs ahead of the trainer. 0 = synchronous (batch t by version t).
  max_version_diff: int = 0
  staleness: str = "exact"  # 'exact': batch t by version max(0, t - d), reproducible; 'bounded': the newest
  guidance_max_staleness: int = -1  # guidance older than this many versions rounds to nearest; -1 = max_version_diff
  split_mismatch: bool = True  # async: one more forward per stale batch, at the rollout's version (train.RLStep.learn)
  mis: str = "none"
  mis_band: tuple[float, float] = (0.5, 2.0)
  trust_region: str = "none"
  trust_region_delta: float = 0.05

  def __post_init__(self):
    if self.num_generations < 2:
      _fail(
        "rl.num_generations", f"GRPO needs >= 2 samples per prompt for a group baseline, got {self.num_generations}."
      )
    if self.clip_eps <= 0:
      _fail("rl.clip_eps", f"must be > 0, got {self.clip_eps}.")
    _at_least(self, "rl.", tis_cap=(0, "0 = TIS off"), max_version_diff=(0, "0 = synchronous"))
    _at_least(self, "rl.", ppo_epochs=(1, ""), minibatches=(1, ""))
    if self.staleness not in STALENESS_MODES:
      _fail("rl.staleness", f"unknown {self.staleness!r}; expected one of {STALENESS_MODES}.")
    if self.mis not in MIS_MODES:
      _fail("rl.mis", f"unknown {self.mis!r}; expected one of {MIS_MODES}.")
    if len(self.mis_band) != 2 or not 0 <= self.mis_band[0] < 1 < self.mis_band[1]:
      _fail("rl.mis_band", f"must be (low, high) with 0 <= low < 1 < high, got {self.mis_band}.")
    if self.trust_region not in TRUST_REGIONS:
      _fail("rl.trust_region", f"unknown {self.trust_region!r}; expected one of {TRUST_REGIONS}.")
    if self.trust_region_delta <= 0:
      _fail("rl.trust_region_delta", f"must be > 0, got {self.trust_region_delta}.")
    if self.guidance_max_staleness < -1:
      _fail(
        "rl.guidance_max_staleness", f"must be >= 0, or -1 (= rl.max_version_diff), got {self.guidance_max_staleness}."
      )

  @property
  def guidance_bound(self) -> int:
    """The oldest guidance (in versions behind the trainer) that still steers rounding."""
    return self.max_version_diff if self.guidance_max_staleness < 0 else self.guidance_max_staleness


MODES = ("bf16", "fp4", "qat", "qat_w4a16", "trace", "trace_full")


def _check_mode(mode: str):
  if mode == "quads":
    _fail(
      "mode",
      "'quads' is now 'qat_w4a16': weight-only QAT on the trainer, the trainer side of QUADS only. QUADS's "
      "rollout-side residual activation compensation is not implemented (its exact formula was not available).",
    )
  if mode not in MODES:
    _fail("mode", f"unknown mode {mode!r}; expected one of {MODES}.")


@dataclasses.dataclass(frozen=True)
class ModeConfig:
  """What a mode of SPEC section 7 means for the engine and the trainer.

  rollout: the engine's config. trainer_quant: the trainer's fake-quant (None = plain BF16).
  guided: whether guidance steers the trainer's rounding (in rollout.guided_layers).
  """

  name: str
  rollout: RolloutConfig
  trainer_quant: QuantConfig | None
  guided: bool


def resolve_mode(mode: str, model: ModelConfig, quant: QuantConfig, trace: TraceConfig = TraceConfig()) -> ModeConfig:
  """bf16 | fp4 | qat | qat_w4a16 | trace | trace_full -> engine and trainer settings."""
  _check_mode(mode)
  guided_fraction, guidance_form, tensors = trace.guided_fraction, trace.guidance_form, trace.tensors
  quant.check_dims(model)
  if mode == "bf16":
    return ModeConfig(mode, RolloutConfig(quant=None), None, False)
  guided_layers, form = (), guidance_form
  if mode == "trace":
    guided_layers = deeper_layers(model.num_layers, guided_fraction)
  elif mode == "trace_full":  # the ablation: full codes of every tensor in every layer
    guided_layers, form, tensors = tuple(range(model.num_layers)), "full", GUIDED_TENSORS
  bf16 = quant.bf16_layer_set(model.num_layers)
  guided_layers = tuple(i for i in guided_layers if i not in bf16)  # BF16 layers have no codes
  rollout = RolloutConfig(
    quant=quant, guided_layers=guided_layers, guided_tensors=tensors, guidance_form=form, record_codes=trace.diagnostics
  )
  trainer = {
    "fp4": dataclasses.replace(quant, targets=()),  # no QAT; the format is kept for measuring
    "qat_w4a16": dataclasses.replace(quant, targets=("experts",), activations=False),  # W4A16
  }.get(mode, quant)
  return ModeConfig(mode, rollout, trainer, mode in ("trace", "trace_full"))


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with linear warmup then cosine decay, and global-norm gradient clipping."""

  learning_rate: float = 3e-5
  warmup_steps: int = 5
  end_lr_fraction: float = 0.1
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.99
  grad_clip: float = 1.0  # 0 = off

  def __post_init__(self):
    if self.learning_rate <= 0:
      _fail("optim.learning_rate", f"must be > 0, got {self.learning_rate}.")
    if self.warmup_steps < 0:
      _fail("optim.warmup_steps", f"must be >= 0, got {self.warmup_steps}.")
    if self.grad_clip < 0:
      _fail("optim.grad_clip", f"must be >= 0 (0 = off), got {self.grad_clip}.")


VERIFIERS = ("exact", "numeric", "code", "math")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """Which verifier and how much each part is worth (format_reward=0 turns the bonus off).

  verifier: 'exact' (the arithmetic and running-sum tasks: the number after the last ';' must equal
    the answer's), 'numeric' (GSM8K-style JSONL: the last number), 'code' (the code tasks: the
    program runs in the sandbox against the hidden tests; data.task code_* needs it), 'math' (the
    response's last \\boxed{} or GSM8K-style final number against the reference through math-verify:
    1/2, 0.5 and \\frac{1}{2} agree; data.task 'math').
  partial_credit: a response whose final answer is wrong still earns correct_reward times the
    share of the answer's intermediate results it got right, in place (exact: the ';'-separated
    results of the running sum; the arithmetic task's answers have only the final one), or the
    share of hidden tests its program passed (code). Note that evaluation reuses this reward at
    correct_reward 1, so with partial credit eval/accuracy is the mean partial score.
  code_timeout_s: the wall-clock limit of one program (code verifier).
  """

  verifier: Literal["exact", "numeric", "code", "math"] = "exact"
  correct_reward: float = 1.0
  format_reward: float = 0.1
  partial_credit: bool = False
  code_timeout_s: float = 2.0

  def __post_init__(self):
    if self.verifier not in VERIFIERS:
      _fail("reward.verifier", f"must be one of {VERIFIERS}, got {self.verifier!r}.")
    if self.partial_credit and self.verifier in ("numeric", "math"):
      _fail(
        "reward.partial_credit",
        f"the {self.verifier!r} verifier has no intermediate results to credit; use 'exact' or 'code'.",
      )
    if not self.code_timeout_s > 0:
      _fail("reward.code_timeout_s", f"must be > 0, got {self.code_timeout_s}.")


TASKS = ("arithmetic", "running_sum", "code_synthesis", "code_jsonl", "math")
CHAT_TEMPLATES = ("auto", "none")
CODE_TASKS = ("code_synthesis", "code_jsonl")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """The task, its size and knobs, the tokenizer and the prompt length.

  task: 'arithmetic' (levels 1-4; or {"prompt", "answer"} JSONL lines when jsonl_train is set),
    'running_sum' (long responses: the prompt's sum_terms terms of term_digits digits, each with a
    blank that the response fills with the partial sum; data/long_tasks.py), 'code_synthesis'
    (write f from 3 input/output pairs; hidden tests run in the sandbox), 'code_jsonl' (MBPP/HumanEval-style problems from jsonl_train /
    jsonl_test). The code tasks need reward.verifier='code' and a model.vocab_size >= 100 (their
    character tokenizer covers printable ASCII), 'math' (math word problems from jsonl_train / jsonl_test,
    JSONL or Parquet, scored by reward.verifier='math'; data/math_tasks.py).
  prompt_field / answer_field: the math task's columns; '' reads GSM8K ('question' / 'answer' ending
    in '#### 42') and MATH / DAPO-style ('problem' / 'solution' with \\boxed{...}) rows alike.
  skip_bad_rows: a malformed row of the math task is skipped and counted, not an error (FILE:LINE).
  chat_template: 'auto' applies the tokenizer's chat template (tokenizer_config.json) to every prompt
    when it has one; 'none' encodes the prompt text as it is. system_prompt: a system message before it.
  levels: the arithmetic task's levels. sum_terms: the running sum's horizon (every response is
    sum_terms * (2 * term_digits + 1) tokens: 13 -> 65 at 2 digits). term_digits: digits per term
    (the work per step: 1 a sum mod 10, 2 an addition with a carry).
  num_train / num_test / seed: the generated tasks' sizes and generator seed (code_synthesis too).
  """

  task: str = "arithmetic"
  tokenizer: str = ""  # '' = the task's character tokenizer; or a tokenizer.json path
  levels: tuple[int, ...] = (1, 2)
  sum_terms: int = 13
  term_digits: int = 2
  num_train: int = 20_000
  num_test: int = 1_000
  seed: int = 0
  data_dir: str = ""  # '' = ~/.cache/trace_jax/tensorflow_datasets
  max_prompt_len: int = 12
  jsonl_train: str = ""
  jsonl_test: str = ""  # '' = evaluate on jsonl_train
  prompt_field: str = ""
  answer_field: str = ""
  skip_bad_rows: bool = False
  chat_template: str = "auto"
  system_prompt: str = ""

  def __post_init__(self):
    if self.task not in TASKS:
      _fail("data.task", f"unknown task {self.task!r}; expected one of {TASKS}.")
    if self.chat_template not in CHAT_TEMPLATES:
      _fail("data.chat_template", f"must be one of {CHAT_TEMPLATES}, got {self.chat_template!r}.")
    if not 2 <= self.sum_terms <= 256:
      _fail("data.sum_terms", f"must lie in [2, 256], got {self.sum_terms}.")
    if not 1 <= self.term_digits <= 6:
      _fail("data.term_digits", f"must lie in [1, 6], got {self.term_digits}.")
    _at_least(self, "data.", num_train=(1, ""), num_test=(1, ""), max_prompt_len=(1, ""))
    if self.task in ("code_jsonl", "math") and not self.jsonl_train:
      _fail("data.jsonl_train", f"task {self.task!r} reads its problems from a file; set data.jsonl_train.")
    if self.task in ("running_sum", "code_synthesis") and (self.jsonl_train or self.jsonl_test):
      _fail(
        "data.jsonl_train", f"task {self.task!r} is generated and reads no JSONL; unset data.jsonl_train/jsonl_test."
      )
    if self.jsonl_test and not self.jsonl_train:
      _fail("data.jsonl_test", "is only read with data.jsonl_train set.")


DEFAULT_SFT_STEPS = 300


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """The supervised warm start, so that RL starts from a policy with partial reward.

  cache_dir: set to share the (deterministic) SFT result between runs, e.g. a sweep's modes.
  seed: the warm start's seed (the initial parameters and the SFT data order); -1: the run's
    `seed`. Set it to run several RL seeds from one warm start (they then share a cache entry).
  steps: -1 = DEFAULT_SFT_STEPS from random weights and none from a pretrained one (init_from).
  """

  steps: int = -1
  batch_size: int = 64
  cache_dir: str = ""
  seed: int = -1
  optim: OptimConfig = OptimConfig(learning_rate=3e-3, warmup_steps=20, end_lr_fraction=0.05)

  def __post_init__(self):
    if self.steps < -1:
      _fail("sft.steps", f"must be >= 0, or -1 for the default; got {self.steps}.")
    if self.seed < -1:
      _fail("sft.seed", f"must be >= 0, or -1 for the run's seed; got {self.seed}.")

  def seed_for(self, run_seed: int) -> int:
    """The warm start's seed in a run seeded `run_seed`."""
    return run_seed if self.seed < 0 else self.seed


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """The trainer's and the rollout engine's meshes over (data, fsdp, expert, tensor) (docs/scaling.md).

  -1 takes the remaining devices. rollout_devices=0 puts both roles on every device; n > 0 gives
  the engine the first n devices and the trainer the rest. moe_impl='ep': the trainer's MoE runs
  expert parallel over 'expert' (all_to_all with `capacity_factor` per expert; a2a 'auto' =
  ragged_all_to_all on GPU/TPU, dense buffers on CPU); the engine never drops a token.
  """

  trainer: Mapping[str, int] = dataclasses.field(default_factory=lambda: dict(data=-1, fsdp=1, expert=1, tensor=1))
  rollout: Mapping[str, int] = dataclasses.field(default_factory=lambda: dict(data=-1, fsdp=1, expert=1, tensor=1))
  rollout_devices: int = 0
  moe_impl: str = "sorted"
  capacity_factor: float = 2.0
  a2a: str = "auto"

  def __post_init__(self):
    if self.moe_impl not in ("sorted", "ep"):
      _fail("mesh.moe_impl", f"unknown {self.moe_impl!r}; expected 'sorted' or 'ep'.")
    if self.capacity_factor <= 0:
      _fail("mesh.capacity_factor", f"must be > 0, got {self.capacity_factor}.")
    if self.rollout_devices < 0:
      _fail("mesh.rollout_devices", f"must be >= 0 (0 = colocated), got {self.rollout_devices}.")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Several hosts: jax.distributed.initialize. Empty / 0 / -1 fall back to JAX_COORDINATOR_ADDRESS,
  JAX_NUM_PROCESSES and JAX_PROCESS_ID, and one process needs none of it."""

  coordinator_address: str = ""
  num_processes: int = 0
  process_id: int = -1


@dataclasses.dataclass(frozen=True)
class JobConfig:
  """The top-level fields of a run's ConfigDict.

  trainer_dtype: the trainer's matmul inputs (fp32 master weights, fp32 accumulation either way);
  'float32' makes sharded-vs-single-device comparisons tight.
  init_from: a Hugging Face model directory (config.json + safetensors) to start from: the model
    section comes from its config.json, the weights load straight into the trainer's shardings, the
    tokenizer is its own (unless data.tokenizer is set) and SFT is off unless sft.steps says otherwise.
  steps: RL steps; 0 runs none and exports the starting policy (WORKDIR/hf/).
  """

  seed: int = 0
  init_from: str = ""
  mode: str = "trace"  # bf16 | fp4 | qat | qat_w4a16 | trace | trace_full
  steps: int = 60
  batch_prompts: int = 8  # prompts per step; x rl.num_generations sequences
  checkpoint_every: int = 10
  keep_checkpoints: int = 3
  eval_every: int = 0  # 0: evaluate only at the end
  eval_prompts: int = 128
  log_every: int = 1
  trainer_dtype: str = "bfloat16"

  def __post_init__(self):
    _check_mode(self.mode)
    _at_least(self, "", steps=(0, "0: export the starting policy"))
    _at_least(self, "", batch_prompts=(1, ""), checkpoint_every=(1, ""), eval_prompts=(1, ""))
    if self.trainer_dtype not in ("bfloat16", "float32"):
      _fail("trainer_dtype", f"unknown {self.trainer_dtype!r}; expected 'bfloat16' or 'float32'.")


# section name -> dataclass; the top-level fields are JobConfig's.
SECTIONS = {
  "quant": QuantConfig,
  "trace": TraceConfig,
  "rollout": SamplingConfig,
  "rl": GRPOConfig,
  "optim": OptimConfig,
  "reward": RewardConfig,
  "data": DataConfig,
  "sft": SFTConfig,
  "mesh": MeshConfig,
  "distributed": DistributedConfig,
}
_TOKENIZER_FIELDS = ("eos_id", "pad_id", "vocab_size", "banned_ids")  # SamplingConfig fields from the tokenizer


def parse_config_arg(arg: str, keys: tuple[str, ...], where: str, example: str) -> dict[str, str]:
  """A get_config() argument 'WORD,key=value,...' -> {'mode': WORD, key: value} (a bare word is the mode).

  keys: the keys besides 'mode' that the config file reads; where / example: for the error message.
  """
  out = {}
  for part in filter(None, (p.strip() for p in (arg or "").split(","))):
    key, sep, value = part.partition("=")
    key, value = ("mode", key) if not sep else (key.strip(), value.strip())
    if key not in ("mode", *keys) or key in out:
      expected = " or ".join(["'MODE'", *(f"'{k}=...'" for k in keys)])
      raise ValueError(f"{where}: cannot read {part!r} in {arg!r}; expected {expected} or both, e.g. {example!r}.")
    out[key] = value
  return out


def to_config_dict(obj) -> ml_collections.ConfigDict:
  """A ConfigDict of a config dataclass's fields (nested dataclasses become sections)."""
  fields = {}
  for f in dataclasses.fields(obj):
    value = getattr(obj, f.name)
    fields[f.name] = to_config_dict(value) if dataclasses.is_dataclass(value) else value
  return ml_collections.ConfigDict(fields)


def defaults() -> ml_collections.ConfigDict:
  """Every section at its dataclass defaults, and the top-level fields. `model` is left to a preset."""
  c = to_config_dict(JobConfig())
  for name, cls in SECTIONS.items():
    c[name] = to_config_dict(cls())
  for name in _TOKENIZER_FIELDS:
    del c.rollout[name]
  return c


def section(cls, config_section: Mapping[str, Any] | Any, prefix: str):
  """A frozen config dataclass from a ConfigDict section (or a plain dict), rejecting unknown fields.

  Missing fields take the dataclass defaults; nested dataclass fields (sft.optim) are read the same way.
  """
  data = dict(config_section.to_dict() if hasattr(config_section, "to_dict") else config_section)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(data) - set(fields))
  if unknown:
    _fail(f"{prefix}.{unknown[0]}", f"unknown field; {cls.__name__} has {sorted(fields)}.")
  for key, value in data.items():
    if isinstance(value, list):
      data[key] = tuple(value)
    default = fields[key].default
    if dataclasses.is_dataclass(default) and isinstance(value, Mapping):
      data[key] = section(type(default), value, f"{prefix}.{key}")
  try:
    return cls(**data)
  except TypeError as e:
    raise ConfigError(f"config.{prefix}: {e}") from None


def model_config(config_section) -> ModelConfig:
  """ModelConfig from the `model` section of a ConfigDict (or a plain dict)."""
  return section(ModelConfig, config_section, "model")


def unset_model_section() -> ml_collections.ConfigDict:
  """A `model` section of placeholders (None, typed) for runs whose model comes from init_from: a
  --config.model.FIELD override then parses, and must agree with the checkpoint's config.json."""
  types = {"int": int, "float": float, "bool": bool, "str": str}
  fields = {}
  for f in dataclasses.fields(ModelConfig):
    kind = types.get(str(f.type), tuple)
    fields[f.name] = ml_collections.FieldReference(None, field_type=kind)
  return ml_collections.ConfigDict(fields)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """The validated, frozen view of a run's ConfigDict: one field per section (see the module docstring)."""

  job: JobConfig
  model: ModelConfig
  quant: QuantConfig
  trace: TraceConfig
  sampling: SamplingConfig
  grpo: GRPOConfig
  optim: OptimConfig
  reward: RewardConfig
  data: DataConfig
  sft: SFTConfig
  mesh: MeshConfig
  distributed: DistributedConfig
  mode: ModeConfig

  def __post_init__(self):
    if self.quant.two_level and self.mesh.moe_impl == "ep":
      _fail(
        "quant.tensor_scale",
        "two-level scaling needs the amax of the whole batch, which expert-parallel shards do not share "
        "(not implemented); use mesh.moe_impl='sorted' or quant.tensor_scale='none'.",
      )
    sequences = self.job.batch_prompts * self.grpo.num_generations
    if sequences % self.grpo.minibatches:
      _fail(
        "rl.minibatches",
        f"{self.grpo.minibatches} mini-batches cannot split a rollout batch of batch_prompts x rl.num_generations = "
        f"{self.job.batch_prompts} x {self.grpo.num_generations} = {sequences} sequences; it must divide {sequences}.",
      )

  @classmethod
  def from_config(cls, cfg: ml_collections.ConfigDict, tokenizer=None) -> RunConfig:
    """tokenizer: supplies EOS / PAD and the vocabulary the model must cover (None: the defaults)."""
    top = {k: v for k, v in cfg.items() if k not in SECTIONS and k != "model"}
    job = section(JobConfig, top, "config")
    if job.init_from and any(v is None for v in cfg.get("model", {None: None}).values()):
      _fail(
        "model",
        f"comes from init_from={job.init_from}: fill it from the checkpoint's config.json first with "
        "hf.with_pretrained_model(cfg) (trace_jax.main, export and evaluate do).",
      )
    model = model_config(cfg.model)
    sft = section(SFTConfig, cfg.get("sft", {}), "sft")
    if sft.steps < 0:
      sft = dataclasses.replace(sft, steps=0 if job.init_from else DEFAULT_SFT_STEPS)
    quant = section(QuantConfig, cfg.get("quant", {}), "quant")
    trace = section(TraceConfig, cfg.get("trace", {}), "trace")
    run = cls(
      job=job,
      model=model,
      quant=quant,
      trace=trace,
      sampling=section(SamplingConfig, cfg.get("rollout", {}), "rollout"),
      grpo=section(GRPOConfig, cfg.get("rl", {}), "rl"),
      optim=section(OptimConfig, cfg.get("optim", {}), "optim"),
      reward=section(RewardConfig, cfg.get("reward", {}), "reward"),
      data=section(DataConfig, cfg.get("data", {}), "data"),
      sft=sft,
      mesh=section(MeshConfig, cfg.get("mesh", {}), "mesh"),
      distributed=section(DistributedConfig, cfg.get("distributed", {}), "distributed"),
      mode=resolve_mode(job.mode, model, quant, trace),
    )
    if run.sampling.temperature == 0:
      _fail(
        "rollout.temperature",
        "0 is greedy decoding: every sample of a group would be the same response, and its log-probs those of "
        "a policy that did not sample it. RL needs sampling: set it > 0 (1.0 samples the model's distribution).",
      )
    return run if tokenizer is None else run.with_tokenizer(tokenizer)

  def with_tokenizer(self, tokenizer) -> RunConfig:
    """The sampling fields that come from the tokenizer (EOS, PAD, its vocabulary and the ids never
    sampled); `model.vocab_size` is the embedding's rows, which must cover the tokenizer's vocabulary."""
    if self.model.vocab_size < tokenizer.vocab_size:
      _fail(
        "model.vocab_size",
        f"{self.model.vocab_size} is smaller than the tokenizer's vocabulary ({tokenizer.vocab_size}); raise it.",
      )
    sampling = dataclasses.replace(
      self.sampling,
      eos_id=tokenizer.eos_id,
      pad_id=tokenizer.pad_id,
      vocab_size=tokenizer.vocab_size,
      banned_ids=never_generated_ids(tokenizer),
    )
    return dataclasses.replace(self, sampling=sampling)

  @property
  def trainer_dtype(self):
    import jax.numpy as jnp  # noqa: PLC0415 (config stays importable without jax)

    return jnp.dtype(self.job.trainer_dtype)


def never_generated_ids(tokenizer) -> tuple[int, ...]:
  """Ids a response never holds and the engine must never sample: PAD and BOS (when there is one).

  EOS is excepted: a tokenizer without a PAD pads with EOS, and some use one token for BOS and EOS.
  """
  ids = {tokenizer.pad_id, tokenizer.bos_id} - {None, tokenizer.eos_id}
  return tuple(sorted(ids))
