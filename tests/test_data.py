"""Tests of trace_jax.data: task, tokenizers, rewards, tfds (without TensorFlow), JSONL, batching."""

import importlib.util
import json
import sys

import numpy as np
import pytest
import tokenizers

from trace_jax.config import ConfigError
from trace_jax.data import (
  LEVELS,
  ArithmeticTask,
  CharTokenizer,
  EpochSampler,
  Example,
  HFTokenizer,
  JsonlFormatError,
  JsonlSource,
  PromptBatcher,
  RewardConfig,
  SFTBatcher,
  TraceArithmetic,
  answer_number,
  arithmetic_source,
  batch_rewards,
  build_arithmetic_dataset,
  check_lengths,
  extract_last_number,
  is_test_problem,
  load_tokenizer,
  longest_example,
  reward_fn,
)

# --- task ---------------------------------------------------------------------------------


@pytest.mark.parametrize("level", LEVELS)
def test_answers_are_correct_by_eval(level):
  examples = ArithmeticTask((level,)).generate(seed=0, n=500)
  for ex in examples:
    assert ex.difficulty == level
    assert ex.prompt.endswith("=")
    assert int(ex.answer) == eval(ex.prompt[:-1]) >= 0
    steps = ex.target.split(";")
    assert steps[-1] == ex.answer
    if level in (2, 4):  # worked step: a+b, then the result
      a, b, _ = map(int, ex.prompt[:-1].replace("-", "+").split("+"))
      assert steps == [str(a + b), ex.answer]
    else:
      assert steps == [ex.answer]


def test_levels_have_their_operand_ranges_and_short_sequences():
  tok = CharTokenizer()
  for level, (lo, hi) in zip(LEVELS, [(0, 9), (0, 9), (10, 99), (10, 99)]):
    examples = ArithmeticTask((level,)).generate(seed=1, n=300)
    operands = np.array([list(map(int, ex.prompt[:-1].replace("-", "+").split("+"))) for ex in examples])
    assert operands.shape[1] == (2 if level in (1, 3) else 3)
    assert operands.min() >= lo and operands.max() <= hi
    assert max(len(tok.encode(ex.prompt)) + 1 for ex in examples) <= 10  # + BOS
    assert max(len(tok.encode(ex.target)) + 1 for ex in examples) <= 8  # + EOS


@pytest.mark.parametrize("level", LEVELS)
def test_longest_example_bounds_its_level(level):
  """What the up-front length check relies on: no problem of a level is longer than its longest_example."""
  longest = longest_example(level)
  assert longest.difficulty == level and int(longest.answer) == eval(longest.prompt[:-1])
  examples = ArithmeticTask((level,)).generate(seed=2, n=2000)
  assert max(len(ex.prompt) for ex in examples) == len(longest.prompt)
  assert max(len(ex.target) for ex in examples) == len(longest.target)


def test_generation_is_deterministic_by_seed_and_mixes_levels():
  task = ArithmeticTask((1, 2, 3, 4))
  assert task.generate(7, 400) == task.generate(7, 400)
  assert task.generate(7, 400) != task.generate(8, 400)
  assert {ex.difficulty for ex in task.generate(7, 400)} == set(LEVELS)
  with pytest.raises(ValueError, match="levels"):
    ArithmeticTask((5,))


def test_test_split_holds_out_problems():
  task = ArithmeticTask((1, 3))
  train, test = task.generate(0, 2000, "train"), task.generate(0, 300, "test")
  assert all(is_test_problem(ex.prompt) for ex in test)
  assert not {ex.prompt for ex in train} & {ex.prompt for ex in test}


# --- char tokenizer -----------------------------------------------------------------------


def test_char_tokenizer_round_trip_and_specials():
  tok = CharTokenizer()
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.vocab_size == 3 + len("0123456789+-*=;") < 64
  text = "47+85-19=132;113"
  ids = tok.encode(text)
  assert len(ids) == len(text) and min(ids) >= 3
  assert tok.decode(ids) == text
  assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text
  assert tok.decode([tok.bos_id, *tok.encode("8"), tok.eos_id], skip_special=False) == "<bos>8<eos>"
  with pytest.raises(ValueError, match="not in the alphabet"):
    tok.encode("3 + 5")
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([tok.vocab_size])
  assert isinstance(load_tokenizer(), CharTokenizer)


