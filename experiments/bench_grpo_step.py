"""One GRPO step, end to end: trace_jax (modes bf16, qat, trace) against Tunix's `GrpoLearner`.

  python experiments/bench_grpo_step.py [--modes bf16,qat,trace] [--steps 5] [--warmup 1] [--threads N]
                                        [--tunix auto|skip|install] [--tunix_python PATH] [--json PATH]
  python experiments/bench_grpo_step.py --smoke --json /tmp/smoke.json   # seconds; Tunix skipped

The work (both sides): a Qwen3-MoE of 2 layers, hidden 128, 8 experts top-2 with expert FFN 256,
4 query heads x head_dim 32 and 2 KV heads, vocab 1024, untied embeddings, RoPE theta 1e6; per step
8 prompts x G = 4 samples, prompts of 16 random tokens (unpadded), exactly 64 new tokens per sample
(EOS off), temperature 1, no top-k / top-p; the reward is the fraction of even token ids in the
response (no SFT, random init); a frozen reference policy with KL coefficient 0.04; one optimizer
update per step (AdamW, global-norm clip 1, our RL learning-rate schedule). The weights are ours
(`model.init_params`), exported with `trace_jax.hf.save_pretrained` and loaded into Tunix with
`tunix.models.qwen3.params.create_model_from_safe_tensors`, so both sides start from the same policy
(checked: the Tunix worker reports its fp32 logits' largest distance from ours on the first prompt
batch, `max_abs_logit_diff_vs_ours`, ~1e-6). RoPE theta is Qwen3's 1e6 because Tunix 0.1.7's Qwen3
attention applies RoPE with 1e6 whatever its ModelConfig says.

What is timed, per step (wall clock; the median over `--steps` steps after the first call and
`--warmup` further untimed steps). Our modes make their first calls (the compiles) one after the
other, then Tunix makes its own (in its process, which waits while ours run), then every system
steps round-robin: bf16, qat, trace, Tunix, bf16, ... Other jobs on the machine, and its slow and
fast minutes, then slow every system alike (Tunix's process is paced over two pipes; its waits are
not in its step times). Beside each ratio of median step times, the same ratio of CPU seconds per
step is printed (`ratios_cpu_s` in the JSON): wall time includes waiting for a core on a shared
machine, CPU time does not.

  ours (mode)   `train.RLStep.__call__(step, state, prompts)`, built as `train.train_and_evaluate`
                builds it (RunConfig from configs/default.py with the overrides below,
                Topology.single_device(), trainer.make_optimizer / init_state, RLStep.build with a
                copy of the initial parameters as the reference): weight sync (trainer params ->
                engine params: bf16, or packed NVFP4 experts), `rollout.generate` (prefill + KV-cache
                decode, recording log-probs, routing and, for FP4 modes, the FP4 codes / guidance),
                the rewards on the host, group advantages, the rollout -> trainer batch, the
                reference log-probs, the update (the mode's QAT forward with routing replay, GRPO
                loss with TIS and KL, backward, AdamW) and every metric as a host float. The mode's
                defaults hold otherwise: TIS cap 5, routing replay (R3), `trace.diagnostics` (full
                FP4 codes recorded in every layer, for the agreement metrics, on every
                `trace.diagnostics_every`-th step: 10; the table's "run" column weighs the steps
                with and without them 1 : 9, and the goals are judged on it), the trainer in bf16.
                Split from the step's metrics: `time/rollout_s` (weight sync + generate),
                `time/train_s` (the update, and the reference log-probs too: RLStep.learn
                dispatches that forward asynchronously just before its timer starts, and the
                update waits for it), and "other" = step - both (host work: rewards, advantages,
                the batch transfer, the metrics).
  Tunix         `GrpoLearner.train`'s per-global-step loop (timestamps at the start of each
                `_run_global_step` and when the loop ends): `rl_cluster.generate` with the `vanilla`
                engine (Tunix's Sampler: prefill + while-loop decode with its KV cache, then the
                tokens to the host and decoded to text), the reward function on the text, the
                reference log-probs, the advantages and one actor update via its PeftTrainer, plus
                the loop's own bookkeeping (metric buffers, progress bar). "rollout" is the time
                inside `rl_cluster.generate`; "other" is the rest.

What differs between the two sides (by each library's design, not by this benchmark's choice):
  - Tunix's actor, reference and rollout share one CPU mesh, so its rollout reads the actor's
    weights directly (no weight sync), in the model's dtype (`--tunix_dtype`, float32 by default,
    Tunix's default: fp32 activations and fp32 KV cache). Ours samples in bf16 (bf16 KV cache) or
    NVFP4 (experts W4A4, FP4 KV cache) and trains in bf16 with fp32 master weights, as the modes say.
  - Tunix's Qwen3 MoE layer on CPU (or without a mesh) runs every expert on every token (dense
    dispatch, E / k = 4x the expert FLOPs of top-2). Ours sorts the k rows of each token by expert
    and runs `lax.ragged_dot`, which XLA:CPU (jax 0.10.2) lowers to one dense dot of the rows,
    masked into an [rows, E * K] block layout, against all E experts' weights: E = 8x the FLOPs of
    the routed rows (2x Tunix's), plus the masking (seen in a profile of the update, where these
    dots and selects take about 70% of the op time; the same holds in the engine).
  - Tunix's rollout returns no log-probs (return_logprobs off by default, as GRPO does not read
    them); ours records them (TIS and the mismatch metrics need them), plus routing for R3.
  - Tunix's prompts go through a tokenizer (a whitespace tokenizer of the ids, here) and the
    completions are decoded to text for the reward; ours passes token ids. Tunix's PAD id is set to
    1024 (outside the vocabulary, never sampled) so that no sampled token is masked as padding.
  - Tunix samples every step with seed PRNGKey(0) (its RolloutConfig.seed default); ours folds the
    step into the key. Timing does not depend on it.

Compiles: every XLA compile (jax.monitoring's backend-compile event) is counted per step on both
sides; a steady step should compile nothing (`compiles_after_first` in the JSON, per step).

Tunix (google-tunix==0.1.7) is not one of our requirements: it pins transformers 5.12, tokenizers
0.22 and safetensors 0.7 (ours: 5.24 / 0.23 / 0.8). It runs in a subprocess with another
interpreter, by default that of a venv made with `--system-site-packages` (so it shares our jax,
flax and optax). `--tunix=auto` uses Tunix if that interpreter imports it and otherwise says how to
install it and skips; `--tunix=install` creates the venv (`--tunix_venv`) and pip-installs it there
first; `--tunix=skip` skips. The running interpreter's packages are never changed.

Threads: `--threads` (default: all cores) sets XLA:CPU's intra-op pool (XLA_FLAGS, before jax is
imported), on both sides. `--set KEY=VALUE` overrides our config (e.g. `--set trace.diagnostics=False`,
`--set trainer_dtype=float32`) to see what a setting costs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

GOAL_VS_TUNIX = 0.5  # ours step / Tunix step, every mode (issue 43)
GOAL_TRACE_VS_QAT = 1.10  # TRACE step / QAT step
TUNIX_PACKAGE = "google-tunix==0.1.7"
DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "trace_jax", "venv_tunix")

# The shared toy model (our ModelConfig field names; the Tunix worker maps them to its own).
MODEL = dict(
  vocab_size=1024,
  hidden_size=128,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=32,
  num_experts=8,
  num_experts_per_tok=2,
  moe_intermediate_size=256,
  rope_theta=1_000_000.0,  # Qwen3's; Tunix 0.1.7's Qwen3 attention applies RoPE with 1e6 whatever its config says
  tie_word_embeddings=False,
  max_position_embeddings=256,
)
KL_COEF = 0.04


def _args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--modes", default="bf16,qat,trace", help="comma-separated modes of ours")
  p.add_argument("--steps", type=int, default=10, help="timed steps per system (the median is reported)")
  p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first call (Tunix settles after 2-3)")
  p.add_argument("--prompts", type=int, default=8, help="prompts per step")
  p.add_argument("--generations", type=int, default=4, help="samples per prompt (G)")
  p.add_argument("--prompt_len", type=int, default=16)
  p.add_argument("--new_tokens", type=int, default=64)
  p.add_argument("--threads", type=int, default=os.cpu_count(), help="XLA:CPU threads")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="a config override of ours, e.g. --set trainer_dtype=float32 --set trace.diagnostics=False (repeatable)",
  )
  p.add_argument("--tunix", choices=("auto", "skip", "install"), default="auto")
  p.add_argument("--tunix_python", default="", help="interpreter for the Tunix half (default: the venv's)")
  p.add_argument("--tunix_venv", default=DEFAULT_VENV, help="where --tunix=install creates its venv")
  p.add_argument("--tunix_dtype", default="float32", choices=("float32", "bfloat16"), help="Tunix model dtype")
  p.add_argument("--tunix_timeout", type=int, default=1800, help="seconds before the Tunix subprocess is stopped")
  p.add_argument("--smoke", action="store_true", help="tiny run: 2 steps, 8 new tokens, 1 warm-up step, Tunix skipped")
  p.add_argument("--json", default="", help="write every figure to this JSON file")
  p.add_argument("--_tunix_worker", default="", help=argparse.SUPPRESS)  # spec JSON path: run the Tunix half
  args = p.parse_args(argv)
  if args.smoke:
    # one warm-up step: the first step without the diagnostics' codes compiles its programs
    args.steps, args.warmup, args.new_tokens, args.tunix = 2, 1, 8, "skip"
  if args.steps < 1 or args.warmup < 0:
    p.error("--steps must be >= 1 and --warmup >= 0")
  return args


def _set_xla_threads(threads: int):
  """XLA:CPU reads its thread pool size from XLA_FLAGS once, when jax initializes its backend."""
  flags = f"--xla_cpu_multi_thread_eigen={'false' if threads == 1 else 'true'} intra_op_parallelism_threads={threads}"
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()


class CompileCounter:
  """Counts XLA compiles (jax.monitoring's backend-compile event) and their seconds, per step."""

  def __init__(self):
    import jax
    from jax._src import dispatch

    self.event = dispatch.BACKEND_COMPILE_EVENT
    self.count, self.seconds, self.names = 0, 0.0, []
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event, duration, **kwargs):
    if event == self.event:
      self.count += 1
      self.seconds += duration
      self.names.append(str(kwargs.get("fun_name", "?")))

  def mark(self):
    return self.count, self.seconds, len(self.names)


