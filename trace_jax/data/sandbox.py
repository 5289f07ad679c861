"""Run untrusted Python programs against assert tests, for code-execution rewards.

    result = run("def f(x):\\n  return x + 3\\n", "assert f(1) == 4\\nassert f(2) == 5")
    result.status, result.passed_tests, result.total_tests   # "ok", 2, 2
    results = run_batch(codes, tests, timeout_s=2.0)         # a bounded pool, results in input order
    rewards = code_reward(results, partial_credit=True)      # 1.0 if passed, else passed/total (or 0)

Tests. `tests` is Python source. Each top-level `assert` statement (parsed with `ast`) is one test;
the other top-level statements (imports, helper definitions, assignments: MBPP's test_setup_code)
are setup, run in order without being counted. A block with no top-level assert (HumanEval's
`def check(candidate): ...` followed by `check(f)`) is a single test that passes when the block
runs without an exception. The code runs once, then the tests one at a time in its namespace, so
a failing or crashing test does not hide the others and partial credit can be counted.

Statuses: "ok" (every test passed), "failed" (some test failed), "timeout" (wall-clock or CPU
time), "memory" (MemoryError or the address-space limit), "crashed" (the code raised at
definition time, SystemExit included, or the process died by a signal or exited before the tests
finished), "refused" (not run: a syntax error, a NUL byte, or more than max_code_bytes). Tests
that reported a pass before a timeout or crash still count in passed_tests (partial credit);
`passed` is True only for "ok".

What it does, per program:
  - A separate process, `python -I -S` (no site-packages, no PYTHON* variables, no user site,
    nothing on sys.path but the stdlib), started in a new session. The environment is replaced
    by PATH, LC_ALL and HOME (the working directory; sh adds PWD): nothing of the caller's
    environment leaks.
  - Where `unshare` works (checked once; as root, or unprivileged with user namespaces) the program
    runs in new network, PID and mount namespaces under a /bin/sh that is the namespace's init:
    no network interface but a down loopback, no view of (or signal to) processes outside, and
    when the process group is killed every process of the namespace dies with it, however it
    forked. In the mount namespace, tmpfs are mounted over /root, /home, /tmp, /var/tmp,
    /dev/shm, /run/lock, /mnt, /media, /srv and the repository (the Python installation is bound
    back read-only where it lives under one of them), and the working directory is a fresh
    size-limited tmpfs; files written there or under /tmp vanish with the namespace.
  - When the caller is root, the program drops to uid/gid 65534 (nobody) before running user
    code: it cannot write to root's files, read root's private files or signal root's processes,
    and RLIMIT_NPROC (which Linux does not enforce for root) is enforced, which bounds a fork bomb.
  - rlimits: CPU time (SIGXCPU), address space (MemoryError), file size, open files, process
    count, no core files; the program runs at nice 10 so that a batch does not starve the trainer.
  - A wall-clock timeout (counted from the moment user code starts) kills the whole process
    group (os.killpg SIGKILL), and the process group is killed after every run anyway.
  - Output: sys.stdout/sys.stderr keep at most max_output_bytes each; the parent reads at most
    max_output_bytes of raw output in all and then closes the pipes (writes get EPIPE).
  - Python-level guards (after the OS setup, before user code): socket creation raises
    PermissionError; os.fork/exec*/spawn*/system/popen/posix_spawn/kill/killpg/setsid and
    signal.pthread_kill raise PermissionError; ctypes, subprocess, multiprocessing and pty cannot
    be imported.
  - Results: the runner reports each test on a pipe that the parent created, as JSON lines
    carrying a random nonce, so printing "all tests passed", faking JSON on stdout or calling
    sys.exit(0)/os._exit(0) before the tests earns nothing.

What it does not protect against (it is NOT a security boundary against a determined attacker):
  - The user code runs in the runner's own interpreter: it can find the nonce and the result pipe
    by frame or gc introspection and forge passes, or return an object whose __eq__ is always True
    (`assert f(x) == y` then passes). These are reward hacks an RL policy could in principle find;
    rely on the sandbox for safety from accidents and crude hostility, not for a tamper-proof score.
  - There is no seccomp filter: the Python guards can be bypassed from Python (e.g. by loading a
    builtin module afresh) and then only the OS layers remain; without namespaces (no `unshare`,
    or namespaces=False) and without root, a bypassing program can kill the caller's other
    processes, leave processes behind that left the process group, and fork without a bound
    beyond RLIMIT_NPROC of the user.
  - Files outside the hidden directories stay readable where their permissions allow (/etc, /usr,
    /proc, /sys, data directories elsewhere); the file system is not isolated beyond that. Without
    root and without namespaces the program can write wherever the caller can.
  - Unix-domain sockets on the file system are reachable if their permissions allow (the guards
    block socket creation from Python, the network namespace does not cover them).
  - Resource use is bounded per process (memory, CPU) and in number of processes only when
    RLIMIT_NPROC is enforced (not root, or uid dropped); there is no cgroup.

isolation() says what this machine provides (it runs one trivial program and reads back what the
runner set up); every SandboxResult carries the same description for its own run.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import functools
import hmac
import inspect
import json
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

STATUSES = ("ok", "failed", "timeout", "memory", "crashed", "refused")
NOBODY = 65534  # uid and gid the program drops to when the caller is root
RUNNER_MARKER = "trace-sandbox-runner"  # in every sandboxed process's command line (tests look for leftovers)
_REPO_ROOT = str(Path(__file__).resolve().parents[2])
_DEFAULT_HIDE = ("/root", "/home", "/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/mnt", "/media", "/srv")
_STDERR_TAIL = 2000  # characters of stderr kept in a result
_RESULT_BYTES = 1 << 20  # the most the parent reads from the result pipe
_SH_WRAPPER = '"$0" "$@"; exit $?'  # sh stays the namespace's init: signals to python act as usual


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Resource limits and isolation switches of one sandboxed program.

  cpu_s: the CPU-time limit (RLIMIT_CPU, rounded up to whole seconds); None: timeout_s.
  memory_mb: the address-space limit (RLIMIT_AS); Python raises MemoryError beyond it.
  file_size_mb: the largest file the program may write (RLIMIT_FSIZE); disk_mb: the size of the
    working-directory tmpfs (namespaces only).
  open_files: RLIMIT_NOFILE. processes: RLIMIT_NPROC (enforced only for a non-root uid: the uid is
    dropped when the caller is root, otherwise it is the caller's own count).
  max_code_bytes: longer programs are refused. max_output_bytes: output kept per stream, and the
    most raw output the parent reads.
  startup_s: the time allowed for the interpreter to start before user code runs (not part of
    timeout_s, which counts from the first line of user code).
  namespaces, drop_privileges, python_guards: switch off an isolation layer (for tests and for
    machines where a layer misbehaves); hide_dirs: directories covered by an empty tmpfs (None:
    the default list and the repository).
  """

  cpu_s: float | None = None
  memory_mb: int = 512
  file_size_mb: int = 16
  disk_mb: int = 64
  open_files: int = 64
  processes: int = 64
  max_code_bytes: int = 64 * 1024
  max_output_bytes: int = 64 * 1024
  startup_s: float = 10.0
  nice: int = 10
  namespaces: bool = True
  drop_privileges: bool = True
  python_guards: bool = True
  hide_dirs: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """The outcome of one program: status (one of STATUSES), test counts and diagnostics.

  passed: status == "ok". passed_tests counts the tests the runner reported as passed (also before
  a timeout or crash). detail: a one-line explanation (the first failure, the signal, ...).
  stderr_tail: the end of the program's stderr (tracebacks of failed tests are written there).
  isolation: the layers that were in place for this run.
  """

  passed: bool
  passed_tests: int
  total_tests: int
  status: str
  stderr_tail: str
  wall_s: float
  detail: str = ""
  returncode: int | None = None
  output_truncated: bool = False
  isolation: str = ""

  @property
  def score(self) -> float:
    """passed_tests / total_tests (0 when there are no tests)."""
    return self.passed_tests / self.total_tests if self.total_tests else 0.0


