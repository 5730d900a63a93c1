"""Real services for the remote-cache tests: a redis-server on a free loopback
port with its own data directory, moto's S3 server, and a listening socket
that never answers. Every start waits a bounded time; every stop is bounded.

Without redis-server the Redis tests skip with an install hint, unless
QUACK_TEST_REQUIRE_SERVICES=1 (CI), where they fail."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

INSTALL_HINT = (
    "redis-server is not installed: apt-get install -y redis-server (Debian/Ubuntu) or "
    "brew install redis; CI sets QUACK_TEST_REQUIRE_SERVICES=1 so it fails instead of skipping"
)


def require_services() -> bool:
    return os.environ.get("QUACK_TEST_REQUIRE_SERVICES", "") == "1"


def require_modules(*names: str) -> None:
    """Skip the module (fail under QUACK_TEST_REQUIRE_SERVICES=1) without the client libraries."""
    import importlib.util

    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        msg = f"missing {', '.join(missing)}: pip install -e '.[remote,remote-test]'"
        if require_services():
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg, allow_module_level=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process. ``url`` is redis://127.0.0.1:PORT/0."""

    def __init__(self, data_dir: Path, *, maxmemory: str | None = None):
        exe = shutil.which("redis-server")
        if exe is None:
            if require_services():
                pytest.fail(INSTALL_HINT)
            pytest.skip(INSTALL_HINT)
        self.exe = exe
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.maxmemory = maxmemory
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        for _ in range(5):  # the free port may be taken between probe and bind: try another
            self.port = free_port()
            args = [
                self.exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.data_dir),
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
                "--daemonize",
                "no",
                "--logfile",
                str(self.data_dir / "redis.log"),
            ]
            if self.maxmemory:
                args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"]
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.proc.poll() is None:
                if self.ping():
                    return self
                time.sleep(0.05)
            self.stop()
        raise RuntimeError(f"redis-server did not start; see {self.data_dir / 'redis.log'}")

    def client(self, db: int = 0):
        import redis

        return redis.Redis(
            host="127.0.0.1", port=self.port, db=db, socket_timeout=5, socket_connect_timeout=1
        )

    def ping(self) -> bool:
        try:
            return bool(self.client().ping())
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def keys(self) -> list[bytes]:
        return sorted(self.client().keys("*"))


@contextlib.contextmanager
def redis_server(data_dir: Path, **kw):
    srv = RedisServer(data_dir, **kw).start()
    try:
        yield srv
    finally:
        srv.stop()


@contextlib.contextmanager
def silent_socket():
    """A loopback port that accepts TCP connections (the kernel's backlog) and
    never reads or answers: the 'hung server' case."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield s.getsockname()[1]
    finally:
        s.close()


@contextlib.contextmanager
def moto_s3(bucket: str = "quack-cache"):
    """moto's S3 server on loopback, a bucket made, and the AWS_* environment
    pointing boto3 at it (restored after)."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    saved = {
        k: os.environ.get(k)
        for k in (
            "AWS_ENDPOINT_URL",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_DEFAULT_REGION",
            "AWS_SESSION_TOKEN",
            "AWS_PROFILE",
        )
    }
    os.environ.update(
        {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    )
    os.environ.pop("AWS_SESSION_TOKEN", None)
    os.environ.pop("AWS_PROFILE", None)
    try:
        import boto3

        boto3.session.Session().client("s3").create_bucket(Bucket=bucket)
        yield f"s3://{bucket}/team-cache"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Server:
    """A loopback TCP server on a daemon thread, one thread per connection; ``stop``
    closes the listening socket and every connection (bounded: nothing is joined)."""

    def __init__(self, handle):
        self.handle = handle
        self.stopped = threading.Event()
        self.conns: list[socket.socket] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        try:
            self.handle(self, c)
        except OSError:
            pass
        finally:
            c.close()

    def stop(self) -> None:
        self.stopped.set()
        for s in [self.sock, *self.conns]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


@contextlib.contextmanager
def trickle_proxy(upstream_port: int, *, big: int = 2000, chunk: int = 1024, every: float = 1.0):
    """A proxy to ``upstream_port`` that passes requests at once but sends each reply read
    of more than ``big`` bytes at ``chunk`` bytes per ``every`` seconds (1 KB/s): a remote
    whose every socket read succeeds while a whole object takes minutes. Yields its port."""

    def pipe(srv: _Server, a: socket.socket, b: socket.socket, slow: bool) -> None:
        while not srv.stopped.is_set():
            d = a.recv(65536)
            if not d:
                break
            if slow and len(d) > big:
                for i in range(0, len(d), chunk):
                    b.sendall(d[i : i + chunk])
                    if srv.stopped.wait(every):
                        return
            else:
                b.sendall(d)

    def handle(srv: _Server, c: socket.socket) -> None:
        u = socket.create_connection(("127.0.0.1", upstream_port), timeout=10)
        u.settimeout(None)
        srv.conns.append(u)
        threading.Thread(target=_guard, args=(pipe, srv, u, c, True), daemon=True).start()
        pipe(srv, c, u, False)

    srv = _Server(handle)
    try:
        yield srv.port
    finally:
        srv.stop()


def _guard(fn, *args) -> None:
    try:
        fn(*args)
    except OSError:
        pass


@contextlib.contextmanager
def answers_ok():
    """A server that answers ``+OK`` to every request, whatever it is: not Redis, though
    it speaks RESP. Yields its port."""

    def handle(srv: _Server, c: socket.socket) -> None:
        while not srv.stopped.is_set() and c.recv(65536):
            c.sendall(b"+OK\r\n")

    srv = _Server(handle)
    try:
        yield srv.port
    finally:
        srv.stop()


@contextlib.contextmanager
def s3_error(status: int = 503, code: str = "SlowDown"):
    """An "S3" answering every request with S3's XML error ``code`` (503 SlowDown: a bucket
    throttled), as S3 would: a remote that is there but fails every fetch. Yields its URL."""
    import http.server

    body = (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        "<Message>Please reduce your request rate.</Message></Error>"
    ).encode()

    class Failing(http.server.BaseHTTPRequestHandler):
        def _fail(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                self.rfile.read(n)
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = do_PUT = do_POST = _fail

        def log_message(self, *a) -> None:
            pass

    with _serving(http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)) as url:
        yield url


@contextlib.contextmanager
def _serving(httpd):
    """Serve ``httpd`` on a daemon thread; yields its URL; shut down and closed after."""
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@contextlib.contextmanager
def plain_http():
    """A plain web server (http.server) answering a generic HTML 404 to everything: an
    endpoint that is not S3. Yields its URL."""
    import http.server

    class NotFound(http.server.BaseHTTPRequestHandler):
        def _404(self) -> None:
            self.send_error(404)

        do_GET = do_HEAD = do_PUT = do_POST = _404

        def log_message(self, *a) -> None:
            pass

    with _serving(http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)) as url:
        yield url


