"""Where data lives: one filesystem abstraction for every path the pipeline reads or writes.

A location is a local path, a ``file://`` URI, an ``s3://bucket/key`` URI (an S3-compatible object
store), or, for ROOT inputs only, ``root://host:port//path`` (XRootD: EOS, the WLCG grid) and
``http(s)://`` URLs. :func:`location` parses and checks one; every artefact the Python side writes or
lists goes through :mod:`pyarrow.fs` (``LocalFileSystem`` or ``S3FileSystem``), uproot reads remote
ROOT files through its fsspec sources (``fsspec-xrootd`` for ``root://``) and ``s3://`` ROOT files
through a :mod:`pyarrow.fs` file object.

S3 settings come from the environment, as for every AWS client: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY`` (and ``AWS_SESSION_TOKEN``), ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``)
for a non-AWS store such as MinIO, Ceph or EOS's S3 gateway, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``.
The instance-metadata lookup of AWS's default credential chain is never tried, so missing credentials
are one clear error instead of a long network wait.

Spark addresses the same objects as ``s3a://`` (the Hadoop S3A connector); :meth:`Location.spark_uri`
is the one place that translates.
"""
from __future__ import annotations

import fnmatch
import glob
import hashlib
import os
import posixpath
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from .errors import BadInputError

OUTPUT_SCHEMES = ("file", "s3")
INPUT_SCHEMES = ("file", "s3", "root", "http", "https")
_ALIASES = {"s3a": "s3", "s3n": "s3"}
_ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
_REGION_VARS = ("AWS_REGION", "AWS_DEFAULT_REGION")
#: every environment variable the S3 client reads (what executors need to reach the store)
S3_ENV_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", *_ENDPOINT_VARS, *_REGION_VARS)


