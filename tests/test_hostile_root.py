"""Hostile ROOT inputs: real sample files truncated at many offsets and with random bytes flipped
(hypothesis, derandomized and bounded), fed to the per-file path of ``ingest_root`` (the code a
Spark task runs for one file) and, in a batch with a good file, to the ``ingest_root`` job and
the feature stage. Each file is either read in full or reported as a bad file with a one-line
reason while the good file is written; never a traceback, never a hang, never a part file of a
bad file. Cases tried: see docs/failures.md (the counts are the ``max_examples`` below).

"Read in full" is checked value by value, not by the row count: the Parquet written for a damaged
file must hold exactly what uproot reads from that same file, and exactly the values of the
undamaged file. What no reader can detect: a ROOT file has no checksum over the whole file, so
damage to bytes the read does not use (other branches, a key's date, cycle or title) reads fine,
harmlessly; damage inside a compressed basket is caught by the compression's own check (zlib's
Adler-32 here, LZ4's xxhash, LZMA's CRC); but a basket that ROOT stored uncompressed (it does when
compression would not shrink it) carries no check at all, and a flipped byte there is a wrong
value that reads without error. Every basket the tests read in ``nano_dy.root`` is compressed
(asserted in the fixture), so here a damaged file that reads must give the original values."""
from __future__ import annotations

import json
import random
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from pipeline.ingest import root as R

set_hypothesis_home_dir(tempfile.mkdtemp(prefix="hypothesis-"))  # never .hypothesis/ in the checkout

NANO, NANO_TREE, NANO_BRANCHES = "nano_dy.root", "Events", ["nMuon", "Muon_pt", "Muon_eta", "Jet_pt"]
HANG_S = 60  # a file that takes longer than this is a hang

TRUNCATIONS = 40
FLIPS = 25
_FUZZ = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


@contextmanager
def _no_hang(seconds: int):
    def _alarm(*_):
        raise TimeoutError(f"no result within {seconds} s")

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


_NANO: dict = {}


def _uproot_values(path) -> dict:
    """What uproot itself reads from ``path``: {branch: values per entry}."""
    import uproot

    with uproot.open(path) as f:
        arrays = f[NANO_TREE].arrays(NANO_BRANCHES, library="ak")
    return {b: arrays[b].tolist() for b in NANO_BRANCHES}


@pytest.fixture(scope="module")
def nano(samples_dir) -> None:
    """The real NanoAOD sample, its entry count and values, kept out of hypothesis' example reprs."""
    import uproot

    src = samples_dir / NANO
    mode, size = R.parse_step_size("100 MB")
    _, _, n, _, _ = R.plan_file(str(src), NANO_TREE, NANO_BRANCHES, None, mode, size)
    with uproot.open(src) as f:
        for b in NANO_BRANCHES:  # no uncompressed basket: a flip in the data cannot read as a wrong value
            br = f[NANO_TREE][b]
            assert all(br.basket(i).compressed_bytes < br.basket(i).uncompressed_bytes for i in range(br.num_baskets))
    _NANO.update(data=src.read_bytes(), entries=n, values=_uproot_values(src))


