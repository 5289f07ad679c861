"""Model presets: the `model` section of a config, validated by `trace_jax.config.model_config`.

Pick one on the command line with `--config=configs/default.py:trace,model=qwen3_30b_a3b`, or
import them (`from configs import models; config.model = models.tiny()`).
"""

import ml_collections


def tiny() -> ml_collections.ConfigDict:
  """The CPU default: a 4-layer, 8-expert Qwen3-MoE over the character tokenizer's vocabulary.

  head_dim and moe_intermediate_size are multiples of 16, so NVFP4 experts and KV cache apply.
  """
  return ml_collections.ConfigDict(
    dict(
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
      norm_topk_prob=True,
      decoder_sparse_step=1,
      mlp_only_layers=[],
      qk_norm=True,
      rope_theta=10_000.0,
      rms_norm_eps=1e-6,
      tie_word_embeddings=False,
      router_aux_loss_coef=0.001,
      max_position_embeddings=256,
      initializer_range=0.02,
    )
  )


def qwen3_30b_a3b() -> ml_collections.ConfigDict:
  """Qwen/Qwen3-30B-A3B as published in its config.json (30.5B parameters, 3.3B active)."""
  return ml_collections.ConfigDict(
    dict(
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
      norm_topk_prob=True,
      decoder_sparse_step=1,
      mlp_only_layers=[],
      qk_norm=True,
      rope_theta=1_000_000.0,
      rms_norm_eps=1e-6,
      tie_word_embeddings=False,
      router_aux_loss_coef=0.001,
      max_position_embeddings=40960,
      initializer_range=0.02,
    )
  )


PRESETS = {"tiny": tiny, "qwen3_30b_a3b": qwen3_30b_a3b}


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
  if preset not in PRESETS:
    raise ValueError(f"configs/models.py: unknown preset {preset!r}; expected one of {sorted(PRESETS)}.")
  return PRESETS[preset]()
