"""One process of a multi-process (or the single-process reference) RL run of a tiny config.

  python tests/multiprocess_worker.py WORKDIR DEVICES_PER_PROCESS NUM_PROCESSES PROCESS_ID PORT

Runs `train.train_and_evaluate` through `config.distributed` (jax.distributed.initialize with
gloo collectives on CPU) on a 2-device global mesh: the trainer's MoE expert parallel over
'expert' = 2 (all_to_all across the processes), the engine data parallel. tests/test_sharding.py
compares the metrics.jsonl of two processes x 1 device with one process x 2 devices.
"""

import os
import sys

workdir, devices, num_processes, process_id, port = sys.argv[1], *map(int, sys.argv[2:])
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"

import json  # noqa: E402

from configs import default  # noqa: E402
from trace_jax import train  # noqa: E402


def config(data_path: str):
  c = default.get_config("trace")
  c.steps = 2
  c.checkpoint_every = 1
  c.batch_prompts = 2
  c.eval_prompts = 4
  c.rl.num_generations = 4
  c.rollout.max_new_tokens = 4
  c.model.num_layers = 2
  c.sft.steps = 40  # a little SFT, so that rewards (format bonus) differ and the updates are not zero
  c.sft.batch_size = 8
  c.sft.optim.learning_rate = 1e-2
  c.data.jsonl_train = data_path
  c.data.max_prompt_len = 8
  c.mesh.trainer = dict(data=1, fsdp=1, expert=2, tensor=1)
  c.mesh.rollout = dict(data=2, fsdp=1, expert=1, tensor=1)
  c.mesh.moe_impl = "ep"
  c.mesh.capacity_factor = 4.0  # no drops: the comparison is exact in principle
  if num_processes > 1:
    c.distributed.coordinator_address = f"127.0.0.1:{port}"
    c.distributed.num_processes = num_processes
    c.distributed.process_id = process_id
  return c


if __name__ == "__main__":
  path = os.path.join(workdir, "data.jsonl")
  with open(f"{path}.{process_id}", "w") as f:  # every process writes the same file, atomically
    for a in range(10):
      for b in range(3):
        f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
  os.replace(f"{path}.{process_id}", path)
  summary = train.train_and_evaluate(config(path), os.path.join(workdir, "run"))
  print("SUMMARY " + json.dumps(summary))
