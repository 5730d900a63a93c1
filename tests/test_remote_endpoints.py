"""Remotes that answer, but not as they should: a server trickling its replies at
1 KB/s (each socket read within the time-out, a whole object taking minutes), a
"Redis" that answers +OK to everything, an "S3" that is a plain web server's HTML
404, servers announcing replies of gigabytes. Each is a miss with one RemoteWarning, never a stall, a crash or an empty-looking
cache. Real redis-server, moto's S3 server, in-process misbehaving servers (threads,
stopped after each test) and real `quack` processes under hard time-outs."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import pytest
import remote_services
from remote_services import (
    answers_ok,
    free_port,
    huge_http_reply,
    huge_redis_reply,
    moto_s3,
    plain_http,
    redis_server,
    s3_error,
    trickle_proxy,
)
from test_remote_build import TOY2, build_json, env_for, project, quack, warning_lines
from test_remote_hardening_e2e import toy_refs

from quack import signing
from quack.errors import RemoteError, RemoteWarning
from quack.remote import objects, tier
from quack.remote.backend import open_backend

remote_services.require_modules("redis", "boto3", "moto")

NAME = "quack/v1/stamp/kern/0123456789abcdef/" + "a" * 64
MISSING = NAME[:-1] + "b"  # never stored (moto's objects outlive a server in-process)
BIG = 24_000  # at 1 KB/s a read of it takes 24 s; every test allows less than half that
ALLOWED = 10.0
HARD_TIMEOUT = 300  # the guard against a hang; never reached when it works


@pytest.fixture(autouse=True)
def _fresh_remote_state(fresh_remote_state):
    """tests/conftest.py's, for every test here."""


@pytest.fixture(scope="module")
def keydir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("keys")
    signing.write_keypair("ci-1", d)
    return d


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("redis")) as s:
        yield s


def remote_warnings(w) -> list[str]:
    return [str(x.message) for x in w if issubclass(x.category, RemoteWarning)]


def failing_get(b) -> tuple[RemoteError, float]:
    """``b.get(NAME)``, which must raise RemoteError: the error and the seconds it took;
    closes ``b``."""
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as e:
        b.get(NAME)
    took = time.monotonic() - t0
    b.close()
    return e.value, took


# --- 1. a remote that trickles its replies ---------------------------------------------------


def test_slow_redis_get_ends_at_the_operation_time_out(srv):
    srv.client().set(NAME, b"x" * BIG)
    with trickle_proxy(srv.port) as port:
        err, took = failing_get(open_backend(f"redis://127.0.0.1:{port}/0", op_timeout=2))
    assert err.reason == "timeout" and err.offline
    assert "GET " + NAME in str(err) and "QUACK_REMOTE_TIMEOUT" in str(err)
    assert took < ALLOWED, took  # the trickle needs BIG / 1024 s


