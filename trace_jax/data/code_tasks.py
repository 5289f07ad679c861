"""Coding problems for code-execution rewards: a JSONL loader and a tiny program-synthesis task.

A CodeProblem holds the prompt the model sees, the hidden tests the sandbox runs (assert
statements; see trace_jax.data.sandbox for how they are counted), optional public examples (already
part of the prompt), the name of the function to write and an optional reference solution (the SFT
target). Score programs with sandbox.run_batch(codes, [p.test_source for p in problems]) and
sandbox.code_reward.

JSONL (load_code_jsonl), one object per line, MBPP/HumanEval style:
  {"prompt": "Write a function add(a, b) ...", "tests": ["assert add(1, 2) == 3", ...],
   "entry_point": "add", "reference": "def add(a, b):\\n  return a + b\\n", "task_id": "..."}
  prompt       required; MBPP's "text" is accepted instead
  tests        required: a string of Python (asserts, one test per top-level assert) or a list of
               such strings; MBPP's "test_list" and HumanEval's "test" (a check(candidate)
               function, called on entry_point: one test) are accepted instead
  setup        optional source run before the tests, not counted (MBPP's "test_setup_code")
  entry_point  optional function name; reference optional (MBPP's "code", HumanEval's
               "canonical_solution"); examples optional (a string or a list of strings)
Other fields are kept in metadata. Every line is validated when the file is read (the tests must
parse) and errors name the file, the line and the field.

synthesis_split(n, split, seed) holds out the problems whose crc32(prompt) % 10 == 0 for the test
split, like the generated tasks. synthesis_problems(n, seed): the prompt shows 3 input/output pairs of a function f from a small
family (x + k, x - k, x * k, x % k, x // k, x * x, and on lists: reverse, max, min, sum, sorted,
len, first, last); the hidden tests are 5 more pairs on other inputs; the reference is the
one-line implementation, e.g. "def f(x):\\n  return x + 3\\n". The public pairs are chosen so that
every function of the families that fits them also passes the hidden tests: the task is well posed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trace_jax.data.jsonl import JsonlFormatError
from trace_jax.data.sandbox import split_tests
from trace_jax.data.tasks import SPLITS, Example, is_test_problem

SAMPLE_PATH = os.path.join(os.path.dirname(__file__), "code_sample.jsonl")


@dataclasses.dataclass(frozen=True)
class CodeProblem:
  """One coding problem. `tests` are hidden from the model; `examples` are shown in the prompt."""

  prompt: str
  tests: tuple[str, ...]
  entry_point: str | None = None
  examples: tuple[str, ...] = ()
  reference: str | None = None
  setup: str = ""
  task_id: str = ""
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def test_source(self) -> str:
    """The source given to sandbox.run: the setup, then the tests."""
    return "\n".join(part for part in (self.setup, *self.tests) if part) + "\n"

  def to_example(self) -> Example:
    """As an Example: answer = the test source, target = the reference solution (or "")."""
    return Example(
      prompt=self.prompt,
      answer=self.test_source,
      target=self.reference or "",
      metadata={"task_id": self.task_id, "entry_point": self.entry_point, **self.metadata},
    )


# --- JSONL ----------------------------------------------------------------------------------


def _strings(value: Any, where: str, field: str) -> tuple[str, ...]:
  if isinstance(value, str):
    return (value,) if value.strip() else ()
  if isinstance(value, list) and all(isinstance(v, str) for v in value):
    return tuple(v for v in value if v.strip())
  raise JsonlFormatError(f"{where}: {field!r} must be a string or a list of strings, got {value!r:.200}")


def _pop_first(record: dict, keys: Sequence[str]) -> tuple[str | None, Any]:
  for key in keys:
    if key in record:
      return key, record.pop(key)
  return None, None


def _parse_problem(line: str, where: str, line_number: int) -> CodeProblem:
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise JsonlFormatError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
  if not isinstance(record, dict):
    raise JsonlFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
  fields = sorted(record)
  prompt_key, prompt = _pop_first(record, ("prompt", "text"))
  if prompt_key is None:
    raise JsonlFormatError(f"{where}: missing field 'prompt' (fields: {fields})")
  if not isinstance(prompt, str) or not prompt.strip():
    raise JsonlFormatError(f"{where}: {prompt_key!r} must be a non-empty string, got {prompt!r:.200}")
  entry_point = record.pop("entry_point", None)
  if entry_point is not None and (not isinstance(entry_point, str) or not entry_point.isidentifier()):
    raise JsonlFormatError(f"{where}: 'entry_point' must be a Python identifier, got {entry_point!r}")
  tests_key, tests_value = _pop_first(record, ("tests", "test_list", "test"))
  if tests_key is None:
    raise JsonlFormatError(f"{where}: missing field 'tests' (fields: {fields})")
  tests = _strings(tests_value, where, tests_key)
  if tests_key == "test":  # HumanEval: a check(candidate) function to call on the entry point
    if entry_point is None:
      raise JsonlFormatError(f"{where}: a HumanEval 'test' needs 'entry_point' (the function check() is called on)")
    tests = ("\n".join(tests) + f"\n\ncheck({entry_point})\n",)
  if not tests:
    raise JsonlFormatError(f"{where}: {tests_key!r} is empty")
  _, setup = _pop_first(record, ("setup", "test_setup_code"))
  setup = "\n".join(_strings(setup, where, "setup")) if setup is not None else ""
  for name, source in (("setup", setup), *((f"{tests_key}[{i}]", t) for i, t in enumerate(tests))):
    try:
      if source:
        split_tests(source)
    except ValueError as e:
      raise JsonlFormatError(f"{where}: {name!r}: {e}") from None
  _, reference = _pop_first(record, ("reference", "canonical_solution", "code"))
  if reference is not None and not isinstance(reference, str):
    raise JsonlFormatError(f"{where}: 'reference' must be a string, got {reference!r:.200}")
  if isinstance(reference, str) and tests_key == "test" and not reference.lstrip().startswith(("def ", "import ")):
    reference = prompt + reference  # HumanEval's canonical_solution is the body that follows the prompt
  examples = _strings(record.pop("examples", []), where, "examples")
  task_id = record.pop("task_id", "")
  return CodeProblem(
    prompt=prompt,
    tests=tests,
    entry_point=entry_point,
    examples=examples,
    reference=reference,
    setup=setup,
    task_id=str(task_id),
    metadata={"line": line_number, **record},
  )


def load_code_jsonl(path: str | os.PathLike) -> list[CodeProblem]:
  """Every problem of a JSONL file (see the module docstring); JsonlFormatError names file, line, field."""
  path = os.fspath(path)
  problems = []
  with open(path, encoding="utf-8") as f:
    for line_number, line in enumerate(f, start=1):
      if line.strip():
        problems.append(_parse_problem(line, f"{path}:{line_number}", line_number))
  if not problems:
    raise JsonlFormatError(f"{path}: no problems")
  return problems


# --- the synthesis task ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Family:
  name: str
  params: tuple[int, ...]  # () for a family without a parameter
  on_lists: bool
  fn: Callable[[Any, int], Any]
  body: str  # the returned expression, with {k}


SYNTHESIS_FAMILIES = (
  _Family("add", tuple(range(1, 10)), False, lambda x, k: x + k, "x + {k}"),
  _Family("sub", tuple(range(1, 10)), False, lambda x, k: x - k, "x - {k}"),
  _Family("mul", tuple(range(2, 10)), False, lambda x, k: x * k, "x * {k}"),
  _Family("mod", tuple(range(2, 10)), False, lambda x, k: x % k, "x % {k}"),
  _Family("floordiv", tuple(range(2, 6)), False, lambda x, k: x // k, "x // {k}"),
  _Family("square", (), False, lambda x, k: x * x, "x * x"),
  _Family("reverse", (), True, lambda x, k: x[::-1], "x[::-1]"),
  _Family("max", (), True, lambda x, k: max(x), "max(x)"),
  _Family("min", (), True, lambda x, k: min(x), "min(x)"),
  _Family("sum", (), True, lambda x, k: sum(x), "sum(x)"),
  _Family("sorted", (), True, lambda x, k: sorted(x), "sorted(x)"),
  _Family("len", (), True, lambda x, k: len(x), "len(x)"),
  _Family("first", (), True, lambda x, k: x[0], "x[0]"),
  _Family("last", (), True, lambda x, k: x[-1], "x[-1]"),
)
SYNTHESIS_FAMILY_NAMES = tuple(f.name for f in SYNTHESIS_FAMILIES)
SYNTHESIS_PUBLIC = 3  # input/output pairs shown in the prompt
SYNTHESIS_HIDDEN = 5  # hidden tests


def _inputs(rng: random.Random, on_lists: bool, count: int) -> list[Any]:
  seen, out = set(), []
  while len(out) < count:
    value = [rng.randint(0, 9) for _ in range(rng.randint(2, 5))] if on_lists else rng.randint(0, 20)
    if repr(value) not in seen:
      seen.add(repr(value))
      out.append(value)
  return out


def _candidates(on_lists: bool) -> list[tuple[_Family, int]]:
  return [(f, k) for f in SYNTHESIS_FAMILIES if f.on_lists == on_lists for k in (f.params or (0,))]


def synthesis_problems(
  n: int, seed: int = 0, families: Sequence[str] | None = None, start: int = 0
) -> list[CodeProblem]:
  """n problems (indices start .. start + n - 1), deterministic in (seed, index); `families`
  restricts the function families."""
  names = tuple(families) if families is not None else SYNTHESIS_FAMILY_NAMES
  unknown = sorted(set(names) - set(SYNTHESIS_FAMILY_NAMES))
  if unknown or not names:
    raise ValueError(f"unknown synthesis families {unknown} (known: {list(SYNTHESIS_FAMILY_NAMES)})")
  chosen = [f for f in SYNTHESIS_FAMILIES if f.name in names]
  problems = []
  for index in range(start, start + n):
    rng = random.Random(f"trace_jax.synthesis:{seed}:{index}")
    family = rng.choice(chosen)
    k = rng.choice(family.params) if family.params else 0
    for _ in range(100):  # resample the inputs until the public pairs single out (family, k)
      inputs = _inputs(rng, family.on_lists, SYNTHESIS_PUBLIC + SYNTHESIS_HIDDEN)
      public, hidden = inputs[:SYNTHESIS_PUBLIC], inputs[SYNTHESIS_PUBLIC:]
      outputs = [family.fn(x, k) for x in inputs]
      rivals = [  # another function that fits the public pairs but fails a hidden test
        (g, j)
        for g, j in _candidates(family.on_lists)
        if all(g.fn(x, j) == y for x, y in zip(public, outputs))
        and any(g.fn(x, j) != y for x, y in zip(hidden, outputs[SYNTHESIS_PUBLIC:]))
      ]
      if not rivals:
        break
    examples = tuple(f"assert f({x!r}) == {y!r}" for x, y in zip(public, outputs))
    tests = tuple(f"assert f({x!r}) == {y!r}" for x, y in zip(hidden, outputs[SYNTHESIS_PUBLIC:]))
    prompt = "Write f so that:\n" + "\n".join(examples) + "\n"
    reference = f"def f(x):\n  return {family.body.format(k=k)}\n"
    problems.append(
      CodeProblem(
        prompt=prompt,
        tests=tests,
        entry_point="f",
        examples=examples,
        reference=reference,
        task_id=f"synthesis/{seed}/{index}",
        metadata={"family": family.name, "k": k},
      )
    )
  return problems


def synthesis_split(
  n: int, split: str = "train", seed: int = 0, families: Sequence[str] | None = None
) -> list[CodeProblem]:
  """n problems of one split: the synthesis problems of `seed` in index order, a problem held out for
  the test split iff crc32(prompt) % 10 == 0 (tasks.is_test_problem), as for the generated tasks."""
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  want_test, out, start = split == "test", [], 0
  while len(out) < n:
    chunk = max(64, (10 if want_test else 2) * (n - len(out)))
    problems = synthesis_problems(chunk, seed, families, start=start)
    out.extend(p for p in problems if is_test_problem(p.prompt) == want_test)
    start += chunk
  return out[:n]


def _named(problem: CodeProblem, name: str) -> Example:
  ex = problem.to_example()
  return dataclasses.replace(ex, metadata={**ex.metadata, "name": name})


def code_sources(cfg) -> tuple[list[Example], list[Example]]:
  """(train, test) Examples of a code task (cfg: a DataConfig with task 'code_synthesis' or 'code_jsonl').

  answer = the hidden tests (what the 'code' verifier runs), target = the reference solution (the SFT
  target; "" when a JSONL problem has none, so warm-start only on files with references),
  metadata["name"] = the task id, or file:line for a JSONL problem without one.
  code_synthesis: num_train / num_test problems of synthesis_split(seed). code_jsonl: every problem of
  jsonl_train, and of jsonl_test (default: the training file).
  """
  if cfg.task == "code_synthesis":
    return tuple(
      [_named(p, p.task_id) for p in synthesis_split(n, split, cfg.seed)]
      for n, split in ((cfg.num_train, "train"), (cfg.num_test, "test"))
    )
  if cfg.task != "code_jsonl":
    raise ValueError(f"not a code task: {cfg.task!r}")
  load = lambda path: [_named(p, p.task_id or f"{path}:{p.metadata['line']}") for p in load_code_jsonl(path)]
  train = load(cfg.jsonl_train)
  return train, load(cfg.jsonl_test) if cfg.jsonl_test else train
