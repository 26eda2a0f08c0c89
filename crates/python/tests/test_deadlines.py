"""A frozen peer (``SIGSTOP``) never holds a caller past its own deadline, on the network planes
(``FERRY_SAME_HOST=off``: TCP and io_uring) and on the same-host plane, under the Mooncake layer (``MC_TRANSFER_TIMEOUT``)
and under NIXL's ``release_xfer_handle``: the call returns within the deadline plus one second
with a typed timeout saying what completed and which WRITEs may have landed, and nothing lands
in the caller's buffers after it returned (checked once the peer runs again). Without the
engine's close at the deadline (``reconnect::until``) these calls return only at the kernel's
dead-peer limit, 20-30 s later.

Each case waits for events, not for time: the peer is stopped once the first bytes of the
batch are in the caller's buffer, and resumed before a fresh transfer proves it runs again."""

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import ferry
from ferry.mooncake import TransferEngine

HERE = Path(__file__).resolve().parent
SIZE = 64 << 20
OPS = 64
TIMEOUT = 5.0


def pattern(n: int, seed: int) -> bytes:
    import random

    return random.Random(seed).randbytes(n)


class MooncakePeer:
    """A ``mooncake_peer.py`` process."""

    def __init__(self, size: int):
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "mooncake_peer.py"), "127.0.0.1", "P2PHANDSHAKE", str(size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ),
        )
        info = json.loads(self.proc.stdout.readline())
        self.name, self.buffer = info["name"], info["buffer"]

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=30)


def _network_plane(monkeypatch, plane: str) -> None:
    if plane == "local":
        monkeypatch.delenv("FERRY_SAME_HOST", raising=False)
    else:
        monkeypatch.setenv("FERRY_SAME_HOST", "off")
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", str(int(TIMEOUT)))
    if plane == "tcp":
        monkeypatch.setenv("MC_FORCE_TCP", "true")
    else:
        monkeypatch.delenv("MC_FORCE_TCP", raising=False)


def _route(te: TransferEngine) -> str:
    routes = te._engine.describe()["routes"]
    assert len(routes) == 1, routes
    return routes[0]["transport"]


def _stop_once_landing(proc, buf: int, first: bytes, call: threading.Thread) -> bool:
    """Stops ``proc`` as soon as the first bytes of the batch are in ``buf`` (the batch runs in
    ``call``); False when the batch ended before (the caller tries again)."""
    while ctypes.string_at(buf, len(first)) != first:
        if not call.is_alive():
            return False
    proc.send_signal(signal.SIGSTOP)
    return call.is_alive()


def _mooncake_pair(monkeypatch, plane: str):
    _network_plane(monkeypatch, plane)
    # The owner copies (what a frozen owner holds): a peer's managed buffer mapped one-sidedly
    # would be copied with by this process whether its owner runs or not.
    monkeypatch.setenv("FERRY_SAME_HOST_SHARED", "off")
    peer = MooncakePeer(SIZE)
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    if plane == "uring" and te._engine.data_plane != "uring":
        te.close()
        peer.close()
        pytest.skip(f"io_uring is not this kernel's plane ({te._engine.data_plane})")
    return te, peer


