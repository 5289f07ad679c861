"""From a pretrained Hugging Face MoE through main: init_from, the chat template, export and evaluation.

The inputs are made here (tests/pretrained.py): tiny random Qwen3-MoE (sharded) and Qwen3.5-MoE
checkpoints saved by transformers in bf16, a byte-level BPE with a Qwen-style chat template, and
GSM8K- / MATH-style JSONL. Run with `-s` to see the measured figures.
"""

import json
import os
import shutil
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from configs import hf_math
from tests import pretrained
from trace_jax import data, evaluate, export, hf, model, qat, train
from trace_jax.config import ConfigError, RunConfig, never_generated_ids

PARITY_ATOL = 1e-4


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  root = tmp_path_factory.mktemp("pretrained")
  return dict(
    qwen3=pretrained.write_checkpoint(root / "qwen3", shard="40KB"),
    qwen3_5=pretrained.write_checkpoint(root / "qwen3_5", "qwen3_5_moe", seed=1),
    math=pretrained.write_jsonl(root / "math.jsonl", pretrained.GSM8K + pretrained.MATH),
    root=root,
  )


def smoke(init_from, math_file, *overrides: str, mode: str = "bf16"):
  """configs/hf_math.py at CPU size (the overrides its docstring gives), then `overrides` ('field=value')."""
  c = hf_math.get_config(f"{mode},init_from={init_from}")
  fields = {
    "data.jsonl_train": str(math_file),
    "steps": 2,
    "batch_prompts": 2,
    "rl.num_generations": 2,
    "rl.minibatches": 1,
    "rollout.max_new_tokens": 8,
    "data.max_prompt_len": 64,
    "eval_prompts": 4,
    "checkpoint_every": 1,
    "trainer_dtype": "float32",
  }
  fields.update(o.split("=", 1) for o in overrides)
  for key, value in fields.items():
    *path, name = key.split(".")
    node = c
    for p in path:
      node = node[p]
    node[name] = (
      type(node[name])(value) if node[name] is not None and not isinstance(value, type(node[name])) else value
    )
  return c


def hf_model(path):
  return transformers.AutoModelForCausalLM.from_pretrained(
    path, dtype=torch.float32, attn_implementation="eager"
  ).eval()


def hf_logits(m, tokens, mask):
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
  with torch.no_grad():
    out = m(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask), position_ids=torch.tensor(positions))
  return out.logits.numpy()


FP32 = qat.QatContext(compute_dtype=jnp.float32)


def our_logits(config, params, tokens, mask):
  return np.asarray(model.forward(params, jnp.asarray(tokens), jnp.asarray(mask), config, ctx=FP32)[0])


# --- the chat template and the tokenizer ------------------------------------------------------


@pytest.mark.parametrize("system", ["", "You are a careful mathematician. Put the answer in \\boxed{}."])
def test_chat_template_renders_as_transformers(inputs, system):
  ours = data.load_tokenizer(inputs["qwen3"], chat_template="auto", system_prompt=system)
  theirs = transformers.AutoTokenizer.from_pretrained(inputs["qwen3"])
  prompt = pretrained.MATH[0]["problem"]
  messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
  want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  want = want["input_ids"] if hasattr(want, "keys") else want
  assert ours.encode_prompt(prompt) == list(want)
  assert (ours.eos_id, ours.pad_id, ours.bos_id) == (
    theirs.convert_tokens_to_ids("<|im_end|>"),
    theirs.convert_tokens_to_ids("<|endoftext|>"),
    None,
  )
  plain = data.load_tokenizer(inputs["qwen3"], chat_template="none")
  assert plain.encode_prompt(prompt) == plain.encode(prompt)


