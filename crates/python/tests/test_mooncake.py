"""Conformance of ``ferry.mooncake.TransferEngine`` to Mooncake's ``mooncake.engine`` API
(0.3.13): every method, every metadata mode (P2P, an HTTP metadata server, a real etcd), the
failure returns, and both alias mechanisms. The peer runs in its own process
(``mooncake_peer.py``); docs/mooncake.md is the contract."""

import ctypes
import json
import logging
import os
import subprocess
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import ferry
from ferry.mooncake import BatchState, TransferEngine, TransferNotify, TransferOpcode

HERE = Path(__file__).resolve().parent
SIZE = 4 << 20


def pattern(n: int, seed: int) -> bytes:
    import random

    return random.Random(seed).randbytes(n)


class _Records(dict):
    """The fake metadata server's records, and the ``Ferry-Owner-Token`` each PUT and DELETE
    carried: ``tokens`` lists (method, key, token)."""

    def __init__(self):
        super().__init__()
        self.tokens = []


class _Metadata(BaseHTTPRequestHandler):
    """Mooncake's HTTP metadata protocol, for the tests: ``/metadata?key=K``."""

    store: _Records = _Records()

    def log_message(self, *args):  # quiet
        pass

    def _key(self):
        url = urllib.parse.urlparse(self.path)
        keys = urllib.parse.parse_qs(url.query).get("key")
        if url.path != "/metadata" or not keys:
            self.send_response(400)
            self.end_headers()
            return None
        return keys[0]

    def _reply(self, code, body=b""):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        key = self._key()
        if key is not None:
            if key in self.store:
                self._reply(200, self.store[key])
            else:
                self._reply(404, b"metadata not found")

    def do_PUT(self):
        key = self._key()
        if key is not None:
            self.store.tokens.append(("PUT", key, self.headers.get("Ferry-Owner-Token")))
            self.store[key] = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._reply(200, b"metadata updated")

    def do_DELETE(self):
        key = self._key()
        if key is not None:
            self.store.tokens.append(("DELETE", key, self.headers.get("Ferry-Owner-Token")))
            self.store.pop(key, None)
            self._reply(200, b"metadata deleted")


@pytest.fixture
def http_metadata():
    """An HTTP metadata server on loopback; yields (url, its store)."""
    store = _Records()
    handler = type("Handler", (_Metadata,), {"store": store})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/metadata", store
    srv.shutdown()
    srv.server_close()


class Peer:
    """A ``mooncake_peer.py`` process."""

    def __init__(self, hostname: str, meta: str, size: int = SIZE, env=None):
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "mooncake_peer.py"), hostname, meta, str(size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})},
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"mooncake peer exited: {self.proc.wait()}")
        info = json.loads(line)
        if "error" in info:
            raise RuntimeError(info["error"])
        self.name, self.buffer, self.port = info["name"], info["buffer"], info["port"]

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.kill()


@pytest.fixture(params=["p2p", "http", "etcd"])
def pair(request):
    """(local engine, its buffer, the peer process) in each metadata mode."""
    if request.param == "p2p":
        meta, host_t, host_l = "P2PHANDSHAKE", "127.0.0.1", "127.0.0.1"
    elif request.param == "http":
        meta = request.getfixturevalue("http_metadata")[0]
        host_t, host_l = "target-host:12345", "initiator-host:12347"
    else:
        meta = request.getfixturevalue("etcd_server")
        host_t, host_l = "127.0.0.1:12345", "127.0.0.1:12347"
    # Names are only names in the metadata modes: the engines listen where the bind address
    # says (here loopback), as Mooncake's do with MC_TCP_BIND_ADDRESS.
    env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    os.environ.update(env)
    peer = Peer(host_t, meta, env=env)
    te = TransferEngine()
    assert te.initialize(host_l, meta, "tcp", "") == 0, te.last_error()
    buf = te.allocate_managed_buffer(SIZE)
    assert buf != 0
    yield te, buf, peer
    te.close()
    peer.close()
    os.environ.pop("MC_TCP_BIND_ADDRESS", None)


