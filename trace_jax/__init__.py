"""trace_jax: FP4 reinforcement learning of Mixture-of-Experts language models with TRACE, in JAX.

Importing the package keeps the CUDA plugin quiet on a machine without a GPU (below); the modules are
listed in the README's module map."""

import importlib.util
import os
import sys

# Device nodes of an accelerator jax could use: NVIDIA, AMD (ROCm), TPU.
_ACCELERATOR_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/accel0", "/dev/vfio")


def _cpu_without_a_gpu() -> None:
  """With the CUDA plugin installed (requirements-gpu-compile.txt: deviceless sm_90a compiles) and no GPU,
  jax's first backend lookup logs an ERROR traceback ("Unable to load CUDA") before it falls back to the CPU.
  Asking for the CPU platform is what skips the plugin's CUDA check: set where no accelerator is present
  and the user named no platform. The plugin still registers, so the deviceless GPU compiles keep working."""
  if os.environ.get("JAX_PLATFORMS") or any(os.path.exists(p) for p in _ACCELERATOR_NODES):
    return
  if importlib.util.find_spec("jax_plugins") is None or importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
    return
  os.environ["JAX_PLATFORMS"] = "cpu"  # for this process if jax is not imported yet, and for every child
  if "jax" in sys.modules:  # imported already: its config read the environment then
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
      sys.modules["jax"].config.update("jax_platforms", "cpu")


_cpu_without_a_gpu()
