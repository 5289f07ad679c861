"""The GRPO loop end to end on a tiny MoE: modes, determinism, resume and preemption,
checkpoint fallback, bad input, the NaN guard, metrics (JSONL and TensorBoard) and main.py.

Compilation dominates the cost, so every run here shares one configuration (TINY) where it
can, one module-scoped reference run (`reference`), and an on-disk XLA cache that later runs,
in this process and in `python -m trace_jax.main` subprocesses, load instead of recompiling.
Runs that do not test evaluation replace `train.evaluate` by a stub.
"""

import dataclasses
import functools
import glob
import hashlib
import json
import logging
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

from configs import default
from experiments import sweep
from tests.tiny import TINY
from trace_jax import checkpoint, cluster, experience, model, rollout, train, trainer
from trace_jax.config import MODES, ConfigError, DataConfig, RunConfig
from trace_jax.metrics_writer import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STEPS = TINY["steps"]

# SPEC section 6 (and the loop's own bookkeeping): keys every FP4-mode row carries.
SPEC_KEYS = (
  "reward/mean",
  "reward/accuracy",
  "response/length_mean",
  "loss/pg",
  "loss/total",
  "loss/clip_frac",
  "loss/kl_ref",
  "grad_norm",
  "mismatch/logp_diff_mean",
  "mismatch/logp_diff_max",
  "mismatch/kl_k3",
  "mismatch/is_ratio_mean",
  "mismatch/is_ratio_outside_0.5_2",
  "guidance/bytes_per_token",
  "time/rollout_s",
  "time/train_s",
  *(f"routing_agreement/layer{i}" for i in range(2)),
  *(f"agreement/{t}/layer{i}" for t in ("moe_input", "moe_hidden", "key", "value") for i in range(2)),
)


# --- fixtures and helpers -------------------------------------------------------------------


def tiny_config(data_dir, mode="trace", **overrides):
  return sweep.configure(default.get_config(mode), {**TINY, "data.data_dir": data_dir, **overrides})


def cli_overrides(data_dir, **overrides):
  return [f"--config.{k}={v}" for k, v in {**TINY, "data.data_dir": data_dir, **overrides}.items()]


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
  """The uninterrupted trace-mode run (with SFT and evaluation) the other tests compare with."""
  workdir = str(tmp_path_factory.mktemp("reference"))
  t0 = time.perf_counter()
  summary = train.train_and_evaluate(tiny_config(data_dir), workdir)
  print(f"reference run: {time.perf_counter() - t0:.1f} s")
  return workdir, summary


def rows_without_time(workdir):
  """metrics.jsonl rows minus wall-clock times, as JSON text (so that NaN equals NaN)."""
  rows = [{k: v for k, v in row.items() if not k.startswith("time/")} for row in read_metrics(workdir)]
  return [json.dumps(row, sort_keys=True) for row in rows]


def without_eval(rows):
  """Rows from rows_without_time, less eval/accuracy (runs with the evaluation stubbed)."""
  return [json.dumps({k: v for k, v in json.loads(r).items() if k != "eval/accuracy"}) for r in rows]


def latest_state(cfg, workdir):
  """(step, TrainState) of the newest readable checkpoint in `workdir`."""
  run = RunConfig.from_config(cfg)
  optimizer = trainer.make_optimizer(run.optim, cfg.steps)
  params = model.init_params(run.model, jax.random.key(0))
  template = trainer.TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
  ckpt = checkpoint.Checkpointer(workdir)
  try:
    return ckpt.restore_latest(template)
  finally:
    ckpt.close()


def assert_same_state(a, b):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def file_digests(directory):
  """{relative path: sha256} of every file under `directory`."""
  out = {}
  for root, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
  return out


def corrupt_checkpoint(workdir, step):
  """Truncate every array data file of one checkpoint (as a crash mid-write would leave it)."""
  pattern = os.path.join(workdir, "checkpoints", str(step), "**", "d", "*")
  files = [f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f)]
  assert files, f"no array data files under checkpoints/{step}"
  for f in files:
    with open(f, "r+b") as fh:
      fh.truncate(3)


def read_tensorboard_scalars(logdir):
  """{tag: {step: value}} from TFRecord event files, CRCs checked; later events win (as after a
  resume's purge_step)."""
  scalars = {}
  paths = sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*")), key=os.path.getmtime)
  assert paths, f"no event files in {logdir}"
  for path in paths:
    with open(path, "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      header = data[pos : pos + 8]
      (length,) = struct.unpack("<Q", header)
      assert struct.unpack("<I", data[pos + 8 : pos + 12])[0] == masked_crc32c(header)
      payload = data[pos + 12 : pos + 12 + length]
      assert struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])[0] == masked_crc32c(payload)
      pos += 16 + length
      event = event_pb2.Event.FromString(payload)
      for value in event.summary.value:
        scalars.setdefault(value.tag, {})[event.step] = value.simple_value
  return scalars


