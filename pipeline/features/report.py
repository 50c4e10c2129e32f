"""The feature stage's counts per file and class (from the tasks' per-chunk statuses), its
``report.json`` and the lines it prints."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ..errors import BadInputError
from ..ingest.root import Chunk, FileInfo
from .layout import N_CLASSES

log = logging.getLogger(__name__)


@dataclass
class Tally:
    """Per-chunk statuses folded into per-file and per-class counts (bad files excluded)."""

    offsets: dict            # chunk_id -> first sample_id of the chunk
    first_id: dict           # file_index -> first sample_id of the file
    per_label: dict          # label -> selected events
    selected: dict           # file_index -> selected events
    read: dict               # file_index -> events read


def tally(files: list[FileInfo], units: list[Chunk], labels: dict, st: dict) -> Tally:
    """Give each chunk of a good file (no failed chunk) its contiguous sample_id range, and count
    per file and class."""
    bad = {f.file_index for f in files if f.error}
    t = Tally({}, {}, {lab: 0 for lab in range(N_CLASSES)}, {f.file_index: 0 for f in files},
              {f.file_index: 0 for f in files})
    next_id = 0
    for u in units:   # units are in (file, entry) order
        if u.file_index in bad:
            continue
        t.offsets[u.chunk_id] = next_id
        t.first_id.setdefault(u.file_index, next_id)
        next_id += int(st[u.chunk_id]["n_selected"])
    unit_file = {u.chunk_id: u.file_index for u in units}
    for cid, s in st.items():
        fi = unit_file[cid]
        t.read[fi] += int(s["n_read"] or 0)
        if fi not in bad:
            t.selected[fi] += int(s["n_selected"])
            t.per_label[labels[fi]] += int(s["n_selected"])
    return t


def per_file(files: list[FileInfo], labels: dict, t: Tally, written: dict) -> list[dict]:
    """The report's ``files``: per input file its label, events read, selected and written, its
    sample_id range and its error."""
    out = []
    for f in files:
        fi = f.file_index
        ids = [t.first_id[fi], t.first_id[fi] + t.selected[fi] - 1] if fi in t.first_id and t.selected[fi] else None
        out.append({"file": f.path, "label": labels.get(fi), "events_read": t.read[fi],
                    "selected": 0 if f.error else t.selected[fi], "written": 0 if f.error else written[fi],
                    "sample_ids": ids, "error": f.error})
    return out


def finish(report: dict, out, n_files: int, n_written: int, split_counts: dict, allow_bad: bool) -> None:
    """One line per file on stdout; BadInputError naming the first bad file unless ``allow_bad``."""
    for p in report["files"]:
        state = f" FAILED: {p['error']}" if p["error"] else ""
        print(f"{p['file']}: {p['events_read']} events read, {p['selected']} selected, {p['written']} written{state}")
    log.info("features: %d events written (train %d, val %d, test %d) -> %s", n_written, split_counts["train"],
             split_counts["val"], split_counts["test"], out)
    if report["bad_files"] and not allow_bad:
        b = report["bad_files"][0]
        raise BadInputError(f"{len(report['bad_files'])} of {n_files} input file(s) failed (see "
                            f"{out}/report.json); {b['file']}: {b['reason']}")
