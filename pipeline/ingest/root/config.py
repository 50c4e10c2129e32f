"""The settings of ROOT ingestion (``jobs/ingest_root.py``) and the constants its modules share."""
from __future__ import annotations

import re
from typing import Annotated, Literal, Optional, Union

from pydantic import AfterValidator, Field, field_validator, model_validator

from ...config import StageConfig
from ...tables.quarantine import QUARANTINE_AFTER

SAMPLES_PREFIX = "samples:"
#: Default limit (seconds) for opening one file's metadata, and for reading one chunk.
FILE_TIMEOUT_S = 600.0
#: How the parts are written (pyarrow.parquet.write_table): snappy, no dictionary encoding (physics
#: values rarely repeat: dictionaries cost time and grow the files), column statistics kept: the
#: settings of ``hepconvert.root_to_parquet``'s defaults with ``compression="snappy"``.
PARQUET_WRITE_OPTIONS = {"compression": "snappy", "use_dictionary": False, "write_statistics": True}

_UNITS = {"b": 1, "kb": 1024, "mb": 1024 ** 2, "gb": 1024 ** 3}


def parse_step_size(v: Union[int, str]) -> tuple[str, int]:
    """``1000`` -> ('entries', 1000); ``"100 MB"`` -> ('bytes', 104857600)."""
    if isinstance(v, bool):
        raise ValueError(f"step_size {v!r}: expected entries or a size like '100 MB'")
    if isinstance(v, int):
        if v <= 0:
            raise ValueError(f"step_size {v!r} must be > 0")
        return "entries", v
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgG]?[bB])\s*", str(v))
    if not m:
        if str(v).strip().isdigit():
            return parse_step_size(int(str(v).strip()))
        raise ValueError(f"step_size {v!r}: expected entries or a size like '100 MB'")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"step_size {v!r} must be > 0")
    return "bytes", n


def _valid_step_size(v: Union[int, str]) -> Union[int, str]:
    parse_step_size(v)
    return v


#: a config field holding a chunk size: entries (int) or an uncompressed size such as '100 MB'
StepSize = Annotated[Union[int, str], AfterValidator(_valid_step_size)]


class IngestRootConfig(StageConfig):
    """Settings of ``jobs/ingest_root.py`` (uproot-like names)."""

    input: Union[str, list[str]] = Field("runs/hep/simulated/*/*.root", description="ROOT files: paths, globs, "
                                         "root:// or s3:// URLs or samples:NAME (coffea sample files); a list or "
                                         "one string (default: the files `make run` generates)")
    tree: str = Field("Delphes", description="TTree or RNTuple name (path inside the file, e.g. 'Events' for "
                      "CMS NanoAOD)")
    filter_name: list[str] = Field(default_factory=lambda: ["*"],
                                   description="branches: exact names, globs or /regex/ (uproot filter_name)")
    output: str = Field("runs/hep/events", description="output Parquet directory: a local path, a shared "
                        "mount or s3://bucket/prefix (replaced atomically)")
    step_size: StepSize = Field("100 MB", description="chunk size: entries (int) or uncompressed "
                                       "size such as '100 MB'; one Spark task per chunk")
    entry_start: Optional[int] = Field(None, ge=0, description="first entry of every file (default 0)")
    entry_stop: Optional[int] = Field(None, ge=0, description="stop entry of every file (default: all)")
    allow_bad_files: bool = Field(False, description="exit 0 even if some files could not be ingested")
    schema_name: Optional[str] = Field(None, description="name under schemas/ (default root/<tree>)")
    schema_dir: Optional[str] = Field(None, description="registry folder for derived schema versions (default: none; the schema is stored next to the output as _schema.json; the repository's schemas/ is only read)")
    row_group_rows: Optional[int] = Field(None, gt=0, description="Parquet row group rows (default: one per chunk)")
    file_timeout_s: float = Field(FILE_TIMEOUT_S, gt=0, description="seconds allowed to open one file (and "
                                  "convert it when it is one chunk) and to read one chunk; a file that takes "
                                  "longer is reported as a bad file ('read timed out after N s')")

    output_format: Literal["parquet", "delta"] = Field(
        "parquet", description="parquet: a Parquet directory replaced whole; delta: a Delta table (delta-rs) that "
                               "each run commits one version to (docs/ingestion.md#delta-tables)")
    mode: Literal["overwrite", "append", "new_files"] = Field(
        "overwrite", description="delta only: overwrite (a version holding only this run's rows), append (add "
                                 "every input), new_files (add only the inputs the table does not hold yet, known "
                                 "by path, size and modification time)")
    on_changed: Literal["skip", "replace", "fail"] = Field(
        "fail", description="new_files: an input the table holds with another size or modification time is "
                            "skipped (its old rows kept), replaced (its old rows removed, the file read again) or "
                            "fails the run")
    input_identity: Literal["stat", "checksum"] = Field(
        "stat", description="delta: what tells a held input from a changed one: its real path, size and "
                            "modification time (and an s3:// object's ETag), or also its content's SHA-256 "
                            "(checksum: every input is read once more per run; for stores where size and "
                            "modification time can repeat: cp -p, touch -r)")
    quarantine_after: int = Field(QUARANTINE_AFTER, ge=0, description="new_files: an input file that failed in this "
                                  "many runs (unchanged) is quarantined: recorded in the table's log with its reason "
                                  "and skipped, one line each, until it changes or retry_quarantined is set; the run "
                                  "that quarantines it does not fail for it; 0: never")
    retry_quarantined: bool = Field(False, description="new_files: read the quarantined inputs again (one try; a "
                                    "failure quarantines a file again at once)")
    schema_changes: Literal["add_columns", "refuse"] = Field(
        "add_columns", description="delta: a branch the table lacks joins as a nullable column (add_columns) or "
                                   "fails the run naming it (refuse); a changed type always fails")
    partition_by: Optional[str] = Field(None, description="delta: a string column, derived from each input "
                                        "file's path with partition_value, that partitions the table")
    partition_value: str = Field(r"([^/]+)/[^/]+$", description="regex whose first group, searched in an input "
                                 "file's path, is its partition_by value (default: the file's folder name)")

    @model_validator(mode="after")
    def _delta_keys(self):
        if self.output_format == "parquet":
            for key, default in (("mode", "overwrite"), ("partition_by", None)):
                if getattr(self, key) != default:
                    raise ValueError(f"{key}={getattr(self, key)} needs output_format=delta")
        if self.partition_by is not None:
            try:
                if re.compile(self.partition_value).groups < 1:
                    raise ValueError(f"partition_value {self.partition_value!r} needs a group: (...)")
            except re.error as e:
                raise ValueError(f"partition_value {self.partition_value!r}: {e}") from None
        return self

    @field_validator("input")
    @classmethod
    def _nonempty(cls, v):
        items = [v] if isinstance(v, str) else list(v)
        if not items or any(not str(x).strip() for x in items):
            raise ValueError("needs at least one non-empty path or glob")
        return v


def default_schema_name(tree: str) -> str:
    return "root/" + re.sub(r"[^A-Za-z0-9_.-]+", "_", tree.strip("/")).lower()
