"""Verifiable rewards: exact match for the arithmetic and running-sum tasks, numeric match for
GSM8K-style data, executed tests for the code tasks.

reward = correct_reward * score + format_reward * [response well formed]
score  = 1 if the answer is correct, else (with reward.partial_credit) the share of the answer's
         intermediate results the response got right in place, or of the hidden tests it passed;
         else 0

A response, given as tokens, ends at its first EOS (or PAD: the engine stopped there); only a
response that ended with EOS can earn the format reward. A response given as text is taken as
finished (decoded up to EOS) unless `finished=False`.

  exact    the number after the last ';' must equal the answer's ("08" is not "8": the task
           has one canonical spelling, and a tiny model should learn it). An answer may list its
           intermediate results before the final one ("47;59;144", the running sum): partial
           credit is the share of them the response has at the same place. Well formed: digits
           separated by ';', with at most max(1, the answer's separators) of them (the
           arithmetic answers have none: one worked step, `^[0-9]+(;[0-9]+)?$`).
  numeric  the last number in the response must equal the last number of the answer (after its
           last '####' if any), compared exactly as decimals; commas, '$' and a trailing '.' are
           tolerated. Well formed: the response contains a number.
  math     the response's last \\boxed{...} (else its '#### N', else its last number) must state the
           reference's value, compared by math-verify (as verl and open-r1 compare): 1/2, 0.5 and
           \\frac{1}{2} agree. Well formed: the response states an answer that way.
  code     the answer is the hidden tests (Python source with asserts); the program, taken from the
           response (the first ```python fenced block if there is one, else the whole text), runs
           in the sandbox (sandbox.run_batch, reward.code_timeout_s): correct = every test passed,
           partial credit = the share that passed. Well formed: a non-empty program that parses.
           Identical (program, tests) pairs of a batch (a GRPO group's duplicates) run once.

`make_reward_fn(task, tokenizer, config)` is the trainer's reward: (answers, responses) -> (rewards,
invalid), refusing a verifier that does not fit the task.

`batch_rewards` scores a [N, T] token array; for the CharTokenizer and the exact verifier it is
vectorized in numpy, and it equals `reward_fn` row by row (tested).

Rewards are total: any token sequence gets one. A response whose content holds an id the
tokenizer cannot decode (outside [0, tokenizer.vocab_size), `invalid_responses`), or whose decode
fails, scores 0.
"""

from __future__ import annotations

import ast
import functools
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from trace_jax.config import CODE_TASKS, ConfigError, RewardConfig
from trace_jax.data import sandbox
from trace_jax.data.tasks import STEP_SEPARATOR, Example, as_example
from trace_jax.data.tokenizer import CharTokenizer, Tokenizer

_STEPS_FORMAT = re.compile(rf"[0-9]+(?:{re.escape(STEP_SEPARATOR)}[0-9]+)*")
_FENCED = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
# A number: optional sign (not after a word character or '.', so "5-3" ends in 3, not -3),
# digits with optional thousands commas, optional decimals; or a bare ".5".
_NUMBER = re.compile(r"(?<![\w.])-?(?:(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+)")


def extract_last_number(text: str) -> str | None:
  """The last number in `text`, commas removed ("1,234.50" -> "1234.50"); None if there is none."""
  matches = _NUMBER.findall(text)
  return matches[-1].replace(",", "") if matches else None


def answer_number(answer: str) -> str | None:
  """The number an answer states: the last number after its last '####' marker (GSM8K), if any."""
  return extract_last_number(answer.rsplit("####", 1)[-1])


def numbers_equal(a: str | None, b: str | None) -> bool:
  """Exact decimal comparison ("72" == "72.0" == "72.00"); None never matches."""
  return a is not None and b is not None and Fraction(a) == Fraction(b)


def final_answer(answer: str) -> str:
  """What the exact verifier compares: the answer's last ';'-separated result."""
  return answer.rsplit(STEP_SEPARATOR, 1)[-1]


def max_separators(answer: str) -> int:
  """The most ';' a well-formed response to `answer` holds: one worked step, or the answer's own."""
  return max(1, answer.count(STEP_SEPARATOR))