def test_every_transfer_form_moves_the_bytes_in_every_metadata_mode(pair):
    te, buf, peer = pair
    remote = te.get_first_buffer_address(peer.name)
    assert remote == peer.buffer
    # One WRITE, one READ.
    data = pattern(SIZE, 7)
    assert te.write_bytes_to_buffer(buf, data, SIZE) == 0
    assert te.transfer_sync_write(peer.name, buf, remote, SIZE) == 0
    assert peer.ask("check 7") == "ok"
    assert peer.ask("fill 8") == "ok"
    assert te.transfer_sync_read(peer.name, buf, remote, SIZE) == 0
    assert te.read_bytes_from_buffer(buf, SIZE) == pattern(SIZE, 8)
    # Batches of 32 blocks: sync, generic with an opcode, async.
    block = SIZE // 32
    locs = [buf + i * block for i in range(32)]
    rems = [remote + i * block for i in range(32)]
    lens = [block] * 32
    te.write_bytes_to_buffer(buf, pattern(SIZE, 9), SIZE)
    assert te.batch_transfer_sync_write(peer.name, locs, rems, lens) == 0
    assert peer.ask("check 9") == "ok"
    assert peer.ask("fill 10") == "ok"
    assert te.batch_transfer_sync(peer.name, locs, rems, lens, TransferOpcode.Read) == 0
    assert te.read_bytes_from_buffer(buf, SIZE) == pattern(SIZE, 10)
    te.write_bytes_to_buffer(buf, pattern(SIZE, 11), SIZE)
    w = te.batch_transfer_async_write(peer.name, locs, rems, lens)
    assert w != 0
    assert te.get_batch_transfer_status([w]) == 0
    assert peer.ask("check 11") == "ok"
    assert peer.ask("fill 12") == "ok"
    r = te.batch_transfer_async(peer.name, locs, rems, lens, TransferOpcode.Read)
    assert r != 0 and te.get_batch_transfer_status([r]) == 0
    assert te.read_bytes_from_buffer(buf, SIZE) == pattern(SIZE, 12)
    assert te.batch_transfer_sync_read(peer.name, locs[:1], rems[:1], lens[:1]) == 0
    assert te.transfer_sync(peer.name, buf, remote, 16, TransferOpcode.Write) == 0
    # Submit and poll.
    b = te.transfer_submit_write(peer.name, buf, remote, 4096)
    assert b != 0
    while (s := te.transfer_check_status(b)) == 0:
        pass
    assert s == 1
    assert te.send_probe(peer.name) == 0


def test_the_metadata_modes_keep_a_record_and_take_it_away(http_metadata):
    url, store = http_metadata
    te = TransferEngine()
    assert te.initialize("node-a:9000", url, "tcp", "") == 0
    rec = json.loads(store["mooncake/ferry/node-a:9000"])
    assert rec["ferry_addr"].endswith(f":{te.get_rpc_port()}") and rec["protocol"] == "ferry"
    te.close()
    assert "mooncake/ferry/node-a:9000" not in store
    # Both carried one owner token (`ferry metadata-server` then refuses anyone else's).
    calls = [(m, t) for m, k, t in store.tokens if k == "mooncake/ferry/node-a:9000"]
    assert [m for m, _ in calls] == ["PUT", "DELETE"]
    assert calls[0][1] == calls[1][1] and len(calls[0][1]) >= 16


def test_initialize_ext_and_a_bare_host_port_are_etcd(etcd_server):
    where = etcd_server.removeprefix("etcd://")
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1:1", where, "tcp", "") == 0
    assert b.initialize_ext("127.0.0.1:2", where, "tcp", "", "etcd") == 0
    x = a.allocate_managed_buffer(4096)
    y = b.allocate_managed_buffer(4096)
    a.write_bytes_to_buffer(x, b"etcd!", 5)
    assert a.transfer_sync_write("127.0.0.1:2", x, y, 5) == 0
    assert b.read_bytes_from_buffer(y, 5) == b"etcd!"
    a.close()
    b.close()


