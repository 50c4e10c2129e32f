"""The Delta table readers docs/ingestion.md shows exit cleanly (issue 52, item 8).

``DeltaTable(t).to_pyarrow_table()`` (deltalake 1.6.6, pyarrow 14, Python 3.11) reads the right rows
and then aborts the interpreter at exit (exit 134) in about half of fresh runs: an Arrow thread
releases a page buffer of delta-rs's Python filesystem after the interpreter began finalizing
(docs/ingestion.md#reading-a-table-the-snapshot-never-the-folder). The fault shows only at the exit of
a fresh interpreter, so each reader runs in 20 of them and every one must exit 0 and print the
table's rows. Spark's reader is left out: 20 Spark starts cost minutes, and the JVM reads the files
(no Python object on an Arrow thread); its ``snapshot_files`` call is the first reader here.
"""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pytest

REPO = Path(__file__).resolve().parents[1]
RUNS = 20

# Each reader as docs/ingestion.md writes it (``T``: the table's path), and what it prints.
READERS = {
    "snapshot_files + pyarrow.dataset": (
        'ds.dataset(files, format="parquet", partitioning="hive", partition_base_dir="runs/hep/table").to_table()',
        "import pyarrow.dataset as ds\nfrom pipeline.tables.snapshot import snapshot_files\n"
        "files = snapshot_files(T)\n"
        "arrow = ds.dataset(files, format='parquet', partitioning='hive', partition_base_dir=T).to_table()\n"
        "print(sorted(arrow.column('a').to_pylist()), sorted(arrow.column('sample').to_pylist()))"),
    "file_uris + pyarrow.dataset": (
        'ds.dataset(DeltaTable(t).file_uris(), format="parquet", partitioning="hive", partition_base_dir=t)',
        "import pyarrow.dataset as ds\nfrom deltalake import DeltaTable\nt = T\n"
        "arrow = ds.dataset(DeltaTable(t).file_uris(), format='parquet', partitioning='hive', "
        "partition_base_dir=t).to_table()\n"
        "print(sorted(arrow.column('a').to_pylist()), sorted(arrow.column('sample').to_pylist()))"),
    "polars": (
        'pl.read_delta("runs/hep/table")',
        "import polars as pl\ndf = pl.read_delta(T)\n"
        "print(sorted(df['a'].to_list()), sorted(df['sample'].to_list()))"),
    "QueryBuilder": (
        'QueryBuilder().register("t", DeltaTable(t)).execute("select * from t").read_all()',
        "from deltalake import DeltaTable, QueryBuilder\n"
        "r = QueryBuilder().register('t', DeltaTable(T)).execute('select * from t').read_all()\n"
        "print(sorted(r.column('a').to_pylist()), sorted(r.column('sample').to_pylist()))"),
}
EXPECTED = "[1, 2, 3] ['qcd', 'ttbar', 'ttbar']"


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> str:
    from deltalake import write_deltalake

    t = str(tmp_path_factory.mktemp("readers") / "table")
    write_deltalake(t, pa.table({"a": [1, 2, 3], "sample": ["ttbar", "qcd", "ttbar"]}), partition_by=["sample"])
    return t


def _run(code: str) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(REPO))
    return r.returncode, (r.stdout.strip().splitlines() or [""])[-1] + r.stderr.strip()[-200:]


def test_the_documented_readers_are_the_ones_tested():
    doc = (REPO / "docs" / "ingestion.md").read_text()
    for name, (documented, _) in READERS.items():
        assert documented in doc, f"docs/ingestion.md no longer shows the reader {name!r}: update this test"


@pytest.mark.slow   # 80 fresh interpreters (4 readers x 20, ~0.9 s of imports each, 2 at a time): 73 s on 2 busy cores
@pytest.mark.parametrize("name", list(READERS))
def test_documented_reader_exits_cleanly_in_fresh_interpreters(table, name):
    code = f"T = {table!r}\n" + READERS[name][1]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(_run, [code] * RUNS))
    bad = [(rc, out) for rc, out in results if rc != 0 or out != EXPECTED]
    assert not bad, f"{name}: {len(bad)} of {RUNS} fresh runs failed, first: exit {bad[0][0]}: {bad[0][1]}"
