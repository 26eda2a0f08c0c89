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
