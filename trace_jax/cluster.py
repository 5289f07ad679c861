"""Roles on meshes: the trainer, the rollout engine, and what crosses between them.

In the spirit of Tunix's `rl_cluster`: `Topology` says which mesh each role runs on (the same
devices with different shapes, or disjoint devices as a disaggregated deployment runs them) and
how each lays out its routed experts. Weights go one way, results the other:

  trainer params --make_weight_sync--> EngineParams on the rollout mesh (packed FP4 experts and
  bf16 rest cross; the quantization, and the packing for the engine's kernel, run where the master
  weights live)
  prompts --make_generate--> RolloutResult on the rollout mesh
  RolloutResult --to_trainer--> TrainBatch on the trainer mesh (tokens, log-probs, routing, guidance)

Each crossing reports the bytes that moved. The engine's numerics are rollout.py's; the
shardings come from the parameter containers' declared logical axes (sharding.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from trace_jax import rollout, sharding
from trace_jax.config import MeshConfig, QuantConfig
from trace_jax.experience import RolloutResult, TrainBatch, train_batch_from_rollout
from trace_jax.expert_parallel import ExpertParallel


@dataclasses.dataclass(frozen=True)
class Topology:
  """The run's devices: the trainer's mesh, the engine's mesh, and each one's MoE dispatch."""

  trainer: jax.sharding.Mesh
  rollout: jax.sharding.Mesh
  expert_parallel: ExpertParallel | None = None  # trainer MoE; None: the 'sorted' MoE under GSPMD
  rollout_expert_parallel: ExpertParallel | None = None  # the engine's routed experts

  @classmethod
  def from_config(cls, mesh: MeshConfig) -> Topology:
    trainer, engine = sharding.make_meshes(dict(mesh.trainer), dict(mesh.rollout), mesh.rollout_devices)
    if mesh.moe_impl == "sorted":
      return cls(trainer, engine)
    layout = lambda m: ExpertParallel(m, capacity_factor=mesh.capacity_factor, a2a=mesh.a2a)
    return cls(trainer, engine, layout(trainer), layout(engine))

  @classmethod
  def single_device(cls) -> Topology:
    mesh = sharding.make_mesh({}, jax.local_devices()[:1])
    return cls(mesh, mesh)


@functools.cache  # one compiled function per mesh pair, like jax.jit's cache
def make_weight_sync(quant: QuantConfig | None, trainer_mesh, rollout_mesh, expert_layout: str = "codes"):
  """params -> (EngineParams on the rollout mesh, bytes that crossed meshes).

  `rollout.weight_sync` runs where the master weights live (the trainer mesh, FP4 experts packed
  there, as the engine's `rollout.expert_layout` wants them: the Mosaic kernel's fragments on
  Hopper), then only the engine's weights move: packed FP4 experts (4.5 bits per element) and bf16 rest.
  """
  on_trainer = sharding.ShardedJit(
    functools.partial(rollout.weight_sync, quant=quant, expert_layout=expert_layout),
    in_shardings=lambda params: (sharding.logical_shardings(params, trainer_mesh),),
    out_shardings=lambda params, out_shape: sharding.logical_shardings(out_shape, trainer_mesh),
  )

  def sync(params):
    engine = on_trainer(params)
    return sharding.reshard(engine, sharding.logical_shardings(engine, rollout_mesh))

  return sync


def _generate_positional(params, prompts, prompt_mask, rng, seq_ids, **static):
  return rollout.generate(params, prompts, prompt_mask, rng, seq_ids=seq_ids, **static)


@functools.cache  # one compiled function per mesh, like jax.jit's cache
def make_generate(mesh) -> sharding.ShardedJit:
  """`rollout.generate` jitted with explicit shardings on the engine's mesh.

  Call as f(params, prompts, prompt_mask, rng, seq_ids_or_None, model_config=..., rollout_config=...,
  sampling=..., expert_parallel=None). Params follow their declared logical axes (packed experts
  split over 'expert'); prompts and every [B, ...] output (tokens, log-probs, routing, guidance)
  split over the batch axes; the KV cache follows the batch by propagation.
  """
  return sharding.ShardedJit(
    _generate_positional,
    in_shardings=lambda params, prompts, prompt_mask, rng, seq_ids: (
      sharding.logical_shardings(params, mesh),
      *sharding.batch_shardings((prompts, prompt_mask), mesh),
      sharding.replicated(mesh),
      sharding.batch_shardings(seq_ids, mesh),
    ),
    out_shardings=lambda *args, out_shape: sharding.batch_shardings(out_shape, mesh),
  )


def to_trainer(result: RolloutResult, routing_replay: bool, trainer_mesh) -> tuple[TrainBatch, dict[str, int]]:
  """The trainer's batch from a rollout, moved onto the trainer mesh (advantages are left to the caller).

  Returns the batch and the bytes that crossed: the whole batch, and the guidance among them.
  """
  batch = train_batch_from_rollout(result, None, routing_replay)  # on the rollout mesh
  targets = sharding.batch_shardings(batch, trainer_mesh)
  guidance_bytes = sharding.crossing_bytes(batch.guidance, targets.guidance)
  batch, batch_bytes = sharding.reshard(batch, targets)
  return batch, {"rollout_to_trainer": batch_bytes, "guidance": guidance_bytes}
