"""Timeouts: of a wait (the request goes on), of a request (it ends), and a lost peer."""

import time

import pytest

import ferry


def test_wait_timeout_leaves_the_request_running(peer_process, np):
    engine, peer, reg = peer_process.client(np)
    peer_process.stop()
    try:
        req = engine.read(reg, peer.segment("src"))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="still running"):
            req.wait(timeout=0.2)
        assert 0.15 < time.monotonic() - t0 < 5
        assert not req.done()
    finally:
        peer_process.resume()
    assert req.wait(timeout=30).ok


def test_request_timeout_ends_it_with_a_timeout_failure(peer_process, np):
    """The timeout ends the request, seen alike by a caller polling `done()` (which resolves a
    request itself once its transport has) and by `wait`; the transport's later end is only
    the drained outcome."""
    engine, peer, reg = peer_process.client(np)
    peer_process.stop()
    try:
        req = engine.read(reg, peer.segment("src"), timeout=0.2)
        deadline = time.monotonic() + 10
        while not req.done():
            assert time.monotonic() < deadline, "the timeout never ended the request"
        outcome = req.wait(timeout=10, check=False)
        assert not outcome.ok and not outcome
        assert outcome.failure.kind == "timeout" and outcome.failure.op_index == 0
        assert outcome.completed_ops == 0 and outcome.completed_bytes == 0
        with pytest.raises(ferry.Timeout) as e:
            outcome.raise_for_failure()
        assert isinstance(e.value, TimeoutError) and isinstance(e.value, ferry.FerryError)
        assert e.value.outcome == outcome
        assert "timeout" in str(e.value)
    finally:
        peer_process.resume()
    # Logical timeout: the buffers are free only once drained.
    assert req.wait_drained(timeout=30).drained
    assert req.done() and req.wait(timeout=1, check=False).failure.kind == "timeout"


def test_engine_request_timeout_is_the_default(peer_process, np):
    engine = ferry.Engine(request_timeout=0.2)
    peer = engine.connect(peer_process.addr)
    reg = engine.register(np.zeros(peer_process.n, dtype=np.uint32))
    peer_process.stop()
    try:
        with pytest.raises(ferry.Timeout) as e:
            engine.read(reg, peer.segment("src")).wait(timeout=10)
        assert e.value.outcome.failure.kind == "timeout"
    finally:
        peer_process.resume()


def test_killed_peer_fails_requests_with_peer_lost(peer_process, np):
    engine, peer, reg = peer_process.client(np)
    peer_process.stop()
    req = engine.write(reg, peer.segment("sink"))
    peer_process.kill()
    # wait() raises a failure (check=True is the default), carrying the outcome.
    with pytest.raises(ferry.PeerLost) as lost:
        req.wait(timeout=30)
    outcome = req.wait(timeout=30, check=False)
    assert lost.value.outcome == outcome
    assert outcome.failure is not None and outcome.failure.kind == "peer_lost"
    assert outcome.remote_effect in ("none", "uncertain", "certain")
    with pytest.raises(ferry.PeerLost) as e:
        outcome.raise_for_failure()
    assert isinstance(e.value, ConnectionError)
    assert req.wait_drained(timeout=30).drained
    # The channel is dead: a new request fails at once, and connecting again is refused.
    again = engine.read(reg, peer.segment("src")).wait(timeout=30, check=False)
    assert again.failure.kind == "peer_lost"
    with pytest.raises(ferry.IoError):
        engine.connect(peer_process.addr)
