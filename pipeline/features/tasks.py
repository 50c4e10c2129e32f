"""The feature pass: the Spark task that turns work units into selected events, and the driver
side that runs it, both on the shared two-pass reading of ROOT files (:mod:`pipeline.ingest.root`:
:func:`~pipeline.ingest.root.scan_file`, :func:`~pipeline.ingest.root.second_pass_chunks`,
:func:`~pipeline.ingest.root.read_range`).

Per work unit the task reads the :data:`~pipeline.features.delphes.REQUIRED_BRANCHES` (a whole
ROOT file is planned in the task and cut into ``step_size`` chunks; a file of one chunk is
processed right there, on the same open tree; the chunks of a larger file go to a second pass),
runs :func:`~pipeline.features.delphes.compute_features`, leaves the selected events in a work
file (:mod:`pipeline.features.workfiles`) and returns one status row."""
from __future__ import annotations

import functools
import logging
import time
from typing import Any, Iterator, Optional, Union

from ..commit import ATTEMPT_DDL, JobTarget, attempt_schema
from ..ingest.root import (FILE_TIMEOUT_S, Chunk, FileInfo, FilePlanning, error_text, read_arrays, read_range,
                           scan_file, second_pass_chunks)
from ..inputs import read_parquet
from ..spark import default_parallelism, spark_task, task_frame
from . import delphes as D
from . import workfiles
from .config import FeaturesConfig
from .plan import WHOLE_FILE, pack_units, unit_entries
from .rows import llf_row_bytes

log = logging.getLogger(__name__)

#: the status row of a work unit (Spark DDL of :func:`_status_schema`): the chunk processed
#: (``entry_start``, ``entry_stop``; :data:`~pipeline.features.plan.WHOLE_FILE` when none was),
#: for a whole ROOT file its ``entries`` and entry ranges (``starts``, ``stops``; -1 and empty
#: otherwise), the counts, the error, the llf/ bytes of the selected events (to size the files)
#: and the attempt that wrote its work file (the commit protocol's ``attempt_dir``; ``files``: the
#: work file): per-chunk metadata only, nothing per event
_STATUS_DDL = ("file_index int, entry_start long, entry_stop long, entries long, starts array<long>, "
               f"stops array<long>, n_read long, n_selected long, error string, llf_bytes long, {ATTEMPT_DDL}")
_STATUS_FIELDS = ("file_index", "entry_start", "entry_stop", "entries", "starts", "stops", "n_read", "n_selected",
                  "error", "llf_bytes", "attempt_dir", "files")


def _status_schema():
    import pyarrow as pa
    return attempt_schema(("file_index", pa.int32()), ("entry_start", pa.int64()), ("entry_stop", pa.int64()),
                          ("entries", pa.int64()), ("starts", pa.list_(pa.int64())), ("stops", pa.list_(pa.int64())),
                          ("n_read", pa.int64()), ("n_selected", pa.int64()), ("error", pa.string()),
                          ("llf_bytes", pa.int64()))


def _read_events(t, entry_start: int, entry_stop: int):
    """The two-pass reading's ``read``: the REQUIRED_BRANCHES of an entry range of an open tree."""
    return read_arrays(t, list(D.REQUIRED_BRANCHES), entry_start, entry_stop)


def _parquet_events(path: str):
    """The REQUIRED_BRANCHES of an ingested Parquet part (local or s3://, through pyarrow.fs)."""
    import awkward as ak

    return ak.from_arrow(read_parquet(path, columns=list(D.REQUIRED_BRANCHES)))


def _unit_events(path: str, tree: str, a: int, b: int, step_size: Union[int, str], timeout_s: float,
                 scope: str) -> tuple[Any, int, int, int, list[tuple[int, int]], Optional[str]]:
    """(events or None, entry_start, entry_stop, entries, ranges, error) of one work unit. A whole
    ROOT file is the first pass (:func:`~pipeline.ingest.root.scan_file`): its one chunk is read on
    the open tree as that chunk, else only its ``entries`` and ``ranges`` come back; a chunk is the
    second pass (:func:`~pipeline.ingest.root.read_range`); a unit without a tree is an ingested
    Parquet part."""
    if not tree:
        try:
            return _parquet_events(path), a, b, -1, [], None
        except Exception as e:  # noqa: BLE001 - the driver reports the file
            return None, a, b, -1, [], error_text(e)
    if a != WHOLE_FILE:
        events, err = read_range(path, tree, a, b, _read_events, timeout_s, scope=scope)
        return events, a, b, -1, [], err
    scan = scan_file(path, FilePlanning(tree, list(D.REQUIRED_BRANCHES), step_size, timeout_s=timeout_s), _read_events)
    if scan.done and scan.ranges:
        a, b = scan.ranges[0]
    return scan.data, a, b, scan.entries, scan.ranges, scan.error


