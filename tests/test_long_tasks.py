"""Issue 16's tasks: the long-response running sum (generator, splits, the length knob, rewards with
partial credit, the tfds builder), the code tasks' sources and sandboxed rewards, their config
validation, and one short RL run on each (slow)."""

import dataclasses
import json
import re
import time

import numpy as np
import pytest

from configs import long_horizon
from experiments import sweep
from tests.tiny import TINY
from trace_jax import data, train
from trace_jax.config import ConfigError, DataConfig, RewardConfig, RunConfig
from trace_jax.data.code_tasks import SAMPLE_PATH
from trace_jax.data.long_tasks import RunningSumTask, mean_target_tokens, running_sum_example
from trace_jax.data.tokenizer import ARITHMETIC_ALPHABET, CODE_ALPHABET, RUNNING_SUM_ALPHABET
from trace_jax.metrics_writer import read_metrics

TOK = data.CharTokenizer(RUNNING_SUM_ALPHABET)
CODE_TOK = data.CharTokenizer(CODE_ALPHABET)


def tokens(text, tokenizer=TOK, eos=True, pad_to=None):
  ids = tokenizer.encode(text) + ([tokenizer.eos_id] if eos else [])
  pad_to = pad_to or len(ids)
  return np.asarray(ids + [tokenizer.pad_id] * (pad_to - len(ids)), np.int32)


def rows(texts, tokenizer=TOK, eos=True):
  width = max(len(t) for t in texts) + 2
  return np.stack([tokens(t, tokenizer, eos, width) for t in texts])


# --- the running sum ------------------------------------------------------------------------


def test_running_sum_example_fills_each_blank_with_the_partial_sum():
  ex = running_sum_example([47, 12, 85, 30], digits=2)
  assert (ex.prompt, ex.target, ex.difficulty) == ("47__;12__;85__;30__=", "4747;1259;8544;3074", 4)
  assert ex.answer == ex.target
  ex = running_sum_example([3, 9, 0, 8], digits=1)
  assert (ex.prompt, ex.target) == ("3_;9_;0_;8_=", "33;92;02;80")
  assert running_sum_example([5, 7], digits=3).target == "005005;007012"  # fixed width: a constant stride
  with pytest.raises(ValueError, match="terms must lie in"):
    running_sum_example([10], digits=1)


def test_running_sum_is_deterministic_and_splits_by_crc32():
  task = RunningSumTask(terms=8, digits=2)
  train_a, train_b = task.generate(0, 300), task.generate(0, 300)
  assert train_a == train_b
  assert task.generate(1, 300) != train_a
  test_0, test_1 = task.generate(0, 100, "test"), task.generate(1, 100, "test")
  assert all(data.is_test_problem(ex.prompt) for ex in test_0 + test_1)  # seed-independent rule
  assert not any(data.is_test_problem(ex.prompt) for ex in train_a)
  for ex in train_a[:50]:  # the targets are what they claim
    terms = [int(t.rstrip("_=")) for t in ex.prompt.split(";")]
    steps = ex.target.split(";")
    assert [int(step[:2]) for step in steps] == terms
    assert [int(step[2:]) for step in steps] == [s % 100 for s in np.cumsum(terms)]
  with pytest.raises(ValueError, match="terms"):
    RunningSumTask(terms=1)
  with pytest.raises(ValueError, match="split"):
    task.generate(0, 1, "validation")


def test_response_length_scales_with_the_terms():
  """The knob: mean SFT target length in tokens (EOS included) for three settings, and one more digit."""
  measured = {}
  for terms, digits in ((7, 2), (13, 2), (52, 2), (22, 1)):
    task = RunningSumTask(terms, digits)
    measured[(terms, digits)] = mean_target_tokens(task.generate(0, 200), TOK)
    longest = task.longest_example()
    assert len(TOK.encode(longest.target)) + 1 == measured[(terms, digits)] == terms * (2 * digits + 1)
    assert len(TOK.encode(longest.prompt)) == measured[(terms, digits)]  # and the prompt, without BOS
  print(f"\nmean response tokens by (terms, digits): {measured}")
  assert measured[(7, 2)] == 35 and measured[(13, 2)] == 65 and measured[(52, 2)] == 260


# --- rewards --------------------------------------------------------------------------------


