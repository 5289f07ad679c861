"""The embedded default task: procedurally generated arithmetic with verifiable answers.

Why this task: a 2-4 layer MoE with hidden 64-128 and a ~20-token vocabulary learns it on CPU in
minutes, the answer is checkable exactly (so GRPO gets a clean 0/1 reward), and the levels give a
knob from "memorise a 100-entry table" to "two-step arithmetic" so that an SFT warm start reaches
a partial reward that RL can then improve.

Levels (prompt -> target; the answer is the number after the last ';'):
  1  single-digit addition              "3+5="      -> "8"
  2  single-digit a+b-c, worked step    "7+5-4="    -> "12;8"       (a+b first, then the result)
  3  two-digit addition                 "47+85="    -> "132"
  4  two-digit a+b-c, worked step       "47+85-19=" -> "132;113"
Subtrahends never exceed a+b, so every answer is a non-negative integer. Prompts are at most 9
characters and targets at most 7, so with BOS/EOS: prompt <= 10 tokens, response <= 8 tokens.

Held-out problems. A problem belongs to the test split iff crc32(prompt) % 10 == 0, whatever the
seed, so the test split measures generalisation to unseen problems rather than memorisation (level
1 has only 100 problems: about 10 of them are test problems).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

LEVELS = (1, 2, 3, 4)
STEP_SEPARATOR = ";"  # between a worked intermediate result and the final answer
SPLITS = ("train", "test")
TEST_BUCKETS = 10  # 1 in TEST_BUCKETS problems is held out for the test split


@dataclasses.dataclass(frozen=True)
class Example:
  """One prompt with its verifiable answer, independent of the source it came from.

  `answer` is what the verifier compares against; `target` is the full response used for SFT
  (the worked steps plus the answer; equal to `answer` when there are no steps).
  """

  prompt: str
  answer: str
  target: str
  difficulty: int = 0
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class DataSource(Protocol):
  """Random access to records: a tfds data source, a JsonlSource or a list of Examples."""

  def __len__(self) -> int: ...

  def __getitem__(self, index: int) -> Example | Mapping[str, Any]: ...


class ExampleList:
  """A file's examples, read eagerly into `self.examples`: len, [i] and iteration (JSONL, math problems)."""

  examples: list[Example]

  def __len__(self) -> int:
    return len(self.examples)

  def __getitem__(self, index: int) -> Example:
    return self.examples[index]

  def __iter__(self):
    return iter(self.examples)


def _plain(value: Any) -> Any:
  """bytes -> str and numpy scalars -> Python, as tfds data sources return them."""
  if isinstance(value, bytes):
    return value.decode("utf-8")
  if isinstance(value, np.generic):
    return value.item()
  return value


def as_example(record: Example | Mapping[str, Any]) -> Example:
  """An Example from a tfds record or a plain dict (prompt, answer; optional target, difficulty)."""
  if isinstance(record, Example):
    return record
  fields = {k: _plain(v) for k, v in record.items()}
  for key in ("prompt", "answer"):
    if key not in fields:
      raise KeyError(f"record has no {key!r} field (fields: {sorted(fields)})")
  prompt, answer = str(fields.pop("prompt")), str(fields.pop("answer"))
  target = str(fields.pop("target", answer))
  difficulty = int(fields.pop("difficulty", 0))
  return Example(prompt=prompt, answer=answer, target=target, difficulty=difficulty, metadata=fields)


def is_test_problem(prompt: str) -> bool:
  """Whether a prompt is held out for the test split (seed-independent, see module doc)."""
  return zlib.crc32(prompt.encode("utf-8")) % TEST_BUCKETS == 0


def sample_split(draw: Callable[[int], list[Example]], n: int, split: str, test_overdraw: int = 2) -> list[Example]:
  """`n` examples of `split` from `draw(k)` (k new candidates a call), rejecting problems of the other split.
  A call asks for max(64, overdraw x the examples still missing): 2 for train (9 in 10 problems are train
  problems), `test_overdraw` for test."""
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  want_test = split == "test"
  out: list[Example] = []
  while len(out) < n:
    candidates = draw(max(64, (test_overdraw if want_test else 2) * (n - len(out))))
    out.extend(ex for ex in candidates if is_test_problem(ex.prompt) == want_test)
  return out[:n]


def _format(level: int, a: int, b: int, c: int) -> Example:
  total = a + b
  if level in (1, 3):
    return Example(prompt=f"{a}+{b}=", answer=str(total), target=str(total), difficulty=level)
  result = total - c
  return Example(
    prompt=f"{a}+{b}-{c}=", answer=str(result), target=f"{total}{STEP_SEPARATOR}{result}", difficulty=level
  )


def _operand_range(level: int) -> tuple[int, int]:
  """[lo, hi): one digit at levels 1-2, two digits at levels 3-4."""
  return (0, 10) if level in (1, 2) else (10, 100)


def longest_example(level: int) -> Example:
  """The level's longest prompt and longest target, in one problem: the largest operands and the
  smallest subtrahend (what a config's lengths must fit; see train.check_lengths)."""
  if level not in LEVELS:
    raise ValueError(f"level must be one of {LEVELS}, got {level}")
  lo, hi = _operand_range(level)
  return _format(level, hi - 1, hi - 1, lo)


def _draw_level(rng: np.random.Generator, level: int, n: int) -> list[Example]:
  lo, hi = _operand_range(level)
  a = rng.integers(lo, hi, n)
  b = rng.integers(lo, hi, n)
  # c uniform in [lo, min(hi - 1, a + b)]: the answer stays non-negative.
  c_hi = np.minimum(hi - 1, a + b)
  c = lo + (rng.random(n) * (c_hi - lo + 1)).astype(np.int64)
  return [_format(level, int(x), int(y), int(z)) for x, y, z in zip(a, b, c)]


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
  """Generator for a mix of levels (each example's level drawn uniformly from `levels`)."""

  levels: tuple[int, ...] = (1, 2)

  def __post_init__(self):
    if not self.levels or any(level not in LEVELS for level in self.levels):
      raise ValueError(f"levels must be a non-empty subset of {LEVELS}, got {self.levels}")

  def sample(self, rng: np.random.Generator, n: int, split: str = "train") -> list[Example]:
    """`n` examples of `split` drawn with `rng` (problems of the other split are rejected)."""

    def draw(chunk: int) -> list[Example]:
      levels = rng.choice(np.asarray(self.levels), chunk)
      drawn = {lvl: iter(_draw_level(rng, int(lvl), int(np.sum(levels == lvl)))) for lvl in self.levels}
      return [next(drawn[int(lvl)]) for lvl in levels]

    return sample_split(draw, n, split)

  def generate(self, seed: int, n: int, split: str = "train") -> list[Example]:
    """Deterministic in (seed, split): the same call always returns the same examples."""
    return self.sample(np.random.default_rng([seed, SPLITS.index(split)]), n, split)
