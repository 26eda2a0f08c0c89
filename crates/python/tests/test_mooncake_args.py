"""Mooncake's variables and arguments mean what docs/mooncake.md says (issue 51): ``MC_FORCE_TCP``
forces TCP sockets even towards a peer on this host, an RDMA protocol or device the machine
lacks is a WARNING on ``ferry.mooncake``, bad argument types and zero lengths are -1 with an
``InvalidArgument`` naming the argument, a closed engine says so, and metadata failures are one
sentence with a hint."""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import ferry
from ferry.mooncake import TransferEngine

HERE = Path(__file__).resolve().parent


def test_mc_force_tcp_takes_tcp_sockets_between_two_processes_on_one_host(monkeypatch):
    monkeypatch.delenv("FERRY_SAME_HOST", raising=False)
    monkeypatch.setenv("MC_FORCE_TCP", "true")
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "mooncake_peer.py"), "127.0.0.1", "P2PHANDSHAKE", str(1 << 20)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    te = TransferEngine()
    try:
        info = json.loads(proc.stdout.readline())
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        buf = te.allocate_managed_buffer(4096)
        assert te.transfer_sync_read(info["name"], buf, info["buffer"], 4096) == 0
        routes = te._engine.describe()["routes"]
        assert [r["transport"] for r in routes] == ["tcp"], routes
    finally:
        te.close()
        proc.kill()
        proc.wait()


def test_an_rdma_protocol_and_device_the_machine_lacks_are_a_warning(caplog):
    caplog.set_level(logging.INFO, logger="ferry.mooncake")
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "nosuch_dev0") == 0
    try:
        if "rdma" in str(te._engine.data_plane):
            pytest.skip("this machine has RDMA")
        warned = [r.getMessage() for r in caplog.records
                  if r.name == "ferry.mooncake" and r.levelno == logging.WARNING]
        assert any('protocol "rdma"' in m and "no usable RDMA device" in m for m in warned), warned
        assert any("nosuch_dev0" in m for m in warned), warned
    finally:
        te.close()


@pytest.fixture
def engine():
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = te.allocate_managed_buffer(4096)
    yield te, buf
    te.close()


@pytest.mark.parametrize("target,said", [
    (b"127.0.0.1:1", "target_hostname must be a str (the peer's name), not bytes"),
    (None, "target_hostname must be a str (the peer's name), not NoneType"),
])
def test_a_target_that_is_not_a_str_is_minus_one_with_a_reason(engine, target, said):
    te, buf = engine
    assert te.transfer_sync_write(target, buf, buf, 8) == -1
    assert te.batch_transfer_sync_read(target, [buf], [buf], [8]) == -1
    assert te.batch_transfer_async_write(target, [buf], [buf], [8]) == 0
    err = te.last_error()
    assert isinstance(err, ferry.InvalidArgument) and said in str(err), err


def test_list_entries_that_are_not_ints_are_named(engine):
    te, buf = engine
    assert te.batch_transfer_sync_write("127.0.0.1:1", [buf], ["0x10"], [8]) == -1
    err = te.last_error()
    assert isinstance(err, ferry.InvalidArgument)
    assert "peer_buffer_addresses[0] must be an int, not str" in str(err), err


def test_a_zero_length_is_a_length_problem(engine):
    te, buf = engine
    assert te.transfer_sync_read("127.0.0.1:1", buf, buf, 0) == -1
    err = te.last_error()
    assert isinstance(err, ferry.InvalidArgument) and "lengths[0] is 0" in str(err), err


def test_use_after_close_says_closed():
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = te.allocate_managed_buffer(4096)
    te.close()
    for rc in (te.transfer_sync_write("127.0.0.1:1", buf, buf, 8),
               te.register_memory(buf, 16)):
        assert rc < 0
        assert "closed" in str(te.last_error()), te.last_error()


def test_a_metadata_url_without_its_path_gives_a_hint():
    class NotFound(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _404(self):
            self.send_response(404)
            self.send_header("Content-Length", "18")
            self.end_headers()
            self.wfile.write(b"404 page not found")

        do_GET = do_PUT = do_DELETE = _404

    srv = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        te = TransferEngine()
        assert te.initialize("node-a", f"http://127.0.0.1:{srv.server_address[1]}", "tcp", "") == -1
        said = str(te.last_error())
        assert "HTTP 404" in said and "hint:" in said and "/metadata" in said, said
        assert "\n" not in said
    finally:
        srv.shutdown()
        srv.server_close()


def test_etcd_down_is_one_sentence_with_a_hint():
    te = TransferEngine()
    assert te.initialize("node-a", "etcd://127.0.0.1:1", "tcp", "") == -1
    said = str(te.last_error())
    assert said.startswith("cannot reach etcd at 127.0.0.1:1: "), said
    assert "hint:" in said and "tonic" not in said and "\n" not in said, said
