"""Model presets as ml_collections ConfigDicts (validated by trace_jax.config.model_config)."""

import ml_collections


def tiny() -> ml_collections.ConfigDict:
  """The embedded CPU default: 4 layers, 8 experts top-2; dims are whole NVFP4 blocks."""
  return ml_collections.ConfigDict(
      dict(
          vocab_size=64,
          hidden_size=64,
          num_layers=4,
          num_heads=4,
          num_kv_heads=2,
          head_dim=32,
          num_experts=8,
          num_experts_per_tok=2,
          moe_intermediate_size=32,
          rope_theta=10000.0,
          max_position_embeddings=256,
      )
  )
