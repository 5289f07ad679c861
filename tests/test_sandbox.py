"""Tests of trace_jax.data.sandbox (hostile programs included) and trace_jax.data.code_tasks."""

import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from trace_jax.data import code_tasks, sandbox
from trace_jax.data.jsonl import JsonlFormatError
from trace_jax.data.sandbox import RUNNER_MARKER, SandboxLimits, code_reward, run, run_batch

REPO = Path(__file__).resolve().parents[1]
FAST = 1.5  # seconds: the wall-clock timeout of the hostile cases
SMALL = SandboxLimits(memory_mb=256)
NO_GUARDS = SandboxLimits(memory_mb=256, processes=16, python_guards=False)  # only the OS layers
ISOLATION = sandbox.isolation()
HAS_PID_NS = "namespaces" in ISOLATION
needs_namespaces = pytest.mark.skipif(not HAS_PID_NS, reason=f"no namespaces here ({ISOLATION})")

ADD3 = "def f(x):\n  return x + 3\n"
ADD3_TESTS = "assert f(1) == 4\nassert f(2) == 5\nassert f(-3) == 0\n"


def sandbox_processes() -> list[int]:
  """Pids whose command line carries the runner marker (sandboxed programs and their forks)."""
  pids = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
      except OSError:
        continue
      if RUNNER_MARKER.encode() in cmdline:
        pids.append(int(entry))
  return pids


def assert_no_reward(result, *statuses):
  assert result.status in statuses, result
  assert not result.passed and result.passed_tests == 0, result
  assert code_reward([result], partial_credit=True)[0] == 0.0


@pytest.fixture(autouse=True)
def no_leftovers():
  """Every test ends with no sandboxed process alive and no working directory left behind."""
  before = set(Path(tempfile.gettempdir()).glob("trace_sandbox_*"))
  yield
  assert sandbox_processes() == []
  assert set(Path(tempfile.gettempdir()).glob("trace_sandbox_*")) <= before


# --- ordinary programs ----------------------------------------------------------------------


def test_correct_program_passes():
  result = run(ADD3, ADD3_TESTS)
  assert (result.status, result.passed, result.passed_tests, result.total_tests) == ("ok", True, 3, 3)
  assert result.wall_s < 5 and result.isolation == ISOLATION


def test_partially_correct_program_gets_partial_credit():
  result = run("def f(x):\n  return 4 if x == 1 else x + 3 if x == 2 else 0 / 0\n", ADD3_TESTS)
  assert (result.status, result.passed, result.passed_tests, result.total_tests) == ("failed", False, 2, 3)
  assert "test 2: ZeroDivisionError" in result.detail and "ZeroDivisionError" in result.stderr_tail
  np.testing.assert_allclose(code_reward([result], partial_credit=True), [2 / 3])
  np.testing.assert_array_equal(code_reward([result], partial_credit=False), [0.0])
  assert code_reward([run(ADD3, ADD3_TESTS)]).dtype == np.float32


def test_counting_tests():
  # setup statements are not counted; each top-level assert is one test, multi-line ones too
  tests = "import math\nassert f(1) == 4\nx = [f(i) for i in range(3)]\nassert x == [\n  3, 4, 5]\n"
  assert sandbox.count_tests(tests) == 2
  assert run(ADD3, tests).passed_tests == 2
  # a block without a top-level assert (HumanEval's check) is one test
  check = "def check(candidate):\n  assert candidate(1) == 4\n  assert candidate(2) == 5\n\ncheck(f)\n"
  assert sandbox.count_tests(check) == 1
  assert (run(ADD3, check).status, run("def f(x):\n  return x\n", check).status) == ("ok", "failed")
  with pytest.raises(ValueError, match="do not parse"):
    run(ADD3, "assert f(1) ==")
  with pytest.raises(ValueError, match="no statement"):
    sandbox.count_tests("# nothing\n")


def test_syntax_errors_and_oversized_code_are_refused():
  assert_no_reward(run("def f(x):\n  return x +\n", ADD3_TESTS), "refused")
  assert "SyntaxError" in run("def f(:", ADD3_TESTS).detail
  assert run("return 1", ADD3_TESTS).status == "refused"  # a compile-time (not parse-time) error
  assert run("x = 1\x00", ADD3_TESTS).status == "refused"
  big = ADD3 + "#" * 70_000
  assert_no_reward(run(big, ADD3_TESTS), "refused")
  assert run(big, ADD3_TESTS, limits=SandboxLimits(max_code_bytes=100_000)).status == "ok"


def test_stdlib_imports_work_in_the_sandbox():
  code = "import collections, fractions, heapq, itertools, json, math, re\ndef f(x):\n  return math.isqrt(x * x) + 3\n"
  assert run(code, ADD3_TESTS.replace("f(-3) == 0", "f(0) == 3")).status == "ok"