def test_exact_verifier_on_running_sums_with_partial_credit():
  ex = running_sum_example([3, 9, 0, 8], digits=1)  # "3_;9_;0_;8_=" -> "33;92;02;80"
  plain, partial = RewardConfig(), RewardConfig(partial_credit=True)
  cases = [  # response, reward, reward with partial credit
    ("33;92;02;80", 1.1, 1.1),
    ("33;92;02;85", 0.1, 0.1 + 3 / 4),  # the last step wrong
    ("33;97;02;80", 1.1, 1.1),  # the final result decides correctness
    ("33;97;07;85", 0.1, 0.1 + 1 / 4),
    ("33;92", 0.1, 0.1 + 2 / 4),  # stopped early: the final result is missing
    ("33;92;02;80;80", 1.0, 1.0),  # one step too many (more ';' than the answer): malformed
    ("33;92;;80", 1.0, 1.0),  # an empty step is malformed
    ("33;92;0_;80", 1.0, 1.0 + 0.0),  # a blank left in: malformed, and that step wrong
    ("80", 1.1, 1.1),  # the right final result without steps: correct and well formed
  ]
  for text, want, want_partial in cases:
    assert data.reward_fn(ex, text, tokenizer=TOK, config=plain) == pytest.approx(want), text
    assert data.reward_fn(ex, text, tokenizer=TOK, config=partial) == pytest.approx(want_partial), text
  # batch_rewards (vectorized for the character tokenizer) equals reward_fn row by row
  texts = [c[0] for c in cases] + ["33;92;02;80;1;2;3;4;5", "3_;9_", ""]
  responses = rows(texts)
  for config in (plain, partial, RewardConfig(partial_credit=True, format_reward=0.0, correct_reward=2.0)):
    got = data.batch_rewards([ex.answer] * len(texts), responses, TOK, config)
    want = [data.reward_fn(ex, r, tokenizer=TOK, config=config) for r in responses]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_arithmetic_rewards_are_unchanged_by_partial_credit():
  """The arithmetic task's answers hold only the final result: partial credit adds nothing."""
  tok = data.CharTokenizer()
  examples = data.ArithmeticTask((1, 2, 3, 4)).generate(0, 32)
  texts = [t for ex in examples for t in (ex.target, ex.target + "1", "1;2;" + ex.answer)]
  answers = [ex.answer for ex in examples for _ in range(3)]
  responses = rows(texts, tok)
  np.testing.assert_allclose(
    data.batch_rewards(answers, responses, tok, RewardConfig(partial_credit=True)),
    data.batch_rewards(answers, responses, tok, RewardConfig()),
  )
  assert data.reward_fn(examples[0], "1;2;" + examples[0].answer) == pytest.approx(1.0)  # two steps: malformed


def test_sft_targets_earn_the_full_reward():
  examples = RunningSumTask(16, 2).generate(0, 64)
  responses = rows([ex.target for ex in examples])
  np.testing.assert_allclose(data.batch_rewards([ex.answer for ex in examples], responses, TOK), 1.1, rtol=1e-6)


# --- the tfds builder -----------------------------------------------------------------------


def test_running_sum_tfds_round_trip(tmp_path):
  kwargs = dict(terms=12, digits=2, num_train=60, num_test=10, seed=3)
  builder = data.build_running_sum_dataset(tmp_path, **kwargs)
  assert builder.name == "trace_running_sum"
  assert builder.builder_config.name == "terms12_digits2_train60_test10_seed3"
  for split, n in (("train", 60), ("test", 10)):
    source = data.running_sum_source(split, data_dir=tmp_path, **kwargs)
    want = RunningSumTask(12, 2).generate(3, n, split)
    assert [data.as_example(source[i]) for i in range(len(source))] == want
  # the arithmetic dataset keeps its name, config names and place
  arithmetic = data.build_arithmetic_dataset(tmp_path, levels=(1,), num_train=20, num_test=5, seed=0)
  assert arithmetic.name == "trace_arithmetic" and "trace_arithmetic/levels1_train20_test5_seed0" in arithmetic.data_dir
  assert data.TraceArithmetic.DEFAULT_CONFIG_NAME == "levels1-2_train20000_test1000_seed0"


# --- code tasks -----------------------------------------------------------------------------

TESTS = "assert f(1) == 4\nassert f(2) == 5\nassert f(10) == 13\n"
PROGRAMS = {  # program, reward (no format bonus), with partial credit, well formed
  "correct": ("def f(x):\n  return x + 3\n", 1.0, 1.0, True),
  "fenced": ("Here:\n```python\ndef f(x):\n  return x + 3\n```\n", 1.0, 1.0, True),
  "partly": ("def f(x):\n  return 4 if x == 1 else 0\n", 0.0, 1 / 3, True),
  "loops": ("def f(x):\n  while True:\n    pass\n", 0.0, 0.0, True),
  "kills": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\ndef f(x):\n  return x + 3\n", 0.0, 0.0, True),
  "forks": ("import os\nwhile True:\n  os.fork()\n", 0.0, 0.0, True),
  "syntax": ("def f(x) return x\n", 0.0, 0.0, False),
  "empty": ("", 0.0, 0.0, False),
}


