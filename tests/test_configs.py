"""Model presets (configs/models.py) and the run config (configs/default.py, trace_jax/config.py): valid and checked."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from configs import default, models
from trace_jax import model
from trace_jax.config import (
  DEFAULT_SFT_STEPS,
  SECTIONS,
  ConfigError,
  QuantConfig,
  RunConfig,
  SFTConfig,
  defaults,
  model_config,
)

DEFAULT_FILE = pathlib.Path(default.__file__)
PRESETS = sorted(models.PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_validate(preset):
  c = model_config(models.get_config(preset))
  assert c.num_layers == len(c.moe_layers)  # every layer sparse
  for fmt in ("nvfp4", "mxfp4"):
    QuantConfig(fmt=fmt, targets=("experts", "kv", "attention")).check_dims(c)


def test_tiny_preset():
  c = model_config(models.tiny())
  assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (64, 64, 4, 4, 2, 32)
  assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.rope_theta) == (8, 2, 32, 10_000.0)
  params = jax.eval_shape(lambda: model.init_params(c, jax.random.key(0)))
  tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
  logits, _ = jax.eval_shape(lambda p, t: model.forward(p, t, jnp.ones_like(t), c), params, tokens)
  assert logits.shape == (2, 16, 64)


def parameter_counts(c) -> tuple[int, int]:
  """(all parameters, those active per token) of a model config, from abstract shapes (nothing allocated)."""
  params = jax.eval_shape(lambda: model.init_params(c, jax.random.key(0)))
  total = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
  experts = sum(
    int(np.prod(w.shape)) for layer in params.layers for w in (layer.mlp.gate, layer.mlp.up, layer.mlp.down)
  )
  return total, total - experts + experts * c.num_experts_per_tok // c.num_experts


def test_qwen3_5_35b_a3b_parameter_count():
  """Qwen3.5-35B-A3B's text model: 34.7B parameters (the published 35B also counts the vision tower and the
  MTP head, which this model does not load), 3.45B active per token (embeddings and lm_head included; 'A3B')."""
  c = model_config(models.qwen3_5_35b_a3b())
  assert c.linear_layers == tuple(i for i in range(40) if (i + 1) % 4) and len(c.attention_layers) == 10
  total, active = parameter_counts(c)
  assert 34.5e9 < total < 35.0e9, total
  assert 3.3e9 < active < 3.6e9, active


def test_qwen3_30b_a3b_parameter_count():
  """30.5B parameters in all and 3.3B active per token, as Qwen reports."""
  c = model_config(models.qwen3_30b_a3b())
  total, active = parameter_counts(c)
  assert 30.4e9 < total < 30.6e9, total
  assert 3.2e9 < active < 3.4e9, active


@pytest.mark.parametrize("preset", PRESETS)
def test_the_run_config_picks_a_preset_with_overrides(preset):
  """--config=configs/default.py:qat,model=PRESET --config.model.num_layers=2 (the flag main defines)."""
  argv = ["prog", f"--config={DEFAULT_FILE}:qat,model={preset}", "--config.model.num_layers=2"]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, flag_values=fv, sys_argv=argv)
  fv(argv)
  run = RunConfig.from_config(fv.config)
  assert run.mode.name == "qat" and run.model.num_layers == 2
  assert run.model.hidden_size == models.get_config(preset).hidden_size


@pytest.mark.parametrize("arg", ["trace,size=big", "trace,bf16", "model=tiny,model=tiny"])
def test_bad_config_argument_is_named(arg):
  with pytest.raises(ValueError, match="configs/default.py: cannot read"):
    default.get_config(arg)


def test_config_defaults_live_in_the_dataclasses():
  """configs/default.py takes every section from the config dataclasses: one place for defaults."""
  cfg = default.get_config()
  run = RunConfig.from_config(cfg)
  resolved = {"sft": SFTConfig(steps=DEFAULT_SFT_STEPS)}  # -1: the default number of SFT steps from random weights
  for name, cls in SECTIONS.items():
    field = {"rollout": "sampling", "rl": "grpo"}.get(name, name)
    assert getattr(run, field) == resolved.get(name, cls())
  assert cfg.to_dict() == {**defaults().to_dict(), "model": models.tiny().to_dict()}


def test_unknown_preset():
  with pytest.raises(ValueError, match="unknown preset 'qwen3_235b'"):
    models.get_config("qwen3_235b")


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize(
  "overrides, field",
  [
    (dict(num_experts_per_tok=1000), "model.num_experts_per_tok"),
    (dict(num_kv_heads=3), "model.num_heads"),
    (dict(head_dim=31), "model.head_dim"),
    (dict(hidden_size=0), "model.hidden_size"),
    (dict(mlp_only_layers=[99]), "model.mlp_only_layers"),
    (dict(decoder_sparse_step=0), "model.decoder_sparse_step"),
    (dict(moe_intermediate_size=0), "model.moe_intermediate_size"),
  ],
)
def test_bad_values_name_the_field(preset, overrides, field):
  cfg = models.get_config(preset)
  cfg.update(overrides)
  with pytest.raises(ConfigError, match=rf"config\.{field}\b"):
    model_config(cfg)


def test_unknown_field_is_named():
  cfg = models.tiny()
  cfg.num_expert = 4  # a typo of num_experts
  with pytest.raises(ConfigError, match=r"config\.model\.num_expert\b.*unknown field"):
    model_config(cfg)


@pytest.mark.parametrize(
  "overrides, fmt, field",
  [
    (dict(head_dim=40), "nvfp4", "model.head_dim"),
    (dict(moe_intermediate_size=48), "mxfp4", "model.moe_intermediate_size"),
    (dict(hidden_size=72, num_heads=4), "nvfp4", "model.hidden_size"),
  ],
)
def test_quant_block_must_divide_dims(overrides, fmt, field):
  cfg = models.tiny()
  cfg.update(overrides)
  with pytest.raises(ConfigError, match=rf"config\.{field}\b.*{fmt}"):
    QuantConfig(fmt=fmt).check_dims(model_config(cfg))


def test_greedy_rollouts_are_refused_for_rl():
  cfg = default.get_config()
  cfg.rollout.temperature = 0.0
  with pytest.raises(ConfigError, match=r"config\.rollout\.temperature: 0 is greedy"):
    RunConfig.from_config(cfg)


def test_the_renamed_quads_mode_says_what_it_is():
  cfg = default.get_config("quads")
  with pytest.raises(ConfigError, match=r"config\.mode: 'quads' is now 'qat_w4a16'.*rollout-side"):
    RunConfig.from_config(cfg)


def test_guidance_bytes_per_tensor_set_from_the_engine_shapes():
  """experiments/aot_compile.py's accounting, on a 2-layer Qwen3-30B-A3B (one guided layer): per token
  and guided layer, NVFP4 mantissa + scale costs 1.5 bits per element of each shipped tensor."""
  from experiments import aot_compile

  table = aot_compile.guidance_bytes(aot_compile.scaled_config(num_layers=2))
  h, k, inter, kv = 2048, 8, 768, 4 * 128
  bits = lambda elements: elements * 3 // 16  # 1.5 bits
  assert table["moe_input (the paper's accounting)"] == {"total": bits(h), "moe_input": bits(h)}
  assert table["all four"]["total"] == bits(h) + bits(k * inter) + 2 * bits(kv)
  assert table["trace_full: full codes, all four, every layer"]["total"] == 2 * 3 * table["all four"]["total"]


@pytest.mark.parametrize(
  "overrides, message",
  [
    ({"rl.minibatches": 0}, r"config\.rl\.minibatches: must be >= 1"),
    ({"rl.minibatches": 3}, r"config\.rl\.minibatches: 3 mini-batches .* 8 x 8 = 64 sequences; it must divide 64"),
    ({"rl.minibatches": 16, "batch_prompts": 4, "rl.num_generations": 2}, r"4 x 2 = 8 sequences"),
  ],
)
def test_minibatches_must_split_the_rollout_batch(overrides, message):
  cfg = default.get_config()
  for key, value in overrides.items():
    section, _, name = key.rpartition(".")
    (cfg[section] if section else cfg)[name] = value
  with pytest.raises(ConfigError, match=message):
    RunConfig.from_config(cfg)


def test_minibatches_that_divide_the_batch_are_accepted():
  cfg = default.get_config()
  cfg.rl.minibatches, cfg.rl.ppo_epochs = 4, 2
  run = RunConfig.from_config(cfg)
  assert (run.grpo.minibatches, run.grpo.ppo_epochs) == (4, 2)


def test_two_level_scaling_is_refused_with_expert_parallelism():
  cfg = default.get_config()
  cfg.quant.tensor_scale, cfg.mesh.moe_impl = "batch_amax", "ep"
  with pytest.raises(ConfigError, match=r"config\.quant\.tensor_scale: .*expert-parallel"):
    RunConfig.from_config(cfg)
  cfg.mesh.moe_impl = "sorted"
  assert RunConfig.from_config(cfg).mode.rollout.quant.two_level


def test_sft_seed_shares_one_warm_start_between_run_seeds():
  """sft.seed >= 0: runs of any seed share the warm start of that seed (one cache entry, the same
  key as that seed's own run); -1 keys it by the run's seed; below -1 is refused."""
  from trace_jax import job

  def cache(seed, sft_seed):
    cfg = default.get_config("trace")
    cfg.seed, cfg.sft.seed, cfg.sft.cache_dir = seed, sft_seed, "/cache"
    return job.sft_cache_path(cfg)

  assert cache(1, 0) == cache(2, 0) == cache(0, 0) == cache(0, -1)
  assert cache(1, -1) != cache(0, -1) and cache(1, -1) == cache(1, 1)
  assert RunConfig.from_config(default.get_config("trace")).sft.seed_for(7) == 7
  cfg = default.get_config("trace")
  cfg.sft.seed = 3
  assert RunConfig.from_config(cfg).sft.seed_for(7) == 3
  cfg.sft.seed = -2
  with pytest.raises(ConfigError, match=r"config\.sft\.seed\b"):
    RunConfig.from_config(cfg)
