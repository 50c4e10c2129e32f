"""Dataset schemas (pipeline.schemas): the registry never writes the repository's schemas/, and
validation enforces nullability and fixed list lengths on the values, naming the column."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.errors import BadInputError, ConfigError
from pipeline.schemas import SCHEMA_DIR, DatasetSchema, load_schema, pad_length, register_schema, validate_parquet


def _tree(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()}


def test_registry_reuses_or_mints_versions_outside_the_reviewed_folder(tmp_path):
    reviewed = tmp_path / "reviewed"
    shutil.copytree(SCHEMA_DIR, reviewed)
    before = _tree(reviewed)
    repo_before = _tree(SCHEMA_DIR)
    a = pa.schema([pa.field("x", pa.float32()), pa.field("y", pa.list_(pa.int32()))])
    b = pa.schema([pa.field("x", pa.float32())])
    # no registry: the version is computed but nothing is written anywhere
    s0 = register_schema("derived/t", a, schema_dir=reviewed)
    assert s0.version == 1 and _tree(reviewed) == before
    reg = tmp_path / "registry"
    s1 = register_schema("derived/t", a, registry_dir=reg, schema_dir=reviewed)
    s2 = register_schema("derived/t", b, registry_dir=reg, schema_dir=reviewed)
    s3 = register_schema("derived/t", a, registry_dir=reg, schema_dir=reviewed)
    assert (s1.version, s2.version, s3.version) == (1, 2, 1)
    assert _tree(reg) == {"derived/t/v1.json", "derived/t/v2.json"}
    assert _tree(reviewed) == before and _tree(SCHEMA_DIR) == repo_before
    # a reviewed version with the same columns is reused; a new one is numbered after it
    hlf = load_schema("hlf", 1, reviewed)
    same = register_schema("hlf", hlf.to_arrow(), registry_dir=reg, schema_dir=reviewed)
    assert same.version == 1 and not (reg / "hlf").exists()
    newer = register_schema("hlf", b, registry_dir=reg, schema_dir=reviewed)
    assert newer.version == max(int(p.stem[1:]) for p in (reviewed / "hlf").glob("v*.json")) + 1
    with pytest.raises(ConfigError, match="reviewed schemas folder"):
        register_schema("derived/u", a, registry_dir=reviewed, schema_dir=reviewed)


SCHEMA = DatasetSchema("t", 1, [
    {"name": "sample_id", "type": "int64", "nullable": False},
    {"name": "note", "type": "string"},
    {"name": "hlf", "type": {"fixed_size_list": "float32", "size": 3}, "nullable": False},
])


def _write(tmp_path: Path, ids, notes, hlf) -> Path:
    d = tmp_path / "ds"
    d.mkdir()
    pq.write_table(pa.table({"sample_id": pa.array(ids, pa.int64()), "note": pa.array(notes, pa.string()),
                             "hlf": pa.array(hlf, pa.list_(pa.float32()))}), d / "part-0.parquet")
    return d


def test_valid_data_passes_and_nullable_columns_may_hold_nulls(tmp_path):
    d = _write(tmp_path, [1, 2], [None, "a"], [[1, 2, 3], [4, 5, 6]])
    assert validate_parquet(d, SCHEMA).names == ["sample_id", "note", "hlf"]


@pytest.mark.parametrize("ids,hlf,needle", [
    ([1, None], [[1, 2, 3], [4, 5, 6]], "column 'sample_id' has 1 null value(s)"),
    ([1, 2], [[1, 2, 3], None], "column 'hlf' has 1 null value(s)"),
    ([1, 2], [[1, 2, 3], [4, 5]], "column 'hlf' has 1 list(s) of length != 3 (first: 2)"),
])
def test_nulls_and_wrong_list_lengths_name_the_column(tmp_path, ids, hlf, needle):
    d = _write(tmp_path, ids, ["a", "b"], hlf)
    with pytest.raises(BadInputError) as e:
        validate_parquet(d, SCHEMA)
    msg = str(e.value)
    assert "\n" not in msg and str(d) in msg and needle in msg, msg


def test_reviewed_feature_schemas_fix_the_list_lengths():
    for name, col, size in (("hlf", "hlf", 14), ("llf", "hlf", 14)):
        s = load_schema(name)
        t = {c["name"]: c["type"] for c in s.columns}[col]
        assert t == {"fixed_size_list": "float32", "size": size}, (name, col)
        raw = json.loads((SCHEMA_DIR / name / f"v{s.version}.json").read_text())
        assert raw["version"] == s.version
    llf = {c["name"]: c for c in load_schema("llf").columns}["llf"]     # v3: real particles, padded by readers
    assert llf["type"] == {"list": "float32"} and llf["pad_to"] == 801 * 19
    assert load_schema("llf", 2).to_arrow().field("llf").metadata is None


def test_a_padded_list_column_carries_its_length_and_refuses_longer_lists(tmp_path):
    s = DatasetSchema("t", 1, [{"name": "x", "type": {"list": "float32"}, "nullable": False, "pad_to": 3}])
    f = s.to_arrow().field("x")
    assert pad_length(f) == 3 and pad_length(pa.field("y", pa.list_(pa.float32()))) is None
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"x": pa.array([[1.0], [], [1.0, 2.0, 3.0]], pa.list_(pa.float32()))},
                            schema=s.to_arrow()), good)
    validate_parquet(good, s)
    assert pad_length(pq.read_schema(good).field("x")) == 3            # the file itself says how to pad
    assert DatasetSchema.from_arrow("t", 1, s.to_arrow()).columns[0]["pad_to"] == 3
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"x": pa.array([[1.0, 2.0, 3.0, 4.0], [1.0]], pa.list_(pa.float32()))}), bad)
    with pytest.raises(BadInputError, match=r"column 'x' has 1 list\(s\) longer than pad_to 3 \(longest: 4\)"):
        validate_parquet(bad, s)


def test_spark_written_lists_are_accepted_when_their_lengths_match(spark, tmp_path):
    from pipeline.outputs import uri

    s = DatasetSchema("t", 1, [{"name": "hlf", "type": {"fixed_size_list": "float32", "size": 2},
                                "nullable": False}])
    out = tmp_path / "spark"
    spark.createDataFrame([([1.0, 2.0],), ([3.0, 4.0],)], "hlf array<float>").write.parquet(uri(out))
    validate_parquet(out, s)
    bad = tmp_path / "spark_bad"
    spark.createDataFrame([([1.0, 2.0],), ([3.0],)], "hlf array<float>").write.parquet(uri(bad))
    with pytest.raises(BadInputError, match="column 'hlf' has 1 list"):
        validate_parquet(bad, s)
