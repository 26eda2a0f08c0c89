"""A request with no step after it is driven by whoever waits for it, with no task of its own on
the runtime (issue 50): ``wait`` polls it in the caller's thread, an asyncio future is settled
from the blocking pool when the request's waker fires, and a panic below ends the wait with a
``FerryError`` instead of leaving it hanging."""

import asyncio
import time

import pytest

import ferry
from ferry import _ferry


def _until(cond, what, limit=10.0):
    """Waits for ``cond()`` (the event itself, looked at every few ms), failing after ``limit``."""
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_a_pending_request_has_no_task_of_its_own(peer_process, np):
    """Requests that nobody awaits and that cannot end (their peer is stopped) add no task to
    the runtime; with a watching task per request each would (the count rises by 8)."""
    engine = ferry.Engine()
    peer = engine.connect(peer_process.addr)
    buf = np.zeros(peer_process.n, dtype=np.uint32)
    reg = engine.register(buf)
    src = peer.segment("src")
    step = buf.nbytes // 8
    before = _ferry._runtime_tasks_for_tests()
    peer_process.stop()
    try:
        reqs = [
            engine.read(reg, src, local_offset=i * step, remote_offset=i * step, length=step)
            for i in range(8)
        ]
        alive = _ferry._runtime_tasks_for_tests()
        assert not any(r.done() for r in reqs)
        assert alive - before < len(reqs), f"{alive - before} tasks for {len(reqs)} requests"
    finally:
        peer_process.resume()
    assert all(r.wait(timeout=30).ok for r in reqs)
    assert all(r.wait_drained(timeout=30).drained for r in reqs)


def test_an_awaited_request_times_out_on_its_timer(peer_process, np):
    """The request's own timer wakes the watch while asyncio awaits it (nobody in `wait`): the
    blocking pool polls it and settles the future with the timeout."""
    engine, peer, reg = peer_process.client(np)
    peer_process.stop()
    try:
        req = engine.read(reg, peer.segment("src"), timeout=0.2)

        async def main():
            t0 = time.monotonic()
            outcome = await asyncio.wait_for(req, 10)
            return outcome, time.monotonic() - t0

        outcome, took = asyncio.run(main())
        assert outcome.failure is not None and outcome.failure.kind == "timeout", outcome
        assert not outcome.drained
        assert took < 5
    finally:
        peer_process.resume()

    async def drained():
        return await asyncio.wait_for(req.drained(), 30)

    assert asyncio.run(drained()).drained


def test_a_request_drains_by_itself_after_its_logical_end(peer_process, np):
    """After `wait` gave the timeout, nobody waits any more: the transport's later end still
    drains the request (its waker queues a poll), without `wait_drained`."""
    engine, peer, reg = peer_process.client(np)
    peer_process.stop()
    try:
        req = engine.read(reg, peer.segment("src"), timeout=0.2)
        outcome = req.wait(timeout=10, check=False)
        assert outcome.failure.kind == "timeout" and not outcome.drained
    finally:
        peer_process.resume()
    _until(lambda: "drained=True" in repr(req), f"never drained by itself: {req!r}")
    assert req.wait_drained(timeout=1).drained


def test_a_panic_in_a_requests_poll_ends_its_waits(peer_process, np):
    """A panic while a request is polled (in `wait`'s thread, `done()`'s or the blocking pool's)
    reaches neither Python as a `PanicException` nor a waiter as a hang: `wait` raises a
    `FerryError`, `done()` is true and `await` raises the same."""
    engine, peer, reg = peer_process.client(np)
    src = peer.segment("src")
    peer_process.stop()
    try:
        req = engine.read(reg, src)
        assert req._plant_panic_for_tests()
        with pytest.raises(ferry.FerryError, match="without an outcome"):
            req.wait(timeout=10)
        assert req.done()

        async def main():
            return await req

        with pytest.raises(ferry.FerryError, match="without an outcome"):
            asyncio.run(main())

        # Planted while asyncio awaits: the blocking pool's poll meets it.
        other = engine.read(reg, src)

        async def awaited():
            fut = asyncio.ensure_future(asyncio.wait_for(other, 10))
            await asyncio.sleep(0)
            assert other._plant_panic_for_tests()
            other.cancel()  # a wake, so that the planted poll runs
            return await fut

        with pytest.raises(ferry.FerryError, match="without an outcome"):
            asyncio.run(awaited())
    finally:
        peer_process.resume()


def test_done_lets_other_threads_run_while_it_polls(peer_process, np):
    """`done()` polls with the GIL released: a poll held at a planted gate is let go by another
    Python thread. Were the GIL held, that thread could not run until the gate gave up."""
    import threading

    engine, peer, reg = peer_process.client(np)
    peer_process.stop()
    try:
        req = engine.read(reg, peer.segment("src"))
        gate = req._plant_gate_for_tests()
        assert gate is not None

        def opener():
            _until(gate.entered, "the poll never reached the gate")
            gate.open()

        t = threading.Thread(target=opener)
        t.start()
        assert not req.done()
        t.join(10)
        assert gate.entered() and not gate.timed_out(), "done() held the GIL while it polled"
    finally:
        peer_process.resume()
    assert req.wait(timeout=30).ok
