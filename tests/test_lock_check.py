"""scripts/lock_current.sh --check: the lock of the current environment checked offline."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(root / "scripts" / "lock_current.sh"), "--check"], capture_output=True,
                          text=True, timeout=60)


def test_the_lock_check_passes_on_the_lock_and_names_a_pin_that_breaks_a_requirement(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "lock_current.sh", tmp_path / "scripts")
    for f in ("requirements-current.in", "requirements-current.txt", "requirements-airflow.txt"):
        shutil.copy(REPO / f, tmp_path / f)
    r = _check(tmp_path)
    assert r.returncode == 0 and "satisfies the" in r.stdout, r.stderr
    lock = tmp_path / "requirements-current.txt"
    text = lock.read_text()
    lock.write_text(text.replace("\npyarrow==26.0.1\n", "\npyarrow==25.0.0\n"))
    r = _check(tmp_path)
    assert r.returncode == 1 and "pyarrow==26.0.1 is not satisfied by the pin pyarrow==25.0.0" in r.stderr, r.stderr
    lock.write_text(text.replace("\npyarrow==26.0.1\n", "\n"))
    r = _check(tmp_path)
    assert r.returncode == 1 and "pyarrow==26.0.1 is not pinned" in r.stderr, r.stderr
