"""The suite's settings (LLVM -O0 for its CPU programs, one compilation cache, the longest files first under
pytest-xdist) and the fixtures that test modules share."""

import os

# The CUDA plugin of requirements-gpu-compile.txt (deviceless GPU compiles, tests/test_gpu_compile.py)
# refuses to load without a CUDA driver unless told to skip its checks; jax then runs on the CPU.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

# The suite's programs are tiny, and about half of its time is XLA compiling them (a profile of two
# tests/test_train.py tests: 50 of 105 s); LLVM at -O0 compiles them sooner (tests/test_train.py alone, one
# process, one run each: 203 s against 229 s). The source under test is the same; the compiled code is not, and
# sums can differ in the last bits (tests/sharding_worker.py: 6e-8). Set before jax creates its client (it
# reads XLA_FLAGS then), so every xdist worker and every subprocess that a test starts inherits it. The flag
# holds for every XLA backend, and the Triton kernels' SASS depends on it, so it is left off where the GPU
# runs the kernel tests (TRACE_PALLAS_INTERPRET=0: pallas_kernels/lab/gpu_check.py) or a GPU is present, and the
# deviceless GPU compiles' children drop it (tests/test_gpu_compile.py). A user's own level is left alone;
# checks that need the default level ask for it per program (tests/sharding_worker.py's jit_default).
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"
_GPU = os.environ.get("TRACE_PALLAS_INTERPRET") == "0" or os.path.exists("/dev/nvidiactl")
if not _GPU and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAG}".strip()

import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

_SESSION_CACHE = "TRACE_JAX_TEST_XLA_CACHE"  # set by the process that made the session's cache


def pytest_configure(config):
  """pytest-xdist hands out files in our order (pytest_collection_modifyitems), not by their count of tests.
  One on-disk XLA compilation cache for the session, made before pytest-xdist starts its workers
  (they and every subprocess inherit it through JAX_COMPILATION_CACHE_DIR): test modules compile
  many of the same programs (the tiny configs' steps), and each would otherwise compile them again.
  A user's own JAX_COMPILATION_CACHE_DIR is left alone."""
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return
  path = tempfile.mkdtemp(prefix="trace_jax_xla_cache_")
  os.environ.update({"JAX_COMPILATION_CACHE_DIR": path, _SESSION_CACHE: path})
  min_secs = os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
  jax.config.update("jax_compilation_cache_dir", path)  # this process imported jax already
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_secs))


# The test files that take longest (the README's command on 2 cores, --durations, 2026-12-05: 405, 214 and 201 s
# for the first three), longest first.
_LONGEST_FIRST = (
  "test_experiments.py",
  "test_sm90_programs.py",  # two child processes compiling for sm_90a, ~6 min of one core: early, not last
  "test_sharding.py",
  "test_train.py",
  "test_outcome.py",  # the regime and outcome smoke runs, ~4.5 min of one core
  "test_vocab_mask.py",
  "test_rollout.py",
  "test_gpu_compile.py",
  "test_long_tasks.py",
  "test_benchmarks.py",
  "test_qwen3_5.py",
  "test_pretrained.py",
  "test_async_rl.py",
  "test_model.py",
)


def pytest_collection_modifyitems(config, items):
  """The longest files first, the rest in their usual order. With `-n 2 --dist loadfile` (the README's
  command) each worker takes the next file when it is free: started last, a long file leaves the other
  worker idle at the end. A file's own tests keep their order (the sort is stable)."""
  rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_unconfigure(config):
  path = os.environ.get(_SESSION_CACHE)
  if path and not hasattr(config, "workerinput"):  # the process that made it (not an xdist worker)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def xla_cache():
  """The on-disk compilation cache (the session's, see pytest_configure, or the user's own): for tests
  that hand it to the subprocesses they start."""
  return jax.config.jax_compilation_cache_dir


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """A module's tfds data folder: the tasks' array_record files are built there once per module."""
  return str(tmp_path_factory.mktemp("tfds"))


@pytest.fixture
def no_eval(monkeypatch):
  """Stubs the end-of-run greedy evaluation for runs whose figures do not need it."""
  from tests.tiny import skip_evaluation

  skip_evaluation(monkeypatch)