def _summary(times: list[float], first: float, warmup: int) -> dict:
  """first call, then `warmup` untimed steps, then the timed ones."""
  timed = times[1 + warmup :]
  return {"first_call_s": first, "step_s": statistics.median(timed), "step_s_all": timed}


def _host_info() -> dict:
  import jax

  return {
    "machine": platform.machine(),
    "processor": platform.processor(),
    "cpu_count": os.cpu_count(),
    "load_average_1min": os.getloadavg()[0],
    "python": platform.python_version(),
    "jax": jax.__version__,
    "backend": jax.default_backend(),
    "devices": [str(d) for d in jax.devices()],
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }


# --- ours -------------------------------------------------------------------------------------


def _run_config(mode: str, args):
  """configs/default.py:MODE with the toy model and this benchmark's batch, lengths and KL."""
  import dataclasses

  from configs import default
  from experiments import sweep
  from trace_jax.config import RunConfig

  overrides = {f"model.{k}": v for k, v in MODEL.items()}
  overrides.update(
    {
      "batch_prompts": args.prompts,
      "rl.num_generations": args.generations,
      "rl.kl_coef": KL_COEF,
      "rl.ppo_epochs": 1,
      "rl.minibatches": 1,
      "rollout.max_new_tokens": args.new_tokens,
      "rollout.temperature": 1.0,
      "data.max_prompt_len": args.prompt_len,
      "sft.steps": 0,
      "steps": 1 + args.warmup + args.steps,
      "seed": args.seed,
    }
  )
  overrides.update(_parse_sets(args.set))
  run = RunConfig.from_config(sweep.configure(default.get_config(mode), overrides))
  # No tokenizer: every id of the vocabulary can be sampled and EOS never ends a response.
  sampling = dataclasses.replace(run.sampling, eos_id=-1, pad_id=0, vocab_size=0, banned_ids=())
  return dataclasses.replace(run, sampling=sampling)


