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

import datetime
import json
import os
from collections.abc import Mapping, Sequence
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

  def encode_prompt(self, text: str) -> list[int]: ...


def _bos_then(tokenizer: Tokenizer, text: str) -> list[int]:
  return ([] if tokenizer.bos_id is None else [tokenizer.bos_id]) + tokenizer.encode(text)


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

  def encode_prompt(self, text: str) -> list[int]:
    """A prompt as the model reads it: BOS, then the text."""
    return _bos_then(self, text)

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
  chat_template: a Jinja chat template (tokenizer_config.json's, rendered as transformers'
  `apply_chat_template` renders it); then every prompt is one user message (after a system message
  when `system_prompt` is set) followed by the generation prompt. None: prompts are BOS + text.
  """

  def __init__(
    self,
    tokenizer: tokenizers.Tokenizer,
    pad_token: str | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    chat_template: str | None = None,
    system_prompt: str = "",
  ):
    self.tokenizer = tokenizer
    self.chat_template, self.system_prompt = chat_template, system_prompt
    self._template = None if chat_template is None else _compile_template(chat_template)
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

  @classmethod
  def from_pretrained(
    cls, path: str | os.PathLike, chat_template: str = "auto", system_prompt: str = ""
  ) -> HFTokenizer:
    """A Hugging Face model folder's tokenizer: tokenizer.json, its special tokens and chat template
    from tokenizer_config.json (or chat_template.jinja), and the EOS / PAD ids of generation_config.json
    (the first, where it lists several EOS ids).

    chat_template: 'auto' applies the folder's template when it has one; 'none' never does.
    """
    path = os.fspath(path)
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
      raise FileNotFoundError(
        f"{path}: no tokenizer.json. Copy the model's tokenizer files (tokenizer.json, tokenizer_config.json) "
        "into it, or point data.tokenizer at a tokenizer.json."
      )
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    generation = _read_json(os.path.join(path, "generation_config.json"))
    inner = tokenizers.Tokenizer.from_file(file)
    name = lambda key: _token_name(config.get(key))
    by_id = lambda key: _first_id(generation.get(key))
    eos = inner.id_to_token(by_id("eos_token_id")) if by_id("eos_token_id") is not None else name("eos_token")
    pad = inner.id_to_token(by_id("pad_token_id")) if by_id("pad_token_id") is not None else name("pad_token")
    template = None
    if chat_template == "auto":
      template = config.get("chat_template")
      if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
      jinja = os.path.join(path, "chat_template.jinja")
      if template is None and os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
          template = f.read()
    elif chat_template != "none":
      raise ValueError(f"chat_template must be 'auto' or 'none', got {chat_template!r}")
    return cls(
      inner,
      pad_token=pad,
      bos_token=name("bos_token"),
      eos_token=eos,
      chat_template=template,
      system_prompt=system_prompt,
    )

  def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
    """The template rendered as transformers renders it (same variables, filters and whitespace rules)."""
    if self._template is None:
      raise ValueError("this tokenizer has no chat template")
    token = lambda i: None if i is None else self.tokenizer.id_to_token(i)
    return self._template.render(
      messages=list(messages),
      add_generation_prompt=add_generation_prompt,
      bos_token=token(self.bos_id) or "",
      eos_token=token(self.eos_id),
      pad_token=token(self.pad_id),
    )

  def encode_prompt(self, text: str) -> list[int]:
    """A prompt as the model reads it: with a chat template, the rendered conversation (the template
    places BOS where the model wants it); otherwise BOS, then the text."""
    if self._template is None:
      return _bos_then(self, text)
    system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
    return self.encode(self.apply_chat_template([*system, {"role": "user", "content": text}]))

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


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None


def _token_name(value) -> str | None:
  """tokenizer_config.json names a special token as a string or as {"content": ...}."""
  return value.get("content") if isinstance(value, Mapping) else value


def _first_id(value) -> int | None:
  return value[0] if isinstance(value, list) and value else value if isinstance(value, int) else None


def _compile_template(source: str):
  """A chat template compiled as transformers compiles it: a sandboxed Jinja environment with
  trim_blocks / lstrip_blocks, loop controls, `tojson`, `raise_exception` and `strftime_now`."""
  import jinja2  # noqa: PLC0415
  import jinja2.ext  # noqa: PLC0415
  from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(source)


def task_alphabet(task: str = "arithmetic") -> str:
  """The character alphabet of a task (see DataConfig.task)."""
  if task in CODE_TASKS:
    return CODE_ALPHABET
  return RUNNING_SUM_ALPHABET if task == "running_sum" else ARITHMETIC_ALPHABET


def load_tokenizer(
  spec: str | os.PathLike | None = None, *, task: str = "arithmetic", **special_tokens: str | None
) -> Tokenizer:
  """None or "char": the task's CharTokenizer (task_alphabet); otherwise a tokenizer.json file, or a
  folder holding one (a Hugging Face model folder: `HFTokenizer.from_pretrained`, with its chat
  template and special tokens; special_tokens may then hold chat_template= and system_prompt=)."""
  if spec is None or spec == "char":
    return CharTokenizer(task_alphabet(task))
  path = os.fspath(spec)
  if os.path.isdir(path):
    return HFTokenizer.from_pretrained(path, **special_tokens)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no tokenizer.json at {path}")
  return HFTokenizer.from_file(path, **special_tokens)
