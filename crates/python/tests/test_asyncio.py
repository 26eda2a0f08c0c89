"""Requests awaited from asyncio."""

import asyncio

import pytest

import ferry
from peer import pattern


def test_gather_many_reads(peer_process, np):
    engine = ferry.Engine()
    peer = engine.connect(peer_process.addr)
    src = peer.segment("src")
    n = peer_process.n
    parts = 8
    buf = np.zeros(n, dtype=np.uint32)
    reg = engine.register(buf)
    step = buf.nbytes // parts

    async def main():
        reqs = [
            engine.read(reg, src, local_offset=i * step, remote_offset=i * step, length=step)
            for i in range(parts)
        ]
        return await asyncio.gather(*reqs)

    outcomes = asyncio.run(main())
    assert all(o.ok for o in outcomes)
    assert sum(o.completed_bytes for o in outcomes) == buf.nbytes
    assert np.array_equal(buf, pattern(n, 1))


def test_await_and_drained_future(loopback):
    _, client, peer, buf = loopback
    buf[:4] = b"abcd"
    local = bytearray(4)
    reg = client.register(local)

    async def main():
        req = client.read(reg, peer.segment("seg"), length=4)
        outcome = await req
        drained = await req.drained()
        return outcome, drained, await req  # awaiting again gives the outcome again

    outcome, drained, again = asyncio.run(main())
    assert outcome.ok and drained.drained and again.ok
    assert local == b"abcd"


def test_wait_for_cancels_the_request(peer_process, np):
    engine, peer, reg = peer_process.client(np)
    peer_process.stop()
    try:
        req = engine.read(reg, peer.segment("src"))

        async def main():
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(req, 0.2)

        asyncio.run(main())
        outcome = req.wait(timeout=10, check=False)
        assert outcome.failure is not None and outcome.failure.kind == "cancelled"
        with pytest.raises(ferry.Cancelled):
            outcome.raise_for_failure()
    finally:
        peer_process.resume()
    assert req.wait_drained(timeout=30).drained


def test_event_loop_keeps_running_while_a_request_waits(peer_process, np):
    engine, peer, reg = peer_process.client(np)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    async def main():
        t = asyncio.create_task(ticker())
        peer_process.stop()
        try:
            req = engine.read(reg, peer.segment("src"))
            await asyncio.sleep(0.3)
        finally:
            peer_process.resume()
        outcome = await req
        t.cancel()
        return outcome

    outcome = asyncio.run(main())
    assert outcome.ok
    assert ticks >= 10