def _written(out: Path) -> dict:
    """The values of the Parquet parts ingest_root wrote, in part order: {branch: values per entry}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pa.concat_tables([pq.read_table(p) for p in sorted(out.glob("*.parquet"))])
    return {b: t.column(b).to_pylist() for b in NANO_BRANCHES}


def _ingest_one(data: bytes, entries: int) -> str:
    """The per-file path of ingest_root on ``data``: 'read' (every entry, with the values uproot
    reads from the same bytes, which are the undamaged file's) or 'bad: <reason>'."""
    mode, size = R.parse_step_size("100 MB")
    with tempfile.TemporaryDirectory() as d:
        path, out = Path(d) / "f.root", Path(d) / "out"
        path.write_bytes(data)
        out.mkdir()
        try:
            with _no_hang(HANG_S):
                t, branches, n, ranges, schema = R.plan_file(str(path), NANO_TREE, NANO_BRANCHES, None, mode, size)
                read = R.convert_range(branches, schema)
                for i, (a, b) in enumerate(ranges):
                    pq.write_table(read(t, a, b), out / R.part_name(0, i))
                rows = sum(pq.read_metadata(p).num_rows for p in out.iterdir())
        except TimeoutError:
            raise
        except Exception as e:  # what the stage catches per file and reports
            reason = R.error_text(e)
            assert reason.strip() and "\n" not in reason
            assert not any(out.iterdir()), "a part file of a bad file was left behind"
            return f"bad: {reason}"
        assert rows == entries, f"read {rows} of {entries} entries without an error"
        got = _written(out)
        with _no_hang(HANG_S):
            assert got == _uproot_values(path), "the Parquet differs from uproot's reading of the same file"
        assert got == _NANO["values"], "a damaged file read without an error gave other values"
        return "read"


@pytest.mark.timeout(600)
@settings(max_examples=TRUNCATIONS, **_FUZZ)
@given(frac=st.floats(0.0, 1.0, exclude_max=True))
def test_truncated_root_files_are_read_or_reported(nano, frac):
    data = _NANO["data"]
    _ingest_one(data[: int(frac * len(data))], _NANO["entries"])  # every entry, or 'bad: <one line>'


@pytest.mark.slow
@pytest.mark.timeout(900)
@settings(max_examples=FLIPS, **_FUZZ)
@given(flips=st.lists(st.tuples(st.floats(0.0, 1.0, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=8))
def test_root_files_with_flipped_bytes_are_read_or_reported(nano, flips):
    b = bytearray(_NANO["data"])
    for frac, x in flips:
        b[int(frac * len(b))] ^= x
    _ingest_one(bytes(b), _NANO["entries"])  # every entry, or 'bad: <one line>'; no hang, no part file


def test_damage_outside_the_branches_read_gives_the_original_values(nano, samples_dir):
    """Bytes of a basket of another branch, flipped: the file reads, and every value is the
    undamaged file's (the check a row count alone would not make)."""
    import uproot

    with uproot.open(samples_dir / NANO) as f:
        br = f[NANO_TREE]["Electron_pt"]
        seek, nbytes = int(br.member("fBasketSeek")[0]), int(br.member("fBasketBytes")[0])
    b = bytearray(_NANO["data"])
    for i in range(seek + nbytes // 2, seek + nbytes // 2 + 8):
        b[i] ^= 0xFF
    assert _ingest_one(bytes(b), _NANO["entries"]) == "read"
    assert _ingest_one(_NANO["data"], _NANO["entries"]) == "read"


# ---------------------------------------------------------------------------- whole stages
def _corrupt_copies(src: Path, d: Path, seed: int = 0) -> list[Path]:
    """Seeded damaged copies of ``src``: truncated (3 offsets), header and tail bytes flipped."""
    rng = random.Random(seed)
    data = src.read_bytes()
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for i, frac in enumerate((0.02, 0.5, 0.97)):
        p = d / f"trunc{i}.root"
        p.write_bytes(data[: int(frac * len(data))])
        out.append(p)
    for name, lo, hi in (("head.root", 0, 64), ("tail.root", len(data) - 4000, len(data))):
        b = bytearray(data)
        for _ in range(6):
            b[rng.randrange(lo, hi)] ^= rng.randrange(1, 256)
        (d / name).write_bytes(bytes(b))
        out.append(d / name)
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ingest_root_job_reports_damaged_files_and_writes_the_good_one(spark, delphes_root, tmp_path, capsys):
    from jobs.ingest_root import main

    bad = _corrupt_copies(delphes_root, tmp_path / "in")
    out = tmp_path / "events"
    inputs = "[" + ", ".join(str(p) for p in [delphes_root, *bad]) + "]"
    rc = main(["--set", f"input={inputs}", "--tree", "Delphes", "--set", "filter_name=[Jet.PT, Jet.Eta, MissingET.MET]",
               "--output", str(out)])
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert rc == 2 and len(err) == 1 and "input file(s) failed" in err[0], err
    rep = json.loads((out / "_report.json").read_text())
    reasons = {Path(b["file"]).name: b["reason"] for b in rep["bad_files"]}
    assert {"trunc0.root", "trunc1.root"} <= set(reasons)
    assert all(r and "\n" not in r for r in reasons.values())
    good = {Path(f["file"]).name: f for f in rep["files"] if not f.get("error")}
    assert good["delphes.root"]["rows"] == 25
    assert set(good) | set(reasons) == {"delphes.root", *(p.name for p in bad)}
    # every part file belongs to a file that was read; none of a bad file
    parts = {p.name for p in out.glob("*.parquet")}
    listed = {p for f in good.values() for p in _parts_of(f)}
    assert parts == listed and parts
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # no temporary output left


def _parts_of(entry: dict) -> list[str]:
    parts = entry.get("parts") or []
    return [Path(p["part"] if isinstance(p, dict) else p).name for p in parts]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_feature_stage_reports_damaged_files_and_keeps_the_good_one(spark, delphes_root, tmp_path):
    from pipeline.errors import BadInputError
    from pipeline.features.stage import FeaturesConfig, build_features

    bad = _corrupt_copies(delphes_root, tmp_path / "in", seed=1)
    cfg = FeaturesConfig(input=[str(delphes_root), *map(str, bad)],
                         samples=[{"name": "ttbar", "label": 1, "files": ["*.root"]}], output=str(tmp_path / "f"))
    with pytest.raises(BadInputError) as ei:
        build_features(cfg, spark=spark)
    assert "\n" not in str(ei.value) and "input file(s) failed" in str(ei.value)
    rep = json.loads((tmp_path / "f" / "report.json").read_text())
    reasons = {Path(b["file"]).name: b["reason"] for b in rep["bad_files"]}
    assert {"trunc0.root", "trunc1.root"} <= set(reasons)
    ok = [f for f in rep["files"] if not f.get("error")]
    assert [Path(f["file"]).name for f in ok if Path(f["file"]).name == "delphes.root"] == ["delphes.root"]