def code_reward(results: Sequence[SandboxResult], partial_credit: bool = False) -> np.ndarray:
  """float32 rewards: 1.0 if a program passed, else passed/total with partial_credit, else 0."""
  rewards = [1.0 if r.passed else (r.score if partial_credit else 0.0) for r in results]
  return np.asarray(rewards, dtype=np.float32)


def default_workers() -> int:
  """The default pool size of run_batch: min(4, the CPUs this process may use)."""
  try:
    cpus = len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    cpus = os.cpu_count() or 1
  return max(1, min(4, cpus))


def split_tests(tests: str) -> tuple[tuple[str, bool], ...]:
  """The test source as (statement source, counted) chunks: each top-level assert is counted.

  A source with no top-level assert is one counted chunk. Raises ValueError when the tests do
  not parse or are empty (a data error, not the program's fault).
  """
  if not isinstance(tests, str):
    raise TypeError(f"tests must be Python source (str), got {type(tests).__name__}")
  return _split_tests(tests)


@functools.lru_cache(maxsize=4096)  # a GRPO group shares its tests
def _split_tests(tests: str) -> tuple[tuple[str, bool], ...]:
  try:
    tree = ast.parse(tests)
  except (SyntaxError, ValueError) as e:
    raise ValueError(f"the tests do not parse: {e}") from None
  if not tree.body:
    raise ValueError("the tests contain no statement")
  if not any(isinstance(node, ast.Assert) for node in tree.body):
    return ((tests, True),)
  return tuple((ast.unparse(node), isinstance(node, ast.Assert)) for node in tree.body)