def test_bad_input_returns_negative_codes_logs_a_reason_and_moves_nothing(pair, caplog):
    te, buf, peer = pair
    remote = te.get_first_buffer_address(peer.name)
    assert peer.ask("fill 3") == "ok"
    caplog.set_level(logging.ERROR, logger="ferry.mooncake")
    te.write_bytes_to_buffer(buf, b"\xff" * 64, 64)
    cases = [
        ("unregistered remote", lambda: te.transfer_sync_write(peer.name, buf, 0x1000, 8)),
        ("past the end", lambda: te.transfer_sync_write(peer.name, buf, remote + SIZE - 4, 8)),
        ("zero length", lambda: te.transfer_sync_write(peer.name, buf, remote, 0)),
        ("unregistered local", lambda: te.transfer_sync_read(peer.name, 0x1000, remote, 8)),
        ("mismatched lists", lambda: te.batch_transfer_sync_write(peer.name, [buf, buf], [remote], [8, 8])),
        ("one bad op of a batch", lambda: te.batch_transfer_sync_write(
            peer.name, [buf, buf], [remote, remote + SIZE], [8, 8])),
        ("unknown peer", lambda: te.transfer_sync_write("127.0.0.1:1", buf, remote, 8)),
    ]
    for what, call in cases:
        caplog.clear()
        assert call() < 0, what
        assert te.last_error() is not None, what
        assert len(caplog.records) == 1, (what, caplog.records)
        assert "failed" in caplog.records[0].getMessage(), what
    assert isinstance(te.last_error(), ferry.FerryError)
    # The refused ranges were refused before any byte moved: the peer's buffer is untouched.
    assert peer.ask("check 3") == "ok"
    # Async forms fail with 0, and an unknown batch id with -1.
    assert te.batch_transfer_async_write("127.0.0.1:1", [buf], [remote], [16]) == 0
    assert te.transfer_submit_write("127.0.0.1:1", buf, remote, 16) == 0
    assert te.batch_transfer_async_read(peer.name, [buf], [remote + SIZE], [16]) == 0
    assert te.get_batch_transfer_status([987654]) < 0
    assert te.transfer_check_status(987654) < 0
    assert te.send_probe("127.0.0.1:1") != 0
    # The last error is typed: the refused remote range is an UnknownAddress (a LookupError).
    assert te.transfer_sync_write(peer.name, buf, remote + SIZE, 1) == -1
    assert isinstance(te.last_error(), ferry.UnknownAddress)
    assert isinstance(te.last_error(), LookupError)


def test_a_registration_made_after_connecting_is_found():
    peer = Peer("127.0.0.1", "P2PHANDSHAKE")
    te = TransferEngine()
    try:
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        buf = te.allocate_managed_buffer(4096)
        assert te.transfer_sync_write(peer.name, buf, peer.buffer, 16) == 0
        late = int(peer.ask("register 4096"))
        te.write_bytes_to_buffer(buf, b"late registration", 17)
        assert te.transfer_sync_write(peer.name, buf, late, 17) == 0
        assert te.transfer_sync_read(peer.name, buf + 100, late, 17) == 0
        assert te.read_bytes_from_buffer(buf + 100, 17) == b"late registration"
    finally:
        te.close()
        peer.close()


def test_a_peer_that_dies_mid_batch_fails_it_and_names_what_may_have_landed(caplog):
    import signal

    # The peer copies (its shared registrations off): a one-sided WRITE into its managed
    # buffer would land while it is stopped, as RDMA's would, and the batch would complete.
    peer = Peer("127.0.0.1", "P2PHANDSHAKE", size=64 << 20,
                env={"FERRY_SAME_HOST_SHARED": "off"})
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = te.allocate_managed_buffer(64 << 20)
    block = 1 << 20
    locs = [buf + i * block for i in range(64)]
    rems = [peer.buffer + i * block for i in range(64)]
    assert te.transfer_sync_write(peer.name, buf, peer.buffer, 8) == 0  # connected
    caplog.set_level(logging.ERROR, logger="ferry.mooncake")
    # The peer stops before the batches start, so none of them can complete before it dies:
    # their first bytes reach its socket, unacknowledged.
    peer.proc.send_signal(signal.SIGSTOP)
    ids = [te.batch_transfer_async_write(peer.name, locs, rems, [block] * 64) for _ in range(2)]
    assert all(ids)
    peer.kill()
    assert [te.get_batch_transfer_status([i]) for i in ids] == [-1, -1]
    err = te.last_error()
    assert isinstance(err, ferry.PeerLost), err
    lines = [r.getMessage() for r in caplog.records]
    assert all(peer.name in line for line in lines), lines
    assert any("may have landed" in line for line in lines), lines
    # The engine is still usable, and the dead peer fails fast.
    assert te.transfer_sync_write(peer.name, buf, peer.buffer, 8) < 0
    te.close()


