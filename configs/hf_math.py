"""FP4 RL with TRACE from a pretrained Hugging Face MoE, on math problems: where a researcher starts at scale.

  python -m trace_jax.main --config=configs/hf_math.py:trace --workdir=/ckpt/q30b_trace \
    --config.init_from=/models/Qwen3-30B-A3B \
    --config.data.jsonl_train=/data/dapo_math_17k.parquet --config.data.jsonl_test=/data/math500.jsonl
  python -m trace_jax.main --config=configs/hf_math.py:trace,init_from=/models/Qwen3-30B-A3B --workdir=...

The argument after ':' is a comma-separated list: a bare word picks the mode (bf16, fp4, qat,
qat_w4a16, trace, trace_full) and `init_from=DIR` the checkpoint. The model section comes from
DIR/config.json (Qwen3-MoE, Qwen3.5-MoE, Mixtral), the tokenizer and its chat template from DIR;
SFT is off. The run ends with its policy in WORKDIR/hf/ (transformers / vLLM load it) and
`python -m trace_jax.evaluate` scores any checkpoint.

Settings: prompts up to 1024 tokens and responses up to 8192 (typical of math RL recipes such as
DAPO's; the paper's own lengths are not in our sources), lr 1e-6 with a short warmup, 16 prompts x
G=16 samples a step, token-level TIS capped at 5 (the paper's cap), routing replay (R3), and a mesh
over every device (one host of 8 GPUs): FSDP for the trainer, the experts split for the rollout.

A CPU smoke run of the same path (`python tests/pretrained.py /tmp/pt` writes a tiny checkpoint and problems):

  python -m trace_jax.main --config=configs/hf_math.py:trace,init_from=/tmp/pt/qwen3 --workdir=/tmp/hf_smoke \
    --config.data.jsonl_train=/tmp/pt/math.jsonl --config.steps=2 --config.batch_prompts=2 \
    --config.rl.num_generations=2 --config.rl.minibatches=1 --config.rollout.max_new_tokens=16 \
    --config.data.max_prompt_len=64 --config.eval_prompts=4
"""

import ml_collections

from trace_jax import config as config_lib


def get_config(arg: str = "trace") -> ml_collections.ConfigDict:
  args = config_lib.parse_config_arg(arg, ("init_from",), "configs/hf_math.py", "trace,init_from=/models/Qwen3-30B-A3B")
  c = config_lib.defaults()
  c.mode = args.get("mode", "trace")
  c.init_from = args.get("init_from", "")
  c.model = config_lib.unset_model_section()  # from init_from's config.json

  c.data.task = "math"
  c.data.max_prompt_len = 1024
  c.rollout.max_new_tokens = 8192
  c.rollout.temperature = 1.0
  c.reward.verifier = "math"
  c.reward.format_reward = 0.0  # the verifier's reward alone, as math RL recipes score

  c.steps = 500
  c.batch_prompts = 16
  c.rl.num_generations = 16
  c.rl.tis_cap = 5.0
  c.rl.routing_replay = True
  c.rl.minibatches = 4
  c.optim.learning_rate = 1e-6
  c.optim.warmup_steps = 10
  c.optim.end_lr_fraction = 1.0  # constant after warmup
  c.optim.weight_decay = 0.01
  c.checkpoint_every = 20
  c.eval_every = 50
  c.eval_prompts = 256

  c.mesh.trainer = dict(data=1, fsdp=-1, expert=1, tensor=1)  # -1: every device (8 on one GPU host)
  c.mesh.rollout = dict(data=1, fsdp=1, expert=-1, tensor=1)
  return c