def count_tests(tests: str) -> int:
  """How many tests `tests` holds (see split_tests)."""
  return sum(counted for _, counted in split_tests(tests))


# --- the child ------------------------------------------------------------------------------


def _runner() -> None:  # pragma: no cover - its source runs in the sandboxed child
  """The sandboxed child's program (passed with -c): set up the isolation, run the code and tests.

  argv: -c MARKER PAYLOAD_FILE. Everything it needs after user code starts is bound to locals
  first, so that user code replacing os.write, json.dumps or builtins does not change reporting.
  """
  import _socket
  import builtins
  import json
  import os
  import posix
  import resource
  import signal
  import socket
  import sys
  import traceback

  with open(sys.argv[2], "rb") as f:
    payload = json.loads(f.read())
  os.unlink(sys.argv[2])
  nonce, result_fd = payload["nonce"], payload["fd"]
  write, dumps, exit_now = os.write, json.dumps, os._exit
  run_exec, run_compile, type_of, is_instance = builtins.exec, builtins.compile, type, isinstance

  def report(**record):
    record["n"] = nonce
    try:
      write(result_fd, (dumps(record) + "\n").encode())
    except BaseException:
      pass

  def describe(exc):
    try:
      text = f"{type_of(exc).__name__}: {exc}"
    except BaseException:
      text = type_of(exc).__name__
    return text[:300]

  def to_stderr(exc):
    try:
      text = "".join(traceback.format_exception(exc))[-4000:]
      write(2, text.encode("utf-8", "backslashreplace"))
    except BaseException:
      pass

  notes, hidden = [], []

  def mount_all(hide, keep, workdir, disk_mb, uid):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    nosuid_nodev, rdonly, remount, bind, rec = 2 | 4, 1, 32, 4096, 16384

    def mount(source, target, fstype, flags, data):
      enc = lambda s: None if s is None else s.encode()  # noqa: E731
      if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)

    keep_fds = [(path, os.open(path, os.O_PATH)) for path in keep if os.path.isdir(path)]
    for path, mode in hide:
      try:
        mount("tmpfs", path, "tmpfs", nosuid_nodev, f"size=16m,nr_inodes=4096,mode={mode}")
        hidden.append(path)
      except OSError as e:
        notes.append(f"hide {path}: {e.strerror}")
    for path, fd in keep_fds:
      if any(path == h or path.startswith(h.rstrip("/") + "/") for h in hidden):
        os.makedirs(path, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, bind | rec, None)
        mount(None, path, None, bind | remount | rdonly | nosuid_nodev, None)
      os.close(fd)
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    os.makedirs(workdir, exist_ok=True)
    mount("tmpfs", workdir, "tmpfs", nosuid_nodev, f"size={disk_mb}m,nr_inodes=4096,mode=700{owner}")
    os.chdir(workdir)
    notes.append("workdir tmpfs")

  if payload["mount"]:
    try:
      mount_all(payload["hide"], payload["keep"], payload["workdir"], payload["disk_mb"], payload["uid"])
    except Exception as e:
      notes.append(f"mount failed: {e}")
  for name, (soft, hard) in payload["rlimits"].items():
    try:
      resource.setrlimit(getattr(resource, name), (soft, hard))
    except (ValueError, OSError) as e:
      notes.append(f"{name}: {e}")
  try:
    os.nice(payload["nice"])
  except OSError:
    pass
  uid = payload["uid"]
  if uid is not None and os.getuid() == 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)

  class Bounded:
    """sys.stdout/sys.stderr that keep at most `budget` bytes and drop the rest."""

    encoding, errors = "utf-8", "backslashreplace"

    def __init__(self, fd, budget):
      self.fd, self.left = fd, budget

    def write(self, text):
      data = str(text).encode("utf-8", "backslashreplace")
      if self.left > 0:
        chunk, self.left = data[: self.left], self.left - min(len(data), self.left)
        try:
          while chunk:
            chunk = chunk[write(self.fd, chunk) :]
        except OSError:
          self.left = 0
      return len(text)

    def writelines(self, lines):
      for line in lines:
        self.write(line)

    def flush(self):
      pass

    def isatty(self):
      return False

    def writable(self):
      return True

    def fileno(self):
      return self.fd

  sys.stdout, sys.stderr = Bounded(1, payload["max_output"]), Bounded(2, payload["max_output"])

  if payload["guards"]:

    def denied(*args, **kwargs):
      raise PermissionError("blocked by the trace_jax sandbox")

    class NoSocket:
      def __init__(self, *args, **kwargs):
        raise PermissionError("sockets are blocked by the trace_jax sandbox")

    for module in (socket, _socket):
      for name in ("socket", "SocketType"):
        if hasattr(module, name):
          setattr(module, name, NoSocket)
      for name in ("socketpair", "fromfd", "create_connection", "create_server", "getaddrinfo", "gethostbyname"):
        if hasattr(module, name):
          setattr(module, name, denied)
    process_calls = (
      "fork forkpty system popen execv execve execl execle execlp execlpe execvp execvpe spawnl spawnle spawnlp "
      "spawnlpe spawnv spawnve spawnvp spawnvpe posix_spawn posix_spawnp kill killpg setsid setpgid setpgrp "
      "pidfd_open"
    ).split()
    for module in (os, posix):
      for name in process_calls:
        if hasattr(module, name):
          setattr(module, name, denied)
    for name in ("pthread_kill", "pidfd_send_signal"):
      if hasattr(signal, name):
        setattr(signal, name, denied)
    for name in ("ctypes", "_ctypes", "subprocess", "_posixsubprocess", "multiprocessing", "_multiprocessing", "pty"):
      sys.modules[name] = None

  code, chunks, guards = payload["code"], payload["chunks"], payload["guards"]
  del payload
  namespace = {"__name__": "solution", "__builtins__": builtins}
  reserve = [bytearray(1 << 20)]  # released on MemoryError so that reporting it can allocate
  report(start=True, uid=os.getuid(), hidden=hidden, guards=guards, notes=notes)
  try:
    run_exec(run_compile(code, "solution.py", "exec"), namespace)
  except BaseException as exc:
    memory = is_instance(exc, MemoryError)
    if memory:
      reserve.clear()
      namespace.clear()
    report(define=describe(exc), memory=memory)
    to_stderr(exc)
    exit_now(1)
  index = 0
  for source, counted in chunks:
    try:
      run_exec(run_compile(source, f"test_{index}.py", "exec"), namespace)
      error, memory = None, False
    except BaseException as exc:
      memory = is_instance(exc, MemoryError)
      if memory:
        reserve.clear()
      error = describe(exc)
      to_stderr(exc)
    if counted:
      report(test=index, ok=error is None, error=error, memory=memory)
      index += 1
    elif error is not None:
      report(setup=error, memory=memory)
  report(done=True)
  exit_now(0)


