"""Tokenizers with one interface: a character tokenizer for the embedded tasks, and Hugging Face
`tokenizer.json` files through the `tokenizers` package.

Each task's character alphabet: ARITHMETIC_ALPHABET for the arithmetic task (vocabulary 18),
RUNNING_SUM_ALPHABET for the running sum (19), CODE_ALPHABET for the code tasks (100);
`load_tokenizer(spec, task=)` picks it.

The interface (`Tokenizer`) is what the batcher and the rewards need and nothing more: `encode`
adds no special tokens (the batcher places BOS/EOS itself, so both tokenizers behave the same),
`decode` can show special tokens (the rewards use that to count a stray BOS as malformed).
This file is named tokenizer.py, not tokenizers.py, so it never shadows the `tokenizers` package.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import tokenizers

from trace_jax.config import CODE_TASKS

ARITHMETIC_ALPHABET = "0123456789+-*=;"  # the arithmetic task
RUNNING_SUM_ALPHABET = ARITHMETIC_ALPHABET + "_"  # the running sum: '_' marks a blank to fill
# Python source: newline, tab and the printable ASCII characters (the code tasks; vocabulary 100).
CODE_ALPHABET = "\n\t" + "".join(map(chr, range(32, 127)))


@runtime_checkable
class Tokenizer(Protocol):
  """What the data pipeline needs from a tokenizer."""

  vocab_size: int
  pad_id: int
  bos_id: int | None  # None: the tokenizer has no BOS (e.g. Qwen); prompts then start with text
  eos_id: int

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...


class CharTokenizer:
  """One token per character: PAD=0, BOS=1, EOS=2, then the alphabet in order.

  Unknown characters raise rather than map to an UNK token: for a synthetic task an unknown
  character is a bug, and silently training on UNK would hide it.
  """

  PAD, BOS, EOS = 0, 1, 2
  SPECIAL_TEXT = ("<pad>", "<bos>", "<eos>")

  def __init__(self, alphabet: str = ARITHMETIC_ALPHABET):
    if len(set(alphabet)) != len(alphabet):
      raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
    self.alphabet = alphabet
    self._ids = {char: i + len(self.SPECIAL_TEXT) for i, char in enumerate(alphabet)}
    self._text = self.SPECIAL_TEXT + tuple(alphabet)
    self.vocab_size = len(self._text)
    self.pad_id, self.bos_id, self.eos_id = self.PAD, self.BOS, self.EOS

  def token_id(self, char: str) -> int:
    """Id of one alphabet character (the vectorized rewards look up digits and separators)."""
    return self._ids[char]

  def encode(self, text: str) -> list[int]:
    try:
      return [self._ids[char] for char in text]
    except KeyError as e:
      raise ValueError(f"character {e.args[0]!r} of {text!r} is not in the alphabet {self.alphabet!r}") from None

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    start = len(self.SPECIAL_TEXT) if skip_special else 0
    out = []
    for i in ids:
      i = int(i)
      if not 0 <= i < self.vocab_size:
        raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
      if i >= start:
        out.append(self._text[i])
    return "".join(out)


# Names tried, in order, when a tokenizer.json does not say which of its tokens play these roles.
PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>", "<|endoftext|>")
BOS_CANDIDATES = ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]")
EOS_CANDIDATES = ("<eos>", "</s>", "<|im_end|>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")


class HFTokenizer:
  """A Hugging Face `tokenizer.json` behind the `Tokenizer` interface.

  Special tokens are given by name or found among common names. EOS is required (rollouts stop
  on it); a missing PAD falls back to EOS (padding is tracked by masks, not by the pad id); a
  missing BOS is allowed (None).
  """

  def __init__(
    self,
    tokenizer: tokenizers.Tokenizer,
    pad_token: str | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
  ):
    self.tokenizer = tokenizer
    self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eos_id = self._find("eos", eos_token, EOS_CANDIDATES)
    if eos_id is None:
      raise ValueError(f"no EOS token found among {EOS_CANDIDATES}; pass eos_token=")
    pad_id = self._find("pad", pad_token, PAD_CANDIDATES)
    self.eos_id = eos_id
    self.pad_id = eos_id if pad_id is None else pad_id
    self.bos_id = self._find("bos", bos_token, BOS_CANDIDATES)

  @classmethod
  def from_file(cls, path: str | os.PathLike, **special_tokens: str | None) -> HFTokenizer:
    return cls(tokenizers.Tokenizer.from_file(os.fspath(path)), **special_tokens)

  def _find(self, role: str, name: str | None, candidates: Sequence[str]) -> int | None:
    if name is not None:
      token_id = self.tokenizer.token_to_id(name)
      if token_id is None:
        raise ValueError(f"{role} token {name!r} is not in the vocabulary")
      return token_id
    return next((i for i in map(self.tokenizer.token_to_id, candidates) if i is not None), None)

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)


def task_alphabet(task: str = "arithmetic") -> str:
  """The character alphabet of a task (see DataConfig.task)."""
  if task in CODE_TASKS:
    return CODE_ALPHABET
  return RUNNING_SUM_ALPHABET if task == "running_sum" else ARITHMETIC_ALPHABET


def load_tokenizer(
  spec: str | os.PathLike | None = None, *, task: str = "arithmetic", **special_tokens: str | None
) -> Tokenizer:
  """None or "char": the task's CharTokenizer (task_alphabet); otherwise a tokenizer.json file or a folder holding one."""
  if spec is None or spec == "char":
    return CharTokenizer(task_alphabet(task))
  path = os.fspath(spec)
  if os.path.isdir(path):
    path = os.path.join(path, "tokenizer.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no tokenizer.json at {path}")
  return HFTokenizer.from_file(path, **special_tokens)
