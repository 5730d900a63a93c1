"""The signed object format and the remote tier, with real keys, a real local
DiskStore and a real shared directory (file://) or a refused Redis port; the
object bytes are synthetic (no compile is the point here)."""

from __future__ import annotations

import base64
import hashlib
import json
import warnings
from collections import Counter

import pytest
import remote_services
from remote_services import free_port

from quack import settings, signing
from quack.cache import keys
from quack.cache.contract import ReadTier
from quack.cache.entry import EntryRef
from quack.cache.store import DiskStore
from quack.errors import ObjectRejected
from quack.remote import objects, tier
from quack.remote.backend import open_backend
from quack.remote.stats import read_stats
from quack.runtime import tiers

SRCFP = "0123456789abcdef"


def ref(i: int = 0, *, kernel: str = "toy_scale", srcfp: str = SRCFP) -> EntryRef:
    return EntryRef(kernel, hashlib.sha256(str(i).encode()).hexdigest(), "sm_90a", srcfp)


@pytest.fixture(autouse=True)
def _fresh_remote_state(fresh_remote_state):
    """tests/conftest.py's, for every test here."""


@pytest.fixture
def keyring(tmp_path):
    d = tmp_path / "keys"
    for n in ("ci-1", "evil"):
        signing.write_keypair(n, d)
    return {
        "ci": signing.load_signing_key(d / "ci-1.key"),
        "evil": signing.load_signing_key(d / "evil.key"),
        "trusted": signing.load_trusted_keys(str(d / "ci-1.pub")),
        "dir": d,
    }


DATA = bytes(range(256)) * 400  # ~100 KB "object file"


def test_pack_unpack_round_trip(keyring):
    blob = objects.pack(ref(), {"dtype": "float16"}, DATA, keyring["ci"], compile_s=1.5)
    data, header = objects.unpack(blob, ref(), keyring["trusted"])
    assert data == DATA
    assert header["signer"] == "ci-1" and header["params"] == {"dtype": "float16"}
    assert header["size"] == len(DATA) and header["stamp"] == keys.toolchain_stamp("sm_90a")
    assert objects.object_name(ref()) == f"quack/v1/{ref().stamp}/toy_scale/{SRCFP}/{ref().key}"


def _tamper_header(blob: bytes, **changes) -> bytes:
    header, body = objects.parse_header(blob)
    header.update(changes)
    return objects.MAGIC + keys.canonical_json(header).encode() + b"\n" + bytes(body)


def _raw_header(blob: bytes, field: bytes) -> bytes:
    """``blob`` with ``field`` (raw JSON text, e.g. ``"size":NaN``) in place of the header's
    ``size`` and ``compile_s``, signer and signature kept: what canonical JSON can't write."""
    header, body = objects.parse_header(blob)
    head = keys.canonical_json({k: v for k, v in header.items() if k not in ("size", "compile_s")})
    return objects.MAGIC + head[:-1].encode() + b"," + field + b"}\n" + bytes(body)


def _cases(k, r=None):
    """case -> (object stored under r's name, the reason it must be refused)."""
    r = r or ref()
    other = ref(int(r.key[:8], 16) + 1)
    good = objects.pack(r, {}, DATA, k["ci"])
    header, body = objects.parse_header(good)
    unsigned = dict(header)
    unsigned.pop("signature")
    flipped = bytearray(good)
    flipped[-100] ^= 0xFF
    return {
        "tampered-bytes": (bytes(flipped), "checksum"),
        "tampered-header": (_tamper_header(good, params={"dtype": "float32"}), "bad-signature"),
        "header-size-forged": (_tamper_header(good, size=len(DATA) - 1), "bad-signature"),
        "copied-under-another-key": (objects.pack(other, {}, DATA, k["ci"]), "wrong-key"),
        "untrusted-signer": (objects.pack(r, {}, DATA, k["evil"]), "untrusted"),
        "signer-name-forged": (
            _tamper_header(objects.pack(r, {}, DATA, k["evil"]), signer="ci-1"),
            "bad-signature",
        ),
        "truncated": (good[:-1000], "size"),
        "truncated-into-header": (good[:40], "malformed"),
        "unsigned": (
            objects.MAGIC + keys.canonical_json(unsigned).encode() + b"\n" + bytes(body),
            "unsigned",
        ),
        "garbage": (b"\x00" * 64, "malformed"),
        # 60,000 '[' (under the 64 KiB header cap): RecursionError, no ValueError, escaped
        # the header's parse and was reported as a broken tier, not a counted rejection.
        "deeply-nested-header": (objects.MAGIC + b"[" * 60_000 + b"\n" + DATA, "malformed"),
        # NaN / 1e999 (infinity) are no JSON, but json.loads takes them: the signed bytes
        # (canonical JSON) then raised ValueError past every refusal, a "failed fetch".
        "nan-in-header": (_raw_header(good, b'"size":NaN'), "malformed"),
        "infinite-number-in-header": (_raw_header(good, b'"size":1e999'), "malformed"),
        "minus-infinity-in-header": (_raw_header(good, b'"compile_s":-Infinity'), "malformed"),
        "other-source": (
            objects.pack(EntryRef(r.kernel, r.key, r.arch, "fedcba9876543210"), {}, DATA, k["ci"]),
            "wrong-source",
        ),
        "other-kernel": (
            objects.pack(EntryRef("toy_fail", r.key, r.arch, r.srcfp), {}, DATA, k["ci"]),
            "wrong-key",
        ),
    }