_RUNNER_SOURCE = textwrap.dedent(inspect.getsource(_runner)) + "\n_runner()\n"


# --- the parent -----------------------------------------------------------------------------


@functools.cache
def _namespace_prefix() -> tuple[tuple[str, ...], bool] | None:
  """The `unshare` command line that works here (and whether it maps a user namespace), or None."""
  unshare = shutil.which("unshare") or next(
    (p for p in ("/usr/bin/unshare", "/bin/unshare") if os.path.exists(p)), None
  )
  if unshare is None or not sys.platform.startswith("linux"):
    return None
  base = ("--net", "--pid", "--fork", "--mount-proc")
  for prefix, userns in (((unshare, *base), False), ((unshare, "--user", "--map-root-user", *base), True)):
    try:
      probe = subprocess.run(
        [*prefix, _sh(), "-c", "exit 0"], env=_child_env("/"), capture_output=True, timeout=20, check=False
      )
    except (OSError, subprocess.SubprocessError):
      continue
    if probe.returncode == 0:
      return prefix, userns
  return None


@functools.cache
def _sh() -> str:
  return shutil.which("sh") or "/bin/sh"


def _child_env(workdir: str) -> dict[str, str]:
  return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": workdir}


def _under(path: str, directory: str) -> bool:
  return path == directory or path.startswith(directory.rstrip("/") + "/")


