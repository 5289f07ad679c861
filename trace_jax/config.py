"""Validated, frozen configs built from ml_collections ConfigDicts.

`configs/*.py` hold the user-facing `get_config()` files; this module turns their sections
into frozen dataclasses (hashable, so they can be static jit arguments) and rejects
inconsistent settings with an error that names the field and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from trace_jax import fp4
from trace_jax.quantizer import GUIDANCE_FORMS


class ConfigError(ValueError):
  """An inconsistent or unknown configuration value."""


def _fail(field: str, message: str):
  raise ConfigError(f"config.{field}: {message}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Qwen3-MoE-family decoder (also covers Qwen2-MoE shared experts and Mixtral)."""

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

  def is_moe_layer(self, layer: int) -> bool:
    """The Qwen-MoE rule for which layers are sparse."""
    return self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

  @property
  def moe_layers(self) -> tuple[int, ...]:
    return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))


# Where FP4 fake-quant / FP4 storage applies (SPEC section 2.5); the rest stays BF16.
QUANT_TARGETS = ("experts", "kv", "attention", "dense_mlp", "shared_expert")
# Activation tensors that the rollout records guidance for, per layer.
GUIDED_TENSORS = ("moe_input", "moe_hidden", "key", "value")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
  """What the trainer fake-quantizes and the rollout stores in FP4.

  targets: subset of QUANT_TARGETS. `experts` = routed-expert matmuls (weights and, when
  `activations`, their inputs); `kv` = K/V as stored in the KV cache.
  weights / activations: W4 and A4 switches (quads = weights only).
  """

  fmt: str = "nvfp4"
  targets: tuple[str, ...] = ("experts", "kv")
  weights: bool = True
  activations: bool = True
  clip_gradient: bool = False

  def __post_init__(self):
    try:
      fp4.get_format(self.fmt)
    except ValueError as e:
      _fail("quant.fmt", str(e))
    unknown = sorted(set(self.targets) - set(QUANT_TARGETS))
    if unknown:
      _fail("quant.targets", f"unknown targets {unknown}; expected a subset of {QUANT_TARGETS}.")

  @property
  def format(self) -> fp4.Fp4Format:
    return fp4.get_format(self.fmt)

  def quantizes(self, target: str) -> bool:
    return target in self.targets

  def check_dims(self, model: ModelConfig):
    """Every quantized contraction axis must be a whole number of blocks."""
    block = self.format.block_size
    dims = {}
    if "experts" in self.targets:
      dims.update(hidden_size=model.hidden_size, moe_intermediate_size=model.moe_intermediate_size)
    if "kv" in self.targets:
      dims["head_dim"] = model.head_dim
    if "attention" in self.targets:
      dims.update(hidden_size=model.hidden_size, head_dim=model.head_dim)
    if "dense_mlp" in self.targets:
      dims.update(hidden_size=model.hidden_size, intermediate_size=model.intermediate_size)
    if "shared_expert" in self.targets:
      dims.update(hidden_size=model.hidden_size, shared_expert_intermediate_size=model.shared_expert_intermediate_size)
    for name, d in dims.items():
      if d % block:
        _fail(f"model.{name}", f"{d} is not a multiple of the {self.fmt} block size {block}; FP4 needs whole blocks.")


def _from_mapping(cls, section: Mapping[str, Any] | Any, prefix: str):
  data = dict(section.to_dict() if hasattr(section, "to_dict") else section)
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(data) - names)
  if unknown:
    _fail(f"{prefix}.{unknown[0]}", f"unknown field; {cls.__name__} has {sorted(names)}.")
  for key, value in data.items():
    if isinstance(value, list):
      data[key] = tuple(value)
  try:
    return cls(**data)
  except TypeError as e:
    raise ConfigError(f"config.{prefix}: {e}") from None


def model_config(section) -> ModelConfig:
  """ModelConfig from the `model` section of a ConfigDict (or a plain dict)."""
  return _from_mapping(ModelConfig, section, "model")