# --- rewards ------------------------------------------------------------------------------

EX = Example(prompt="7+5-4=", answer="8", target="12;8", difficulty=2)


def _tokens(text, eos=True, pad_to=10):
  tok = CharTokenizer()
  ids = [tok.bos_id if c == "B" else tok.token_id(c) for c in text] + ([tok.eos_id] if eos else [])
  return np.array(ids + [tok.pad_id] * (pad_to - len(ids)), np.int32)


@pytest.mark.parametrize(
  "response, eos, expected",
  [
    ("8", True, 1.1),  # correct and well formed
    ("12;8", True, 1.1),  # with the worked step
    ("13;8", True, 1.1),  # only the final answer is verified
    ("8", False, 1.0),  # correct but never ended: no format bonus
    ("9", True, 0.1),  # wrong, well formed
    ("12;9", True, 0.1),
    ("08", True, 0.1),  # exact spelling: "08" is not "8"
    ("8;", True, 0.0),  # malformed and the final segment is empty
    ("1;2;8", True, 1.0),  # correct final answer, but more than one step is malformed
    ("+8", True, 0.0),
    ("8B", True, 0.0),  # a stray BOS
    ("", True, 0.0),
  ],
)
def test_exact_reward_on_tokens(response, eos, expected):
  assert reward_fn(EX, _tokens(response, eos)) == pytest.approx(expected)


def test_reward_on_text_and_configs():
  assert reward_fn(EX, "12;8") == pytest.approx(1.1)
  assert reward_fn(EX, "12;8", finished=False) == pytest.approx(1.0)
  assert reward_fn(EX, "7") == pytest.approx(0.1)
  assert reward_fn(EX, "eight") == 0.0
  assert reward_fn(EX, "8", config=RewardConfig(format_reward=0.0)) == 1.0
  assert reward_fn({"prompt": "7+5-4=", "answer": "8"}, "8", config=RewardConfig(correct_reward=2.0)) == 2.1
  numeric = RewardConfig(verifier="numeric")
  assert reward_fn(EX, "so it is 8.", config=numeric) == pytest.approx(1.1)
  with pytest.raises(ValueError, match="verifier"):
    RewardConfig(verifier="fuzzy")


def test_batch_rewards_match_scalar_rewards():
  tok = CharTokenizer()
  rng = np.random.default_rng(0)
  examples = ArithmeticTask((1, 2, 3, 4)).generate(0, 64)
  rows, answers = [], []
  for ex in examples:  # targets, their corruptions, and random tokens
    for text in (ex.target, ex.answer, ex.target + "1", "1" + ex.answer, ex.target.replace(";", ";;")):
      rows.append(_tokens(text, eos=bool(rng.integers(2)), pad_to=12))
      answers.append(ex.answer)
    rows.append(rng.integers(0, tok.vocab_size, 12).astype(np.int32))
    answers.append(ex.answer)
  responses = np.stack(rows)
  for config in (RewardConfig(), RewardConfig(correct_reward=0.5, format_reward=0.25)):
    got = batch_rewards(answers, responses, tok, config)
    want = [reward_fn({"prompt": "", "answer": a}, r, tokenizer=tok, config=config) for a, r in zip(answers, responses)]
    assert got.dtype == np.float32 and got.shape == (len(answers),)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got.max() == pytest.approx(config.correct_reward + config.format_reward)


# --- numeric verifier ---------------------------------------------------------------------


@pytest.mark.parametrize(
  "text, number",
  [
    ("The answer is 1,234.", "1234"),
    ("#### 72", "72"),
    ("costs $18.00 in total", "18.00"),
    ("first 3 then 5-3", "3"),
    ("it is -4", "-4"),
    ("x=-4.5.", "-4.5"),
    ("1,2,3", "3"),
    ("no number", None),
  ],
)
def test_extract_last_number(text, number):
  assert extract_last_number(text) == number


