"""Meshes, shardings, expert parallelism, multi-host runs and AOT compilation.

The multi-device checks need `--xla_force_host_platform_device_count` before jax is imported,
and pytest has imported jax already, so they run in subprocesses started once for the module
(all at once, so they overlap): tests/sharding_worker.py on 8 simulated CPU devices (the Qwen3.5
hybrid's check in a second such process), and tests/multiprocess_worker.py as one process with 2 devices and as two processes with 1 device
each (jax.distributed, gloo). The rules themselves are checked here on abstract meshes.

Tolerances: fp32 trainer and fp32 engine (bf16 reductions reorder under sharding), so the
sharded rollout must give the same tokens and log-probs within 1e-5, the metrics of two RL
steps within 1e-5 and the parameters after two AdamW steps within 1e-4 (measured: 1e-6,
1e-6, 8e-6; for the 2-layer Qwen3.5 hybrid on fsdp x tensor / expert x tensor meshes: 2e-6,
1e-6, 5e-8); expert parallelism with enough capacity is bitwise equal to the sorted MoE; the
two-process run equals the one-process run exactly.
"""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from configs import default, models
from tests.tiny import tiny_model
from trace_jax import cluster, model, moe, qat, rollout, sharding
from trace_jax.config import ConfigError, MeshConfig, QuantConfig, RunConfig, model_config, section
from trace_jax.expert_parallel import ExpertParallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = tiny_model()


def abstract_mesh(**shape):
  sizes = sharding.mesh_shape(shape, int(np.prod(list(shape.values()))))
  return AbstractMesh(tuple(sizes.values()), sharding.MESH_AXES, axis_types=(AxisType.Auto,) * 4)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# Every subprocess: their tiny steps are all compile time, and LLVM at -O0 compiles them in about 60% of the
# time (CPU seconds, measured: the hybrid 47 against 79, the RL check 36 against 53, each multi-process run 31
# against 52); sharded and one-device (or one- and two-process) programs are compiled alike, so the comparisons
# do not depend on it. EP's bitwise equality with the sorted MoE holds at the default level only: check_ep
# compiles at that level whatever XLA_FLAGS says (sharding_worker.jit_default).
FAST_COMPILE = "--xla_backend_optimization_level=0"


def _start(args, log, xla_flags: str = ""):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  if xla_flags:
    env["XLA_FLAGS"] = xla_flags
  return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def subprocesses():
  """Start every multi-device subprocess now; tests wait for the one they need."""
  tmp = tempfile.TemporaryDirectory()
  logs, procs = {}, {}
  port = _free_port()
  jobs = {
    "worker": ["tests/sharding_worker.py", "rl", "ep", "checkpoint", "aot"],
    "hybrid": ["tests/sharding_worker.py", "hybrid"],
    "one": ["tests/multiprocess_worker.py", os.path.join(tmp.name, "one"), "2", "1", "0", "0"],
    "two/0": ["tests/multiprocess_worker.py", os.path.join(tmp.name, "two"), "1", "2", "0", str(port)],
    "two/1": ["tests/multiprocess_worker.py", os.path.join(tmp.name, "two"), "1", "2", "1", str(port)],
  }
  for d in ("one", "two"):
    os.makedirs(os.path.join(tmp.name, d))
  for name, args in jobs.items():
    logs[name] = open(os.path.join(tmp.name, name.replace("/", "_") + ".log"), "w+")  # noqa: SIM115
    procs[name] = _start(args, logs[name], FAST_COMPILE)

  def wait(name, timeout=900):
    try:
      procs[name].wait(timeout=timeout)
    finally:
      if procs[name].poll() is None:
        procs[name].kill()
    logs[name].seek(0)
    text = logs[name].read()
    assert procs[name].returncode == 0, f"{name} failed:\n{text[-5000:]}"
    return text

  yield wait, tmp.name
  for p in procs.values():
    if p.poll() is None:
      p.kill()
  for f in logs.values():
    f.close()
  tmp.cleanup()


def _results(subprocesses, name: str) -> dict:
  wait, _ = subprocesses
  text = wait(name)
  line = next(line for line in text.splitlines() if line.startswith("RESULTS "))
  return json.loads(line[len("RESULTS ") :])