@pytest.mark.parametrize("plane", ["tcp", "uring", "local"])
def test_a_mooncake_read_from_a_frozen_peer_ends_at_its_deadline_and_nothing_lands_later(
        monkeypatch, caplog, plane):
    te, peer = _mooncake_pair(monkeypatch, plane)
    try:
        buf = te.allocate_managed_buffer(SIZE)
        probe = te.allocate_managed_buffer(4096)
        assert peer.ask("fill 7") == "ok"
        want = pattern(SIZE, 7)
        assert te.transfer_sync_read(peer.name, probe, peer.buffer, 4096) == 0
        assert _route(te) == plane
        block = SIZE // OPS
        locs = [buf + i * block for i in range(OPS)]
        rems = [peer.buffer + i * block for i in range(OPS)]
        caplog.set_level(logging.ERROR, logger="ferry.mooncake")
        for _ in range(5):
            ctypes.memset(buf, 0, SIZE)
            got: dict = {}

            def read():
                t0 = time.monotonic()
                got["rc"] = te.batch_transfer_sync_read(peer.name, locs, rems, [block] * OPS)
                got["took"] = time.monotonic() - t0

            call = threading.Thread(target=read)
            call.start()
            if _stop_once_landing(peer.proc, buf, want[:64], call):
                break
            call.join()
        else:
            pytest.fail("five batches ended before the peer could be stopped")
        call.join(timeout=TIMEOUT + 30)
        assert not call.is_alive(), "the frozen peer holds the call"
        deadline = TIMEOUT + SIZE * 1e-9
        print(f"{plane}: batch_transfer_sync_read returned {got['rc']} after {got['took']:.2f} s "
              f"(deadline {deadline:.2f} s)")
        assert got["rc"] == -1
        assert got["took"] <= deadline + 1.0, got
        err = te.last_error()
        assert isinstance(err, ferry.Timeout), err
        assert err.outcome.drained and err.outcome.completed_ops < OPS
        line = caplog.records[-1].getMessage()
        assert "Timeout" in line and "completed before it" in line, line
        after = ctypes.string_at(buf, SIZE)
        # The peer runs again (its answer proves it), and a fresh transfer from it completes:
        # whatever its old streams still had to send never reaches our buffer.
        peer.proc.send_signal(signal.SIGCONT)
        assert peer.ask("check 7") == "ok"
        assert te.transfer_sync_read(peer.name, probe, peer.buffer, 4096) == 0
        assert te.read_bytes_from_buffer(probe, 4096) == want[:4096]
        assert ctypes.string_at(buf, SIZE) == after, "bytes landed after the call returned"
    finally:
        te.close()
        peer.close()


@pytest.mark.parametrize("plane", ["tcp", "uring", "local"])
def test_a_mooncake_write_to_a_frozen_peer_ends_at_its_deadline_naming_what_may_have_landed(
        monkeypatch, caplog, plane):
    te, peer = _mooncake_pair(monkeypatch, plane)
    try:
        buf = te.allocate_managed_buffer(SIZE)
        assert te.transfer_sync_write(peer.name, buf, peer.buffer, 8) == 0
        assert _route(te) == plane
        block = SIZE // OPS
        caplog.set_level(logging.ERROR, logger="ferry.mooncake")
        # Stopped first: the WRITEs' first bytes fill its socket and nothing is acknowledged.
        peer.proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        rc = te.batch_transfer_sync_write(peer.name, [buf + i * block for i in range(OPS)],
                                          [peer.buffer + i * block for i in range(OPS)],
                                          [block] * OPS)
        took = time.monotonic() - t0
        deadline = TIMEOUT + SIZE * 1e-9
        print(f"{plane}: batch_transfer_sync_write returned {rc} after {took:.2f} s "
              f"(deadline {deadline:.2f} s)")
        assert rc == -1
        assert took <= deadline + 1.0, took
        err = te.last_error()
        assert isinstance(err, ferry.Timeout), err
        line = caplog.records[-1].getMessage()
        assert "Timeout" in line and "may have landed" in line, line
        peer.proc.send_signal(signal.SIGCONT)
        assert peer.ask("fill 1") == "ok"
        assert te.transfer_sync_write(peer.name, buf, peer.buffer, 8) == 0
    finally:
        te.close()
        peer.close()