def quant_config(section) -> QuantConfig:
  return _from_mapping(QuantConfig, section, "quant")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How the rollout engine samples. temperature 0 = greedy; top_k 0 / top_p 1 = off.

  vocab_size: the tokenizer's vocabulary; logits of ids >= vocab_size (embedding rows padded
  beyond it, model.vocab_size > vocab_size) are never sampled. 0: every logit is a token.
  banned_ids: ids that are never sampled either (PAD, BOS). The trainer's log-probs use the
  same masked distribution (model.policy_logits).
  """

  max_new_tokens: int = 16
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
    if self.max_new_tokens < 1:
      _fail("sampling.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}.")
    if self.temperature < 0:
      _fail("sampling.temperature", f"must be >= 0 (0 = greedy), got {self.temperature}.")
    if self.top_k < 0:
      _fail("sampling.top_k", f"must be >= 0 (0 = off), got {self.top_k}.")
    if not 0 < self.top_p <= 1:
      _fail("sampling.top_p", f"must lie in (0, 1], got {self.top_p}.")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """The rollout engine: FP4 or BF16, and what it records for the trainer.

  quant=None: the BF16 engine. guided_layers: layers whose guidance is recorded in
  `guidance_form`. record_codes: also record full codes in every quantized layer
  (per-layer agreement diagnostics; costs memory, not shipped as guidance).
  matmul_impl: 'auto' (Pallas kernel on GPU, jnp reference elsewhere), 'pallas', 'reference'.
  """

  quant: QuantConfig | None = QuantConfig()
  guided_layers: tuple[int, ...] = ()
  guidance_form: str = "mantissa_scale"
  record_codes: bool = False
  matmul_impl: str = "auto"
  compute_dtype: str = "bfloat16"  # 'float32' for exact parity tests against the trainer

  def __post_init__(self):
    if self.compute_dtype not in ("bfloat16", "float32"):
      _fail("rollout.compute_dtype", f"unknown {self.compute_dtype!r}; expected 'bfloat16' or 'float32'.")
    if self.guidance_form not in GUIDANCE_FORMS:
      _fail("rollout.guidance_form", f"unknown form {self.guidance_form!r}; expected one of {GUIDANCE_FORMS}.")
    if self.matmul_impl not in ("auto", "pallas", "reference"):
      _fail("rollout.matmul_impl", f"unknown {self.matmul_impl!r}; expected 'auto', 'pallas' or 'reference'.")
    for name in ("guided_layers", "record_codes"):
      if self.quant is None and getattr(self, name):
        _fail(f"rollout.{name}", "a BF16 engine (quant=None) has no FP4 codes to record.")
    if any(i < 0 for i in self.guided_layers):
      _fail("rollout.guided_layers", f"layer indices must be >= 0, got {self.guided_layers}.")


def deeper_layers(num_layers: int, fraction: float) -> tuple[int, ...]:
  """The deepest `fraction` of the layers (TRACE's selective depth; 0.5 = the second half)."""
  if not 0 <= fraction <= 1:
    _fail("guided_fraction", f"must lie in [0, 1], got {fraction}.")
  n = round(num_layers * fraction)
  return tuple(range(num_layers - n, num_layers))


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """num_generations: G samples per prompt. tis_cap: C in min(pi_train / pi_rollout, C) (0 = off)."""

  num_generations: int = 8
  clip_eps: float = 0.2
  clip_eps_high: float | None = None  # asymmetric (DAPO-style) upper clip; None = clip_eps
  tis_cap: float = 5.0
  kl_coef: float = 0.0
  normalize_std: bool = True
  routing_replay: bool = True
  aux_loss_coef: float = 0.0
  ppo_epochs: int = 1

  def __post_init__(self):
    if self.num_generations < 2:
      _fail(
        "rl.num_generations", f"GRPO needs >= 2 samples per prompt for a group baseline, got {self.num_generations}."
      )
    if self.clip_eps <= 0:
      _fail("rl.clip_eps", f"must be > 0, got {self.clip_eps}.")
    if self.tis_cap < 0:
      _fail("rl.tis_cap", f"must be >= 0 (0 = TIS off), got {self.tis_cap}.")
    if self.ppo_epochs < 1:
      _fail("rl.ppo_epochs", f"must be >= 1, got {self.ppo_epochs}.")


MODES = ("bf16", "fp4", "qat", "quads", "trace", "trace_full")


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


def resolve_mode(
  mode: str,
  model: ModelConfig,
  quant: QuantConfig,
  *,
  guided_fraction: float = 0.5,
  guidance_form: str = "mantissa_scale",
  diagnostics: bool = True,
  matmul_impl: str = "auto",
) -> ModeConfig:
  """bf16 | fp4 | qat | quads | trace | trace_full -> engine and trainer settings.

  diagnostics: the FP4 engine also records full codes in every layer so that per-layer
  codeword agreement can be measured in every mode (costs rollout memory, not guidance).
  """
  if mode not in MODES:
    _fail("mode", f"unknown mode {mode!r}; expected one of {MODES}.")
  quant.check_dims(model)
  if mode == "bf16":
    return ModeConfig(mode, RolloutConfig(quant=None, matmul_impl=matmul_impl), None, False)
  guided_layers, form = (), guidance_form
  if mode == "trace":
    guided_layers = deeper_layers(model.num_layers, guided_fraction)
  elif mode == "trace_full":
    guided_layers, form = tuple(range(model.num_layers)), "full"
  rollout = RolloutConfig(
    quant=quant, guided_layers=guided_layers, guidance_form=form, record_codes=diagnostics, matmul_impl=matmul_impl
  )
  trainer = {
    "fp4": dataclasses.replace(quant, targets=()),  # no QAT; the format is kept for measuring
    "quads": dataclasses.replace(quant, targets=("experts",), activations=False),  # W4A16
  }.get(mode, quant)
  return ModeConfig(mode, rollout, trainer, mode in ("trace", "trace_full"))


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with linear warmup then cosine decay, and global-norm gradient clipping."""

  learning_rate: float = 1e-5
  warmup_steps: int = 0
  end_lr_fraction: float = 0.1
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  grad_clip: float = 1.0

  def __post_init__(self):
    if self.learning_rate <= 0:
      _fail("optim.learning_rate", f"must be > 0, got {self.learning_rate}.")
    if self.warmup_steps < 0:
      _fail("optim.warmup_steps", f"must be >= 0, got {self.warmup_steps}.")
    if self.grad_clip < 0:
      _fail("optim.grad_clip", f"must be >= 0 (0 = off), got {self.grad_clip}.")


def section(cls, config_section, prefix: str):
  """A frozen config dataclass from a ConfigDict section, rejecting unknown fields."""
  return _from_mapping(cls, config_section, prefix)
