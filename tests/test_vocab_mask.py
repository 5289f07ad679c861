"""Padded vocabularies (issue 19): the engine never samples an id the tokenizer cannot decode.

The default tiny model has 64 embedding rows, the character tokenizer 18 ids. The engine masks
the padded ids and the ids no response holds (PAD, BOS) before sampling; the trainer computes
log-probs over the same masked distribution (model.policy_logits, model.token_logprobs), and
rewards score any token sequence. Each engine and trainer configuration compiles once
(module-scoped fixtures, fixed shapes); the whole loop runs in the `slow` test only.
"""

import dataclasses
import functools
import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

from configs import default
from tests.tiny import TINY
from trace_jax import attention, data, model, qat, rl, rollout, train
from trace_jax.config import ConfigError, GRPOConfig, RolloutConfig, RunConfig, SamplingConfig, never_generated_ids
from trace_jax.metrics_writer import read_metrics

TOK = data.CharTokenizer()
RUN = RunConfig.from_config(default.get_config(), TOK)  # the default model and mode, vocab 64
MODEL = RUN.model
B, P, NEW = 256, 12, 64
SAMPLING = dataclasses.replace(RUN.sampling, max_new_tokens=NEW, temperature=1.0)
UNMASKED = dataclasses.replace(SAMPLING, vocab_size=0, banned_ids=())
BF16_ENGINE = RolloutConfig(quant=None)
FP32_ENGINE = RolloutConfig(quant=None, compute_dtype="float32")
FP32_B, FP32_NEW = 8, 16
R = 32  # rows of the 256 that the trainer recomputes


@functools.partial(jax.jit, static_argnames=("ctx",))
def _forward(params, tokens, mask, ctx):
  return model.forward(params, tokens, mask, MODEL, ctx=ctx)[0]


def trainer_logits(params, res: rollout.RolloutResult, ctx):
  """The trainer's teacher-forced logits for tokens[:, 1:] of a rollout."""
  return _forward(params, res.tokens[:, :-1], res.mask[:, :-1], ctx)


