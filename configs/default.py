"""The embedded default: GRPO with TRACE on the arithmetic task, tiny MoE, 2 CPU cores.

  python -m trace_jax.main --config=configs/default.py --workdir=/tmp/trace_run
  python -m trace_jax.main --config=configs/default.py:qat --workdir=... --config.steps=20
  python -m trace_jax.main --config=configs/default.py:trace,model=qwen3_30b_a3b --workdir=...

The argument after ':' is a comma-separated list: a bare word picks the mode (bf16, fp4, qat,
qat_w4a16, trace, trace_full) and `model=NAME` a preset of configs/models.py. Every field and its
default is declared once, in the config dataclasses of trace_jax/config.py (their docstrings say
what each means); this file only picks the model.
"""

import ml_collections

from configs import models
from trace_jax import config as config_lib

# The smallest run, as overrides (sweep.configure / --config.FIELD): the smallest model NVFP4 applies to
# (contraction dims multiples of 16), 2 layers so that TRACE guides one and measures the other, 2 prompts x 2
# generations, 2 SFT steps. The tests' runs (tests/tiny.py TINY) and the benchmarks' and long-horizon
# experiment's --smoke runs start from it.
SMOKE = {
  "model.hidden_size": 32,
  "model.num_layers": 2,
  "model.num_heads": 2,
  "model.num_kv_heads": 1,
  "model.head_dim": 16,
  "model.num_experts": 4,
  "model.num_experts_per_tok": 2,
  "model.moe_intermediate_size": 16,
  "batch_prompts": 2,
  "rl.num_generations": 2,
  "sft.steps": 2,
  "sft.batch_size": 8,
}


def parse_arg(arg: str) -> dict[str, str]:
  """'trace,model=tiny' -> {'mode': 'trace', 'model': 'tiny'} (a bare word is the mode)."""
  return config_lib.parse_config_arg(arg, ("model",), "configs/default.py", "trace,model=tiny")


def get_config(arg: str = "trace") -> ml_collections.ConfigDict:
  args = parse_arg(arg)
  c = config_lib.defaults()
  c.mode = args.get("mode", "trace")
  c.model = models.get_config(args.get("model", "tiny"))
  return c
