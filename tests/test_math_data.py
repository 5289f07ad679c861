"""The math task: GSM8K- and MATH-style rows from JSONL and Parquet, and the math-verify verifier."""

import json
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests import pretrained
from trace_jax import data
from trace_jax.config import ConfigError, RewardConfig

MATH = RewardConfig(verifier="math", format_reward=0.1)

# (reference, response, correct)
TABLE = [
  ("\\frac{1}{2}", "so \\boxed{0.5}", True),
  ("0.5", "\\boxed{\\frac{1}{2}}", True),
  ("\\frac{1}{2}", "\\boxed{1/2}", True),
  ("0.75", "\\boxed{\\frac{3}{4}}", True),
  ("42", "\\boxed{42.0}", True),
  ("42", "The answer is \\boxed{41}.", False),
  ("72", "48 + 24 = 72\n#### 72", True),
  ("72", "#### 71", False),
  ("72", "so she sold 72 clips.", True),
  ("10", "She earned $10.", True),
  ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\frac{1}{\\sqrt{2}}}", True),
  ("\\sqrt{2}", "\\boxed{2}", False),
  ("4", "$x = \\boxed{4}$", True),
  ("4", "\\boxed{x = 4}", True),
  ("\\frac{3}{4}", "first \\boxed{1}, then \\boxed{\\frac{3}{4}}", True),  # the last box counts
  ("\\frac{3}{4}", "first \\boxed{\\frac{3}{4}}, then \\boxed{1}", False),
  ("\\pi", "\\boxed{\\pi}", True),
  ("2\\pi", "\\boxed{\\pi}", False),
  ("(1, 2)", "\\boxed{(1,2)}", True),
  ("-3", "\\boxed{-3}", True),
  ("-3", "\\boxed{3}", False),
  ("1000", "\\boxed{1{,}000}", True),
  ("5", "no answer here", False),
  ("5", "\\boxed{5", True),  # cut off mid-box: the last number stands (a cut-off response earns no format reward)
  ("6", "\\boxed{5", False),
]


@pytest.mark.parametrize("reference, response, correct", TABLE)
def test_the_math_verifier(reference, response, correct):
  reward = data.reward_fn({"prompt": "", "answer": reference}, response, config=MATH)
  assert reward == pytest.approx((1.0 if correct else 0.0) + (0.1 if data.rewards.math_final_answer(response) else 0))


def test_last_boxed_balances_braces():
  assert data.last_boxed("\\boxed{\\frac{1}{\\sqrt{2}}} and \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
  assert data.last_boxed("\\fbox{7}") == "7" and data.last_boxed("none") is None


def test_the_verifier_runs_off_the_main_thread():
  """The async producer scores in a thread, where math-verify's SIGALRM timeout cannot be set."""
  out = {}
  thread = threading.Thread(target=lambda: out.update(r=data.math_equal("\\frac{1}{2}", "0.5")))
  thread.start()
  thread.join()
  assert out["r"] is True


def test_batch_rewards_with_a_tokenizer(tmp_path):
  tok = data.HFTokenizer.from_pretrained(pretrained.write_tokenizer(tmp_path / "tok"))
  responses = [tok.encode("It is \\boxed{0.5}") + [tok.eos_id], tok.encode("It is \\boxed{2}") + [tok.eos_id]]
  width = max(map(len, responses))
  tokens = np.asarray([r + [tok.pad_id] * (width - len(r)) for r in responses])
  rewards = data.batch_rewards(["\\frac{1}{2}", "\\frac{1}{2}"], tokens, tok, MATH)
  np.testing.assert_allclose(rewards, [1.1, 0.1], rtol=1e-6)
  fn = data.make_reward_fn("math", tok, MATH)
  assert fn(["\\frac{1}{2}"] * 2, tokens)[0].tolist() == pytest.approx([1.1, 0.1])
  with pytest.raises(ConfigError, match="config.reward.verifier: task 'math' needs 'math', got 'numeric'"):
    data.make_reward_fn("math", tok, RewardConfig(verifier="numeric"))
  with pytest.raises(ConfigError, match="task 'arithmetic' needs 'exact' or 'numeric', got 'math'"):
    data.make_reward_fn("arithmetic", tok, MATH)


def test_gsm8k_and_math_rows(tmp_path):
  src = data.MathSource(pretrained.write_jsonl(tmp_path / "m.jsonl", pretrained.GSM8K + pretrained.MATH))
  assert [ex.answer for ex in src] == ["72", "10", "35", "624", "\\frac{3}{4}", "4", "4", "21"]
  assert src[0].target == pretrained.GSM8K[0]["answer"] and src[0].prompt == pretrained.GSM8K[0]["question"]
  assert src[4].metadata["line"] == 5
  # a MATH row with its own answer column; named fields
  rows = [{"problem": "1+1?", "solution": "It is \\boxed{2}.", "answer": "2", "level": "Level 1"}]
  src = data.MathSource(pretrained.write_jsonl(tmp_path / "a.jsonl", rows))
  assert (src[0].answer, src[0].target, src[0].metadata["level"]) == ("2", "It is \\boxed{2}.", "Level 1")
  named = [{"q": "2+2?", "final": 4}]
  src = data.MathSource(pretrained.write_jsonl(tmp_path / "n.jsonl", named), prompt_field="q", answer_field="final")
  assert src[0].answer == "4"


def test_parquet(tmp_path):
  path = tmp_path / "train.parquet"
  pq.write_table(pa.Table.from_pylist(pretrained.MATH), path)
  src = data.MathSource(path)
  assert [ex.answer for ex in src] == ["\\frac{3}{4}", "4", "4", "21"] and src[3].metadata["line"] == 4


# what the error says -> the bad line
BAD_ROWS = {
  "invalid JSON": '{"question": "x?", "answer": "#### 3"',
  "expected an object, got list": "[1, 2]",
  "missing the answer field 'answer' / 'solution' \\(fields: \\['question'\\]\\)": '{"question": "x?"}',
  "missing the prompt field": '{"answer": "#### 3"}',
  "'question' must be a non-empty string": '{"question": "", "answer": "#### 3"}',
  "'solution' states no answer": '{"problem": "x?", "solution": "no box, no number"}',
}


@pytest.mark.parametrize("message, line", BAD_ROWS.items())
def test_bad_rows_name_file_and_line(tmp_path, message, line):
  path = tmp_path / "bad.jsonl"
  good = json.dumps(pretrained.GSM8K[0])
  path.write_text(f"{good}\n\n{line}\n{good}\n")
  with pytest.raises(data.MathFormatError, match=f"{path}:3: {message}"):
    data.MathSource(path)
  src = data.MathSource(path, skip_bad_rows=True)
  assert (len(src), src.skipped) == (2, 1)


def test_nothing_usable_is_an_error(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"question": "x?"}\n')
  with pytest.raises(data.MathFormatError, match="no usable problems"):
    data.MathSource(path, skip_bad_rows=True)
  with pytest.raises(FileNotFoundError, match="no such file"):
    data.MathSource(tmp_path / "missing.jsonl")
