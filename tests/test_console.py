"""What a run prints (trace_jax.console, set up by main.py): our records and every warning on the
console, above the progress bars; every record in <workdir>/log.txt. The real run's console is
checked in test_train (the SIGTERM test runs `python -m trace_jax.main`)."""

import logging as py_logging
import os
import re
import sys

import pytest
from absl import flags, logging
from tqdm import tqdm

from trace_jax import console

OURS = os.path.join(console.OURS[0], "checkpoint.py")
ORBAX = os.path.join(os.sep, "site-packages", "orbax", "checkpoint", "checkpoint_manager.py")


def record(path, level=py_logging.INFO, message="hello"):
  return py_logging.LogRecord("absl", level, path, 1, message, (), None)


def test_the_console_keeps_our_records_and_every_warning():
  assert console.for_the_console(record(OURS))
  assert console.for_the_console(record(os.path.join(console.OURS[1], "__init__.py")))
  assert not console.for_the_console(record(ORBAX))
  assert not console.for_the_console(record(__file__))  # the tests are not the package
  assert console.for_the_console(record(ORBAX, py_logging.WARNING))


@pytest.fixture
def absl_console():
  """absl's handler on the root logger and the flags parsed, as in app.run (before flag parsing
  absl writes to stderr directly); everything setup_logging changes is put back afterwards."""
  handler, root = logging.get_absl_handler(), py_logging.getLogger()
  stream, verbosity, installed = handler.python_handler.stream, logging.get_verbosity(), handler in root.handlers
  parsed = flags.FLAGS.is_parsed()
  if not parsed:
    flags.FLAGS.mark_as_parsed()
  if not installed:
    root.addHandler(handler)
  before = list(root.handlers)
  yield handler
  handler.removeFilter(console.for_the_console)
  handler.python_handler.setStream(stream)
  for added in set(root.handlers) - set(before):
    root.removeHandler(added)
  if not installed:
    root.removeHandler(handler)
  logging.set_verbosity(verbosity)
  if not parsed:
    flags.FLAGS.unparse_flags()


def test_setup_logging_splits_console_and_log_file(absl_console, tmp_path, capsys):
  workdir = tmp_path / "run"
  log = logging.get_absl_logger()
  console.setup_logging(str(workdir))
  with tqdm(total=2, desc="rl", file=sys.stderr) as bar:
    log.handle(record(ORBAX, message="CheckpointManagerOptions(...)"))
    log.handle(record(OURS, message="Starting a new run"))
    bar.update()
    assert not workdir.exists()  # the records wait for the run to create its workdir
    workdir.mkdir()
    log.handle(record(ORBAX, py_logging.WARNING, message="orbax warns"))
  err = capsys.readouterr().err
  lines = re.split(r"[\r\n]", err)
  assert "CheckpointManagerOptions" not in err
  # whole absl lines, not appended to the progress bar
  assert any(re.match(r"I\d{4} .*checkpoint\.py:1\] Starting a new run$", line) for line in lines), err
  assert any(re.match(r"W\d{4} .*checkpoint_manager\.py:1\] orbax warns$", line) for line in lines), err
  text = (workdir / console.LOG_FILE).read_text()
  messages = [line.split("] ", 1)[1] for line in text.splitlines()]
  assert messages == ["CheckpointManagerOptions(...)", "Starting a new run", "orbax warns"]


def test_no_cuda_plugin_traceback_on_a_machine_without_a_gpu():
  """With requirements-gpu-compile.txt's CUDA plugin installed and no GPU, jax's first backend lookup logs an
  ERROR traceback unless the CPU platform is asked for: importing trace_jax asks for it (before or after
  `import jax`), and jax still runs on the CPU."""
  import importlib.util
  import subprocess

  import trace_jax

  if importlib.util.find_spec("jax_plugins.xla_cuda12") is None or any(
    map(os.path.exists, trace_jax._ACCELERATOR_NODES)
  ):
    pytest.skip("needs the CUDA plugin installed and no accelerator")
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")}
  for first, then in (("import trace_jax", "import jax"), ("import jax", "import trace_jax")):
    code = f"{first}; {then}; print(jax.devices()[0].platform)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "cpu", done.stderr
    assert "Traceback" not in done.stderr and "plugin configuration error" not in done.stderr, done.stderr
