"""Reading a committed Parquet dataset in Spark tasks through pyarrow.fs (pipeline/inputs.py), on a
local path and on a real S3 server (moto, loopback), with the suite's local Spark session: no
Hadoop S3A connector is installed here, so the S3 case can only pass through the tasks' own reads."""
from __future__ import annotations

import pyarrow as pa
import pytest

from pipeline import fs
from pipeline.commit import output_job
from pipeline.errors import BadInputError
from pipeline.inputs import dataset_files, parquet_frame, read_parquet
from servers import environment, s3_server


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path)
        return
    server = request.getfixturevalue("s3")
    with environment(**server.env("writer")):
        yield f"s3://{server.bucket}/{tmp_path.name}"


def _dataset(out: str, parts: int = 3, rows: int = 50) -> None:
    """``parts`` files of ids (part i: ids i*rows ...) and a list column, committed by the driver."""
    with output_job(out) as job:
        for i in range(parts):
            ids = list(range(i * rows, (i + 1) * rows))
            job.write_table(f"part-{i:05d}.parquet", pa.table({
                "id": pa.array(ids, pa.int64()), "x": pa.array([[float(v), -float(v)] for v in ids],
                                                              pa.list_(pa.float32()))}), row_group_size=20)
        job.write_json("_report.json", {"parts": parts})


def test_parquet_frame_reads_the_committed_files(spark, root):
    out = f"{root}/data"
    _dataset(out)
    if not fs.location(out).is_local:                   # an object beside the committed files is not read
        fs.write_bytes(fs.location(out).child("part-99999.parquet"), b"PAR1 stray")
    assert [u.rsplit("/", 1)[1] for u in dataset_files(out)] == [f"part-{i:05d}.parquet" for i in range(3)]
    rows = parquet_frame(spark, out, files_per_task=2, file_column="file").collect()
    assert sorted((r.id, tuple(r.x), r.file) for r in rows) == [(i, (float(i), -float(i)), i // 50) for i in range(150)]
    ids = parquet_frame(spark, out, columns=["id"]).groupBy().sum("id").collect()[0][0]
    assert ids == sum(range(150))
    assert read_parquet(dataset_files(out)[1], ["id"]).column("id").to_pylist() == list(range(50, 100))
    with pytest.raises(BadInputError, match="no column 'y'"):
        parquet_frame(spark, out, columns=["y"])


def test_missing_and_uncommitted_inputs_are_one_line(s3, tmp_path):
    with pytest.raises(BadInputError, match="not found"):
        dataset_files(tmp_path / "nothing")
    with environment(**s3.env("writer")):
        half = f"s3://{s3.bucket}/half"
        fs.write_bytes(fs.location(half).child("part-0.parquet"), b"PAR1")
        with pytest.raises(BadInputError, match="incomplete"):
            dataset_files(half)
    empty = tmp_path / "empty"
    with output_job(empty) as job:
        job.write_json("_report.json", {})
    with pytest.raises(BadInputError, match="holds no .parquet files"):
        dataset_files(empty)
