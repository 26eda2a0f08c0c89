"""The exception hierarchy, errors with Rust's messages, and bad arguments refused with
TypeError / ValueError / FerryError before anything moves."""

import socket

import pytest

import ferry

KINDS = [
    "Unavailable", "PeerLost", "StaleEpoch", "ResourceExhausted", "ProtocolMismatch",
    "HandshakeRefused", "UnknownSegment", "UnknownSegmentName", "OutOfBounds", "AccessDenied",
    "Timeout", "Cancelled", "Unquiesced", "RegistrationError", "Malformed", "InvalidRequest",
    "NoRoute", "IoError", "InvalidArgument", "AuthenticationFailed", "AuthKeyError",
    "UnknownAddress",
]


def test_hierarchy():
    assert issubclass(ferry.FerryError, Exception)
    for name in KINDS:
        cls = getattr(ferry, name)
        assert issubclass(cls, ferry.FerryError), name
        assert cls.__module__ == "ferry" and cls.__doc__, name
    assert issubclass(ferry.Timeout, TimeoutError)
    assert issubclass(ferry.PeerLost, ConnectionError)
    assert issubclass(ferry.OutOfBounds, ValueError)
    assert issubclass(ferry.InvalidRequest, ValueError)
    assert issubclass(ferry.UnknownSegmentName, ferry.UnknownSegment)
    assert issubclass(ferry.UnknownSegment, LookupError)
    assert issubclass(ferry.UnknownAddress, LookupError)
    assert issubclass(ferry.IoError, OSError)
    assert issubclass(ferry.InvalidArgument, ValueError)
    assert issubclass(ferry.AuthenticationFailed, ferry.HandshakeRefused)


def test_unknown_segment_name(loopback):
    _, _, peer, _ = loopback
    with pytest.raises(ferry.UnknownSegmentName, match=r'no segment named "nope"'):
        peer.segment("nope")


def test_out_of_bounds_local_and_remote(loopback):
    _, client, peer, _ = loopback
    seg = peer.segment("seg")
    reg = client.register(bytearray(1024))
    with pytest.raises(ferry.OutOfBounds, match="local range out of bounds"):
        client.read(reg, seg, length=2048)
    with pytest.raises(ferry.OutOfBounds, match="remote range out of bounds"):
        client.read(reg, seg, remote_offset=len(seg) - 10, length=100)
    with pytest.raises(ferry.OutOfBounds, match="past the end of registration"):
        client.read(reg, seg, local_offset=4096)
    # An offset past the end is out of bounds, as a length past the end is.
    with pytest.raises(ferry.OutOfBounds, match='past the end of segment "seg"'):
        client.read(reg, seg, remote_offset=len(seg) + 1)


def test_access_denied_writing_a_read_only_segment(loopback):
    _, client, peer, _ = loopback
    reg = client.register(bytearray(16))
    with pytest.raises(ferry.AccessDenied, match='segment "ro": access denied'):
        client.write(reg, peer.segment("ro"))


def test_a_published_name_is_unique_per_engine():
    engine = ferry.Engine()
    first = engine.register(bytearray(4096), name="dup", access="read")
    with pytest.raises(ferry.RegistrationError, match='"dup".*unique per engine'):
        engine.register(bytearray(4096), name="dup", access="read+write")
    # Local-only registrations are not published: any name.
    engine.register(bytearray(4096), name="dup")
    assert [s["name"] for s in engine.describe()["published"]] == ["dup"]
    first.close()
    engine.register(bytearray(4096), name="dup", access="read")


def test_bad_numbers_are_ferry_errors_naming_the_argument(loopback):
    _, client, peer, _ = loopback
    reg = client.register(bytearray(64))
    with pytest.raises(ferry.InvalidArgument, match="remote_offset must be >= 0"):
        client.read(reg, peer.segment("seg"), remote_offset=-1)
    with pytest.raises(ferry.InvalidArgument, match="streams must be at most 64"):
        ferry.Engine(streams=65)
    with pytest.raises(ferry.InvalidArgument, match="depth must be at least 1"):
        ferry.Engine(depth=0)
    with pytest.raises(ferry.InvalidArgument, match="chunk_size must be at most 64 MiB"):
        ferry.Engine(chunk_size=1 << 30)
    with pytest.raises(ferry.InvalidArgument, match="chunk_size must be at least 1 byte"):
        ferry.Engine(chunk_size=0)
    with pytest.raises(ferry.InvalidArgument, match="timeout must be"):
        client.read(reg, peer.segment("seg"), timeout=-1)


def test_connect_refused_is_an_io_error():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(ferry.IoError) as e:
        ferry.Engine(connect_timeout=5).connect(f"127.0.0.1:{port}")
    assert f"127.0.0.1:{port}" in str(e.value)


