"""Data for RL and SFT: tasks, verifiable rewards, tokenizers, the tfds builder, JSONL, batching.

Self-contained (no model imports): config -> data -> rollout -> train.

  tasks.py         Example, ArithmeticTask (levels 1-4, seed-independent held-out test problems)
  tokenizer.py     CharTokenizer, HFTokenizer (tokenizer.json), load_tokenizer
  rewards.py       RewardConfig, reward_fn, batch_rewards, invalid_responses, numeric answer extraction
  tfds_builder.py  TraceArithmetic (array_record, no TensorFlow), build_arithmetic_dataset
  jsonl.py         JsonlSource for {"prompt", "answer"} lines
  batching.py      PromptBatcher (left-padded prompts), SFTBatcher, both deterministic in (seed, step); check_lengths
  sandbox.py       run/run_batch: untrusted programs against assert tests in a sandboxed process; code_reward
  code_tasks.py    CodeProblem, load_code_jsonl (MBPP/HumanEval style), synthesis_problems (the tiny synthesis task)
"""

from trace_jax.data.batching import (
  EpochSampler,
  PromptBatch,
  PromptBatcher,
  SFTBatch,
  SFTBatcher,
  check_lengths,
  encode_prompts,
  encode_sft,
)
from trace_jax.data.code_tasks import CodeProblem, load_code_jsonl, synthesis_problems
from trace_jax.data.jsonl import JsonlFormatError, JsonlSource
from trace_jax.data.rewards import (
  RewardConfig,
  answer_number,
  batch_rewards,
  extract_last_number,
  invalid_responses,
  numbers_equal,
  reward_fn,
)
from trace_jax.data.sandbox import SandboxLimits, SandboxResult, code_reward
from trace_jax.data.tasks import (
  LEVELS,
  ArithmeticTask,
  DataSource,
  Example,
  as_example,
  is_test_problem,
  longest_example,
)
from trace_jax.data.tfds_builder import (
  ArithmeticConfig,
  TraceArithmetic,
  arithmetic_source,
  build_arithmetic_dataset,
  default_data_dir,
)
from trace_jax.data.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
  "LEVELS",
  "ArithmeticConfig",
  "ArithmeticTask",
  "CharTokenizer",
  "CodeProblem",
  "DataSource",
  "EpochSampler",
  "Example",
  "HFTokenizer",
  "JsonlFormatError",
  "JsonlSource",
  "PromptBatch",
  "PromptBatcher",
  "RewardConfig",
  "SFTBatch",
  "SFTBatcher",
  "SandboxLimits",
  "SandboxResult",
  "Tokenizer",
  "TraceArithmetic",
  "answer_number",
  "arithmetic_source",
  "as_example",
  "batch_rewards",
  "build_arithmetic_dataset",
  "check_lengths",
  "code_reward",
  "default_data_dir",
  "encode_prompts",
  "encode_sft",
  "extract_last_number",
  "invalid_responses",
  "is_test_problem",
  "load_code_jsonl",
  "load_tokenizer",
  "longest_example",
  "numbers_equal",
  "reward_fn",
  "synthesis_problems",
]