def test_slow_s3_get_ends_at_the_operation_time_out(monkeypatch):
    import boto3

    with moto_s3() as url:
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        boto3.session.Session().client("s3").put_object(
            Bucket=bucket, Key=f"{prefix}/{NAME}", Body=b"x" * BIG
        )
        upstream = int(remote_services.os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
        with trickle_proxy(upstream) as port:
            monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
            err, took = failing_get(open_backend(url, op_timeout=2))
    assert err.reason == "timeout" and err.offline
    assert took < ALLOWED, took


def test_slow_remote_is_switched_off_with_one_warning(srv, keydir):
    """Through the tier, as the runtime's first call and the build's pull use it: a miss,
    the remote off, one warning; the next fetch does not ask the remote at all."""
    from test_remote_tier import ref

    key = signing.load_signing_key(keydir / "ci-1.key")
    r0, r1 = ref(0), ref(1)
    for r in (r0, r1):
        srv.client().set(objects.object_name(r), objects.pack(r, {}, b"o" * BIG, key))
    with trickle_proxy(srv.port) as port:
        t = tier.RemoteTier(
            open_backend(f"redis://127.0.0.1:{port}/0", op_timeout=2),
            trusted=signing.load_trusted_keys(str(keydir / "ci-1.pub")),
        )
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            t0 = time.monotonic()
            assert t.fetch(r0) is None and t.fetch(r1) is None
            took = time.monotonic() - t0
        t.close()
    assert t.offline and t.counters.errors == 1 and t.counters.hits == 0
    msgs = remote_warnings(w)
    assert len(msgs) == 1 and "took longer than the 2s time-out" in msgs[0], msgs
    assert "off for the rest of this process" in msgs[0]
    assert took < ALLOWED, took


def test_cache_pull_from_a_slow_remote_gives_up(tmp_path, srv, keydir):
    proj = project(tmp_path / "proj", TOY2)
    key = signing.load_signing_key(keydir / "ci-1.key")
    client = srv.client(db=3)
    for c, r in toy_refs(proj, tmp_path / "c"):
        client.set(objects.object_name(r), objects.pack(r, c.plain_params, b"o" * BIG, key))
    with trickle_proxy(srv.port) as port:
        env = env_for(tmp_path / "c", f"redis://127.0.0.1:{port}/3", keydir=keydir, QUACK_REMOTE_TIMEOUT=2)
        t0 = time.monotonic()
        r = quack(["cache", "pull", "--json"], proj, env, timeout=HARD_TIMEOUT)
        took = time.monotonic() - t0
    assert r.returncode == 1, r.stderr[-3000:]  # the remote went off: pull says so
    rep = json.loads(r.stdout)
    assert (rep["total"], rep["pulled"], rep["offline"]) == (2, 0, True)
    lines = warning_lines(r.stderr, "remote cache")
    assert len(lines) == 1 and "took longer than the 2s time-out" in lines[0], r.stderr[-3000:]
    # Two objects of BIG bytes at 1 KB/s: 48 s before; the process start is included here.
    assert took < 2 * ALLOWED, took


# --- 2. a "Redis" that answers +OK to everything ---------------------------------------------


def test_a_server_that_is_not_redis_is_unreachable_not_a_crash(keydir):
    from test_remote_tier import ref

    with answers_ok() as port:
        url = f"redis://127.0.0.1:{port}/0"
        with pytest.raises(RemoteError) as e:
            open_backend(url).get(NAME)
        assert e.value.reason == "unreachable" and "is it a Redis server?" in str(e.value)
        t = tier.RemoteTier(open_backend(url), trusted=signing.load_trusted_keys(str(keydir / "ci-1.pub")))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert t.fetch(ref(0)) is None and t.fetch(ref(1)) is None
        t.close()
    assert t.offline and t.counters.errors == 1
    msgs = remote_warnings(w)
    assert len(msgs) == 1 and "is it a Redis server?" in msgs[0], msgs


def test_a_backend_leaking_a_client_exception_is_a_miss(keydir):
    """The tier enforces the backend contract (only RemoteError): anything else a client
    library raises is a protocol error, one warning, a miss; it never reaches the caller."""
    from test_remote_tier import ref

    class Leaky:
        url = "redis://127.0.0.1:1/0"
        max_bytes = 1 << 20

        def get(self, name):
            raise AttributeError("'bytes' object has no attribute 'get'")

        exists = get

        def close(self):
            """Nothing to release: this fake holds no connection."""

    t = tier.RemoteTier(Leaky(), trusted=signing.load_trusted_keys(str(keydir / "ci-1.pub")))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert t.fetch(ref(0)) is None and t.fetch(ref(1)) is None
        assert t.has(ref(0)) is None
    assert t.counters.errors == 3
    msgs = remote_warnings(w)
    assert len(msgs) == 1 and "AttributeError" in msgs[0] and "treated as a miss" in msgs[0], msgs


def test_build_and_pull_with_a_server_that_is_not_redis(tmp_path, keydir):
    proj = project(tmp_path / "proj", TOY2)
    with answers_ok() as port:
        env = env_for(tmp_path / "c", f"redis://127.0.0.1:{port}/0", keydir=keydir)
        r = quack(["cache", "pull"], proj, env, timeout=HARD_TIMEOUT)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert "is it a Redis server?" in " ".join(r.stdout.split()), r.stdout
        res, err = build_json(proj, env, timeout=HARD_TIMEOUT)
    assert (res["ok"], res["compiled"], res["remote_hits"]) == (True, 2, 0)
    assert "Traceback" not in err
    lines = warning_lines(err, "remote cache")
    assert len(lines) == 1 and "is it a Redis server?" in lines[0], err[-3000:]


# --- 3. a remote announcing a reply far over the cap ----------------------------------------
# STRLEN or ContentLength is only asked first: the reply itself announces its length, and the
# clients read what it announces (a 1.5 GB GETRANGE reply, a 500 with a 1.5 GB error body
# took 4 to 5 GB and ran past the time-out). The fake servers count what they managed to send
# before the client hung up (up to 64 MiB, then they hang up themselves).

CAP = 1 << 20  # the cap on an object in these tests
TAKEN = 8 << 20  # what a client may take: the cap and a reply's framing, plus socket buffers


def _hung_up_early(flood) -> None:
    assert flood.done.wait(60), "the flood never ended"
    assert flood.cut.is_set() and flood.sent < TAKEN, f"the client read {flood.sent} bytes"


def _fetch_from_flood(url, keydir, flood):
    """One fetch through a capped tier at ``url`` (a flooding endpoint): a miss, the client
    hung up early; (the closed tier, the remote warnings it gave)."""
    from test_remote_tier import ref

    t = tier.RemoteTier(
        open_backend(url, max_bytes=CAP), trusted=signing.load_trusted_keys(str(keydir / "ci-1.pub"))
    )
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert t.fetch(ref(0)) is None
    _hung_up_early(flood)
    t.close()
    return t, remote_warnings(w)


@pytest.mark.parametrize("kind", ["bulk", "line", "array"])
def test_redis_reply_over_the_cap_is_refused_unread(kind, keydir):
    """``bulk``: a GETRANGE reply announcing 2 GiB after STRLEN said 100 bytes, refused
    from its ``$N`` header; ``line``: a status line that never ends; ``array``: 2 Gi bulks
    of 1 KiB, each under the cap. A refused object (size), one warning, the rest unread."""
    with huge_redis_reply(kind) as (port, flood):
        t, msgs = _fetch_from_flood(f"redis://127.0.0.1:{port}/0", keydir, flood)
    assert t.counters.rejected == 1 and dict(t.counters.rejected_by_reason) == {"size": 1}
    assert (t.counters.errors, t.counters.bytes_down, t.offline) == (0, 0, False)
    assert len(msgs) == 1 and "refused (size)" in msgs[0] and f"{CAP}-byte cap" in msgs[0], msgs


def test_redis_huge_reply_to_the_first_ping_is_not_redis():
    """Any other reply over the cap is a protocol error: to the first PING, not a Redis
    server (the remote goes off), the rest unread."""
    with huge_redis_reply("bulk", to=(b"PING",)) as (port, flood):
        b = open_backend(f"redis://127.0.0.1:{port}/0", max_bytes=CAP)
        with pytest.raises(RemoteError) as e:
            b.get(NAME)
        _hung_up_early(flood)
        b.close()
    assert e.value.reason == "unreachable" and e.value.offline
    assert "announcing 2147483648 bytes" in str(e.value) and "is it a Redis server?" in str(e.value)


def _fake_s3(monkeypatch, endpoint: str) -> None:
    for k, v in {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "y",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_s3_error_body_over_the_cap_is_refused_unread(chunked, keydir, monkeypatch):
    """A 500 whose error body is 2 GiB (or endless, chunked): botocore read an error's body
    whole. Now at most MAX_RESPONSE: an error, one warning, a miss, the rest unread."""
    from quack.remote import s3_backend

    with huge_http_reply(500, chunked=chunked) as (endpoint, flood):
        _fake_s3(monkeypatch, endpoint)
        t, msgs = _fetch_from_flood("s3://quack-bucket/ci", keydir, flood)
    assert (t.counters.errors, t.counters.rejected, t.counters.hits) == (1, 0, 0)
    assert len(msgs) == 1 and "HTTP 500" in msgs[0], msgs
    assert f"runs past the {s3_backend.MAX_RESPONSE}-byte cap" in msgs[0], msgs


def test_s3_put_reply_over_the_cap_is_refused_unread(monkeypatch):
    """botocore reads a PUT's reply whole as soon as it is sent (a 200 of 2 GiB here)."""
    with huge_http_reply(200) as (endpoint, flood):
        _fake_s3(monkeypatch, endpoint)
        b = open_backend("s3://quack-bucket/ci", max_bytes=CAP)
        with pytest.raises(RemoteError) as e:
            b.put_if_absent(NAME, b"x" * 100)
        _hung_up_early(flood)
        b.close()
    assert e.value.reason == "protocol" and "HTTP 200" in str(e.value), str(e.value)


# --- 5. an "S3" endpoint that is a plain web server -----------------------------------------


def test_s3_missing_key_on_real_s3_is_absent(monkeypatch):
    with moto_s3() as url:
        b = open_backend(url)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert b.get(MISSING) is None  # GET 404 with S3's NoSuchKey
            assert b.exists(MISSING) is False  # HEAD 404: no body, so no code, even from S3
        b.close()


def test_s3_endpoint_answering_html_404_is_a_protocol_error(monkeypatch):
    with moto_s3() as url, plain_http() as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        b = open_backend(url)
        with pytest.raises(RemoteError) as e:
            b.get(NAME)
        b.close()
    assert e.value.reason == "protocol"
    assert "404 without an S3 error code" in str(e.value) and "AWS_ENDPOINT_URL" in str(e.value)


def test_cache_pull_from_a_plain_web_server_warns(tmp_path, keydir, monkeypatch):
    proj = project(tmp_path / "proj", TOY2)
    with moto_s3() as url, plain_http() as endpoint:
        env = env_for(tmp_path / "c", url, keydir=keydir, AWS_ENDPOINT_URL=endpoint)
        r = quack(["cache", "pull", "--json"], proj, env, timeout=HARD_TIMEOUT)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    rep = json.loads(r.stdout)
    assert (rep["total"], rep["pulled"]) == (2, 0)
    assert rep["counters"]["errors"] == 2 and rep["counters"]["misses"] == 0, rep["counters"]
    assert (rep["missing"], rep["remote_errors"], r.returncode) == (0, 2, 1)  # errors, not absence
    lines = warning_lines(r.stderr, "remote cache")
    assert len(lines) == 1 and "404 without an S3 error code" in lines[0], r.stderr[-3000:]


# --- 6. the pull's counts: absent, refused, failed with a remote error, not asked ----------------


def _s3_env(tmp_path, keydir, endpoint: str) -> dict:
    return env_for(
        tmp_path / "c",
        "s3://quack-bucket/ci",
        keydir=keydir,
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="x",
        AWS_SECRET_ACCESS_KEY="y",
        AWS_DEFAULT_REGION="us-east-1",
    )


def test_cache_pull_from_a_remote_failing_every_fetch_fails(tmp_path, keydir):
    """An S3 answering 503 SlowDown to everything: the pull said "2 not available", exit 0,
    as if the cache were empty (the errors only in --json's counters). They are errors: in
    the report and its line, and a pull whose every fetch failed exits 1."""
    proj = project(tmp_path / "proj", TOY2)
    with s3_error(503, "SlowDown") as endpoint:
        env = _s3_env(tmp_path, keydir, endpoint)
        r = quack(["cache", "pull", "--json"], proj, env, timeout=HARD_TIMEOUT)
        human = quack(["cache", "pull"], proj, env, timeout=HARD_TIMEOUT)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    rep = json.loads(r.stdout)
    got = {
        k: rep[k] for k in ("total", "pulled", "missing", "refused", "remote_errors", "not_asked", "offline")
    }
    assert got == dict(total=2, pulled=0, missing=0, refused=0, remote_errors=2, not_asked=0, offline=False)
    lines = warning_lines(r.stderr, "remote cache")
    assert len(lines) == 1 and "SlowDown" in lines[0], r.stderr[-3000:]
    out = " ".join(human.stdout.split())
    assert human.returncode == 1, human.stderr[-3000:]
    assert "0 not available" in out and "2 failed with remote errors" in out, out
    assert "every fetch from s3://quack-bucket/ci (2) failed" in " ".join(human.stderr.split())


def test_cache_pull_counts_what_it_never_asked_for(tmp_path, keydir):
    """A refused port: the first fetch fails, the remote goes off, the other key is never
    asked for: neither "not available" nor an error of its own."""
    proj = project(tmp_path / "proj", TOY2)
    env = env_for(tmp_path / "c", f"redis://127.0.0.1:{free_port()}/0", keydir=keydir)
    r = quack(["cache", "pull", "--json"], proj, env, timeout=HARD_TIMEOUT)
    assert r.returncode == 1, r.stderr[-3000:]
    rep = json.loads(r.stdout)
    got = {k: rep[k] for k in ("total", "pulled", "missing", "remote_errors", "not_asked", "offline")}
    assert got == dict(total=2, pulled=0, missing=0, remote_errors=1, not_asked=1, offline=True)
    human = quack(["cache", "pull"], proj, env, timeout=HARD_TIMEOUT)
    out = " ".join(human.stdout.split())
    assert "0 not available" in out and "1 not asked, the remote being off" in out, out
