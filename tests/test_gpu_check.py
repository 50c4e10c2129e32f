"""scripts/gpu_check.py (``make gpu-check``) on a host without CUDA: one line, non-zero exit."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_without_cuda_it_says_so_in_one_line_and_fails(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: run make gpu-check instead")
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--workdir", str(tmp_path / "w")],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 1
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA device"), lines
    assert not (tmp_path / "w").exists()                  # nothing was run