def run_main(args, **kwargs):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.2"}
  if jax.config.jax_compilation_cache_dir:
    env["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir
  return subprocess.Popen(
    [sys.executable, "-m", "trace_jax.main", *args],
    cwd=REPO,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    **kwargs,
  )


def main_after_its_first_step(workdir, overrides, timeout_s=300):
  """`python -m trace_jax.main` (trace mode) on `workdir`, returned once its first RL step is logged."""
  proc = run_main(["--config=configs/default.py:trace", f"--workdir={workdir}", *overrides])
  metrics = workdir / "metrics.jsonl"
  deadline = time.monotonic() + timeout_s
  while not (metrics.exists() and metrics.read_text().strip()):
    assert proc.poll() is None, f"main exited early ({proc.returncode}):\n{proc.communicate()[1][-3000:]}"
    assert time.monotonic() < deadline, f"no RL step logged within {timeout_s} s"
    time.sleep(0.02)
  return proc


# --- the reference run: metrics and TensorBoard ---------------------------------------------


@pytest.mark.slow
def test_reference_run_writes_every_metric(reference):
  workdir, summary = reference
  rows = read_metrics(workdir)
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  for row in rows:
    missing = [k for k in SPEC_KEYS if k not in row]
    assert not missing, f"step {row['step']} lacks {missing}"
    assert row["finite"] is True
    for key in SPEC_KEYS:
      assert math.isfinite(row[key]), (row["step"], key, row[key])
    for key in SPEC_KEYS:
      if "agreement" in key:
        assert 0.0 <= row[key] <= 1.0, (key, row[key])
    assert row["mismatch/logp_diff_max"] >= row["mismatch/logp_diff_mean"] > 0  # FP4 engine vs trainer
    assert row["mismatch/kl_k3"] >= 0
    assert row["guidance/bytes_per_token"] > 0
    assert 0 < row["response/length_mean"] <= TINY["rollout.max_new_tokens"]
  assert "eval/accuracy" in rows[-1] and all("eval/accuracy" not in r for r in rows[:-1])
  with open(os.path.join(workdir, "summary.json")) as f:
    assert json.load(f) == summary
  assert summary["mode"] == "trace" and summary["steps"] == STEPS
  for key in ("final/accuracy_bf16_engine", "final/accuracy_fp4_engine"):
    assert 0.0 <= summary[key] <= 1.0
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["0", "2", "4"]


@pytest.mark.slow
def test_tensorboard_holds_the_jsonl_scalars(reference):
  workdir, _ = reference
  scalars = read_tensorboard_scalars(os.path.join(workdir, "tensorboard"))
  for row in read_metrics(workdir):
    for key, value in row.items():
      if key == "step" or isinstance(value, bool) or not math.isfinite(value):
        continue
      assert scalars[key][row["step"]] == pytest.approx(value, rel=1e-6), key


# --- modes ----------------------------------------------------------------------------------


def test_every_mode_resolves_to_its_engine_and_trainer(data_dir):
  """SPEC section 7: what each mode means for the rollout engine and the trainer."""
  cfg = tiny_config(data_dir)
  tokenizer, _, _ = train.load_data(RunConfig.from_config(cfg).data)
  runs = {mode: RunConfig.from_config(tiny_config(data_dir, mode), tokenizer).mode for mode in MODES}
  assert set(runs) == {"bf16", "fp4", "qat", "qat_w4a16", "trace", "trace_full"}
  quant = runs["qat"].trainer_quant
  assert quant.targets == ("experts", "kv") and quant.weights and quant.activations
  # BF16 engine and trainer.
  assert runs["bf16"].rollout.quant is None and runs["bf16"].trainer_quant is None
  for mode in ("fp4", "qat", "qat_w4a16", "trace", "trace_full"):
    assert runs[mode].rollout.quant == quant, mode  # FP4 W4A4 experts + FP4 KV cache
    assert runs[mode].rollout.record_codes, mode  # per-layer agreement diagnostics
  # fp4: a plain BF16 trainer (no fake-quant); qat: RTN everywhere; qat_w4a16: weight-only experts.
  assert runs["fp4"].trainer_quant.targets == () and not runs["fp4"].guided
  assert not runs["qat"].guided and runs["qat"].rollout.guided_layers == ()
  assert runs["qat_w4a16"].trainer_quant.targets == ("experts",)
  assert runs["qat_w4a16"].trainer_quant.weights and not runs["qat_w4a16"].trainer_quant.activations
  # trace: guided by mantissa + scale in the deeper half; trace_full: full codes everywhere.
  assert runs["trace"].guided and runs["trace"].trainer_quant == quant
  assert runs["trace"].rollout.guided_layers == (1,) and runs["trace"].rollout.guidance_form == "mantissa_scale"
  assert runs["trace_full"].guided and runs["trace_full"].rollout.guided_layers == (0, 1)
  assert runs["trace_full"].rollout.guidance_form == "full"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16", "fp4"])
def test_mode_runs_an_rl_step(mode, data_dir, tmp_path, no_eval):
  """bf16 and fp4 end to end (trace is the reference run; the other modes are traced below)."""
  cfg = tiny_config(data_dir, mode, steps=1, **{"sft.steps": 0})
  summary = train.train_and_evaluate(cfg, str(tmp_path))
  (row,) = read_metrics(str(tmp_path))
  assert summary["mode"] == mode and summary["steps"] == 1 and row["finite"] is True
  assert math.isfinite(row["loss/total"]) and math.isfinite(row["mismatch/logp_diff_mean"])
  assert "routing_agreement/layer0" in row
  if mode == "bf16":
    assert row["guidance/bytes_per_token"] == 0
    assert not any(k.startswith("agreement/") and math.isfinite(v) for k, v in row.items())
    assert row["mismatch/logp_diff_mean"] < 0.05  # BF16 engine vs BF16 trainer
  else:
    assert row["guidance/bytes_per_token"] == 0  # fp4 ships no guidance, its codes are diagnostics
    assert all(0 <= row[k] <= 1 for k in SPEC_KEYS if k.startswith("agreement/"))


@pytest.mark.slow
def test_the_qwen3_5_hybrid_trains_with_the_same_metrics(reference, data_dir, tmp_path, no_eval):
  """The Qwen3.5 hybrid preset (here 2 layers: Gated DeltaNet, then gated full attention) runs the RL loop
  end to end and writes every metric the Qwen3-MoE reference run writes."""
  hybrid = {k: v for k, v in TINY.items() if not k.startswith("model.")}
  hybrid.update(
    {
      "model.hidden_size": 32,
      "model.num_layers": 2,
      "model.full_attention_interval": 2,  # layer 0 Gated DeltaNet, layer 1 full attention
      "model.num_heads": 2,
      "model.num_kv_heads": 1,
      "model.head_dim": 16,
      "model.num_experts": 4,
      "model.moe_intermediate_size": 16,
      "model.shared_expert_intermediate_size": 16,
      "model.linear_num_key_heads": 1,
      "model.linear_num_value_heads": 2,
      "model.linear_key_head_dim": 16,
      "model.linear_value_head_dim": 16,
      "data.data_dir": data_dir,
      "steps": 1,
      "sft.steps": 0,
    }
  )
  cfg = sweep.configure(default.get_config("trace,model=tiny_hybrid"), hybrid)
  summary = train.train_and_evaluate(cfg, str(tmp_path))
  (row,) = read_metrics(str(tmp_path))
  reference_row = read_metrics(reference[0])[0]
  assert summary["steps"] == 1 and row["finite"] is True
  assert math.isfinite(row["loss/total"]) and 0 < row["guidance/bytes_per_token"]
  untimed = lambda r: {k for k in r if not k.startswith("time/")}
  # the same metrics, except K/V ones of layer 0: a DeltaNet layer has a recurrent state, not an FP4 KV cache
  missing = untimed(reference_row) - untimed(row)
  assert missing and all(re.search(r"/(key|value)/layer0$", k) for k in missing), sorted(missing)
  assert untimed(row) <= untimed(reference_row)


def traced_rl_step(cfg):
  """(params, (state, logp, metrics)) of the whole RL step (weight sync, FP4 rollout, trainer batch, GRPO update) as
  jax.eval_shape traces it: shapes and metric keys without a compilation."""
  run = RunConfig.from_config(cfg)
  tokenizer, _, _ = train.load_data(run.data)
  run = run.with_tokenizer(tokenizer)
  optimizer = trainer.make_optimizer(run.optim, cfg.steps)
  n, p = cfg.batch_prompts * cfg.rl.num_generations, cfg.data.max_prompt_len

  def rl_step(params, prompts, prompt_mask, key):
    state = trainer.TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
    engine = rollout.weight_sync(params, run.mode.rollout.quant)
    result = rollout.generate(
      engine, prompts, prompt_mask, key, model_config=run.model, rollout_config=run.mode.rollout, sampling=run.sampling
    )
    batch = experience.train_batch_from_rollout(result, jnp.zeros((n,), jnp.float32), run.grpo.routing_replay)
    batch = dataclasses.replace(batch, ref_logp=batch.rollout_logp)
    return trainer.make_rl_step(run, optimizer)(state, batch, first=True)

  params = jax.eval_shape(functools.partial(model.init_params, run.model), jax.random.key(0))
  tokens = jax.ShapeDtypeStruct((n, p), jnp.int32)
  return params, jax.eval_shape(rl_step, params, tokens, jax.ShapeDtypeStruct((n, p), bool), jax.random.key(1))


@pytest.mark.parametrize("mode", ["qat", "qat_w4a16", "trace_full"])
def test_other_modes_trace_an_rl_step(mode, data_dir):
  """qat, qat_w4a16 and trace_full differ from trace only in static settings, so tracing their whole
  RL step with jax.eval_shape checks them without paying three more compilations."""
  cfg = tiny_config(data_dir, mode)
  n, p = cfg.batch_prompts * cfg.rl.num_generations, cfg.data.max_prompt_len
  params, (state, logp, metrics) = traced_rl_step(cfg)
  assert logp.shape == (n, p + cfg.rollout.max_new_tokens - 1)
  assert jax.tree_util.tree_structure(state.params) == jax.tree_util.tree_structure(params)
  missing = [
    k for k in SPEC_KEYS if k not in metrics and k.split("/")[0] not in ("reward", "response", "time", "guidance")
  ]
  assert not missing, missing


# --- PPO updates per rollout batch ----------------------------------------------------------


@pytest.fixture(scope="module")
def one_rl_step(data_dir):
  """(minibatches, ppo_epochs) -> metrics of one RL step from a fresh init, at a large learning rate,
  with rewards 0, 1 in every group (so that every advantage is +-1 and the policy moves)."""

  def run_one(minibatches, ppo_epochs):
    overrides = {"optim.learning_rate": 0.03, "optim.warmup_steps": 0, "rl.kl_coef": 0.0}
    cfg = tiny_config(data_dir, **overrides, **{"rl.minibatches": minibatches, "rl.ppo_epochs": ppo_epochs})
    run = RunConfig.from_config(cfg)
    tokenizer, source, _ = train.load_data(run.data)
    run = run.with_tokenizer(tokenizer)
    topology = cluster.Topology.single_device()
    optimizer = trainer.make_optimizer(run.optim, run.job.steps)
    state = trainer.init_state(run.model, optimizer, jax.random.key(0), topology.trainer)
    rewards = lambda answers, responses: (
      (np.arange(len(answers)) % 2).astype(np.float32),
      np.zeros(len(answers), bool),
    )
    rl_step = train.RLStep.build(run, topology, optimizer, rewards, jax.random.key(1))
    prompts = train.data.PromptBatcher(source, tokenizer, run.job.batch_prompts, run.data.max_prompt_len).batch_at(0)
    _, metrics = rl_step(0, state, prompts)
    return {k: v for k, v in metrics.items() if not k.startswith("time/")}

  return run_one


def test_the_ppo_clip_acts_only_after_the_first_update(one_rl_step):
  """One update per rollout batch: the ratio is exactly 1 and nothing clips. Mini-batches (the
  second sees parameters the first moved) or a second epoch: it clips. The mismatch and agreement
  metrics are the pre-update policy's in every setting, and mini-batches are deterministic."""
  single = one_rl_step(1, 1)
  assert single["loss/clip_frac"] == 0.0 and single["finite"] is True
  behaviour = {k: v for k, v in single.items() if k.startswith(("mismatch/", "agreement/", "routing_agreement/"))}
  runs = {setting: one_rl_step(*setting) for setting in ((2, 1), (1, 2))}
  for setting, metrics in runs.items():
    assert metrics["loss/clip_frac"] > 0.0 and metrics["finite"] is True, setting
    assert set(metrics) == set(single)
    for k, v in behaviour.items():
      # abs: the two programs' log-probs differ by a float32 step on a few tokens, which a signed sum
      # over a sequence (mismatch/seq_log_ratio_*) turns into a larger relative difference
      assert metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-6, nan_ok=True), (k, setting)
  assert json.dumps(one_rl_step(2, 1)) == json.dumps(runs[2, 1])


