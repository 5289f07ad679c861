"""Checkpoints under `<workdir>/checkpoints` with orbax, and resume.

Restores the newest checkpoint that reads back cleanly: a corrupt or half-written one is
reported and skipped (never deleted), so a crash during a save loses at most one interval.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from absl import logging


class CheckpointError(RuntimeError):
  """No checkpoint in the directory could be restored."""


class Checkpointer:
  """Thin wrapper over an orbax CheckpointManager for one pytree of train state."""

  def __init__(self, workdir: str, *, max_to_keep: int = 3):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state, *, force: bool = False) -> None:
    self._manager.save(step, args=ocp.args.StandardSave(state), force=force)

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def restore_latest(self, target):
    """(step, state) from the newest readable checkpoint, or (None, target) when there is none.

    `target` gives the structure, shapes, dtypes and shardings to restore into.
    """
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
    failures = []
    for step in reversed(self.steps()):
      try:
        state = self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
      except Exception as e:  # noqa: BLE001 (any read failure means: try the previous one)
        logging.warning(
          "Checkpoint at step %d in %s is unreadable (%s); trying the previous one.", step, self.directory, e
        )
        failures.append(f"step {step}: {type(e).__name__}: {e}")
        continue
      return step, state
    if failures:
      raise CheckpointError(
        f"No checkpoint in {self.directory} could be restored:\n  " + "\n  ".join(failures) + "\n"
        "Move the directory aside to start afresh (nothing was deleted)."
      )
    return None, target

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def save_tree(path: str, tree) -> None:
  """Write one pytree to `path` (e.g. cached SFT parameters shared by several runs)."""
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.abspath(path), tree)


def load_tree(path: str, target):
  """Read a pytree written by `save_tree`, into the structure of `target`."""
  abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
  with ocp.StandardCheckpointer() as ckptr:
    return ckptr.restore(os.path.abspath(path), abstract)
