"""Issue 46, S6: where a registration's address goes. Ferry's own API lists no raw address
(``RawEngine`` registrations are named ``raw#<id>/<location>``); the addresses the Mooncake and
NIXL layers need travel in an index segment published to the same peers as the registrations,
so a peer they are not published to (``FERRY_PUBLISH_TO``) learns no address on either layer.
docs/security.md, "Registrations' addresses"."""

import ctypes

import pytest

import ferry
from ferry import _ferry
from ferry.mooncake import TransferEngine
from ferry.nixl import nixl_agent, nixl_agent_config

SIZE = 16 << 10


def keyrings(tmp_path, names):
    """Per-peer keyrings: for each name, a file holding every name's key, its own first (the
    key an engine proves is its first)."""
    keys = {n: bytes([i + 1]) * 16 for i, n in enumerate(names)}
    files = {}
    for n in names:
        f = tmp_path / f"{n}.key"
        f.write_text("".join(f"{m} {keys[m].hex()}\n" for m in [n] + [m for m in names if m != n]))
        f.chmod(0o600)
        files[n] = str(f)
    return files


def shows_no_address(listed: object, addrs) -> None:
    text = repr(listed)
    for a in addrs:
        for form in (f"{a:x}", f"{a:X}", str(a)):
            assert form not in text, f"{form} in {text}"


def test_a_listing_on_ferrys_api_shows_no_registration_address(np):
    """A peer listing a RawEngine's registrations through Ferry's own API (a connect's listing)
    sees opaque names, no address in any form; a RawEngine peer still maps the addresses (from
    the index) and moves bytes by them."""
    server = ferry.Engine(listen="127.0.0.1:0")
    raw = _ferry.RawEngine(server)
    src = np.full(SIZE, 0x5A, dtype=np.uint8)
    raw.register(src.ctypes.data, SIZE)
    managed = raw.allocate(4096)
    local = np.zeros(SIZE, dtype=np.uint8)
    raw.register(local.ctypes.data, SIZE, access="local")
    addrs = [src.ctypes.data, managed, local.ctypes.data]
    try:
        client = ferry.Engine()
        listed = client.connect(server.listen_addr).segments
        names = sorted(s["name"] for s in listed)
        assert [n.split("#")[0] for n in names] == ["raw", "raw", "raw-index"], names
        shows_no_address(listed, addrs)

        craw = _ferry.RawEngine(client)
        remote = craw.remote_registrations(server.listen_addr)
        # The local-only registration is neither listed nor in the index.
        assert sorted(r[:2] for r in remote) == sorted([(src.ctypes.data, SIZE), (managed, 4096)])
        dst = craw.allocate(SIZE)
        craw.transfer(server.listen_addr, "read", [dst], [src.ctypes.data], [SIZE])
        assert craw.registrations()[0][0] == dst
        assert ctypes.string_at(dst, SIZE) == bytes(src)

        # Unregistered, it leaves the index: a fresh listing maps nothing there.
        raw.unregister(src.ctypes.data)
        assert [r[0] for r in craw.remote_registrations(server.listen_addr)] == [managed]
        with pytest.raises(ferry.UnknownAddress):
            craw.transfer(server.listen_addr, "read", [dst], [src.ctypes.data], [SIZE])
    finally:
        server.shutdown()


def test_a_peer_the_registrations_are_not_published_to_learns_no_address(np, tmp_path):
    """With ``publish_to``, a key holder not named lists neither the registrations nor their
    index (Ferry's API), maps no address and moves no byte (the compat layer); the named peer
    does both."""
    files = keyrings(tmp_path, ["owner", "alice", "bob"])
    owner = ferry.Engine(listen="127.0.0.1:0", auth_key_file=files["owner"])
    raw = _ferry.RawEngine(owner, ["alice"])
    src = np.full(SIZE, 0x33, dtype=np.uint8)
    raw.register(src.ctypes.data, SIZE)
    addr = owner.listen_addr
    try:
        alice, bob = (ferry.Engine(auth_key_file=files[n]) for n in ("alice", "bob"))
        assert sorted(s["name"].split("#")[0] for s in alice.connect(addr).segments) == ["raw", "raw-index"]
        assert bob.connect(addr).segments == []

        araw, braw = _ferry.RawEngine(alice), _ferry.RawEngine(bob)
        assert [r[:2] for r in araw.remote_registrations(addr)] == [(src.ctypes.data, SIZE)]
        dst = araw.allocate(SIZE)
        araw.transfer(addr, "read", [dst], [src.ctypes.data], [SIZE])

        assert braw.remote_registrations(addr) == []
        bdst = braw.allocate(SIZE)
        for op in ("read", "write"):
            with pytest.raises(ferry.UnknownAddress):
                braw.transfer(addr, op, [bdst], [src.ctypes.data], [SIZE])
        assert (src == 0x33).all()
    finally:
        owner.shutdown()


