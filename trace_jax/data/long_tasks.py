"""Long-response tasks: a running sum that writes every partial sum (issue 16).

    prompt  "47__;12__;85__;30__="   (n terms of `digits` digits, each followed by a blank for its
                                      partial sum)
    target  "4747;1259;8544;3074"    (the prompt with the blanks filled: each term, then the partial
                                      sum s_k = a_1 + ... + a_k mod 10^digits, zero-padded)
    answer  the target: the exact verifier checks the last result ("3074": term and final sum);
            partial credit counts the results right in place.

Why this form. Each step adds the term just written to the partial sum written one step before:
local operands, one small addition. The response copies the prompt except in the blanks, so the
term of step k sits at a constant distance (the prompt's length) before it, and that copy is
supervised on most tokens: a 4-layer tiny MoE learns it. Measured after SFT (train.sft_warm_start
from a fresh init, seed 0, batch 64, lr 3e-3 with cosine decay, the `tiny` preset), then greedy
decoding with the BF16 engine as train.evaluate does: accuracy / share of steps right in place,
on 256 held-out problems:
  - digits=1, 22 terms (66 response tokens), 1000 steps: 100% / 100% (a sum mod 10 is a table)
  - digits=2, 13 terms (65 tokens): 300 steps 1.6% / 8.7%, 500 steps 2.7% / 12%, 700 steps
    0.4% / 9.0% (terms copied, sums near but wrong), 1000 steps 99.6% / 100% (seed 1: 100%
    greedy, and 100% of responses sampled at temperature 1 exact). These from a script with its
    own 20,000 training problems; with configs/long_horizon.py's data (greedy accuracy, BF16 /
    FP4 engine): 850 steps 0.8% (seed 0), 925 steps 1.6% / 0.4% / 1.2% (seeds 0, 1, 2; each a
    full cosine schedule of that length), 1000 steps 99.2% / 17.2% (seed 0), 1.2% / 1.6% (seed 1),
    0.8% / 0.4% (seed 2). The addition is learnt suddenly, then without error at any position,
    at a step that depends on the seed and the data. SFT length is a poor dial for a partial
    accuracy: the window is narrow. Nor does RL cross it from below: from the 850- and 925-step
    policies, 40-60 GRPO steps (BF16, 8 x 8 samples, partial credit, lr 1e-4 or 3e-4) leave the
    reward flat or falling and the exact accuracy at 0-1.6%. The FP4 engine is where a partial
    accuracy appears: 17% for seed 0's solved policy (experiments/long_horizon.py starts there).
  - digits=3, 10 terms (70 tokens), 1000 steps: 0% / 10% (terms copied, sums wrong).
  - without the echo ("3+9+0+8=" -> "3;2;2;0", sums mod 10): 1200 steps at 16 terms, 2000 at 32:
    final answers at chance (11%), steps right in place 64% / 40%, the first error at step
    9-10 (the model has to find term k by position, unsupervised); plain decimal sums of 2-digit
    terms, 600 steps at 8 terms: 4.7%.
The final answer needs every step right, so any per-step error rate (sampling at temperature 1,
FP4 rollouts, a partly trained policy) compounds over the n steps: that is what makes the horizon
matter. Partial credit keeps a reward gradient where the final answer is rarely right (before the
addition is learnt).

The knobs. `terms` (n) is the horizon: every response is n * (2 * digits + 1) tokens with its EOS
(digits=2: n = 7 -> 35 tokens, 13 -> 65, 26 -> 130, 52 -> 260; `mean_target_tokens` measures
it); every prompt is as long without its BOS. `digits` sets the work per step: 1 is a table of 100
sums mod 10, 2 an addition mod 100 with a carry from the units, 3 two carries.

Held-out problems: as for the arithmetic task, a problem belongs to the test split iff
crc32(prompt) % 10 == 0 (tasks.is_test_problem), whatever the seed. There are 10^(n * digits)
problems, so train and test problems practically never repeat.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from trace_jax.data.tasks import SPLITS, STEP_SEPARATOR, Example, sample_split

MAX_TERMS = 256
MAX_DIGITS = 6


BLANK = "_"  # a partial sum's place in the prompt (the running sum's alphabet: ARITHMETIC_ALPHABET + BLANK)


def running_sum_example(terms: list[int] | tuple[int, ...], digits: int) -> Example:
  """The example of one list of terms (difficulty = the number of terms); terms and partial sums
  mod 10^digits are written with exactly `digits` digits."""
  mod = 10**digits
  if any(not 0 <= t < mod for t in terms):
    raise ValueError(f"terms must lie in [0, {mod}), got {terms}")
  sums = (np.cumsum(np.asarray(terms, np.int64)) % mod).tolist()
  spell = lambda value: str(value).zfill(digits)
  prompt = STEP_SEPARATOR.join(spell(a) + BLANK * digits for a in terms) + "="
  steps = STEP_SEPARATOR.join(spell(a) + spell(s) for a, s in zip(terms, sums))
  return Example(prompt=prompt, answer=steps, target=steps, difficulty=len(terms))


@dataclasses.dataclass(frozen=True)
class RunningSumTask:
  """The running-sum generator: `terms` terms of `digits` digits per problem (see module doc)."""

  terms: int = 13
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

    def draw(chunk: int) -> list[Example]:
      return [
        running_sum_example(row, self.digits) for row in rng.integers(0, 10**self.digits, (chunk, self.terms)).tolist()
      ]

    return sample_split(draw, n, split, test_overdraw=12)

  def generate(self, seed: int, n: int, split: str = "train") -> list[Example]:
    """Deterministic in (seed, split): the same call always returns the same examples."""
    if split not in SPLITS:
      raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return self.sample(np.random.default_rng([seed, SPLITS.index(split), self.terms, self.digits]), n, split)


def mean_target_tokens(examples: list[Example], tokenizer) -> float:
  """Mean response length in tokens of the SFT targets, EOS included (what a rollout must write)."""
  return float(np.mean([len(tokenizer.encode(ex.target)) + 1 for ex in examples]))
