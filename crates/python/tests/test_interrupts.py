"""No panic reaches Python, every argument is checked, and every blocking wait gives way to
Ctrl-C: a SIGINT sent while the call blocks raises ``KeyboardInterrupt`` within a second and
stops what was waited for, and an exception raised by a ``progress`` callback stops the pull
and is raised to the caller."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import ferry
import ferry.broadcast
from ferry.broadcast import Publisher, pull

# How soon after the signal the call must have raised.
# A process started with SIGINT ignored (a background job of a non-interactive shell) never
# raises KeyboardInterrupt. These tests send SIGINT to themselves, so they take Python's own
# handler whatever they were started with.
signal.signal(signal.SIGINT, signal.default_int_handler)

PROMPT = 1.0


@contextlib.contextmanager
def sigint_inside(name: str, owner=None, before=None):
    """Expects the block to raise ``KeyboardInterrupt`` promptly after a SIGINT that is sent
    once the main thread has entered the native call ``name`` (of ``owner`` when given): the
    profiler's ``c_call`` event says so, and nothing in Python runs between it and the call.
    ``before()``, when given, runs at that moment first (in the main thread)."""
    entered = threading.Event()
    sent: list[float] = []

    def profile(frame, event, arg):
        if (
            event == "c_call"
            and getattr(arg, "__name__", None) == name
            and (owner is None or getattr(arg, "__self__", None) is owner)
            and not entered.is_set()
        ):
            if before is not None:
                before()
            entered.set()

    def fire():
        if entered.wait(30):
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=fire, daemon=True).start()
    sys.setprofile(profile)
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        sys.setprofile(None)
    caught = time.monotonic()
    assert sent, f"{name} was never called"
    assert caught - sent[0] < PROMPT, f"KeyboardInterrupt {caught - sent[0]:.2f} s after SIGINT"


@pytest.fixture
def silent_server():
    """A TCP listener that accepts and never answers: its address."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(16)
    held = []
    stop = threading.Event()

    def accept():
        lst.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(lst.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield "127.0.0.1:%d" % lst.getsockname()[1]
    stop.set()
    t.join()
    for c in held:
        c.close()
    lst.close()


@pytest.mark.parametrize("under", ["guard", "detach", "block_on"])
def test_a_panic_is_a_ferry_error_and_the_engine_goes_on(loopback, under):
    _, client, peer, buf = loopback
    with pytest.raises(ferry.FerryError, match="internal error .*a test panic") as e:
        ferry._ferry._panic_for_tests(under)
    assert type(e.value).__module__ == "ferry"
    # The engine, its runtime and the peer still work.
    buf[:4] = b"abcd"
    local = client.register(bytearray(4))
    client.read(local, peer.segment("seg"), length=4).wait()
    client.connect(peer.addr)


def test_every_documented_number_is_checked(loopback, np):
    _, client, peer, _ = loopback
    reg = client.register(bytearray(64))
    bad = [
        lambda: ferry.Engine(streams=-1),
        lambda: ferry.Engine(depth=-1),
        lambda: ferry.Engine(chunk_size=-1),
        lambda: ferry.Engine(socket_buffer=-1),
        lambda: ferry.Engine(io_threads=-1),
        lambda: ferry.Engine(request_timeout=float("nan")),
        lambda: ferry.Engine(connect_timeout=-1),
        lambda: ferry.Batch(timeout=float("inf")),
        lambda: client.read(reg, peer.segment("seg"), timeout=float("nan")),
        lambda: client.read(reg, peer.segment("seg"), length=-1),
        lambda: client.read(reg, peer.segment("seg"), length=4).wait(timeout=-1),
        lambda: pull(client, "127.0.0.1:1", {"w": np.zeros(4)}, timeout=-1),
        lambda: pull(client, "127.0.0.1:1", {"w": np.zeros(4)}, timeout=float("nan")),
        lambda: pull(client, "127.0.0.1:1", {"w": np.zeros(4)}, linger=-1),
        lambda: pull(client, "127.0.0.1:1", {"w": np.zeros(4)}, version=-1),
        lambda: Publisher(client, {"w": np.zeros(4)}, name="x", keep_versions=0),
        lambda: Publisher(client, {"w": np.zeros(4)}, name="x", version=-1),
        lambda: Publisher(client, {"w": np.zeros(4)}, name="x", chunk_size=0),
    ]
    names = [
        "streams", "depth", "chunk_size", "socket_buffer", "io_threads", "request_timeout",
        "connect_timeout", "timeout", "timeout", "length", "timeout", "timeout", "timeout",
        "linger", "version", "keep_versions", "version", "chunk_size",
    ]
    for call, name in zip(bad, names, strict=True):
        with pytest.raises(ferry.InvalidArgument, match=name):
            call()


def test_ctrl_c_interrupts_connecting_to_a_silent_server(silent_server):
    engine = ferry.Engine(connect_timeout=60)
    with sigint_inside("connect", engine):
        engine.connect(silent_server)
    # The engine is still usable.
    assert engine.describe()["peer_id"]


def test_ctrl_c_interrupts_the_raw_engines_connect(silent_server):
    raw = ferry._ferry.RawEngine(ferry.Engine(connect_timeout=60))
    with sigint_inside("connect", raw):
        raw.connect(silent_server)


def test_ctrl_c_interrupts_a_pull_joining_a_silent_source(silent_server, np):
    engine = ferry.Engine(listen="127.0.0.1:0")
    live = {"w": np.zeros(1024, np.float32)}
    before = engine.describe()["registrations"]
    with sigint_inside("_join"):
        pull(engine, silent_server, live, name="policy")
    # What the pull registered was closed again.
    assert engine.describe()["registrations"] == before


def test_ctrl_c_interrupts_and_cancels_a_wait_on_a_stopped_peer(peer_process, np):
    engine = ferry.Engine()
    peer = engine.connect(peer_process.addr)
    dst = np.zeros(1 << 20, np.uint32)
    reg = engine.register(dst)
    peer_process.stop()
    req = engine.read(reg, peer.segment("src"))
    with sigint_inside("wait", req):
        req.wait()
    outcome = req.wait(timeout=5, check=False)
    assert outcome.failure is not None and outcome.failure.kind == "cancelled"
    peer_process.resume()


PUBLISHER = """
import sys, numpy as np, ferry
from ferry.broadcast import Publisher
engine = ferry.Engine(listen="127.0.0.1:0", data_plane="tcp")
w = {"w": np.arange(1 << 22, dtype=np.uint32)}
with Publisher(engine, w, name="policy", chunk_size=64 << 10) as pub:
    print(pub.addr, flush=True)
    sys.stdin.readline()
"""


def test_ctrl_c_interrupts_a_pull_whose_source_stopped(np):
    src = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        addr = src.stdout.readline().strip()
        assert addr, f"the publisher exited: {src.wait()}"
        engine = ferry.Engine(listen="127.0.0.1:0", data_plane="tcp")
        live = {"w": np.zeros(1 << 22, np.uint32)}
        # Joined: the source stops before the first chunk is asked for, so the pull blocks.
        with sigint_inside("run", before=lambda: src.send_signal(signal.SIGSTOP)):
            pull(engine, addr, live, name="policy", relay=False)
    finally:
        src.send_signal(signal.SIGCONT)
        src.kill()
        src.wait()


def test_an_exception_in_progress_stops_the_pull_and_is_raised(np):
    trainer = ferry.Engine(listen="127.0.0.1:0", data_plane="tcp")
    w = {"w": np.arange(1 << 20, dtype=np.uint32)}
    calls = []

    def progress(done, total):
        calls.append(done)
        raise ValueError("stop here")

    def interrupt(done, total):
        calls.append(done)
        raise KeyboardInterrupt

    with Publisher(trainer, w, name="policy", chunk_size=16 << 10) as pub:
        engine = ferry.Engine(listen="127.0.0.1:0", data_plane="tcp")
        with pytest.raises(ValueError, match="stop here"):
            pull(engine, pub.addr, {"w": np.zeros_like(w["w"])}, progress=progress, relay=False)
        assert len(calls) == 1
        with pytest.raises(KeyboardInterrupt):
            pull(engine, pub.addr, {"w": np.zeros_like(w["w"])}, progress=interrupt, relay=False)
        assert len(calls) == 2
        # The engine and the publisher go on: a pull without a failing callback completes.
        out = {"w": np.zeros_like(w["w"])}
        s = pull(engine, pub.addr, out, relay=False)
        assert s.bytes == w["w"].nbytes and np.array_equal(out["w"], w["w"])


def test_one_timeout_convention_zero_is_now(np, peer_process):
    """``timeout=0`` has passed already, for a read and for a pull; ``None`` waits as long
    as it takes (the engine's ``request_timeout`` for a read, none by default)."""
    engine = ferry.Engine()
    peer = engine.connect(peer_process.addr)
    reg = engine.register(np.zeros(1 << 20, np.uint32))
    peer_process.stop()
    try:
        o = engine.read(reg, peer.segment("src"), timeout=0).wait(timeout=10, check=False)
        assert o.failure is not None and o.failure.kind == "timeout", o
        req = engine.read(reg, peer.segment("src"))
        with pytest.raises(TimeoutError):
            req.wait(timeout=0)
        req.cancel()
    finally:
        peer_process.resume()
    trainer = ferry.Engine(listen="127.0.0.1:0", data_plane="tcp")
    w = {"w": np.arange(1 << 16, dtype=np.uint32)}
    with Publisher(trainer, w, name="policy") as pub:
        receiver = ferry.Engine(listen="127.0.0.1:0", data_plane="tcp")
        # The deadline has passed at once; where bytes landed before it was seen (the same-host
        # plane is quick), the destination is reported torn, for the same reason.
        with pytest.raises((ferry.broadcast.PullTimeout, ferry.broadcast.TornError)) as e:
            pull(receiver, pub.addr, {"w": np.zeros_like(w["w"])}, timeout=0, relay=False)
        assert isinstance(e.value, ferry.broadcast.PullTimeout) or "within 0.0 s" in str(e.value)
        s = pull(receiver, pub.addr, {"w": np.zeros_like(w["w"])}, timeout=None, relay=False)
        assert s.bytes == w["w"].nbytes


def test_ctrl_c_interrupts_a_raw_transfer_to_a_stopped_peer_and_cancels_it():
    from ferry.mooncake import TransferEngine
    from test_mooncake import Peer

    peer = Peer("127.0.0.1", "P2PHANDSHAKE", size=8 << 20)
    te = TransferEngine()
    try:
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        buf = te.allocate_managed_buffer(8 << 20)
        assert te.transfer_sync_write(peer.name, buf, peer.buffer, 8) == 0  # connected
        peer.proc.send_signal(signal.SIGSTOP)
        # `transfer_sync_write` waits in RawEngine.transfer for a peer that cannot answer.
        with sigint_inside("transfer"):
            te.transfer_sync_write(peer.name, buf, peer.buffer, 8 << 20)
    finally:
        peer.proc.send_signal(signal.SIGCONT)
        peer.kill()
        te.close()