@pytest.fixture(scope="module")
def results(subprocesses):
  return _results(subprocesses, "worker")


@pytest.fixture(scope="module")
def hybrid_results(subprocesses):
  return _results(subprocesses, "hybrid")


# --- the rules, on abstract meshes (no devices needed) -------------------------------------


def test_mesh_shape_fills_and_validates():
  assert sharding.mesh_shape({"expert": 4, "data": -1}, 32) == {"data": 8, "fsdp": 1, "expert": 4, "tensor": 1}
  with pytest.raises(ValueError, match="Unknown mesh axes"):
    sharding.mesh_shape({"pipeline": 2}, 2)
  with pytest.raises(ValueError, match="needs 8 devices"):
    sharding.mesh_shape({"data": 8}, 4)


def test_logical_rules_on_a_pod_mesh():
  mesh = abstract_mesh(data=2, fsdp=4, expert=8, tensor=2)
  spec = lambda axes, shape: sharding.logical_to_spec(axes, shape, mesh)
  assert spec(("experts", "embed", "mlp"), (128, 2048, 768)) == P("expert", "fsdp", "tensor")
  assert spec(("batch", "sequence"), (64, 1024)) == P(("data", "fsdp", "expert"), None)
  assert spec(("embed", "kv_heads", "head_dim"), (2048, 4, 128)) == P("fsdp", "tensor", None)
  # an axis that does not divide the dimension is skipped (the rest of the rule still applies)
  assert spec(("batch",), (8,)) == P(("data", "fsdp"))
  assert spec(("vocab", "embed"), (151937, 2048)) == P(None, "fsdp")
  with pytest.raises(ValueError, match="No rule"):
    spec(("nonsense",), (4,))


def test_param_and_engine_axes_mirror_the_pytrees():
  params = jax.eval_shape(lambda: model.init_params(TINY, jax.random.key(0)))
  mesh = abstract_mesh(fsdp=2, expert=4)
  sh = sharding.logical_shardings(params, mesh)
  assert jax.tree_util.tree_structure(sh) == jax.tree_util.tree_structure(params)
  assert sh.layers[0].mlp.gate.spec == P("expert", "fsdp", None)
  assert sh.layers[0].mlp.router.spec == P("fsdp", None)
  assert sh.embed.spec == P(None, "fsdp")
  engine = jax.eval_shape(lambda p: rollout.weight_sync(p, QuantConfig()), params)
  esh = sharding.logical_shardings(engine, mesh)
  assert jax.tree_util.tree_structure(esh) == jax.tree_util.tree_structure(engine)
  gate = esh.layers[0].mlp.gate  # packed FP4 codes [E, I, H/2] and scales [E, I, H/16]
  assert gate.codes.spec == P("expert", None, None) and gate.scales.spec == P("expert", None, None)
  caches = jax.eval_shape(lambda: rollout.init_cache(TINY, 8, 16, QuantConfig(), jnp.bfloat16))
  csh = sharding.logical_shardings(caches, abstract_mesh(data=4, tensor=2))
  assert csh[0].k.codes.spec == P("data", None, "tensor", None)


def _check_specs(tree, shardings, mesh) -> None:
  """Every leaf's spec is valid on `mesh`: one entry at most per dimension, each mesh axis used once,
  and the product of a dimension's mesh axes divides it."""
  sizes = dict(mesh.shape)
  leaves, specs = jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(shardings)
  assert len(leaves) == len(specs) > 0
  for leaf, sh in zip(leaves, specs):
    spec = sh.spec
    assert len(spec) <= leaf.ndim, (leaf.shape, spec)
    axes = [a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)]
    assert len(axes) == len(set(axes)) and set(axes) <= set(sharding.MESH_AXES), (leaf.shape, spec)
    for dim, entry in zip(leaf.shape, spec):
      split = int(np.prod([sizes[a] for a in ((entry,) if isinstance(entry, str) else entry or ())]))
      assert dim % split == 0, (leaf.shape, spec)