@pytest.mark.parametrize("same_host", ["off", "on"])
def test_nixl_release_of_a_read_from_a_frozen_peer_returns_within_a_second(monkeypatch, same_host):
    np = pytest.importorskip("numpy")
    from ferry.nixl import nixl_agent

    monkeypatch.setenv("FERRY_SAME_HOST", same_host)
    monkeypatch.setenv("FERRY_BIND_ADDRESS", "127.0.0.1")
    proc = subprocess.Popen([sys.executable, str(HERE / "nixl_peer.py"), "frozen", str(SIZE)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ))
    try:
        info = json.loads(proc.stdout.readline())
        proc.stdin.write("fill 3\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "ok"
        want = np.random.default_rng(3).integers(0, 256, size=SIZE, dtype=np.uint8)
        agent = nixl_agent("caller")
        kv = np.zeros(SIZE, dtype=np.uint8)
        agent.register_memory([(kv.ctypes.data, SIZE, 0, "")], "DRAM")
        name = agent.add_remote_agent(bytes.fromhex(info["metadata"]))
        block = SIZE // OPS
        local = agent.prep_xfer_dlist("", [(kv.ctypes.data + i * block, block, 0) for i in range(OPS)], "DRAM")
        remote = agent.prep_xfer_dlist(name, [(info["buffer"] + i * block, block, 0) for i in range(OPS)], "DRAM")
        warm = agent.make_prepped_xfer("READ", local, [0], remote, [0])
        assert agent.transfer(warm) in ("PROC", "DONE")
        while (s := agent.check_xfer_state(warm)) == "PROC":
            pass
        assert s == "DONE"
        agent.release_xfer_handle(warm)
        plane = agent._engine.describe()["routes"][0]["transport"]
        assert (plane == "local") == (same_host == "on"), plane
        for _ in range(5):
            kv[:] = 0
            h = agent.make_prepped_xfer("READ", local, list(range(OPS)), remote, list(range(OPS)))
            agent.transfer(h)
            while not kv[:64].any() and agent.check_xfer_state(h) == "PROC":
                pass
            proc.send_signal(signal.SIGSTOP)
            if agent.check_xfer_state(h) == "PROC":
                break
            proc.send_signal(signal.SIGCONT)
            agent.release_xfer_handle(h)
        else:
            pytest.fail("five transfers ended before the peer could be stopped")
        t0 = time.monotonic()
        agent.release_xfer_handle(h)
        took = time.monotonic() - t0
        print(f"{plane}: release_xfer_handle returned after {took:.2f} s")
        assert took <= 1.0, took
        after = kv.copy()
        proc.send_signal(signal.SIGCONT)
        proc.stdin.write("check 3\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "ok"
        again = agent.make_prepped_xfer("READ", local, [OPS - 1], remote, [OPS - 1])
        agent.transfer(again)
        while (s := agent.check_xfer_state(again)) == "PROC":
            pass
        assert s == "DONE", agent.ferry_error(again)
        assert np.array_equal(kv[-block:], want[-block:])
        assert np.array_equal(kv[:-block], after[:-block]), "bytes landed after the release"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait(timeout=30)


def test_nixl_ferry_error_is_a_sentence(monkeypatch):
    np = pytest.importorskip("numpy")
    from ferry.nixl import nixl_agent

    monkeypatch.setenv("FERRY_BIND_ADDRESS", "127.0.0.1")
    size = 8 << 20
    proc = subprocess.Popen([sys.executable, str(HERE / "nixl_peer.py"), "lost", str(size)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ))
    try:
        info = json.loads(proc.stdout.readline())
        agent = nixl_agent("sayer")
        kv = np.zeros(size, dtype=np.uint8)
        agent.register_memory([(kv.ctypes.data, size, 0, "")], "DRAM")
        name = agent.add_remote_agent(bytes.fromhex(info["metadata"]))
        block = size // 8
        local = agent.prep_xfer_dlist("", [(kv.ctypes.data + i * block, block, 0) for i in range(8)], "DRAM")
        remote = agent.prep_xfer_dlist(name, [(info["buffer"] + i * block, block, 0) for i in range(8)], "DRAM")
        proc.send_signal(signal.SIGSTOP)
        h = agent.make_prepped_xfer("WRITE", local, list(range(8)), remote, list(range(8)))
        assert agent.transfer(h) == "PROC"
        proc.kill()
        proc.wait()
        while (state := agent.check_xfer_state(h)) == "PROC":
            pass
        assert state == "ERR"
        why = agent.ferry_error(h)
        # One sentence, as the Mooncake layer's: the typed failure, what completed, the WRITEs.
        assert why.split(":")[0] in ("PeerLost", "IoError", "Timeout"), why
        assert "completed before it" in why and "may have landed" in why, why
        assert "Outcome(" not in why, why
        agent.release_xfer_handle(h)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