def test_restarted_peer_is_a_stale_epoch():
    first = ferry.Engine(listen="127.0.0.1:0")
    addr = first.listen_addr
    client = ferry.Engine()
    client.connect(addr)
    first.shutdown()
    del first
    try:
        second = ferry.Engine(listen=addr)
    except ferry.IoError as e:  # the port was taken meanwhile
        pytest.skip(f"cannot listen on {addr} again: {e}")
    with pytest.raises(ferry.StaleEpoch, match="re-resolve"):
        client.connect(addr)
    assert client.reresolve(addr).epoch == second.epoch


def test_bad_registrations():
    e = ferry.Engine()
    with pytest.raises(TypeError, match="buffer protocol.*not int"):
        e.register(5)
    with pytest.raises(TypeError, match="read-only"):
        e.register(b"immutable", name="b", access="write")
    with pytest.raises(TypeError, match="read-only"):
        e.register(memoryview(bytearray(8)).toreadonly(), access="read+write")
    with pytest.raises(ValueError, match="access must be"):
        e.register(bytearray(8), access="everything")
    e.register(b"immutable", access="read").close()  # a read-only source is fine


def test_strided_and_readonly_numpy(np, loopback):
    _, client, peer, _ = loopback
    a = np.zeros((64, 64), dtype=np.float32)
    with pytest.raises(ValueError, match="contiguous"):
        client.register(a[:, ::2])
    ro = np.ones(16, dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(TypeError, match="read-only"):
        client.register(ro, access="write")
    reg = client.register(ro)
    assert reg.readonly
    with pytest.raises(TypeError, match="cannot READ into"):
        client.read(reg, peer.segment("seg"))
    client.write(reg, peer.segment("seg")).wait(timeout=30).raise_for_failure()


def test_bad_op_arguments(loopback):
    _, client, peer, _ = loopback
    seg = peer.segment("seg")
    reg = client.register(bytearray(1024))
    with pytest.raises(ValueError, match="local_offset must be >= 0"):
        client.read(reg, seg, local_offset=-1)
    with pytest.raises(ValueError, match="length must be >= 0"):
        client.read(reg, seg, length=-5)
    with pytest.raises(TypeError):
        client.read(reg, seg, remote_offset=1.5)
    with pytest.raises(TypeError):
        client.read(bytearray(4), seg)
    with pytest.raises(TypeError):
        client.read(reg, "seg")
    with pytest.raises(ValueError, match="timeout must be"):
        client.read(reg, seg, timeout=-1)
    req = client.read(reg, seg, length=16)
    with pytest.raises(ValueError, match="timeout must be"):
        req.wait(timeout=float("nan"))
    assert req.wait(timeout=30).ok
    with pytest.raises(ferry.InvalidRequest, match="empty batch"):
        client.submit(ferry.Batch())
    reg.close()
    with pytest.raises(ferry.InvalidRequest, match="closed"):
        client.read(reg, seg, length=16)


def test_bad_engine_arguments():
    with pytest.raises(ferry.InvalidArgument, match="listen must be HOST:PORT"):
        ferry.Engine(listen="localhost")
    with ferry.Engine(listen="localhost:0") as e:
        assert e.listen_addr.rsplit(":", 1)[1] != "0"
    with pytest.raises(ValueError, match="data_plane must be"):
        ferry.Engine(data_plane="carrier-pigeon")
    with pytest.raises(ValueError, match="transports takes"):
        ferry.Engine(transports=["smoke-signals"])
    with pytest.raises(ValueError, match="streams must be"):
        ferry.Engine(streams=0)
    with pytest.raises(TypeError):
        ferry.Engine(streams="two")
    with pytest.raises(ValueError, match="dead_peer_after"):
        ferry.Engine(dead_peer_after=-3)


def test_errors_keep_rusts_message_and_are_catchable_as_ferry_error(loopback):
    _, client, peer, _ = loopback
    try:
        peer.segment("missing")
    except ferry.FerryError as e:
        assert str(e).startswith("peer 127.0.0.1:") and '"missing"' in str(e)
    else:
        raise AssertionError("no error")


def test_a_short_destination_is_an_error_unless_a_length_is_given(loopback):
    _, client, peer, buf = loopback
    seg = peer.segment("seg")  # 64 KiB
    small = client.register(bytearray(1024))
    with pytest.raises(ferry.OutOfBounds, match="give length="):
        client.read(small, seg)
    big = client.register(bytearray(128 << 10))
    with pytest.raises(ferry.OutOfBounds, match="give length="):
        client.write(big, seg)
    with pytest.raises(ferry.OutOfBounds, match="give length="):
        ferry.Batch().read(small, seg)
    # With a length, part of it; without one, the whole source where the destination holds it.
    buf[:4] = b"wxyz"
    assert client.read(small, seg, length=1024).wait().completed_bytes == 1024
    assert client.read(big, seg).wait().completed_bytes == 64 << 10
    assert client.write(small, seg).wait().completed_bytes == 1024