@pytest.mark.parametrize("preset", ["tiny_hybrid", "qwen3_5_35b_a3b"])
def test_hybrid_params_engine_params_and_caches_shard_by_the_rules(preset):
  """The Qwen3.5 hybrid's trees (Gated DeltaNet weights, the engine's copy, DeltaNetState beside the
  FP4 KV cache) get a valid spec for every leaf on a pod mesh; the new weights split 'heads' over tensor."""
  c = model_config(models.get_config(preset))
  linear, full = c.linear_layers[0], c.attention_layers[0]
  mesh = abstract_mesh(data=2, fsdp=4, expert=8, tensor=2)
  params = jax.eval_shape(lambda: model.init_params(c, jax.random.key(0)))
  engine = jax.eval_shape(lambda p: rollout.weight_sync(p, QuantConfig()), params)
  for other in (abstract_mesh(fsdp=2, expert=2, tensor=4), abstract_mesh(data=8, tensor=8)):  # uneven splits skip
    for tree in (params, engine):
      _check_specs(tree, sharding.logical_shardings(tree, other), other)
  sh = sharding.logical_shardings(params, mesh)
  assert jax.tree_util.tree_structure(sh) == jax.tree_util.tree_structure(params)
  _check_specs(params, sh, mesh)
  d = sh.layers[linear].attn  # DeltaNetParams: fsdp on the hidden size, tensor on the (key or value) heads
  assert d.q.spec == d.v.spec == d.z.spec == P("fsdp", "tensor", None)
  assert d.b.spec == d.a.spec == P("fsdp", "tensor")
  assert d.conv_q.spec == d.conv_v.spec == P(None, "tensor", None)
  assert d.a_log.spec == d.dt_bias.spec == P("tensor") and d.norm.spec == P(None)
  assert d.out.spec == P("tensor", None, "fsdp")
  assert sh.layers[full].attn.gate.spec == P("fsdp", "tensor", None)
  assert sh.layers[full].mlp.shared.gate.spec == P("fsdp", "tensor")
  esh = sharding.logical_shardings(engine, mesh)
  assert jax.tree_util.tree_structure(esh) == jax.tree_util.tree_structure(engine)
  _check_specs(engine, esh, mesh)
  assert esh.layers[linear].attn.v.spec == P("fsdp", "tensor", None)
  assert esh.layers[linear].mlp.gate.codes.spec == P("expert", "tensor", None)  # [E, I, H / 2]: packed axis whole
  for decoded in (True, False):
    caches = jax.eval_shape(lambda d=decoded: rollout.init_cache(c, 16, 64, QuantConfig(), jnp.bfloat16, d))
    rollout_mesh = abstract_mesh(data=4, expert=2, tensor=2)
    csh = sharding.logical_shardings(caches, rollout_mesh)
    _check_specs(caches, csh, rollout_mesh)
    assert csh[linear].recurrent.spec == P(("data", "expert"), "tensor", None, None)
    assert csh[linear].conv.spec == P(("data", "expert"), None, None)
    assert csh[full].k.codes.spec == P(("data", "expert"), None, "tensor", None)


def test_topology_from_the_default_config_is_data_parallel():
  topology = cluster.Topology.from_config(RunConfig.from_config(default.get_config()).mesh)
  assert dict(topology.trainer.shape)["data"] == jax.device_count()
  assert topology.expert_parallel is None
  cfg = default.get_config()
  cfg.mesh.moe_impl = "ep"
  assert cluster.Topology.from_config(RunConfig.from_config(cfg).mesh).expert_parallel is not None
  cfg.mesh.moe_impl = "bogus"
  with pytest.raises(ConfigError, match="mesh.moe_impl"):
    RunConfig.from_config(cfg)
  assert cluster.Topology.from_config(section(MeshConfig, ml_collections.ConfigDict(), "mesh")).rollout.size == (
    jax.device_count()
  )


def test_initialize_distributed_is_a_no_op_for_one_process():
  sharding.initialize_distributed()
  assert not jax.distributed.is_initialized()
  with pytest.raises(ValueError, match="coordinator"):
    sharding.initialize_distributed("", 2, 0)


