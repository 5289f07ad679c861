"""experiments/regime.py and experiments/outcome.py (issue 41): their statistics on hand-made numbers, and
each end to end on its smoke grid (tiny model, a few steps), read back on a second call."""

import json
import os

import numpy as np
import pytest

from experiments import outcome, regime


def test_paired_difference_and_its_interval():
  rows = [
    {"name": "trace", "seeds": [0, 1, 2, 3], "last:reward/mean:values": [0.9, 0.8, 0.85, 0.95]},
    {"name": "qat", "seeds": [0, 1, 2], "last:reward/mean:values": [0.5, 0.6, 0.55]},
  ]
  got = outcome.paired(rows, "trace", "qat")
  assert got["seeds"] == [0, 1, 2]  # only the seeds both finished
  d = np.array([0.4, 0.2, 0.3])
  half = 4.302652729911275 * d.std(ddof=1) / np.sqrt(3)  # t(0.975, 2 dof)
  assert got["mean"] == pytest.approx(0.3) and got["ci95"] == pytest.approx([0.3 - half, 0.3 + half])
  assert got["separated"]
  rows[1]["last:reward/mean:values"] = [0.5, 0.9, 0.55]  # differences 0.4, -0.1, 0.3: the CI holds 0
  assert not outcome.paired(rows, "trace", "qat")["separated"]
  assert outcome.paired(rows, "trace", "bf16") == {}
  rows[1]["last:reward/mean:values"] = [0.5, 0.4]  # two seeds with the same difference: no call
  assert not outcome.paired(rows, "trace", "qat")["separated"]


def test_pick_applies_the_conditions():
  def rec(width, scope, accuracy, partial, tokens=66):
    return dict(
      width=width,
      horizon="h",
      scope=scope,
      accuracy=accuracy,
      partial=partial,
      response_tokens=tokens,
      ptq_cost=0.0,
      rl_step_s_trace=1.0,
    )

  records = [
    rec(64, "bf16", 0.9, 0.95),
    rec(64, "a", 0.85, 0.9),
    rec(128, "bf16", 0.5, 0.6),
    rec(128, "a", 0.4, 0.5),
    rec(128, "b", 0.1, 0.2),
  ]
  for r in records:
    r["ptq_cost"] = (
      next(x["accuracy"] for x in records if x["width"] == r["width"] and x["scope"] == "bf16") - r["accuracy"]
    )
  best = regime.pick(records)
  assert (best["width"], best["scope"]) == (128, "a")  # cost 10 points, start 60%: (a), (b), (d) hold


@pytest.mark.slow
def test_regime_smoke(tmp_path):
  scopes = "experts+fp8 kv,experts (boundary bf16)"
  records = regime.main(["--smoke", "--out", str(tmp_path), "--scopes", scopes])
  assert [r["scope"] for r in records] == ["bf16", *scopes.split(",")]
  for r in records:
    assert 0 <= r["accuracy"] <= r["partial"] <= 1 and r["sft_s"] > 0 and r["rl_step_s_trace"] > 0
    assert r["ptq_cost"] == pytest.approx(records[0]["accuracy"] - r["accuracy"])
  saved = json.load(open(tmp_path / "table.json"))
  assert saved["records"] == records and saved["picked"]["scope"] != "bf16"
  assert "| 64 | sum1x22 |" in (tmp_path / "table.md").read_text()
  assert regime.main(["--smoke", "--out", str(tmp_path), "--scopes", scopes]) == records  # read back


@pytest.mark.slow
def test_outcome_smoke_writes_the_table_and_resumes(tmp_path, monkeypatch):
  root, out = tmp_path / "runs", tmp_path / "out"
  args = ["--smoke", f"--root={root}", f"--out={out}", "--modes=qat+trm,trace"]
  table = outcome.main(args)
  saved = json.load(open(out / "table.json"))
  assert saved["regime"] == outcome.REGIME and isinstance(saved["ptq_cost"], float)
  for name in ("qat+trm", "trace"):
    m = saved["modes"][name]
    assert m["seeds"] == [0] and m["steps"] == [2]
    for key in ("late_reward", "final_acc_fp4", "final_acc_bf16", "late_abs_dlogp"):
      assert len(m[key]) == 1, key
  assert saved["modes"]["trace"]["agreement_by_layer"] and saved["modes"]["qat+trm"]["routing_by_layer"]
  rows = [
    json.loads(line)
    for line in open(root / "mode=qat,rl.trust_region=max,rl.trust_region_delta=0.1/seed0/metrics.jsonl")
  ]
  assert all("correction/seq_kept_frac" in r for r in rows)
  assert os.path.exists(out / "curves.png") and "| trace | 1 | 2 |" in (out / "table.md").read_text()
  assert (root / ".gitignore").read_text() == outcome.GITIGNORE

  from trace_jax import train

  monkeypatch.setattr(train, "train_and_evaluate", lambda *a, **k: pytest.fail("a finished run was rerun"))
  assert outcome.main(args)["modes"] == table["modes"]