CASES = [
    "tampered-bytes",
    "tampered-header",
    "header-size-forged",
    "copied-under-another-key",
    "untrusted-signer",
    "signer-name-forged",
    "truncated",
    "truncated-into-header",
    "unsigned",
    "garbage",
    "deeply-nested-header",
    "nan-in-header",
    "infinite-number-in-header",
    "minus-infinity-in-header",
    "other-source",
    "other-kernel",
]


@pytest.mark.parametrize("case", CASES)
def test_every_tamper_is_refused(keyring, case):
    blob, reason = _cases(keyring)[case]
    with pytest.raises(ObjectRejected) as e:
        objects.unpack(blob, ref(), keyring["trusted"])
    assert e.value.reason == reason, str(e.value)
    assert e.value.key == ref().key


def test_a_header_canonical_json_refuses_is_malformed(keyring, monkeypatch):
    """The second guard: a header the parser let through (json.loads takes NaN) but the
    signed bytes can't be made of is a refusal, not a ValueError out of unpack."""
    import json

    blob = _raw_header(objects.pack(ref(), {}, DATA, keyring["ci"]), b'"size":NaN')
    monkeypatch.setattr(objects, "safe_loads", lambda data, **kw: json.loads(data))
    with pytest.raises(ObjectRejected) as e:
        objects.unpack(blob, ref(), keyring["trusted"])
    assert e.value.reason == "malformed" and "canonicalized" in str(e.value), str(e.value)


def test_wrong_stamp_refused(keyring, monkeypatch):
    blob = objects.pack(ref(), {}, DATA, keyring["ci"])
    monkeypatch.setattr(
        keys, "toolchain", lambda: {"python": "3.99", "cutlass_dsl": "9.9", "libs": "cu99", "tvm_ffi": "9"}
    )
    with pytest.raises(ObjectRejected) as e:
        objects.unpack(blob, ref(), keyring["trusted"])
    assert e.value.reason == "wrong-stamp"


def test_oversized_header_refused_without_scanning_everything(keyring):
    blob = objects.MAGIC + b"{" + b" " * (objects.MAX_HEADER + 10) + b"}\n" + DATA
    with pytest.raises(ObjectRejected) as e:
        objects.unpack(blob, ref(), keyring["trusted"])
    assert e.value.reason == "malformed"


# --- the tier --------------------------------------------------------------------------


