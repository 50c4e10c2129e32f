"""ROOT ingestion (and the feature stage) from remote inputs and to an object store, against real
loopback servers (tests/servers.py): ``root://`` inputs from an xrootd server (a glob the server
lists, a missing file, a closed port, a server that accepts and never answers), ``http://`` inputs from a
Range-capable HTTP server, and an ``s3://`` output on moto's S3 server."""
from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import fs, outputs
from pipeline.errors import BadInputError
from pipeline.ingest.root import IngestRootConfig, ingest_root
from pipeline.train.comm.ports import free_port
from servers import environment, s3_server, xrootd_server

SAMPLES = ("nano_dimuon.root", "nano_dy.root")        # sorted: the order a remote glob lists them in
BRANCHES = ["run", "event", "nMuon", "Muon_pt", "Muon_eta", "Muon_charge"]


@pytest.fixture(scope="module")
def export(tmp_path_factory, samples_dir) -> Path:
    d = tmp_path_factory.mktemp("export")
    for name in SAMPLES:
        shutil.copy(samples_dir / name, d / name)
    return d


@pytest.fixture(scope="module")
def xrd(export, tmp_path_factory):
    with xrootd_server(export, tmp_path_factory.mktemp("xrootd-log")) as server:
        yield server


@pytest.fixture(scope="module")
def local_parts(spark, export, tmp_path_factory) -> pa.Table:
    """The same files ingested from the local disk: what every remote ingestion must equal."""
    out = tmp_path_factory.mktemp("local") / "events"
    ingest_root(_cfg([str(export / n) for n in SAMPLES], out), spark=spark)
    return _parts(out)


@pytest.fixture
def silent_server():
    """A TCP server that accepts connections and never answers (a stuck or half-dead server)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held = []

    def accept():
        while True:
            try:
                held.append(srv.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield srv.getsockname()[1]
    srv.close()
    for c in held:
        c.close()


def _cfg(inputs, out, **kw) -> IngestRootConfig:
    return IngestRootConfig(input=inputs, tree="Events", filter_name=BRANCHES, output=str(out),
                            schema_dir=str(Path(str(out)).parent / "schemas") if "://" not in str(out) else None,
                            **kw)


def _parts(out) -> pa.Table:
    """Every part in file/chunk order (part names carry both), read through pyarrow's filesystem."""
    loc = fs.location(str(out))
    files = [f for f in fs.list_files(loc, ".parquet")]
    assert files, f"no parts under {loc}"
    filesystem = loc.filesystem()
    return pa.concat_tables([pq.read_table(f.path, filesystem=filesystem) for f in files])


def test_root_glob_ingests_the_same_rows_as_the_local_files(spark, xrd, export, local_parts, tmp_path):
    out = tmp_path / "remote"
    rep = ingest_root(_cfg(xrd.url(export) + "/nano_*.root", out), spark=spark)
    assert [f["file"] for f in rep["files"]] == [xrd.url(export / n) for n in SAMPLES]
    assert rep["bad_files"] == [] and rep["rows"] == local_parts.num_rows > 0
    assert _parts(out).equals(local_parts)


@pytest.mark.timeout(300)                      # a hang fails here, not at the suite's limit
def test_missing_unreachable_and_silent_servers_are_bad_files(spark, xrd, export, local_parts, silent_server,
                                                              tmp_path):
    good = xrd.url(export / "nano_dy.root")
    missing = xrd.url(export / "no_such.root")
    closed = f"root://127.0.0.1:{free_port()}/{export / 'nano_dy.root'}"
    silent = f"root://127.0.0.1:{silent_server}/{export / 'nano_dy.root'}"
    out = tmp_path / "out"
    t0 = time.monotonic()
    with pytest.raises(BadInputError, match="3 of 4 input file") as err:
        ingest_root(_cfg([good, missing, closed, silent], out, file_timeout_s=5), spark=spark)
    assert time.monotonic() - t0 < 5 * 3 + 60             # each bad file costs at most file_timeout_s
    assert "\n" not in str(err.value) and missing in str(err.value)
    rep = json.loads((out / "_report.json").read_text())
    bad = {b["file"]: b["reason"] for b in rep["bad_files"]}
    assert set(bad) == {missing, closed, silent}
    assert "no such file" in bad[missing]
    assert bad[silent] == "read timed out after 5 s"
    assert all("\n" not in r for r in bad.values())
    # the good file is kept, identical to its local ingestion (the rows of nano_dy follow nano_dimuon's)
    got = _parts(out)
    assert got.equals(local_parts.slice(local_parts.num_rows - got.num_rows))
    assert [p.name for p in out.glob("*.parquet")] == ["part-f00000-c00000.parquet"]


