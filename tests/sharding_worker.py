"""8 simulated CPU devices: sharded train step, rollout (Qwen3-MoE and the Qwen3.5 hybrid), EP MoE and
checkpoints against one device.

Run by tests/test_sharding.py in a subprocess (XLA_FLAGS must be set before jax is imported,
and pytest imports jax earlier in its own process). Prints one JSON object of measurements;
the assertions live in the test. `python tests/sharding_worker.py [check ...]` runs it by hand
(every check by default; the test runs `hybrid` in a process of its own, and every process at LLVM -O0:
see FAST_COMPILE there, and jit_default here for the EP check).
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from configs import models  # noqa: E402  (the test runs this with the repo root on PYTHONPATH)
from tests.tiny import tiny_model  # noqa: E402
from trace_jax import async_rl, checkpoint, cluster, data, model, moe, qat, sharding, train, trainer  # noqa: E402
from trace_jax import config as config_lib  # noqa: E402
from trace_jax.config import (  # noqa: E402
  FULL_ATTENTION,
  LINEAR_ATTENTION,
  ModelConfig,
  OptimConfig,
  QuantConfig,
  RunConfig,
)
from trace_jax.expert_parallel import ExpertParallel  # noqa: E402

CFG: ModelConfig = tiny_model(initializer_range=0.1)
# The tiny Qwen3.5 hybrid cut to one Gated DeltaNet layer and one gated full-attention layer (vocab 64):
# every new weight, the DeltaNet state beside an FP4 KV cache, in half the compile time of 4 layers.
HYBRID: ModelConfig = dataclasses.replace(
  config_lib.model_config(models.tiny_hybrid()),
  num_layers=2,
  layer_types=(LINEAR_ATTENTION, FULL_ATTENTION),
  initializer_range=0.1,
)
B, P, NEW, G = 16, 6, 6, 4  # 16 sequences = 4 prompts x 4 samples


def run_config(mode: str, model_config: ModelConfig = CFG) -> RunConfig:
  """The trainer in fp32 (bf16 matmuls reorder under sharding; fp32 makes the comparison tight)."""
  cfg = config_lib.defaults()
  cfg.update(mode=mode, trainer_dtype="float32")
  cfg.model = config_lib.to_config_dict(model_config)
  cfg.rollout.max_new_tokens = NEW
  cfg.rl.num_generations = G
  cfg.rl.normalize_std = False
  cfg.optim.learning_rate = 1e-3
  run = RunConfig.from_config(cfg)
  rollout_fp32 = dataclasses.replace(run.mode.rollout, compute_dtype="float32")
  return dataclasses.replace(run, mode=dataclasses.replace(run.mode, rollout=rollout_fp32))


def prompts() -> data.PromptBatch:
  """4 prompts with 0-3 left pads (x G samples each = B sequences)."""
  rng = np.random.default_rng(0)
  n = B // G
  tokens = rng.integers(3, CFG.vocab_size, (n, P)).astype(np.int32)
  mask = np.ones((n, P), bool)
  for i, pad in enumerate([0, 2, 3, 1]):
    tokens[i, :pad], mask[i, :pad] = 0, False
  answers = [""] * n
  return data.PromptBatch(tokens, mask, answers, answers, np.zeros(n, np.int32), np.arange(n), [{}] * n, 0)


def synthetic_rewards(answers, responses):
  """Deterministic in the tokens, so that both layouts see the same rewards."""
  return (responses % 3 == 0).mean(1).astype(np.float32), np.zeros(len(responses), bool)


def pipeline(run: RunConfig, topology: cluster.Topology, steps: int = 2):
  """A few RL steps of the real loop's `train.RLStep` on the given meshes; returns host copies."""
  optimizer = trainer.make_optimizer(run.optim, 10)
  state = trainer.init_state(run.model, optimizer, jax.random.key(0), topology.trainer)
  # a copy for async_pipeline (learn donates the state): init_state jits a new closure, and so compiles, per call
  out = {"metrics": [], "tokens": [], "logprobs": [], "bytes": [], "init": async_rl.copy_params(state)}
  rl_step = train.RLStep.build(run, topology, optimizer, synthetic_rewards, jax.random.key(7))
  batch = prompts()
  for step in range(steps):
    result, metrics = rl_step.rollout(step, state.params, batch)  # the halves of rl_step(step, state, batch)
    state, learned = rl_step.learn(step, state, batch, result)
    metrics.update(learned)
    out["metrics"].append(metrics)
    out["tokens"].append(sharding.to_host(result.tokens))
    out["logprobs"].append(sharding.to_host(result.logprobs))
    out["bytes"].append(
      dict(
        sync=metrics["transfer/weight_sync_bytes"],
        batch=metrics["transfer/rollout_to_trainer_bytes"],
        guidance=metrics["transfer/guidance_bytes"],
      )
    )
  out["params"] = sharding.to_host(state.params)
  out["state"] = state
  engine, _ = rl_step.sync(state.params)
  out["engine"] = engine
  out["engine_sharding"] = str(jax.tree_util.tree_leaves(engine)[-3].sharding.spec)
  out["rl_step"] = rl_step
  return out


