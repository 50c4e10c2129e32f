"""Versioned dataset schemas: the contract between stages.

A schema is a JSON file ``schemas/<name>/v<N>.json``::

    {"name": "images", "version": 1, "description": "...",
     "columns": [{"name": "sample_id", "type": "int64", "nullable": false, "description": "..."},
                 {"name": "image", "type": {"list": "uint8"}}, ...]}

Types: arrow primitive names (``int32``, ``int64``, ``float32``, ``float64``, ``bool``,
``string``, ``uint8``, ...), ``{"list": T}``, ``{"fixed_size_list": T, "size": N}`` and
``{"struct": [{"name": ..., "type": T}, ...]}``.
A list column may declare ``"pad_to": N``: its lists hold at most N values (the real ones; a
variable-length layout stored without padding) and readers that need one length per row pad them
with zeros to N. The Arrow field then carries the metadata ``{PAD_KEY: "N"}`` (:func:`pad_length`),
which Parquet files written with pyarrow keep, so a reader of the data alone knows the length.
``load_schema`` gives the newest version unless one is asked for; ``validate`` checks a
dataset's Arrow schema against it (names, types, nullability, fixed list lengths, lists no longer
than ``pad_to``) and names the
first offending column.

``schemas/`` in the repository holds only versioned, reviewed contracts and is never written at
run time. A stage that derives a schema from its input (ROOT ingestion) calls
:func:`register_schema`, which reuses a reviewed or registered version with the same columns and
otherwise mints the next version number; the new version is written only to a configured
*registry directory* (and, by the stage, next to its output as ``_schema.json``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from .errors import BadInputError, ConfigError
from .outputs import local_path

SCHEMA_DIR = Path(__file__).resolve().parents[1] / "schemas"

_PRIMITIVES = {
    "bool": pa.bool_(), "int8": pa.int8(), "int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(),
    "uint8": pa.uint8(), "uint16": pa.uint16(), "uint32": pa.uint32(), "uint64": pa.uint64(),
    "float16": pa.float16(), "float32": pa.float32(), "float64": pa.float64(),
    "string": pa.string(), "large_string": pa.large_string(), "binary": pa.binary(),
}
_PRIM_NAMES = {v: k for k, v in _PRIMITIVES.items()}

#: Arrow field metadata of a padded list column: the length its lists are padded to (``pad_to``)
PAD_KEY = b"pipeline.pad_to"


def pad_length(f: pa.Field) -> Optional[int]:
    """The ``pad_to`` length of a list field (from its metadata), None when it has none."""
    md = f.metadata or {}
    return int(md[PAD_KEY]) if PAD_KEY in md else None


def _field(c: dict) -> pa.Field:
    md = {PAD_KEY: str(int(c["pad_to"])).encode()} if c.get("pad_to") is not None else None
    return pa.field(c["name"], type_from_json(c["type"]), nullable=c.get("nullable", True), metadata=md)


def type_from_json(t: Any) -> pa.DataType:
    if isinstance(t, str):
        if t not in _PRIMITIVES:
            raise ConfigError(f"unknown schema type {t!r}")
        return _PRIMITIVES[t]
    if isinstance(t, dict) and "list" in t:
        return pa.list_(type_from_json(t["list"]))
    if isinstance(t, dict) and "large_list" in t:
        return pa.large_list(type_from_json(t["large_list"]))
    if isinstance(t, dict) and "fixed_size_list" in t:
        return pa.list_(type_from_json(t["fixed_size_list"]), int(t["size"]))
    if isinstance(t, dict) and "struct" in t:
        return pa.struct([pa.field(f["name"], type_from_json(f["type"]), nullable=f.get("nullable", True))
                          for f in t["struct"]])
    raise ConfigError(f"unknown schema type {t!r}")


def type_to_json(t: pa.DataType) -> Any:
    if t in _PRIM_NAMES:
        return _PRIM_NAMES[t]
    if pa.types.is_fixed_size_list(t):
        return {"fixed_size_list": type_to_json(t.value_type), "size": t.list_size}
    if pa.types.is_large_list(t):
        return {"large_list": type_to_json(t.value_type)}
    if pa.types.is_list(t):
        return {"list": type_to_json(t.value_type)}
    if pa.types.is_struct(t):
        return {"struct": [{"name": f.name, "type": type_to_json(f.type), "nullable": f.nullable} for f in t]}
    raise ConfigError(f"arrow type {t} has no schema JSON form")


@dataclass
class DatasetSchema:
    name: str
    version: int
    columns: list[dict]
    description: str = ""
    metadata: dict = field(default_factory=dict)

    def to_arrow(self) -> pa.Schema:
        return pa.schema([_field(c) for c in self.columns])

    def to_spark(self):
        from pyspark.sql.pandas.types import from_arrow_schema
        return from_arrow_schema(self.to_arrow())

    @property
    def column_names(self) -> list[str]:
        return [c["name"] for c in self.columns]

    def to_json(self) -> dict:
        return {"name": self.name, "version": self.version, "description": self.description,
                "columns": self.columns, "metadata": self.metadata}

    @classmethod
    def from_arrow(cls, name: str, version: int, schema: pa.Schema, description: str = "",
                   metadata: Optional[dict] = None) -> "DatasetSchema":
        cols = [{"name": f.name, "type": type_to_json(f.type), "nullable": f.nullable,
                 **({"pad_to": pad_length(f)} if pad_length(f) is not None else {})} for f in schema]
        return cls(name, version, cols, description, metadata or {})


def schema_versions(name: str, schema_dir: Path = SCHEMA_DIR) -> list[int]:
    d = Path(schema_dir) / name
    if not d.is_dir():
        return []
    return sorted(int(p.stem[1:]) for p in d.glob("v*.json") if p.stem[1:].isdigit())


def load_schema(name: str, version: Optional[int] = None, schema_dir: Path = SCHEMA_DIR) -> DatasetSchema:
    versions = schema_versions(name, schema_dir)
    if not versions:
        raise ConfigError(f"no schema named {name!r} under {schema_dir}")
    v = versions[-1] if version is None else version
    p = Path(schema_dir) / name / f"v{v}.json"
    if not p.is_file():
        raise ConfigError(f"schema {name!r} has no version {v} (have {versions})")
    d = json.loads(p.read_text())
    return DatasetSchema(d["name"], int(d["version"]), d["columns"], d.get("description", ""), d.get("metadata", {}))


def _shape(columns: list[dict]) -> list[tuple]:
    """What makes two column lists the same schema: names, types, nullability, padding (not descriptions)."""
    return [(c["name"], json.dumps(c["type"], sort_keys=True), bool(c.get("nullable", True)), c.get("pad_to"))
            for c in columns]


def register_schema(name: str, schema: pa.Schema, description: str = "", metadata: Optional[dict] = None,
                    registry_dir: Optional[Path] = None, schema_dir: Path = SCHEMA_DIR) -> DatasetSchema:
    """The version of a derived schema: a reviewed (``schema_dir``) or registered (``registry_dir``)
    version with exactly these columns is returned as is, so alternating inputs do not mint new
    versions; otherwise the next version number is minted and written under ``registry_dir``
    (nothing is written when it is None: the caller stores the schema next to its output).
    ``schema_dir`` is only read."""
    dirs = [Path(schema_dir)] + ([Path(registry_dir)] if registry_dir is not None else [])
    found = {(v, d) for d in dirs for v in schema_versions(name, d)}
    versions = sorted({v for v, _ in found})
    candidate = DatasetSchema.from_arrow(name, (versions[-1] + 1) if versions else 1, schema, description, metadata)
    for v, d in sorted(found, reverse=True):
        existing = load_schema(name, v, d)
        if _shape(existing.columns) == _shape(candidate.columns):
            return existing
    if registry_dir is not None:
        if Path(registry_dir).resolve() == Path(schema_dir).resolve():
            raise ConfigError(f"schema registry {registry_dir} is the reviewed schemas folder; "
                              "derived schemas go to another directory")
        p = Path(registry_dir) / name / f"v{candidate.version}.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(candidate.to_json(), indent=2) + "\n")
    return candidate


def _compatible(actual: pa.DataType, expected: pa.DataType) -> bool:
    if actual == expected:
        return True
    # Spark writes list element fields named "element"; compare value types only.
    if pa.types.is_list(actual) and pa.types.is_list(expected):
        return _compatible(actual.value_type, expected.value_type)
    if pa.types.is_large_list(actual) and pa.types.is_list(expected):
        return _compatible(actual.value_type, expected.value_type)
    if pa.types.is_fixed_size_list(actual) and pa.types.is_fixed_size_list(expected):
        return actual.list_size == expected.list_size and _compatible(actual.value_type, expected.value_type)
    # Parquet/Spark store fixed-size lists as plain lists: the length is checked on the values
    if (pa.types.is_list(actual) or pa.types.is_large_list(actual)) and pa.types.is_fixed_size_list(expected):
        return _compatible(actual.value_type, expected.value_type)
    if pa.types.is_large_string(actual) and pa.types.is_string(expected):
        return True
    if pa.types.is_struct(actual) and pa.types.is_struct(expected):
        return actual.num_fields == expected.num_fields and all(
            a.name == e.name and _compatible(a.type, e.type) for a, e in zip(actual, expected))
    return False


def validate(actual: pa.Schema, expected: DatasetSchema, where: str, allow_extra: bool = True) -> None:
    """Raise BadInputError naming ``where`` and the first missing or mistyped column. Nullability
    and fixed list lengths are properties of the values (Spark declares every column nullable and
    writes fixed-size lists as plain lists): :func:`validate_data` / :func:`validate_parquet`."""
    exp = expected.to_arrow()
    for f in exp:
        idx = actual.get_field_index(f.name)
        if idx < 0:
            raise BadInputError(f"{where}: missing column {f.name!r} required by schema {expected.name} v{expected.version}")
        got = actual.field(idx).type
        if not _compatible(got, f.type):
            raise BadInputError(f"{where}: column {f.name!r} has type {got}, schema {expected.name} "
                                f"v{expected.version} wants {f.type}")
    if not allow_extra:
        extra = [n for n in actual.names if n not in expected.column_names and not n.startswith("__")]
        if extra:
            raise BadInputError(f"{where}: unexpected column {extra[0]!r} (schema {expected.name} v{expected.version})")


def _column_error(col: pa.ChunkedArray, expected: pa.Field) -> Optional[str]:
    """What in the values of ``col`` breaks ``expected``: a null where none is allowed, or a
    list whose length differs from a ``fixed_size_list`` size, or one longer than ``pad_to``. None
    when the values comply."""
    import pyarrow.compute as pc

    if not expected.nullable and col.null_count:
        return f"has {col.null_count} null value(s) but schema says nullable: false"
    et = expected.type
    if pa.types.is_fixed_size_list(et) and not pa.types.is_fixed_size_list(col.type):
        lengths = pc.list_value_length(col)
        bad = pc.and_(pc.is_valid(lengths), pc.not_equal(lengths, et.list_size))
        n_bad = pc.sum(bad).as_py() or 0
        if n_bad:
            first = pc.filter(lengths, bad)[0].as_py()
            return f"has {n_bad} list(s) of length != {et.list_size} (first: {first})"
    pad = pad_length(expected)
    if pad is not None:
        lengths = pc.list_value_length(col)
        longest = pc.max(lengths).as_py()
        if longest is not None and longest > pad:
            n_bad = pc.sum(pc.greater(lengths, pad)).as_py()
            return f"has {n_bad} list(s) longer than pad_to {pad} (longest: {longest})"
    if (pa.types.is_list(et) or pa.types.is_fixed_size_list(et)) and not et.value_field.nullable:
        values = pc.list_flatten(col)
        if values.null_count:
            return f"has {values.null_count} null list element(s) but schema says nullable: false"
    return None


def validate_data(table: pa.Table, expected: DatasetSchema, where: str) -> None:
    """Check the values of ``table`` against ``expected``: non-nullable columns hold no nulls,
    ``fixed_size_list`` columns stored as plain lists have exactly the declared length, padded
    list columns no list longer than ``pad_to``. BadInputError names ``where`` and the first offending column."""
    for f in expected.to_arrow():
        if f.name not in table.column_names:
            raise BadInputError(f"{where}: missing column {f.name!r} required by schema {expected.name} "
                                f"v{expected.version}")
        err = _column_error(table.column(f.name), f)
        if err:
            raise BadInputError(f"{where}: column {f.name!r} {err} (schema {expected.name} v{expected.version})")


def parquet_schema(path: str | os.PathLike) -> pa.Schema:
    """The Arrow schema of a Parquet file or directory, or BadInputError naming the path."""
    import pyarrow.dataset as ds

    p = local_path(path)
    if not p.exists():
        raise BadInputError(f"input path not found: {p}")
    try:
        d = ds.dataset(str(p), format="parquet", exclude_invalid_files=False, ignore_prefixes=[".", "_"])
        schema = d.schema
    except Exception as e:  # pyarrow raises several types here
        raise BadInputError(f"cannot read Parquet at {p}: {str(e).splitlines()[0]}") from None
    _check_parts(d.files, schema)
    return schema


def _check_parts(files: list[str], schema: pa.Schema) -> None:
    """Every part readable and with the schema of the first (pyarrow inspects only the first)."""
    import pyarrow.parquet as pq

    for f in files[1:]:
        try:
            s = pq.read_schema(f)
        except Exception as e:  # noqa: BLE001 - truncated or not Parquet
            raise BadInputError(f"{f}: unreadable Parquet part ({str(e).splitlines()[0][:200]})") from None
        if s.equals(schema, check_metadata=False):
            continue
        for field in schema:
            i = s.get_field_index(field.name)
            if i < 0:
                raise BadInputError(f"{f}: column {field.name!r} missing (present in {files[0]})")
            if s.field(i).type != field.type:
                raise BadInputError(f"{f}: column {field.name!r} has type {s.field(i).type}, "
                                    f"{files[0]} has {field.type}")
        extra = [n for n in s.names if schema.get_field_index(n) < 0]
        if extra:
            raise BadInputError(f"{f}: column {extra[0]!r} is not in {files[0]}")


def validate_parquet(path: str | os.PathLike, expected: DatasetSchema, check_data: bool = True) -> pa.Schema:
    """Check a Parquet dataset's schema and (``check_data``) its values against ``expected``:
    types, nulls in non-nullable columns, fixed list lengths and ``pad_to``; the values are read one
    column at a time, only for the columns that carry such a constraint."""
    s = parquet_schema(path)
    validate(s, expected, str(path))
    if check_data:
        _validate_parquet_values(path, expected)
    return s


def _validate_parquet_values(path: str | os.PathLike, expected: DatasetSchema) -> None:
    import pyarrow.dataset as ds

    constrained = [f for f in expected.to_arrow() if not f.nullable or pa.types.is_fixed_size_list(f.type)
                   or pad_length(f) is not None
                   or ((pa.types.is_list(f.type) or pa.types.is_fixed_size_list(f.type))
                       and not f.type.value_field.nullable)]
    if not constrained:
        return
    dataset = ds.dataset(str(local_path(path)), format="parquet", ignore_prefixes=[".", "_"])
    for f in constrained:
        for batch in dataset.to_batches(columns=[f.name], batch_size=65536):
            err = _column_error(pa.chunked_array([batch.column(0)]), f)
            if err:
                raise BadInputError(f"{path}: column {f.name!r} {err} (schema {expected.name} v{expected.version})")
