"""Fixtures shared by the test modules that run the RL loop end to end (train, experiments)."""

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
  """An on-disk compilation cache for this module (unless the user runs with their own)."""
  if jax.config.jax_compilation_cache_dir:
    yield jax.config.jax_compilation_cache_dir
    return
  path = str(tmp_path_factory.mktemp("xla_cache"))
  min_secs = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
  compilation_cache.set_cache_dir(path)
  compilation_cache.reset_cache()  # re-read the setting even if earlier tests compiled already
  yield path
  jax.config.update("jax_compilation_cache_dir", None)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_secs)
  compilation_cache.reset_cache()
