"""The embedded default: GRPO with TRACE on the arithmetic task, tiny MoE, 2 CPU cores.

  python -m trace_jax.main --config=configs/default.py --workdir=/tmp/trace_run
  python -m trace_jax.main --config=configs/default.py:qat --workdir=... --config.steps=20

The optional argument after ':' picks the mode (bf16, fp4, qat, quads, trace, trace_full).
"""

import ml_collections

from configs import models


def get_config(mode: str = "trace") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.mode = mode or "trace"  # bf16 | fp4 | qat | quads | trace | trace_full
  c.steps = 60
  c.batch_prompts = 8  # prompts per step; x rl.num_generations sequences
  c.checkpoint_every = 10
  c.keep_checkpoints = 3
  c.eval_every = 0  # 0: evaluate only at the end
  c.eval_prompts = 128
  c.log_every = 1

  c.model = models.tiny()

  # FP4 format and targets (SPEC 2.5): routed experts W4A4 and the KV cache.
  c.quant = ml_collections.ConfigDict(
    dict(fmt="nvfp4", targets=("experts", "kv"), weights=True, activations=True, clip_gradient=False)
  )
  # TRACE: which layers get guidance and in which form; diagnostics records full codes in every
  # layer so that per-layer codeword agreement is measured in every mode.
  c.trace = ml_collections.ConfigDict(dict(guided_fraction=0.5, guidance_form="mantissa_scale", diagnostics=True))

  c.rollout = ml_collections.ConfigDict(dict(max_new_tokens=8, temperature=1.0, top_k=0, top_p=1.0, matmul_impl="auto"))
  c.rl = ml_collections.ConfigDict(
    dict(
      num_generations=8,
      clip_eps=0.2,
      clip_eps_high=None,
      tis_cap=5.0,  # token-level TIS min(pi_train / pi_rollout, C); 0 = off
      kl_coef=0.0,
      normalize_std=True,
      routing_replay=True,  # R3
      aux_loss_coef=0.0,
      ppo_epochs=1,
    )
  )
  c.optim = ml_collections.ConfigDict(
    dict(learning_rate=3e-5, warmup_steps=5, end_lr_fraction=0.1, weight_decay=0.0, b1=0.9, b2=0.99, grad_clip=1.0)
  )
  c.reward = ml_collections.ConfigDict(dict(verifier="exact", correct_reward=1.0, format_reward=0.1))

  c.data = ml_collections.ConfigDict(
    dict(
      tokenizer="",  # '' = the task's character tokenizer; or a tokenizer.json path
      levels=(1, 2),
      num_train=20_000,
      num_test=1_000,
      seed=0,
      data_dir="",  # '' = ~/.cache/trace_jax/tensorflow_datasets
      max_prompt_len=12,
      jsonl_train="",  # {"prompt", "answer"} lines instead of the arithmetic task
      jsonl_test="",
    )
  )
  # Supervised warm start so that RL starts from a policy with partial reward.
  c.sft = ml_collections.ConfigDict(
    dict(
      steps=300,
      batch_size=64,
      cache_dir="",  # set to share the (deterministic) SFT result between runs, e.g. a sweep's modes
      optim=dict(
        learning_rate=3e-3, warmup_steps=20, end_lr_fraction=0.05, weight_decay=0.0, b1=0.9, b2=0.99, grad_clip=1.0
      ),
    )
  )
  # Devices (docs/scaling.md): the trainer's and the rollout engine's meshes over the axes
  # (data, fsdp, expert, tensor); -1 takes the remaining devices. rollout_devices=0 puts both
  # roles on every device; n > 0 gives the engine the first n devices and the trainer the rest.
  # moe_impl='ep': the trainer's MoE runs expert parallel over 'expert' (all_to_all with a
  # capacity per expert; a2a 'auto' = ragged_all_to_all on GPU/TPU, dense buffers on CPU).
  c.mesh = ml_collections.ConfigDict(
    dict(
      trainer=dict(data=-1, fsdp=1, expert=1, tensor=1),
      rollout=dict(data=-1, fsdp=1, expert=1, tensor=1),
      rollout_devices=0,
      moe_impl="sorted",
      capacity_factor=2.0,
      a2a="auto",
    )
  )
  # Several hosts: jax.distributed.initialize; empty / 0 / -1 fall back to JAX_COORDINATOR_ADDRESS,
  # JAX_NUM_PROCESSES, JAX_PROCESS_ID, and one process needs none of it.
  c.distributed = ml_collections.ConfigDict(dict(coordinator_address="", num_processes=0, process_id=-1))
  return c