def test_two_level_scaling_runs_guided_in_mini_batches(data_dir, tmp_path, no_eval):
  """quant.tensor_scale='batch_amax' end to end: the engine's per-call tensor scales ride with the
  guidance (also into mini-batches), so the guided layer's codes stay the rollout's; the share of
  block scales at the E4M3 floor is reported per tensor and layer."""
  overrides = {"sft.steps": 0, "quant.tensor_scale": "batch_amax", "rl.minibatches": 2}
  train.train_and_evaluate(tiny_config(data_dir, steps=1, **overrides), str(tmp_path))
  (row,) = read_metrics(str(tmp_path))
  assert row["finite"] is True
  for name in ("moe_input", "key", "value"):  # the default trace.tensors
    assert row[f"agreement/{name}/layer1"] >= 0.999, name  # layer 1: the guided deeper half
  for name in ("moe_input", "moe_hidden", "key", "value"):
    for layer in (0, 1):
      assert 0.0 <= row[f"quant/scale_floor_frac/{name}/layer{layer}"] <= 1.0


@pytest.mark.parametrize("diagnostics", [True, False])
@pytest.mark.parametrize("routing_replay", [True, False])
def test_guidance_metric_keys(data_dir, diagnostics, routing_replay):
  """trace mode (layer 1 guided by mantissa + scales of the default tensors, moe_input and K/V): codeword agreement
  in every layer and tensor (NaN where no codes), mantissa-bit agreement where bits were shipped, the non-adjacent
  counts where the diagnostic codes exist, and the unmatched-expert share where 'moe_hidden' guidance exists."""
  cfg = tiny_config(data_dir, **{"trace.diagnostics": diagnostics, "rl.routing_replay": routing_replay})
  _, (_, _, metrics) = traced_rl_step(cfg)
  tensors = ("moe_input", "moe_hidden", "key", "value")
  assert all(f"agreement/{t}/layer{i}" in metrics for t in tensors for i in range(2))
  shipped = ("moe_input", "key", "value")
  assert {k for k in metrics if k.startswith("bit_agreement/")} == {f"bit_agreement/{t}/layer1" for t in shipped}
  measured_layers = range(2) if diagnostics else ()
  want = {
    f"guidance/{m}/{t}/layer{i}"
    for m in ("non_adjacent_frac", "adjacent_share_of_mismatches")
    for t in tensors
    for i in measured_layers
  }
  if diagnostics:
    want |= {"guidance/non_adjacent_frac", "guidance/adjacent_share_of_mismatches"}
  want |= {f"guidance/unmatched_expert_frac/layer{i}" for i in measured_layers}  # moe_hidden: diagnostic codes only
  assert {k for k in metrics if k.startswith("guidance/")} == want