def test_poll_and_cancel_batch(pair):
    te, buf, peer = pair
    remote = te.get_first_buffer_address(peer.name)
    block = SIZE // 64
    locs = [buf + i * block for i in range(64)]
    rems = [remote + i * block for i in range(64)]
    b = te.batch_transfer_async_write(peer.name, locs, rems, [block] * 64)
    while (s := te.poll_batch(b)) == BatchState.RUNNING:
        pass
    assert s == BatchState.DONE
    assert te.get_batch_transfer_status([b]) == 0
    with pytest.raises(KeyError):
        te.poll_batch(b)
    c = te.batch_transfer_async_write(peer.name, locs, rems, [block] * 64)
    result = te.cancel_batch(c)
    assert result.outcome.drained
    assert 0 <= result.completed <= 64
    if result.completed == 64:
        assert result.may_have_landed == ()
    else:
        assert all(result.completed <= i < 64 for i in result.may_have_landed)
    with pytest.raises(KeyError):
        te.cancel_batch(c)
    r = te.batch_transfer_async_read(peer.name, locs, rems, [block] * 64)
    assert te.cancel_batch(r).may_have_landed == ()


def test_memory_registration_forms(pair):
    te, buf, peer = pair
    bufs = [ctypes.create_string_buffer(8192) for _ in range(3)]
    addrs = [ctypes.addressof(b) for b in bufs]
    assert te.batch_register_memory(addrs, [8192] * 3) == 0
    assert te.register_memory(addrs[0], 8192, "cpu:0") == 0  # the same range again: counted
    assert te.unregister_memory(addrs[0]) == 0
    assert te.register_memory(addrs[0] + 4096, 8192) == -7  # overlaps
    assert te.batch_register_memory(addrs, [8192]) == -1  # mismatched
    bufs[1].raw = b"x" * 8192
    assert te.transfer_sync_write(peer.name, addrs[1], te.get_first_buffer_address(peer.name), 8192) == 0
    assert te.batch_unregister_memory(addrs) == 0
    assert te.unregister_memory(addrs[0]) == -3  # all gone now
    assert te.transfer_sync_write(peer.name, addrs[1], peer.buffer, 16) == -1
    assert te.free_managed_buffer(buf, SIZE) == 0
    assert te.register_memory(0, 16) < 0


def test_the_rest_of_the_surface(pair):
    te, buf, peer = pair
    assert te.get_notifies() == []
    assert te.warmup_efa_segment(peer.name) == 0
    topo = json.loads(te.get_local_topology())
    assert topo and all(k.startswith(("cpu:", "cuda:")) for k in topo)
    assert all(len(v) == 2 and all(isinstance(x, list) for x in v) for v in topo.values())
    for call in (te.get_engine, te.get_engine_ptr):
        with pytest.raises(NotImplementedError, match="Mooncake Store"):
            call()
    assert TransferEngine.TransferOpcode.Read == 0 and TransferEngine.TransferOpcode.Write == 1
    assert te.get_rpc_port() > 0
    again = TransferEngine()
    assert again.get_rpc_port() == -1
    assert again.transfer_sync_write(peer.name, 0, 0, 8) == -1
    assert again.initialize("127.0.0.1", "redis://127.0.0.1:6379", "tcp", "") == -1