def _hide_list(limits: SandboxLimits) -> list[tuple[str, str]]:
  """(real path, tmpfs mode) of the directories to hide: never "/", nor one inside another."""
  dirs = limits.hide_dirs if limits.hide_dirs is not None else (*_DEFAULT_HIDE, _REPO_ROOT)
  real = sorted({os.path.realpath(d) for d in dirs if os.path.isdir(d)} - {"/"})
  out = []
  for d in real:
    if not any(_under(d, other) for other, _ in out):
      world_writable = (os.stat(d).st_mode & 0o1777) == 0o1777
      out.append((d, "1777" if world_writable else "755"))
  return out


def _stdlib_readable_by_others(hide: list[tuple[str, str]]) -> bool:
  """Whether uid NOBODY can import the stdlib (checked from the installation down when it is bound
  back under a hidden directory, else from /): pyenv under /root (mode 700) is not, outside a
  mount namespace, and then the uid is not dropped."""
  prefix = os.path.realpath(sys.base_prefix)
  stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
  top = prefix if any(_under(prefix, d) for d, _ in hide) else "/"
  paths = [stdlib, os.path.join(stdlib, "lib-dynload")]
  parent = os.path.dirname(stdlib)
  while _under(parent, top):
    paths.append(parent)
    if parent == top:
      break
    parent = os.path.dirname(parent)
  try:
    return all(os.stat(p).st_mode & 0o005 == 0o005 for p in paths if os.path.exists(p))
  except OSError:
    return False


def _decode_signal(returncode: int | None, namespaced: bool) -> int | None:
  if returncode is None:
    return None
  if returncode < 0:
    return -returncode
  if namespaced and returncode > 128:  # the init sh reports a signal as 128 + n
    return returncode - 128
  return None


def _signal_name(sig: int) -> str:
  try:
    return signal.Signals(sig).name
  except ValueError:
    return f"signal {sig}"


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)  # the child is unreaped until proc.wait, so the group id is ours
  except (ProcessLookupError, PermissionError):
    pass


def _refusal(code: str, limits: SandboxLimits) -> str | None:
  if not isinstance(code, str):
    return f"code must be a str, got {type(code).__name__}"
  size = len(code.encode("utf-8", "surrogatepass"))
  if size > limits.max_code_bytes:
    return f"code is {size} bytes (max_code_bytes={limits.max_code_bytes})"
  try:
    compile(code, "solution.py", "exec", dont_inherit=True)
  except SyntaxError as e:
    return f"SyntaxError: {e.msg} (line {e.lineno})"
  except (ValueError, RecursionError, MemoryError, OverflowError) as e:
    return f"{type(e).__name__}: {e}"
  return None


