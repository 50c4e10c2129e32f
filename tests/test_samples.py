"""The sample-file cache: two processes fetching at once (two test workers, two jobs on a fresh
machine) both end with the complete folder; a failed fetch is never taken for a complete one."""
from __future__ import annotations

import pytest

from pipeline.samples import install_fetched


def _fetched(folder, text):
    folder.mkdir()
    (folder / "delphes.root").write_text(text)
    return folder


def test_the_first_fetch_installs_its_folder(tmp_path):
    out = tmp_path / "samples"
    install_fetched(_fetched(tmp_path / "staging", "ours"), out)
    assert (out / "delphes.root").read_text() == "ours"


def test_a_fetch_that_lost_the_race_keeps_the_complete_folder_already_there(tmp_path):
    out = _fetched(tmp_path / "samples", "theirs")
    install_fetched(_fetched(tmp_path / "staging", "ours"), out)
    assert (out / "delphes.root").read_text() == "theirs"


def test_an_incomplete_folder_in_the_way_is_an_error_not_a_cache_hit(tmp_path):
    out = tmp_path / "samples"
    out.mkdir()
    (out / "stray.txt").write_text("not ours")
    with pytest.raises(OSError):
        install_fetched(_fetched(tmp_path / "staging", "ours"), out)
    assert (out / "stray.txt").is_file()
