"""The test services themselves (tests/servers.py): the XRootD server reads a copy made for it and
leaves the permissions of the caller's directories alone; both servers listen on loopback only."""
from __future__ import annotations

import shutil
import stat
from pathlib import Path

import psutil
import pytest

from servers import s3_server, xrootd_server


def _modes(paths) -> dict[str, str]:
    return {str(p): stat.filemode(p.stat().st_mode) for p in paths}


def _listening(pid: int) -> set[tuple[str, int]]:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return {(c.laddr.ip, c.laddr.port) for p in procs for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def test_xrootd_serves_a_private_directory_without_touching_the_callers_permissions(tmp_path, samples_dir):
    import uproot

    from pipeline import fs

    private = tmp_path / "private"          # a directory only its owner may enter, like pytest's tmp root
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    export = private / "export"
    export.mkdir()
    shutil.copy(samples_dir / "nano_dy.root", export / "nano_dy.root")
    (export / "nano_dy.root").chmod(0o600)  # not world-readable either
    watched = [export / "nano_dy.root", export, *export.parents]
    before = _modes(watched)
    with xrootd_server(export, tmp_path) as xrd:
        assert _modes(watched) == before
        assert _listening(xrd.proc.pid) == {("127.0.0.1", xrd.port)}
        with uproot.open(xrd.url(export / "nano_dy.root"), timeout=fs.remote_root_timeout()) as f:
            n = f["Events"].num_entries
        served = xrd.served
        assert not served.is_relative_to(tmp_path)
    assert n == uproot.open(samples_dir / "nano_dy.root")["Events"].num_entries > 0
    assert _modes(watched) == before
    assert not served.exists()              # the server's copy is removed with it
    assert (export / "nano_dy.root").is_file()


def test_s3_server_listens_on_loopback_only(tmp_path):
    with s3_server(tmp_path) as s3:
        port = int(s3.endpoint.rsplit(":", 1)[1])
        listening = _listening(s3.proc.pid)
    assert listening == {("127.0.0.1", port)}, listening


def test_xrootd_url_names_only_paths_under_the_export(tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    with xrootd_server(export, tmp_path) as xrd:
        assert xrd.url(export / "nope.root") == f"root://127.0.0.1:{xrd.port}/{xrd.served}/nope.root"
        with pytest.raises(ValueError):
            xrd.url(tmp_path / "elsewhere.root")