# --- loading: parity with transformers, on 1 and 8 devices, and across 2 processes ------------


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_load_sharded_logits_match_transformers(inputs, arch):
  mesh = jax.make_mesh((1, 1, 1, 1), ("data", "fsdp", "expert", "tensor"))
  config, params = hf.load_sharded(inputs[arch], mesh)
  tokens, mask = pretrained.batch(config.vocab_size)
  theirs = hf_logits(hf_model(inputs[arch]), tokens, mask)
  ours = our_logits(config, params, tokens, mask)
  real = mask.astype(bool)
  diff = np.abs(ours - theirs)[real].max()
  print(
    f"\n[parity] {arch} from bf16 safetensors: max |logit diff| {diff:.2e} (max |logit| {np.abs(theirs).max():.2f})"
  )
  assert diff <= PARITY_ATOL


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_one_and_eight_devices_and_two_processes_load_the_same_logits(inputs, tmp_path):
  """8 devices (fsdp 2 x expert 4) in one process, and 2 processes x 4 devices (expert 2 x tensor 4, gloo): the same
  logits as 1 device; each of the 2 processes reads only the 2 of 4 experts it holds."""
  script = os.path.join(os.path.dirname(__file__), "pretrained.py")
  ckpt, out, port = str(inputs["qwen3"]), str(tmp_path / "logits"), str(_free_port())
  runs = {
    "one": [[ckpt, out + "1", "1", "1", "0", "0", ""]],
    "eight": [[ckpt, out + "8", "8", "1", "0", "0", "fsdp=2,expert=4"]],
    "two": [[ckpt, out + "2", "4", "2", str(i), port, "expert=2,tensor=4"] for i in range(2)],
  }
  procs = [
    subprocess.Popen([sys.executable, script, "logits", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for jobs in runs.values()
    for args in jobs
  ]
  for p in procs:
    text = p.communicate(timeout=600)[0].decode()
    assert p.returncode == 0, text[-3000:]
  one = np.load(out + "1.npy")
  for n in ("8", "2"):
    np.testing.assert_allclose(np.load(out + n + ".npy"), one, atol=1e-5)
  read = [json.load(open(f"{out}2.{i}.json"))["experts"] for i in range(2)]
  assert read == [["slice(0, 2, None)"], ["slice(2, 4, None)"]]


# --- main from the checkpoint ---------------------------------------------------------------


@pytest.fixture(scope="module")
def first_run(inputs, tmp_path_factory):
  """main, 2 steps of bf16 RL from the sharded Qwen3-MoE checkpoint on math JSONL (no routing replay,
  so that the trainer routes as transformers does), with the first update's batch and log-probs kept."""
  workdir = tmp_path_factory.mktemp("run") / "w"
  cfg = smoke(inputs["qwen3"], inputs["math"], "rl.routing_replay=False")
  seen = {}
  optimize = train.RLStep.optimize

  def spy(self, step, state, batch, guided=True):
    out = optimize(self, step, state, batch, guided)
    seen.setdefault("first", (jax.device_get(batch), np.asarray(out[2])))
    return out

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(train.RLStep, "optimize", spy)
    summary = train.train_and_evaluate(cfg, str(workdir))
  return dict(workdir=workdir, cfg=cfg, summary=summary, first=seen["first"])


def test_first_step_logprobs_match_transformers(inputs, first_run):
  batch, logp = first_run["first"]
  inputs_, targets, mask = np.asarray(batch.inputs), np.asarray(batch.targets), np.asarray(batch.mask)
  logits = hf_logits(hf_model(inputs["qwen3"]), inputs_, mask.astype(np.int64))
  # the policy is over what can be sampled: the tokenizer's ids (384 embedding rows, 320 ids) less PAD
  tok = data.load_tokenizer(inputs["qwen3"])
  logits[..., tok.vocab_size :] = -np.inf
  logits[..., list(never_generated_ids(tok))] = -np.inf
  theirs = torch.log_softmax(torch.tensor(logits), -1).gather(-1, torch.tensor(targets)[..., None])[..., 0].numpy()
  response = np.asarray(batch.loss_mask).astype(bool)
  diff = np.abs(logp - theirs)[response].max()
  print(
    f"\n[parity] first step's trainer log-probs vs transformers: max |diff| {diff:.2e} over {response.sum()} tokens"
  )
  assert response.sum() > 0 and diff <= PARITY_ATOL


def test_run_exports_a_checkpoint_transformers_loads(inputs, first_run):
  out = first_run["workdir"] / "hf"
  for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
    assert (out / name).exists(), name
  m = transformers.AutoModelForCausalLM.from_pretrained(out)
  assert m.dtype == torch.bfloat16
  tokens, mask = pretrained.batch()
  run = export.saved_run(str(first_run["workdir"]))
  _, params = export.restore_params(str(first_run["workdir"]), run)
  ours = our_logits(
    run.model, jax.tree_util.tree_map(lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32), params), tokens, mask
  )
  theirs = hf_logits(hf_model(out), tokens, mask)
  assert np.abs(ours - theirs)[mask.astype(bool)].max() <= PARITY_ATOL
  assert (
    transformers.AutoTokenizer.from_pretrained(out)
    .apply_chat_template([{"role": "user", "content": "1+1"}], tokenize=False, add_generation_prompt=True)
    .endswith("<|im_start|>assistant\n")
  )


def test_export_command_and_resume_never_rereads_init_from(inputs, first_run, tmp_path):
  """trace_jax.export writes step 1; then, with init_from's weights gone, the run resumes from its own
  checkpoint to 3 steps (the model section and tokenizer still come from init_from's files)."""
  work = tmp_path / "w"
  shutil.copytree(first_run["workdir"], work)
  cmd = [sys.executable, "-m", "trace_jax.export", f"--workdir={work}", f"--out={tmp_path / 'step1'}", "--step=1"]
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert json.loads(done.stdout.strip().splitlines()[-1])["step"] == 1
  transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "step1")
  source = tmp_path / "source"
  shutil.copytree(inputs["qwen3"], source, ignore=shutil.ignore_patterns("*.safetensors*"))
  cfg = smoke(source, inputs["math"], "rl.routing_replay=False", "steps=3")
  saved = json.loads((work / "config.json").read_text())
  (work / "config.json").write_text(json.dumps({**saved, "init_from": str(source)}))
  summary = train.train_and_evaluate(cfg, str(work))
  assert summary["steps"] == 3
  rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2, 3]


