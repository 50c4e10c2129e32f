"""Choosing an engine or launcher whose package is not installed (Petastorm, Horovod: the
design-card environment only) is one line naming what to install, before any work. Runs in both
environments: ``sys.modules[name] = None`` is Python's own way of making a module unimportable, so
the missing case is exercised where the package is installed too."""
from __future__ import annotations

import sys

import pytest

from pipeline.data.shard_reader import ShardReader
from pipeline.errors import ConfigError
from train_fixtures import write_digit_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_digit_shards(tmp_path_factory.mktemp("ex") / "shards", workers=1, n_train=64, n_test=32,
                              n_val=32, row_group_rows=32)


def test_a_missing_petastorm_is_one_line_naming_what_to_install(shards, tmp_path, monkeypatch, capsys):
    from jobs.train import main as train_main

    monkeypatch.setitem(sys.modules, "petastorm", None)
    w = shards.parent / "worker_000"
    with pytest.raises(ConfigError, match=r"loader.engine='petastorm': petastorm is not installed; pip install "
                                          r"'hep-pipeline\[petastorm\]'"):
        with ShardReader(str(w), 8, "image", engine="petastorm"):
            pass
    rc = train_main(["--manifest", str(shards), "--output", str(tmp_path / "out"), "--launcher", "local",
                     "--set", "loader.engine=petastorm", "--dry-run"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and len(err) == 1 and "hep-pipeline[petastorm]" in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_missing_horovod_is_one_line_naming_what_to_install(shards, tmp_path, monkeypatch, capsys):
    from jobs.train import main as train_main

    monkeypatch.setitem(sys.modules, "horovod", None)
    rc = train_main(["--manifest", str(shards), "--output", str(tmp_path / "out"), "--launcher", "horovod",
                     "--dry-run"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and len(err) == 1 and "launcher='horovod': horovod is not installed" in err[0], err
    assert "scripts/build_horovod.sh" in err[0]



def test_no_module_imports_petastorm_or_horovod_at_import():
    """Importing every module of the package (but the Petastorm filesystem adapter, whose job it is)
    leaves Petastorm and Horovod unimported. In the current environment (pyarrow 26, which has no
    ``pyarrow.filesystem`` any more) the same walk shows that no module needs the legacy API."""
    import subprocess

    code = """
import importlib, pkgutil, sys
import pipeline
for m in pkgutil.walk_packages(pipeline.__path__, "pipeline."):
    if m.name != "pipeline.data.petastorm_fs":
        importlib.import_module(m.name)
print(sorted(n for n in sys.modules if n.split(".")[0] in ("petastorm", "horovod")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