def test_notifications_arrive_after_their_transfer_in_order():
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    name = f"127.0.0.1:{b.get_rpc_port()}"
    src = a.allocate_managed_buffer(1 << 20)
    dst = b.allocate_managed_buffer(1 << 20)
    assert b.get_notifies() == []
    for i in range(3):
        a.write_bytes_to_buffer(src, bytes([65 + i]) * 4096, 4096)
        assert a.transfer_sync(name, src, dst + i * 4096, 4096, TransferOpcode.Write,
                               TransferNotify(f"block-{i}", f"written {i}")) == 0
    assert a.batch_transfer_sync(name, [src], [dst], [16], TransferOpcode.Read,
                                 TransferNotify("read", "done")) == 0
    got = b.get_notifies()
    assert [(n.name, n.msg) for n in got] == [
        ("block-0", "written 0"), ("block-1", "written 1"), ("block-2", "written 2"), ("read", "done")]
    # Each notification's transfer had landed before it was sent.
    assert b.read_bytes_from_buffer(dst + 2 * 4096, 4) == b"CCCC"
    assert b.get_notifies() == []
    # A failed transfer sends no notification.
    assert a.transfer_sync(name, src, dst + (1 << 20), 8, TransferOpcode.Write,
                           TransferNotify("never", "sent")) == -1
    assert b.get_notifies() == []
    # Nor does a failed batch (one op of it past the peer's buffer), which returns -1.
    assert a.batch_transfer_sync(name, [src, src], [dst, dst + (1 << 20)], [8, 8],
                                 TransferOpcode.Write, TransferNotify("never", "batch")) == -1
    assert a.batch_transfer_sync(name, [src], [dst + (1 << 20)], [8], TransferOpcode.Read,
                                 TransferNotify("never", "read")) == -1
    assert b.get_notifies() == []
    a.close()
    b.close()


def keyrings(tmp_path, names):
    """Per-peer keyrings: for each name, a file holding every name's key, its own first (the
    key an engine proves); key names are the engines' names."""
    keys = {n: bytes([i + 1]) * 16 for i, n in enumerate(names)}
    files = {}
    for n in names:
        f = tmp_path / f"{n}.key"
        f.write_text("".join(f"{m} {keys[m].hex()}\n" for m in [n] + [m for m in names if m != n]))
        f.chmod(0o600)
        files[n] = str(f)
    return files


def engine_as(name, meta, monkeypatch, key_file=None):
    """A TransferEngine in this process named ``name``, proving ``key_file``'s first key."""
    if key_file is None:
        monkeypatch.delenv("FERRY_AUTH_KEY_FILE", raising=False)
    else:
        monkeypatch.setenv("FERRY_AUTH_KEY_FILE", key_file)
    te = TransferEngine()
    assert te.initialize(name, meta, "tcp", "") == 0, te.last_error()
    return te


@pytest.mark.parametrize("keys", ["keyless", "per-peer-keyrings"])
def test_a_third_engine_naming_another_changes_no_completion(http_metadata, tmp_path, monkeypatch,
                                                             caplog, keys):
    """Issue 46: a third engine (keyless, or holding a key of its own) whose notifications
    name ``prefill`` files nothing under that name at decode, before and after prefill spoke;
    prefill's own are taken. Each forgery is dropped with a WARNING on ``ferry.mooncake``.
    Keyless, prefill's metadata record binds the name once decode looked it up; with per-peer
    keyrings prefill's key does, so decode looks nothing up."""
    meta = http_metadata[0]
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    files = (keyrings(tmp_path, ["decode", "prefill", "mallory"]) if keys != "keyless"
             else {"decode": None, "prefill": None, "mallory": None})
    decode = engine_as("decode", meta, monkeypatch, files["decode"])
    prefill = engine_as("prefill", meta, monkeypatch, files["prefill"])
    mallory = engine_as("mallory", meta, monkeypatch, files["mallory"])
    dst = decode.allocate_managed_buffer(1 << 16)
    src_p, src_m = prefill.allocate_managed_buffer(4096), mallory.allocate_managed_buffer(4096)
    if keys == "keyless":
        # decode knows prefill through its metadata record (its incarnation speaks for the name).
        assert decode.send_probe("prefill") == 0
    caplog.set_level(logging.WARNING, logger="ferry.mooncake")
    caplog.clear()

    # The forged completion comes with a transfer that moved (into decode's memory: anyone may
    # write there, keyless); the notification returns once decode's engine holds it.
    assert mallory.transfer_sync("decode", src_m, dst, 16, TransferOpcode.Write,
                                 TransferNotify("prefill", "kv-done:req-1")) == 0
    assert decode.get_notifies() == []
    dropped = [r.getMessage() for r in caplog.records
               if r.name == "ferry.mooncake" and r.levelno == logging.WARNING]
    assert len(dropped) == 1 and "dropped a notification naming 'prefill'" in dropped[0], dropped

    # prefill's own is taken, and a forgery after it is still dropped.
    assert prefill.transfer_sync("decode", src_p, dst, 16, TransferOpcode.Write,
                                 TransferNotify("prefill", "kv-done:req-1")) == 0
    assert mallory.transfer_sync("decode", src_m, dst, 16, TransferOpcode.Write,
                                 TransferNotify("prefill", "kv-done:req-2")) == 0
    got = decode.get_notifies()
    assert [(n.name, n.msg) for n in got] == [("prefill", "kv-done:req-1")]
    # mallory's notifications under its own name are taken.
    assert mallory.transfer_sync("decode", src_m, dst, 16, TransferOpcode.Write,
                                 TransferNotify("mallory", "hello")) == 0
    assert [(n.name, n.msg) for n in decode.get_notifies()] == [("mallory", "hello")]
    for te in (decode, prefill, mallory):
        te.close()