class _Records:
  """The validated records of one run, parsed from the result pipe."""

  def __init__(self, nonce: str, total: int):
    self.nonce, self.total = nonce, total
    self.buffer = b""
    self.start: dict | None = None
    self.tests: dict[int, bool] = {}
    self.first_failure = ""
    self.define: str | None = None
    self.setup_errors: list[str] = []
    self.memory = False
    self.done = False

  def feed(self, data: bytes) -> None:
    self.buffer += data
    *lines, self.buffer = self.buffer.split(b"\n")
    for line in lines:
      try:
        record = json.loads(line)
      except (ValueError, RecursionError):
        continue
      if not isinstance(record, dict):
        continue
      if not hmac.compare_digest(str(record.get("n", "")).encode("utf-8", "replace"), self.nonce.encode()):
        continue
      self.memory |= bool(record.get("memory"))
      if record.get("start") and self.start is None:
        self.start = record
      elif "test" in record:
        index = record["test"]
        if isinstance(index, int) and 0 <= index < self.total and index not in self.tests:
          self.tests[index] = bool(record.get("ok"))
          if not record.get("ok") and not self.first_failure:
            self.first_failure = f"test {index}: {record.get('error')}"
      elif "define" in record:
        self.define = str(record["define"])
      elif "setup" in record:
        self.setup_errors.append(str(record["setup"]))
      elif record.get("done"):
        self.done = True


def _describe_isolation(namespaced: tuple[tuple[str, ...], bool] | None, start: dict | None, limits) -> str:
  parts = []
  if namespaced is not None:
    parts.append("namespaces: net, pid, mount" + (" (in a user namespace)" if namespaced[1] else ""))
  if start is not None:
    if start.get("hidden"):
      parts.append("tmpfs over " + " ".join(start["hidden"]))
    if "workdir tmpfs" in start.get("notes", []):
      parts.append("tmpfs working directory")
    if start.get("uid") == NOBODY:
      parts.append(f"uid {NOBODY}")
    parts.append("rlimits")
    if start.get("guards"):
      parts.append("python guards")
  else:
    parts.append(
      "rlimits" + (", python guards" if limits.python_guards else "") + " (planned; the runner did not start)"
    )
  return "; ".join(parts)


def run(code: str, tests: str, timeout_s: float = 5.0, *, limits: SandboxLimits | None = None) -> SandboxResult:
  """Run `code` then each test of `tests` in a sandboxed process; see the module docstring.

  Raises ValueError when the tests themselves are bad; everything the program does becomes a
  status.
  """
  limits = limits or SandboxLimits()
  if not timeout_s > 0:
    raise ValueError(f"timeout_s must be positive, got {timeout_s}")
  chunks = split_tests(tests)
  total = sum(counted for _, counted in chunks)
  t0 = time.monotonic()
  reason = _refusal(code, limits)
  if reason is not None:
    return SandboxResult(False, 0, total, "refused", "", time.monotonic() - t0, detail=reason)
  return _execute(code, chunks, total, timeout_s, limits, t0)


