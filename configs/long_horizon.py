"""Long-horizon RL (issue 16): long responses on the running-sum task, or code with sandboxed rewards.

  python -m trace_jax.main --config=configs/long_horizon.py:trace --workdir=/tmp/long_trace
  python -m trace_jax.main --config=configs/long_horizon.py:qat,terms=26 --workdir=/tmp/long_qat_26
  python -m trace_jax.main --config=configs/long_horizon.py:trace,task=code --workdir=/tmp/code_trace

The argument after ':' is a comma-separated list. A bare word picks the mode (bf16, fp4, qat,
qat_w4a16, trace, trace_full: as in configs/default.py); `model=NAME` a preset of configs/models.py;
`task=long` (the default) or `task=code`; `terms=N` and `digits=D` the running sum's knobs, with
the lengths (data.max_prompt_len, rollout.max_new_tokens) set to fit. Override anything else with
--config.FIELD=VALUE; a length override that the task does not fit is refused at start-up
(data.check_lengths) with the value to raise it to.

task=long: data.task='running_sum' (trace_jax/data/long_tasks.py). The prompt lists `terms` terms
of `digits` digits, each with a blank, "47__;12__;85__;...=", and the response fills the blanks with
the partial sums mod 10^digits, "4747;1259;8544;...": every response is terms * (2 * digits + 1)
tokens with its EOS, 65 at the default terms=13, digits=2 (terms=7: 35, 26: 130, 52: 260). The
final answer is the last step; reward: 1 for it (the 'exact' verifier) + 0.1 for a well-formed
finished response; --config.reward.partial_credit=True pays the share of steps right, in place,
when the final one is wrong (evaluation then reports the mean partial score, not accuracy).
  terms   the horizon: response and prompt length grow linearly with it; the chance of getting
          every step right falls about geometrically with it.
  digits  the work per step: 1 is a sum mod 10 (learnt to 100% at 22 terms), 2 an addition with
          a carry, 3 two carries.
The model is the `tiny` preset (4 layers, 8 experts, hidden 64) with room for the positions. SFT
warm start: 1000 steps of 64 (about 11 min on 2 CPU cores; share it between the modes of a
comparison with --config.sft.cache_dir=...). Measured with this config (greedy, 256 held-out
problems, BF16 / FP4 engine): seed 0 99.2% / 17.2%, seed 1 1.2% / 1.6%, seed 2 0.8% / 0.4%. The
addition is learnt suddenly and the step at which it is learnt depends on the seed (925 steps:
0.4-1.6% for seeds 0-2), so at 1000 steps seed 0 starts RL from a policy that has learnt the task
(and whose FP4 rollouts get 17% of it right: per-step FP4 errors compound over 13 steps), seeds 1
and 2 from one that has not. RL from below the transition, with partial credit, leaves the reward
flat (data/long_tasks.py has the measurements). Then `steps` GRPO steps of
batch_prompts x rl.num_generations at lr 1e-4 (3e-5 in configs/default.py; 3e-4 made BF16 RL
from the 925-step policy lose reward).

task=code: data.task='code_synthesis' (trace_jax/data/code_tasks.py): the prompt shows three
input/output asserts of a function f (x + k, x % k, max(x), sorted(x), ...), the response writes f,
and the reward runs it in the sandbox (trace_jax/data/sandbox.py) against 5 hidden asserts
(reward.verifier='code': 1 when all pass, + 0.1 for a program that parses; partial_credit pays
the share passed). The character tokenizer covers printable ASCII (100 ids), so model.vocab_size
is 128. Use your own MBPP/HumanEval-style problems with --config.data.task=code_jsonl
--config.data.jsonl_train=FILE (and sft.steps=0 if they carry no reference solutions).
"""

import ml_collections

from configs import models
from trace_jax import config as config_lib
from trace_jax.data.long_tasks import RunningSumTask

TASKS = ("long", "code")
KEYS = ("mode", "model", "task", "terms", "digits")
DEFAULT_TERMS, DEFAULT_DIGITS = 13, 2


def parse_arg(arg: str) -> dict[str, str]:
  """'trace,task=code' -> {'mode': 'trace', 'task': 'code'} (a bare word is the mode)."""
  out = {}
  for part in filter(None, (p.strip() for p in (arg or "").split(","))):
    key, sep, value = part.partition("=")
    key, value = ("mode", key) if not sep else (key.strip(), value.strip())
    if key not in KEYS or key in out:
      raise ValueError(
        f"configs/long_horizon.py: cannot read {part!r} in {arg!r}; expected 'MODE' and any of "
        f"{', '.join(k + '=...' for k in KEYS[1:])}, e.g. 'trace,terms=64' or 'qat,task=code'."
      )
    out[key] = value
  if out.get("task", "long") not in TASKS:
    raise ValueError(f"configs/long_horizon.py: task must be one of {TASKS}, got {out['task']!r}.")
  if out.get("task") == "code" and ("terms" in out or "digits" in out):
    raise ValueError("configs/long_horizon.py: terms= and digits= are knobs of task=long.")
  return out


def long_task(c: ml_collections.ConfigDict, terms: int, digits: int) -> None:
  """The running sum with the lengths that fit it exactly."""
  longest = RunningSumTask(terms, digits).longest_example()
  c.data.task = "running_sum"
  c.data.sum_terms = terms
  c.data.term_digits = digits
  c.data.max_prompt_len = len(longest.prompt) + 1  # with BOS
  c.rollout.max_new_tokens = len(longest.target) + 1  # with EOS
  c.model.max_position_embeddings = max(
    c.model.max_position_embeddings, c.data.max_prompt_len + c.rollout.max_new_tokens
  )
  c.sft.steps = 1000  # the addition is learnt between 700 and 1000 steps (data/long_tasks.py)
  c.sft.batch_size = 64
  c.steps = 100
  c.optim.learning_rate = 1e-4
  c.batch_prompts = 8
  c.rl.num_generations = 8
  c.eval_every = 20
  c.eval_prompts = 256


def code_task(c: ml_collections.ConfigDict) -> None:
  """The synthesis task with sandboxed rewards (prompts <= 153 tokens with BOS, programs <= 30 with EOS)."""
  c.data.task = "code_synthesis"
  c.data.num_train = 4000
  c.data.num_test = 200
  c.data.max_prompt_len = 160
  c.rollout.max_new_tokens = 48
  c.reward.verifier = "code"
  c.model.vocab_size = 128  # >= the code tokenizer's 100 ids
  c.sft.steps = 300
  c.sft.batch_size = 32
  c.steps = 60
  c.batch_prompts = 8
  c.rl.num_generations = 8
  c.eval_prompts = 64


def get_config(arg: str = "trace") -> ml_collections.ConfigDict:
  args = parse_arg(arg)
  c = config_lib.defaults()
  c.mode = args.get("mode", "trace")
  c.model = models.get_config(args.get("model", "tiny"))
  if args.get("task", "long") == "long":
    long_task(c, int(args.get("terms", DEFAULT_TERMS)), int(args.get("digits", DEFAULT_DIGITS)))
  else:
    code_task(c)
  return c
