"""Hugging Face checkpoints: logit parity with transformers, export round trips, loader errors.

Tiny random Qwen3-MoE and Mixtral models are built offline with transformers (fp32, eager
attention), saved with `save_pretrained`, loaded with `hf.load_pretrained`, and compared on a
batch with one left-padded row (real tokens only). Run with `-s` to see the measured figures.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from configs import models
from trace_jax import hf, model, qat
from trace_jax.config import model_config

PARITY_ATOL = 1e-4
B, S, PAD = 2, 12, 4
COMMON = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_experts_per_tok=2, rms_norm_eps=1e-6)
CASES = {
  # heads/kv 4/4, head_dim = hidden/heads, top-k weights not renormalized
  "qwen3_mha": (Qwen3MoeConfig, dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16, norm_topk_prob=False)),
  # heads/kv 4/2, head_dim 32 != hidden/heads, tied embeddings, a dense layer
  "qwen3_gqa_tied_dense": (
    Qwen3MoeConfig,
    dict(
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=32,
      norm_topk_prob=True,
      tie_word_embeddings=True,
      mlp_only_layers=[1],
      intermediate_size=48,
    ),
  ),
  # heads/kv 8/1 (MQA)
  "qwen3_mqa": (Qwen3MoeConfig, dict(num_attention_heads=8, num_key_value_heads=1, head_dim=16, norm_topk_prob=True)),
  # Mixtral: head_dim absent from config.json (hidden/heads), then given and != hidden/heads
  "mixtral": (MixtralConfig, dict(num_attention_heads=4, num_key_value_heads=2)),
  "mixtral_head_dim": (MixtralConfig, dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32)),
}
EXPERTS = {
  Qwen3MoeConfig: dict(num_experts=8, moe_intermediate_size=32, rope_theta=10_000.0),
  MixtralConfig: dict(num_local_experts=8, intermediate_size=32),  # rope_theta: Mixtral's default 1e6
}
FP32 = qat.QatContext(compute_dtype=jnp.float32)


@functools.partial(jax.jit, static_argnums=3)
def our_logits(params, tokens, mask, config):
  return model.forward(params, tokens, mask, config, ctx=FP32)[0]


def hf_logits(hf_model, tokens, mask):
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0)  # as ours: attention.positions_from_mask
  with torch.no_grad():
    out = hf_model(
      input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask), position_ids=torch.tensor(positions)
    )
  return out.logits.numpy()


def build_hf_model(name: str):
  config_cls, kwargs = CASES[name]
  config = config_cls(**COMMON, **EXPERTS[config_cls], **kwargs, attn_implementation="eager")
  torch.manual_seed(sorted(CASES).index(name))
  m = (Qwen3MoeForCausalLM if config_cls is Qwen3MoeConfig else MixtralForCausalLM)(config)
  with torch.no_grad():  # O(1) logits and decisive routing; norms away from 1 so a swapped norm shows
    for p in m.parameters():
      p.copy_(1 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.1 * torch.randn_like(p))
  return m.eval()


@pytest.fixture(scope="module")
def batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, COMMON["vocab_size"], (B, S))
  mask = np.ones((B, S), np.int64)
  mask[1, :PAD] = 0
  return tokens, mask


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory, batch):
  """An HF model, its save_pretrained directory, our load of it, and both logits."""
  name = request.param
  hf_model = build_hf_model(name)
  path = tmp_path_factory.mktemp(name) / "hf"
  hf_model.save_pretrained(path)
  config, params = hf.load_pretrained(path)
  tokens, mask = batch
  return dict(
    name=name,
    hf_model=hf_model,
    path=path,
    config=config,
    params=params,
    hf_logits=hf_logits(hf_model, tokens, mask),
    our_logits=np.asarray(our_logits(params, jnp.asarray(tokens), jnp.asarray(mask), config)),
  )


def test_logit_parity(case, batch):
  real = batch[1].astype(bool)
  err = np.where(real[..., None], np.abs(case["our_logits"] - case["hf_logits"]), 0).max(axis=(1, 2))
  diff, scale = err.max(), np.abs(case["hf_logits"][real]).max()
  print(
    f"\n[parity] {case['name']}: max |logit diff| = {diff:.2e} (unpadded row {err[0]:.2e}, left-padded row "
    f"{err[1]:.2e}; max |logit| = {scale:.2f})"
  )
  assert scale > 1.0
  assert diff <= PARITY_ATOL


def test_loaded_config(case):
  c, hf_config = case["config"], case["hf_model"].config
  assert c.num_heads == hf_config.num_attention_heads and c.num_kv_heads == hf_config.num_key_value_heads
  assert c.head_dim == hf_config.head_dim or c.head_dim == hf_config.hidden_size // hf_config.num_attention_heads
  assert c.num_experts == hf_config.num_local_experts and c.tie_word_embeddings == hf_config.tie_word_embeddings
  assert c.qk_norm == case["name"].startswith("qwen3")
  assert (case["params"].lm_head is None) == c.tie_word_embeddings


def test_export_uses_the_on_disk_layout(case, tmp_path):
  """transformers writes one tensor per expert; our export writes the same names and shapes."""
  hf.save_pretrained(tmp_path, case["config"], case["params"])
  theirs = load_file(case["path"] / "model.safetensors")
  ours = load_file(tmp_path / "model.safetensors")
  module, expert = ("mlp", "gate_proj") if case["name"].startswith("qwen3") else ("block_sparse_moe", "w1")
  assert f"model.layers.0.{module}.experts.7.{expert}.weight" in theirs
  assert not any("gate_up_proj" in k for k in theirs)
  assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
  for k in theirs:
    np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)


def test_export_reloads_in_transformers(case, batch, tmp_path):
  hf.save_pretrained(tmp_path, case["config"], case["params"])
  cls = type(case["hf_model"])
  reloaded = cls.from_pretrained(tmp_path, attn_implementation="eager", dtype=torch.float32).eval()
  logits = hf_logits(reloaded, *batch)
  print(f"\n[export->transformers] {case['name']}: max |logit diff| = {np.abs(logits - case['hf_logits']).max():.2e}")
  np.testing.assert_array_equal(logits, case["hf_logits"])


def test_export_reloads_exactly(case, tmp_path):
  hf.save_pretrained(tmp_path, case["config"], case["params"])
  config, params = hf.load_pretrained(tmp_path)
  assert config == case["config"]
  assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(case["params"])
  jax.tree_util.tree_map(np.testing.assert_array_equal, params, case["params"])


def test_fused_expert_layout_loads(case, tmp_path):
  """transformers' in-memory layout (gate_up_proj [E, 2I, H], down_proj [E, H, I]) saved as is."""
  case["hf_model"].save_pretrained(tmp_path, save_original_format=False)
  assert any("gate_up_proj" in k for k in load_file(tmp_path / "model.safetensors"))
  config, params = hf.load_pretrained(tmp_path)
  assert config == case["config"]
  jax.tree_util.tree_map(np.testing.assert_array_equal, params, case["params"])


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
  """Our export of a tiny random Qwen3-MoE (the source for the sharding, dtype and error tests)."""
  hf_model = build_hf_model("qwen3_gqa_tied_dense")
  path = tmp_path_factory.mktemp("qwen3") / "hf"
  hf_model.save_pretrained(path)
  config, params = hf.load_pretrained(path)
  return path, config, params


