"""Engine(auth_key_file=...): peers prove a key of the file before anything is listed."""

import pytest

import ferry

ALICE = "alice 000102030405060708090a0b0c0d0e0f"


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "alice.key"
    path.write_text(ALICE + "\n")
    path.chmod(0o600)
    return path


def test_with_the_key_bytes_move_and_without_it_nothing_is_listed(key_file):
    server = ferry.Engine(listen="127.0.0.1:0", auth_key_file=key_file)
    buf = bytearray(b"\x5a" * 4096)
    reg = server.register(buf, name="seg", access="read")
    try:
        client = ferry.Engine(auth_key_file=str(key_file))
        peer = client.connect(server.listen_addr)
        dst = bytearray(4096)
        out = client.register(dst)
        client.read(out, peer.segment("seg")).wait(timeout=30).raise_for_failure()
        assert dst == buf
        with pytest.raises(ferry.HandshakeRefused, match="authentication required"):
            ferry.Engine().connect(server.listen_addr)
    finally:
        reg.close()
        server.shutdown()


def test_an_unreadable_key_file_names_the_file(tmp_path):
    missing = tmp_path / "nope.key"
    with pytest.raises(ferry.AuthKeyError, match="nope.key"):
        ferry.Engine(auth_key_file=missing)


def test_a_client_that_names_the_server_it_expects_refuses_another_key_holder(key_file):
    """Issue 46, S3: two servers hold alice's key; ``connect(addr, server_identity=A's)`` at
    B's address raises AuthenticationFailed naming the address and the identity; at A's it
    connects; without ``server_identity`` B is reached as before."""
    a = ferry.Engine(listen="127.0.0.1:0", auth_key_file=key_file)
    b = ferry.Engine(listen="127.0.0.1:0", auth_key_file=key_file)
    try:
        assert a.server_identity != b.server_identity
        assert a.describe()["server_identity"] == a.server_identity
        client = ferry.Engine(auth_key_file=key_file)
        with pytest.raises(ferry.AuthenticationFailed) as e:
            client.connect(b.listen_addr, server_identity=a.server_identity)
        assert b.listen_addr in str(e.value) and a.server_identity in str(e.value), str(e.value)
        client.connect(a.listen_addr, server_identity=a.server_identity)
        ferry.Engine(auth_key_file=key_file).connect(b.listen_addr)
        with pytest.raises(ferry.InvalidArgument):
            client.connect(a.listen_addr, server_identity="not hex")
        with pytest.raises(ferry.InvalidRequest, match="key file"):
            ferry.Engine().expect_server(a.listen_addr, a.server_identity)
    finally:
        a.shutdown()
        b.shutdown()