@pytest.fixture
def shared(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    return d


@pytest.fixture
def store(tmp_path):
    return DiskStore(tmp_path / "cache", fsync=False)


def make_tier(url, keyring, *, write=False):
    return tier.RemoteTier(
        open_backend(url), trusted=keyring["trusted"], signer=keyring["ci"] if write else None, write=write
    )


def publish_local(store, r, data=DATA):
    with store.lock(r):
        tmp = store.tmp_obj(r)
        tmp.write_bytes(data)
        return store.publish(r, tmp, {"params": {"dtype": "float16"}, "compile_s": 0.5})


def test_push_then_fetch_into_a_fresh_store(keyring, shared, store, tmp_path):
    writer = make_tier(f"file://{shared}", keyring, write=True)
    entry = publish_local(store, ref())
    assert writer.push(store, entry) == "pushed"
    assert writer.push(store, entry) == "exists"
    fresh = DiskStore(tmp_path / "fresh", fsync=False)
    reader = make_tier(f"file://{shared}", keyring)
    assert isinstance(reader, ReadTier) and reader.name == "remote"
    got, name = tiers.fetch_into(fresh, ref(), (reader,))  # the runtime's chain: verify, publish locally
    assert name == "remote" and got is not None and got.obj_path.read_bytes() == DATA
    assert got.meta["params"] == {"dtype": "float16"} and got.meta["compile_s"] == 0.5
    assert fresh.lookup(ref()) is not None  # published through the store, checksum-verified
    assert tiers.fetch_into(fresh, ref(5), (reader,)) == (None, "")
    c = reader.counters
    assert (c.hits, c.misses, c.rejected, c.bytes_down > len(DATA)) == (1, 1, 0, True)
    assert (writer.counters.pushed, writer.counters.push_exists) == (1, 1)


def test_reader_never_pushes(keyring, shared, store):
    reader = make_tier(f"file://{shared}", keyring, write=False)
    assert reader.push(store, publish_local(store, ref())) == "off"
    assert not any(shared.rglob("*"))


def test_rejected_objects_are_counted_warned_once_never_stored(keyring, shared, store):
    backend = open_backend(f"file://{shared}")
    names = CASES
    for i, case in enumerate(names):
        blob, _ = _cases(keyring, ref(i))[case]
        assert backend.put_if_absent(objects.object_name(ref(i)), blob)
    reader = make_tier(f"file://{shared}", keyring)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for i in range(len(names)):
            assert tiers.fetch_into(store, ref(i), (reader,)) == (None, "")
    assert reader.counters.rejected == len(names)
    assert reader.counters.rejected_by_reason == Counter(_cases(keyring)[c][1] for c in names)
    remote_warnings = [x for x in w if issubclass(x.category, tier.RemoteWarning)]
    assert len(remote_warnings) == 1 and "refused" in str(remote_warnings[0].message)
    assert not list(store.root.rglob("*.o"))  # nothing refused reached the local store


def test_pushes_not_tried_after_a_full_remote_are_counted(keyring, store):
    """A full remote switches pushing off after the first failure; every later push is
    ``skipped`` and counted (a build of 100 keys said "push failed 1", 99 unpushed unsaid)."""
    from quack.errors import RemoteError

    class Full:
        url = "redis://127.0.0.1:1/0"
        max_bytes = 1 << 20

        def put_if_absent(self, name, data):
            raise RemoteError(f"remote cache {self.url} is full (OOM)", url=self.url, reason="full")

        def get(self, name):
            return None

        exists = get

        def close(self):
            """Nothing to release: this fake holds no connection."""

    writer = tier.RemoteTier(Full(), trusted=keyring["trusted"], signer=keyring["ci"], write=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = [writer.push(store, publish_local(store, ref(i))) for i in range(5)]
    assert got == ["failed"] + ["skipped"] * 4
    c = writer.counters
    assert (c.pushed, c.push_failed, c.push_skipped, c.errors) == (0, 1, 4, 1)
    assert c.to_json()["push_skipped"] == 4 and c.any()
    assert len([x for x in w if issubclass(x.category, tier.RemoteWarning)]) == 1
    reader = tier.RemoteTier(Full(), trusted=keyring["trusted"])  # a reader never pushes: not counted
    assert reader.push(store, publish_local(store, ref(9))) == "off" and reader.counters.push_skipped == 0


def test_refused_port_switches_remote_off_once(keyring, store):
    remote_services.require_modules("redis")
    url = f"redis://127.0.0.1:{free_port()}/0"
    reader = make_tier(url, keyring)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for i in range(20):
            assert reader.fetch(ref(i)) is None
        again = make_tier(url, keyring)  # another tier in this process: still off
        assert again.fetch(ref(0)) is None
    assert reader.offline and again.offline
    assert reader.counters.errors == 1 and again.counters.errors == 0
    assert len([x for x in w if issubclass(x.category, tier.RemoteWarning)]) == 1


def test_no_trusted_keys_reads_nothing(shared, store, keyring):
    backend = open_backend(f"file://{shared}")
    backend.put_if_absent(objects.object_name(ref()), objects.pack(ref(), {}, DATA, keyring["ci"]))
    reader = tier.RemoteTier(backend, trusted=signing.TrustedKeys())
    assert reader.fetch(ref()) is None
    assert reader.counters.hits == 0 and store.lookup(ref()) is None


def test_stats_recorded_and_summed(keyring, shared, store):
    writer = make_tier(f"file://{shared}", keyring, write=True)
    writer.push(store, publish_local(store, ref()))
    writer.record(store.root)
    writer.record(store.root)  # recording again never double-counts
    reader = make_tier(f"file://{shared}", keyring)
    assert reader.fetch(ref()) is not None and reader.fetch(ref(9)) is None
    reader.record(store.root)
    (store.root / "remote-stats.jsonl").open("a").write("{torn line\n")
    s = read_stats(store.root)
    assert (s["total"]["pushed"], s["total"]["hits"], s["total"]["misses"]) == (1, 1, 1)
    assert s["total"]["bytes_up"] > len(DATA) and s["total"]["bytes_down"] > len(DATA)
    assert list(s["per_url"]) == [f"file://{shared}"]


def test_from_settings(keyring, tmp_path):
    d = keyring["dir"]
    env = {"QUACK_REMOTE": f"file://{tmp_path}", "QUACK_TRUSTED_KEYS": str(d / "ci-1.pub")}
    t = tier.from_settings(settings.resolve(env=env, cwd=tmp_path))
    assert t is not None and not t.write and t.trusted.names == ("ci-1",)
    t = tier.from_settings(
        settings.resolve(
            env={**env, "QUACK_REMOTE_WRITE": "1", "QUACK_SIGNING_KEY": str(d / "ci-1.key")}, cwd=tmp_path
        )
    )
    assert t.write and t.signer.name == "ci-1"
    with pytest.warns(tier.RemoteWarning, match="no signing key"):
        t = tier.from_settings(settings.resolve(env={**env, "QUACK_REMOTE_WRITE": "1"}, cwd=tmp_path))
    assert not t.write
    with pytest.warns(tier.RemoteWarning, match="not used"):
        bad = {**env, "QUACK_TRUSTED_KEYS": str(d / "ci-1.key")}
        assert tier.from_settings(settings.resolve(env=bad, cwd=tmp_path)) is None
    with pytest.raises(Exception, match="PRIVATE"):
        tier.from_settings(settings.resolve(env=bad, cwd=tmp_path), strict=True)
    assert tier.from_settings(settings.resolve(env={}, cwd=tmp_path)) is None
    # The runtime's chain: remote after the local store (and bundles), before compiling.
    s = settings.resolve(env=env, cwd=tmp_path)
    order = [t.name for t in tiers.read_tiers(s)]
    assert order[-1:] == ["remote"]
    assert "remote" not in [t.name for t in tiers.read_tiers(settings.resolve(env={}, cwd=tmp_path))]
    with pytest.raises(settings.SettingsError, match="QUACK_REMOTE"):
        settings.resolve(env={"QUACK_REMOTE": "http://x"}, cwd=tmp_path)
    with pytest.raises(settings.SettingsError, match="QUACK_REMOTE_TIMEOUT"):
        settings.resolve(env={"QUACK_REMOTE_TIMEOUT": "30"}, cwd=tmp_path)


def test_signature_covers_every_header_field(keyring):
    """Changing any signed field (even informative ones) breaks the signature."""
    good = objects.pack(ref(), {"a": 1}, DATA, keyring["ci"], compile_s=1.0)
    for field, value in (
        ("compile_s", 0.1),
        ("created", 1.0),
        ("format", 2),
        ("arch", "sm_100a"),
        ("sha256", "0" * 64),
    ):
        with pytest.raises(ObjectRejected) as e:
            objects.unpack(_tamper_header(good, **{field: value}), ref(), keyring["trusted"])
        assert e.value.reason == "bad-signature", field
    sig = objects.parse_header(good)[0]["signature"]
    assert len(base64.b64decode(sig)) == 64
    assert json.loads(good[len(objects.MAGIC) : good.index(b"\n", len(objects.MAGIC))])["signer"] == "ci-1"


def test_summary_table_shows_the_remote():
    """`quack build`'s summary table: remote hits, pushed, rejected (with reasons), failures."""
    import io

    from rich.console import Console

    from quack_build.build import progress as display
    from quack_build.build.results import BuildResult

    res = BuildResult(
        [],
        2,
        remote_url="redis://h:6379/0",
        remote_offline=True,
        remote={
            "pushed": 3,
            "push_exists": 1,
            "rejected": 2,
            "push_failed": 1,
            "push_skipped": 4,
            "errors": 1,
            "rejected_by_reason": {"checksum": 1, "untrusted": 1},
        },
    )
    con = Console(file=io.StringIO(), width=200)
    display.print_summary(con, res)
    out = con.file.getvalue()
    for text in (
        "redis://h:6379/0",
        "(off: unreachable)",
        "remote hits",
        "remote pushed",
        "3 (1 already there)",
        "remote rejected",
        "2 (checksum 1, untrusted 1)",
        "remote push failed",
        "remote push skipped",
        "4 (not tried: pushing was off after a failure)",
        "remote errors",
    ):
        assert text in out, text
    js = res.to_json()
    assert (js["remote_hits"], js["remote_pushed"], js["remote_rejected"]) == (0, 3, 2)
    assert (js["remote_push_failed"], js["remote_push_skipped"], js["remote"]["push_skipped"]) == (1, 4, 4)
    assert js["remote"]["offline"] is True
    assert BuildResult([], 1).to_json()["remote"] is None