@functools.partial(jax.jit, static_argnames=("rollout_config",))
def engine_logits(engine_params, tokens, prompt_mask, rollout_config):
  """The engine's logits for tokens[:, P:], feeding it the given tokens as `generate` feeds its samples."""
  b, total = tokens.shape
  p = prompt_mask.shape[1]
  step = functools.partial(rollout.decode_step, engine_params, model_config=MODEL, rollout_config=rollout_config)
  slot_mask = jnp.concatenate([prompt_mask, jnp.ones((b, total - p), jnp.int32)], axis=1)
  caches = rollout.init_cache(MODEL, b, total, None, jnp.dtype(rollout_config.compute_dtype))
  first, caches, _, _ = step(tokens[:, :p], caches, 0, attention.positions_from_mask(prompt_mask), slot_mask)

  def body(caches, t):
    positions = (jnp.sum(prompt_mask, axis=1) + t - p)[:, None]
    logits, caches, _, _ = step(jax.lax.dynamic_slice_in_dim(tokens, t, 1, axis=1), caches, t, positions, slot_mask)
    return caches, logits

  _, rest = jax.lax.scan(body, caches, jnp.arange(p, total - 1))
  return jnp.concatenate([first[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)


def response_dlogp(a, b, response_mask):
  """(mean, max) |a - b| over response positions."""
  m = np.asarray(response_mask, bool)
  d = np.abs(np.asarray(a) - np.asarray(b))[m]
  return float(d.mean()), float(d.max())


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def params():
  return jax.jit(model.init_params, static_argnums=0)(MODEL, jax.random.key(0))  # untrained


@pytest.fixture(scope="module")
def prompts():
  examples = data.ArithmeticTask((1, 2)).generate(0, B)
  tokens, mask = data.encode_prompts(examples, TOK, P)
  return jnp.asarray(tokens), jnp.asarray(mask, jnp.int32), [ex.answer for ex in examples]


@pytest.fixture(scope="module")
def bf16_engine(params):
  return rollout.weight_sync(params, None)


def sample(engine, tokens, mask, engine_config, sampling=SAMPLING):
  """The module's sampled sequences: `engine` on these prompts at seed 1, one sequence id per row."""
  kwargs = dict(model_config=MODEL, rollout_config=engine_config, sampling=sampling)
  return rollout.generate(engine, tokens, mask, jax.random.key(1), seq_ids=jnp.arange(tokens.shape[0]), **kwargs)


@pytest.fixture(scope="module")
def bf16_rollout(bf16_engine, prompts):
  """256 sequences of 64 sampled tokens at temperature 1 from the untrained model, mask on."""
  tokens, mask, _ = prompts
  return sample(bf16_engine, tokens, mask, BF16_ENGINE)


@pytest.fixture(scope="module")
def bf16_engine_logits(bf16_engine, bf16_rollout, prompts):
  """The engine's logits [B, NEW, V] for the rollout's response slots, teacher-forced on its tokens.

  The whole batch: a bf16 engine's numerics depend on the batch it runs (expert grouping), as real engines' do.
  """
  return engine_logits(bf16_engine, bf16_rollout.tokens, prompts[1], BF16_ENGINE)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
  """A 32-id BPE over arithmetic text (PAD 0, BOS 1, EOS 2), built here and saved as tokenizer.json."""
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.decoder = tokenizers.decoders.Fuse()  # concatenate pieces: decode(encode(text)) == text
  trainer = tokenizers.trainers.BpeTrainer(vocab_size=32, special_tokens=["<pad>", "<s>", "</s>"])
  rng = random.Random(0)
  corpus = ["+".join(str(rng.randint(10, 99)) for _ in range(4)) + f"={rng.randint(40, 396)};" for _ in range(200)]
  tok.train_from_iterator(corpus, trainer)
  path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
  tok.save(str(path))
  return path


# --- config: which vocabulary is which ----------------------------------------------------


def test_run_config_states_both_vocabularies(hf_tokenizer):
  assert MODEL.vocab_size == 64 and TOK.vocab_size == 18
  assert (RUN.sampling.vocab_size, RUN.sampling.banned_ids) == (18, (TOK.pad_id, TOK.bos_id))
  hf = data.load_tokenizer(hf_tokenizer)
  assert hf.vocab_size == 32 < MODEL.vocab_size
  run = RunConfig.from_config(default.get_config(), hf)
  assert (run.sampling.vocab_size, run.sampling.banned_ids, run.sampling.eos_id) == (32, (0, 1), 2)
  # a tokenizer without PAD pads with EOS, and EOS stays samplable
  no_pad = data.HFTokenizer.from_file(hf_tokenizer, pad_token="</s>")
  assert never_generated_ids(no_pad) == (1,)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(vocab_size=-1), "sampling.vocab_size"),
    (dict(banned_ids=(-1,)), "sampling.banned_ids"),
    (dict(banned_ids=(0, 2)), r"sampling.banned_ids: bans EOS"),
    (dict(vocab_size=3, eos_id=5), r"sampling.eos_id: 5 lies outside"),
    (dict(vocab_size=2, banned_ids=(0, 1, 5), eos_id=-1), r"sampling.banned_ids: .* every id"),
  ],
)
def test_sampling_config_errors(kwargs, message):
  with pytest.raises(ConfigError, match=message):
    SamplingConfig(**kwargs)


# --- the one masking function -------------------------------------------------------------


def test_policy_logits_and_token_logprobs():
  logits = jax.random.normal(jax.random.key(0), (4, 5, MODEL.vocab_size)) * 3
  allowed = np.zeros(MODEL.vocab_size, bool)
  allowed[2 : TOK.vocab_size] = True  # EOS and the alphabet; not PAD, BOS or padded rows
  np.testing.assert_array_equal(model.samplable_ids(MODEL.vocab_size, SAMPLING), allowed)
  assert model.samplable_ids(MODEL.vocab_size, UNMASKED) is None and model.samplable_ids(64, None) is None
  policy = np.asarray(model.policy_logits(logits, SAMPLING))
  assert np.all(policy[..., ~allowed] == -np.inf) and np.array_equal(policy[..., allowed], logits[..., allowed])

  targets = jax.random.randint(jax.random.key(1), (4, 5), 0, MODEL.vocab_size)
  got = np.asarray(model.token_logprobs(logits, targets, SAMPLING))
  want = np.take_along_axis(np.asarray(jax.nn.log_softmax(policy)), np.asarray(targets)[..., None], -1)[..., 0]
  ok = allowed[np.asarray(targets)]
  assert 0 < ok.sum() < ok.size
  np.testing.assert_array_equal(got[ok], want[ok])  # the masked distribution, bit for bit
  assert np.all(np.isfinite(got))  # never-sampled targets (outside responses) stay finite
  # unmasked: bit-identical to the log_softmax it replaces
  for sampling in (None, UNMASKED):
    plain = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    np.testing.assert_array_equal(np.asarray(model.token_logprobs(logits, targets, sampling)), np.asarray(plain))


