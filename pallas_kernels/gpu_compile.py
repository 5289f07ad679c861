"""Compile the FP4 kernels for an H200 (sm_90a) on a machine without a GPU, and read what came out.

The whole GPU compile chain runs on a CPU host: the CUDA PJRT plugin builds a device topology from
a target description (`h200_target_config.txtpb`, beside this file), `jax.jit(...).lower(
lowering_platforms=("cuda",)).compile()` runs XLA's GPU pipeline and Pallas' Triton lowering down
to PTX, and `ptxas` / `nvdisasm` (pip wheels) turn the PTX into SASS. Nothing runs, but the program
is the one a GPU would run, so its static figures can be measured and held to a budget:

  * launches per call: the kernels (and memsets) of XLA's thunk sequence, e.g. the pad of M and
    the split-K sum around the matmul kernel;
  * registers, spills, stack: `ptxas -v` for each Pallas kernel;
  * the main loop: the instructions between the loop label and its backward branch, for the loop
    that holds the MMAs, and so the SASS instructions each thread issues per weight it decodes
    (loop instructions / (weights per iteration / threads per program)).

Pallas' Mosaic GPU kernels (`plgpu`, wgmma / TMA) compile the same way: Mosaic GPU turns its MLIR
module into PTX and a cubin in the `mosaic_gpu_v2` custom call's *instantiate* handler, which XLA
runs while it builds the thunks (inside `.compile()`), for the target's compute capability, with
no driver. Its PTX is not in XLA's dump but in Mosaic's own (`MOSAIC_GPU_DUMP_TO`, set here for the
compile); ptxas / nvdisasm then read it as they read Triton's. Mosaic finds ptxas on PATH, so the
wheel's comes first (its PTX ISA must be one that ptxas accepts); Mosaic compiles each distinct
kernel once per process (later compiles of it dump nothing): use a fresh process per report.

Needs (test-only, `requirements-gpu-compile.txt`): jax-cuda12-plugin and jax-cuda12-pjrt at the
installed jax version, nvidia-cuda-nvcc-cu12 (ptxas) and nvidia-cuda-nvdisasm, and
JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 in the environment before jax initializes its backends (the
plugin otherwise refuses to load without a CUDA driver). `missing()` says what is absent; with the
plugin installed and no GPU, jax still runs everything else on the CPU.

  python pallas_kernels/lab/kernel_report.py   # the report: every kernel and shape, with a roofline
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
from typing import NamedTuple

import jax

TARGET_CONFIG = pathlib.Path(__file__).with_name("h200_target_config.txtpb")
ARCH = "sm_90a"
MMA_OPCODES = ("HMMA", "HGMMA", "IMMA", "QMMA")  # mma.sync and wgmma families in SASS


def _nvidia_bin(tool: str) -> str | None:
  """`tool` from the nvidia-* pip wheels (site-packages/nvidia/*/bin), else from PATH."""
  spec = importlib.util.find_spec("nvidia")
  for root in list(spec.submodule_search_locations or []) if spec else []:
    for path in sorted(glob.glob(os.path.join(root, "*", "bin", tool))):
      if os.access(path, os.X_OK):
        return path
  return shutil.which(tool)


def missing(check_env: bool = True) -> list[str]:
  """What the deviceless compile lacks here (empty when it can run), each with its fix.
  check_env=False: leave out the environment variable (for a caller that starts a child process
  with it set)."""
  out = []
  if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
    out.append(
      f"the CUDA PJRT plugin: pip install jax-cuda12-plugin=={jax.__version__} jax-cuda12-pjrt=={jax.__version__}"
    )
  if check_env and os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK") != "1":
    out.append("JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 in the environment before jax starts (no CUDA driver here)")
  if _nvidia_bin("ptxas") is None:
    out.append("ptxas: pip install nvidia-cuda-nvcc-cu12")
  if _nvidia_bin("nvdisasm") is None:
    out.append("nvdisasm: pip install nvidia-cuda-nvdisasm")
  return out


def h200_device():
  """The one device of a deviceless H200 topology (compile only; it cannot hold arrays)."""
  from jax.experimental import topologies

  text = "\n".join(line for line in TARGET_CONFIG.read_text().splitlines() if not line.startswith("#"))
  return topologies.get_topology_desc(platform="cuda", target_config=text, topology="1x1x1").devices[0]


# --- reading the compiler's output --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Launch:
  """One entry of XLA's thunk sequence that launches work on the GPU."""

  kind: str  # kCustomKernel (Triton / Pallas), kKernel (XLA fusion), kMemset32BitValue, ...
  name: str
  grid: tuple[int, ...] = ()
  threads: tuple[int, ...] = ()
  shared_memory: int = 0


def _dims(text: str, key: str) -> tuple[int, ...]:
  found = re.search(rf"{key}: \[([\d, ]+)\]", text)
  return tuple(int(v) for v in found.group(1).split(",")) if found else ()


_THUNK = re.compile(r"^\d+:\s+(k\w+)\s+\[[^\]]*\]\s+(\S+)(.*)$")


def parse_launches(thunk_sequence: str) -> list[Launch]:
  """Launches from a `*.thunk_sequence.txt` dump (kernels, memsets, and custom calls such as Mosaic
  GPU's kernels, which the dump lists without a grid; copies of zero bytes and control thunks are
  not work on the device)."""
  out = []
  for line in thunk_sequence.splitlines():
    match = _THUNK.match(line.strip())
    kinds = ("Kernel", "Memset", "Memzero", "Copy", "CustomCall")
    if not match or not any(word in match.group(1) for word in kinds):
      continue
    kind, name, rest = match.groups()
    shared = re.search(r"shared_memory: (\d+)", rest)
    out.append(Launch(kind, name, _dims(rest, "grid"), _dims(rest, "threads"), int(shared.group(1)) if shared else 0))
  return out


def parse_loop_launches(thunk_sequence: str) -> list[Launch]:
  """The launches of one trip of a program's main while loop in a `*.thunk_sequence.txt` dump: of its top-level
  loops (a prefill's scans, say, besides a decode loop), the one that launches the most, its condition's and its
  body's launches (the dump lists them below the kWhile, indented, under "condition:" and "body:"); [] without a
  loop. A loop nested in the body counts once."""
  lines = thunk_sequence.splitlines()
  top = min((len(line) - len(line.lstrip()) for line in lines if re.match(r"^\s*\d+:", line)), default=0)
  loops = []
  for start, line in enumerate(lines):
    if not re.match(r"^\s*\d+:\s+kWhile\b", line) or len(line) - len(line.lstrip()) != top:
      continue
    inside = []
    for below in lines[start + 1 :]:
      if len(below) - len(below.lstrip()) <= top and re.match(r"^\s*\d+:", below):
        break  # the next thunk at the loop's own level
      inside.append(below)
    loops.append(parse_launches("\n".join(inside)))
  return max(loops, key=len, default=[])


@dataclasses.dataclass(frozen=True)
class Resources:
  """`ptxas -v` figures of one kernel."""

  registers: int
  spill_stores: int
  spill_loads: int
  stack_frame: int


def parse_ptxas(log: str) -> Resources:
  stack = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
  regs = re.search(r"Used (\d+) registers", log)
  if not (stack and regs):
    raise ValueError(f"ptxas -v printed no resource usage:\n{log}")
  return Resources(int(regs.group(1)), int(stack.group(2)), int(stack.group(3)), int(stack.group(1)))


_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T\d]\s+)?([A-Z][A-Z0-9_]*)(\.[A-Za-z0-9_.]+)?\s*(.*?);")
_LABEL = re.compile(r"^(\.L\w+):")


class Instruction(NamedTuple):
  label: str  # the label on the line before, or ''
  opcode: str  # HGMMA
  modifiers: str  # .64x16x16.F32.BF16
  operands: str  # R24, R32, gdesc[UR8], R24


def sass_instructions(sass: str) -> list[Instruction]:
  """One Instruction per instruction of `nvdisasm -c` output (a predicate guard is dropped); a label line
  attaches to the instruction after it."""
  out, label = [], ""
  for line in sass.splitlines():
    if m := _LABEL.match(line.strip()):
      label = m.group(1)
      continue
    if m := _SASS_LINE.match(line):
      out.append(Instruction(label, m.group(1), m.group(2) or "", m.group(3)))
      label = ""
  return out


def _main_loop_span(instructions: list[Instruction]) -> tuple[int, int]:
  """(first, last) index of the main loop: of the loops (a label to a backward branch to it) that issue
  the most MMAs, the shortest. Raises if no loop holds an MMA."""
  starts = {ins.label: i for i, ins in enumerate(instructions) if ins.label}
  best = None  # (-mmas, length, start, end)
  for end, ins in enumerate(instructions):
    target = re.search(r"`\((\.L\w+)\)", ins.operands) if ins.opcode == "BRA" else None
    if not target or starts.get(target.group(1), end + 1) > end:
      continue
    start = starts[target.group(1)]
    mmas = sum(i.opcode in MMA_OPCODES for i in instructions[start : end + 1])
    if mmas and (best is None or (-mmas, end - start) < best[:2]):
      best = (-mmas, end - start, start, end)
  if best is None:
    raise ValueError("no loop with an MMA instruction in this SASS (one K tile: the K loop is unrolled away)")
  return best[2], best[3]


def _main_loop_instructions(sass: str) -> list[Instruction]:
  instructions = sass_instructions(sass)
  start, end = _main_loop_span(instructions)
  return instructions[start : end + 1]


def main_loop(sass: str) -> list[str]:
  """Opcodes of the main loop: of the loops (a label to a backward branch to it) that issue the
  most MMAs, the shortest. Triton's software-pipelined K loop is one such block; in a Mosaic GPU
  kernel the K loop sits inside the persistent tile loop, and the barrier waits' retry paths, placed
  after the function's end, branch back into its middle: both span the K loop's MMAs and more.
  Raises if no loop holds an MMA."""
  return [ins.opcode for ins in _main_loop_instructions(sass)]


def _wgmma_wait(ins: Instruction) -> int | None:
  """N of a WARPGROUP.DEPBAR.LE gsb0, N (wgmma.wait_group N: the groups it leaves in flight); None for others."""
  if ins.opcode != "WARPGROUP" or not ins.modifiers.startswith(".DEPBAR"):
    return None
  return int(re.search(r"0x([0-9a-f]+)", ins.operands).group(1), 16)


def _written(ins: Instruction) -> set[int]:
  """The R registers an instruction writes: its first operand where that is a register (a store's or a
  reduction's first operand is an address, a branch's a label, a compare's a predicate: none), after the
  predicate that SHFL and ATOM write first. Widths: 64- and 128-bit loads, .WIDE results, CS2R (not .32) and
  double-precision results take 2 or 4 registers; anything else one. HGMMA's own accumulator writes are
  ordered with the other HGMMAs of the same shape: not counted."""
  operands = [op.strip() for op in ins.operands.split(",")]
  if ins.opcode in ("SHFL", "ATOM", "ATOMG", "ATOMS") and re.fullmatch(r"U?P(T|\d+)", operands[0]):
    operands = operands[1:]
  dest = re.fullmatch(r"R(\d+)", operands[0]) if operands else None
  if not dest or ins.opcode == "HGMMA":
    return set()
  width = re.search(r"\.(64|128)\b", ins.modifiers) if ins.opcode.startswith("LD") else None
  if width:
    n = int(width.group(1)) // 32
  else:
    pair = ".WIDE" in ins.modifiers or (ins.opcode == "CS2R" and ".32" not in ins.modifiers)
    n = 2 if pair or ins.opcode in ("DADD", "DMUL", "DFMA", "DMNMX") else 1
  return set(range(int(dest.group(1)), int(dest.group(1)) + n))


def _hgmma_registers(ins: Instruction) -> set[int]:
  """The registers an HGMMA keeps reading or writing until its group is waited for: its accumulators
  (64 x N over 128 threads: N / 2 registers of f32, N / 4 of f16 pairs) and, where A comes from registers,
  A's fragment (64 x 16 16-bit values: 4)."""
  shape = re.match(r"\.64x(\d+)x\d+\.(\w+)", ins.modifiers)
  n = int(shape.group(1)) // (4 if shape.group(2) == "F16" else 2)
  d, a = (x.strip() for x in ins.operands.split(",")[:2])
  regs = set(range(int(d[1:]), int(d[1:]) + n))
  return regs | (set(range(int(a[1:]), int(a[1:]) + 4)) if re.fullmatch(r"R\d+", a) else set())


def inflight_register_writes(sass: str) -> list[Instruction]:
  """Main-loop instructions that write a register an HGMMA still in flight reads or writes: its A fragment or
  its accumulators, before a WARPGROUP.DEPBAR has waited for its group. PTX says that is undefined
  (wgmma.mma_async: "accessing the accumulator register or the input register containing fragments of matrix
  A ... without first performing a wgmma.wait_group ... that waits on a wgmma-group including that
  wgmma.mma_async instruction"), and the SASS does not hold such a write back: the HGMMA takes no read or
  write barrier on its registers, only the group scoreboard (gsb0) that DEPBAR waits on (control bits as
  decoded outside NVIDIA; it documents no SASS encoding). The loop is walked twice, so that a group left in
  flight at the back branch meets the next trip's writes; a group ends at the HGMMA marked gsb0
  (wgmma.commit_group), and DEPBAR.LE gsb0, N keeps the last N groups in flight. Not checked: reads of
  in-flight accumulators, and code outside the main loop."""
  loop = _main_loop_instructions(sass)
  groups, open_group, out = [], set(), []
  for trip in range(2):
    for ins in loop:
      if ins.opcode == "HGMMA":
        open_group |= _hgmma_registers(ins)
        if "gsb0" in ins.operands:
          groups, open_group = [*groups, open_group], set()
      elif (keep := _wgmma_wait(ins)) is not None:
        groups = groups[-keep:] if keep else []
      elif trip and _written(ins) & set().union(open_group, *groups):
        out.append(ins)
  return out


def wgmma_waits(sass: str) -> list[int]:
  """The wgmma groups each WARPGROUP.DEPBAR of the main loop leaves in flight (wgmma.wait_group N), in order."""
  return [keep for ins in _main_loop_instructions(sass) if (keep := _wgmma_wait(ins)) is not None]


# --- compiling ----------------------------------------------------------------------------------


@dataclasses.dataclass
class KernelSass:
  """One Pallas (Triton) kernel of a compiled program."""

  name: str
  resources: Resources
  loop: list[str]  # main-loop opcodes
  sass: str

  def loop_histogram(self, top: int = 12) -> dict[str, int]:
    return dict(collections.Counter(self.loop).most_common(top))

  def loads_before_exit(self) -> int | None:
    """Global loads (LDG) in the SASS before its first EXIT (None without one): what a block that ends early
    waits for (a grouped Mosaic block reads its group sizes)."""
    ops = [ins.opcode for ins in sass_instructions(self.sass)]
    return ops[: ops.index("EXIT")].count("LDG") if "EXIT" in ops else None

  def tma_loads(self) -> dict[str, int]:
    """The kernel's TMA loads (SASS UTMALDG) by kind: "multicast" (one copy for every block of a cluster) and
    "single"."""
    loads = [ins for ins in sass_instructions(self.sass) if ins.opcode == "UTMALDG"]
    multicast = sum(".MULTICAST" in ins.modifiers for ins in loads)
    return {"multicast": multicast, "single": len(loads) - multicast}

  def inflight_register_writes(self) -> list[Instruction]:
    """Main-loop writes to registers that an HGMMA in flight still uses (`inflight_register_writes`)."""
    return inflight_register_writes(self.sass)

  def wgmma_waits(self) -> list[int]:
    """The wgmma groups each wait of the main loop leaves in flight (`wgmma_waits`)."""
    return wgmma_waits(self.sass)

  def setmaxnreg(self) -> dict[str, list[int]]:
    """The registers per thread that warp-specialized warpgroups give back ("dealloc": the producer) and
    take ("alloc": the consumers) with setmaxnreg (SASS USETMAXREG), in order; empty lists if none."""
    out = {"dealloc": [], "alloc": []}
    for kind, value in re.findall(r"USETMAXREG\.(DEALLOC|TRY_ALLOC)\.CTAPOOL[^;]*?(0x[0-9a-f]+)\s*;", self.sass):
      out["dealloc" if kind == "DEALLOC" else "alloc"].append(int(value, 16))
    return out


@dataclasses.dataclass
class CompiledProgram:
  launches: list[Launch]  # every launch of one call, a while loop's condition and body once each
  kernels: dict[str, KernelSass]
  loop_launches: list[Launch] = dataclasses.field(default_factory=list)  # one trip of its main loop (the largest)


def _with_device(tree, device):
  sharding = jax.sharding.SingleDeviceSharding(device)

  def leaf(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) if hasattr(x, "shape") else x

  return jax.tree.map(leaf, tree)


def compile_for_h200(
  fn,
  *args,
  kernel_names: tuple[str, ...] | None = None,
  keep_dir: str | None = None,
  donate_argnums: tuple[int, ...] = (),
) -> CompiledProgram:
  """Compile `fn(*args)` (args: arrays or ShapeDtypeStructs, pytrees allowed) for an H200, and
  read the launches and the SASS of its matmul kernels (the `.entry` points of PTX files that
  hold an MMA, or those named in `kernel_names`). donate_argnums: as jax.jit's, for arguments that
  the caller updates in place (a loop's carry): without it XLA copies each one it writes."""
  work = keep_dir or tempfile.mkdtemp(prefix="gpu_compile_")
  os.makedirs(work, exist_ok=True)
  dump, mosaic_dump = os.path.join(work, "xla_dump"), os.path.join(work, "mosaic_dump")
  try:
    # Never from a persistent compilation cache: a cache hit compiles nothing, so dumps nothing.
    with _mosaic_gpu_dump(mosaic_dump, work), _no_persistent_cache():
      _lowered(jax.jit(fn, donate_argnums=donate_argnums), args, {}).compile(compiler_options={"xla_dump_to": dump})
    [sequence] = glob.glob(os.path.join(dump, "*.thunk_sequence.txt"))
    thunks = pathlib.Path(sequence).read_text()
    launches = parse_launches(thunks)
    kernels = {}
    for ptx in sorted(glob.glob(os.path.join(dump, "*.ptx")) + glob.glob(os.path.join(mosaic_dump, "*.ptx"))):
      text = pathlib.Path(ptx).read_text()
      for name in re.findall(r"\.visible \.entry (\w+)\(", text):
        has_mma = re.search(r"\b(mma|wgmma)\.", text) is not None  # XLA's fusions have none
        if (kernel_names is None and has_mma) or (kernel_names and name in kernel_names):
          kernels[name] = _sass_of(ptx, name, work)
    return CompiledProgram(launches, kernels, parse_loop_launches(thunks))
  finally:
    if keep_dir is None:
      shutil.rmtree(work, ignore_errors=True)


def _lowered(jitted, args, static: dict):
  """`jitted(*args, **static)` lowered for the H200 topology (args: arrays or ShapeDtypeStructs, pytrees)."""
  if problems := missing():
    raise RuntimeError("deviceless GPU compile unavailable: " + "; ".join(problems))
  args = _with_device(jax.eval_shape(lambda *a: a, *args), h200_device())
  return jitted.trace(*args, **static).lower(lowering_platforms=("cuda",))


@contextlib.contextmanager
def as_hopper():
  """Trace as on an H100 / H200: `jax.default_backend()` says 'gpu' and `pallas_kernels.is_hopper()` True, so
  that the choices the code makes while tracing are the GPU's (`select_impl`'s Mosaic kernel and the expert
  layout it takes, moe's tiled grouped dot, the engine's bf16 KV carriers, compiled Triton kernels)."""
  from unittest import mock

  import pallas_kernels

  with (
    mock.patch.object(jax, "default_backend", lambda: "gpu"),
    mock.patch.object(pallas_kernels, "is_hopper", lambda: True),
  ):
    yield


def compile_sm90(fn, *args, donate_argnums: tuple[int, ...] = (), compiler_options: dict | None = None, **static):
  """`fn(*args, **static)` (static: a jitted fn's static arguments) traced `as_hopper` and compiled for an H200;
  fn may be jitted already (then donate_argnums is its own). The compiled program's memory_analysis() is the
  device memory it needs (`memory_figures`)."""
  jitted = fn if hasattr(fn, "trace") else jax.jit(fn, donate_argnums=donate_argnums)
  with as_hopper(), _no_persistent_cache():
    return _lowered(jitted, args, static).compile(compiler_options=compiler_options)


def memory_figures(compiled) -> dict[str, int]:
  """The compiled program's device memory in bytes: arguments, outputs, aliased (donated arguments the outputs
  reuse), temporaries and their sum, peak = argument + output - alias + temp."""
  m = compiled.memory_analysis()
  out = dict(
    argument=m.argument_size_in_bytes, output=m.output_size_in_bytes, alias=m.alias_size_in_bytes,
    temp=m.temp_size_in_bytes,
  )  # fmt: skip
  out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  return out


@contextlib.contextmanager
def _no_persistent_cache():
  before = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", before)


@contextlib.contextmanager
def _mosaic_gpu_dump(dump: str, work: str):
  """Mosaic GPU's dump (PTX, ptxas log, SASS) into `dump` for the compiles inside, with the wheels'
  ptxas first on PATH and `MOSAIC_GPU_CUDA_ROOT` a folder whose bin/ holds ptxas and nvdisasm."""
  try:  # its import points MOSAIC_GPU_CUDA_ROOT at the CUDA install it knows: let that happen first
    import jax.experimental.mosaic.gpu  # noqa: F401
  except ImportError:  # no Mosaic GPU in this jaxlib: Triton kernels only
    pass
  root = pathlib.Path(work, "cuda_root")
  (root / "bin").mkdir(parents=True, exist_ok=True)
  for tool in ("ptxas", "nvdisasm"):
    if not (root / "bin" / tool).exists():
      os.symlink(_nvidia_bin(tool), root / "bin" / tool)
  os.makedirs(dump, exist_ok=True)
  saved = {k: os.environ.get(k) for k in ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_CUDA_ROOT", "PATH")}
  os.environ.update(
    MOSAIC_GPU_DUMP_TO=dump,
    MOSAIC_GPU_CUDA_ROOT=str(root),
    PATH=os.path.dirname(_nvidia_bin("ptxas")) + os.pathsep + (saved["PATH"] or ""),
  )
  try:
    yield
  finally:
    for key, value in saved.items():
      if value is None:
        os.environ.pop(key, None)
      else:
        os.environ[key] = value
    for log in glob.glob(os.path.join(dump, "*.mlir-passes.log")):  # tens of MB per kernel
      os.remove(log)


def _sass_of(ptx: str, name: str, work: str) -> KernelSass:
  cubin = os.path.join(work, f"{name}.cubin")
  run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True, text=True)
  log = run(_nvidia_bin("ptxas"), f"-arch={ARCH}", "-O3", "-v", f"--entry={name}", ptx, "-o", cubin)
  sass = run(_nvidia_bin("nvdisasm"), "-c", cubin).stdout
  return KernelSass(name, parse_ptxas(log.stdout + log.stderr), main_loop(sass), sass)


def instructions_per_weight(kernel: KernelSass, weights_per_iteration: int, threads: int) -> float:
  """Main-loop SASS instructions one thread issues per weight: the loop consumes
  `weights_per_iteration` weights per trip (block_n * block_k), shared by `threads` threads."""
  return len(kernel.loop) / (weights_per_iteration / threads)