class Flood:
    """What a flooding server managed to send: ``sent`` bytes of the reply (counted per
    completed ``sendall``), and whether the client hung up before it was through."""

    def __init__(self) -> None:
        self.sent = 0
        self.cut = threading.Event()
        self.done = threading.Event()  # the flood ended: hung up on, or sent it all


def _flood(srv: _Server, c: socket.socket, flood: Flood, head: bytes, unit: bytes, hard: int) -> None:
    """Send ``head`` then ``unit`` repeatedly: up to ``hard`` bytes, then hang up (so a
    client that reads everything stops there too, instead of reading gigabytes). A small
    send buffer: what was sent is close to what the client took."""
    c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    try:
        c.sendall(head)
        flood.sent += len(head)
        while flood.sent < hard and not srv.stopped.is_set():
            c.sendall(unit)
            flood.sent += len(unit)
    except OSError:
        flood.cut.set()  # the client closed the connection: it read no further
    finally:
        flood.done.set()


@contextlib.contextmanager
def huge_redis_reply(
    kind: str, *, announce: int = 1 << 31, hard: int = 64 << 20, to: tuple[bytes, ...] = (b"GETRANGE", b"GET")
):
    """A "Redis" that answers PING, HELLO, SELECT and ``STRLEN`` (100 bytes, under any cap)
    as Redis does, then floods the reply to ``GETRANGE``/``GET``: ``bulk`` announces
    ``announce`` bytes (``$N``), ``line`` is a status line that never ends, ``array``
    announces ``announce`` bulks of 1 KiB. ``to``: the commands answered so (``PING``: the
    first contact). Yields (port, Flood)."""
    flood = Flood()
    head, unit = {
        "bulk": (b"$%d\r\n" % announce, b"\0" * 65536),
        "line": (b"+", b"x" * 65536),
        "array": (b"*%d\r\n" % announce, b"$1024\r\n" + b"\0" * 1024 + b"\r\n"),
    }[kind]

    def handle(srv: _Server, c: socket.socket) -> None:
        f = c.makefile("rb")
        while not srv.stopped.is_set():
            line = f.readline()
            if not line.startswith(b"*"):
                return
            args = []
            for _ in range(int(line[1:])):
                n = int(f.readline()[1:])
                args.append(f.read(n + 2)[:-2].upper())
            if args[0] in to:
                return _flood(srv, c, flood, head, unit, hard)
            c.sendall(
                {
                    b"PING": b"+PONG\r\n",
                    b"STRLEN": b":100\r\n",
                    b"HELLO": b"%2\r\n+proto\r\n:3\r\n+server\r\n+redis\r\n",  # RESP3 asked
                }.get(args[0], b"+OK\r\n")
            )

    srv = _Server(handle)
    try:
        yield srv.port, flood
    finally:
        srv.stop()


@contextlib.contextmanager
def huge_http_reply(status: int, *, announce: int = 1 << 31, hard: int = 64 << 20, chunked: bool = False):
    """An "S3" endpoint answering every request with HTTP ``status`` and a body of
    ``announce`` bytes (Content-Length; or ``chunked``, no length at all) that it floods
    (an error's XML, or a PUT's reply). Yields (endpoint URL, Flood)."""
    flood = Flood()
    if chunked:
        head = (
            b"HTTP/1.1 %d Oops\r\nContent-Type: application/xml\r\nTransfer-Encoding: chunked\r\n\r\n"
            % status
        )
        unit = b"10000\r\n" + b"A" * 65536 + b"\r\n"
    else:
        head = b"HTTP/1.1 %d Oops\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n\r\n" % (
            status,
            announce,
        )
        unit = b"A" * 65536
    xml = b"<Error><Code>InternalError</Code><Message>"
    head += b"%x\r\n%s\r\n" % (len(xml), xml) if chunked else xml

    def handle(srv: _Server, c: socket.socket) -> None:
        f = c.makefile("rb")
        if not f.readline():
            return
        while f.readline() not in (b"\r\n", b""):
            pass  # the headers; a request body (a PUT's) is left unread
        _flood(srv, c, flood, head, unit, hard)

    srv = _Server(handle)
    try:
        yield f"http://127.0.0.1:{srv.port}", flood
    finally:
        srv.stop()