def test_diagnostics_every(data_dir, tmp_path, no_eval):
  """trace.diagnostics_every=2 over 3 steps: the engine records the full codes on the first step and the last
  (codeword agreement and scale-floor shares measured), not on the one between (agreement NaN, no floor
  shares), while the guidance and the mantissa-bit agreement of the guided layer are there on every step."""
  cfg = tiny_config(data_dir, steps=3, **{"sft.steps": 0, "trace.diagnostics_every": 2, "eval_every": 0})
  run = train.run_config(cfg)
  assert [train.diagnostic_step(run, s) for s in range(3)] == [True, False, True]
  train.train_and_evaluate(cfg, str(tmp_path))
  rows = read_metrics(str(tmp_path))
  assert [row["step"] for row in rows] == [1, 2, 3]
  for row, diagnosed in zip(rows, (True, False, True)):
    assert ("quant/scale_floor_frac/moe_input/layer0" in row) == diagnosed, row["step"]
    assert np.isfinite(row["agreement/moe_hidden/layer0"]) == diagnosed, row["step"]
    assert row["bit_agreement/moe_input/layer1"] >= 0.999  # guided: the rollout's bits, whatever the step
    assert row["guidance/bytes_per_token"] > 0
  with pytest.raises(ConfigError, match="trace.diagnostics_every"):
    train.run_config(tiny_config(data_dir, **{"trace.diagnostics_every": 0}))