def async_pipeline(ran: dict, steps: int = 3, d: int = 1) -> list[dict]:
  """The loop of train.train_and_evaluate with rl.max_version_diff=d (exact): a Producer thread
  generates batch t with version max(0, t - d) while the trainer trains. Reuses the programs and the
  initial state (a copy) of the `pipeline` that returned `ran`."""
  rl_step, state = ran["rl_step"], ran["init"]
  run = dataclasses.replace(rl_step.run, grpo=dataclasses.replace(rl_step.run.grpo, max_version_diff=d))
  rl_step = dataclasses.replace(rl_step, run=run)  # the same programs
  versions = async_rl.Versions(d)
  versions.publish(0, async_rl.copy_params(state.params))
  out = []
  with async_rl.Producer(
    rl_step.rollout, lambda step: prompts(), versions, start=0, steps=steps, max_version_diff=d
  ) as producer:
    for step in range(steps):
      r = producer.get(step)
      state, metrics = rl_step.learn(step, state, r.prompts, r.result, r.version, r.params)
      versions.publish(step + 1, async_rl.copy_params(state.params))
      out.append({**metrics, **r.metrics, "version": r.version})
  return out


def max_diff(a, b) -> float:
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) for x, y in zip(la, lb))


def metric_diff(ma: list[dict], mb: list[dict]) -> float:
  same = lambda k: not k.startswith(("time/", "transfer/"))  # wall clock and layout-dependent bytes
  diffs = [abs(a[k] - b[k]) for a, b in zip(ma, mb) for k in a if same(k) and np.isfinite(a[k]) and k in b]
  return max(diffs)


def against_one_device(single: dict, res: dict) -> dict:
  """What a sharded pipeline run shares with the one-device run: tokens, log-probs, metrics, parameters."""
  return dict(
    tokens_equal=all(np.array_equal(a, b) for a, b in zip(single["tokens"], res["tokens"])),
    logprob_diff=max_diff(single["logprobs"], res["logprobs"]),
    metric_diff=metric_diff(single["metrics"], res["metrics"]),
    param_diff=max_diff(single["params"], res["params"]),
    grad_norm=[m["grad_norm"] for m in res["metrics"]],
  )


def check_rl(results: dict) -> None:
  """Two RL steps on one device against a disaggregated layout: the engine on devices 0-3
  (expert 2 x tensor 2), the trainer on devices 4-7 (fsdp 2 x expert 2); both expert parallel."""
  run = run_config("trace")
  single = pipeline(run, cluster.Topology.single_device())
  trainer_mesh, rollout_mesh = sharding.make_meshes(
    {"fsdp": 2, "expert": 2}, {"expert": 2, "tensor": 2}, rollout_devices=4
  )
  eps = ExpertParallel(trainer_mesh, capacity_factor=4.0), ExpertParallel(rollout_mesh, capacity_factor=1.0)
  topology = cluster.Topology(trainer_mesh, rollout_mesh, *eps)
  res = pipeline(run, topology)
  # rl.max_version_diff=1 on the same layouts: the producer on the engine's devices, the trainer on its own
  single_async, res_async = async_pipeline(single), async_pipeline(res)
  results["async"] = dict(
    versions=[m["version"] for m in res_async],
    staleness=[m["staleness/version_diff"] for m in res_async],
    metric_diff=metric_diff(single_async, res_async),
    first_step_diff=metric_diff(res["metrics"][:1], res_async[:1]),
    quant_part=[m["mismatch/quant_part/logp_diff_mean"] for m in res_async],
    staleness_part=[m["mismatch/staleness_part/logp_diff_mean"] for m in res_async],
  )
  results["rl"] = dict(
    **against_one_device(single, res),
    dropped=[m.get("moe/dropped_tokens") for m in res["metrics"]],
    bytes=res["bytes"],
    single_bytes=single["bytes"],
    engine_expert_spec=res["engine_sharding"],
  )