def test_steps_0_exports_the_checkpoint_bit_exact(inputs, tmp_path):
  cfg = smoke(inputs["qwen3_5"], inputs["math"], "steps=0")
  train.train_and_evaluate(cfg, str(tmp_path / "w"))
  original = load_file(inputs["qwen3_5"] / "model.safetensors")
  exported = {}
  for f in sorted((tmp_path / "w" / "hf").glob("*.safetensors")):
    exported.update(load_file(f))
  missing = {k for k in original if not k.startswith("mtp.")} - set(exported)
  assert not missing
  for k in original:
    assert original[k].dtype == exported[k].dtype == ml_dtypes.bfloat16, k
    np.testing.assert_array_equal(original[k].view(np.uint16), exported[k].view(np.uint16), err_msg=k)


# --- bad inputs -------------------------------------------------------------------------------


def test_bad_checkpoints_are_named(inputs, tmp_path):
  with pytest.raises(ConfigError, match="no such directory"):
    hf.with_pretrained_model(smoke(tmp_path / "missing", inputs["math"]))
  broken = tmp_path / "broken"
  shutil.copytree(inputs["qwen3"], broken)
  shard = sorted(broken.glob("model-*.safetensors"))[1]
  shard.unlink()
  mesh = jax.make_mesh((1, 1, 1, 1), ("data", "fsdp", "expert", "tensor"))
  with pytest.raises(hf.HFCheckpointError, match=f"shard {shard.name} is listed in weight_map but missing"):
    hf.load_sharded(broken, mesh)
  unknown = tmp_path / "unknown"
  shutil.copytree(inputs["qwen3"], unknown)
  config = json.loads((unknown / "config.json").read_text())
  (unknown / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
  with pytest.raises(ConfigError, match="LlamaForCausalLM.*not supported"):
    hf.with_pretrained_model(smoke(unknown, inputs["math"]))


def test_model_overrides_must_agree_with_the_checkpoint(inputs):
  cfg = smoke(inputs["qwen3"], inputs["math"])
  cfg.model.num_layers = 3
  with pytest.raises(ConfigError, match=r"config.model.num_layers: is 3, but init_from=.* says 2"):
    hf.with_pretrained_model(cfg)
  with pytest.raises(ConfigError, match="config.model: comes from init_from"):
    RunConfig.from_config(cfg)
  cfg.model.num_layers = 2  # restating it is fine; our own knobs are ours to set
  cfg.model.linear_chunk_size = 16
  run = RunConfig.from_config(hf.with_pretrained_model(cfg))
  assert run.model.num_layers == 2 and run.model.linear_chunk_size == 16 and run.sft.steps == 0


def test_a_tokenizer_larger_than_the_embedding_is_refused(inputs, tmp_path):
  small = tmp_path / "small"
  pretrained.write_checkpoint(small, vocab_size=256)  # the tokenizer has 320 ids
  with pytest.raises(ConfigError, match=r"model.vocab_size: 256 is smaller than the tokenizer's vocabulary \(320\)"):
    train.train_and_evaluate(smoke(small, inputs["math"]), str(tmp_path / "w"))
  assert not (tmp_path / "w" / "checkpoints").exists()


# --- evaluation -------------------------------------------------------------------------------


def test_pass_at_k_is_the_unbiased_estimator():
  from itertools import combinations
  from math import comb

  for n, c, k in [(8, 0, 1), (8, 3, 1), (8, 3, 4), (8, 8, 8), (5, 2, 3)]:
    samples = [1] * c + [0] * (n - c)
    brute = np.mean([any(s) for s in combinations(samples, k)]) if comb(n, k) else 0.0
    assert evaluate.pass_at_k(n, c, k) == pytest.approx(brute)
  assert evaluate.ks(8) == [1, 2, 4, 8] and evaluate.ks(6) == [1, 2, 4, 6]


def test_evaluate_command_on_the_run(first_run, inputs):
  work = first_run["workdir"]
  cmd = [sys.executable, "-m", "trace_jax.evaluate", f"--workdir={work}", f"--data={inputs['math']}", "--k=4"]
  done = subprocess.run(cmd + ["--engine=fp4", "--batch_prompts=4"], capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads((work / "eval" / "step_2" / "results.json").read_text())
  assert results["step"] == 2 and results["eval_fp4/problems"] == 8
  for key in (
    "greedy/accuracy",
    "pass@1",
    "pass@2",
    "pass@4",
    "mean@4",
    "response/length_mean",
    "response/truncated_frac",
  ):
    assert 0 <= results[f"eval_fp4/{key}"] <= (8 if "length" in key else 1), key
  assert results["eval_fp4/pass@1"] == pytest.approx(results["eval_fp4/mean@4"])
  rows = [json.loads(line) for line in (work / "eval" / "step_2" / "samples.jsonl").read_text().splitlines()]
  assert len(rows) == 8 and all(len(r["samples"]) == 4 for r in rows)
  assert list((work / "eval" / "step_2" / "tensorboard").iterdir())