# --- determinism and resume -----------------------------------------------------------------


@pytest.mark.slow
def test_same_seed_gives_the_same_run(reference, data_dir, tmp_path):
  workdir, summary = reference
  again = train.train_and_evaluate(tiny_config(data_dir), str(tmp_path))
  assert again == summary
  assert rows_without_time(str(tmp_path)) == rows_without_time(workdir)
  cfg = tiny_config(data_dir)
  assert_same_state(latest_state(cfg, str(tmp_path))[1], latest_state(cfg, workdir)[1])


@pytest.mark.slow
def test_a_shorter_run_extended_matches_the_uninterrupted_one(reference, data_dir, tmp_path, no_eval):
  """steps=2, then steps=4 in the same workdir == steps=4 at once.

  The LR schedule's horizon is config.steps; with warmup_steps (5) >= steps it does not
  depend on it here. With a shorter warmup, extending a run changes the cosine decay of the
  remaining steps, so that the final parameters differ from a run planned that long.
  """
  workdir, _ = reference
  cfg = tiny_config(data_dir)
  assert cfg.optim.warmup_steps >= STEPS
  train.train_and_evaluate(tiny_config(data_dir, steps=2), str(tmp_path))
  assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]
  train.train_and_evaluate(cfg, str(tmp_path))
  ours, theirs = rows_without_time(str(tmp_path)), rows_without_time(workdir)
  assert without_eval(ours) == without_eval(theirs)
  step, state = latest_state(cfg, str(tmp_path))
  ref_step, ref_state = latest_state(cfg, workdir)
  assert step == ref_step == STEPS
  assert_same_state(state, ref_state)