def test_publish_to_names_someone():
    with pytest.raises(_ferry.InvalidArgument, match="publish_to names no peer"):
        _ferry.RawEngine(ferry.Engine(), [])


def test_on_the_nixl_layer_an_agent_not_published_to_learns_no_address(np, tmp_path, monkeypatch):
    """``FERRY_PUBLISH_TO=decode`` on prefill: a third key holder that loaded prefill's metadata
    finds none of its descriptors, and its listing of prefill shows no raw registration; decode
    reads prefill's bytes."""
    monkeypatch.setenv("FERRY_BIND_ADDRESS", "127.0.0.1")
    files = keyrings(tmp_path, ["prefill", "decode", "mallory"])

    def agent(name, publish_to=None):
        monkeypatch.setenv("FERRY_AUTH_KEY_FILE", files[name])
        if publish_to:
            monkeypatch.setenv("FERRY_PUBLISH_TO", publish_to)
        else:
            monkeypatch.delenv("FERRY_PUBLISH_TO", raising=False)
        return nixl_agent(name, nixl_agent_config(enable_listen_thread=True, listen_port=0))

    prefill = agent("prefill", "decode")
    decode, mallory = agent("decode"), agent("mallory")
    kv = np.full(SIZE, 0x77, dtype=np.uint8)
    prefill.register_memory([(kv.ctypes.data, SIZE, 0, "")], "DRAM")
    md = prefill.get_agent_metadata()
    shows_no_address(md, [kv.ctypes.data])
    for a in (decode, mallory):
        assert a.add_remote_agent(md) == b"prefill"
    descs = [(kv.ctypes.data, SIZE, 0)]
    assert decode.check_remote_metadata("prefill", decode.get_xfer_descs(descs, "DRAM"))
    assert not mallory.check_remote_metadata("prefill", mallory.get_xfer_descs(descs, "DRAM"))
    assert not [s for s in mallory._peer_segments(prefill._addr) if s.startswith("raw")]
    out = np.zeros(SIZE, dtype=np.uint8)
    for a in (decode, mallory):
        a.register_memory([(out.ctypes.data, SIZE, 0, "")], "DRAM")
    with pytest.raises(Exception, match="NIXL_ERR"):
        mallory.initialize_xfer("READ", mallory.get_xfer_descs([(out.ctypes.data, SIZE, 0)], "DRAM"),
                                mallory.get_xfer_descs(descs, "DRAM"), "prefill")
    h = decode.initialize_xfer("READ", decode.get_xfer_descs([(out.ctypes.data, SIZE, 0)], "DRAM"),
                               decode.get_xfer_descs(descs, "DRAM"), "prefill")
    decode.transfer(h)
    while decode.check_xfer_state(h) == "PROC":
        pass
    assert decode.check_xfer_state(h) == "DONE"
    assert (out == 0x77).all()


def test_on_the_mooncake_layer_an_engine_not_published_to_learns_no_address(tmp_path, monkeypatch):
    """``FERRY_PUBLISH_TO=decode`` on prefill: a third key holder finds no first buffer address
    of prefill and its READ of prefill's buffer fails, nothing moved; decode reads it."""
    files = keyrings(tmp_path, ["prefill", "decode", "mallory"])

    def engine(name, publish_to=None):
        monkeypatch.setenv("FERRY_AUTH_KEY_FILE", files[name])
        if publish_to:
            monkeypatch.setenv("FERRY_PUBLISH_TO", publish_to)
        else:
            monkeypatch.delenv("FERRY_PUBLISH_TO", raising=False)
        te = TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, te.last_error()
        return te

    prefill = engine("prefill", "decode")
    decode, mallory = engine("decode"), engine("mallory")
    name = f"127.0.0.1:{prefill.get_rpc_port()}"
    src = prefill.allocate_managed_buffer(SIZE)
    prefill.write_bytes_to_buffer(src, b"\x42" * SIZE, SIZE)
    assert decode.get_first_buffer_address(name) == src
    assert mallory.get_first_buffer_address(name) == 0
    dst_d, dst_m = decode.allocate_managed_buffer(SIZE), mallory.allocate_managed_buffer(SIZE)
    assert mallory.transfer_sync_read(name, dst_m, src, SIZE) < 0
    assert isinstance(mallory.last_error(), ferry.UnknownAddress)
    assert mallory.read_bytes_from_buffer(dst_m, SIZE) == bytes(SIZE)
    assert decode.transfer_sync_read(name, dst_d, src, SIZE) == 0
    assert decode.read_bytes_from_buffer(dst_d, SIZE) == b"\x42" * SIZE