def test_code_reward_runs_programs_in_the_sandbox():
  """A correct program scores 1, a hostile one 0, and the rest of the batch is unaffected."""
  names = list(PROGRAMS)
  responses = rows([PROGRAMS[n][0] for n in names], CODE_TOK)
  plain = RewardConfig(verifier="code", code_timeout_s=1.0, format_reward=0.0)
  t0 = time.perf_counter()
  for config, column in ((plain, 1), (dataclasses.replace(plain, partial_credit=True), 2)):
    rewards, invalid = data.make_reward_fn("code_synthesis", CODE_TOK, config)([TESTS] * len(names), responses)
    assert not invalid.any()
    np.testing.assert_allclose(rewards, [PROGRAMS[n][column] for n in names], rtol=1e-6, err_msg=str(names))
  print(f"\ncode rewards of {2 * len(names)} programs: {time.perf_counter() - t0:.1f} s")
  # the format bonus: a program that parses, in a finished response; an undecodable id is invalid, 0
  bonus = dataclasses.replace(plain, format_reward=0.1)
  unfinished = tokens(PROGRAMS["correct"][0], CODE_TOK, eos=False, pad_to=40)
  bad = tokens(PROGRAMS["correct"][0], CODE_TOK, pad_to=40)
  bad[3] = CODE_TOK.vocab_size + 5
  batch = np.stack(
    [tokens(PROGRAMS[n][0], CODE_TOK, pad_to=40) for n in ("correct", "syntax", "loops")] + [unfinished, bad]
  )
  rewards, invalid = data.make_reward_fn("code_synthesis", CODE_TOK, bonus)([TESTS] * 5, batch)
  np.testing.assert_allclose(rewards, [1.1, 0.0, 0.1, 1.0, 0.0], rtol=1e-6)
  np.testing.assert_array_equal(invalid, [False, False, False, False, True])
  assert data.reward_fn({"prompt": "", "answer": TESTS}, PROGRAMS["correct"][0], config=bonus) == pytest.approx(1.1)


def test_extract_program():
  assert data.extract_program("def f(x):\n  return x\n") == "def f(x):\n  return x\n"
  assert data.extract_program("text\n```python\nA = 1\n```\nmore ```py\nB\n```") == "A = 1\n"
  assert data.extract_program("```\nA = 1\n") == "A = 1\n"  # an unclosed fence runs to the end


def test_code_sources_and_tokenizer():
  cfg = DataConfig(task="code_synthesis", num_train=40, num_test=8, max_prompt_len=160)
  tokenizer, train_src, test_src = train.load_data(cfg, max_new_tokens=32)
  assert tokenizer.vocab_size == 100 and tokenizer.alphabet == CODE_ALPHABET
  assert (len(train_src), len(test_src)) == (40, 8)
  assert all(data.is_test_problem(ex.prompt) for ex in test_src)
  assert not any(data.is_test_problem(ex.prompt) for ex in train_src)
  ex = train_src[0]
  assert ex.prompt.startswith("Write f so that:\n") and ex.target.startswith("def f(x):")
  results = data.code_rewards(
    [e.answer for e in train_src[:4]], [e.target for e in train_src[:4]], [True] * 4, RewardConfig(verifier="code")
  )
  np.testing.assert_allclose(results[0], 1.1)  # the references pass their hidden tests
  assert all(r.status == "ok" for r in results[1])
  with pytest.raises(ConfigError, match=r"config\.rollout\.max_new_tokens: answers of problem synthesis/0/\d+ need"):
    train.load_data(cfg, max_new_tokens=8)
  # JSONL problems (the shipped sample)
  tokenizer, train_src, test_src = train.load_data(
    DataConfig(task="code_jsonl", jsonl_train=SAMPLE_PATH, max_prompt_len=200), 200
  )
  assert len(train_src) == 8 and test_src is train_src and train_src[0].metadata["name"] == "sample/1"
  assert "assert" in train_src[0].answer


def test_load_data_picks_source_and_tokenizer_by_task(tmp_path):
  cfg = DataConfig(
    task="running_sum", sum_terms=6, term_digits=2, num_train=30, num_test=5, max_prompt_len=31, data_dir=str(tmp_path)
  )
  tokenizer, train_src, test_src = train.load_data(cfg, max_new_tokens=30)
  assert tokenizer.alphabet == RUNNING_SUM_ALPHABET and (len(train_src), len(test_src)) == (30, 5)
  assert data.as_example(train_src[0]) == RunningSumTask(6, 2).generate(0, 1)[0]
  with pytest.raises(
    ConfigError, match=r"^config\.rollout\.max_new_tokens: answers of the running sum of 6 2-digit terms need 30"
  ):
    train.load_data(cfg, max_new_tokens=29)
  with pytest.raises(ConfigError, match=r"^config\.data\.max_prompt_len: prompts of the running sum .* need 31"):
    train.load_data(dataclasses.replace(cfg, max_prompt_len=30), max_new_tokens=30)
  assert data.load_tokenizer(task="code_jsonl").alphabet == CODE_ALPHABET
  assert data.load_tokenizer().alphabet == data.task_alphabet("arithmetic") == ARITHMETIC_ALPHABET