def _execute(code, chunks, total, timeout_s, limits, t0) -> SandboxResult:
  namespaced = _namespace_prefix() if limits.namespaces else None
  userns = namespaced is not None and namespaced[1]
  hide = _hide_list(limits) if namespaced is not None else []
  drop = limits.drop_privileges and os.geteuid() == 0 and not userns and _stdlib_readable_by_others(hide)
  uid = NOBODY if drop else None
  cpu_s = max(1, math.ceil(limits.cpu_s if limits.cpu_s is not None else timeout_s))
  mib = 1 << 20
  rlimits = {
    "RLIMIT_CPU": (cpu_s, cpu_s + 1),
    "RLIMIT_AS": (limits.memory_mb * mib, limits.memory_mb * mib),
    "RLIMIT_FSIZE": (limits.file_size_mb * mib, limits.file_size_mb * mib),
    "RLIMIT_NOFILE": (limits.open_files, limits.open_files),
    "RLIMIT_NPROC": (limits.processes, limits.processes),
    "RLIMIT_CORE": (0, 0),
  }
  nonce = secrets.token_hex(16)
  workdir = tempfile.mkdtemp(prefix="trace_sandbox_")
  read_fd, write_fd = os.pipe()
  proc = None
  records = _Records(nonce, total)
  stderr_tail, output_bytes, truncated, timed_out, detail = b"", 0, False, False, ""
  try:
    payload = {
      "nonce": nonce,
      "fd": write_fd,
      "code": code,
      "chunks": [list(c) for c in chunks],
      "mount": namespaced is not None,
      "hide": hide,
      "keep": sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}),
      "workdir": workdir,
      "disk_mb": limits.disk_mb,
      "uid": uid,
      "rlimits": rlimits,
      "nice": limits.nice,
      "guards": limits.python_guards,
      "max_output": limits.max_output_bytes,
    }
    payload_path = os.path.join(workdir, "payload.json")
    fd = os.open(payload_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
      json.dump(payload, f)
    if uid is not None:
      os.chown(workdir, uid, uid)
    argv = [sys.executable, "-I", "-S", "-c", _RUNNER_SOURCE, RUNNER_MARKER, payload_path]
    if namespaced is not None:
      argv = [*namespaced[0], _sh(), "-c", _SH_WRAPPER, *argv]
    try:
      proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=workdir,
        env=_child_env(workdir),
        pass_fds=(write_fd,),
        start_new_session=True,
      )
    except OSError as e:
      return SandboxResult(False, 0, total, "crashed", "", time.monotonic() - t0, detail=f"could not start: {e}")
    finally:
      os.close(write_fd)
      write_fd = -1
    streams = {proc.stdout.fileno(): "out", proc.stderr.fileno(): "err", read_fd: "result"}
    deadline = time.monotonic() + limits.startup_s
    result_bytes = 0
    with selectors.DefaultSelector() as selector:
      for fd in streams:
        selector.register(fd, selectors.EVENT_READ)
      while streams and not records.done:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          timed_out = True
          detail = (
            f"wall-clock timeout after {timeout_s:g} s"
            if records.start is not None
            else f"the interpreter did not start within {limits.startup_s:g} s"
          )
          break
        for key, _ in selector.select(remaining):
          fd = key.fd
          if fd not in streams:  # closed by an earlier event of this round (the output cap)
            continue
          data = os.read(fd, 65536)
          kind = streams[fd]
          if not data:
            selector.unregister(fd)
            del streams[fd]
            continue
          if kind == "result":
            result_bytes += len(data)
            had_start = records.start is not None
            records.feed(data)
            if not had_start and records.start is not None:
              deadline = time.monotonic() + timeout_s
            if result_bytes > _RESULT_BYTES:
              selector.unregister(fd)
              del streams[fd]
            continue
          output_bytes += len(data)
          if kind == "err":
            stderr_tail = (stderr_tail + data)[-4 * _STDERR_TAIL :]
          if output_bytes > limits.max_output_bytes and not truncated:
            truncated = True
            for out_fd in (proc.stdout.fileno(), proc.stderr.fileno()):
              if out_fd in streams:
                selector.unregister(out_fd)
                del streams[out_fd]
            proc.stdout.close()
            proc.stderr.close()
    if not records.done and not timed_out:
      _wait_without_reaping(proc.pid, 2.0)  # the exit status of a program that ended by itself
    _kill_group(proc)  # whatever is left of the group (and, with namespaces, of the namespace)
    try:
      proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
      detail = detail or "the process group did not die after SIGKILL"
    if not proc.stderr.closed:  # what was written before the end (tracebacks), bounded
      stderr_tail = (stderr_tail + _drain(proc.stderr.fileno()))[-4 * _STDERR_TAIL :]
    if not records.done:
      records.feed(_drain(read_fd) + b"\n")
  finally:
    if write_fd >= 0:
      os.close(write_fd)
    if proc is not None:
      if proc.returncode is None:  # an error above, or an unkillable process: do not leave the group running
        _kill_group(proc)
        try:
          proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
          pass
      for stream in (proc.stdout, proc.stderr):
        if stream is not None and not stream.closed:
          stream.close()
    os.close(read_fd)
    shutil.rmtree(workdir, onerror=_force_remove)
  return _result(records, proc, namespaced, limits, timed_out, detail, stderr_tail, truncated, total, t0, cpu_s)


def _wait_without_reaping(pid: int, timeout_s: float) -> None:
  """Wait until `pid` has exited but leave it unreaped, so that its process group id stays ours."""
  end = time.monotonic() + timeout_s
  while time.monotonic() < end:
    try:
      if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
        return
    except ChildProcessError:
      return
    time.sleep(0.005)


