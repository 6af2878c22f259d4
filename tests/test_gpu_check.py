"""scripts/gpu_check.sh, the GPU acceptance run: `--smoke` runs the same steps at toy sizes on
the CPU (tests/test_cuda.py, bench/gpu.py, bench/rl.py through the HTTP server) and writes the
summary; the summary fails the run when a step failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check_summary  # noqa: E402


@pytest.mark.slow
def test_the_smoke_run_passes_every_step_and_writes_the_summary(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)  # the script sets its own
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["smoke"] is True
    assert {name: step["exit"] for name, step in summary["steps"].items()} == {
        "test_cuda": 0,
        "gpu": 0,
        "rl": 0,
    }
    values = {f["figure"]: f["value"] for f in summary["figures"]}
    for figure in ("train_mfu", "sample_mixed_over_base", "tenants4_throughput_over_1"):
        assert isinstance(values[figure], float) and values[figure] > 0, figure
    assert values["graphs_over_eager_8_rows"] is None  # no CUDA graphs on the CPU
    assert all(f["meets_target"] is None for f in summary["figures"])  # smoke measures nothing
    assert summary["environment"]["device"]["device"] == "cpu"
    assert summary["cuda_graphs"]["start_up"]["enabled"] is False
    for name in ("gpu.json", "rl.json", "test_cuda.log", "gpu.log", "rl.log"):
        assert (tmp_path / name).is_file(), name
    rl = json.loads((tmp_path / "rl.json").read_text())
    assert rl["device"] == "cpu" and rl["environment"]["device"]["device"] == "cpu"


def test_the_summary_fails_the_run_when_a_step_failed(tmp_path, capsys):
    (tmp_path / "gpu.json").write_text(
        json.dumps({"train_mfu": 0.41, "graphs_over_eager_8_rows": 1.2})
    )
    code = gpu_check_summary.main(
        [
            "--results",
            str(tmp_path),
            "--smoke",
            "0",
            "--steps",
            "test_cuda=0:40",
            "gpu=0:100",
            "rl=124:150",
        ]
    )
    assert code == 1
    assert "failed steps: rl" in capsys.readouterr().out
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    meets = {f["figure"]: f["meets_target"] for f in summary["figures"]}
    assert meets["train_mfu"] is True and meets["graphs_over_eager_8_rows"] is False
    assert meets["tenants4_throughput_over_1"] is None  # rl.json was never written
    with pytest.raises(SystemExit, match="NAME=STATUS:SECONDS"):
        gpu_check_summary.main(["--results", str(tmp_path), "--smoke", "0", "--steps", "gpu"])