# --- config validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
  "fields, field",
  [
    ({"task": "sorting"}, "data.task"),
    ({"sum_terms": 1}, "data.sum_terms"),
    ({"term_digits": 0}, "data.term_digits"),
    ({"task": "code_jsonl"}, "data.jsonl_train"),
    ({"task": "running_sum", "jsonl_train": "x.jsonl"}, "data.jsonl_train"),
    ({"jsonl_test": "x.jsonl"}, "data.jsonl_test"),
    ({"num_train": 0}, "data.num_train"),
  ],
)
def test_data_config_errors_name_the_field(fields, field):
  with pytest.raises(ConfigError, match="^" + re.escape(f"config.{field}: ")):
    DataConfig(**fields)


def test_reward_config_and_verifier_task_fit():
  with pytest.raises(ConfigError, match=r"^config\.reward\.partial_credit: "):
    RewardConfig(verifier="numeric", partial_credit=True)
  with pytest.raises(ConfigError, match=r"^config\.reward\.code_timeout_s: "):
    RewardConfig(verifier="code", code_timeout_s=0)
  with pytest.raises(ConfigError, match=r"^config\.reward\.verifier: task 'code_synthesis' needs 'code'"):
    data.make_reward_fn("code_synthesis", CODE_TOK, RewardConfig())
  with pytest.raises(ConfigError, match=r"^config\.reward\.verifier: task 'running_sum' needs 'exact' or 'numeric'"):
    data.make_reward_fn("running_sum", TOK, RewardConfig(verifier="code"))


def test_long_horizon_config():
  for arg in ("trace", "qat,terms=26", "bf16,model=tiny,terms=22,digits=1", "trace,task=code"):
    cfg = long_horizon.get_config(arg)
    run = RunConfig.from_config(cfg)
    tokenizer = data.load_tokenizer(task=run.data.task)
    run = run.with_tokenizer(tokenizer)
    if run.data.task == "running_sum":
      task = RunningSumTask(run.data.sum_terms, run.data.term_digits)
      data.check_lengths(
        {"longest": task.longest_example()}, tokenizer, run.data.max_prompt_len, run.sampling.max_new_tokens
      )
      assert run.sampling.max_new_tokens == mean_target_tokens(task.generate(0, 16), tokenizer)
  run = RunConfig.from_config(long_horizon.get_config("trace"))
  assert run.data.task == "running_sum" and run.sampling.max_new_tokens >= 64 and run.mode.name == "trace"
  assert RunConfig.from_config(long_horizon.get_config("trace,task=code")).reward.verifier == "code"
  for bad in ("trace,task=chess", "trace,task=code,terms=8", "trace,depth=3"):
    with pytest.raises(ValueError, match="configs/long_horizon.py"):
      long_horizon.get_config(bad)


# --- one short RL run on each task (slow) ----------------------------------------------------


def smoke_config(arg, **overrides):
  tiny = {k: v for k, v in TINY.items() if not k.startswith(("data.", "rollout."))}
  return sweep.configure(
    long_horizon.get_config(arg),
    {**tiny, "steps": 2, "checkpoint_every": 2, "eval_every": 0, "eval_prompts": 4, **overrides},
  )


@pytest.mark.slow
def test_the_code_task_trains_end_to_end_with_sandboxed_rewards(tmp_path):
  cfg = smoke_config("trace,task=code", **{"data.num_train": 16, "data.num_test": 4, "rollout.max_new_tokens": 32})
  summary = train.train_and_evaluate(cfg, str(tmp_path / "run"))
  metrics = read_metrics(str(tmp_path / "run"))
  assert summary["steps"] == 2 and len(metrics) == 2
  assert all(np.isfinite(r["reward/mean"]) and r["finite"] for r in metrics)
  assert 0 <= summary["final/accuracy_fp4_engine"] <= 1
  print("\n" + json.dumps({k: metrics[-1][k] for k in ("reward/mean", "response/length_mean", "time/step_s")}))


@pytest.mark.slow
def test_the_running_sum_trains_end_to_end(tmp_path):
  cfg = smoke_config(
    "trace,terms=8,digits=1", **{"data.num_train": 64, "data.num_test": 8, "data.data_dir": str(tmp_path / "tfds")}
  )
  summary = train.train_and_evaluate(cfg, str(tmp_path / "run"))
  metrics = read_metrics(str(tmp_path / "run"))
  assert summary["steps"] == 2 and len(metrics) == 2
  assert all(np.isfinite(r["reward/mean"]) and r["finite"] for r in metrics)
  print("\n" + json.dumps({k: metrics[-1][k] for k in ("reward/mean", "response/length_mean", "time/step_s")}))
