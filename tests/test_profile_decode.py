"""experiments/profile_decode.py (issue 43): self times from nested profiler events, parts from HLO metadata,
and the smoke run end to end (one engine); experiments/bench_scaling.py (built on its decode program): the
growth check and its smoke run."""

import json

import pytest

from experiments import bench_scaling, profile_decode


def test_self_time_removes_the_children_and_names_the_parent():
  events = [
    {"ph": "X", "pid": 1, "tid": 1, "name": "cond.1", "ts": 0, "dur": 10},
    {"ph": "X", "pid": 1, "tid": 1, "name": "ynn_fusion.2", "ts": 1, "dur": 6},
    {"ph": "X", "pid": 1, "tid": 1, "name": "convert.3", "ts": 7, "dur": 2},
    {"ph": "X", "pid": 1, "tid": 1, "name": "sort.4", "ts": 12, "dur": 3},
    {"ph": "X", "pid": 1, "tid": 2, "name": "sort.4", "ts": 0, "dur": 1},  # another thread: not a child
    {"ph": "i", "pid": 1, "tid": 1, "name": "marker", "ts": 3},
    {"ph": "X", "pid": 1, "tid": 1, "name": "Runtime::Launch", "ts": 2, "dur": 1},  # not a thunk: left out
    {"ph": "X", "pid": 1, "tid": 1, "name": "add.5", "ts": 14.999, "dur": 2},  # starts as sort.4 ends (rounding)
  ]
  got = profile_decode._self_times(events, keep=lambda n: not n.startswith("Runtime"))
  assert got["cond.1"] == (2, None)
  assert got["ynn_fusion.2"] == (6, "cond.1") and got["convert.3"] == (2, "cond.1")
  assert got["sort.4"] == (4, None) and got["add.5"] == (2, None)  # a sibling, not a child
  assert "Runtime::Launch" not in got


def test_parts_come_from_the_most_specific_named_scope():
  hlo = "\n".join(
    [
      "  %ynn_fusion.57 = f32[16,16,128]{2,1,0} fusion(%a, %b), kind=kCustom, calls=%c, "
      'metadata={op_name="jit(f)/while/body/moe/experts/cond/branch_0_fun/dot_general"}',
      '  ROOT %sort.3 = s32[128]{0} sort(%x), metadata={op_name="jit(f)/moe/dispatch/sort"}',
      "  %wrapped_convert.88 = bf16[16,16,256]{2,1,0} fusion(%w), kind=kLoop, calls=%d",
      '  %cond.127.clone.4 = (f32[128,128]{1,0}) conditional(%r, %s), metadata={op_name="jit(f)/moe/experts/cond"}',
    ]
  )
  parts = profile_decode.hlo_parts(hlo)
  assert parts["ynn_fusion.57"] == ("experts", "ynn_fusion")
  assert parts["sort.3"] == ("dispatch", "sort")
  assert parts["wrapped_convert.88"] == (None, "wrapped_convert")
  assert parts["cond.127.clone.4"] == ("experts", "conditional")


def test_useful_work_counts_fp4_bytes_below_bf16():
  config = profile_decode.model_config()
  bf16 = profile_decode.useful_work(config, 64, 80, False, False)
  fp4 = profile_decode.useful_work(config, 64, 80, True, True)
  assert bf16["flops"] == fp4["flops"] > 0
  assert fp4["bytes"] < bf16["bytes"] and fp4["kv_bytes"] == pytest.approx(bf16["kv_bytes"] * 0.5625 / 2)
  mx = profile_decode.useful_work(config, 64, 80, True, True, block_size=32)  # MXFP4: one scale per 32
  assert mx["kv_bytes"] == pytest.approx(bf16["kv_bytes"] * (0.5 + 1 / 32) / 2)


@pytest.mark.slow
def test_profile_smoke_attributes_the_step(tmp_path):
  out = tmp_path / "profile.json"
  result = profile_decode.main(["--smoke", "--engines", "fp4", "--json", str(out), "--md", str(tmp_path / "p.md")])
  (row,) = result["engines"]
  assert row["thunks_per_step"] > 0 and row["thunk_s"] > 0
  assert sum(row["by_part_s"].values()) == pytest.approx(row["thunk_s"])
  assert {"experts", "scores", "kv_cache", "act_quant"} <= set(row["by_part_s"])
  assert row["by_part_s"].get("other", 0) < 0.25 * row["thunk_s"]  # the scopes cover the step
  assert json.loads(out.read_text())["engines"][0]["engine"] == "fp4"
  assert "| experts |" in (tmp_path / "p.md").read_text()


def test_the_growth_check_tells_linear_from_quadratic():
  slots = [80, 528, 2064]
  linear = [0.01 + 1e-5 * s for s in slots]
  quadratic = [0.01 + 1e-8 * s * s for s in slots]
  assert bench_scaling.linear_check(slots, linear)["linear"] is True
  assert bench_scaling.linear_check(slots, linear)["predicted_s"] == pytest.approx(linear[-1])
  assert bench_scaling.linear_check(slots, quadratic)["linear"] is False
  assert bench_scaling.linear_check(slots, [0.02, 0.01, 0.03])["linear"] is None  # noise: no rise to extrapolate


@pytest.mark.slow
def test_scaling_smoke_times_every_system(tmp_path):
  files = {k: str(tmp_path / f"s.{k}") for k in ("json", "md", "png")}
  result = bench_scaling.main(["--smoke", *[f"--{k}={v}" for k, v in files.items()]])
  timed = [r for r in result["rows"] if "step_s" in r]
  assert len(timed) == 3 * 2 * 3 and all(r["tokens_per_s"] > 0 for r in timed)
  assert {r["slots"] for r in timed if r["system"] == "ours fp4"} == {16 + 4, 16 + 8, 16 + 16}
  assert {r["slots"] for r in timed if r["system"] == "transformers float32"} == {16 + 2, 16 + 4, 16 + 8}
  assert len(result["growth"]) == 3 * 2
  assert json.loads((tmp_path / "s.json").read_text())["rows"] == result["rows"]
  assert "| 16 | 2 |" in (tmp_path / "s.md").read_text() and (tmp_path / "s.png").stat().st_size > 0
