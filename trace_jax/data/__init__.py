"""Data for RL and SFT: tasks, verifiable rewards, tokenizers, the tfds builder, JSONL, batching.

Self-contained (no model imports): config -> data -> rollout -> train.

  tasks.py         Example, ArithmeticTask (levels 1-4, seed-independent held-out test problems)
  long_tasks.py    RunningSumTask: long responses (every partial sum written), the length knob `terms`
  tokenizer.py     CharTokenizer (the task's alphabet), HFTokenizer (tokenizer.json), load_tokenizer
  rewards.py       RewardConfig, reward_fn, batch_rewards (exact / numeric / code, partial credit),
                   make_reward_fn (the trainer's), invalid_responses, numeric answer extraction
  tfds_builder.py  TraceArithmetic, TraceRunningSum (array_record, no TensorFlow), build_*_dataset, *_source
  jsonl.py         JsonlSource for {"prompt", "answer"} lines
  math_tasks.py    MathSource: GSM8K- and MATH-style problems from JSONL or Parquet (the 'math' verifier: rewards.py)
  batching.py      PromptBatcher (left-padded prompts), SFTBatcher, both deterministic in (seed, step); check_lengths
  sandbox.py       run/run_batch: untrusted programs against assert tests in a sandboxed process; code_reward
  code_tasks.py    CodeProblem, load_code_jsonl (MBPP/HumanEval style), synthesis_problems / synthesis_split
                   (the tiny synthesis task), code_sources (a code task's train and test Examples)
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
from trace_jax.data.code_tasks import CodeProblem, code_sources, load_code_jsonl, synthesis_problems, synthesis_split
from trace_jax.data.jsonl import JsonlFormatError, JsonlSource
from trace_jax.data.long_tasks import RunningSumTask, mean_target_tokens
from trace_jax.data.math_tasks import MathFormatError, MathSource
from trace_jax.data.rewards import (
  RewardConfig,
  answer_number,
  batch_rewards,
  code_rewards,
  extract_last_number,
  extract_program,
  invalid_responses,
  last_boxed,
  make_reward_fn,
  math_equal,
  numbers_equal,
  reward_fn,
  step_credit,
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
  RunningSumConfig,
  TraceArithmetic,
  TraceRunningSum,
  arithmetic_source,
  build_arithmetic_dataset,
  build_running_sum_dataset,
  default_data_dir,
  running_sum_source,
)
from trace_jax.data.tokenizer import (
  ARITHMETIC_ALPHABET,
  CODE_ALPHABET,
  RUNNING_SUM_ALPHABET,
  CharTokenizer,
  HFTokenizer,
  Tokenizer,
  load_tokenizer,
  task_alphabet,
)

__all__ = [
  "ARITHMETIC_ALPHABET",
  "CODE_ALPHABET",
  "RUNNING_SUM_ALPHABET",
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
  "MathFormatError",
  "MathSource",
  "PromptBatch",
  "PromptBatcher",
  "RewardConfig",
  "RunningSumConfig",
  "RunningSumTask",
  "SFTBatch",
  "SFTBatcher",
  "SandboxLimits",
  "SandboxResult",
  "Tokenizer",
  "TraceArithmetic",
  "TraceRunningSum",
  "answer_number",
  "arithmetic_source",
  "as_example",
  "batch_rewards",
  "build_arithmetic_dataset",
  "build_running_sum_dataset",
  "check_lengths",
  "code_reward",
  "code_rewards",
  "code_sources",
  "default_data_dir",
  "encode_prompts",
  "encode_sft",
  "extract_last_number",
  "extract_program",
  "invalid_responses",
  "last_boxed",
  "is_test_problem",
  "load_code_jsonl",
  "load_tokenizer",
  "longest_example",
  "make_reward_fn",
  "math_equal",
  "mean_target_tokens",
  "numbers_equal",
  "reward_fn",
  "running_sum_source",
  "step_credit",
  "synthesis_problems",
  "synthesis_split",
  "task_alphabet",
]