def check_hybrid(results: dict) -> None:
  """Two RL steps of the tiny hybrid on one device against tensor-parallel layouts: the engine on devices
  0-3 (expert 2 x tensor 2, EP), the trainer on devices 4-7 (fsdp 2 x tensor 2, the sorted MoE), so
  that the Gated DeltaNet weights split their 'heads' over 'tensor' on both meshes (the engine's recurrent
  state follows by propagation inside generate)."""
  run = run_config("trace", HYBRID)
  single = pipeline(run, cluster.Topology.single_device())
  trainer_mesh, rollout_mesh = sharding.make_meshes(
    {"fsdp": 2, "tensor": 2}, {"expert": 2, "tensor": 2}, rollout_devices=4
  )
  topology = cluster.Topology(trainer_mesh, rollout_mesh, None, ExpertParallel(rollout_mesh, capacity_factor=1.0))
  res = pipeline(run, topology)
  linear, full = res["state"].params.layers[0].attn, res["engine"].layers[1].attn
  spec = lambda x: str(x.sharding.spec)
  results["hybrid"] = dict(
    **against_one_device(single, res),
    agreement={k: v for k, v in res["metrics"][0].items() if k.startswith("agreement/")},
    bytes=res["bytes"],
    trainer_specs=dict(
      q=spec(linear.q), v=spec(linear.v), conv_v=spec(linear.conv_v), a_log=spec(linear.a_log), out=spec(linear.out)
    ),
    engine_specs=dict(
      v=spec(res["engine"].layers[0].attn.v),
      gate=spec(full.gate),
      k=spec(full.k),
      experts=spec(res["engine"].layers[0].mlp.gate.codes),
    ),
  )


# LLVM's default optimization level, whatever XLA_FLAGS says: EP's bitwise equality with the sorted MoE holds
# there only (at --xla_backend_optimization_level=0 the two differ by 6e-8).
jit_default = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 3})


def check_ep(results: dict) -> None:
  """EP MoE (8 devices: data 2 x expert 4) against the single-device sorted MoE."""
  mesh = sharding.make_mesh({"data": 2, "expert": 4})
  params = model.init_params(CFG, jax.random.key(0)).layers[0].mlp
  x = jax.random.normal(jax.random.key(1), (44, CFG.hidden_size))  # 44 rows: padded to 48 inside
  ctx = qat.QatContext(QuantConfig(), compute_dtype=jnp.float32)
  ref = jit_default(lambda p, x: moe.moe_block(p, x, CFG, ctx, {}, impl="sorted"))(params, x)
  out = {}
  for a2a in ("dense", "ragged_reference"):
    for cf in (4.0, 1.0):
      ep = ExpertParallel(mesh, capacity_factor=cf, a2a=a2a)
      got = jit_default(lambda p, x, ep=ep: moe.moe_block(p, x, CFG, ctx, {}, impl="ep", expert_parallel=ep))(params, x)
      out[f"{a2a}/{cf}"] = dict(
        max_diff=float(jnp.max(jnp.abs(got.out - ref.out))),
        dropped=int(got.dropped),
        expected_dropped=expected_drops(np.asarray(ref.topk_ids), 8, 4, cf, a2a),
        rows_equal=int(jnp.sum(jnp.all(got.out == ref.out, axis=1))),
        rows_with_drops=rows_with_drops(np.asarray(ref.topk_ids), 8, 4, cf, a2a),
      )
  # gradients through the exchange (both directions of the all_to_all) against the reference
  loss = lambda impl, ep: jit_default(
    jax.grad(lambda p, x: jnp.sum(moe.moe_block(p, x, CFG, ctx, {}, impl=impl, expert_parallel=ep).out ** 2), (0, 1))
  )(params, x)
  want = loss("sorted", None)
  for a2a in ("dense", "ragged_reference"):
    out[f"grad/{a2a}"] = max_diff(want, loss("ep", ExpertParallel(mesh, capacity_factor=4.0, a2a=a2a)))
  results["ep"] = out