# --- hostile programs -----------------------------------------------------------------------


def test_infinite_loop_times_out():
  start = time.monotonic()
  result = run("while True:\n  pass\n", ADD3_TESTS, FAST)
  assert_no_reward(result, "timeout")
  assert time.monotonic() - start < FAST + 3


def test_infinite_loop_in_a_test_keeps_earlier_credit():
  result = run("def f(x):\n  while x == 2:\n    pass\n  return x + 3\n", ADD3_TESTS, FAST)
  assert (result.status, result.passed_tests) == ("timeout", 1)


def test_cpu_limit_stops_a_loop_before_the_wall_clock():
  result = run("while True:\n  pass\n", ADD3_TESTS, 20.0, limits=SandboxLimits(cpu_s=1))
  assert_no_reward(result, "timeout")
  assert "CPU time limit" in result.detail and result.wall_s < 10


def test_memory_bombs():
  assert_no_reward(run("x = bytearray(10**10)\n", ADD3_TESTS, FAST, limits=SMALL), "memory")
  growing = "blocks = []\nwhile True:\n  blocks.append(bytearray(1 << 20))\n"
  assert_no_reward(run(growing, ADD3_TESTS, 5.0, limits=SandboxLimits(memory_mb=128)), "memory")
  in_test = "def f(x):\n  return len('x' * 10**10)\n"
  assert_no_reward(run(in_test, ADD3_TESTS, FAST, limits=SMALL), "memory")


def test_fork_bomb_is_contained():
  bomb = "import os\nwhile True:\n  os.fork()\n"
  assert_no_reward(run(bomb, ADD3_TESTS, FAST), "crashed")  # the guard: os.fork raises
  assert sandbox_processes() == []


@needs_namespaces
def test_fork_bomb_without_python_guards_is_contained():
  bomb = "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n"
  start = time.monotonic()
  result = run(bomb, ADD3_TESTS, 1.0, limits=NO_GUARDS)
  assert_no_reward(result, "timeout", "crashed")
  assert time.monotonic() - start < 10
  assert sandbox_processes() == []  # the PID namespace died with its init


def test_writing_outside_the_working_directory_leaves_no_file():
  token = os.urandom(6).hex()
  targets = [f"/tmp/trace_sandbox_escape_{token}", str(REPO / f"sandbox_escape_{token}"), f"/root/escape_{token}"]
  code = (
    f"import os\nwritten = []\nfor path in {targets!r} + ['../escape_{token}', 'inside.txt']:\n"
    "  try:\n    with open(path, 'w') as f:\n      f.write('x')\n    written.append(path)\n"
    "  except OSError:\n    pass\n"
    "def f(x):\n  return written\n"
  )
  result = run(code, "assert 'inside.txt' in f(0)\nassert len(f(0)) == 0\n", FAST)
  assert (result.status, result.passed_tests) == ("failed", 1)  # it may write in its own directory
  for path in [*targets, str(Path(tempfile.gettempdir()) / f"escape_{token}")]:
    assert not os.path.exists(path), path


def test_parent_environment_is_not_visible(monkeypatch):
  monkeypatch.setenv("TRACE_SANDBOX_SECRET", "hunter2")
  code = (
    "import os\ndef f(x):\n  found = [k for k, v in os.environ.items() if 'hunter2' in v]\n"
    "  for pid in os.listdir('/proc'):\n    try:\n"
    "      if b'hunter2' in open(f'/proc/{pid}/environ', 'rb').read():\n        found.append(pid)\n"
    "    except OSError:\n      pass\n  return found, sorted(os.environ)\n"
  )
  result = run(code, "assert f(0)[0]\nassert 'TRACE_SANDBOX_SECRET' in f(0)[1]\n", FAST)
  assert_no_reward(result, "failed")
  plain = run("import os\ndef f(x):\n  return set(os.environ)\n", "assert f(0) <= {'HOME', 'LC_ALL', 'PATH', 'PWD'}")
  assert plain.status == "ok", plain


@pytest.mark.skipif("uid" not in ISOLATION and "tmpfs" not in ISOLATION, reason="files are not isolated here")
def test_private_files_are_not_readable(tmp_path):
  secret = tmp_path / "secret.txt"  # under /tmp (hidden by a tmpfs) and in pytest's 0700 directory
  secret.write_text("hunter2")
  code = f"def f(x):\n  try:\n    return open({str(secret)!r}).read()\n  except OSError as e:\n    return repr(e)\n"
  assert_no_reward(run(code, "assert f(0) == 'hunter2'", FAST), "failed")


