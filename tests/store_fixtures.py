"""Fixtures for tests that run the same case on a local path and on the S3 server (moto, loopback):
import them into the test module (``from store_fixtures import s3, store_root  # noqa: F401``)."""
from __future__ import annotations

import pytest

from servers import environment, s3_server


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture(params=["local", "s3"])
def store_root(request, tmp_path):
    """The parent of a test's outputs: a local directory, or a prefix on the S3 server (with the
    writer's settings in the environment for the test's duration)."""
    if request.param == "local":
        yield str(tmp_path)
        return
    server = request.getfixturevalue("s3")
    with environment(**server.env("writer")):
        yield f"s3://{server.bucket}/{tmp_path.name}"
