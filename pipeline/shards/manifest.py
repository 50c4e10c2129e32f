"""The shard manifest: the contract between the shard stage (writer) and training (reader).

``manifest.json`` at the root of a shard directory is one :class:`ShardManifest`. The shard
stage (:mod:`pipeline.shards.materialize`) builds it and writes it with :meth:`ShardManifest.write`;
training reads it with :func:`load_manifest`.
Its JSON Schema is published as ``schemas/contracts/shard_manifest.json``
(:mod:`pipeline.contracts`).
"""
from __future__ import annotations

import json
import math
import posixpath
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from ..committed import resolve
from ..errors import BadInputError
from ..fs import Location, is_dir, is_file, location, read_bytes
from ..outputs import require_complete, write_json

MANIFEST_FORMAT = "hep-pipeline-shards/1"
MANIFEST_NAME = "manifest.json"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LayoutSpec(_Strict):
    """The assignment layout (:meth:`pipeline.shards.schemes.Layout.to_manifest`)."""

    scheme: str = Field(description="assignment scheme (pipeline.shards.schemes.SCHEMES)")
    workers: int = Field(ge=1, description="number of workers M")
    copies: int = Field(ge=1, description="copies C of each training sample")
    shards: Optional[int] = Field(None, ge=1, description="coarse: number of shards S")
    households: Optional[int] = Field(None, ge=1, description="households / neighbourhoods: H")
    household_shards: Optional[int] = Field(None, ge=1, description="household shards S_H")
    neighbourhoods: Optional[int] = Field(None, ge=1, description="neighbourhoods: NB")
    shuffle: bool = Field(True, description="samples randomised over shards (false: contiguous id ranges)")
    seed: int = Field(0, ge=0, description="seed of the assignment and of the worker seeds")


class WorkerShard(_Strict):
    """One worker's directory of Parquet files (row groups of ``row_group_rows`` rows)."""

    worker: int = Field(ge=0, description="worker index, 0..M-1, equal to the position in the list")
    path: str = Field(description="the worker's Parquet directory: an absolute path or an s3:// URI")
    files: list[str] = Field(default_factory=list, description="the directory's Parquet file names")
    rows: int = Field(ge=1, description="number of rows (training samples held by the worker)")
    sample_ids: list[tuple[int, int]] = Field(default_factory=list,
                                              description="optional: sample ids held, as sorted inclusive [first, "
                                                          "last] ranges (the shard stage leaves it empty: the ids "
                                                          "are in the files)")
    seed: int = Field(description="the worker's shuffle seed")
    group: dict[str, int] = Field(default_factory=dict, description="household / neighbourhood labels")


class TensorSpec(_Strict):
    """A feature column stored as one fixed-size binary tensor per row (pipeline.shards.tensors)."""

    dtype: str = Field(description="numpy dtype of the values (uint8, float32, ...)")
    length: int = Field(ge=0, description="values per row")


class ShardManifest(_Strict):
    """``manifest.json``: layout, sizes, eval paths and one entry per worker."""

    format: Literal["hep-pipeline-shards/1"] = Field(MANIFEST_FORMAT, description="format tag and version")
    source: str = Field(description="the input dataset the shards were cut from")
    layout: LayoutSpec
    n_train_samples: int = Field(ge=1, description="training samples N (each held by `copies` workers)")
    row_group_rows: int = Field(ge=1, description="rows per Parquet row group")
    eval: dict[str, str] = Field(description="split name -> directory (always test and val)")
    tensors: dict[str, TensorSpec] = Field(default_factory=dict,
                                           description="feature columns stored as one tensor per row")
    workers: list[WorkerShard] = Field(min_length=1)
    _path: str = PrivateAttr("")

    @model_validator(mode="after")
    def _consistent(self) -> "ShardManifest":
        if [w.worker for w in self.workers] != list(range(len(self.workers))):
            raise ValueError(f"workers must be numbered 0..{len(self.workers) - 1} in order")
        if self.layout.workers != len(self.workers):
            raise ValueError(f"layout.workers={self.layout.workers} but {len(self.workers)} workers are listed")
        if self.layout.copies > len(self.workers):
            raise ValueError(f"layout.copies={self.layout.copies} must be in 1..{len(self.workers)}")
        return self

    # ------------------------------------------------------------------ what training uses
    @property
    def path(self) -> str:
        """The file this manifest was loaded from ('' when built in memory)."""
        return self._path

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def copies(self) -> int:
        return self.layout.copies

    def overlap_epochs(self, target_epochs: int) -> int:
        """E_overlap = ceil(E_target / C): with C copies, every sample is still seen E_target times."""
        return max(1, math.ceil(target_epochs / self.copies))

    def write(self, path: Path) -> None:
        write_json(Path(path), self.model_dump(mode="json"))


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        return f"manifest key {where!r} missing"
    return f"manifest {where or 'value'}: {msg}" + (f" (got {err['input']!r})" if err["type"] == "literal_error" else "")


def load_manifest(path: str) -> ShardManifest:
    """Read and check a shard manifest: the model, then every worker directory exists.
    BadInputError names the file and the offending key.

    ``path`` is a local path or an ``s3://`` URI; on an object store the shard prefix holding the
    manifest must carry the completion marker of a committed output
    (:func:`pipeline.outputs.require_complete`; the shard stage lists the worker and eval
    directories as URIs on the same store).
    """
    loc = location(path)
    if not loc.is_local:
        require_complete(str(Location(loc.scheme, posixpath.dirname(loc.path))), "shard directory")
    src = resolve(loc)           # where the committed manifest lies (its output's marker says)
    if not is_file(src):
        raise BadInputError(f"shard manifest not found: {loc}")
    try:
        raw = json.loads(read_bytes(src))
    except json.JSONDecodeError as e:
        raise BadInputError(f"{loc}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise BadInputError(f"{loc}: not valid JSON (not UTF-8 text)") from None
    try:
        man = ShardManifest.model_validate(raw)
    except ValidationError as e:
        raise BadInputError(f"{loc}: {_first_error(e)}") from None
    for w in man.workers:
        if not shard_dir_exists(w.path):
            raise BadInputError(f"{loc}: shard directory of worker {w.worker} not found: {w.path}")
    man._path = str(loc)
    return man


def shard_dir_exists(path: str) -> bool:
    """A worker or eval directory of the manifest exists (a local directory or a non-empty prefix)."""
    return is_dir(location(path))