@pytest.mark.slow
def test_sigterm_checkpoints_and_the_resumed_run_matches(reference, data_dir, tmp_path):
  """A real preemption: SIGTERM to `python -m trace_jax.main` after its first logged RL step."""
  workdir, _ = reference
  proc = main_after_its_first_step(tmp_path, cli_overrides(data_dir))
  proc.send_signal(signal.SIGTERM)
  stdout, stderr = proc.communicate(timeout=300)
  assert proc.returncode == 0, stderr[-3000:]
  assert "SIGTERM" in stderr
  saved = sorted(int(s) for s in os.listdir(tmp_path / "checkpoints"))
  stopped = max(saved)
  assert 1 <= stopped < STEPS, f"the run was not interrupted (checkpoints {saved})"
  # The console holds a line per checkpoint; orbax's INFO lines go to the workdir's log file only.
  assert all(f"Checkpoint of step {s}: " in stderr for s in saved) and "CheckpointManagerOptions" not in stderr
  assert "CheckpointManagerOptions" in (tmp_path / "log.txt").read_text()
  assert [r["step"] for r in read_metrics(str(tmp_path))] == list(range(1, stopped + 1))
  assert json.loads(stdout)["steps"] == stopped

  cfg = tiny_config(data_dir)
  train.train_and_evaluate(cfg, str(tmp_path))  # resume in-process, with evaluation at step 4
  assert rows_without_time(str(tmp_path)) == rows_without_time(workdir)
  assert_same_state(latest_state(cfg, str(tmp_path))[1], latest_state(cfg, workdir)[1])
  # TensorBoard: the resumed run's scalars replace the dropped tail.
  scalars = read_tensorboard_scalars(str(tmp_path / "tensorboard"))
  assert sorted(scalars["reward/mean"]) == list(range(1, STEPS + 1))


# --- checkpoints ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(reference, data_dir, tmp_path, caplog, no_eval):
  workdir, _ = reference
  copy = str(tmp_path / "run")
  shutil.copytree(workdir, copy)
  corrupt_checkpoint(copy, STEPS)
  corrupt = file_digests(os.path.join(copy, "checkpoints", str(STEPS)))
  cfg = tiny_config(data_dir)
  with caplog.at_level(logging.WARNING):
    step, state = latest_state(cfg, copy)
  assert step == 2 and int(state.step) == 2
  assert any("step 4" in r.getMessage() and "unreadable" in r.getMessage() for r in caplog.records)
  # The unreadable checkpoint is moved aside, not deleted, so that step 4 can be saved again.
  assert file_digests(os.path.join(copy, "checkpoints.unreadable", str(STEPS))) == corrupt
  assert sorted(os.listdir(os.path.join(copy, "checkpoints"))) == ["0", "2"]
  # Resuming there redoes steps 3 and 4 as the first run did.
  train.train_and_evaluate(cfg, copy)
  assert without_eval(rows_without_time(copy)) == without_eval(rows_without_time(workdir))
  step, state = latest_state(cfg, copy)
  assert step == STEPS
  assert_same_state(state, latest_state(cfg, workdir)[1])