@pytest.mark.parametrize(
  "answer, response, correct",
  [
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "48 + 24 = 72", True),
    ("#### 1,234", "The total is 1234.", True),
    ("72", "The answer is 72.0", True),
    ("18", "$18.00", True),
    ("#### 72", "#### 27", False),
    ("72", "72 apples, no wait, 71", False),
    ("-3", "it drops to -3", True),
    ("72", "I don't know", False),
  ],
)
def test_numeric_verifier(answer, response, correct):
  config = RewardConfig(verifier="numeric", format_reward=0.0)
  assert reward_fn({"prompt": "q", "answer": answer}, response, config=config) == float(correct)


# --- tfds without TensorFlow ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tfds_builder(tmp_path_factory):
  return build_arithmetic_dataset(tmp_path_factory.mktemp("tfds"), levels=(1, 2), num_train=3000, num_test=200, seed=5)


def _records(source):
  return [source[i] for i in range(len(source))]


def test_tfds_build_and_read_without_tensorflow(tfds_builder, tmp_path):
  import tensorflow_datasets as tfds

  assert isinstance(tfds_builder, TraceArithmetic)
  train, test = tfds_builder.as_data_source("train"), tfds_builder.as_data_source("test")
  assert (len(train), len(test)) == (3000, 200)
  assert list(tfds_builder.data_path.glob("*.array_record*"))
  rec = train[0]
  assert set(rec) == {"prompt", "answer", "target", "difficulty"}
  expected = ArithmeticTask((1, 2)).generate(5, 3000, "train")
  assert [r["prompt"].decode() for r in _records(train)] == [ex.prompt for ex in expected]
  assert all(int(r["answer"]) == eval(r["prompt"].decode()[:-1]) for r in _records(test))

  # Reading back by name, as a run that did not build it would.
  root = tfds_builder.data_path.parents[2]  # root/trace_arithmetic/<config>/<version>
  by_name = tfds.data_source(f"trace_arithmetic/{tfds_builder.builder_config.name}", data_dir=root, split="test")
  assert _records(by_name) == _records(test)
  kwargs = dict(data_dir=root, levels=(1, 2), num_train=3000, num_test=200, seed=5)
  assert _records(arithmetic_source("test", **kwargs)) == _records(test)

  # Same seed, another directory: the same records.
  again = build_arithmetic_dataset(tmp_path, levels=(1, 2), num_train=3000, num_test=200, seed=5)
  assert _records(again.as_data_source("train")) == _records(train)

  assert "tensorflow" not in sys.modules
  assert importlib.util.find_spec("tensorflow") is None


# --- JSONL --------------------------------------------------------------------------------


def _write_jsonl(path, lines):
  path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
  return path


def test_jsonl_source_reads_gsm8k_style_lines(tmp_path):
  path = _write_jsonl(
    tmp_path / "train.jsonl",
    [
      {"prompt": "Natalia sold 48 clips...", "answer": "She sold 48/2 = 24.\n#### 72", "id": "a"},
      "",
      {"prompt": "2+2=", "answer": 4, "difficulty": 1, "target": "4"},
    ],
  )
  source = JsonlSource(path)
  assert len(source) == 2
  assert source[0].answer.endswith("#### 72") and source[0].target == source[0].answer
  assert source[0].metadata == {"line": 1, "id": "a"}
  assert (source[1].answer, source[1].difficulty, source[1].metadata["line"]) == ("4", 1, 3)
  assert answer_number(source[0].answer) == "72"


@pytest.mark.parametrize(
  "bad_line, message",
  [
    ('{"prompt": "q", "answer": ', "invalid JSON"),
    ('{"prompt": "q"}', "missing field 'answer'"),
    ('{"answer": "1"}', "missing field 'prompt'"),
    ('["q", "1"]', "expected a JSON object"),
    ('{"prompt": "q", "answer": "none"}', "no number"),
    ('{"prompt": "q", "answer": "1", "difficulty": "hard"}', "'difficulty' must be an integer"),
  ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, bad_line, message):
  path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "q", "answer": "1"}, bad_line])
  with pytest.raises(JsonlFormatError, match=message) as err:
    JsonlSource(path)
  assert f"{path}:2:" in str(err.value)