def _parse_sets(items: list[str]) -> dict:
  """['trace.diagnostics=False', 'trainer_dtype=float32'] -> {dotted key: Python literal or string}."""
  import ast

  out = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep:
      raise ValueError(f"--set {item!r}: expected KEY=VALUE")
    try:
      out[key.strip()] = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
      out[key.strip()] = value.strip()
  return out


def even_fraction(responses):
  """The reward of both sides: the fraction of even token ids in each response [N, R]."""
  import numpy as np

  return np.mean(np.asarray(responses) % 2 == 0, axis=1).astype(np.float32)


def _prompt_batches(args, count: int):
  """`count` batches of random prompts (ids 3 .. vocab-1, unpadded), the same for every system."""
  import numpy as np

  rng = np.random.default_rng(args.seed)
  return [rng.integers(3, MODEL["vocab_size"], (args.prompts, args.prompt_len)).astype(np.int32) for _ in range(count)]


def initial_params(args):
  """The policy both sides start from (our init, as init_state draws it for every mode)."""
  import jax

  from trace_jax import cluster, trainer

  run = _run_config("bf16", args)
  init_key = jax.random.split(jax.random.key(run.job.seed), 3)[0]  # as train_and_evaluate splits it
  optimizer = trainer.make_optimizer(run.optim, run.job.steps)
  return run.model, trainer.init_state(run.model, optimizer, init_key, cluster.Topology.single_device().trainer).params


