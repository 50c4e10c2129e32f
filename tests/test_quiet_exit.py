"""Nothing is printed after the final line: pytest's summary line is the last line of a real test
run that used the XRootD client (whose exit handler walks every live object, which made torch print
a FutureWarning after the summary), and a job's SUMMARY line is the last line of its output."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from shell_fixtures import REPO, VENV_BIN, clean_env, lines

pytestmark = pytest.mark.slow


def test_pytest_summary_is_the_last_line_after_xrootd_tests():
    r = subprocess.run([sys.executable, "-m", "pytest", "tests/test_fs.py", "-k", "uproot_reads_root_over_xrootd",
                        "-q", "-p", "no:cacheprovider"], cwd=REPO, capture_output=True, text=True, timeout=600)
    out = lines(r.stdout + r.stderr)
    assert r.returncode == 0, "\n".join(out[-20:])
    assert re.match(r"^1 passed\b.* in [\d.]+s", out[-1]), out[-4:]


def test_a_job_that_imports_xrootd_and_torch_ends_with_its_summary(tmp_path, delphes_root):
    """A job process with both clients loaded (the XRootD client through fsspec, torch through the
    training stage): the SUMMARY line is the last line, also after the interpreter's exit handlers."""
    code = ("import sys, torch.distributed, XRootD.client\n"
            "from jobs.ingest_root import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    r = subprocess.run([str(VENV_BIN / "python"), "-c", code, "--input", str(delphes_root), "--tree", "Delphes",
                        "--set", "filter_name=[Muon.PT]", "--output", str(tmp_path / "out")], cwd=tmp_path,
                       env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    out = lines(r.stdout)
    assert r.returncode == 0, "\n".join(out[-20:])
    assert out[-1].startswith("SUMMARY ingest_root: "), out[-4:]
