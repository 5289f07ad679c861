"""Kernel time on the device, from a profiler trace, next to the wall-clock time of the same calls.

A wall-clock median of `jax.block_until_ready(f(*args))` holds the dispatch, the launches and the
wait besides the kernels; at tens of microseconds per kernel that is no small part (on an H200,
XLA's bf16 dot timed that way came to 1.9 TB/s at M = 1, K = N = 8192: far under HBM's 4.8). So
`measure` runs the calls again under `jax.profiler.trace` and sums the durations of the kernels that
the GPU's streams ran (CUPTI's events in the Perfetto trace that the profiler writes): per call, per
kernel name, and in all. `RowLog` keeps a diagnostic's rows through a kernel that hangs.

  m = measure(f, args, reps=20)     # Measurement(wall_us, device_us, kernels={name: us per call})

On a CPU there is no device stream: device_us is None and kernels is empty (`parse_trace` is
tested on a CPU trace and on a hand-made GPU one). Each call's kernels are counted once: the
trace's "XLA Ops" / "XLA Modules" lines, which span the same kernels again, are left out.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import faulthandler
import glob
import gzip
import json
import os
import statistics
import tempfile
import time

import jax


@dataclasses.dataclass(frozen=True)
class Measurement:
  wall_us: float  # median over reps of one call, dispatch to block_until_ready
  device_us: float | None  # kernel time per call on the device's streams (None: no device stream)
  kernels: dict[str, float]  # per kernel name, us per call
  lines: dict[str, float]  # every line of the trace ("process | thread"), us per call: to check what was counted


def _is_stream(process: str, thread: str) -> bool:
  """A GPU's kernel stream line of the trace (not its XLA Ops / Modules summaries, not the host)."""
  return process.startswith("/device:GPU") and thread.lower().startswith("stream")


def parse_trace(events: list[dict], reps: int) -> tuple[float | None, dict[str, float], dict[str, float]]:
  """(device us per call, {kernel: us per call}, {"process | thread": us per call}) from a Chrome /
  Perfetto trace's events: complete events ("X") on a GPU's stream lines, their durations (us)
  summed and divided by reps; and every line's total, counted or not."""
  processes, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      processes[e["pid"]] = e.get("args", {}).get("name", "")
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
  per_kernel, per_line = collections.Counter(), collections.Counter()
  found = False
  for e in events:
    if e.get("ph") != "X":
      continue
    process, thread = processes.get(e.get("pid"), ""), threads.get((e.get("pid"), e.get("tid")), "")
    per_line[f"{process} | {thread}"] += float(e.get("dur", 0.0)) / reps
    if _is_stream(process, thread):
      found = True
      per_kernel[e.get("name", "?")] += float(e.get("dur", 0.0))
  kernels = {name: us / reps for name, us in per_kernel.items()}
  return (sum(kernels.values()) if found else None), kernels, dict(per_line)


def _trace_events(directory: str) -> list[dict]:
  [path] = glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"), recursive=True)
  trace = json.load(gzip.open(path))
  return trace["traceEvents"] if isinstance(trace, dict) else trace


def measure(fn, args, *, reps: int = 20, profile_reps: int = 5) -> Measurement:
  """fn(*args) timed by wall clock (median of reps, after a warm-up) and by the device's kernels
  (profile_reps more calls under the profiler)."""
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  walls = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    walls.append(time.perf_counter() - t)
  with tempfile.TemporaryDirectory() as directory:
    with jax.profiler.trace(directory, create_perfetto_trace=True):
      for _ in range(profile_reps):
        jax.block_until_ready(fn(*args))
    device_us, kernels, lines = parse_trace(_trace_events(directory), profile_reps)
  return Measurement(statistics.median(walls) * 1e6, device_us, kernels, lines)


class RowLog:
  """The rows of a GPU diagnostic, rewritten to `path` (JSON) after each, that survives a kernel that
  hangs: a hung kernel cannot be interrupted from Python, so `row` ends the process after `row_s`
  (faulthandler, with a traceback) and leaves the row in progress in `<path>.pending`. A rerun with
  resume=True keeps the rows so far, records that one with an "error" ("no result: ..."), and `done` skips
  both; pallas_kernels/lab/gpu_check.py reruns while its stage has time left.

    log = RowLog(f"{out}/rows.json", resume=os.environ.get("RESUME") == "1", row_s=45)
    if not log.done(key):
      with log.row(dict(name=..., M=...)) as row:
        row["device_us"] = ...
  """

  def __init__(self, path: str, *, resume: bool = False, row_s: float = 45, key=lambda row: row["name"]):
    self.path, self.pending, self.row_s, self.key = path, pending_path(path), row_s, key
    self.rows = []
    if resume:
      self.rows = json.load(open(path)) if os.path.exists(path) else []
      if os.path.exists(self.pending):
        hung = json.load(open(self.pending))
        error = f"no result: the process ended during this row (a hang past {row_s} s, or a crash)"
        self.rows.append(dict(hung, error=error))
        self._write()  # now, in case the next row hangs too
        os.remove(self.pending)
    elif os.path.exists(self.pending):
      os.remove(self.pending)
    self._done = {key(r) for r in self.rows}

  def done(self, key) -> bool:
    return key in self._done

  def _write(self):
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.rows, f, indent=1)
    os.replace(tmp, self.path)

  @contextlib.contextmanager
  def row(self, row: dict):
    """Yields `row` to fill in; an exception inside becomes its "error" (a variant that fails is a finding,
    not the end of the run). The row is written when the block ends, or as hung by a rerun."""
    with open(self.pending, "w") as f:
      json.dump(row, f)
    faulthandler.dump_traceback_later(self.row_s, exit=True)
    try:
      yield row
    except Exception as e:
      row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    finally:
      faulthandler.cancel_dump_traceback_later()
    self.rows.append(row)
    self._done.add(self.key(row))
    print(json.dumps(row), flush=True)
    self._write()
    os.remove(self.pending)


def pending_path(path: str) -> str:
  """Where RowLog(path) keeps the row in progress."""
  return path + ".pending"