class _RangeHandler(SimpleHTTPRequestHandler):
    """Static files with single and multiple byte ranges (what uproot's HTTPSource asks for)."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        rng = self.headers.get("Range")
        path = Path(self.translate_path(self.path))
        if not rng or not path.is_file():
            return super().do_GET()
        data = path.read_bytes()
        spans = []
        for part in rng.split("=", 1)[1].split(","):
            a, b = part.strip().split("-")
            a, b = int(a), min(int(b) if b else len(data) - 1, len(data) - 1)
            spans.append((a, b))
        if len(spans) == 1:
            a, b = spans[0]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {a}-{b}/{len(data)}")
            self.send_header("Content-Length", str(b - a + 1))
            self.end_headers()
            self.wfile.write(data[a:b + 1])
            return
        boundary = "RANGEBOUNDARY"
        body = b"".join(f"--{boundary}\r\nContent-Range: bytes {a}-{b}/{len(data)}\r\n\r\n".encode()
                        + data[a:b + 1] + b"\r\n" for a, b in spans) + f"--{boundary}--\r\n".encode()
        self.send_response(206)
        self.send_header("Content-Type", f"multipart/byteranges; boundary={boundary}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_http_inputs_ingest_the_same_rows(spark, export, local_parts, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_RangeHandler, directory=str(export)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        out = tmp_path / "http"
        with pytest.raises(BadInputError, match="1 of 3 input file"):
            ingest_root(_cfg([f"{base}/{n}" for n in SAMPLES] + [f"{base}/missing.root"], out), spark=spark)
    finally:
        server.shutdown()
        server.server_close()
    rep = json.loads((out / "_report.json").read_text())
    assert [b["file"] for b in rep["bad_files"]] == [f"{base}/missing.root"]
    assert _parts(out).equals(local_parts)


def test_output_to_s3_is_committed_and_equals_the_local_output(spark, export, local_parts, tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("moto")) as s3, environment(**s3.env("writer")):
        uri = f"s3://{s3.bucket}/ingested"
        rep = ingest_root(_cfg([str(export / n) for n in SAMPLES], uri), spark=spark)
        assert rep["output"] == uri
        loc = outputs.require_complete(uri)
        assert _parts(loc).equals(local_parts)
        report = outputs.read_json(loc.child("_report.json"))
        assert report["output"] == uri and report["rows"] == local_parts.num_rows
        assert outputs.read_json(loc.child("_schema.json"))["columns"]


def test_s3_inputs_ingest_the_same_rows_and_a_missing_object_is_a_bad_file(spark, export, local_parts,
                                                                         tmp_path_factory, tmp_path):
    """ROOT files on the object store: a glob the store lists (segment by segment), read through
    pyarrow.fs in the tasks; a missing object is one bad file naming it, the others are kept."""
    with s3_server(tmp_path_factory.mktemp("moto")) as s3, environment(**s3.env("writer")):
        for n in SAMPLES:
            fs.write_bytes(fs.location(f"s3://{s3.bucket}/root/in/{n}"), (export / n).read_bytes())
        fs.write_bytes(fs.location(f"s3://{s3.bucket}/root/in/deeper/nano_x.root"), b"not matched by */")
        out = tmp_path / "s3in"
        rep = ingest_root(_cfg(f"s3://{s3.bucket}/root/in/nano_*.root", out), spark=spark)
        assert [f["file"] for f in rep["files"]] == [f"s3://{s3.bucket}/root/in/{n}" for n in SAMPLES]
        assert rep["bad_files"] == [] and _parts(out).equals(local_parts)
        missing = f"s3://{s3.bucket}/root/in/missing.root"
        with pytest.raises(BadInputError, match="1 of 3 input file"):
            ingest_root(_cfg([f"s3://{s3.bucket}/root/in/{n}" for n in SAMPLES] + [missing], tmp_path / "m"),
                        spark=spark)
        rep = json.loads((tmp_path / "m" / "_report.json").read_text())
        assert [b["file"] for b in rep["bad_files"]] == [missing]
        assert _parts(tmp_path / "m").equals(local_parts)


def test_s3a_and_s3n_input_names_are_s3():
    from pipeline.ingest.root.files import resolve_files

    assert resolve_files(["s3a://b/x/a.root", "S3N://b/x/b.root", "s3://b/x/a.root"]) == ["s3://b/x/a.root",
                                                                                          "s3://b/x/b.root"]


def test_s3a_inputs_are_the_s3_inputs(spark, export, local_parts, tmp_path_factory, tmp_path):
    """``s3a://`` (Spark's name for the same objects) is an alias of ``s3://`` for inputs: its glob is
    listed by the store, the tasks get the credentials, and the rows and file names are those of the
    ``s3://`` input (the rows of the local files, as the ``s3://`` glob gives them in the test above)."""
    with s3_server(tmp_path_factory.mktemp("moto")) as s3, environment(**s3.env("writer")):
        for n in SAMPLES:
            fs.write_bytes(fs.location(f"s3://{s3.bucket}/root/a/{n}"), (export / n).read_bytes())
        rep = ingest_root(_cfg(f"s3a://{s3.bucket}/root/a/nano_*.root", tmp_path / "s3a"), spark=spark)
        assert [f["file"] for f in rep["files"]] == [f"s3://{s3.bucket}/root/a/{n}" for n in SAMPLES]
        assert rep["bad_files"] == [] and _parts(tmp_path / "s3a").equals(local_parts)
        one = ingest_root(_cfg([f"s3a://{s3.bucket}/root/a/{SAMPLES[0]}", f"s3n://{s3.bucket}/root/a/{SAMPLES[1]}"],
                               tmp_path / "listed"), spark=spark)
        assert [f["file"] for f in one["files"]] == [f"s3://{s3.bucket}/root/a/{n}" for n in SAMPLES]
        assert _parts(tmp_path / "listed").equals(local_parts)