def test_sockets_are_denied():
  code = (
    "import socket\ndef f(port):\n  try:\n    s = socket.create_connection(('127.0.0.1', port), timeout=1)\n"
    "    return 'connected'\n  except OSError as e:\n    return repr(e)\n"
  )
  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    tests = f"assert f({port}) == 'connected', f({port})"
    result = run(code, tests, FAST)
    assert_no_reward(result, "failed")
    assert "PermissionError" in result.detail
    assert_no_reward(run("import socket\nsocket.socket()\n", "assert True", FAST), "crashed")
    if HAS_PID_NS:  # without the guard, the network namespace has no route (not even to our loopback)
      unguarded = run(code, tests, FAST, limits=NO_GUARDS)
      assert_no_reward(unguarded, "failed")
      assert "unreachable" in unguarded.detail, unguarded.detail


def test_huge_output_is_bounded():
  rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  printing = run("while True:\n  print('x' * 100_000)\n", ADD3_TESTS, FAST)
  assert_no_reward(printing, "timeout")
  raw = "import os, sys\nwhile True:\n  os.write(1, b'y' * 65536)\n  os.write(2, b'z' * 65536)\n"
  flood = run(raw, ADD3_TESTS, FAST)  # bypasses sys.stdout: the parent closes the pipes
  assert_no_reward(flood, "timeout", "crashed")
  assert flood.output_truncated and len(flood.stderr_tail) <= 2000
  correct_but_loud = run("print('x' * 10**7)\n" + ADD3, ADD3_TESTS, 5.0)
  assert correct_but_loud.status == "ok"  # what print keeps is bounded; the program carries on
  assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 64 * 1024  # KiB


def test_killing_the_parent_fails():
  me = os.getpid()
  code = f"import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill({me}, signal.SIGKILL)\n"
  assert_no_reward(run(code, ADD3_TESTS, FAST), "crashed")
  assert os.getpid() == me  # still here


@needs_namespaces
def test_killing_everything_without_guards_reaches_nothing_outside():
  sentinel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    me = os.getpid()
    code = (
      "import os, signal\n"
      f"for pid in (os.getppid(), {me}, {sentinel.pid}, 1, -1):\n"
      "  try:\n    os.kill(pid, signal.SIGKILL)\n  except OSError:\n    pass\n"
    )
    assert_no_reward(run(code, ADD3_TESTS, FAST, limits=NO_GUARDS), "failed", "crashed")
    time.sleep(0.1)
    assert sentinel.poll() is None  # not killed
  finally:
    sentinel.kill()
    sentinel.wait()


def test_exiting_early_earns_nothing():
  for code in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n", "raise SystemExit\n"):
    assert_no_reward(run(code, ADD3_TESTS, FAST), "crashed")
  # inside a test, sys.exit fails that test only
  result = run("import sys\ndef f(x):\n  if x == 1:\n    sys.exit(0)\n  return x + 3\n", ADD3_TESTS, FAST)
  assert (result.status, result.passed_tests) == ("failed", 2)


def test_faked_results_earn_nothing():
  fake = json.dumps({"n": "0" * 32, "test": 0, "ok": True})
  code = (
    "import json, os, sys\nprint('3/3 tests passed\\nok\\nPASSED')\n"
    f"for fd in range(64):\n  for line in ({fake!r}, '{{\"done\": true}}'):\n"
    "    try:\n      os.write(fd, (line + '\\n').encode())\n    except OSError:\n      pass\n"
    "os._exit(0)\n"
  )
  assert_no_reward(run(code, ADD3_TESTS, FAST), "crashed")
  # rebinding AssertionError does not silence the asserts of the tests
  code = "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\ndef f(x):\n  return None\n"
  assert_no_reward(run(code, ADD3_TESTS, FAST), "failed")