class Ours:
  """One mode's RLStep, built as train_and_evaluate builds it, and its state; `step` times one call."""

  def __init__(self, mode: str, args, counter: CompileCounter):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from trace_jax import cluster, train, trainer

    self.mode, self.args, self.counter = mode, args, counter
    run = _run_config(mode, args)
    topology = cluster.Topology.single_device()
    init_key, rollout_key, _ = jax.random.split(jax.random.key(run.job.seed), 3)
    optimizer = trainer.make_optimizer(run.optim, run.job.steps)
    self.state = trainer.init_state(run.model, optimizer, init_key, topology.trainer)
    reference = jax.tree_util.tree_map(jnp.copy, self.state.params)  # the frozen KL anchor (updates donate state)

    def reward_fn(answers, responses):
      del answers
      return even_fraction(responses), np.zeros(len(responses), bool)

    self.rl_step = train.RLStep.build(run, topology, optimizer, reward_fn, rollout_key, reference)
    # the steps whose engine records the agreement diagnostics' full codes (trace.diagnostics_every)
    self.diagnostic = lambda step: run.mode.rollout.record_codes and train.diagnostic_step(run, step)
    self.diagnostics_every = run.trace.diagnostics_every if run.mode.rollout.record_codes else 0

  def step(self, step: int, tokens) -> dict:
    import numpy as np

    from trace_jax import data

    n = len(tokens)
    prompts = data.PromptBatch(
      tokens=tokens,
      mask=np.ones_like(tokens, bool),
      prompts=[""] * n,
      answers=[""] * n,
      difficulty=np.zeros(n, np.int32),
      indices=np.arange(n),
      metadata=[{}] * n,
      step=step,
    )
    before = self.counter.mark()
    wall, cpu = time.perf_counter(), time.process_time()
    self.state, metrics = self.rl_step(step, self.state, prompts)  # metrics are host floats: the step is done
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = self.counter.mark()
    row = {
      "wall_s": wall,
      "cpu_s": cpu,
      "rollout_s": metrics["time/rollout_s"],
      "train_s": metrics["time/train_s"],
      "compiles": after[0] - before[0],
      "compile_s": after[1] - before[1],
      "compiled": self.counter.names[before[2] : after[2]],
      "finite": bool(metrics["finite"]),
      "response_length": metrics["response/length_mean"],
      "reward": metrics["reward/mean"],
      "diagnostics": bool(self.diagnostic(step)),
    }
    print(
      f"  ours {self.mode:>5} step {step}: {wall:7.3f} s wall ({cpu:6.2f} s CPU), rollout {row['rollout_s']:.3f} s, "
      f"train {row['train_s']:.3f} s, {row['compiles']} compiles ({row['compile_s']:.2f} s), "
      f"response length {row['response_length']:.0f}",
      flush=True,
    )
    return row


def bench_ours(modes: list[str], args, prompt_batches, counter: CompileCounter, tunix=None) -> tuple[dict, dict | None]:
  """Every mode's first call (compiles), then Tunix's (`tunix`: a started TunixWorker, or None),
  then the later steps round-robin over the modes and Tunix, so that other jobs on the machine slow
  every system alike. Returns ({mode: figures}, Tunix's figures or None)."""
  rows = {}
  for mode in modes:  # built and compiled one after the other
    ours = Ours(mode, args, counter)
    rows[mode] = (ours, [ours.step(0, prompt_batches[0])])
  if tunix is not None:
    tunix.step()  # its first call, while ours wait
  for step in range(1, len(prompt_batches)):
    for ours, mode_rows in rows.values():
      mode_rows.append(ours.step(step, prompt_batches[step]))
    if tunix is not None:
      tunix.step()
  figures = {mode: _figures(mode_rows, args.warmup, ours.diagnostics_every) for mode, (ours, mode_rows) in rows.items()}
  return figures, (tunix.finish() if tunix is not None else None)


def _figures(rows: list[dict], warmup: int, diagnostics_every: int = 0) -> dict:
  """Per-system figures from per-step rows (first call, warm-up, timed steps): medians over the timed
  steps, and the fastest one (less sensitive to other jobs on the same cores).

  diagnostics_every n > 1 (a mode whose engine records the agreement diagnostics on every n-th step,
  `diagnostics` in the rows): `step_s_run`, the mean step of a long run, is (n - 1) x the median step
  without them + the median step with them, over n; the goals are judged on it. Otherwise (and for
  Tunix) it is the median step."""
  for r in rows:  # what the split does not name: the reference log-probs, rewards, transfers, metrics
    r["other_s"] = r["wall_s"] - r["rollout_s"] - r.get("train_s", 0.0)
  timed = rows[1 + warmup :]
  med = lambda key: statistics.median(r[key] for r in timed)
  out = {
    "first_call_s": rows[0]["wall_s"],
    "first_call_compiles": rows[0]["compiles"],
    "first_call_compile_s": rows[0]["compile_s"],
    "step_s": med("wall_s"),
    "step_s_min": min(r["wall_s"] for r in timed),
    "step_cpu_s": med("cpu_s"),
    "rollout_s": med("rollout_s"),
    "other_s": med("other_s"),
    "steps_s": [r["wall_s"] for r in timed],
    "compiles_after_first": [r["compiles"] for r in rows[1:]],
    "compiled_after_first": sorted({name for r in rows[1:] for name in r["compiled"]}),
    "compiled_in_timed_steps": sorted({name for r in timed for name in r["compiled"]}),
  }
  out["step_s_run"] = out["step_s"]
  with_codes = [r["wall_s"] for r in timed if r.get("diagnostics")]
  without = [r["wall_s"] for r in timed if not r.get("diagnostics")]
  if diagnostics_every > 1 and with_codes and without:
    n, lean, diagnosed = diagnostics_every, statistics.median(without), statistics.median(with_codes)
    out.update(step_s_without_diagnostics=lean, step_s_with_diagnostics=diagnosed, diagnostics_every=n)
    out["step_s_run"] = ((n - 1) * lean + diagnosed) / n
  if "train_s" in rows[0]:
    out["train_s"] = med("train_s")
  for key in ("finite", "response_length", "reward"):
    if key in rows[-1]:
      out[f"last_{key}"] = rows[-1][key]
  return out


# --- Tunix ------------------------------------------------------------------------------------


