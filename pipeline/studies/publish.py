"""A study or tuning output on an object store: the work happens in a local directory, the results
are published under the ``s3://`` prefix through :mod:`pipeline.fs` and :mod:`pipeline.outputs`.

* a run's (or trial's) training output: written to ``<run>/train/`` on the store by the training
  itself and committed with ``_COMPLETE`` (:mod:`pipeline.train.launch`), wherever its ranks run;
* a failed run: its previous prefix is removed and ``error.txt`` written (no marker: not finished);
* the other files (``study.json``, Parquet tables, plots, ``report.md``, ``best_train.yaml``, the
  Optuna journal): one PUT each, which the store makes visible whole or not at all, in the order
  given.

A rerun reads what it needs back from the store (:meth:`RemoteOutput.fetch`): a run whose training
output carries ``_COMPLETE`` is finished, so a study or a search continues from the store alone.
"""
from __future__ import annotations

from pathlib import Path

from ..committed import resolve
from ..fs import Location, delete_tree, exists, read_bytes, write_bytes
from ..outputs import COMPLETE_MARKER


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
            src = resolve(self.at(rel))      # a file of a committed output: where its marker says
            if optional and not exists(src):
                continue
            dest = Path(local_root) / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(read_bytes(src))
            got.append(rel)
        return got

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