@pytest.mark.slow
def test_no_readable_checkpoint_is_an_error_and_nothing_is_deleted(reference, data_dir, tmp_path):
  workdir, _ = reference
  copy = str(tmp_path / "run")
  shutil.copytree(workdir, copy)
  for step in (0, 2, 4):
    corrupt_checkpoint(copy, step)
  before = file_digests(copy)
  cfg = tiny_config(data_dir)
  with pytest.raises(checkpoint.CheckpointError, match="nothing was deleted") as e:
    latest_state(cfg, copy)
  assert all(f"step {s}" in str(e.value) for s in (0, 2, 4))
  with pytest.raises(checkpoint.CheckpointError):
    train.train_and_evaluate(cfg, copy)
  assert file_digests(copy) == before


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "overrides, field",
  [
    ({"mode": "int8"}, "config.mode"),
    ({"rl.num_generations": 1}, "config.rl.num_generations"),
    ({"model.num_experts_per_tok": 5}, "config.model.num_experts_per_tok"),
    ({"model.moe_intermediate_size": 24}, "config.model.moe_intermediate_size"),  # not whole NVFP4 blocks
    ({"model.num_kv_heads": 3}, "config.model.num_heads"),
    ({"optim.learning_rate": 0.0}, "config.optim.learning_rate"),
  ],
)
def test_inconsistent_config_is_refused_before_anything_is_written(overrides, field, data_dir, tmp_path):
  workdir = tmp_path / "run"
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    train.train_and_evaluate(tiny_config(data_dir, **overrides), str(workdir))
  assert not workdir.exists()


@pytest.mark.parametrize(
  "overrides, message",
  [
    ({"rollout.max_new_tokens": 7}, r"config\.rollout\.max_new_tokens: answers of level 4 need 8 tokens with EOS"),
    ({"data.max_prompt_len": 9}, r"config\.data\.max_prompt_len: prompts of level 4 need 10 tokens with BOS"),
  ],
)
def test_a_task_longer_than_the_lengths_is_refused_before_any_work(overrides, message, tmp_path):
  """Refused with the field and the fix before the task is built, SFT runs or the workdir is written."""
  data_dir, workdir = tmp_path / "tfds", tmp_path / "run"
  cfg = tiny_config(str(data_dir), **{"data.levels": (3, 4), **overrides})
  with pytest.raises(ConfigError, match=message + r".*raise it to >= (8|10)\."):
    train.train_and_evaluate(cfg, str(workdir))
  assert not workdir.exists() and not data_dir.exists()


def test_jsonl_lines_longer_than_the_lengths_are_refused_by_line(tmp_path):
  path = tmp_path / "train.jsonl"
  lines = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "12+34=", "answer": "46", "target": "40;46;46"}]
  path.write_text("".join(json.dumps(line) + "\n" for line in lines))
  cfg = DataConfig(jsonl_train=str(path))
  line = re.escape(f"{path}:2")
  with pytest.raises(ConfigError, match=rf"config\.rollout\.max_new_tokens: answers of {line} need 9 tokens with EOS"):
    train.load_data(cfg, max_new_tokens=8)
  with pytest.raises(ConfigError, match=rf"config\.data\.max_prompt_len: prompts of {line} need 7 tokens with BOS"):
    train.load_data(dataclasses.replace(cfg, max_prompt_len=6), max_new_tokens=9)
  assert len(train.load_data(cfg, max_new_tokens=9)[1]) == 2


def test_level_4_answers_fill_the_response_and_train(tmp_path, no_eval):
  """A level-4 target with its EOS is 8 tokens, all that max_new_tokens = 8 lets the rollout generate:
  SFT must train on it (it used to stop at 7 tokens and raise) and RL runs."""
  cfg = tiny_config(str(tmp_path / "tfds"), steps=1, **{"data.levels": (3, 4)})
  run = RunConfig.from_config(cfg)
  tokenizer, source, _ = train.load_data(run.data)
  batcher = train.data.SFTBatcher(source, tokenizer, cfg.sft.batch_size, cfg.data.max_prompt_len, 8, seed=cfg.seed)
  assert any(batcher.batch_at(i).loss_mask.sum(1).max() == 8 for i in range(cfg.sft.steps))
  summary = train.train_and_evaluate(cfg, str(tmp_path / "run"))
  assert summary["steps"] == 1 and read_metrics(str(tmp_path / "run"))[0]["finite"] is True


def test_unknown_config_field_is_refused(data_dir, tmp_path):
  cfg = tiny_config(data_dir)
  cfg.rl.tis_clip = 2.0  # a typo of tis_cap
  with pytest.raises(ConfigError, match=r"config\.rl\.tis_clip"):
    train.train_and_evaluate(cfg, str(tmp_path / "run"))


@pytest.mark.slow
def test_a_workdir_of_another_config_is_refused_untouched(reference, data_dir, tmp_path):
  workdir, _ = reference
  copy = str(tmp_path / "run")
  shutil.copytree(workdir, copy)
  before = file_digests(copy)
  with pytest.raises(ConfigError, match=r"another config.*'seed'"):
    train.train_and_evaluate(tiny_config(data_dir, seed=1), copy)
  with pytest.raises(ConfigError, match=r"another config.*'mode'"):
    train.train_and_evaluate(tiny_config(data_dir, "qat"), copy)
  assert file_digests(copy) == before


