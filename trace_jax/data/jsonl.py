"""User data as JSONL: one `{"prompt": ..., "answer": ...}` object per line (GSM8K style).

Optional fields: "target" (the SFT response; defaults to "answer", which for GSM8K is the worked
solution ending in "#### 72"), "difficulty" (int). Other fields are kept as per-example metadata.
The file is read and validated eagerly so that a bad line fails at start-up, with file and line,
rather than hours into a run. Score answers with RewardConfig(verifier="numeric").
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from trace_jax.data.rewards import answer_number
from trace_jax.data.tasks import Example, ExampleList


class JsonlFormatError(ValueError):
  """A malformed JSONL line; the message names the file and the 1-based line number."""


def jsonl_records(path: str, error=JsonlFormatError) -> Iterator[tuple[int, object]]:
  """(1-based line number, the line's JSON value, or an `error` naming FILE:LINE) for each non-blank line."""
  with open(path, encoding="utf-8") as f:
    for line_number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        yield line_number, json.loads(line)
      except json.JSONDecodeError as e:
        yield line_number, error(f"{path}:{line_number}: invalid JSON ({e.msg} at column {e.colno})")


class JsonlSource(ExampleList):
  """Random-access examples from a JSONL file (the interface of a tfds data source: len and [i]).

  require_numeric_answer: reject answers with no number in them, which the numeric verifier
  could never reward.
  """

  def __init__(self, path: str | os.PathLike, require_numeric_answer: bool = True):
    self.path = os.fspath(path)
    self.examples: list[Example] = []
    for line_number, record in jsonl_records(self.path):
      if isinstance(record, Exception):
        raise record
      self.examples.append(self._parse(record, line_number, require_numeric_answer))
    if not self.examples:
      raise JsonlFormatError(f"{self.path}: no examples")

  def _parse(self, record, line_number: int, require_numeric_answer: bool) -> Example:
    where = f"{self.path}:{line_number}"
    if not isinstance(record, dict):
      raise JsonlFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in ("prompt", "answer"):
      if key not in record:
        raise JsonlFormatError(f"{where}: missing field {key!r} (fields: {sorted(record)})")
    prompt, answer = record.pop("prompt"), record.pop("answer")
    if not isinstance(prompt, str) or not prompt:
      raise JsonlFormatError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
      raise JsonlFormatError(f"{where}: 'answer' must be a string or a number, got {answer!r}")
    answer = str(answer)
    if require_numeric_answer and answer_number(answer) is None:
      raise JsonlFormatError(f"{where}: 'answer' has no number in it: {answer!r}")
    target = record.pop("target", answer)
    if not isinstance(target, str):
      raise JsonlFormatError(f"{where}: 'target' must be a string, got {target!r}")
    difficulty = record.pop("difficulty", 0)
    if isinstance(difficulty, bool) or not isinstance(difficulty, int):
      raise JsonlFormatError(f"{where}: 'difficulty' must be an integer, got {difficulty!r}")
    metadata = {"line": line_number, **record}
    return Example(prompt=prompt, answer=answer, target=target, difficulty=difficulty, metadata=metadata)
