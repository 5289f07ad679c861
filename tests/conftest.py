"""Fixtures shared by the test modules that run the RL loop end to end (train, experiments)."""

import os

# The CUDA plugin of requirements-gpu-compile.txt (deviceless GPU compiles, tests/test_gpu_compile.py)
# refuses to load without a CUDA driver unless told to skip its checks; jax then runs on the CPU.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

_SESSION_CACHE = "TRACE_JAX_TEST_XLA_CACHE"  # set by the process that made the session's cache


def pytest_configure(config):
  """One on-disk XLA compilation cache for the session, made before pytest-xdist starts its workers
  (they and every subprocess inherit it through JAX_COMPILATION_CACHE_DIR): test modules compile
  many of the same programs (the tiny configs' steps), and each would otherwise compile them again.
  A user's own JAX_COMPILATION_CACHE_DIR is left alone."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return
  path = tempfile.mkdtemp(prefix="trace_jax_xla_cache_")
  os.environ.update({"JAX_COMPILATION_CACHE_DIR": path, _SESSION_CACHE: path})
  min_secs = os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
  jax.config.update("jax_compilation_cache_dir", path)  # this process imported jax already
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_secs))


def pytest_unconfigure(config):
  path = os.environ.get(_SESSION_CACHE)
  if path and not hasattr(config, "workerinput"):  # the process that made it (not an xdist worker)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def xla_cache():
  """The on-disk compilation cache (the session's, see pytest_configure, or the user's own): for tests
  that hand it to the subprocesses they start."""
  return jax.config.jax_compilation_cache_dir