def test_run_batch_keeps_order_and_isolates_programs():
  kinds = ["good", "loop", "memory", "syntax", "exit", "partial", "fork", "print"]
  programs = {
    "good": (ADD3, "ok"),
    "loop": ("while True:\n  pass\n", "timeout"),
    "memory": ("x = bytearray(10**10)\n", "memory"),
    "syntax": ("def f(x)\n  return x\n", "refused"),
    "exit": ("import sys\nsys.exit(0)\n", "crashed"),
    "partial": ("def f(x):\n  return 4\n", "failed"),
    "fork": ("import os\nos.fork()\n", "crashed"),
    "print": ("print('x' * 10**6)\n" + ADD3, "ok"),
  }
  order = [kinds[0] if i % 2 == 0 else kinds[1 + (i // 2) % (len(kinds) - 1)] for i in range(64)]
  order = [k if k != "loop" or i < 16 else "good" for i, k in enumerate(order)]  # 2 infinite loops
  start = time.monotonic()
  results = run_batch([programs[k][0] for k in order], [ADD3_TESTS] * 64, timeout_s=FAST, limits=SMALL)
  elapsed = time.monotonic() - start
  assert [r.status for r in results] == [programs[k][1] for k in order]
  assert [r.passed_tests for r in results if r.status == "failed"] == [1] * order.count("partial")
  assert elapsed < 40, elapsed
  rewards = code_reward(results)
  np.testing.assert_array_equal(rewards, [float(programs[k][1] == "ok") for k in order])
  assert run_batch([], []) == []
  with pytest.raises(ValueError, match="2 programs but 1"):
    run_batch([ADD3, ADD3], [ADD3_TESTS])
  with pytest.raises(ValueError, match="do not parse"):
    run_batch([ADD3], ["assert ("])


def test_isolation_is_described():
  assert ISOLATION == run(ADD3, ADD3_TESTS).isolation and "rlimits" in ISOLATION
  if os.geteuid() == 0 and HAS_PID_NS:  # this machine: root with unshare
    assert "uid 65534" in ISOLATION and "tmpfs over" in ISOLATION and "python guards" in ISOLATION
  fallback = run(ADD3, ADD3_TESTS, limits=SandboxLimits(namespaces=False))
  assert fallback.status == "ok" and "namespaces" not in fallback.isolation
  bare = run(ADD3, ADD3_TESTS, limits=SandboxLimits(namespaces=False, drop_privileges=False, python_guards=False))
  assert bare.status == "ok" and bare.isolation == "rlimits"


# --- code tasks -----------------------------------------------------------------------------


def test_sample_problems_load_and_their_references_pass():
  problems = code_tasks.load_code_jsonl(code_tasks.SAMPLE_PATH)
  assert 5 <= len(problems) <= 10 and len({p.task_id for p in problems}) == len(problems)
  assert all(p.entry_point and p.reference for p in problems)
  results = run_batch([p.reference for p in problems], [p.test_source for p in problems])
  assert [r.status for r in results] == ["ok"] * len(problems), [r.detail for r in results]
  wrong = run_batch(["def nothing():\n  pass\n"] * len(problems), [p.test_source for p in problems])
  assert all(r.status == "failed" and r.passed_tests == 0 for r in wrong)
  example = problems[0].to_example()
  assert example.prompt == problems[0].prompt and example.target == problems[0].reference


def test_synthesis_problems():
  problems = code_tasks.synthesis_problems(40, seed=3)
  assert problems == code_tasks.synthesis_problems(40, seed=3)
  assert problems != code_tasks.synthesis_problems(40, seed=4)
  assert {p.metadata["family"] for p in problems} > {"add", "reverse"}
  for p in problems:
    assert len(p.examples) == 3 and len(p.tests) == 5 and p.entry_point == "f"
    assert all(e in p.prompt for e in p.examples) and not any(t in p.prompt for t in p.tests)
    assert p.reference.startswith("def f(x):\n  return ") and len(p.reference) < 40
  results = run_batch([p.reference for p in problems], [p.test_source for p in problems])
  assert all(r.status == "ok" and r.total_tests == 5 for r in results)
  only = code_tasks.synthesis_problems(5, families=["mod"])
  assert {p.metadata["family"] for p in only} == {"mod"}
  with pytest.raises(ValueError, match="unknown synthesis families"):
    code_tasks.synthesis_problems(1, families=["nope"])


@pytest.mark.parametrize(
  ("line", "message"),
  [
    ("not json", "invalid JSON"),
    ("[1]", "expected a JSON object"),
    ('{"tests": "assert True"}', "missing field 'prompt'"),
    ('{"prompt": "p"}', "missing field 'tests'"),
    ('{"prompt": "p", "tests": 3}', "'tests' must be a string or a list of strings"),
    ('{"prompt": "p", "tests": []}', "'tests' is empty"),
    ('{"prompt": "p", "tests": ["assert f(1) =="]}', "'tests[0]': the tests do not parse"),
    ('{"prompt": "p", "tests": "assert True", "entry_point": "f x"}', "'entry_point' must be a Python identifier"),
    ('{"prompt": "p", "test": "def check(c):\\n  pass\\n"}', "needs 'entry_point'"),
    ('{"prompt": "", "tests": "assert True"}', "'prompt' must be a non-empty string"),
  ],
)
def test_load_code_jsonl_errors_name_line_and_field(tmp_path, line, message):
  path = tmp_path / "problems.jsonl"
  path.write_text('{"prompt": "ok", "tests": "assert True"}\n\n' + line + "\n")
  with pytest.raises(JsonlFormatError) as info:
    code_tasks.load_code_jsonl(path)
  assert f"{path}:3:" in str(info.value) and message in str(info.value)