def _tunix_version(python: str) -> str | None:
  """Tunix's version in `python`, or None if it does not import there."""
  code = "import importlib.metadata as m, tunix.rl.grpo.grpo_learner; print(m.version('google-tunix'))"
  try:
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
  except (OSError, subprocess.TimeoutExpired):
    return None
  return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None


def _install_tunix(venv: str) -> str:
  """A venv at `venv` that sees our packages (--system-site-packages), with Tunix installed in it."""
  python = os.path.join(venv, "bin", "python")
  if not os.path.exists(python):
    print(f"tunix: creating the venv {venv} (--system-site-packages)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
  print(f"tunix: pip install {TUNIX_PACKAGE} into {venv}", flush=True)
  subprocess.run([python, "-m", "pip", "install", TUNIX_PACKAGE], check=True)
  return python


def _tunix_python(args) -> tuple[str | None, str]:
  """(the interpreter to run Tunix with, or None to skip; what was decided, in words)."""
  if args.tunix == "skip":
    return None, "skipped (--tunix=skip)" if not args.smoke else "skipped (--smoke)"
  venv_python = os.path.join(args.tunix_venv, "bin", "python")
  python = args.tunix_python or (venv_python if os.path.exists(venv_python) else sys.executable)
  version = _tunix_version(python)
  if version is None and args.tunix == "install":
    python = _install_tunix(args.tunix_venv) if not args.tunix_python else args.tunix_python
    if args.tunix_python:
      subprocess.run([python, "-m", "pip", "install", TUNIX_PACKAGE], check=True)
    version = _tunix_version(python)
  if version is None:
    how = (
      f"python -m venv --system-site-packages {args.tunix_venv} && "
      f"{venv_python} -m pip install {TUNIX_PACKAGE}   (or rerun with --tunix=install)"
    )
    return None, f"skipped: Tunix does not import in {python}; to install it: {how}"
  return python, f"google-tunix {version} in {python}"


class TunixWorker:
  """The Tunix half in `python` (a subprocess) from our `params`, driven one global step at a time.

  The parameters cross as a Hugging Face checkpoint; our fp32 logits of the first prompt batch go
  along, so that the worker can report how far its model's logits are from ours (the same policy).
  Two pipes pace it: at the start of each global step (and at the end of the loop) the worker says
  "ready" and waits for "go"; `step()` sends one "go" and waits for the next "ready". Its step
  times run from "go" to the next "ready", so the waits between steps are not in them. `finish()`
  waits for the worker to exit and returns its figures.
  """

  def __init__(self, python: str, args, prompt_batches, config, params):
    import jax.numpy as jnp
    import numpy as np

    from trace_jax import hf, model, qat

    self.timeout, self.steps_left = args.tunix_timeout, len(prompt_batches)
    self.tmp = tempfile.TemporaryDirectory()
    tmp = self.tmp.name
    weights_dir = os.path.join(tmp, "weights")
    hf.save_pretrained(weights_dir, config, params)
    tokens = jnp.asarray(prompt_batches[0])
    logits, _ = model.forward(
      params, tokens, jnp.ones_like(tokens), config, ctx=qat.QatContext(compute_dtype=jnp.float32)
    )
    np.save(os.path.join(tmp, "ours_logits.npy"), np.asarray(logits, np.float32))
    go_read, self.go = os.pipe()
    self.ready, ready_write = os.pipe()
    self.spec = {
      "model": MODEL,
      "weights_dir": weights_dir,
      "ours_logits": os.path.join(tmp, "ours_logits.npy"),
      "prompts": [b.tolist() for b in prompt_batches],
      "generations": args.generations,
      "prompt_len": args.prompt_len,
      "new_tokens": args.new_tokens,
      "kl_coef": KL_COEF,
      "warmup": args.warmup,
      "dtype": args.tunix_dtype,
      "optim": _optim_spec(args),
      "out": os.path.join(tmp, "tunix.json"),
      "go_fd": go_read,
      "ready_fd": ready_write,
    }
    spec_path = os.path.join(tmp, "spec.json")
    with open(spec_path, "w") as f:
      json.dump(self.spec, f)
    cmd = [python, os.path.abspath(__file__), "--_tunix_worker", spec_path, "--threads", str(args.threads)]
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the worker adds its thread flags to the caller's own
    if args.xla_flags_before is not None:
      env["XLA_FLAGS"] = args.xla_flags_before
    self.start = time.monotonic()
    self.proc = subprocess.Popen(cmd, env=env, pass_fds=(go_read, ready_write))
    os.close(go_read)
    os.close(ready_write)  # the worker holds the only write end: its exit reads as end of file
    self._wait_ready()  # the model loaded and the learner built, at the start of its first step

  def _wait_ready(self):
    import select

    left = self.timeout - (time.monotonic() - self.start)
    readable, _, _ = select.select([self.ready], [], [], max(left, 0))
    if not readable:
      self.proc.kill()
      raise RuntimeError(f"Tunix worker: no progress within --tunix_timeout={self.timeout} s; stopped it")
    if os.read(self.ready, 1) != b"r":
      code = self.proc.wait()
      raise RuntimeError(f"Tunix worker exited (code {code}) before finishing its steps; its output is above")

  def step(self):
    """One Tunix global step; returns when it has finished."""
    if self.steps_left <= 0:
      raise RuntimeError("TunixWorker.step: every prompt batch has been run")
    os.write(self.go, b"g")
    self._wait_ready()
    self.steps_left -= 1

  def finish(self) -> dict:
    try:
      code = self.proc.wait(timeout=max(self.timeout - (time.monotonic() - self.start), 1))
      if code:
        raise RuntimeError(f"Tunix worker exited with code {code}; its output is above")
      with open(self.spec["out"]) as f:
        return json.load(f)
    finally:
      os.close(self.go)
      os.close(self.ready)
      self.tmp.cleanup()


def _optim_spec(args) -> dict:
  import dataclasses

  run = _run_config("bf16", args)
  return {**dataclasses.asdict(run.optim), "total_steps": run.job.steps}


def tunix_worker(spec_path: str):
  """The Tunix half, in the interpreter that has Tunix (imports nothing from trace_jax)."""
  with open(spec_path) as f:
    spec = json.load(f)
  import warnings

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx
  from tunix.models.qwen3 import model as qwen3_model
  from tunix.models.qwen3 import params as qwen3_params
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout

  warnings.filterwarnings("ignore", message=".*with mesh:.*", category=DeprecationWarning)  # Tunix's own idiom
  counter = CompileCounter()
  m = spec["model"]
  vocab, new_tokens, prompt_len = m["vocab_size"], spec["new_tokens"], spec["prompt_len"]
  dtype = jnp.dtype(spec["dtype"])
  config = qwen3_model.ModelConfig(
    num_layers=m["num_layers"],
    vocab_size=vocab,
    embed_dim=m["hidden_size"],
    hidden_dim=m["moe_intermediate_size"],
    num_heads=m["num_heads"],
    head_dim=m["head_dim"],
    num_kv_heads=m["num_kv_heads"],
    rope_theta=int(m["rope_theta"]),
    norm_eps=1e-6,
    use_tied_embedding=m["tie_word_embeddings"],
    num_experts=m["num_experts"],
    num_experts_per_tok=m["num_experts_per_tok"],
    dtype=dtype,
    param_dtype=jnp.float32,
  )
  auto = (jax.sharding.AxisType.Auto,) * 2  # Tunix's models shard by constraints (jax.make_mesh's default: Explicit)
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=auto, devices=jax.devices()[:1])
  same_weights = True
  try:
    with mesh:
      reference = qwen3_params.create_model_from_safe_tensors(spec["weights_dir"], config, mesh, dtype=jnp.float32)
  except Exception as e:  # noqa: BLE001  (report and fall back to Tunix's own random init)
    print(f"tunix: could not load our weights ({type(e).__name__}: {e}); random init instead", flush=True)
    same_weights = False
    with mesh:
      reference = qwen3_model.Qwen3(config, rngs=nnx.Rngs(0))
  graph, state = nnx.split(reference)
  actor = nnx.merge(graph, jax.tree.map(jnp.copy, state))

  # The same policy as ours? Tunix's logits of the first prompt batch (a full causal forward) against ours.
  tokens = jnp.asarray(spec["prompts"][0], jnp.int32)
  b, n = tokens.shape
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))
  with mesh:
    logits, _ = reference(tokens, jnp.broadcast_to(jnp.arange(n), (b, n)), None, causal)
  logit_diff = float(np.max(np.abs(np.asarray(logits, np.float32) - np.load(spec["ours_logits"]))))
  print(f"tunix: max |logit - ours| on the first prompt batch: {logit_diff:.3g}", flush=True)

  class IdTokenizer:
    """Whitespace-separated decimal ids <-> ids; PAD outside the vocabulary, no BOS, no EOS."""

    def encode(self, text, **kwargs):
      return [int(t) for t in text.split()]

    def decode(self, ids, **kwargs):
      return " ".join(str(int(i)) for i in ids)

    def bos_id(self):
      return None

    def eos_id(self):
      return -1

    def pad_id(self):
      return vocab

  def reward(prompts, completions, **kwargs):
    return [float(np.mean([int(t) % 2 == 0 for t in c.split()])) if c.split() else 0.0 for c in completions]

  o = spec["optim"]
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0 if o["warmup_steps"] else o["learning_rate"],
    peak_value=o["learning_rate"],
    warmup_steps=o["warmup_steps"],
    decay_steps=max(o["total_steps"], o["warmup_steps"] + 1),
    end_value=o["learning_rate"] * o["end_lr_fraction"],
  )
  optimizer = optax.chain(
    optax.clip_by_global_norm(o["grad_clip"]),
    optax.adamw(schedule, b1=o["b1"], b2=o["b2"], weight_decay=o["weight_decay"]),
  )
  batches = spec["prompts"]
  roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
  cluster_config = rl_cluster_lib.ClusterConfig(
    role_to_mesh={role: mesh for role in roles},
    rollout_engine="vanilla",
    offload_to_cpu=False,
    training_config=rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optimizer,
      eval_every_n_steps=10**9,
      max_steps=len(batches),
    ),
    rollout_config=base_rollout.RolloutConfig(
      max_tokens_to_generate=new_tokens,
      max_prompt_length=prompt_len,
      kv_cache_size=prompt_len + new_tokens,
      temperature=1.0,
      top_p=1.0,
      top_k=None,
      eos_tokens=[-1],
    ),
  )
  cluster = rl_cluster_lib.RLCluster(
    actor=actor, reference=reference, tokenizer=IdTokenizer(), cluster_config=cluster_config
  )
  learner = grpo_learner.GrpoLearner(
    rl_cluster=cluster,
    algo_config=grpo_learner.GrpoConfig(
      num_generations=spec["generations"], num_iterations=1, beta=spec["kl_coef"], epsilon=0.2
    ),
    reward_fns=reward,
  )

  # Per-step timestamps: the start of each global step (after the parent's "go"), and when the next
  # one is ready to start or the loop ends (close()).
  starts, readies, marks, rollout_s, cpu, lengths, end = [], [], [], [], [], [], {}
  run_global_step, generate, close = learner._run_global_step, cluster.generate, cluster.close

  def paced():
    """Tell the parent this step may start, and wait for its go (no pipes: go at once)."""
    readies.append(time.perf_counter())
    if spec.get("ready_fd") is not None:
      os.write(spec["ready_fd"], b"r")
      if os.read(spec["go_fd"], 1) != b"g":
        raise RuntimeError("Tunix worker: the benchmark process went away")

  def timed_global_step(*a, **k):
    paced()
    starts.append(time.perf_counter())
    cpu.append(time.process_time())
    marks.append(counter.mark())
    return run_global_step(*a, **k)

  def timed_generate(*a, **k):
    t0 = time.perf_counter()
    out = generate(*a, **k)  # tokens come back as host numpy arrays: the rollout has finished
    rollout_s.append(time.perf_counter() - t0)
    lengths.extend(len(t) for t in out.tokens)
    return out

  def timed_close(*a, **k):
    end.update(t=time.perf_counter(), cpu=time.process_time(), mark=counter.mark())
    if spec.get("ready_fd") is not None:
      os.write(spec["ready_fd"], b"r")  # the last step is done
    return close(*a, **k)

  learner._run_global_step, cluster.generate, cluster.close = timed_global_step, timed_generate, timed_close
  dataset = [{"prompts": np.array([" ".join(map(str, row)) for row in b])} for b in batches]  # repeated G x
  with mesh:
    learner.train(dataset)
  ends = [*readies[1:], end["t"]]  # a step ends when the next is ready to start: the waits for "go" are left out
  cpu_ends = [*cpu[1:], end["cpu"]]  # waiting in a read takes no CPU time
  mark_ends = [*marks[1:], end["mark"]]
  rows = [
    {
      "wall_s": e - s,
      "cpu_s": ce - cs,
      "rollout_s": r,
      "compiles": me[0] - ms[0],
      "compile_s": me[1] - ms[1],
      "compiled": counter.names[ms[2] : me[2]],
    }
    for s, e, cs, ce, ms, me, r in zip(starts, ends, cpu, cpu_ends, marks, mark_ends, rollout_s)
  ]
  for i, r in enumerate(rows):
    print(
      f"  tunix step {i}: {r['wall_s']:7.3f} s wall ({r['cpu_s']:6.2f} s CPU), rollout {r['rollout_s']:.3f} s, "
      f"{r['compiles']} compiles ({r['compile_s']:.2f} s)",
      flush=True,
    )
  if len(rows) != len(batches):
    raise RuntimeError(f"Tunix ran {len(rows)} global steps, expected {len(batches)}")
  figures = _figures(rows, spec["warmup"])
  figures.update(
    same_weights=same_weights,
    max_abs_logit_diff_vs_ours=logit_diff,
    dtype=spec["dtype"],
    completion_length_mean=float(np.mean(lengths)) if lengths else 0.0,
    tunix_version=__import__("importlib.metadata").metadata.version("google-tunix"),
    jax=jax.__version__,
  )
  with open(spec["out"], "w") as f:
    json.dump(figures, f)