def test_sharded_export_reloads(qwen3, tmp_path):
  _, config, params = qwen3
  hf.save_pretrained(tmp_path, config, params, max_shard_bytes=64 * 1024)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 2 and not (tmp_path / "model.safetensors").exists()
  config2, params2 = hf.load_pretrained(tmp_path)
  assert config2 == config
  jax.tree_util.tree_map(np.testing.assert_array_equal, params2, params)


def test_bf16_export(qwen3, tmp_path):
  _, config, params = qwen3
  hf.save_pretrained(tmp_path, config, params, dtype="bfloat16")
  assert load_file(tmp_path / "model.safetensors")["model.norm.weight"].dtype == ml_dtypes.bfloat16
  _, params2 = hf.load_pretrained(tmp_path)
  bf16 = lambda a: np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float32)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(a, bf16(b)), params2, params)


def test_public_qwen3_config_maps():
  """config.json of Qwen/Qwen3-30B-A3B, as published (transformers 4.51 era)."""
  public = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
  }
  c = hf.config_from_hf(public)
  assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (48, 32, 4, 128)
  assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.rope_theta) == (128, 8, 768, 1e6)
  # transformers 5 spells the same config with num_local_experts and rope_parameters
  v5 = {k: v for k, v in public.items() if k not in ("num_experts", "rope_theta", "rope_scaling")}
  v5.update(num_local_experts=128, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
  assert hf.config_from_hf(v5) == c
  assert hf.config_from_hf(hf.config_to_hf(c)) == c
  assert c == model_config(models.qwen3_30b_a3b())  # the preset is the published model


# --- errors -------------------------------------------------------------------------------


def edited_copy(src, dst, *, config=None, tensors=None):
  """A copy of checkpoint `src` with config.json and/or the tensor dict edited."""
  shutil.copytree(src, dst)
  if config is not None:
    data = json.loads((dst / "config.json").read_text())
    config(data)
    (dst / "config.json").write_text(json.dumps(data))
  if tensors is not None:
    data = load_file(dst / "model.safetensors")
    tensors(data)
    save_file(data, dst / "model.safetensors", metadata={"format": "pt"})
  return dst


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize(
  "edit, pattern",
  [
    (
      dict(config=lambda c: c.update(architectures=["LlamaForCausalLM"])),
      r"architectures.*LlamaForCausalLM.*not supported",
    ),
    (dict(tensors=lambda t: t.pop(Q_PROJ)), rf"tensor '{Q_PROJ}' is missing"),
    (
      dict(tensors=lambda t: t.pop("model.layers.0.mlp.experts.3.down_proj.weight")),
      r"experts\.3\.down_proj.* is missing",
    ),
    (
      dict(tensors=lambda t: t.update({Q_PROJ: t[Q_PROJ].T.copy()})),
      rf"tensor '{Q_PROJ}' has shape \(64, 128\).*\(128, 64\)",
    ),
    (dict(tensors=lambda t: t.update(extra=np.zeros(3, np.float32))), r"unexpected tensor.*'extra'"),
    (
      dict(config=lambda c: c.update(num_hidden_layers=1, mlp_only_layers=[])),
      r"unexpected tensor.*model\.layers\.1\.",
    ),
    (dict(config=lambda c: c.update(num_local_experts=4)), r"mlp\.gate\.weight' has shape \(8, 64\).*\(4, 64\)"),
    (dict(config=lambda c: c.update(num_experts=4)), r"num_experts and num_local_experts disagree"),
    (dict(config=lambda c: c.pop("hidden_size")), r"'hidden_size' is missing"),
    (dict(config=lambda c: c.update(hidden_act="gelu")), r"hidden_act"),
    (
      dict(config=lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0})),
      r"rope_parameters\.rope_type",
    ),
    (dict(config=lambda c: c.update(num_key_value_heads=3)), r"config\.model\.num_heads"),
  ],
  ids=[
    "architecture",
    "missing",
    "missing_expert",
    "misshaped",
    "extra",
    "extra_layer",
    "expert_count",
    "expert_count_spellings",
    "config_field",
    "activation",
    "rope_scaling",
    "invalid_config",
  ],
)
def test_load_errors_name_the_problem(qwen3, tmp_path, edit, pattern):
  path = edited_copy(qwen3[0], tmp_path / "ckpt", **edit)
  with pytest.raises(hf.HFCheckpointError, match=pattern):
    hf.load_pretrained(path)


def test_export_errors(qwen3, tmp_path):
  _, config, params = qwen3
  with pytest.raises(hf.HFCheckpointError, match="Mixtral has no QK-norm"):
    hf.config_to_hf(config, hf.MIXTRAL)
  with pytest.raises(hf.HFCheckpointError, match="shared expert"):
    hf.config_to_hf(dataclasses.replace(config, shared_expert_intermediate_size=32))
  with pytest.raises(hf.HFCheckpointError, match="dtype"):
    hf.save_pretrained(tmp_path / "out", config, params, dtype="float8")
  assert not (tmp_path / "out").exists()
