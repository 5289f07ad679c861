"""The embedded default: GRPO with TRACE on the arithmetic task, tiny MoE, 2 CPU cores.

  python -m trace_jax.main --config=configs/default.py --workdir=/tmp/trace_run
  python -m trace_jax.main --config=configs/default.py:qat --workdir=... --config.steps=20
  python -m trace_jax.main --config=configs/default.py:trace,model=qwen3_30b_a3b --workdir=...

The argument after ':' is a comma-separated list: a bare word picks the mode (bf16, fp4, qat,
qat_w4a16, trace, trace_full) and `model=NAME` a preset of configs/models.py. Every field and its
default is declared once, in the config dataclasses of trace_jax/config.py (their docstrings say
what each means); this file only picks the model.
"""

import ml_collections

from configs import models
from trace_jax import config as config_lib


def parse_arg(arg: str) -> dict[str, str]:
  """'trace,model=tiny' -> {'mode': 'trace', 'model': 'tiny'} (a bare word is the mode)."""
  out = {}
  for part in filter(None, (p.strip() for p in (arg or "").split(","))):
    key, sep, value = part.partition("=")
    key, value = ("mode", key) if not sep else (key.strip(), value.strip())
    if key not in ("mode", "model") or key in out:
      raise ValueError(
        f"configs/default.py: cannot read {part!r} in {arg!r}; expected 'MODE', 'model=PRESET' or both, "
        "e.g. 'trace,model=tiny'."
      )
    out[key] = value
  return out


def get_config(arg: str = "trace") -> ml_collections.ConfigDict:
  args = parse_arg(arg)
  c = config_lib.defaults()
  c.mode = args.get("mode", "trace")
  c.model = models.get_config(args.get("model", "tiny"))
  return c