def _kept(ids: np.ndarray, devices: int, n_ep: int, cf: float, a2a: str) -> np.ndarray:
  """Which (token, slot) assignments each exchange keeps: the capacity rule written out in numpy."""
  t, k = ids.shape
  rows = -(-t // devices)
  e = np.full((rows * devices, k), -1)
  e[:t] = ids
  kept = np.ones_like(e, bool)
  n, num_e = rows * k, CFG.num_experts
  for d in range(devices):
    flat = e[d * rows : (d + 1) * rows].reshape(-1)
    keep = np.ones(n, bool)
    if a2a == "dense":
      cap = max(1, min(n, int(np.ceil(cf * n / num_e))))
      for ex in range(num_e):
        where = np.flatnonzero(flat == ex)
        keep[where[cap:]] = False
    else:
      quota = max(1, min(n, int(np.ceil(cf * n / n_ep))))
      per = num_e // n_ep
      for dev in range(n_ep):
        where = np.flatnonzero((flat // per == dev) & (flat >= 0))
        where = where[np.argsort(flat[where], kind="stable")]
        keep[where[quota:]] = False
    kept[d * rows : (d + 1) * rows] = keep.reshape(rows, k)
  return kept[:t]


def expected_drops(ids, devices, n_ep, cf, a2a) -> int:
  return int((~_kept(ids, devices, n_ep, cf, a2a)).sum())


def rows_with_drops(ids, devices, n_ep, cf, a2a) -> int:
  return int((~_kept(ids, devices, n_ep, cf, a2a)).any(1).sum())


def check_checkpoint(results: dict) -> None:
  """Save a state sharded on one mesh, restore it onto another mesh shape (and one device)."""
  optimizer = trainer.make_optimizer(OptimConfig(), 10)
  mesh_a = sharding.make_mesh({"fsdp": 2, "expert": 4})
  mesh_b = sharding.make_mesh({"data": 2, "tensor": 4})
  state = trainer.init_state(CFG, optimizer, jax.random.key(3), mesh_a)
  with tempfile.TemporaryDirectory() as workdir:
    ckpt = checkpoint.Checkpointer(workdir)
    ckpt.save(1, state, force=True)
    ckpt.wait()
    abstract = jax.eval_shape(lambda: state)
    target = jax.tree_util.tree_map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract,
      trainer.state_shardings(abstract, optimizer, mesh_b),
    )
    step, restored = ckpt.restore_latest(target)
    single = trainer.init_state(CFG, optimizer, jax.random.key(4), cluster.Topology.single_device().trainer)
    _, on_one = ckpt.restore_latest(single)
    ckpt.close()
  want = trainer.state_shardings(restored, optimizer, mesh_b)
  results["checkpoint"] = dict(
    step=step,
    equal=max_diff(sharding.to_host(state), sharding.to_host(restored)) == 0.0,
    equal_single=max_diff(sharding.to_host(state), sharding.to_host(on_one)) == 0.0,
    on_target_mesh=all(
      a.sharding.is_equivalent_to(s, a.ndim)
      for a, s in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(want))
    ),
    q_spec_a=str(state.params.layers[0].attn.q.sharding.spec),
    q_spec_b=str(restored.params.layers[0].attn.q.sharding.spec),
    expert_spec_b=str(restored.opt_state[1][0].mu.layers[0].mlp.gate.sharding.spec),
  )


def check_aot(results: dict) -> None:
  """A scaled-down (1-layer) Qwen3-30B-A3B-shaped train step and decode step compile ahead of time."""
  from experiments import aot_compile

  t0 = time.perf_counter()
  report = aot_compile.compile_all(aot_compile.scaled_config(num_layers=1), {"data": 2, "expert": 4}, batch=8, seq=64)
  results["aot"] = dict(seconds=time.perf_counter() - t0, **{k: v for k, v in report.items() if k != "config"})


CHECKS = {"rl": check_rl, "hybrid": check_hybrid, "ep": check_ep, "checkpoint": check_checkpoint, "aot": check_aot}

if __name__ == "__main__":
  assert jax.device_count() == 8, jax.devices()
  results = {}
  for name in sys.argv[1:] or CHECKS:
    t0 = time.perf_counter()
    CHECKS[name](results)
    results[f"time/{name}"] = time.perf_counter() - t0
  print("RESULTS " + json.dumps(results, default=str))