# --- Hugging Face tokenizer.json ----------------------------------------------------------


@pytest.fixture(scope="module")
def hf_tokenizer_path(tmp_path_factory):
  """A tiny byte-level BPE trained here, offline, and saved as tokenizer.json."""
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
    vocab_size=300,
    special_tokens=["<pad>", "<s>", "</s>"],
    initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
  )
  corpus = ["The answer is 72.", "Natalia sold 48 clips in April.", "3+5=8", "47+85-19=132;113"] * 20
  tok.train_from_iterator(corpus, trainer)
  path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
  tok.save(str(path))
  return path


def test_hf_tokenizer_interface(hf_tokenizer_path):
  tok = load_tokenizer(hf_tokenizer_path.parent)
  assert isinstance(tok, HFTokenizer)
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert 256 < tok.vocab_size <= 300
  for text in ["The answer is 72.", "Natalia sold 1,234 clips!", "3+5=8"]:
    ids = tok.encode(text)
    assert tok.bos_id not in ids and tok.eos_id not in ids  # encode adds no specials
    assert tok.decode(ids) == text
  assert tok.decode([tok.bos_id, *tok.encode("8"), tok.eos_id]) == "8"
  assert HFTokenizer.from_file(hf_tokenizer_path, eos_token="<pad>").eos_id == 0
  with pytest.raises(ValueError, match="not in the vocabulary"):
    HFTokenizer.from_file(hf_tokenizer_path, eos_token="<|im_end|>")
  with pytest.raises(FileNotFoundError):
    load_tokenizer(hf_tokenizer_path.parent / "missing.json")


def test_hf_tokenizer_batching_and_rewards(hf_tokenizer_path, tmp_path):
  tok = load_tokenizer(hf_tokenizer_path)
  source = JsonlSource(
    _write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"What is {i}+{i}?", "answer": f"#### {2 * i}"} for i in range(10)])
  )
  batch = PromptBatcher(source, tok, batch_size=4, max_prompt_len=16, seed=0).batch_at(3)
  for row, prompt in zip(range(4), batch.prompts):
    assert tok.decode(batch.tokens[row][batch.mask[row]]) == prompt
    assert batch.tokens[row][batch.mask[row]][0] == tok.bos_id
  expected = answer_number(batch.answers[0])
  texts = [f"so {expected}", f"so {expected}1", "no idea"]
  responses = np.full((3, 12), tok.pad_id, np.int32)
  for row, text in enumerate(texts):
    ids = tok.encode(text) + [tok.eos_id]
    responses[row, : len(ids)] = ids
  rewards = batch_rewards([batch.answers[0]] * 3, responses, tok, RewardConfig(verifier="numeric"))
  np.testing.assert_allclose(rewards, [1.1, 0.1, 0.0], rtol=1e-6)


# --- batching -----------------------------------------------------------------------------


def test_epoch_sampler_is_a_deterministic_stream_of_permutations():
  sampler = EpochSampler(num_examples=10, batch_size=4, seed=3)
  stream = np.concatenate([sampler.indices_at(step) for step in range(5)])  # 20 = two epochs
  assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
  assert not np.array_equal(stream[:10], stream[10:])
  np.testing.assert_array_equal(sampler.indices_at(2), EpochSampler(10, 4, 3).indices_at(2))
  assert not np.array_equal(stream[:10], np.concatenate([EpochSampler(10, 4, 4).indices_at(s) for s in range(3)])[:10])
  np.testing.assert_array_equal(EpochSampler(10, 4, 3, shuffle=False).indices_at(2), [8, 9, 0, 1])


