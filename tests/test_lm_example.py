"""The GPT-style LM example through ``autotune tune``, by way of its H200 runner in tiny size on a CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import yaml

REPO = Path(__file__).resolve().parent.parent


def test_the_lm_example_tunes_and_its_runner_writes_the_evidence(tmp_path: Path) -> None:
    # The example's own space, shrunk to what a 2-core CPU runs in seconds: the tiny model, fp32, a budget
    # of 8 optimizer steps; the new knobs stay in, and the probe removes the attention kernels a CPU lacks.
    doc = yaml.safe_load((REPO / "search_spaces" / "example_gpt_lm.yaml").read_text())
    doc["knobs"]["precision"] = ["fp32"]
    doc["knobs"]["batch_size"] = [16, 32]
    doc["knobs"].pop("compile")
    doc.update(global_batch=32, budget={"samples": 256, "warmup_steps": 1, "windows": 3})
    doc["baseline"]["batch_size"] = 32
    space = tmp_path / "lm_tiny.yaml"
    space.write_text(yaml.safe_dump(doc))
    out = tmp_path / "lm.md"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.runners.lm_h200", "--tiny", "--space", str(space), "--out", str(out),
         "--workdir", str(tmp_path / "work"), "--trials", "2", "--top-k", "0"],
        cwd=REPO, env={**os.environ, "COLUMNS": "400"}, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = out.read_text()
    for value in ("auto", "flash", "math", "explicit"):
        assert f"| attention={value} |" in text
    assert "**NO**" not in text  # every kernel check saw what its knob asked for
    assert "removed by the probe" in text  # efficient and cuDNN attention have no CPU kernels
    assert "block forward ran 2x per step" in text and "aten::_fused_adamw_" in text

    # The study that `autotune tune examples/gpt_lm.py:train` ran, from the tiny fp32 explicit baseline.
    studies = tmp_path / "work" / "studies"
    best = json.loads((studies / "lm" / "best_config.json").read_text())
    assert best["baseline"]["config"]["attention"] == "explicit"
    study = optuna.load_study(study_name="lm", storage=f"sqlite:///{studies}/autotune.db")
    ran = [t for t in study.trials if t.user_attrs.get("status") == "ok"]
    assert len(ran) >= 2 and ran[0].user_attrs["role"] == "reference"
    assert all(t.user_attrs["accuracy_verdict"] in ("equivalent", "unchecked", "degraded") for t in ran)
    assert all(t.user_attrs["extra:tokens_per_sequence"] == 32 for t in ran if "extra:tokens_per_sequence" in t.user_attrs)
    removed = study.user_attrs["removed_knobs"]
    assert "attention=efficient" in removed and "attention=cudnn" in removed
    data = json.loads(out.with_suffix(".json").read_text())
    assert [c["status"] for c in data["grid"]] == ["ok"] * len(data["grid"])
    assert "## 3. Tuner study" in text and "Grid best beside it" in text


def test_the_ceiling_runner_sweeps_global_batches_at_equal_steps(tmp_path: Path) -> None:
    out = tmp_path / "ceiling.md"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.runners.lm_ceiling", "--tiny", "--out", str(out), "--batches", "16,64",
         "--steps", "8", "--profile-steps", "2", "--skip", "loss-graph"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["breakdown"]["wall_s"] > 0 and data["breakdown"]["kinds"] == {}  # a CPU has no GPU kernels
    rows = data["batches"]
    assert [r["status"] for r in rows] == ["ok"] * 3
    # The baseline first (the ratios' base), then the pick at each global batch without accumulation.
    assert rows[0]["config"].startswith("fp32 bs64 attention=explicit")
    assert [r["config"].split()[1] for r in rows[1:]] == ["bs16", "bs64"]
    assert "no GPU kernels to break down" in out.read_text()


def test_kernel_kinds() -> None:
    from benchmarks.runners.lm_ceiling import kind_of

    assert kind_of("pytorch_flash::flash_bwd_dq_dk_dv_loop_kernel<...>") == "attention"
    assert kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16") == "attention"
    assert kind_of("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTT") == "matmul"
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert kind_of("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer and gradient clipping"
    assert kind_of("triton_per_fused__log_softmax_nll_loss_0") == "Triton fused (element-wise, norms, loss)"
    assert kind_of("Memset (Device)") == "other"
