"""Checkpoints under `<workdir>/checkpoints` with orbax, and resume.

Restores the newest checkpoint that reads back cleanly: a corrupt or half-written one is
reported and moved aside to `<workdir>/checkpoints.unreadable` (never deleted), so that the
resumed run can save that step again and a crash during a save loses at most one interval.
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
    if self._manager.save(step, args=ocp.args.StandardSave(state), force=force):
      logging.info("Checkpoint of step %d: %s", step, os.path.join(self.directory, str(step)))

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
        failures.append((step, f"step {step}: {type(e).__name__}: {e}"))
        continue
      if failures:
        self._set_aside([bad for bad, _ in failures])
      return step, state
    if failures:
      raise CheckpointError(
        f"No checkpoint in {self.directory} could be restored:\n  " + "\n  ".join(m for _, m in failures) + "\n"
        "Move the directory aside to start afresh (nothing was deleted)."
      )
    return None, target

  def restore(self, step: int, target):
    """The checkpoint of `step`, into the structure, shapes and shardings of `target`."""
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
    try:
      return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
    except Exception as e:  # noqa: BLE001 (any read failure: say which checkpoint)
      raise CheckpointError(f"The checkpoint of step {step} in {self.directory} is unreadable: {e}") from e

  def _set_aside(self, steps: list[int]) -> None:
    """Move unreadable checkpoints out of the manager's directory: the resumed run saves those
    steps again, which orbax refuses while a directory of that step exists."""
    aside = self.directory + ".unreadable"
    if jax.process_index() == 0:
      os.makedirs(aside, exist_ok=True)
      for step in steps:
        target, n = os.path.join(aside, str(step)), 0
        while os.path.exists(target):
          n += 1
          target = os.path.join(aside, f"{step}.{n}")
        os.rename(os.path.join(self.directory, str(step)), target)
        logging.warning("Moved the unreadable checkpoint of step %d to %s.", step, target)
    if jax.process_count() > 1:
      ocp.multihost.sync_global_processes("trace_jax_checkpoint_set_aside")
    self._manager.reload()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def save_tree(path: str, tree, *, force: bool = False) -> None:
  """Write one pytree to `path` (e.g. cached SFT parameters shared by several runs).

  force: replace what is there (else an existing `path` is an error).
  """
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.abspath(path), tree, force=force)


def load_tree(path: str, target):
  """Read a pytree written by `save_tree`, into the structure of `target`."""
  abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
  with ocp.StandardCheckpointer() as ckptr:
    return ckptr.restore(os.path.abspath(path), abstract)
