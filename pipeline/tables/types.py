"""Arrow types as a Delta table stores them, and the schema rules of appending to a table.

Delta has no unsigned integers and no fixed-size lists: delta-rs maps ``uint8`` to its signed
``byte`` and ``uint32`` to ``integer``, so 200 would read back as -56 and 2^31 as a negative
number. A table's files therefore hold the widened types (:func:`delta_type`): ``uint8`` ->
``int16``, ``uint16`` -> ``int32``, ``uint32`` -> ``int64``; ``uint64`` -> ``int64`` only where
every value fits (:func:`check_fits`, else one line naming the branch and the value); a
fixed-size list -> a list. The Parquet output keeps the unsigned types.

Appending to a table (:func:`compare`): a column the table lacks joins as a nullable column, or
is refused by option; a column whose type differs from the table's is refused; a table column
the new files lack reads as null in their rows.
"""
from __future__ import annotations

from typing import Optional

from ..errors import BadInputError

_WIDEN = {"uint8": "int16", "uint16": "int32", "uint32": "int64", "uint64": "int64"}
INT64_MAX = 2 ** 63 - 1


def delta_type(t):
    """The type a Delta table's files hold for the Arrow type ``t``."""
    import pyarrow as pa

    if pa.types.is_unsigned_integer(t):
        return pa.type_for_alias(_WIDEN[str(t)])
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(pa.field(t.value_field.name, delta_type(t.value_type), t.value_field.nullable))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, delta_type(f.type), f.nullable) for f in t])
    if pa.types.is_float16(t):
        raise BadInputError("a float16 column cannot be stored in a Delta table")
    return t


def delta_schema(schema):
    """``schema`` with :func:`delta_type` applied to every column, every column nullable (a later
    file may lack it; its rows read as null there), metadata dropped."""
    import pyarrow as pa

    return pa.schema([pa.field(f.name, delta_type(f.type), True) for f in schema])


def _has_uint64(t) -> bool:
    import pyarrow as pa

    if pa.types.is_uint64(t):
        return True
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        return _has_uint64(t.value_type)
    if pa.types.is_struct(t):
        return any(_has_uint64(f.type) for f in t)
    return False


def _max_uint64(arr) -> Optional[int]:
    """The largest uint64 value anywhere in ``arr`` (lists and structs flattened)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = arr.type
    if pa.types.is_uint64(t):
        m = pc.max(arr).as_py()
        return None if m is None else int(m)
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        return _max_uint64(pc.list_flatten(arr))
    if pa.types.is_struct(t):
        got = [_max_uint64(pc.struct_field(arr, [i])) for i in range(t.num_fields)]
        got = [g for g in got if g is not None]
        return max(got) if got else None
    return None


def check_fits(table) -> None:
    """Every ``uint64`` value of ``table`` fits in int64; else one line naming the column and the
    value (Delta has no unsigned types; a wrapped value would read back negative)."""
    for name, col in zip(table.column_names, table.columns):
        if not _has_uint64(col.type):
            continue
        m = max((x for x in (_max_uint64(c) for c in col.chunks) if x is not None), default=None)
        if m is not None and m > INT64_MAX:
            raise BadInputError(f"branch {name!r}: value {m} does not fit in a Delta table's int64 (Delta has no "
                                "unsigned types); write this input as Parquet (output_format: parquet), which keeps "
                                "uint64")


def to_delta(table, schema):
    """``table`` cast to the Delta schema ``schema`` (:func:`delta_schema` of its own), after
    :func:`check_fits`."""
    check_fits(table)
    return table.cast(schema)


def compare(table_schema, new_schema, partition_by: tuple, *, where: str, first_file: str,
            add_columns: bool) -> list:
    """The fields of ``new_schema`` (the Delta types of a run's files) that the table lacks, to be
    added as nullable columns; one line naming the branch and ``first_file`` when a branch's type
    differs from the table's, or when a new branch is refused (``add_columns`` false)."""
    have = {f.name: f for f in table_schema if f.name not in partition_by}
    new = []
    for f in new_schema:
        old = have.get(f.name)
        if old is None:
            if not add_columns:
                raise BadInputError(f"{first_file}: branch {f.name!r} is not a column of the table {where} (set "
                                    "schema_changes: add_columns to add it as a nullable column)")
            new.append(f)
        elif old.type != f.type:
            raise BadInputError(f"{first_file}: branch {f.name!r} is {f.type} here and {old.type} in the table "
                                f"{where}: a column's type cannot change (write to a new table)")
    return new
