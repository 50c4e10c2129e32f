"""The Arrow schema of the selected branches: which ones convert, with the types of a real read,
and chunks cast to it."""
from __future__ import annotations

import io
import logging
import re

from ...errors import BadInputError
from .deadline import ReadTimeout
from .trees import first_line, is_rntuple, read_arrow

log = logging.getLogger(__name__)

#: an RNTuple's storage field of a collection whose members are also top-level (projected) fields
_INTERNAL_FIELD = re.compile(r"_collection\d+$")


def _candidates(t, matched: list[str], patterns: list[str]) -> tuple[list[str], list[str]]:
    """(branches to try, skipped names): a TTree branch with sub-branches is a container and an
    RNTuple's ``_collectionN`` duplicates its projected fields; both are skipped unless named exactly."""
    rntuple = is_rntuple(t)
    keep, skipped = [], []
    for name in matched:
        if name in patterns:
            keep.append(name)
        elif (rntuple and _INTERNAL_FIELD.match(name)) or (not rntuple and len(t[name].branches)):
            skipped.append(name)
        else:
            keep.append(name)
    return keep, skipped


def _root_type(t, name: str) -> str:
    try:
        return str(t[name].typename)
    except ReadTimeout:
        raise
    except Exception:  # noqa: BLE001 - only for the message
        return "?"


def _probe(t, names: list[str], stop: int = 1):
    """The Arrow table of a real read of entries [0, stop) (none for an empty tree), written to an
    in-memory Parquet file: what a task will produce, or the exception that stops it."""
    import pyarrow.parquet as pq

    table = read_arrow(t, names, 0, min(stop, int(t.num_entries)))
    pq.write_table(table, io.BytesIO(), compression="none", use_dictionary=False)
    return table


def supported_branches(t, matched: list[str], patterns: list[str], stop: int = 1):
    """(branches, Arrow schema, table of entries [0, stop)): the matched branches (fields) that
    uproot reads and Parquet stores, with the types of a REAL read (a zero-entry read gives other
    types for arrays of ROOT objects). A branch that fails is skipped with one log line naming it
    and its ROOT type, or is an error when it was asked for by its exact name."""
    names, skipped = _candidates(t, matched, patterns)
    if skipped:
        log.info("skipping %d container/collection branch(es) whose members are branches (e.g. %s)",
                 len(skipped), ", ".join(skipped[:3]))
    try:
        table = _probe(t, names, stop)
    except ReadTimeout:
        raise
    except Exception:  # noqa: BLE001 - find the branches that fail, one by one
        good, failed = [], []
        for name in names:
            try:
                _probe(t, [name])
                good.append(name)
            except ReadTimeout:
                raise
            except Exception as e:  # noqa: BLE001
                failed.append(f"branch {name!r} ({_root_type(t, name)}) cannot be converted: "
                              f"{type(e).__name__}: {first_line(e)}")
                if name in patterns:
                    raise BadInputError(failed[-1]) from None
        if not good:                               # nothing readable: the file, not a branch, is broken
            raise BadInputError(failed[0] if failed else f"no branch matches {patterns}") from None
        for why in failed:
            log.warning("skipping %s", why)
        names = good
        table = _probe(t, names, stop)
    return names, _declared_types(t, table.schema), table


def _declared_types(t, schema):
    """An RNTuple's cardinality fields (``RNTupleCardinality<std::uint32_t>``: uproot reads int64)
    get the declared integer type, as the equivalent TTree counter branch has."""
    import pyarrow as pa

    if not is_rntuple(t):
        return schema
    ints = {"std::uint32_t": pa.uint32(), "std::uint64_t": pa.uint64(), "std::int32_t": pa.int32(),
            "std::int64_t": pa.int64()}
    for i, f in enumerate(schema):
        m = re.fullmatch(r"ROOT::RNTupleCardinality<(.+)>", _root_type(t, f.name))
        if m and m.group(1) in ints:
            schema = schema.set(i, f.with_type(ints[m.group(1)]))
    return schema


def arrow_schema(t, branches: list[str]):
    """The Arrow schema of ``branches`` as the tasks write them (a real read of the first entry)."""
    return _declared_types(t, _probe(t, branches).schema)


def schema_bytes(schema) -> bytes:
    """An Arrow schema for the Spark tasks, as Arrow IPC bytes: pickling a ``pyarrow.Schema``
    drops the value field of a ``fixed_size_list`` (its name and ``not null``), and the tasks
    would then cast every chunk to a schema other than the one the driver records."""
    return schema.serialize().to_pybytes()


def as_schema(schema):
    """A schema from :func:`schema_bytes` (a ``pyarrow.Schema`` passes through)."""
    import pyarrow as pa

    return pa.ipc.read_schema(pa.py_buffer(schema)) if isinstance(schema, bytes) else schema


def conform(table, schema):
    """Cast a chunk to the dataset schema or raise BadInputError naming the first differing branch."""
    if table.schema == schema:
        return table
    for f in schema:
        i = table.schema.get_field_index(f.name)
        if i < 0:
            raise BadInputError(f"missing branch {f.name!r}")
        got = table.schema.field(i).type
        if got != f.type:
            try:
                table = table.set_column(i, f.name, table.column(i).cast(f.type))
            except Exception:  # noqa: BLE001
                from ...tables.types import check_fits

                check_fits(table.select([i]))        # an unsigned value too large for a Delta table's int64
                raise BadInputError(f"branch {f.name!r} has type {got} here, {f.type} in the first file") from None
    return table.select(schema.names).cast(schema)