def feature_partition(batches: Iterator, *, target: JobTarget, step_size: Union[int, str] = "50 MB",
                      file_timeout_s: float = FILE_TIMEOUT_S, batch_rows: int = workfiles.IPC_BATCH_ROWS,
                      compression: str) -> Iterator:
    """The ``mapInArrow`` function of the feature pass. Per work unit (``file_index, path, tree,
    entry_start, entry_stop``): a whole ROOT file (:data:`~pipeline.features.plan.WHOLE_FILE`) is
    planned and cut into ``step_size`` chunks (at most ``file_timeout_s`` to open it); when it is
    one chunk it is processed on the same open tree, otherwise only its ranges come back. A chunk
    is read (at most ``file_timeout_s``), selected and computed; its selected events go to its
    work file (:func:`~pipeline.features.workfiles.work_name`, written by this task's attempt of
    the job ``target``); one status row comes back (:func:`_status_schema`)."""
    import pyarrow as pa

    attempt = target.attempt()
    schema = _status_schema()
    for batch in batches:
        d = batch.to_pydict()
        for fi, path, tree, a, b in zip(d["file_index"], d["path"], d["tree"], d["entry_start"], d["entry_stop"]):
            n_read, n_sel, n_bytes, block = 0, 0, 0, None
            ev, a, b, entries, ranges, err = _unit_events(path, tree, a, b, step_size, file_timeout_s, target.staging)
            if ev is not None and err is None:
                try:
                    block = D.compute_features(ev)
                    n_read, n_sel = block.n_read, len(block.index)
                    n_bytes = int(llf_row_bytes(block.n_particles).sum())
                except Exception as e:  # noqa: BLE001 - the driver reports the file
                    err, n_sel, n_bytes = error_text(e), 0, 0
            if n_sel:  # outside the try: a full disk fails the stage, it is not the input file's fault
                with attempt.open(workfiles.work_name(fi, a)) as sink:
                    workfiles.save_block(block, sink, batch_rows, compression=compression)
            yield pa.RecordBatch.from_pylist([{
                "file_index": fi, "entry_start": a, "entry_stop": b, "entries": entries,
                "starts": [x for x, _ in ranges], "stops": [y for _, y in ranges], "n_read": n_read,
                "n_selected": n_sel, "error": err, "llf_bytes": n_bytes, **attempt.record()}], schema=schema)


def _feature_pass(spark, units: list[Chunk], target: JobTarget, cfg: FeaturesConfig, received) -> list[dict]:
    """One Spark job of :func:`feature_partition` over the work units: their status rows (the
    selected events themselves wait in work files under the job's prefix, one per chunk); the
    bytes the driver received are counted in ``received`` (a Counter)."""
    fn = functools.partial(feature_partition, target=target, step_size=cfg.step_size,
                           file_timeout_s=cfg.file_timeout_s,
                           batch_rows=workfiles.IPC_BATCH_ROWS,  # read at call time: a test may shrink it
                           compression=cfg.work_compression)
    tasks = pack_units([unit_entries(u) for u in units], default_parallelism(spark))
    rows = [(u.file_index, u.path, u.tree, u.entry_start, u.entry_stop) for u in units]
    df = task_frame(spark, rows, "file_index int, path string, tree string, entry_start long, entry_stop long", tasks)
    table = df.mapInArrow(spark_task(fn), _STATUS_DDL).toArrow()
    received["features"] += table.nbytes
    return table.select(list(_STATUS_FIELDS)).to_pylist()


def run_units(spark, files: list[FileInfo], units: list[Chunk], target: JobTarget, cfg: FeaturesConfig,
              t_start: float, received) -> tuple[list[Chunk], dict]:
    """The feature pass over the work units, and a second one over the chunks of the ROOT files
    that are more than one chunk (:func:`~pipeline.ingest.root.second_pass_chunks`): (every chunk
    processed, in (file, entry) order and numbered so; {chunk_id: status}). The files' entries,
    chunk counts and errors are filled in ``files``."""
    rows = _feature_pass(spark, units, target, cfg, received) if units else []
    for r in rows:
        if r["entries"] >= 0:            # a whole ROOT file, planned by its task
            f = files[r["file_index"]]
            f.entries, f.chunks = int(r["entries"]), len(r["starts"])
    more = second_pass_chunks([f.path for f in files], cfg.tree,
                              {r["file_index"]: (r["starts"], r["stops"]) for r in rows
                               if r["entry_start"] == WHOLE_FILE and not r["error"]})
    if more:
        log.info("features: %d chunk(s) of %d large file(s) -> a second pass", len(more),
                 len({c.file_index for c in more}))
        rows += _feature_pass(spark, more, target, cfg, received)
    for r in rows:
        f = files[r["file_index"]]
        if r["error"] and not f.error:
            f.error = r["error"]
            log.warning("bad input file %s: %s", f.path, f.error)
    done = sorted((r for r in rows if r["entry_start"] != WHOLE_FILE),
                  key=lambda r: (r["file_index"], r["entry_start"]))
    chunks = [Chunk(i, r["file_index"], files[r["file_index"]].path, cfg.tree, r["entry_start"], r["entry_stop"])
              for i, r in enumerate(done)]
    log.info("features: selection and features of %d chunk(s) done (%.1f s)", len(chunks), time.time() - t_start)
    return chunks, dict(enumerate(done))
