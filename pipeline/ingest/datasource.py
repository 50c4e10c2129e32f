"""ROOT files as a PySpark 4 Python Data Source (``spark.read.format("root")``).

    from pipeline.ingest.datasource import register
    register(spark)
    df = (spark.read.format("root").option("tree", "Events").option("filter_name", "Muon_*")
          .load("data/*.root"))

Planning is :func:`pipeline.ingest.root.plan_chunks`, the ingestion's own: the files are expanded
like ``ingest_root``'s ``input`` (paths, globs, ``samples:NAME``; several paths separated by
commas), each file's entries are cut into chunks of ``step_size`` snapped to its clusters, and
every chunk is one Spark partition. Each partition is read in the executor with uproot (TTree or
RNTuple) and handed to Spark as Arrow RecordBatches. The schema is taken from the first file,
with the types of a real read (:func:`pipeline.ingest.root.arrow_schema`).

Options (anything else is an error naming it): ``tree`` (TTree or RNTuple name, default
``Events``), ``filter_name`` (comma-separated names, globs or ``/regex/``, default ``*``),
``step_size`` (entries or a size such as ``100 MB``), ``entry_start``, ``entry_stop``.

Types Spark lacks are converted (:func:`spark_type`): unsigned integers widen to the next signed
type (uint8 -> short, uint16 -> int, uint32 -> long) and uint64 becomes ``decimal(20,0)``;
fixed-size arrays (``float[5]``) become arrays; structs (ROOT objects) stay structs. The ingestion
job keeps the exact Arrow types instead.

Column pruning: only the branches in the DataFrame's schema are read. Spark 4.0's Python Data
Source API does not pass a query's column selection to the reader, so choose the columns with
``filter_name`` (or with a user schema, ``.schema("Muon_pt array<float>, nMuon long")``): the other
branches are never read.

Bad input: a file that cannot be opened, lacks the tree or a requested branch, is reported while
planning with one line naming it (``BadInputError``); the whole read stops (use ``ingest_root`` with
``allow_bad_files`` to keep the good files of a mixed set).
"""
from __future__ import annotations

import re
import uuid
from typing import Iterator

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from ..errors import BadInputError, ConfigError
from .root import plan_chunks, read_chunk, resolve_files, to_arrow

OPTIONS = {"tree": "Events", "filter_name": "*", "step_size": "100 MB", "entry_start": None, "entry_stop": None}


def register(spark) -> None:
    """Make ``spark.read.format("root")`` available in this session. The session's executors
    must run a Python with the project installed (``PYSPARK_PYTHON``): checked here, once, with
    one line naming the interpreter (``pipeline.spark.check_executor_python``)."""
    from ..spark import check_executor_python

    check_executor_python(spark)
    spark.dataSource.register(RootDataSource)


def spark_type(t):
    """The Arrow type Spark can take for Arrow type ``t`` (recursively)."""
    import pyarrow as pa

    widen = {pa.uint8(): pa.int16(), pa.uint16(): pa.int32(), pa.uint32(): pa.int64(), pa.uint64(): pa.decimal128(20, 0)}
    if t in widen:
        return widen[t]
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        # elements declared nullable (array<T> with containsNull): what PySpark 4.0 makes of any Arrow
        # list, while 4.1+ keep the element's nullability; one DataFrame schema on both
        return pa.list_(pa.field("element", spark_type(t.value_type), True))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, spark_type(f.type), f.nullable) for f in t])
    return t


def _spark_arrow_schema(schema):
    import pyarrow as pa

    return pa.schema([pa.field(f.name, spark_type(f.type), f.nullable) for f in schema])


def _options(options) -> dict:
    known = {k.lower(): k for k in OPTIONS}
    out = dict(OPTIONS)
    paths = []
    for k, v in options.items():
        key = k.lower()
        if key in ("path", "paths"):
            paths.extend(p for p in re.split(r",(?![^{]*})", str(v).strip("[]")) if p.strip())
        elif key in known:
            out[known[key]] = v
        else:
            raise ConfigError(f"unknown option {k!r} of format root (known: {', '.join(OPTIONS)}, path)")
    if not paths:
        raise ConfigError("format root needs a path: .load('data/*.root')")
    out["paths"] = [p.strip().strip("'\"") for p in paths]
    out["filter_name"] = [p.strip() for p in str(out["filter_name"]).split(",") if p.strip()]
    for k in ("entry_start", "entry_stop"):
        if out[k] is not None:
            if not str(out[k]).isdigit():
                raise ConfigError(f"option {k}={out[k]!r}: expected a non-negative integer")
            out[k] = int(out[k])
    step = str(out["step_size"]).strip()
    out["step_size"] = int(step) if step.isdigit() else step
    return out


class RootDataSource(DataSource):
    """``spark.read.format("root")``: see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return "root"

    def __init__(self, options) -> None:
        super().__init__(options)
        self.settings = _options(options)
        self._plan = None

    def plan(self):
        """plan_chunks over the files; BadInputError naming the first bad file."""
        if self._plan is None:
            s = self.settings
            plan = plan_chunks(resolve_files(s["paths"]), s["tree"], s["filter_name"], s["step_size"],
                               s["entry_start"], s["entry_stop"], progress=False)
            if plan.bad:
                b = plan.bad[0]
                raise BadInputError(f"{b.path}: {b.reason}")
            self._plan = plan
        return self._plan

    def schema(self):
        from pyspark.sql.pandas.types import from_arrow_schema

        return from_arrow_schema(_spark_arrow_schema(self.plan().schema))

    def reader(self, schema) -> "RootReader":
        import pyarrow as pa

        plan = self.plan()
        names = [f.name for f in schema.fields]
        missing = [n for n in names if n not in plan.branches]
        if missing:
            raise BadInputError(f"{plan.files[0].path}: no branch {missing[0]!r} among the selected branches")
        # the nullability Spark expects (a user schema's columns are nullable): PySpark 4.1+ compare it
        nullable = {f.name: f.nullable for f in schema.fields}
        target = _spark_arrow_schema(plan.schema)
        target = pa.schema([f.with_nullable(nullable.get(f.name, f.nullable)) for f in target])
        return RootReader([(c.path, c.tree, c.entry_start, c.entry_stop) for c in plan.chunks], names,
                          target, uuid.uuid4().hex)


class RootReader(DataSourceReader):
    """The chunks of one read; ``scope`` keeps a worker's open tree to this read alone."""

    def __init__(self, chunks: list, branches: list[str], target, scope: str) -> None:
        self.chunks, self.branches, self.target, self.scope = chunks, branches, target, scope

    def partitions(self):
        return [InputPartition(c) for c in self.chunks]

    def read(self, partition) -> Iterator:
        path, tree, a, b = partition.value
        try:
            table = to_arrow(read_chunk(path, tree, self.branches, a, b, scope=self.scope))
        except BadInputError as e:
            raise BadInputError(f"{path}: {e}") from None
        except Exception as e:  # noqa: BLE001 - one line naming the file
            raise BadInputError(f"{path}: entries {a}-{b}: {type(e).__name__}: {e}") from None
        table = table.cast(_select(self.target, self.branches))
        yield from table.to_batches()


def _select(schema, names: list[str]):
    import pyarrow as pa

    return pa.schema([schema.field(n) for n in names])