@dataclass(frozen=True)
class Location:
    """A parsed location. ``path`` is the absolute local path (``file``), ``bucket/key`` (``s3``)
    or the whole URL (``root``, ``http``, ``https``)."""

    scheme: str
    path: str

    def __str__(self) -> str:
        if self.scheme == "file":
            return self.path
        if self.scheme == "s3":
            return "s3://" + self.path
        return self.path

    @property
    def is_local(self) -> bool:
        return self.scheme == "file"

    @property
    def name(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))

    @property
    def bucket(self) -> str:
        return self.path.split("/", 1)[0] if self.scheme == "s3" else ""

    def local_path(self) -> Path:
        if not self.is_local:
            raise BadInputError(f"{self}: a local path is needed here")
        return Path(self.path)

    def child(self, *parts: str) -> "Location":
        if self.scheme in ("file", "s3"):
            return Location(self.scheme, posixpath.join(self.path.rstrip("/"), *parts))
        return Location(self.scheme, self.path.rstrip("/") + "/" + "/".join(parts))

    @property
    def is_bucket_root(self) -> bool:
        """An ``s3://bucket`` with no key: it has no parent, so no sibling."""
        return self.scheme == "s3" and "/" not in self.path.strip("/")

    def sibling(self, name: str) -> "Location":
        """``name`` next to this location. The root of a bucket has none (a name next to it would
        be another bucket): BadInputError naming it and the prefix to use instead."""
        if self.is_bucket_root:
            raise BadInputError(f"{self}: the root of a bucket cannot be used here: names derived next to it "
                                f"(such as {name!r}) would be other buckets; use a prefix, e.g. {self}/run")
        return Location(self.scheme, posixpath.join(posixpath.dirname(self.path.rstrip("/")), name))

    def spark_uri(self) -> str:
        """The URI Spark's (Hadoop's) filesystem layer reads: ``file:///...`` or ``s3a://bucket/key``."""
        if self.scheme == "file":
            return "file://" + self.path
        if self.scheme == "s3":
            return "s3a://" + self.path
        raise BadInputError(f"{self}: Spark cannot read {self.scheme}:// paths; read them with the ingestion stage")

    def filesystem(self):
        """The :mod:`pyarrow.fs` filesystem holding this location (``file`` and ``s3``)."""
        if self.scheme == "file":
            import pyarrow.fs as pafs

            return pafs.LocalFileSystem()
        if self.scheme == "s3":
            settings = s3_settings()
            if not (settings["key"] and settings["secret"]):
                raise BadInputError(f"{self}: no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                                    "(and AWS_ENDPOINT_URL for a store other than AWS)")
            return s3_filesystem(**settings)
        raise BadInputError(f"{self}: no writable filesystem for {self.scheme}:// (ROOT inputs are read by uproot)")


def confined(root: Location, name, source) -> Location:
    """Where the name ``name``, read from our own metadata (``source``: a ``_COMPLETE`` marker, a
    job's ``_moving.json``, an ingestion report, a table's ledger), lies inside ``root``. Such
    names are relative to ``root`` and stay inside it; one that is not a string, is empty,
    absolute, a URI, holds a NUL, or climbs out of ``root`` (``..``: on S3 out of its bucket and
    prefix) is BadInputError naming ``source`` and the name, before anything is read or deleted
    through it. The one check every reader of such names goes through (docs/storage.md)."""
    ok = isinstance(name, str) and name and "\x00" not in name and "://" not in name \
        and not name.startswith(("/", "\\", "~"))
    rel = posixpath.normpath(name) if ok else ""
    if not ok or rel in (".", "..") or rel.startswith("../"):
        raise BadInputError(f"{source}: names {name!r}, which is not inside {root}: this metadata was not "
                            "written by this pipeline as it is; nothing was read or changed through it")
    return root.child(rel)


def location(uri: str | os.PathLike | Location, *, output: bool = False) -> Location:
    """Parse ``uri``; an unsupported scheme is one line naming the URI and the schemes that work."""
    if isinstance(uri, Location):
        return uri
    s = os.fspath(uri)
    if not s:
        raise BadInputError("an empty path was given")
    if "://" not in s:
        return Location("file", str(Path(s).expanduser().absolute()))
    scheme = urlparse(s).scheme.lower()
    scheme = _ALIASES.get(scheme, scheme)
    allowed = OUTPUT_SCHEMES if output else INPUT_SCHEMES
    if scheme not in allowed:
        what = "outputs" if output else "inputs"
        raise BadInputError(f"{s}: the URI scheme {scheme}:// is not supported for {what} "
                            f"(supported: local paths, {', '.join(x + '://' for x in allowed)})")
    if scheme == "file":
        p = urlparse(s)
        return Location("file", str(Path(p.netloc + p.path).absolute()))
    if scheme == "s3":
        raw = s.split("://", 1)[1]
        rest = raw.strip("/")
        if not rest or raw.startswith("/"):
            raise BadInputError(f"{s}: an S3 URI needs a bucket: s3://bucket/key")
        return Location("s3", rest)
    return Location(scheme, s)


def s3_settings() -> dict:
    """Endpoint, region and credentials of the S3 client, read from the environment (hashable values)."""
    endpoint = next((os.environ[v] for v in _ENDPOINT_VARS if os.environ.get(v)), "")
    region = next((os.environ[v] for v in _REGION_VARS if os.environ.get(v)), "us-east-1")
    return {"endpoint": endpoint, "region": region,
            "key": os.environ.get("AWS_ACCESS_KEY_ID", ""),
            "secret": os.environ.get("AWS_SECRET_ACCESS_KEY", ""),
            "token": os.environ.get("AWS_SESSION_TOKEN", "")}


@lru_cache(maxsize=8)
def s3_filesystem(endpoint: str, region: str, key: str, secret: str, token: str):
    import pyarrow.fs as pafs

    kw = dict(access_key=key, secret_key=secret, session_token=token or None, region=region,
              connect_timeout=10, request_timeout=60)
    if endpoint:
        u = urlparse(endpoint if "://" in endpoint else "https://" + endpoint)
        kw.update(endpoint_override=u.netloc, scheme=u.scheme or "https")
    return pafs.S3FileSystem(**kw)


def _file_type(loc: Location):
    """pyarrow's FileType of ``loc``; S3 errors become one line naming the location."""
    try:
        return loc.filesystem().get_file_info(loc.path).type
    except OSError as e:
        raise BadInputError(f"{loc}: {error_reason(e)}") from None


def error_reason(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    for key, reason in (("NoSuchBucket", "the bucket does not exist"), ("AccessDenied", "access denied"), ("ACCESS_DENIED", "access denied"),
                        ("InvalidAccessKeyId", "the access key is not valid"),
                        ("SignatureDoesNotMatch", "the secret key is not valid"),
                        ("Couldn't connect", "cannot reach the S3 endpoint"),
                        ("curlCode: 7", "cannot reach the S3 endpoint")):
        if key in msg:
            return reason
    return msg[:300]


def exists(loc: Location) -> bool:
    import pyarrow.fs as pafs

    return _file_type(loc) != pafs.FileType.NotFound


def is_file(loc: Location) -> bool:
    import pyarrow.fs as pafs

    return _file_type(loc) == pafs.FileType.File


def is_dir(loc: Location) -> bool:
    import pyarrow.fs as pafs

    return _file_type(loc) == pafs.FileType.Directory


def check_writable(loc: Location) -> None:
    """Fail before any work when ``loc`` cannot be written: a bucket that does not exist, missing
    credentials, a read-only prefix (a probe object is written and removed). Local paths: nothing
    to check here (a local failure already names the path)."""
    if loc.is_local:
        return
    import pyarrow.fs as pafs

    fs = loc.filesystem()
    try:
        bucket = fs.get_file_info(loc.bucket)
    except OSError as e:
        raise BadInputError(f"{loc}: {error_reason(e)}") from None
    if bucket.type == pafs.FileType.NotFound:
        raise BadInputError(f"{loc}: the bucket {loc.bucket!r} does not exist")
    probe = loc.sibling(f".{loc.name}.write-probe")
    try:
        with fs.open_output_stream(probe.path) as f:
            f.write(b"probe")
        fs.delete_file(probe.path)
    except OSError as e:
        raise BadInputError(f"{loc}: not writable: {error_reason(e)}") from None


def read_bytes(loc: Location) -> bytes:
    if loc.is_local:
        return Path(loc.path).read_bytes()
    data = read_bytes_if_exists(loc)
    if data is None:
        raise BadInputError(f"{loc}: not found")
    return data


def write_bytes(loc: Location, data: bytes) -> None:
    """Write one object/file whole: locally via a temporary file, ``fsync`` and a rename (the
    temporary file is removed when the write fails: a full disk leaves nothing behind), on S3 with
    one PUT (an object appears complete or not at all)."""
    if loc.is_local:
        p = Path(loc.path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return
    try:
        with loc.filesystem().open_output_stream(loc.path) as f:
            f.write(data)
    except OSError as e:
        raise BadInputError(f"{loc}: cannot write: {error_reason(e)}") from None


def read_bytes_if_exists(loc: Location) -> Optional[bytes]:
    """The bytes of the file/object ``loc``, None when there is none (one request on S3: the read
    itself, not a lookup first)."""
    if loc.is_local:
        try:
            return Path(loc.path).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
    try:
        with loc.filesystem().open_input_stream(loc.path) as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise BadInputError(f"{loc}: {error_reason(e)}") from None


def file_size(loc: Location) -> Optional[int]:
    """The size in bytes of the file/object ``loc``, None when there is none."""
    import pyarrow.fs as pafs

    try:
        info = loc.filesystem().get_file_info(loc.path)
    except OSError as e:
        raise BadInputError(f"{loc}: {error_reason(e)}") from None
    return info.size if info.type == pafs.FileType.File else None


def sha256(loc: Location) -> str:
    """The SHA-256 of the file/object ``loc``, read in 1 MiB pieces."""
    h = hashlib.sha256()
    try:
        with loc.filesystem().open_input_stream(loc.path) as f:
            for piece in iter(lambda: f.read(1 << 20), b""):
                h.update(piece)
    except OSError as e:
        raise BadInputError(f"{loc}: {error_reason(e)}") from None
    return h.hexdigest()


def sync_dir(loc: Location) -> None:
    """Make the renames inside a local directory durable (``fsync`` of the directory); nothing
    to do on an object store."""
    if not loc.is_local:
        return
    try:
        fd = os.open(loc.path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def list_dirs(loc: Location) -> list[Location]:
    """The directories (object stores: the common prefixes) directly under ``loc``, sorted; none
    when ``loc`` does not exist."""
    return [p for p, is_directory in list_entries(loc) if is_directory]


def list_entries(loc: Location) -> list[tuple[Location, bool]]:
    """``(location, is_directory)`` of every entry directly under ``loc`` (object stores: the objects
    and common prefixes), sorted; none when ``loc`` does not exist."""
    import pyarrow.fs as pafs

    try:
        infos = loc.filesystem().get_file_info(pafs.FileSelector(loc.path, recursive=False, allow_not_found=True))
    except OSError as e:
        raise BadInputError(f"{loc}: {error_reason(e)}") from None
    return sorted(((Location(loc.scheme, i.path.rstrip("/")), i.type == pafs.FileType.Directory) for i in infos
                   if i.type in (pafs.FileType.File, pafs.FileType.Directory)), key=lambda x: x[0].path)


def list_files(loc: Location, suffix: str = "") -> list[Location]:
    """Files under a directory/prefix (recursive, sorted), optionally ending with ``suffix``."""
    import pyarrow.fs as pafs

    fs = loc.filesystem()
    try:
        infos = fs.get_file_info(pafs.FileSelector(loc.path, recursive=True, allow_not_found=True))
    except OSError as e:
        raise BadInputError(f"{loc}: {error_reason(e)}") from None
    return sorted((Location(loc.scheme, i.path) for i in infos
                   if i.type == pafs.FileType.File and i.path.endswith(suffix)), key=lambda x: x.path)


def delete_file(loc: Location) -> None:
    """Remove one file/object; missing is fine."""
    try:
        if loc.is_local:
            Path(loc.path).unlink(missing_ok=True)
        else:
            loc.filesystem().delete_file(loc.path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise BadInputError(f"{loc}: cannot delete: {error_reason(e)}") from None


def remove_dir_if_empty(loc: Location) -> None:
    """Remove the directory/prefix ``loc`` if nothing is left in it (an object store may keep an
    empty directory marker); never anything that holds a file."""
    try:
        if loc.is_local:
            os.rmdir(loc.path)
        elif not list_files(loc):
            loc.filesystem().delete_dir(loc.path)
    except FileNotFoundError:
        pass
    except OSError as e:
        if not loc.is_local:
            raise BadInputError(f"{loc}: cannot delete: {error_reason(e)}") from None


def delete_tree(loc: Location) -> None:
    """Remove a directory/prefix and everything under it; missing is fine."""
    if loc.is_local:
        shutil.rmtree(loc.path, ignore_errors=True)
        return
    fs = loc.filesystem()
    try:
        fs.delete_dir(loc.path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise BadInputError(f"{loc}: cannot delete: {error_reason(e)}") from None


def remote_root_timeout(default: Optional[int] = None) -> int:
    """Per-request timeout (whole seconds, as the XRootD client takes it) for remote ROOT reads:
    ``PIPELINE_REMOTE_TIMEOUT`` or ``default`` or 60."""
    return int(float(os.environ.get("PIPELINE_REMOTE_TIMEOUT", default or 60)))


def expand_remote_glob(url: str) -> list[str]:
    """The files a remote glob (``root://host//dir/*.root``, ``s3://bucket/dir/*/*.root``) matches,
    listed by the server (sorted). A URL without glob characters is returned as is."""
    if not glob.has_magic(url.split("://", 1)[1]):
        return [url]
    if url.lower().split("://", 1)[0] in ("s3", "s3a", "s3n"):
        return [str(loc) for loc in _match_store_glob(location(url))]
    import fsspec

    try:
        fsys, _, paths = fsspec.get_fs_token_paths(url)
    except Exception as e:                       # the client raises OSError, RuntimeError, ValueError...
        raise BadInputError(f"{url}: cannot list the files: {' '.join(str(e).split())[:300]}") from None
    return sorted(fsys.unstrip_protocol(p) for p in paths)


def _match_store_glob(pattern: Location) -> list[Location]:
    """The objects under the pattern's fixed prefix whose keys match it segment by segment (``*``
    and ``?`` stay within one ``/``-separated segment, as for local globs)."""
    parts = pattern.path.split("/")
    fixed = next(i for i, p in enumerate(parts) if glob.has_magic(p))
    base = Location(pattern.scheme, "/".join(parts[:fixed]))
    return [f for f in list_files(base) if len(f.path.split("/")) == len(parts)
            and all(fnmatch.fnmatchcase(a, b) for a, b in zip(f.path.split("/")[fixed:], parts[fixed:]))]


def open_root(path: str, **options):
    """``uproot.open`` with the per-request timeout for remote files (``root://``, ``http(s)://``);
    an ``s3://`` file is read through :mod:`pyarrow.fs` (uproot reads the file object it opens)."""
    import uproot

    scheme = path.split("://", 1)[0].lower() if "://" in path else "file"
    if scheme in ("root", "http", "https"):
        options.setdefault("timeout", remote_root_timeout())
    if scheme in ("http", "https"):
        options.setdefault("handler", uproot.source.http.HTTPSource)
    if _ALIASES.get(scheme, scheme) == "s3":
        loc = location(path)
        try:
            return uproot.open(loc.filesystem().open_input_file(loc.path), **options)
        except OSError as e:
            raise BadInputError(f"{loc}: {error_reason(e)}") from None
    return uproot.open(path, **options)