@pytest.fixture(scope="module")
def delphes_export(delphes_root, tmp_path_factory) -> Path:
    """Delphes-layout ttbar / wjets files (boosted real delphes.root events) to serve over root://."""
    import hep_root_fixtures as H

    d = tmp_path_factory.mktemp("delphes-export")
    colls = H.boosted(H.read_required(delphes_root))
    H.write_delphes_like(d / "ttbar_0000.root", H.take(colls, list(range(25))))
    H.write_delphes_like(d / "wjets_0000.root", H.take(colls, list(range(24, -1, -1))))
    return d


@pytest.mark.timeout(300)
def test_feature_stage_reads_root_urls_like_local_files(spark, delphes_export, tmp_path_factory, tmp_path):
    """The feature stage's tasks open and plan root:// files themselves (the driver opens none):
    a served glob gives the datasets of the local files, chunked (step_size 10: a second pass) or
    whole; a missing file on the server is a bad file and the good ones are kept."""
    import pyarrow.dataset as pads

    from pipeline.features.stage import FeaturesConfig, build_features

    samples = [{"name": "ttbar", "label": 1, "files": ["ttbar_*.root"]},
               {"name": "wjets", "label": 2, "files": ["wjets_*.root"]}]

    def rows(path):
        t = pads.dataset(str(path), format="parquet", ignore_prefixes=[".", "_"]).to_table()
        return t.sort_by("sample_id").to_pylist()

    with xrootd_server(delphes_export, tmp_path_factory.mktemp("xrootd-log")) as server:
        for step in (10, "50 MB"):
            cfg = dict(samples=samples, step_size=step, test_fraction=0.2, val_fraction=0.2, seed=3)
            local = build_features(FeaturesConfig(input=str(delphes_export / "*.root"),
                                                  output=str(tmp_path / f"l{step}"), **cfg), spark=spark)
            remote = build_features(FeaturesConfig(input=server.url(delphes_export) + "/*.root",
                                                   output=str(tmp_path / f"r{step}"), **cfg), spark=spark)
            assert [f["file"] for f in remote["files"]] == [server.url(delphes_export / n)
                                                             for n in ("ttbar_0000.root", "wjets_0000.root")]
            assert [f["events_read"] for f in remote["files"]] == [25, 25] and not remote["bad_files"]
            assert remote["splits"] == local["splits"] and sum(local["splits"].values()) > 0
            for name in ("hlf", "llf"):
                assert rows(tmp_path / f"r{step}" / name) == rows(tmp_path / f"l{step}" / name), (step, name)
        missing = server.url(delphes_export / "ttbar_9999.root")
        with pytest.raises(BadInputError, match="1 of 2 input file.*ttbar_9999.root"):
            build_features(FeaturesConfig(input=[missing, server.url(delphes_export / "wjets_0000.root")],
                                          output=str(tmp_path / "bad"), **cfg), spark=spark)
        rep = json.loads((tmp_path / "bad" / "report.json").read_text())
        assert [b["file"] for b in rep["bad_files"]] == [missing]
        assert {f["file"]: f["written"] for f in rep["files"]}[server.url(delphes_export / "wjets_0000.root")] > 0
