"""NumPy arrays moving between two processes, both ways, and a registered array deleted on the
Python side while a transfer runs."""

import gc
import weakref

import ferry
from peer import pattern


def test_read_and_write_numpy_between_processes(peer_process, np):
    n = peer_process.n
    engine = ferry.Engine()
    peer = engine.connect(peer_process.addr)
    assert {s["name"] for s in peer.segments} == {"src", "sink", "small"}

    # Pull: their `src` into our preallocated array.
    dst = np.zeros(n, dtype=np.uint32)
    with engine.register(dst, name="dst") as local:
        outcome = engine.read(local, peer.segment("src")).wait(timeout=30)
        outcome.raise_for_failure()
        assert outcome.ok and outcome.completed_ops == 1
        assert outcome.completed_bytes == dst.nbytes
    assert np.array_equal(dst, pattern(n, 1))

    # Push: our array into their `sink`, which they check.
    out = pattern(n, 7)
    with engine.register(out, name="out") as local:
        engine.write(local, peer.segment("sink")).wait(timeout=30).raise_for_failure()
    assert peer_process.ask("check sink 7") == "ok"


def test_batch_of_slices_both_ways(peer_process, np):
    n = peer_process.n
    engine = ferry.Engine()
    peer = engine.connect(peer_process.addr)
    src, sink = peer.segment("src"), peer.segment("sink")
    buf = np.zeros(n, dtype=np.uint32)
    reg = engine.register(buf)
    half = buf.nbytes // 2
    # Two READs of the halves in one request, in swapped order.
    batch = ferry.Batch().read(reg, src, 0, half, half).read(reg, src, half, 0, half)
    assert len(batch) == 2
    engine.submit(batch).wait(timeout=30).raise_for_failure()
    expect = pattern(n, 1)
    assert np.array_equal(buf[: n // 2], expect[n // 2 :])
    assert np.array_equal(buf[n // 2 :], expect[: n // 2])
    # Write the pattern of seed 9 back in two WRITEs.
    buf[:] = pattern(n, 9)
    batch = ferry.Batch(timeout=30).write(reg, sink, 0, 0, half).write(reg, sink, half, half)
    outcome = engine.submit(batch).wait(timeout=30)
    assert outcome.ok and outcome.completed_ops == 2 and outcome.remote_effect == "none"
    assert peer_process.ask("check sink 9") == "ok"


def test_registered_array_deleted_while_a_transfer_runs(peer_process, np):
    engine = ferry.Engine()
    peer = engine.connect(peer_process.addr)
    arr = np.zeros(peer_process.n, dtype=np.uint32)
    alive = weakref.ref(arr)
    reg = engine.register(arr)
    peer_process.stop()  # the READ cannot finish while the peer is stopped
    try:
        req = engine.read(reg, peer.segment("src"))
        del arr
        reg.close()
        gc.collect()
        # The registration's buffer export keeps the array (and its memory) alive.
        assert alive() is not None
        assert not req.done()
    finally:
        peer_process.resume()
    outcome = req.wait_drained(timeout=30)
    assert outcome.ok and outcome.drained
    # Once drained, nothing holds the export: the array goes (its decref may be queued by an
    # I/O thread until this thread next enters the module).
    del req
    for _ in range(100):
        ferry.Engine  # noqa: B018 - any call into the module drains queued decrefs
        engine.describe()
        gc.collect()
        if alive() is None:
            break
    assert alive() is None


def test_bytearray_cannot_resize_while_registered():
    engine = ferry.Engine()
    ba = bytearray(100)
    reg = engine.register(ba, name="ba")
    try:
        ba.extend(b"x")
    except BufferError:
        pass
    else:
        raise AssertionError("a registered bytearray resized")
    reg.close()
    del reg
    gc.collect()
    engine.describe()
    ba.extend(b"x")  # released with the registration
