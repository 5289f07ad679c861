"""Fixtures shared by the test modules that run the RL loop end to end (train, experiments)."""

import os

# The CUDA plugin of requirements-gpu-compile.txt (deviceless GPU compiles, tests/test_gpu_compile.py)
# refuses to load without a CUDA driver unless told to skip its checks; jax then runs on the CPU.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import pytest  # noqa: E402
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
