"""The generated tasks as tensorflow-datasets datasets in array_record files, without TensorFlow.

  TraceArithmetic   "trace_arithmetic", the arithmetic task (levels), build_arithmetic_dataset
  TraceRunningSum   "trace_running_sum", the long-response running sum (terms, digits),
                    build_running_sum_dataset / running_sum_source
Both have the features prompt, answer, target (text) and difficulty (int32).

Building writes array_record shards (random access, no TF) and reading uses tfds data sources
(`builder.as_data_source()` / `tfds.data_source(...)`), never `as_dataset`, which needs TF. A build
is a pure function of the config (levels, sizes, seed): the config name spells all of them, so a
cached build is reused only when it is the same data, and two builds are record-for-record equal.
Records keep the generator's order (disable_shuffling); the batcher shuffles by (seed, epoch).
Token ids are not stored: the same records serve any tokenizer.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from trace_jax.data.long_tasks import RunningSumTask
from trace_jax.data.tasks import LEVELS, SPLITS, ArithmeticTask, DataSource, Example


def default_data_dir() -> str:
  """$XDG_CACHE_HOME/trace_jax/tensorflow_datasets (usually ~/.cache/...); runs pass their workdir instead."""
  cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(cache, "trace_jax", "tensorflow_datasets")


@dataclasses.dataclass
class ArithmeticConfig(tfds.core.BuilderConfig):
  """Which levels to mix, how many examples per split, and the generator seed."""

  levels: tuple[int, ...] = (1, 2)
  num_train: int = 20_000
  num_test: int = 1_000
  seed: int = 0

  @classmethod
  def named(cls, levels: tuple[int, ...], num_train: int, num_test: int, seed: int) -> ArithmeticConfig:
    """A config whose name spells every parameter, so differently built data never share a cache dir."""
    name = f"levels{'-'.join(map(str, levels))}_train{num_train}_test{num_test}_seed{seed}"
    return cls(name=name, levels=tuple(levels), num_train=num_train, num_test=num_test, seed=seed)


class _TaskBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """What the task builders share: the features, the two splits, generation from `_examples`."""

  # Generated, so there are no download checksums to locate; tfds' lookup of them (via code_path)
  # needs the importlib_resources package for a builder outside tensorflow_datasets.
  code_path = None

  def _info(self) -> tfds.core.DatasetInfo:
    # Built directly: outside its own package folder tfds cannot find metadata files for dataset_info_from_configs.
    features = tfds.features.FeaturesDict(
      {
        "prompt": tfds.features.Text(),
        "answer": tfds.features.Text(),
        "target": tfds.features.Text(),
        "difficulty": np.int32,
      }
    )
    return tfds.core.DatasetInfo(builder=self, features=features, disable_shuffling=True)

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    del dl_manager  # generated, nothing to download
    config = self.builder_config
    return {
      "train": self._generate_examples("train", config.num_train),
      "test": self._generate_examples("test", config.num_test),
    }

  def _examples(self, split: str, num_examples: int) -> list[Example]:
    raise NotImplementedError

  def _generate_examples(self, split: str, num_examples: int):
    for i, ex in enumerate(self._examples(split, num_examples)):
      yield i, {"prompt": ex.prompt, "answer": ex.answer, "target": ex.target, "difficulty": ex.difficulty}


class TraceArithmetic(_TaskBuilder):
  """tfds name "trace_arithmetic"; features: prompt, answer, target (text), difficulty (int32)."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Levels 1-4, crc32 held-out test problems."}
  BUILDER_CONFIGS = [
    *(ArithmeticConfig.named((level,), 20_000, 1_000, 0) for level in LEVELS),
    ArithmeticConfig.named((1, 2), 20_000, 1_000, 0),
  ]
  DEFAULT_CONFIG_NAME = BUILDER_CONFIGS[-1].name

  def _examples(self, split: str, num_examples: int) -> list[Example]:
    config = self.builder_config
    return ArithmeticTask(tuple(config.levels)).generate(config.seed, num_examples, split)


@dataclasses.dataclass
class RunningSumConfig(tfds.core.BuilderConfig):
  """Terms per problem, digits per term, how many examples per split, and the generator seed."""

  terms: int = 13
  digits: int = 2
  num_train: int = 20_000
  num_test: int = 1_000
  seed: int = 0

  @classmethod
  def named(cls, terms: int, digits: int, num_train: int, num_test: int, seed: int) -> RunningSumConfig:
    """A config whose name spells every parameter, so differently built data never share a cache dir."""
    name = f"terms{terms}_digits{digits}_train{num_train}_test{num_test}_seed{seed}"
    return cls(name=name, terms=terms, digits=digits, num_train=num_train, num_test=num_test, seed=seed)


class TraceRunningSum(_TaskBuilder):
  """tfds name "trace_running_sum": the long-response running sum (data/long_tasks.py)."""

  VERSION = tfds.core.Version("2.0.0")
  RELEASE_NOTES = {
    "1.0.0": "Running sums of n d-digit terms, every partial sum written; crc32 held-out problems.",
    "2.0.0": "The prompt has a blank per term; the response writes each term with its partial sum.",
  }
  BUILDER_CONFIGS = [RunningSumConfig.named(terms, 2, 20_000, 1_000, 0) for terms in (7, 13, 26, 52)]
  DEFAULT_CONFIG_NAME = BUILDER_CONFIGS[1].name

  def _examples(self, split: str, num_examples: int) -> list[Example]:
    config = self.builder_config
    return RunningSumTask(config.terms, config.digits).generate(config.seed, num_examples, split)


def _prepared(builder_cls, config, data_dir):
  data_dir = os.fspath(data_dir) if data_dir is not None else default_data_dir()
  # tfds refuses a custom config named like a predefined one; the predefined one is the same data.
  predefined = {c.name for c in builder_cls.BUILDER_CONFIGS}
  builder = builder_cls(
    data_dir=data_dir, config=config.name if config.name in predefined else config, file_format="array_record"
  )
  builder.download_and_prepare()
  return builder


def build_arithmetic_dataset(
  data_dir: str | os.PathLike | None = None,
  levels: tuple[int, ...] = (1, 2),
  num_train: int = 20_000,
  num_test: int = 1_000,
  seed: int = 0,
) -> TraceArithmetic:
  """Build (or reuse) the dataset under `data_dir` and return the prepared builder."""
  ArithmeticTask(tuple(levels))  # validate before creating any directory
  return _prepared(TraceArithmetic, ArithmeticConfig.named(tuple(levels), num_train, num_test, seed), data_dir)


def arithmetic_source(split: str = "train", **build_kwargs: Any) -> DataSource:
  """The random-access array_record data source of one split (building it first if needed)."""
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  return build_arithmetic_dataset(**build_kwargs).as_data_source(split=split)


def build_running_sum_dataset(
  data_dir: str | os.PathLike | None = None,
  terms: int = 13,
  digits: int = 2,
  num_train: int = 20_000,
  num_test: int = 1_000,
  seed: int = 0,
) -> TraceRunningSum:
  """Build (or reuse) the running-sum dataset under `data_dir` and return the prepared builder."""
  RunningSumTask(terms, digits)  # validate before creating any directory
  return _prepared(TraceRunningSum, RunningSumConfig.named(terms, digits, num_train, num_test, seed), data_dir)


def running_sum_source(split: str = "train", **build_kwargs: Any) -> DataSource:
  """The random-access array_record data source of one split of the running sum (built first if needed)."""
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  return build_running_sum_dataset(**build_kwargs).as_data_source(split=split)