@pytest.mark.slow
def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(data_dir, tmp_path, monkeypatch, no_eval):
  """NaN rewards from step 3 on make the loss NaN: the update is skipped, the run stops with a
  FloatingPointError naming the step-2 checkpoint, which stays on disk."""
  make_reward_fn = train.data.make_reward_fn
  calls = []

  def nan_from_step_3(*args, **kwargs):
    reward_fn = make_reward_fn(*args, **kwargs)

    def rewards(answers, responses):
      calls.append(1)
      out, invalid = reward_fn(answers, responses)
      return (out * np.nan if len(calls) >= 3 else out), invalid

    return rewards

  monkeypatch.setattr(train.data, "make_reward_fn", nan_from_step_3)
  cfg = tiny_config(data_dir)
  with pytest.raises(FloatingPointError, match=r"step 3.*last good checkpoint is step 2") as e:
    train.train_and_evaluate(cfg, str(tmp_path))
  assert os.path.join(str(tmp_path), "checkpoints") in str(e.value)
  assert sorted(int(s) for s in os.listdir(tmp_path / "checkpoints")) == [0, 2]
  assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]
  step, state = latest_state(cfg, str(tmp_path))
  assert step == 2 and int(state.step) == 2


# --- main.py --------------------------------------------------------------------------------


@pytest.mark.slow
def test_main_helpfull():
  proc = run_main(["--helpfull"])
  stdout, stderr = proc.communicate(timeout=300)
  assert proc.returncode == 1, stderr[-2000:]  # absl's help flags print to stdout and exit 1
  assert "trace_jax/main.py:" in stdout and "--config: Path to a get_config() file" in stdout
  assert "--workdir: Directory for checkpoints" in stdout


@pytest.mark.slow
def test_main_bad_config_exits_2_with_a_message(data_dir, tmp_path):
  workdir = tmp_path / "run"
  proc = run_main(["--config=configs/default.py:int8", f"--workdir={workdir}", *cli_overrides(data_dir)])
  _, stderr = proc.communicate(timeout=300)
  assert proc.returncode == 2, stderr[-2000:]
  assert "error: config.mode: unknown mode 'int8'" in stderr
  assert "Traceback" not in stderr
  assert not workdir.exists()


def test_main_selects_a_model_preset(data_dir, tmp_path):
  """`--config=configs/default.py:MODE,model=PRESET` reaches the run: the 30B preset's 128 experts are
  named when its top-k is set out of range (refused before any work, so nothing big is built)."""
  workdir = tmp_path / "run"
  args = ["--config=configs/default.py:bf16,model=qwen3_30b_a3b", f"--workdir={workdir}"]
  proc = run_main([*args, "--config.model.num_experts_per_tok=200"])
  _, stderr = proc.communicate(timeout=300)
  assert proc.returncode == 2, stderr[-2000:]
  assert "error: config.model.num_experts_per_tok: top-k = 200 must lie in [1, num_experts = 128]" in stderr
  assert not workdir.exists()
  proc = run_main(["--config=configs/default.py:bf16,model=qwen3_235b", f"--workdir={workdir}"])
  _, stderr = proc.communicate(timeout=300)
  assert proc.returncode != 0 and "unknown preset 'qwen3_235b'" in stderr, stderr[-2000:]


def test_the_starting_policy_is_the_one_the_run_trains_from(data_dir, tmp_path, no_eval):
  """train.starting_policy (what experiments/outcome.py and regime.py evaluate as "the SFT policy") gives,
  computed afresh, the very parameters that a run's own warm start wrote to its SFT cache."""
  from trace_jax import job

  cfg = tiny_config(data_dir, "bf16", steps=1, **{"sft.steps": 3, "sft.cache_dir": str(tmp_path / "cache")})
  train.train_and_evaluate(cfg, str(tmp_path / "run"))
  cached = job.sft_cache_path(cfg)
  assert os.path.exists(cached)
  run = RunConfig.from_config(cfg)
  tokenizer, train_source, _ = train.load_data(run.data, run.sampling.max_new_tokens)
  run = run.with_tokenizer(tokenizer)
  afresh = sweep.configure(cfg, {"sft.cache_dir": str(tmp_path / "elsewhere")})
  params = train.starting_policy(afresh, run, tokenizer, train_source)
  assert_same_state(params, checkpoint.load_tree(cached, params))
  assert os.path.exists(job.sft_cache_path(afresh))