def test_loss_and_metrics_stay_finite_with_never_sampled_targets():
  """Prompt BOS/PAD targets and pads after EOS sit outside the loss mask; nothing turns NaN."""
  logits = jax.random.normal(jax.random.key(2), (4, 6, MODEL.vocab_size))
  targets = jnp.asarray([[1, 5, 7, 2, 0, 0]] * 4)  # BOS, two digits, EOS, pads
  loss_mask = jnp.asarray([[0, 1, 1, 1, 0, 0]] * 4)
  rollout_logp = model.token_logprobs(logits, targets, SAMPLING) * loss_mask + 0.01 * loss_mask
  cfg = GRPOConfig(kl_coef=0.1)

  def loss(logits):
    logp = model.token_logprobs(logits, targets, SAMPLING)
    old = jax.lax.stop_gradient(logp)
    value, metrics = rl.grpo_loss(logp, old, rollout_logp, jnp.asarray([1.0, -1, 0.5, 0]), loss_mask, cfg, old + 0.1)
    return value, {**metrics, **rl.mismatch_metrics(old, rollout_logp, loss_mask)}

  (value, metrics), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(logits)
  assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grads)))
  assert all(np.isfinite(float(v)) for v in metrics.values()), metrics
  never = ~model.samplable_ids(MODEL.vocab_size, SAMPLING)
  assert np.all(np.asarray(grads)[..., never] == 0)  # the masked ids get no gradient


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 4, 1.0), (1.0, 0, 0.5)])
def test_sample_never_draws_a_masked_id(temperature, top_k, top_p):
  """Logits that favour the masked ids (+4 over the rest): none is ever drawn, and the reported
  log-prob is the trainer's token_logprobs of the same (temperature-scaled) logits."""
  n = 4096
  never = ~model.samplable_ids(MODEL.vocab_size, SAMPLING)
  logits = jax.random.normal(jax.random.key(3), (n, MODEL.vocab_size)) + 4.0 * jnp.asarray(never)
  cfg = dataclasses.replace(SAMPLING, temperature=temperature, top_k=top_k, top_p=top_p)
  tokens, logp = rollout.sample(logits, jax.random.split(jax.random.key(4), n), cfg)
  tokens = np.asarray(tokens)
  assert not never[tokens].any()
  assert len(np.unique(tokens)) > 1
  expected = model.token_logprobs(logits, jnp.asarray(tokens), cfg)  # the temperature is the policy's
  np.testing.assert_allclose(np.asarray(logp), np.asarray(expected), rtol=1e-6, atol=1e-6)  # fp32 rounding
  # greedy: the best allowed id (a masked one has the highest logit in most rows)
  greedy = dataclasses.replace(cfg, temperature=0)
  tokens, logp = rollout.sample(logits, jax.random.split(jax.random.key(4), n), greedy)
  best = np.argmax(np.where(never, -np.inf, np.asarray(logits)), -1)
  np.testing.assert_array_equal(np.asarray(tokens), best)
  np.testing.assert_allclose(np.asarray(logp), np.asarray(model.token_logprobs(logits, tokens, greedy)), rtol=1e-6)


# --- the done-when check: an untrained model, 256 x 64 tokens at temperature 1 ---------------


def test_untrained_model_samples_only_decodable_ids(bf16_rollout, prompts):
  _, _, answers = prompts
  tokens = np.asarray(bf16_rollout.tokens)[:, P:]
  response = np.asarray(bf16_rollout.response_mask, bool)[:, P:]
  sampled = tokens[response]
  print(f"\n{B} x {NEW} tokens: {sampled.size} sampled, mean response length {response.sum(1).mean():.1f}")
  assert sampled.size > B * 8  # the untrained policy is near uniform: EOS ends responses after ~16 tokens
  assert sampled.max() < TOK.vocab_size
  assert not np.isin(sampled, never_generated_ids(TOK)).any()
  assert not data.invalid_responses(tokens, TOK).any()
  for verifier in ("exact", "numeric"):
    rewards = data.batch_rewards(answers, tokens, TOK, data.RewardConfig(verifier=verifier))
    assert rewards.shape == (B,) and np.all(np.isfinite(rewards))
  for row in tokens[:64]:  # every response decodes
    TOK.decode(row)


