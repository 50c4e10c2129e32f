"""spark.read.format("root"): the PySpark 4 Python Data Source over the real NanoAOD samples."""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.ingest.root import plan_chunks

NANO = ["nano_dy.root", "nano_dimuon.root"]


@pytest.fixture(scope="module")
def root_format(spark):
    from pipeline.ingest.datasource import register

    register(spark)
    return spark


def test_sql_filter_and_aggregation_equal_uproot(root_format, samples_dir):
    import awkward as ak
    import uproot
    from pyspark.sql.types import ArrayType, DecimalType, FloatType, LongType

    spark = root_format
    paths = ",".join(str(samples_dir / n) for n in NANO)
    df = (spark.read.format("root").option("tree", "Events").option("filter_name", "Muon_pt,Muon_charge,nMuon,event")
          .option("step_size", "15").load(paths))
    chunks = plan_chunks([str(samples_dir / n) for n in NANO], "Events", ["Muon_pt"], 15, progress=False).chunks
    assert df.rdd.getNumPartitions() == len(chunks) > 2                 # one partition per planned chunk
    types = {f.name: f.dataType for f in df.schema.fields}
    assert types["nMuon"] == LongType() and types["event"] == DecimalType(20, 0)   # uint32, uint64 widened
    assert types["Muon_pt"] == ArrayType(FloatType(), True)
    df.createOrReplaceTempView("events")
    got = spark.sql("""SELECT count(*) AS n, sum(nMuon) AS muons, max(event) AS last,
                              sum(aggregate(Muon_pt, 0D, (acc, x) -> acc + x)) AS sum_pt
                       FROM events WHERE nMuon >= 2 AND Muon_charge[0] + Muon_charge[1] = 0""").collect()[0]
    arrs = [uproot.open(samples_dir / n)["Events"].arrays(["Muon_pt", "Muon_charge", "nMuon", "event"]) for n in NANO]
    a = ak.concatenate(arrs)
    two = a[a.nMuon >= 2]
    sel = two[(two.Muon_charge[:, 0] + two.Muon_charge[:, 1]) == 0]
    assert got["n"] == len(sel) > 0
    assert got["muons"] == int(ak.sum(sel.nMuon))
    assert int(got["last"]) == int(ak.max(sel.event))
    assert got["sum_pt"] == pytest.approx(float(ak.sum(ak.values_astype(sel.Muon_pt, np.float64))), rel=1e-9)


def test_user_schema_reads_only_its_columns(root_format, samples_dir):
    df = (root_format.read.format("root").schema("nMuon long").option("filter_name", "Muon_pt,nMuon")
          .load(str(samples_dir / "nano_dy.root")))
    rows = df.collect()
    assert df.columns == ["nMuon"] and len(rows) == 40


def test_bad_file_and_unknown_option_name_themselves(root_format, samples_dir, bad_delphes_root):
    with pytest.raises(Exception) as ei:
        root_format.read.format("root").option("tree", "Events").load(str(bad_delphes_root)).count()
    last = [line for line in str(ei.value).splitlines() if line.startswith("pipeline.errors.")]
    assert last == [f"pipeline.errors.BadInputError: {bad_delphes_root}: no tree 'Events' in the file "
                    "(not found: 'Events' (with any cycle number))"]
    with pytest.raises(Exception) as ei:
        root_format.read.format("root").option("treee", "Events").load(str(samples_dir / "nano_dy.root")).count()
    last = [line for line in str(ei.value).splitlines() if line.startswith("pipeline.errors.")]
    assert len(last) == 1 and "unknown option 'treee' of format root" in last[0]
