"""A study or tuning output on an object store: the work happens in a local directory, the results
are published under the ``s3://`` prefix through :mod:`pipeline.fs` and :mod:`pipeline.outputs`.

* a finished run (or trial) directory: one :func:`~pipeline.outputs.atomic_output_dir` commit
  (the directory's files, then ``_COMPLETE``), made as soon as it ends;
* a failed run: its previous prefix is removed and ``error.txt`` written (no marker: not finished);
* the other files (``study.json``, Parquet tables, plots, ``report.md``, ``best_train.yaml``, the
  Optuna journal): one PUT each, which the store makes visible whole or not at all, in the order
  given.

A rerun reads what it needs back from the store (:meth:`RemoteOutput.fetch`): a run committed
with ``_COMPLETE`` is finished, so a study or a search continues from the store alone.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from ..fs import Location, delete_tree, exists, read_bytes, write_bytes
from ..outputs import COMPLETE_MARKER, atomic_output_dir


class RemoteOutput:
    """The object-store prefix (``target``) a local working directory is published to."""

    def __init__(self, target: Location):
        self.target = target

    def at(self, rel: str) -> Location:
        return self.target.child(rel) if rel else self.target

    def committed(self, rel: str) -> bool:
        """Whether the directory ``rel`` under the prefix carries its completion marker."""
        return exists(self.at(rel).child(COMPLETE_MARKER))

    def fetch(self, rels: list[str], local_root: Path, optional: bool = False) -> list[str]:
        """Copy the files ``rels`` (relative to the prefix) to the same paths under ``local_root``;
        with ``optional`` a missing file is skipped. Returns the files copied."""
        got = []
        for rel in rels:
            src = self.at(rel)
            if optional and not exists(src):
                continue
            dest = Path(local_root) / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(read_bytes(src))
            got.append(rel)
        return got

    def commit_dir(self, rel: str, local_dir: Path) -> Location:
        """Replace the directory ``rel`` under the prefix by ``local_dir``'s files (``_COMPLETE`` last)."""
        with atomic_output_dir(str(self.at(rel))) as tmp:
            shutil.copytree(local_dir, tmp, dirs_exist_ok=True)
        return self.at(rel)

    def replace_with_file(self, rel: str, local_file: Path) -> None:
        """Remove the directory ``rel`` and write one file in it (a failed run's ``error.txt``)."""
        delete_tree(self.at(rel))
        write_bytes(self.at(rel).child(Path(local_file).name), Path(local_file).read_bytes())

    def put_files(self, local_root: Path, files: list[Path]) -> list[Location]:
        """Each file (under ``local_root``) to the same relative key under the prefix, one PUT each."""
        done = []
        for f in files:
            dest = self.at(Path(f).relative_to(local_root).as_posix())
            write_bytes(dest, Path(f).read_bytes())
            done.append(dest)
        return done