def test_unmasked_engine_would_sample_padded_ids(bf16_rollout, bf16_engine_logits):
  """Without the mask the untrained policy puts most of its mass on ids the tokenizer lacks."""
  p = np.asarray(jax.nn.softmax(bf16_engine_logits, -1))
  never = ~model.samplable_ids(MODEL.vocab_size, SAMPLING)
  mass = p[..., never].sum(-1)[np.asarray(bf16_rollout.response_mask, bool)[:, P:]]
  print(f"\nunmasked mass on never-sampled ids per step: mean {mass.mean():.3f}")
  assert mass.mean() > 0.5


# --- train-rollout parity with the mask ---------------------------------------------------


def test_bf16_mismatch_unchanged_by_the_mask(params, bf16_rollout, bf16_engine_logits):
  """On the same tokens, with the same engine and trainer logits: |dlogp| with the mask on both
  sides is the unmasked |dlogp| (the mask adds no mismatch); masking one side only would add ~1.4."""
  res = jax.tree_util.tree_map(lambda a: a[:R], bf16_rollout)
  response = np.asarray(res.response_mask[:, 1:], bool)
  targets = res.tokens[:, 1:]
  engine = jnp.zeros((R, P + NEW - 1, MODEL.vocab_size)).at[:, P - 1 :].set(bf16_engine_logits[:R])
  trainer = trainer_logits(params, res, qat.QatContext())
  lp = {
    (side, name): model.token_logprobs(logits, targets, sampling)
    for side, logits in (("engine", engine), ("trainer", trainer))
    for name, sampling in (("masked", SAMPLING), ("unmasked", None))
  }
  # the teacher-forced engine reproduces the recorded (masked) rollout log-probs
  recorded = response_dlogp(lp["engine", "masked"], res.logprobs[:, 1:], response)
  masked = response_dlogp(lp["trainer", "masked"], lp["engine", "masked"], response)
  unmasked = response_dlogp(lp["trainer", "unmasked"], lp["engine", "unmasked"], response)
  one_sided = response_dlogp(lp["trainer", "unmasked"], res.logprobs[:, 1:], response)
  print(
    f"\nbf16 engine vs bf16 trainer |dlogp| mean/max: masked {masked[0]:.5f}/{masked[1]:.5f}, "
    f"unmasked {unmasked[0]:.5f}/{unmasked[1]:.5f}; trainer unmasked vs masked rollout {one_sided[0]:.3f}; "
    f"teacher-forced engine vs recorded {recorded[1]:.1e}"
  )
  assert recorded[1] < 1e-4  # measured 5e-7 on CPU: the same computation, compiled apart
  assert 1e-5 < masked[0] and abs(masked[0] - unmasked[0]) < 0.1 * unmasked[0] and masked[1] < 2 * unmasked[1]
  assert one_sided[0] > 1.0


@pytest.fixture(scope="module")
def fp32_rollout(params, prompts):
  tokens, mask, _ = prompts
  engine = rollout.weight_sync(params, None, jnp.float32)
  return sample(
    engine, tokens[:FP32_B], mask[:FP32_B], FP32_ENGINE, dataclasses.replace(SAMPLING, max_new_tokens=FP32_NEW)
  )


def test_fp32_engine_logprobs_equal_masked_trainer(params, fp32_rollout):
  res = fp32_rollout
  response = np.asarray(res.response_mask[:, 1:], bool)
  logits = trainer_logits(params, res, qat.QatContext(compute_dtype=jnp.float32))
  masked = response_dlogp(model.token_logprobs(logits, res.tokens[:, 1:], SAMPLING), res.logprobs[:, 1:], response)
  unmasked = response_dlogp(model.token_logprobs(logits, res.tokens[:, 1:]), res.logprobs[:, 1:], response)
  print(f"\nfp32 engine vs fp32 trainer, both masked: |dlogp| max {masked[1]:.1e}; trainer unmasked {unmasked[0]:.3f}")
  assert response.sum() > 2 * FP32_B
  assert masked[1] < 1e-4  # fp32 rounding, as tests/test_rollout.py's unmasked parity
  assert unmasked[0] > 1.0