def test_qwen3_30b_a3b_preset():
  c = model_config(models.qwen3_30b_a3b())
  assert (c.num_layers, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (48, 128, 8, 768)


def test_aot_scaled_hybrid_keeps_the_pattern_and_counts_guidance_bytes():
  """experiments/aot_compile.py on Qwen3.5-35B-A3B without compiling: depths in blocks of 4 (3 Gated
  DeltaNet, 1 full attention), and the guidance bytes of a 4-layer cut (layers 2-3 guided; K/V only
  in the full-attention layer 3). NVFP4 mantissa + scale: 1.5 bits per element; full codes 4.5."""
  from experiments import aot_compile

  c = aot_compile.scaled_config(8, "qwen3_5_35b_a3b")
  assert c.linear_layers == (0, 1, 2, 4, 5, 6) and c.attention_layers == (3, 7)
  assert aot_compile.scaled_config(preset="qwen3_5_35b_a3b").num_layers == 40
  for depth in (2, 6, 0):
    with pytest.raises(ValueError, match="multiples of 4 to keep that pattern"):
      aot_compile.scaled_config(depth, "qwen3_5_35b_a3b")
  table = aot_compile.guidance_bytes(aot_compile.scaled_config(4, "qwen3_5_35b_a3b"))
  h, k, inter, kv = 2048, 8, 512, 2 * 256
  bits = lambda elements: elements * 3 // 16
  assert table["moe_input (the paper's accounting)"] == {"total": 2 * bits(h), "moe_input": 2 * bits(h)}
  want = {"moe_input": 2 * bits(h), "key": bits(kv), "value": bits(kv)}
  assert table["moe_input + key/value"] == {"total": sum(want.values()), **want}
  assert table["all four"]["moe_hidden"] == 2 * bits(k * inter)
  full = table["trace_full: full codes, all four, every layer"]  # 3x the bits; 2x the layers, but one K/V layer
  assert full["moe_input"] == 2 * 3 * 2 * bits(h) and full["key"] == 3 * bits(kv)


def test_expert_parallel_on_one_device_is_the_sorted_moe():
  params = model.init_params(TINY, jax.random.key(0)).layers[0].mlp
  x = jax.random.normal(jax.random.key(1), (10, TINY.hidden_size))
  ctx = qat.QatContext(QuantConfig(), compute_dtype=jnp.float32)
  ep = ExpertParallel(cluster.Topology.single_device().trainer, capacity_factor=1.0)  # C = 3 < 10 rows
  ref = jax.jit(lambda p, x: moe.moe_block(p, x, TINY, ctx, {}, impl="sorted"))(params, x)
  got = jax.jit(lambda p, x: moe.moe_block(p, x, TINY, ctx, {}, impl="ep", expert_parallel=ep))(params, x)
  counts = np.bincount(np.asarray(ref.topk_ids).reshape(-1), minlength=TINY.num_experts)
  assert int(got.dropped) == np.maximum(counts - 3, 0).sum() > 0  # beyond 3 per expert, in token order
  assert np.sum(np.all(np.asarray(got.out) == np.asarray(ref.out), axis=1)) >= 10 - int(got.dropped)
  full = dataclasses.replace(ep, capacity_factor=TINY.num_experts / TINY.num_experts_per_tok)
  got = jax.jit(lambda p, x: moe.moe_block(p, x, TINY, ctx, {}, impl="ep", expert_parallel=full))(params, x)
  np.testing.assert_array_equal(got.out, ref.out)
  assert int(got.dropped) == 0
  with pytest.raises(ValueError, match="needs an ExpertParallel"):
    moe.moe_block(params, x, TINY, ctx, {}, impl="ep")


# --- 8 simulated devices (subprocess) --------------------------------------------------------


@pytest.mark.slow
def test_expert_parallel_equals_sorted_moe_with_enough_capacity(results):
  for a2a in ("dense", "ragged_reference"):
    r = results["ep"][f"{a2a}/4.0"]
    assert r["max_diff"] == 0.0 and r["dropped"] == 0, (a2a, r)
    assert results["ep"][f"grad/{a2a}"] < 1e-5


@pytest.mark.slow
def test_expert_parallel_reports_drops(results):
  for a2a in ("dense", "ragged_reference"):
    r = results["ep"][f"{a2a}/1.0"]
    assert r["dropped"] == r["expected_dropped"] > 0, (a2a, r)
    assert r["rows_equal"] == 44 - r["rows_with_drops"], (a2a, r)  # rows without a drop are untouched


def assert_matches_one_device(r: dict) -> None:
  """The same tokens, log-probs and metrics (to float rounding), parameters after two steps, a live gradient."""
  assert r["tokens_equal"]
  assert r["logprob_diff"] < 1e-5
  assert r["metric_diff"] < 1e-5
  assert r["param_diff"] < 1e-4
  assert r["grad_norm"][0] > 0


@pytest.mark.slow
def test_sharded_rl_steps_match_one_device(results):
  r = results["rl"]
  assert_matches_one_device(r)
  assert r["dropped"] == [0.0, 0.0]


@pytest.mark.slow
def test_async_rl_on_separate_meshes_matches_one_device(results):
  """rl.max_version_diff=1: the producer generates on the engine's 4 devices while the trainer trains on
  the other 4; the same loop on one device gives the same metrics, and step 0 those of the sync loop."""
  r = results["async"]
  assert r["versions"] == [0, 0, 1] and r["staleness"] == [0, 1, 1]
  assert r["metric_diff"] < 1e-5 and r["first_step_diff"] < 1e-5
  assert r["staleness_part"][0] == 0 and r["staleness_part"][2] > 0  # step 0's LR is 0 (warmup)
  assert all(q > 0 for q in r["quant_part"])


@pytest.mark.slow
def test_sharded_hybrid_rl_steps_match_one_device(hybrid_results):
  """The Qwen3.5 hybrid (Gated DeltaNet + gated full attention) with its heads split over 'tensor'."""
  r = hybrid_results["hybrid"]
  assert_matches_one_device(r)
  assert all(b["guidance"] > 0 for b in r["bytes"])
  assert r["trainer_specs"]["v"] == "P('fsdp', 'tensor', None)" and r["trainer_specs"]["a_log"] == "P('tensor',)"
  assert r["engine_specs"]["v"] == "P(None, 'tensor', None)" and r["engine_specs"]["gate"] == "P(None, 'tensor', None)"
  # codes are compared for the routed experts of every layer, K/V only where a full-attention layer has them
  assert {k.split("/")[1] for k in r["agreement"] if k.endswith("layer0")} == {"moe_input", "moe_hidden"}


@pytest.mark.slow
def test_bytes_crossing_meshes_are_reported(results):
  r = results["rl"]
  assert all(b == {"sync": 0, "batch": 0, "guidance": 0} for b in r["single_bytes"])
  for b in r["bytes"]:  # disjoint device sets: the engine weights and the whole batch cross
    assert b["sync"] > 0 and b["batch"] > b["guidance"] > 0


@pytest.mark.slow
def test_checkpoint_restores_onto_another_mesh(results):
  r = results["checkpoint"]
  assert r["step"] == 1 and r["equal"] and r["equal_single"] and r["on_target_mesh"]
  assert r["q_spec_a"] != r["q_spec_b"]


@pytest.mark.slow
def test_aot_compile_of_a_scaled_down_qwen3_30b_a3b(results):
  r = results["aot"]
  for step in ("train_step", "decode_step"):
    assert r[step]["tflops_per_device"] > 0 and r[step]["temp_gib"] > 0, r


# --- two processes (jax.distributed) ----------------------------------------------------------


@pytest.mark.slow
def test_two_processes_produce_the_metrics_of_one(subprocesses):
  wait, tmp = subprocesses
  wait("one")
  wait("two/0")
  wait("two/1")
  read = lambda d: [json.loads(line) for line in open(os.path.join(tmp, d, "run", "metrics.jsonl"))]
  one, two = read("one"), read("two")
  assert len(one) == len(two) == 2
  for a, b in zip(one, two):
    a = {k: v for k, v in a.items() if not k.startswith("time/")}
    b = {k: v for k, v in b.items() if not k.startswith("time/")}
    assert a == b
  assert one[0]["grad_norm"] > 0  # a real update happened between the steps compared
  assert os.path.isdir(os.path.join(tmp, "two", "run", "checkpoints", "2"))
