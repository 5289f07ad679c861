"""Pretrained inputs made here, offline: tiny random Hugging Face MoE checkpoints (transformers, bf16,
one sharded), a small byte-level BPE with a Qwen-style chat template, and GSM8K- / MATH-style JSONL.

  python tests/pretrained.py DIR    writes DIR/qwen3 (a checkpoint with its tokenizer) and DIR/math.jsonl,
                                    for the CPU smoke run of configs/hf_math.py
"""

import json
import os
import pathlib
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages

# Qwen2.5 / Qwen3's template without tools: a system message if given, the turns, then the assistant's opening.
CHAT_TEMPLATE = (
  "{%- if messages[0]['role'] == 'system' %}"
  "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
  "{%- endif %}"
  "{%- for message in messages %}"
  "{%- if message['role'] != 'system' %}"
  "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
  "{%- endif %}"
  "{%- endfor %}"
  "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GSM8K = [
  {
    "question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
    "answer": "48/2 = 24\n#### 72",
  },
  {
    "question": "Weng earns $12 an hour. She worked 50 minutes. How much did she earn?",
    "answer": "12/60*50 = 10\n#### 10",
  },
  {"question": "Betty has half of the $100 she needs. Her parents give $15. How much more?", "answer": "#### 35"},
  {"question": "James writes 3 pages to 2 friends twice a week. Pages a year?", "answer": "3*2*2*52 = 624\n#### 624"},
]
MATH = [
  {"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "solution": "It is $\\boxed{\\frac{3}{4}}$."},
  {"problem": "Solve $2x = 8$.", "solution": "So $x = \\boxed{4}$."},
  {"problem": "What is $\\sqrt{16}$?", "solution": "$\\boxed{4}$"},
  {"problem": "Compute $3 \\cdot 7$.", "solution": "$3 \\cdot 7 = \\boxed{21}$"},
]


def corpus() -> list[str]:
  rows = [r["question"] + " " + r["answer"] for r in GSM8K] + [r["problem"] + " " + r["solution"] for r in MATH]
  return rows * 10 + ["The answer is \\boxed{42}. 0123456789 +-*/=()"] * 10


def write_tokenizer(path: pathlib.Path, vocab_size: int = 320) -> pathlib.Path:
  """tokenizer.json (a byte-level BPE trained on the math rows), tokenizer_config.json with the chat
  template (EOS <|im_end|>, PAD <|endoftext|>, no BOS: as Qwen's) and generation_config.json."""
  import tokenizers  # noqa: PLC0415

  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
    vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
  )
  tok.train_from_iterator(corpus(), trainer)
  path.mkdir(parents=True, exist_ok=True)
  tok.save(str(path / "tokenizer.json"))
  config = {
    "tokenizer_class": "Qwen2Tokenizer",
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "bos_token": None,
    "chat_template": CHAT_TEMPLATE,
    "model_max_length": 4096,
  }
  (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
  ids = {name: tok.token_to_id(name) for name in SPECIAL}
  generation = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"]}
  (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
  return path


# The checkpoints' models: configs/default.py's smallest (SMOKE) and the tiny hybrid, over a 384-row embedding
# (the tokenizer has 320 ids: the rows past it stay unsampled), as config.json describes them.
VOCAB = 384


def hf_config(arch: str, **fields) -> dict:
  """config.json's fields of the preset for `arch` ('qwen3_moe' or 'qwen3_5_moe') with ModelConfig `fields`."""
  from configs import default, models  # noqa: PLC0415
  from trace_jax import config, hf  # noqa: PLC0415

  if arch == "qwen3_moe":
    smoke = {k.removeprefix("model."): v for k, v in default.SMOKE.items() if k.startswith("model.")}
    base = {**models.tiny().to_dict(), **smoke}
  else:
    base = {**models.tiny_hybrid().to_dict(), "num_layers": 2, "full_attention_interval": 2}
  return hf.config_to_hf(config.model_config({**base, "vocab_size": VOCAB, **fields}), dtype="bfloat16")


def write_checkpoint(path: pathlib.Path, arch: str = "qwen3_moe", *, shard: str | None = None, seed: int = 0, **fields):
  """A tiny random model saved by transformers in bf16 (shard: e.g. '20KB' for model-0000x-of-... shards;
  fields: ModelConfig fields, e.g. num_layers),
  weights N(0, 0.1) and norms near 1 so that logits are O(1) and routing decisive; with the tokenizer."""
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  fields = hf_config(arch, **fields)
  if arch == "qwen3_moe":
    config, cls = transformers.Qwen3MoeConfig(**fields), transformers.Qwen3MoeForCausalLM
  else:
    config, cls = transformers.Qwen3_5MoeTextConfig(**fields), transformers.Qwen3_5MoeForCausalLM
  torch.manual_seed(seed)
  model = cls(config)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("A_log"):
        continue
      p.copy_(1 + 0.1 * torch.randn_like(p) if p.ndim == 1 and "norm" in name else 0.1 * torch.randn_like(p))
  model = model.to(torch.bfloat16)
  kwargs = {} if shard is None else {"max_shard_size": shard}
  model.save_pretrained(path, **kwargs)
  write_tokenizer(path)
  return path


def write_jsonl(path: pathlib.Path, rows) -> pathlib.Path:
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def batch(vocab: int = 320, rows: int = 2, length: int = 12, pad: int = 4):
  """Token ids and a mask with one left-padded row: what the parity checks feed both models."""
  import numpy as np  # noqa: PLC0415

  tokens = np.random.default_rng(0).integers(0, vocab, (rows, length))
  mask = np.ones((rows, length), np.int32)
  mask[1, :pad] = 0
  return tokens, mask


def logits_worker(ckpt: str, out: str, devices: int, num_processes: int, process_id: int, port: int, mesh: str):
  """Load `ckpt` with hf.load_sharded onto a mesh of `devices` CPU devices per process ('fsdp=2,expert=4'),
  and write the logits of `batch()` (fp32) to OUT.npy, and what this process read to OUT.json: the
  experts it read and the peak of numpy's host allocations during the load (tracemalloc)."""
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
  import tracemalloc  # noqa: PLC0415

  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from trace_jax import hf, model, qat, sharding  # noqa: PLC0415

  if num_processes > 1:
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id)
  shape = {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
  shape.update({k: int(v) for k, v in (part.split("=") for part in mesh.split(",") if part)})
  m = sharding.make_mesh(shape)
  read = []
  load = hf.load_pretrained

  def spy(*args, **kwargs):
    read.append(str(kwargs.get("experts")))
    return load(*args, **kwargs)

  hf.load_pretrained = spy
  tracemalloc.start()
  config, params = hf.load_sharded(ckpt, m)
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  tokens, mask = batch(config.vocab_size)
  ctx = qat.QatContext(compute_dtype=jnp.float32)
  logits = jax.jit(lambda p, t, k: model.forward(p, t, k, config, ctx=ctx)[0])(
    params, jnp.asarray(tokens), jnp.asarray(mask)
  )
  logits = sharding.to_host(logits)
  if process_id == 0:
    np.save(out + ".npy", logits)
  with open(f"{out}.{process_id}.json", "w") as f:
    json.dump({"experts": read, "peak_host_bytes": peak}, f)


if __name__ == "__main__":
  if sys.argv[1] == "logits":
    logits_worker(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:8]), sys.argv[8])
    sys.exit(0)
  out = pathlib.Path(sys.argv[1])
  write_checkpoint(out / "qwen3")
  write_jsonl(out / "math.jsonl", GSM8K + MATH)
  print(f"wrote {out / 'qwen3'} and {out / 'math.jsonl'}")
