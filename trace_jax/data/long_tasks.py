"""Long-response tasks: a running sum that writes every partial sum (issue 16).

    prompt  "3+9+0+8="          (n terms of `digits` digits, zero-padded)
    target  "3;2;2;0"           (s_1; s_2; ...; s_n with s_k = a_1 + ... + a_k mod 10^digits,
                                 zero-padded to `digits` digits)
    answer  "3;2;2;0"           (the same: the exact verifier checks the number after the last
                                 ';'; partial credit counts the partial sums right in place)

Why this form. Every step is one small addition: the previous partial sum, which the response
wrote just before, plus the k-th term of the prompt. Terms and partial sums have the same fixed
width, so the k-th term sits at a constant distance (the prompt's length) before the k-th partial
sum: the model finds it with relative-position attention instead of counting terms. Without that
(plain decimal sums of growing width), a 4-layer tiny MoE after 600 SFT steps wrote the format
but added a typical term instead of the right one (4.7% final accuracy at 8 terms), and 3-digit
additions of two earlier results (a Fibonacci-like chain) were not learnt at all in 600 steps.
The final answer needs every step right, so accuracy falls about geometrically with n, which is
what makes the horizon matter; partial credit keeps a reward gradient where the exact answer is
rarely right.

The knobs. `terms` (n) is the horizon: every response is n * (digits + 1) tokens with its EOS
(digits=1: n = 16 -> 32 tokens, 32 -> 64, 64 -> 128, 128 -> 256; `mean_target_tokens` measures
it), and so is every prompt with its BOS. `digits` sets the work per step: 1 is a table of 100
sums mod 10, 2 an addition mod 100 with a carry from the units.

Held-out problems: as for the arithmetic task, a problem belongs to the test split iff
crc32(prompt) % 10 == 0 (tasks.is_test_problem), whatever the seed. There are 10^(n * digits)
problems, so train and test problems practically never repeat.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from trace_jax.data.tasks import SPLITS, STEP_SEPARATOR, Example, is_test_problem

MAX_TERMS = 256
MAX_DIGITS = 6


def running_sum_example(terms: list[int] | tuple[int, ...], digits: int) -> Example:
  """The example of one list of terms (difficulty = the number of terms): every term and partial
  sum mod 10^digits, written with exactly `digits` digits."""
  mod = 10**digits
  if any(not 0 <= t < mod for t in terms):
    raise ValueError(f"terms must lie in [0, {mod}), got {terms}")
  sums = (np.cumsum(np.asarray(terms, np.int64)) % mod).tolist()
  spell = lambda values: [str(v).zfill(digits) for v in values]
  steps = STEP_SEPARATOR.join(spell(sums))
  return Example(prompt="+".join(spell(terms)) + "=", answer=steps, target=steps, difficulty=len(terms))


@dataclasses.dataclass(frozen=True)
class RunningSumTask:
  """The running-sum generator: `terms` terms of `digits` digits per problem (see module doc)."""

  terms: int = 16
  digits: int = 2

  def __post_init__(self):
    if not 2 <= self.terms <= MAX_TERMS:
      raise ValueError(f"terms must lie in [2, {MAX_TERMS}], got {self.terms}")
    if not 1 <= self.digits <= MAX_DIGITS:
      raise ValueError(f"digits must lie in [1, {MAX_DIGITS}], got {self.digits}")

  def longest_example(self) -> Example:
    """The longest prompt and the longest target in one problem: every term at its maximum."""
    return running_sum_example([10**self.digits - 1] * self.terms, self.digits)

  def sample(self, rng: np.random.Generator, n: int, split: str = "train") -> list[Example]:
    """`n` examples of `split` drawn with `rng` (problems of the other split are rejected)."""
    if split not in SPLITS:
      raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    want_test = split == "test"
    out: list[Example] = []
    while len(out) < n:
      chunk = max(64, 2 * (n - len(out)) if not want_test else 12 * (n - len(out)))
      drawn = rng.integers(0, 10**self.digits, (chunk, self.terms))
      candidates = (running_sum_example(row, self.digits) for row in drawn.tolist())
      out.extend(ex for ex in candidates if is_test_problem(ex.prompt) == want_test)
    return out[:n]

  def generate(self, seed: int, n: int, split: str = "train") -> list[Example]:
    """Deterministic in (seed, split): the same call always returns the same examples."""
    if split not in SPLITS:
      raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return self.sample(np.random.default_rng([seed, SPLITS.index(split), self.terms, self.digits]), n, split)


def mean_target_tokens(examples: list[Example], tokenizer) -> float:
  """Mean response length in tokens of the SFT targets, EOS included (what a rollout must write)."""
  return float(np.mean([len(tokenizer.encode(ex.target)) + 1 for ex in examples]))