# --- main -------------------------------------------------------------------------------------


def _ratios(ours: dict, tunix: dict | None, key: str) -> dict:
  """{'MODE/tunix': ours / Tunix for every mode, 'trace/qat'} of the figure `key` (where both exist)."""
  ratios = {f"{mode}/tunix": r[key] / tunix[key] for mode, r in ours.items()} if tunix else {}
  if "trace" in ours and "qat" in ours:
    ratios["trace/qat"] = ours["trace"][key] / ours["qat"][key]
  return ratios


def report(args, ours: dict, tunix: dict | None, tunix_status: str) -> tuple[dict, dict, dict]:
  """Print the table and the goal lines. Returns (ratios of a run's mean step, `step_s_run`; the same of
  the median CPU seconds per step; whether each goal is met by the first)."""
  ratios, ratios_cpu, goals = _ratios(ours, tunix, "step_s_run"), _ratios(ours, tunix, "step_cpu_s"), {}
  print(
    f"\n{args.prompts} prompts x G={args.generations}, prompt {args.prompt_len}, {args.new_tokens} new tokens "
    f"(EOS off), {args.threads} XLA thread(s); median of {args.steps} steps after the first call and "
    f"{args.warmup} warm-up step(s); 'run' is a long run's mean step, diagnostics on every n-th\n"
    "| system | first call s | step s (median) | step s (min) | step s (run) | CPU s/step | rollout s | train s | "
    "other s | compiles after the first call |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  )
  systems = [(f"ours {m}", r) for m, r in ours.items()] + ([(f"tunix ({tunix['dtype']})", tunix)] if tunix else [])
  for name, r in systems:
    train_s = f"{r['train_s']:.3f}" if "train_s" in r else "-"
    run_s = r.get("step_s_run", r["step_s"])
    print(
      f"| {name} | {r['first_call_s']:.2f} | {r['step_s']:.3f} | {r['step_s_min']:.3f} | {run_s:.3f} | "
      f"{r['step_cpu_s']:.2f} | {r['rollout_s']:.3f} | {train_s} | {r['other_s']:.3f} | {sum(r['compiles_after_first'])} |"
    )
  for name, r in systems:
    if "diagnostics_every" in r:
      print(
        f"{name}: {r['step_s_without_diagnostics']:.3f} s a step without the diagnostics' codes, "
        f"{r['step_s_with_diagnostics']:.3f} s with them (every {r['diagnostics_every']}th step)"
      )
  verdict = lambda ok: "meets" if ok else "misses"
  line = lambda key, name: f"{name} step: {ratios[key]:.3f}"
  cpu = lambda key: f"; CPU seconds per step: {ratios_cpu[key]:.3f}"
  if not tunix:
    print(f"ours / Tunix step: not measured (Tunix {tunix_status})")
  for key in ratios:
    if key.endswith("/tunix"):
      goals[key] = ratios[key] <= GOAL_VS_TUNIX
      mode = key.split("/")[0]
      print(f"{line(key, f'ours {mode} / Tunix')} ({verdict(goals[key])} the <= {GOAL_VS_TUNIX} goal){cpu(key)}")
  if "trace/qat" in ratios:
    goals["trace/qat"] = ratios["trace/qat"] <= GOAL_TRACE_VS_QAT
    ok = verdict(goals["trace/qat"])
    print(f"{line('trace/qat', 'TRACE / QAT')} ({ok} the <= {GOAL_TRACE_VS_QAT} goal){cpu('trace/qat')}")
  # the first step without the diagnostics' codes compiles its own programs (in the warm-up); the timed must not
  recompiled = {name: r["compiled_in_timed_steps"] for name, r in systems if r.get("compiled_in_timed_steps")}
  print(f"recompiles in the timed steps: {recompiled or 'none'}")
  return ratios, ratios_cpu, goals


def main(argv=None) -> dict:
  args = _args(argv)
  args.xla_flags_before = os.environ.get("XLA_FLAGS")
  _set_xla_threads(args.threads)
  if args._tunix_worker:
    tunix_worker(args._tunix_worker)
    return {}
  # Imported here so that XLA_FLAGS above takes effect.
  import jax

  counter = CompileCounter()
  modes = [m.strip() for m in args.modes.split(",") if m.strip()]
  host = _host_info()
  print(
    f"host: {host['machine']}, {host['cpu_count']} cores, load average {host['load_average_1min']:.1f}; "
    f"XLA_FLAGS={host['xla_flags']!r}; jax {jax.__version__} ({jax.default_backend()})",
    flush=True,
  )
  tunix_python, tunix_status = _tunix_python(args)
  print(f"tunix: {tunix_status}", flush=True)
  calls = 1 + args.warmup + args.steps
  batches = _prompt_batches(args, calls)

  tunix = TunixWorker(tunix_python, args, batches, *initial_params(args)) if tunix_python else None
  ours, tunix = bench_ours(modes, args, batches, counter, tunix)
  ratios, ratios_cpu, goals = report(args, ours, tunix, tunix_status)

  out = {
    "config": {
      "model": MODEL,
      "prompts": args.prompts,
      "generations": args.generations,
      "prompt_len": args.prompt_len,
      "new_tokens": args.new_tokens,
      "kl_coef": KL_COEF,
      "steps": args.steps,
      "warmup": args.warmup,
      "threads": args.threads,
      "smoke": args.smoke,
    },
    "host": host,
    "ours": ours,
    "tunix": tunix,
    "tunix_status": tunix_status,
    "ratios": ratios,
    "ratios_cpu_s": ratios_cpu,
    "goals": {**{f"{m}/tunix": GOAL_VS_TUNIX for m in ours}, "trace/qat": GOAL_TRACE_VS_QAT},
    "meets": goals,
  }
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
    print(f"wrote {args.json}")
  return out


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
  main()
