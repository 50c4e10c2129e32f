"""Where a study or a search works and publishes: shared by ``runner`` (studies) and ``tune`` (searches).

* the **target**: the ``output`` location (a local directory or an ``s3://`` prefix; default
  ``runs/<kind>/<name>``), checked writable before any work when it is on a store;
* the **work folder**: the target itself when it is local, else ``work_dir`` (default
  ``runs/<kind>/<name>``) on the driver's disk;
* the **data cache**: ``data_dir``, default ``<work folder>/data``; on a cluster whose workers share no
  disk with the driver it must be where every node reaches (``s3://...``, a shared mount), since the
  data stages' tasks write there and the training tasks read from there;
* **publishing**: a :class:`~.publish.RemoteOutput` for a store target (None for a local one);
* **tracking**: the MLflow parent run (None when tracking is off); a configured tracking URI is
  checked before anything is written.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import BadInputError
from ..fs import Location, check_writable, exists, location
from ..outputs import COMPLETE_MARKER, local_path
from .publish import RemoteOutput


class StorePath(str):
    """An object-store URI that joins like a ``Path`` (``/``), so the workflows' stage wiring builds
    store paths as it builds local ones."""

    def __truediv__(self, part) -> "StorePath":
        return StorePath(f"{self.rstrip('/')}/{part}")

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]


def store_or_local(path: str):
    """A local ``Path`` or a :class:`StorePath` for an object-store URI."""
    loc = location(path, output=True)
    return Path(loc.path) if loc.is_local else StorePath(str(loc))


def is_complete(path) -> bool:
    """Whether a stage's output exists: a local directory, or a store prefix with its ``_COMPLETE``."""
    return path.is_dir() if isinstance(path, Path) else exists(location(str(path)).child(COMPLETE_MARKER))


@dataclass
class Workspace:
    target: Location                   # where the results go
    out: Path                          # the local work folder
    data_root: object                  # the cache of datasets and shards: a Path or a StorePath
    remote: Optional[RemoteOutput]     # publishing to a store target (None: local)


def target_of(output: Optional[str], default: str) -> Location:
    return location(output or default, output=True)


def work_folder(output: Optional[str], work_dir: Optional[str], default: str) -> Path:
    t = target_of(output, default)
    return Path(t.path) if t.is_local else local_path(work_dir or default)


def data_root_of(data_dir: Optional[str], out: Path):
    """``data_dir`` (a local Path, or a StorePath on an object store), default ``<out>/data``."""
    if not data_dir:
        return out / "data"
    root = store_or_local(data_dir)
    return local_path(data_dir) if isinstance(root, Path) else root


def open_workspace(output: Optional[str], work_dir: Optional[str], data_dir: Optional[str], default: str,
                   tracking, own: str) -> Workspace:
    """The checked workspace of a run (tracking URI and store target checked, work folder created).
    A work folder that exists must be empty or hold ``own`` (the file a study or a search writes
    first): a folder of someone else's is refused in one line naming it, and nothing is written."""
    if tracking.enabled and tracking.uri:
        from .tracking import client

        client(tracking.uri)  # a bad tracking URI fails here, before anything is written
    target = target_of(output, default)
    out = work_folder(output, work_dir, default)
    if out.is_dir() and not (out / own).exists():
        first = next(iter(sorted(out.iterdir())), None)
        if first is not None:
            raise BadInputError(f"{out}: not a folder of this pipeline's (it holds {first.name} and no {own}): "
                                "choose another output or work_dir; nothing was changed")
    remote = None if target.is_local else RemoteOutput(target)
    if remote:
        check_writable(target)  # a bad bucket, credentials or a read-only prefix: before any work
    out.mkdir(parents=True, exist_ok=True)
    return Workspace(target, out, data_root_of(data_dir, out), remote)


def parent_run(tracking, out: Path, name: str, marker: str, params: dict, tags: dict):
    """The MLflow parent run of a study or search (file store ``<out>/mlruns`` unless ``tracking.uri``),
    or None when tracking is off. Returns (parent, uri)."""
    if not tracking.enabled:
        return None, None
    from .tracking import ParentRun, store_uri

    uri = store_uri(tracking.uri, out / "mlruns")
    return ParentRun(uri, tracking.experiment or name, name, out / marker, params,
                     {**tags, "pipeline.output": str(out)}), uri
