"""Verifiable rewards: exact match for the arithmetic task, numeric match for GSM8K-style data.

reward = correct_reward * [answer correct] + format_reward * [response well formed]

A response, given as tokens, ends at its first EOS (or PAD: the engine stopped there); only a
response that ended with EOS can earn the format reward. A response given as text is taken as
finished (decoded up to EOS) unless `finished=False`.

  exact    the number after the last ';' must equal the answer string ("08" is not "8": the task
           has one canonical spelling, and a tiny model should learn it). Well formed: digits with
           at most one worked step, `^[0-9]+(;[0-9]+)?$`.
  numeric  the last number in the response must equal the last number of the answer (after its
           last '####' if any), compared exactly as decimals; commas, '$' and a trailing '.' are
           tolerated. Well formed: the response contains a number.

`batch_rewards` scores a [N, T] token array; for the CharTokenizer and the exact verifier it is
vectorized in numpy, and it equals `reward_fn` row by row (tested).

Rewards are total: any token sequence gets one. A response whose content holds an id the
tokenizer cannot decode (outside [0, tokenizer.vocab_size), `invalid_responses`), or whose decode
fails, scores 0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from trace_jax.config import RewardConfig
from trace_jax.data.tasks import STEP_SEPARATOR, Example, as_example
from trace_jax.data.tokenizer import CharTokenizer, Tokenizer

_STEPS_FORMAT = re.compile(rf"[0-9]+(?:{re.escape(STEP_SEPARATOR)}[0-9]+)?")
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


def _correct_and_formatted(answer: str, text: str, verifier: str) -> tuple[bool, bool]:
  if verifier == "exact":
    return text.rsplit(STEP_SEPARATOR, 1)[-1] == answer, _STEPS_FORMAT.fullmatch(text) is not None
  number = extract_last_number(text)
  return numbers_equal(number, answer_number(answer)), number is not None


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
      # Exact matching sees special tokens (a stray BOS makes the answer wrong); numeric ignores them.
      text = tokenizer.decode(content, skip_special=config.verifier == "numeric")
    except ValueError:  # a sampled sequence the tokenizer rejects is a wrong answer, not a crash
      return 0.0
  correct, formatted = _correct_and_formatted(answer, text, config.verifier)
  return config.correct_reward * correct + config.format_reward * (formatted and finished)


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
  if config.verifier == "exact" and isinstance(tokenizer, CharTokenizer):
    return np.where(invalid, 0.0, _exact_char_rewards(answers, responses, tokenizer, config)).astype(np.float32)
  rewards = [
    0.0 if bad else reward_fn({"prompt": "", "answer": a}, r, tokenizer=tokenizer, config=config)
    for a, r, bad in zip(answers, responses, invalid)
  ]
  return np.asarray(rewards, np.float32)


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
  answers: Sequence[str], responses: np.ndarray, tokenizer: CharTokenizer, config: RewardConfig
) -> np.ndarray:
  """The exact verifier over a whole batch at once (one token per character)."""
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
  formatted = np.all(~in_content | is_digit | is_sep, 1) & (is_sep.sum(1) <= 1) & first_digit & last_digit

  # Final segment = content after the last separator; compare it right-aligned with the answer.
  seg_start = np.max(np.where(is_sep, pos + 1, 0), 1)
  seg_len = end - seg_start
  width = max(1, max(len(a) for a in answers)) if len(answers) else 1
  answer_ids = np.full((n, width), -1, np.int64)  # reversed: answer_ids[i, k] is the k-th char from the end
  answer_len = np.zeros(n, np.int64)
  for i, answer in enumerate(answers):
    ids = tokenizer.encode(answer)[::-1]
    answer_ids[i, : len(ids)] = ids
    answer_len[i] = len(ids)
  k = np.arange(width)[None, :]
  from_end = responses[rows, np.clip(end[:, None] - 1 - k, 0, t - 1)]
  chars_match = np.all((k >= answer_len[:, None]) | (from_end == answer_ids), 1)
  correct = (seg_len == answer_len) & chars_match
  return (config.correct_reward * correct + config.format_reward * (formatted & finished)).astype(np.float32)
