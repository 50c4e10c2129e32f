"""Any TTree or RNTuple -> Parquet on Spark (``jobs/ingest_root.py``), one concern per module:

* :mod:`.config`    the stage's settings (:class:`IngestRootConfig`), ``step_size`` parsing, the Parquet options
* :mod:`.files`     which files an ``input`` names (paths, globs, ``samples:``, ``root://`` globs, URLs)
* :mod:`.deadline`  the per-file time limit (a SIGALRM timer)
* :mod:`.trees`     opening a TTree/RNTuple, matching branches, reading entry ranges as Arrow
* :mod:`.schema`    the branches that convert and their Arrow schema (a real read); casting chunks to it
* :mod:`.planning`  entry ranges snapped to basket clusters; the driver-side plan of many files
* :mod:`.twopass`   plan each file in its task, then a second pass for the large files (shared with
  the feature stage)
* :mod:`.tasks`     the Spark task bodies: both passes write their parts through :mod:`pipeline.commit`
* :mod:`.stage`     the driver: :func:`ingest_root`, :func:`plan_ingest_root`, the report and the commit
"""
from .config import (FILE_TIMEOUT_S, PARQUET_WRITE_OPTIONS, SAMPLES_PREFIX, IngestRootConfig, StepSize,
                     default_schema_name, parse_step_size)
from .deadline import ReadTimeout, read_deadline
from .files import resolve_files, sample_path
from .planning import CHUNK_COLUMNS, BadFile, Chunk, FileInfo, Plan, chunks_dataframe, plan_chunks, plan_file
from .schema import arrow_schema, as_schema, conform, schema_bytes, supported_branches
from .stage import ingest_root, plan_ingest_root
from .tasks import convert_range, part_name
from .trees import (branches_by_name, cached_tree, error_text, first_line, is_rntuple, match_branches, open_tree,
                    read_arrays, read_arrow, read_chunk, to_arrow)
from .twopass import FilePlanning, FileScan, read_range, scan_file, second_pass_chunks

__all__ = ["BadFile", "CHUNK_COLUMNS", "Chunk", "FILE_TIMEOUT_S", "FileInfo", "FilePlanning", "FileScan",
           "IngestRootConfig", "PARQUET_WRITE_OPTIONS", "Plan", "ReadTimeout", "SAMPLES_PREFIX", "StepSize",
           "arrow_schema", "as_schema", "branches_by_name", "cached_tree", "chunks_dataframe", "conform",
           "convert_range", "default_schema_name", "error_text", "first_line", "ingest_root", "is_rntuple",
           "match_branches", "open_tree", "parse_step_size", "part_name", "plan_chunks", "plan_file",
           "plan_ingest_root", "read_arrays", "read_arrow", "read_chunk", "read_deadline", "read_range",
           "resolve_files", "sample_path", "scan_file", "schema_bytes", "second_pass_chunks", "supported_branches",
           "to_arrow"]
