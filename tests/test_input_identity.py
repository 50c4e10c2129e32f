"""What identifies an input of an only-new run (issue 52, item 6): its real path (a symlink or a
folder reached through one is not a new file), an opt-in SHA-256 of its content (size and
modification time can repeat: ``cp -p``, ``touch -r``), and an ``s3://`` object's ETag from a HEAD
request. Real Delta tables (deltalake writes the log and its commit records), real files, and the
real S3 server on loopback; the runs' inputs are chosen by ``select_inputs``, as ``ingest_root`` does."""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from servers import environment
from store_fixtures import s3  # noqa: F401 - the S3 server fixture

from pipeline.errors import BadInputError
from pipeline.fs import location, write_bytes
from pipeline.ingest.root import IngestRootConfig
from pipeline.ingest.root.table import select_inputs
from pipeline.tables import deltalog
from pipeline.tables.ledger import read_ledger, same_file, source_stat


def _cfg(inputs, out, **kw) -> IngestRootConfig:
    return IngestRootConfig(input=inputs, tree="Events", output=str(out), output_format="delta", mode="new_files",
                            **kw)


def _commit(table, stats: list[dict]) -> None:
    """One real commit whose ledger holds ``stats`` (a data file each), as ingest_root records them."""
    loc = location(str(table))
    os.makedirs(table, exist_ok=True)
    adds, sources = [], []
    for i, st in enumerate(stats):
        name = f"part-{i:05d}.parquet"
        pq.write_table(pa.table({"x": [i]}), os.path.join(table, name))
        adds.append({"path": name, "size": os.path.getsize(os.path.join(table, name)), "rows": 1})
        sources.append({**st, "entries": 1, "rows": 1, "parts": [{"path": name, "rows": 1}]})
    read = deltalog.snapshot(loc).version if deltalog.is_table(loc) else None
    deltalog.commit(loc, read, adds, [], pa.schema([("x", pa.int64())]), [], {"stage": "ingest_root",
                                                                               "sources": sources})


def test_a_symlink_or_a_folder_reached_through_one_is_not_a_new_input(tmp_path, capsys):
    land = tmp_path / "land" / "ttbar"
    land.mkdir(parents=True)
    (land / "a.root").write_bytes(b"a" * 100)
    (tmp_path / "alias").symlink_to(tmp_path / "land")                   # a second name of the folder
    (land / "b.root").symlink_to(land / "a.root")                         # a second name of the file
    table = tmp_path / "table"
    _commit(str(table), [source_stat(str(land / "a.root"))])

    via_folder = str(tmp_path / "alias" / "ttbar" / "a.root")
    run = select_inputs(_cfg([via_folder], table), [via_folder], location(str(table)))
    assert run.files == [] and run.selection.unchanged == [via_folder]
    run = select_inputs(_cfg([str(land / "b.root")], table), [str(land / "b.root")], location(str(table)))
    assert run.files == [] and run.held == 1

    # a new file named twice in one run is read once, with one line saying so
    (land / "c.root").write_bytes(b"c" * 100)
    twice = [str(land / "c.root"), str(tmp_path / "alias" / "ttbar" / "c.root")]
    capsys.readouterr()
    run = select_inputs(_cfg(twice, table), twice, location(str(table)))
    assert run.files == [twice[0]] and run.selection.duplicates == [twice[1]]
    assert f"{twice[1]}: the same file as the input {twice[0]}" in capsys.readouterr().out
    # the record keeps the name the run was given (the partition value comes from it) and the real path
    assert source_stat(via_folder)["file"] == via_folder
    assert source_stat(via_folder)["real"] == str(land / "a.root")


def test_checksum_identity_sees_new_content_with_the_same_size_and_mtime(tmp_path):
    f = tmp_path / "land" / "a.root"
    f.parent.mkdir()
    f.write_bytes(b"first content...")
    table = tmp_path / "table"
    _commit(str(table), [source_stat(str(f), checksum=True)])
    st = os.stat(f)
    f.write_bytes(b"other content!!!")                                   # same size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))                     # touch -r: the same mtime

    run = select_inputs(_cfg([str(f)], table, on_changed="skip"), [str(f)], location(str(table)))
    assert run.selection.unchanged == [str(f)]                           # by stat it is the file held: the limit
    with pytest.raises(BadInputError, match=r"a\.root: changed since the table ingested it at version 0 .*sha256"):
        select_inputs(_cfg([str(f)], table, input_identity="checksum"), [str(f)], location(str(table)))
    run = select_inputs(_cfg([str(f)], table, input_identity="checksum", on_changed="replace"), [str(f)],
                        location(str(table)))
    assert run.files == [str(f)] and run.selection.replace == ["part-00000.parquet"]
    assert run.selection.replaced == [str(f)]

    # the same bytes again: unchanged under checksum identity too
    f.write_bytes(b"first content...")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    run = select_inputs(_cfg([str(f)], table, input_identity="checksum"), [str(f)], location(str(table)))
    assert run.files == [] and run.selection.unchanged == [str(f)]


def test_s3_inputs_are_known_by_the_etag_of_a_head_request(tmp_path, s3):
    with environment(**s3.env("writer")):
        uri = f"s3://{s3.bucket}/{tmp_path.name}/land/a.root"
        loc = location(uri)
        write_bytes(loc, b"x" * 64)
        first = source_stat(uri)
        info = loc.filesystem().get_file_info(loc.path)
        assert first["etag"] and first["size"] == 64
        assert first["mtime_ns"] == info.mtime_ns                            # the same value as pyarrow's stat
        assert source_stat(uri) == first                                     # a second look: the same object

        table = tmp_path / "table"
        _commit(str(table), [first])
        assert read_ledger(location(str(table))).sources[uri]["etag"] == first["etag"]
        write_bytes(loc, b"y" * 64)                                          # same size, maybe the same second
        second = source_stat(uri)
        assert second["etag"] != first["etag"] and not same_file(first, second)
        with pytest.raises(BadInputError, match="changed since the table ingested it.*etag"):
            select_inputs(_cfg([uri], table), [uri], location(str(table)))
        assert source_stat(f"s3://{s3.bucket}/{tmp_path.name}/land/missing.root")["size"] is None
