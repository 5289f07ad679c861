"""Math word problems from JSONL or Parquet (the math verifier is rewards.py's 'math').

Rows: GSM8K (`question`, `answer` ending in "#### 72": the reference is what follows ####, the SFT
target the whole worked answer) and MATH / DAPO-style (`problem`, `solution` with \\boxed{...}: the
reference is the last boxed expression; an `answer` column beside `problem` is the reference when
there is one). data.prompt_field / data.answer_field name other columns. Other columns are kept as
metadata. Every row is read and checked at start-up: a malformed one is an error naming FILE:LINE
(the row number for Parquet), or with skip_bad_rows=True skipped and counted (`MathSource.skipped`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

from absl import logging

from trace_jax.data.jsonl import JsonlFormatError, jsonl_records
from trace_jax.data.rewards import math_final_answer
from trace_jax.data.tasks import Example, ExampleList

PROMPT_FIELDS = ("question", "problem", "prompt")
ANSWER_FIELDS = ("answer", "solution")  # in this order: MATH's `answer` column beats its `solution`


class MathFormatError(JsonlFormatError):
  """A malformed math row; the message starts with FILE:LINE."""


def _parquet_records(path: str) -> Iterator[tuple[int, object]]:
  import pyarrow.parquet as pq  # noqa: PLC0415

  yield from enumerate(pq.read_table(path).to_pylist(), start=1)


class MathSource(ExampleList):
  """Random-access math problems (len and [i], as the other sources) from a .jsonl or .parquet file."""

  def __init__(
    self, path: str | os.PathLike, prompt_field: str = "", answer_field: str = "", skip_bad_rows: bool = False
  ):
    self.path = os.fspath(path)
    self.prompt_field, self.answer_field = prompt_field, answer_field
    self.examples: list[Example] = []
    self.skipped, first = 0, ""
    if not os.path.isfile(self.path):
      raise FileNotFoundError(f"{self.path}: no such file (data.jsonl_train / data.jsonl_test).")
    rows = _parquet_records(self.path) if self.path.endswith(".parquet") else jsonl_records(self.path, MathFormatError)
    for line, row in rows:
      try:
        if isinstance(row, Exception):
          raise row
        self.examples.append(self._example(row, line))
      except MathFormatError as e:
        if not skip_bad_rows:
          raise
        self.skipped += 1
        first = first or str(e)
    if self.skipped:
      logging.warning(
        "%s: skipped %d malformed rows (data.skip_bad_rows), the first: %s", self.path, self.skipped, first
      )
    if not self.examples:
      raise MathFormatError(f"{self.path}: no usable problems")

  def _field(self, row: Mapping, given: str, candidates: tuple[str, ...], what: str, where: str) -> str:
    names = (given,) if given else candidates
    name = next((n for n in names if n in row), None)
    if name is None:
      raise MathFormatError(
        f"{where}: missing the {what} field {' / '.join(repr(n) for n in names)} (fields: {sorted(row)}); "
        f"name it with data.{what}_field"
      )
    return name

  def _example(self, row, line: int) -> Example:
    where = f"{self.path}:{line}"
    if not isinstance(row, Mapping):
      raise MathFormatError(f"{where}: expected an object, got {type(row).__name__}")
    row = dict(row)
    prompt_key = self._field(row, self.prompt_field, PROMPT_FIELDS, "prompt", where)
    answer_key = self._field(row, self.answer_field, ANSWER_FIELDS, "answer", where)
    prompt = row.pop(prompt_key)
    if not isinstance(prompt, str) or not prompt.strip():
      raise MathFormatError(f"{where}: {prompt_key!r} must be a non-empty string, got {prompt!r}")
    answer = row.pop(answer_key)
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
      raise MathFormatError(f"{where}: {answer_key!r} must be a string or a number, got {answer!r}")
    answer = str(answer)
    solution = row.get("solution") if answer_key == "answer" and isinstance(row.get("solution"), str) else answer
    reference = answer if answer_key == "answer" and "####" not in answer else math_final_answer(answer)
    if reference is None or not reference.strip():
      raise MathFormatError(
        f"{where}: {answer_key!r} states no answer (no \\boxed{{}}, '#### N' or number): {answer!r}"
      )
    return Example(prompt=prompt, answer=reference, target=solution, metadata={"line": line, **row})