def test_a_redirected_record_pointing_at_another_key_holder_is_refused(http_metadata, tmp_path,
                                                                      monkeypatch):
    """Issue 46, S3: with per-peer keyrings mallory holds decode's key, so its engine passes
    decode's handshake. prefill's record, rewritten to send decode to mallory's address, still
    names prefill's server identity: decode refuses mallory there (AuthenticationFailed naming
    the address and the identity, Mooncake's handshake code) and reads nothing from it. The
    record put back, decode reaches prefill."""
    from ferry.mooncake import metadata
    from ferry.mooncake.engine import ERR_REJECT_HANDSHAKE

    meta, store = http_metadata
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    files = keyrings(tmp_path, ["decode", "prefill", "mallory"])
    decode = engine_as("decode", meta, monkeypatch, files["decode"])
    prefill = engine_as("prefill", meta, monkeypatch, files["prefill"])
    mallory = engine_as("mallory", meta, monkeypatch, files["mallory"])
    key = metadata.key_of("prefill")
    real = store[key]
    rec = json.loads(real)
    assert rec["server_identity"] == prefill._engine.server_identity
    redirected = dict(rec, ferry_addr=json.loads(store[metadata.key_of("mallory")])["ferry_addr"])
    store[key] = json.dumps(redirected).encode()

    assert decode.send_probe("prefill") == ERR_REJECT_HANDSHAKE
    e = decode.last_error()
    assert isinstance(e, ferry.AuthenticationFailed), repr(e)
    assert redirected["ferry_addr"] in str(e) and rec["server_identity"] in str(e), str(e)
    assert mallory._engine.server_identity in str(e), str(e)

    store[key] = real
    assert decode.send_probe("prefill") == 0, decode.last_error()
    for te in (decode, prefill, mallory):
        te.close()


