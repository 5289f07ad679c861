"""What a run prints: the progress bars, our own log lines and every warning; the rest to a file.

Libraries (orbax above all: its options and every step of a save) log at INFO through the same
absl logger as this package does, so records are told apart by the file that logged them.
`setup_logging(workdir)` (called by main.py) keeps on the console the records of `trace_jax` and
`pallas_kernels` and anything at WARNING or above, written through `tqdm.write` so that they
land above the progress bars instead of inside them, and appends every record at INFO or above
to `<workdir>/log.txt`.
"""

from __future__ import annotations

import logging as py_logging
import os
import sys

from absl import logging
from tqdm import tqdm

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = tuple(os.path.join(_ROOT, package) + os.sep for package in ("trace_jax", "pallas_kernels"))
LOG_FILE = "log.txt"


def for_the_console(record: py_logging.LogRecord) -> bool:
  """Our own records at any level, other libraries' from WARNING on."""
  return record.levelno >= py_logging.WARNING or os.path.abspath(record.pathname).startswith(OURS)


class AboveTheBars:
  """A stream that writes through `tqdm.write`: active progress bars are cleared, the text is
  written, the bars are drawn again below it."""

  def write(self, text: str) -> None:
    tqdm.write(text, file=sys.stderr, end="")

  def flush(self) -> None:
    sys.stderr.flush()

  def close(self) -> None:
    """Nothing to close: absl's handler closes its stream at exit, and stderr is not ours."""


class WorkdirLog(py_logging.Handler):
  """Every record into `<workdir>/log.txt`, held back until the run has created the workdir (a
  refused config leaves no workdir behind)."""

  def __init__(self, workdir: str):
    super().__init__(py_logging.INFO)
    self.setFormatter(logging.PythonFormatter())
    self.path = os.path.join(workdir, LOG_FILE)
    self._held: list[str] = []

  def emit(self, record: py_logging.LogRecord) -> None:
    self._held.append(self.format(record) + "\n")
    if os.path.isdir(os.path.dirname(self.path)):
      # Opened per record: nothing to close, and lines from orbax's saving threads stay whole.
      with open(self.path, "a", encoding="utf-8") as f:
        f.writelines(self._held)
      self._held.clear()


def setup_logging(workdir: str) -> WorkdirLog:
  """INFO logging, split between the console (absl's handler, filtered) and `<workdir>/log.txt`.

  Returns the file handler (attached to the root logger, like absl's handler).
  """
  logging.set_verbosity(logging.INFO)
  console = logging.get_absl_handler()
  console.addFilter(for_the_console)
  console.python_handler.setStream(AboveTheBars())
  log_file = WorkdirLog(workdir)
  py_logging.getLogger().addHandler(log_file)
  return log_file