# --- rewards are total --------------------------------------------------------------------


def test_rewards_score_any_token_sequence(hf_tokenizer):
  rng = np.random.default_rng(0)
  responses = rng.integers(0, MODEL.vocab_size, (64, 20)).astype(np.int32)
  responses[:8, :3] = [TOK.token_id("8"), TOK.eos_id, 40]  # correct, an undecodable id after EOS only
  responses[8:16, :3] = [TOK.token_id("8"), 40, TOK.eos_id]  # an undecodable id inside the content
  answers = ["8"] * 64
  invalid = data.invalid_responses(responses, TOK)
  stop = (responses == TOK.eos_id) | (responses == TOK.pad_id)
  end = np.where(stop.any(1), stop.argmax(1), responses.shape[1])
  np.testing.assert_array_equal(invalid, [np.any(r[:e] >= TOK.vocab_size) for r, e in zip(responses, end)])
  assert not invalid[:8].any() and invalid[8:16].all()
  for verifier in ("exact", "numeric"):
    config = data.RewardConfig(verifier=verifier)
    rewards = data.batch_rewards(answers, responses, TOK, config)
    assert np.all(rewards[invalid] == 0) and np.allclose(rewards[:8], 1.1)
    scalar = [
      data.reward_fn({"prompt": "", "answer": a}, r, tokenizer=TOK, config=config) for a, r in zip(answers, responses)
    ]
    np.testing.assert_allclose(rewards, scalar)
  # an HF tokenizer silently drops unknown ids in decode; the rewards do not let them through
  hf = data.load_tokenizer(hf_tokenizer)
  ids = hf.encode("8")
  rows = np.full((2, 6), hf.pad_id, np.int32)
  rows[0, : len(ids) + 1] = [*ids, hf.eos_id]
  rows[1, : len(ids) + 2] = [hf.vocab_size + 3, *ids, hf.eos_id]
  assert hf.decode(rows[1]) == "8"
  np.testing.assert_array_equal(data.invalid_responses(rows, hf), [False, True])
  np.testing.assert_allclose(data.batch_rewards(["8", "8"], rows, hf, data.RewardConfig(verifier="numeric")), [1.1, 0])


# --- the whole loop: an HF tokenizer smaller than the embedding, JSONL running sums ------------


def running_sums(rng: random.Random, n: int) -> list[dict]:
  rows = []
  for _ in range(n):
    numbers = [rng.randint(10, 99) for _ in range(3)]
    sums = np.cumsum(numbers).tolist()
    prompt = "+".join(map(str, numbers)) + "="
    rows.append({"prompt": prompt, "answer": str(sums[-1]), "target": ";".join(map(str, sums))})
  return rows


@pytest.mark.slow
def test_loop_trains_with_a_smaller_hf_tokenizer(hf_tokenizer, tmp_path):
  rng = random.Random(0)
  paths = {}
  for split, n in (("train", 200), ("test", 16)):
    paths[split] = tmp_path / f"{split}.jsonl"
    paths[split].write_text("".join(json.dumps(row) + "\n" for row in running_sums(rng, n)))
  cfg = default.get_config()
  overrides = {
    **TINY,
    "data.tokenizer": str(hf_tokenizer),
    "data.jsonl_train": str(paths["train"]),
    "data.jsonl_test": str(paths["test"]),
    "data.max_prompt_len": 16,
    "reward.verifier": "numeric",
    "rollout.max_new_tokens": 16,
    "steps": 2,
    "eval_every": 0,
  }
  for key, value in overrides.items():
    section, _, field = key.rpartition(".")
    (cfg[section] if section else cfg)[field] = value
  summary = train.train_and_evaluate(cfg, str(tmp_path / "run"))
  rows = read_metrics(str(tmp_path / "run"))
  assert [r["step"] for r in rows] == [1, 2] and summary["steps"] == 2
  for row in rows:
    assert row["response/invalid_frac"] == 0.0 and row["finite"]
    assert np.isfinite(row["mismatch/logp_diff_mean"]) and row["mismatch/logp_diff_mean"] < 0.5