def test_keyless_off_loopback_warns_on_the_ferry_mooncake_logger(monkeypatch, tmp_path, caplog):
    """S4: an engine listening off loopback without keys says so on ``ferry.mooncake``; on
    loopback, or with keys, it does not."""
    caplog.set_level(logging.WARNING, logger="ferry.mooncake")
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "0.0.0.0")
    engines = [engine_as("127.0.0.1", "P2PHANDSHAKE", monkeypatch)]
    warned = [r for r in caplog.records if r.name == "ferry.mooncake" and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "without authentication keys" in warned[0].getMessage()
    assert "FERRY_AUTH_KEY_FILE" in warned[0].getMessage()
    caplog.clear()
    engines.append(engine_as("127.0.0.1", "P2PHANDSHAKE", monkeypatch,
                             keyrings(tmp_path, ["keyed"])["keyed"]))
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    engines.append(engine_as("127.0.0.1", "P2PHANDSHAKE", monkeypatch))
    assert not [r for r in caplog.records if "without authentication keys" in r.getMessage()]
    for te in engines:
        te.close()


def test_cuda_methods_without_a_driver_return_negative_and_name_libcuda(tmp_path):
    script = tmp_path / "nocuda.py"
    script.write_text(
        "import logging, sys\n"
        "logging.basicConfig(level=logging.ERROR, stream=sys.stdout)\n"
        "from ferry.mooncake import TransferEngine\n"
        "te = TransferEngine()\n"
        "assert te.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', '') == 0\n"
        "name = f'127.0.0.1:{te.get_rpc_port()}'\n"
        "print('rc', te.transfer_write_on_cuda(name, 0, 0, 8), te.batch_transfer_read_on_cuda(name, [0], [0], [8]))\n"
        "print('cuda:0', te.register_memory(4096, 4096, 'cuda:0'))\n"
    )
    env = {**os.environ, "FERRY_LIBCUDA": str(tmp_path / "missing" / "libcuda.so.1")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "rc -303 -303" in out.stdout
    assert "libcuda" in out.stdout
    assert "cuda:0 -" in out.stdout


SCRIPT = """
from mooncake.engine import TransferEngine, TransferOpcode
import mooncake
te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
a = te.allocate_managed_buffer(4096)
name = f"127.0.0.1:{te.get_rpc_port()}"
b = te.allocate_managed_buffer(4096)
te.write_bytes_to_buffer(a, b"alias", 5)
assert te.transfer_sync_write(name, a, b, 5) == 0
assert te.read_bytes_from_buffer(b, 5) == b"alias"
print("ferry" if getattr(mooncake, "__ferry__", False) else "other", TransferEngine.__module__)
"""


def test_python_m_ferry_mooncake_runs_unchanged_mooncake_code(tmp_path):
    script = tmp_path / "uses_mooncake.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "FERRY_AS_MOONCAKE"}
    out = subprocess.run([sys.executable, "-m", "ferry.mooncake", str(script)],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ferry", "ferry.mooncake.engine"]
    # Without the alias, `mooncake` is whatever the environment has (here: nothing).
    plain = subprocess.run([sys.executable, "-c", "import mooncake.engine"], capture_output=True,
                           text=True, env=env, timeout=60)
    assert plain.returncode != 0 and "No module named 'mooncake'" in plain.stderr


def test_ferry_as_mooncake_in_the_environment_reaches_every_process(tmp_path):
    import site

    hooks = [Path(p) / "ferry_aliases.pth" for p in site.getsitepackages()]
    # The wheel installs the hook; an editable build (maturin develop) does not. `cargo xtask
    # ci` tests the installed wheel, so there (FERRY_REQUIRE_PYTHON=1) a missing hook fails.
    from conftest import require

    require(any(h.is_file() for h in hooks),
            f"no ferry_aliases.pth in {site.getsitepackages()} (an editable build has none; "
            "the wheel installs it)")
    script = tmp_path / "uses_mooncake.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "FERRY_AS_MOONCAKE": "1"}
    # A child started by a launcher: a plain interpreter, nothing but the variable.
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ferry", "ferry.mooncake.engine"]
    env["FERRY_AS_MOONCAKE"] = "0"
    off = subprocess.run([sys.executable, "-c", "import sys, ferry; print('mooncake' in sys.modules)"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert off.stdout.strip() == "False"


def test_cuda_memory_registers_and_moves_through_the_gpu_path(cuda_driver, tmp_path):
    """``cuda:0`` and ``*`` registrations of device memory (Ferry's fake driver here), and the
    ``*_on_cuda`` methods moving it to a peer's host memory and back."""
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    name = f"127.0.0.1:{b.get_rpc_port()}"
    host = b.allocate_managed_buffer(1 << 20)
    owner = ferry.Engine()
    dev = owner.alloc_gpu(0, 1 << 20)  # device memory the test owns; its pointer is the API's
    dev.copy_from(b"from the gpu" + bytes(100), 0)
    assert a.register_memory(dev.ptr, 1 << 20, "cuda:0") == 0
    assert a.transfer_write_on_cuda(name, dev.ptr, host, 12) == 0
    assert b.read_bytes_from_buffer(host, 12) == b"from the gpu"
    b.write_bytes_to_buffer(host, b"back to the gpu", 15)
    assert a.batch_transfer_read_on_cuda(name, [dev.ptr + 64], [host], [15]) == 0
    assert dev.to_bytes(offset=64, length=15) == b"back to the gpu"
    assert a.unregister_memory(dev.ptr) == 0
    assert a.register_memory(dev.ptr, 1 << 20) == 0  # "*": the driver says it is device memory
    assert a.transfer_sync_write(name, dev.ptr, host, 12) == 0
    assert a.unregister_memory(dev.ptr) == 0
    assert a.register_memory(dev.ptr, 1 << 20, "cuda:7") < 0  # not where the driver places it
    a.close()
    b.close()