def test_prompt_batches_are_deterministic_and_left_padded():
  tok = CharTokenizer()
  source = ArithmeticTask((1, 4)).generate(0, 100)
  batcher = PromptBatcher(source, tok, batch_size=8, max_prompt_len=12, seed=1)
  later_first = batcher.batch_at(7)
  it = batcher.iterate(start_step=5)
  next(it), next(it)
  resumed = next(it)  # a resumed run reaching step 7
  fresh = PromptBatcher(source, tok, batch_size=8, max_prompt_len=12, seed=1).batch_at(7)
  for batch in (resumed, fresh):
    np.testing.assert_array_equal(batch.tokens, later_first.tokens)
    assert batch.answers == later_first.answers and batch.step == 7

  batch = later_first
  assert batch.tokens.dtype == np.int32 and batch.tokens.shape == (8, 12) and batch.mask.dtype == bool
  assert batch.mask[:, -1].all()  # every prompt ends in the last column
  np.testing.assert_array_equal(batch.mask, np.cumsum(batch.mask, 1) > 0)  # pads only on the left
  assert (batch.tokens[~batch.mask] == tok.pad_id).all()
  for row, i in enumerate(batch.indices):
    ex = source[i]
    assert batch.prompts[row] == ex.prompt and batch.answers[row] == ex.answer
    assert batch.difficulty[row] == ex.difficulty
    assert list(batch.tokens[row][batch.mask[row]]) == [tok.bos_id, *tok.encode(ex.prompt)]

  with pytest.raises(ValueError, match="over the limit of 4"):
    PromptBatcher(source, tok, batch_size=8, max_prompt_len=4).batch_at(0)


def test_prompt_batcher_reads_tfds_sources(tfds_builder):
  batch = PromptBatcher(tfds_builder.as_data_source("train"), CharTokenizer(), 16, 10, seed=0).batch_at(0)
  assert all(isinstance(p, str) for p in batch.prompts)
  assert all(int(a) == eval(p[:-1]) for p, a in zip(batch.prompts, batch.answers))


def test_check_lengths_names_the_field_and_the_fix():
  """Level 4's "99+99-10=" -> "198;188": 10 prompt tokens with BOS, 8 answer tokens with EOS."""
  tok = CharTokenizer()
  examples = {f"level {level}": longest_example(level) for level in (1, 2, 3, 4)}
  check_lengths(examples, tok, max_prompt_len=10, max_new_tokens=8)  # fits exactly
  with pytest.raises(ConfigError, match=r"^config\.rollout\.max_new_tokens: answers of level 4 need 8 tokens with EOS"):
    check_lengths(examples, tok, max_prompt_len=10, max_new_tokens=7)
  with pytest.raises(ConfigError, match=r"config\.rollout\.max_new_tokens: .*raise it to >= 6"):
    check_lengths({k: examples[k] for k in ("level 1", "level 2")}, tok, max_prompt_len=10, max_new_tokens=5)
  with pytest.raises(
    ConfigError, match=r"^config\.data\.max_prompt_len: prompts of level 4 need 10 tokens with BOS.*>= 10"
  ):
    check_lengths(examples, tok, max_prompt_len=9, max_new_tokens=8)


def test_sft_batch_layout():
  tok = CharTokenizer()
  source = ArithmeticTask((2, 3)).generate(0, 50)
  batch = SFTBatcher(source, tok, batch_size=6, max_prompt_len=8, max_target_len=8, seed=0).batch_at(4)
  assert batch.tokens.shape == batch.mask.shape == batch.loss_mask.shape == (6, 16)
  assert batch.prompt_len == 8 and not batch.loss_mask[:, :8].any()
  assert batch.mask[:, 7:9].all()  # prompt and target are contiguous at the boundary
  for row, i in enumerate(batch.indices):
    ex = source[i]
    target = [*tok.encode(ex.target), tok.eos_id]
    assert list(batch.tokens[row][batch.loss_mask[row]]) == target
    assert list(batch.tokens[row][batch.mask[row]]) == [tok.bos_id, *tok.encode(ex.prompt), *target]
    assert list(batch.tokens[row, 8 : 8 + len(target)]) == target
  with pytest.raises(ValueError, match="target"):
    SFTBatcher(source, tok, batch_size=6, max_prompt_len=8, max_target_len=3).batch_at(0)
