"""Model presets: the `model` section of a config, validated by `trace_jax.config.model_config`.

Pick one on the command line with `--config=configs/default.py:trace,model=qwen3_30b_a3b`, or
import them (`from configs import models; config.model = models.tiny()`).
"""

import ml_collections


def _qwen3_moe(**fields) -> ml_collections.ConfigDict:
  """Qwen3-MoE's fixed features (as every released Qwen3-MoE config.json has them): top-k weights
  renormalized, every layer sparse, QK-norm, untied embeddings; `fields` set the rest (or replace these)."""
  fixed = dict(
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    qk_norm=True,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    router_aux_loss_coef=0.001,
    initializer_range=0.02,
  )
  return ml_collections.ConfigDict({**fixed, **fields})


def tiny() -> ml_collections.ConfigDict:
  """The CPU default: a 4-layer, 8-expert Qwen3-MoE over the character tokenizer's vocabulary.

  head_dim and moe_intermediate_size are multiples of 16, so NVFP4 experts and KV cache apply.
  """
  return _qwen3_moe(
    vocab_size=64,  # embedding rows, >= the tokenizer's size (read from the tokenizer: 18); extra ids never sampled
    hidden_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    intermediate_size=0,  # no dense layers
    rope_theta=10_000.0,
    max_position_embeddings=256,
  )


def qwen3_30b_a3b() -> ml_collections.ConfigDict:
  """Qwen/Qwen3-30B-A3B as published in its config.json (30.5B parameters, 3.3B active)."""
  return _qwen3_moe(
    vocab_size=151936,
    hidden_size=2048,
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    intermediate_size=6144,
    rope_theta=1_000_000.0,
    max_position_embeddings=40960,
  )


def _qwen3_5(**fields) -> ml_collections.ConfigDict:
  """The Qwen3.5-MoE text model's fixed features: Qwen3-MoE's, plus every layer MoE with a gated shared
  expert, gated full attention with partial RoPE, zero-centred RMSNorm, Gated DeltaNet layers."""
  return _qwen3_moe(
    intermediate_size=0, attention_output_gate=True, zero_centered_norm=True, linear_conv_kernel_dim=4, **fields
  )


def tiny_hybrid() -> ml_collections.ConfigDict:
  """A tiny Qwen3.5-MoE hybrid for CPU: 4 layers, 3 Gated DeltaNet : 1 gated full attention (the
  released models' pattern), 8 experts top-2 plus a shared expert; sizes as `tiny`. FP4 applies to
  the routed experts and the one full-attention layer's KV cache."""
  return _qwen3_5(
    vocab_size=64,
    hidden_size=64,
    num_layers=4,
    full_attention_interval=4,  # layers 0-2 Gated DeltaNet, layer 3 full attention
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    partial_rotary_factor=0.25,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_chunk_size=16,
    rope_theta=10_000.0,
    tie_word_embeddings=False,
    max_position_embeddings=256,
  )


def qwen3_5_35b_a3b() -> ml_collections.ConfigDict:
  """Qwen/Qwen3.5-35B-A3B's text model as published (text_config of its config.json): 40 layers,
  3 Gated DeltaNet : 1 gated attention, 256 experts top-8 + a shared expert (35B total, 3B active)."""
  return _qwen3_5(
    vocab_size=248320,
    hidden_size=2048,
    num_layers=40,
    full_attention_interval=4,  # 30 Gated DeltaNet layers, full attention at 3, 7, ..., 39
    num_heads=16,
    num_kv_heads=2,
    head_dim=256,
    partial_rotary_factor=0.25,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_chunk_size=64,
    rope_theta=10_000_000.0,
    tie_word_embeddings=False,
    max_position_embeddings=262144,
  )


PRESETS = {"tiny": tiny, "qwen3_30b_a3b": qwen3_30b_a3b, "tiny_hybrid": tiny_hybrid, "qwen3_5_35b_a3b": qwen3_5_35b_a3b}


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
  if preset not in PRESETS:
    raise ValueError(f"configs/models.py: unknown preset {preset!r}; expected one of {sorted(PRESETS)}.")
  return PRESETS[preset]()