def step_credit(answer: str, text: str) -> float:
  """The share of the answer's ';'-separated results that `text` has at the same place."""
  want, got = answer.split(STEP_SEPARATOR), text.split(STEP_SEPARATOR)
  return sum(i < len(got) and got[i] == w for i, w in enumerate(want)) / len(want)


def _score_and_formatted(answer: str, text: str, config: RewardConfig) -> tuple[float, bool]:
  if config.verifier == "exact":
    correct = text.rsplit(STEP_SEPARATOR, 1)[-1] == final_answer(answer)
    formatted = _STEPS_FORMAT.fullmatch(text) is not None and text.count(STEP_SEPARATOR) <= max_separators(answer)
    score = 1.0 if correct else (step_credit(answer, text) if config.partial_credit else 0.0)
    return score, formatted
  if config.verifier == "math":
    return math_score(answer, text)
  number = extract_last_number(text)
  return float(numbers_equal(number, answer_number(answer))), number is not None


def last_boxed(text: str) -> str | None:
  """The content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces balanced; None if none."""
  start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
  if start < 0:
    return None
  i = text.find("{", start)
  if i < 0:
    return None
  depth = 0
  for j in range(i, len(text)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return text[i + 1 : j]
  return None  # unbalanced: cut off mid-answer


def math_final_answer(text: str) -> str | None:
  """What a response (or a reference solution) answers: its last \\boxed{}, else a GSM8K '#### N',
  else its last number."""
  boxed = last_boxed(text)
  if boxed is not None:
    return boxed
  if "####" in text:
    return answer_number(text)
  return extract_last_number(text)


@functools.lru_cache(maxsize=65536)
def _parse(text: str, timeout: int | None):
  import math_verify  # noqa: PLC0415 (sympy is slow to import: only math runs pay for it)

  return math_verify.parse(f"${text}$", parsing_timeout=timeout)


def math_equal(reference: str, answer: str | None) -> bool:
  """Whether `answer` states the same value as `reference` (math-verify; both already extracted).

  math-verify times out with SIGALRM, which only the main thread may set: elsewhere (the async
  producer's thread) it runs without a timeout.
  """
  import math_verify  # noqa: PLC0415

  if answer is None or not answer.strip():
    return False
  timeout = 5 if threading.current_thread() is threading.main_thread() else None
  gold, pred = _parse(reference, timeout), _parse(answer, timeout)
  if not gold or not pred:
    return reference.strip() == answer.strip()
  return bool(math_verify.verify(gold, pred, timeout_seconds=timeout))


def math_score(reference: str, text: str) -> tuple[float, bool]:
  """(1 if the response's final answer equals the reference, whether it states one at all)."""
  answer = math_final_answer(text)
  return float(math_equal(reference, answer)), answer is not None


def extract_program(text: str) -> str:
  """The program in a response: the first fenced block (```python ... ```) if any, else the whole text."""
  match = _FENCED.search(text)
  return match.group(1) if match else text


def program_parses(code: str) -> bool:
  """Whether `code` is a non-empty Python program that parses (the code verifier's format check)."""
  if not code.strip():
    return False
  try:
    ast.parse(code)
  except (SyntaxError, ValueError):
    return False
  return True


def code_rewards(
  answers: Sequence[str], texts: Sequence[str], finished: Sequence[bool], config: RewardConfig
) -> tuple[np.ndarray, list[sandbox.SandboxResult]]:
  """float32 [N] rewards of N response texts whose answers are hidden tests, and the N sandbox results.

  Identical (program, tests) pairs run once (a GRPO group often samples the same program).
  """
  codes = [extract_program(t) for t in texts]
  unique = list(dict.fromkeys(zip(codes, answers)))
  ran = sandbox.run_batch([c for c, _ in unique], [a for _, a in unique], timeout_s=config.code_timeout_s)
  by_pair = dict(zip(unique, ran))
  results = [by_pair[pair] for pair in zip(codes, answers)]
  scores = sandbox.code_reward(results, partial_credit=config.partial_credit)
  formatted = np.asarray([bool(f) and program_parses(c) for c, f in zip(codes, finished)])
  return (config.correct_reward * scores + config.format_reward * formatted).astype(np.float32), results


def _content(ids: np.ndarray, tokenizer: Tokenizer) -> tuple[np.ndarray, bool]:
  """Tokens before the first EOS/PAD, and whether the response ended with EOS."""
  stops = np.flatnonzero((ids == tokenizer.eos_id) | (ids == tokenizer.pad_id))
  if not stops.size:
    return ids, False
  return ids[: stops[0]], bool(ids[stops[0]] == tokenizer.eos_id)


def reward_fn(
  example: Example | Mapping[str, Any],
  response: str | Sequence[int] | np.ndarray,
  *,
  tokenizer: Tokenizer | None = None,
  config: RewardConfig = RewardConfig(),
  finished: bool = True,
) -> float:
  """Reward of one response (text, or token ids decoded with `tokenizer`, default CharTokenizer)."""
  answer = as_example(example).answer
  if isinstance(response, str):
    text = response
  else:
    tokenizer = tokenizer or CharTokenizer()
    content, finished = _content(np.asarray(response), tokenizer)
    if not np.all((content >= 0) & (content < tokenizer.vocab_size)):
      return 0.0
    try:
      # Exact matching sees special tokens (a stray BOS makes the answer wrong); numeric and code ignore them.
      text = tokenizer.decode(content, skip_special=config.verifier != "exact")
    except ValueError:  # a sampled sequence the tokenizer rejects is a wrong answer, not a crash
      return 0.0
  if config.verifier == "code":
    return float(code_rewards([answer], [text], [finished], config)[0][0])
  score, formatted = _score_and_formatted(answer, text, config)
  return config.correct_reward * score + config.format_reward * (formatted and finished)


def batch_rewards(
  answers: Sequence[str],
  responses: np.ndarray,
  tokenizer: Tokenizer,
  config: RewardConfig = RewardConfig(),
) -> np.ndarray:
  """float32 [N] rewards of [N, T] response tokens against N answers (repeat answers for G samples)."""
  responses = np.asarray(responses)
  if responses.ndim != 2 or responses.shape[0] != len(answers):
    raise ValueError(f"responses must be [N, T] with N = len(answers) = {len(answers)}, got {responses.shape}")
  invalid = invalid_responses(responses, tokenizer)
  if config.verifier == "code":
    return _batch_code_rewards(answers, responses, tokenizer, config, invalid)
  if config.verifier == "exact" and isinstance(tokenizer, CharTokenizer):
    correct, formatted = _exact_char_rewards(answers, responses, tokenizer)
    score = correct.astype(np.float64)
    if config.partial_credit:
      for i in np.flatnonzero(~correct & ~invalid):
        if STEP_SEPARATOR in answers[i]:  # a single-result answer has no credit short of correct
          content, _ = _content(responses[i], tokenizer)
          score[i] = step_credit(answers[i], tokenizer.decode(content, skip_special=False))
    rewards = config.correct_reward * score + config.format_reward * formatted
    return np.where(invalid, 0.0, rewards).astype(np.float32)
  rewards = [
    0.0 if bad else reward_fn({"prompt": "", "answer": a}, r, tokenizer=tokenizer, config=config)
    for a, r, bad in zip(answers, responses, invalid)
  ]
  return np.asarray(rewards, np.float32)


def _batch_code_rewards(answers, responses, tokenizer, config, invalid) -> np.ndarray:
  texts, finished = [], []
  for row, bad in zip(responses, invalid):
    content, done = _content(row, tokenizer)
    try:
      texts.append("" if bad else tokenizer.decode(content, skip_special=True))
    except ValueError:
      texts.append("")
    finished.append(done)
  rewards = np.zeros(len(answers), np.float32)
  run = [i for i, t in enumerate(texts) if t.strip()]  # an empty program passes nothing: no process for it
  if run:
    pick = lambda values: [values[i] for i in run]
    rewards[run] = code_rewards(pick(answers), pick(texts), pick(finished), config)[0]
  return rewards


def make_reward_fn(
  task: str, tokenizer: Tokenizer, config: RewardConfig
) -> Callable[[Sequence[str], np.ndarray], tuple[np.ndarray, np.ndarray]]:
  """The trainer's reward: (answers [N], responses [N, R] token ids) -> (float32 rewards [N], bool invalid [N]).

  Total: an undecodable response scores 0 and is flagged invalid. The verifier must fit the task:
  the code tasks' answers are hidden tests, which only the 'code' verifier runs.
  """
  want = "'code'" if task in CODE_TASKS else "'math'" if task == "math" else "'exact' or 'numeric'"
  if (task in CODE_TASKS) != (config.verifier == "code") or (task == "math") != (config.verifier == "math"):
    raise ConfigError(f"config.reward.verifier: task {task!r} needs {want}, got {config.verifier!r}.")

  def reward_fn(answers: Sequence[str], responses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    responses = np.asarray(responses)
    return batch_rewards(answers, responses, tokenizer, config), invalid_responses(responses, tokenizer)

  return reward_fn


def invalid_responses(responses: np.ndarray, tokenizer: Tokenizer) -> np.ndarray:
  """bool [N]: responses [N, T] whose content (before the first EOS/PAD) holds an id the tokenizer
  cannot decode, outside [0, tokenizer.vocab_size). They score 0."""
  responses = np.asarray(responses)
  stop = (responses == tokenizer.eos_id) | (responses == tokenizer.pad_id)
  end = np.where(stop.any(1), stop.argmax(1), responses.shape[1])
  in_content = np.arange(responses.shape[1])[None, :] < end[:, None]
  undecodable = (responses < 0) | (responses >= tokenizer.vocab_size)
  return np.any(undecodable & in_content, axis=1)


def _exact_char_rewards(
  answers: Sequence[str], responses: np.ndarray, tokenizer: CharTokenizer
) -> tuple[np.ndarray, np.ndarray]:
  """The exact verifier over a whole batch at once (one token per character): bool [N] correct,
  bool [N] well formed and finished."""
  n, t = responses.shape
  rows = np.arange(n)[:, None]
  pos = np.arange(t)[None, :]
  stop = (responses == tokenizer.eos_id) | (responses == tokenizer.pad_id)
  end = np.where(stop.any(1), stop.argmax(1), t)  # content is responses[:, :end]
  finished = responses[np.arange(n), np.minimum(end, t - 1)] == tokenizer.eos_id
  finished &= end < t
  in_content = pos < end[:, None]

  digit_ids = np.asarray([tokenizer.token_id(d) for d in "0123456789"])
  is_digit = np.isin(responses, digit_ids)
  is_sep = (responses == tokenizer.token_id(STEP_SEPARATOR)) & in_content
  first_digit = is_digit[:, 0] & (end > 0)
  last_digit = is_digit[np.arange(n), np.maximum(end - 1, 0)] & (end > 0)
  no_empty_step = ~np.any(is_sep[:, 1:] & is_sep[:, :-1], 1)  # ';;' (with first/last digit: no empty result)
  seps_allowed = np.asarray([max_separators(a) for a in answers], np.int64)
  formatted = np.all(~in_content | is_digit | is_sep, 1) & (is_sep.sum(1) <= seps_allowed) & first_digit & last_digit
  formatted &= no_empty_step

  # Final segment = content after the last separator; compare it right-aligned with the final answer.
  finals = [final_answer(a) for a in answers]
  seg_start = np.max(np.where(is_sep, pos + 1, 0), 1)
  seg_len = end - seg_start
  width = max(1, max(len(a) for a in finals)) if len(finals) else 1
  answer_ids = np.full((n, width), -1, np.int64)  # reversed: answer_ids[i, k] is the k-th char from the end
  answer_len = np.zeros(n, np.int64)
  for i, answer in enumerate(finals):
    ids = tokenizer.encode(answer)[::-1]
    answer_ids[i, : len(ids)] = ids
    answer_len[i] = len(ids)
  k = np.arange(width)[None, :]
  from_end = responses[rows, np.clip(end[:, None] - 1 - k, 0, t - 1)]
  chars_match = np.all((k >= answer_len[:, None]) | (from_end == answer_ids), 1)
  correct = (seg_len == answer_len) & chars_match
  return correct, formatted & finished
