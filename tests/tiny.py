"""The tiny model of the tests: `tiny_model()` for the unit tests, and the config overrides (TINY)
shared by the tests that run the RL loop end to end (train, experiments)."""

import dataclasses

from configs import default, models
from trace_jax.config import ModelConfig, model_config


def tiny_model(**overrides) -> ModelConfig:
  """The `tiny` preset of configs/models.py at 2 layers (vocab 64, hidden 64, 4 heads / 2 KV heads
  of 32, 8 experts of 32, top-2, RoPE theta 1e4), with `overrides` (ModelConfig fields) applied.

  A test names here only what it needs to differ (e.g. a larger `initializer_range` for decisive
  routing), so every test module starts from the same model.
  """
  return dataclasses.replace(model_config(models.tiny()), **{"num_layers": 2, **overrides})


# configs/default.py's smallest run (SMOKE: the smallest model NVFP4 applies to, 2 layers so that TRACE guides
# one and measures the other), with a KL anchor, 8 new tokens, 4 steps, checkpoints at 0, 2, 4, eval at 4.
TINY = {
  **default.SMOKE,
  "rl.kl_coef": 0.05,  # a KL anchor, so that resuming must restore the reference policy too
  "rollout.max_new_tokens": 8,
  "steps": 4,
  "checkpoint_every": 2,
  "eval_every": 4,
  "eval_prompts": 8,
  "data.num_train": 500,
  "data.num_test": 50,
  # the agreement diagnostics on every step: one engine and one trainer program per mode (the default
  # cadence compiles a second pair; test_diagnostics_every covers it)
  "trace.diagnostics_every": 1,
}


def skip_evaluation(mp) -> None:
  """Stubs the end-of-run greedy evaluation (train.evaluate) on a pytest MonkeyPatch."""
  from trace_jax import train

  mp.setattr(train, "evaluate", lambda *args, **kwargs: 0.0)
