"""The backend contract (get, put_if_absent, exists; bytes in, bytes out;
RemoteError with a reason) against REAL servers: redis-server, moto's S3
server, a shared directory. Plus the failure modes: a refused port, a socket
that never answers, a full Redis."""

from __future__ import annotations

import os
import threading
import time

import pytest
import remote_services
from interrupt_support import scaled
from remote_services import redis_server, silent_socket

from quack.errors import RemoteError
from quack.remote.backend import open_backend
from quack.remote.base import redact

remote_services.require_modules("redis", "boto3", "moto")


@pytest.fixture(params=["redis", "s3", "file"])
def backend(request, tmp_path):
    if request.param == "redis":
        srv = request.getfixturevalue("redis_srv")
        srv.client().flushall()
        b = open_backend(srv.url)
    elif request.param == "s3":
        url = request.getfixturevalue("s3_url")
        b = open_backend(f"{url}/{request.node.name}")
    else:
        (tmp_path / "shared").mkdir()
        b = open_backend(f"file://{tmp_path / 'shared'}")
    yield b
    b.close()


NAME = "quack/v1/stamp/kern/0123456789abcdef/" + "a" * 64


def test_contract_round_trip(backend):
    assert backend.get(NAME) is None
    assert backend.exists(NAME) is False
    data = os.urandom(100_000) + b"\n\0tail"
    assert backend.put_if_absent(NAME, data) is True
    assert backend.exists(NAME) is True
    assert backend.get(NAME) == data
    # First writer wins: a second put does not replace it.
    assert backend.put_if_absent(NAME, b"other") is False
    assert backend.get(NAME) == data
    assert backend.get(NAME[:-1] + "b") is None


def test_racing_writers_one_object(backend):
    """16 threads put different bytes under one name: exactly one wins, and the
    stored object is the winner's, whole."""
    name = NAME[:-1] + "c"
    results: dict[int, bool] = {}
    payloads = {i: bytes([i]) * 50_000 for i in range(16)}
    barrier = threading.Barrier(16, timeout=30)

    def put(i):
        barrier.wait()
        results[i] = backend.put_if_absent(name, payloads[i])

    threads = [threading.Thread(target=put, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 16
    winners = [i for i, ok in results.items() if ok]
    assert len(winners) == 1
    assert backend.get(name) == payloads[winners[0]]


def test_redis_refused_port_is_unreachable_and_fast():
    from remote_services import free_port

    b = open_backend(f"redis://127.0.0.1:{free_port()}/0")
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as e:
        b.get(NAME)
    assert e.value.reason == "unreachable" and e.value.offline
    assert time.monotonic() - t0 < scaled(5)  # no retries with back-off


def test_redis_silent_socket_times_out():
    with silent_socket() as port:
        b = open_backend(f"redis://127.0.0.1:{port}/0", op_timeout=0.5)
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as e:
            b.get(NAME)
        assert e.value.reason == "timeout" and e.value.offline
        assert time.monotonic() - t0 < scaled(5)


def test_s3_silent_socket_times_out(monkeypatch):
    with silent_socket() as port:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        b = open_backend("s3://bucket/p", op_timeout=0.5)
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as e:
            b.get(NAME)
        assert e.value.reason == "timeout"
        assert time.monotonic() - t0 < scaled(5)


def test_redis_full_is_reported_as_full(tmp_path):
    with redis_server(tmp_path / "full", maxmemory="1mb") as srv:
        b = open_backend(srv.url)
        with pytest.raises(RemoteError) as e:
            for i in range(100):
                b.put_if_absent(f"{NAME}-{i}", os.urandom(200_000))
        assert e.value.reason == "full" and not e.value.offline
        assert "maxmemory" in str(e.value)


def test_s3_missing_bucket_and_file_missing_root(s3_url, tmp_path):
    b = open_backend("s3://no-such-bucket-quack/p")
    with pytest.raises(RemoteError) as e:
        b.get(NAME)
    assert "does not exist" in str(e.value)
    f = open_backend(f"file://{tmp_path / 'absent'}")
    with pytest.raises(RemoteError) as e:
        f.get(NAME)
    assert e.value.reason == "unreachable"
    with pytest.raises(RemoteError):
        f.put_if_absent(NAME, b"x")


def test_file_backend_refuses_escaping_names(tmp_path):
    f = open_backend(f"file://{tmp_path}")
    for bad in ("../x", "quack/../../x", "a//b", "/abs"):
        with pytest.raises(ValueError):
            f.get(bad)


def test_bad_urls_and_redaction():
    with pytest.raises(ValueError, match="unsupported scheme"):
        open_backend("http://example.com/")
    with pytest.raises(ValueError, match="three slashes"):
        open_backend("file://relative/path")
    assert redact("redis://:hunter2@h:6379/0") == "redis://:***@h:6379/0"
    assert "hunter2" not in redact("redis://user:hunter2@h/0")
