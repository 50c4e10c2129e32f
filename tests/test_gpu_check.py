"""scripts/gpu_check.py (``make gpu-check``) on a host without CUDA: one line, non-zero exit."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_without_cuda_it_says_so_in_one_line_and_fails(tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides any GPU from the script, so this runs on GPU hosts too
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--workdir", str(tmp_path / "w")],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 1
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA device"), lines
    assert not (tmp_path / "w").exists()                  # nothing was run
