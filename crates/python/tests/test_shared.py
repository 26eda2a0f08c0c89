"""Issue 50: shared registrations. Memory a RawEngine allocates lives in a memfd; a same-host
peer it is published to maps it and copies one-sidedly, and the owner's ``describe()`` says so
(``published[].shared``: the memfd's mode and its grants); a key holder it is not published to
never gets it (the grants stay the named peer's). Registered user memory is not shared."""

import ctypes

import pytest

import ferry
from ferry import _ferry

from test_raw import keyrings

SIZE = 64 << 10


def shared_rows(engine):
    return sorted(s.get("shared") or "" for s in engine.describe()["published"])


def test_allocated_memory_is_shared_with_the_peer_it_is_published_to_and_no_other(np, tmp_path):
    files = keyrings(tmp_path, ["owner", "alice", "bob"])
    owner = ferry.Engine(listen="127.0.0.1:0", auth_key_file=files["owner"])
    raw = _ferry.RawEngine(owner, ["alice"])
    managed = raw.allocate(SIZE)
    ctypes.memset(managed, 0x5A, SIZE)
    user = np.full(SIZE, 0x33, dtype=np.uint8)
    raw.register(user.ctypes.data, SIZE)
    addr = owner.listen_addr
    try:
        rows = shared_rows(owner)
        # The managed buffer, not granted yet; the user's memory and the index: not shared.
        assert rows.count("memfd, not granted") == 1, rows
        alice, bob = (ferry.Engine(auth_key_file=files[n]) for n in ("alice", "bob"))
        araw, braw = _ferry.RawEngine(alice), _ferry.RawEngine(bob)
        dst = araw.allocate(SIZE)
        # The first READ asks for the memory on a thread of its own (the owner copies it);
        # READs go on until the grant is seen (the event), each checked.
        for _ in range(10_000):
            araw.transfer(addr, "read", [dst], [managed], [SIZE])
            assert ctypes.string_at(dst, SIZE) == b"\x5a" * SIZE
            ctypes.memset(dst, 0, SIZE)
            if "memfd, read-write, 1 grants" in shared_rows(owner):
                break
        else:
            raise AssertionError(f"never granted: {shared_rows(owner)}")
        # Now one-sided: a WRITE lands in the owner's memory, a READ brings it back.
        ctypes.memset(dst, 0x77, SIZE)
        araw.transfer(addr, "write", [dst], [managed], [SIZE])
        assert ctypes.string_at(managed, SIZE) == b"\x77" * SIZE
        ctypes.memset(dst, 0, SIZE)
        araw.transfer(addr, "read", [dst], [managed], [SIZE])
        assert ctypes.string_at(dst, SIZE) == b"\x77" * SIZE
        # Alice's route says what it mapped and moved one-sidedly.
        (route,) = alice.describe()["routes"]
        assert route["one_sided"].startswith("1 shared registration(s) mapped"), route
        assert int(route["one_sided"].split(", ")[1].split()[0]) >= 2, route
        # Bob, not published to, moves nothing, and the memfd went to no one else.
        bdst = braw.allocate(SIZE)
        with pytest.raises(ferry.UnknownAddress):
            braw.transfer(addr, "read", [bdst], [managed], [SIZE])
        assert "memfd, read-write, 1 grants" in shared_rows(owner), shared_rows(owner)
        # The user's memory still moves, by the owner's copies.
        araw.transfer(addr, "read", [dst], [user.ctypes.data], [SIZE])
        assert ctypes.string_at(dst, SIZE) == b"\x33" * SIZE
    finally:
        owner.shutdown()
