"""Deterministic batches for the RL loop (left-padded prompts) and the SFT warm start.

Determinism. Batch `step` holds the examples at global positions step*B .. step*B + B - 1 of an
endless stream in which epoch e is permutation(seed, e) of the source. So `batch_at(step)` is a
pure function of (source, seed, step): a resumed run sees exactly the batches it would have seen.

Layout. Prompts are LEFT-padded to P = max_prompt_len, so every prompt ends at column P-1 and
decoding appends at the same column for the whole batch. The SFT batch uses the rollout layout
[left-padded prompt (P) | target + EOS, right-padded (R)], so the trainer's teacher-forced
log-prob code serves both RL and SFT. Positions are `cumsum(mask) - 1` (pad columns excluded).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from trace_jax.config import ConfigError
from trace_jax.data.tasks import DataSource, Example, as_example
from trace_jax.data.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class EpochSampler:
  """Source indices of batch `step`: positions step*B.. of the stream of per-epoch permutations."""

  num_examples: int
  batch_size: int
  seed: int
  shuffle: bool = True

  def __post_init__(self):
    if self.num_examples <= 0 or self.batch_size <= 0:
      raise ValueError(f"need num_examples > 0 and batch_size > 0, got {self.num_examples}, {self.batch_size}")

  def order(self, epoch: int) -> np.ndarray:
    """The order of epoch `epoch` (identity when not shuffling, e.g. for evaluation)."""
    if not self.shuffle:
      return np.arange(self.num_examples)
    return np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)

  def indices_at(self, step: int) -> np.ndarray:
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}")
    positions = step * self.batch_size + np.arange(self.batch_size)
    epochs, offsets = np.divmod(positions, self.num_examples)
    out = np.empty(self.batch_size, np.int64)
    for epoch in np.unique(epochs):  # a batch spans at most a few epochs
      here = epochs == epoch
      out[here] = self.order(int(epoch))[offsets[here]]
    return out

  @property
  def steps_per_epoch(self) -> int:
    return math.ceil(self.num_examples / self.batch_size)


@dataclasses.dataclass(frozen=True)
class PromptBatch:
  """Left-padded prompts for a rollout, with what the rewards need (answers) and bookkeeping."""

  tokens: np.ndarray  # int32 [B, P], BOS + prompt, left-padded with pad_id
  mask: np.ndarray  # bool [B, P], True on real tokens
  prompts: list[str]
  answers: list[str]
  difficulty: np.ndarray  # int32 [B]
  indices: np.ndarray  # int64 [B], positions in the source
  metadata: list[Mapping[str, Any]]
  step: int


@dataclasses.dataclass(frozen=True)
class SFTBatch:
  """Teacher-forced [prompt | target + EOS] sequences in the rollout layout.

  loss_mask[b, t] is True where tokens[b, t] is a target or EOS token, i.e. a token the model
  must predict from the logits at t-1 (use loss_mask[:, 1:] against logits[:, :-1]).
  """

  tokens: np.ndarray  # int32 [B, P + R]
  mask: np.ndarray  # bool [B, P + R]
  loss_mask: np.ndarray  # bool [B, P + R]
  prompt_len: int  # P: column where the targets start
  indices: np.ndarray  # int64 [B]
  step: int


BatchT = TypeVar("BatchT", PromptBatch, SFTBatch)


def _prompt_ids(ex: Example, tokenizer: Tokenizer) -> list[int]:
  return tokenizer.encode_prompt(ex.prompt)


def _too_long(what: str, index: int, length: int, limit: int) -> ValueError:
  return ValueError(f"example {index}: {what} is {length} tokens, over the limit of {limit}")


def check_lengths(
  examples: Mapping[str, Example], tokenizer: Tokenizer, max_prompt_len: int, max_new_tokens: int | None
):
  """Refuse, before any work, a task that does not fit the configured lengths: a ConfigError naming the field.

  A prompt (with BOS) must fit data.max_prompt_len, and a target with its EOS must fit the
  rollout's response, which is up to rollout.max_new_tokens tokens, EOS included.
  examples: the examples to check, by the name the message gives them ('level 4', 'train.jsonl:12').
  max_new_tokens None: the targets are not checked (no SFT on them: a pretrained policy's math problems).
  """
  prompt = lambda ex: len(_prompt_ids(ex, tokenizer))
  answer = lambda ex: len(tokenizer.encode(ex.target)) + 1
  bos = "" if tokenizer.bos_id is None else " with BOS"
  for what, length, field, limit, suffix in (
    ("prompts", prompt, "data.max_prompt_len", max_prompt_len, bos),
    ("answers", answer, "rollout.max_new_tokens", max_new_tokens, " with EOS"),
  ):
    if limit is None:
      continue
    needs = {name: length(ex) for name, ex in examples.items()}
    name = max(needs, key=needs.get)
    if needs[name] > limit:
      raise ConfigError(
        f"config.{field}: {what} of {name} need {needs[name]} tokens{suffix}, over the limit of {limit}; "
        f"raise it to >= {needs[name]}."
      )


def encode_prompts(
  examples: Sequence[Example], tokenizer: Tokenizer, max_prompt_len: int, indices: Sequence[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
  """(tokens int32 [B, P], mask bool [B, P]) of BOS + prompt, left-padded. Over-long prompts raise."""
  indices = range(len(examples)) if indices is None else indices
  tokens = np.full((len(examples), max_prompt_len), tokenizer.pad_id, np.int32)
  mask = np.zeros(tokens.shape, bool)
  for row, (ex, index) in enumerate(zip(examples, indices)):
    ids = _prompt_ids(ex, tokenizer)
    if len(ids) > max_prompt_len:
      raise _too_long("the prompt", int(index), len(ids), max_prompt_len)
    tokens[row, max_prompt_len - len(ids) :] = ids
    mask[row, max_prompt_len - len(ids) :] = True
  return tokens, mask


def encode_sft(
  examples: Sequence[Example],
  tokenizer: Tokenizer,
  max_prompt_len: int,
  max_target_len: int,
  indices: Sequence[int] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(tokens, mask, loss_mask) of [left-padded BOS + prompt | target + EOS, right-padded]."""
  indices = list(range(len(examples))) if indices is None else list(indices)
  prompt_tokens, prompt_mask = encode_prompts(examples, tokenizer, max_prompt_len, indices)
  target_tokens = np.full((len(examples), max_target_len), tokenizer.pad_id, np.int32)
  target_mask = np.zeros(target_tokens.shape, bool)
  for row, (ex, index) in enumerate(zip(examples, indices)):
    ids = tokenizer.encode(ex.target) + [tokenizer.eos_id]
    if len(ids) > max_target_len:
      raise _too_long("the target + EOS", index, len(ids), max_target_len)
    target_tokens[row, : len(ids)] = ids
    target_mask[row, : len(ids)] = True
  tokens = np.concatenate([prompt_tokens, target_tokens], 1)
  mask = np.concatenate([prompt_mask, target_mask], 1)
  loss_mask = np.concatenate([np.zeros_like(prompt_mask), target_mask], 1)
  return tokens, mask, loss_mask


# Dataclasses for their __init__ only: identity equality and the default repr (a source can be large).
@dataclasses.dataclass(eq=False, repr=False)
class _Batcher(abc.ABC, Generic[BatchT]):
  """Shared by the prompt and SFT batchers: the source, the sampler, and stateless iteration.

  seed and shuffle are keyword-only, so that a subclass's own lengths follow max_prompt_len.
  """

  source: DataSource
  tokenizer: Tokenizer
  batch_size: int
  max_prompt_len: int
  seed: int = dataclasses.field(default=0, kw_only=True)
  shuffle: bool = dataclasses.field(default=True, kw_only=True)

  def __post_init__(self):
    self.sampler = EpochSampler(len(self.source), self.batch_size, self.seed, self.shuffle)

  def _examples(self, step: int) -> tuple[np.ndarray, list[Example]]:
    indices = self.sampler.indices_at(step)
    return indices, [as_example(self.source[int(i)]) for i in indices]

  @abc.abstractmethod
  def batch_at(self, step: int) -> BatchT: ...

  def iterate(self, start_step: int = 0) -> Iterator[BatchT]:
    """batch_at(start_step), batch_at(start_step + 1), ... (resume by passing the restored step)."""
    step = start_step
    while True:
      yield self.batch_at(step)
      step += 1

  def __iter__(self) -> Iterator[BatchT]:
    return self.iterate()

  @property
  def steps_per_epoch(self) -> int:
    return self.sampler.steps_per_epoch


class PromptBatcher(_Batcher[PromptBatch]):
  """Batches of B left-padded prompts; `batch_at(step)` is deterministic in (seed, step)."""

  def batch_at(self, step: int) -> PromptBatch:
    indices, examples = self._examples(step)
    tokens, mask = encode_prompts(examples, self.tokenizer, self.max_prompt_len, indices)
    return PromptBatch(
      tokens=tokens,
      mask=mask,
      prompts=[ex.prompt for ex in examples],
      answers=[ex.answer for ex in examples],
      difficulty=np.asarray([ex.difficulty for ex in examples], np.int32),
      indices=indices,
      metadata=[ex.metadata for ex in examples],
      step=step,
    )


@dataclasses.dataclass(eq=False, repr=False)
class SFTBatcher(_Batcher[SFTBatch]):
  """Batches of teacher-forced prompt + target sequences for the supervised warm start."""

  max_target_len: int

  def batch_at(self, step: int) -> SFTBatch:
    indices, examples = self._examples(step)
    tokens, mask, loss_mask = encode_sft(examples, self.tokenizer, self.max_prompt_len, self.max_target_len, indices)
    return SFTBatch(
      tokens=tokens, mask=mask, loss_mask=loss_mask, prompt_len=self.max_prompt_len, indices=indices, step=step
    )