def _drain(fd: int, limit: int = 1 << 16, wait_s: float = 0.5) -> bytes:
  """What is left in a pipe (up to `limit` bytes, waiting at most `wait_s` for writers to end)."""
  out = b""
  end = time.monotonic() + wait_s
  with selectors.DefaultSelector() as selector:
    selector.register(fd, selectors.EVENT_READ)
    while len(out) < limit:
      remaining = end - time.monotonic()
      if remaining <= 0 or not selector.select(remaining):
        break
      data = os.read(fd, limit - len(out))
      if not data:
        break
      out += data
  return out


def _force_remove(function, path, _exc_info) -> None:
  """rmtree's error handler: make the directory writable and retry once."""
  try:
    os.chmod(os.path.dirname(path), 0o700)
    function(path)
  except OSError:
    pass


def _result(records, proc, namespaced, limits, timed_out, detail, stderr_tail, truncated, total, t0, cpu_s):
  returncode = proc.returncode if proc is not None else None
  passed_tests = sum(records.tests.values())
  tail = stderr_tail.decode("utf-8", "backslashreplace")[-_STDERR_TAIL:]
  sig = _decode_signal(returncode, namespaced is not None)
  if records.define is not None:
    status = "memory" if records.memory else "crashed"
    detail = f"the code raised at definition time: {records.define}"
  elif records.done:
    if records.memory:
      status = "memory"
    elif passed_tests == total and len(records.tests) == total:
      status = "ok"
    else:
      status = "failed"
    detail = f"{passed_tests}/{total} tests passed" + (
      f"; first failure: {records.first_failure}" if records.first_failure else ""
    )
    if records.setup_errors:
      detail += f"; setup error: {records.setup_errors[0]}"
  elif timed_out:
    status = "timeout"
  elif sig == signal.SIGXCPU or (sig == signal.SIGKILL and time.monotonic() - t0 >= cpu_s):
    status, detail = "timeout", f"killed by {_signal_name(sig)} (CPU time limit {cpu_s} s)"
  elif records.memory or "MemoryError" in tail[-500:]:
    status, detail = "memory", "ran out of memory"
  else:
    status = "crashed"
    how = f"killed by {_signal_name(sig)}" if sig is not None else f"exited with code {returncode}"
    detail = f"{how} after {len(records.tests)}/{total} tests" if records.start else f"{how} before user code ran"
  if truncated:
    detail += f"; output truncated at {limits.max_output_bytes} bytes"
  return SandboxResult(
    passed=status == "ok",
    passed_tests=passed_tests,
    total_tests=total,
    status=status,
    stderr_tail=tail,
    wall_s=time.monotonic() - t0,
    detail=detail,
    returncode=returncode,
    output_truncated=truncated,
    isolation=_describe_isolation(namespaced, records.start, limits),
  )


def run_batch(
  codes: Sequence[str],
  tests: Sequence[str],
  *,
  timeout_s: float = 5.0,
  max_workers: int | None = None,
  limits: SandboxLimits | None = None,
) -> list[SandboxResult]:
  """run() over pairs of (code, tests) in a pool of max_workers (default_workers()) processes.

  Results are in input order. Each program is one child process; the pool bounds how many run at
  once so that a batch of 64 does not starve the trainer.
  """
  codes, tests = list(codes), list(tests)
  if len(codes) != len(tests):
    raise ValueError(f"{len(codes)} programs but {len(tests)} test sources")
  if not codes:
    return []
  for source in set(tests):
    split_tests(source)  # a bad test source fails before any program runs
  workers = max(1, min(max_workers or default_workers(), len(codes)))
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox") as pool:
    return list(pool.map(lambda pair: run(pair[0], pair[1], timeout_s, limits=limits), zip(codes, tests)))


@functools.cache
def isolation(limits: SandboxLimits | None = None) -> str:
  """The isolation this machine provides: runs one trivial program and reports what was set up."""
  result = run("def f():\n  return 1\n", "assert f() == 1", 10.0, limits=limits)
  return result.isolation
