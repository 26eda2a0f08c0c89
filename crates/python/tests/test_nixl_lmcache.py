"""LMCache 0.5.6's transfer channels on Ferry (docs/nixl.md, "LMCache"): its ``nixl`` channel
through the NIXL alias, and Ferry's native ``ferry`` channel (``ferry.lmcache``) made through
LMCache's factory, held to the same contract: LMCache's ``TransferChannelContext``/``Client``
as its own channel tests pin it down, with every read checked byte by byte.

Needs LMCache 0.5.6 importable (it is not in the CI environments: docs/nixl.md says how to
make one); skips without it, and fails instead under ``FERRY_REQUIRE_LMCACHE=1``."""

import gc
import importlib
import importlib.util
import os
import socket

import pytest

import ferry.nixl


def _lmcache():
    try:
        if importlib.util.find_spec("lmcache") is None:
            raise ImportError("no module named 'lmcache'")
        # Only now (LMCache is here) the alias, which stays on for this process: the nixl
        # channel imports nixl._api, Ferry's here.
        ferry.nixl.install()
        from lmcache.v1.distributed import transfer_channel  # noqa: F401
        from lmcache.v1.distributed.internal_api import L1MemoryDesc
        from lmcache.v1.distributed.transfer_channel import factory
        from lmcache.v1.distributed.transfer_channel.impl import nixl_impl  # noqa: F401
    except ImportError as e:
        if os.environ.get("FERRY_REQUIRE_LMCACHE") == "1":
            pytest.fail(f"LMCache is not importable: {e} (FERRY_REQUIRE_LMCACHE=1 says it must be)")
        pytest.skip(f"LMCache is not importable: {e} (FERRY_REQUIRE_LMCACHE=1 makes this a failure)")
    importlib.import_module("ferry.lmcache")  # registers the ferry channel

    return L1MemoryDesc, factory


ALIGN, SIZE = 256, 1 << 16


def free_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(params=["ferry", "nixl"])
def pair(request, np, monkeypatch):
    """Two contexts of one channel type in this process: ``a``'s buffer zeroed, ``b``'s a
    pattern; ``(a, abuf, b, bbuf)``."""
    monkeypatch.setenv("FERRY_BIND_ADDRESS", "127.0.0.1")
    L1MemoryDesc, factory = _lmcache()
    abuf = np.zeros(SIZE, dtype=np.uint8)
    bbuf = np.random.default_rng(7).integers(0, 256, size=SIZE, dtype=np.uint8)
    made = []
    for buf in (abuf, bbuf):
        url = free_url()
        made.append(factory.create_transfer_channel_context(
            transfer_channel_type=request.param,
            l1_memory_desc=L1MemoryDesc(ptr=buf.ctypes.data, size=SIZE, align_bytes=ALIGN),
            listen_url=url, advertise_url=url))
    yield made[0], abuf, made[1], bbuf
    for c in made:
        c.close()
    gc.collect()


def read(client, local, remote):
    task = client.submit_read(local, remote)
    while not (result := client.query_read_status(task)).is_finished():
        pass
    return result


def test_reads_bring_the_peers_bytes_to_their_offsets(pair):
    a, abuf, b, bbuf = pair
    client = a.get_transfer_channel_client(b.advertise_url)
    objects = [(0, 512), (4096, 1024), (SIZE - 256, 256)]
    targets = [(8192, 512), (1024, 1024), (0, 256)]
    result = read(client, a.get_transfer_channel_address(targets),
                  b.get_transfer_channel_address(objects))
    assert result.succeeded_mask == [True] * 3
    for (lo, n), (ro, _) in zip(targets, objects):
        assert (abuf[lo:lo + n] == bbuf[ro:ro + n]).all()
    with pytest.raises(KeyError):  # a finished task is forgotten
        client.query_read_status(10 ** 6)


def test_addresses_outside_the_buffer_and_mismatched_lists_are_valueerror(pair):
    a, _, b, _ = pair
    with pytest.raises(ValueError):
        a.get_transfer_channel_address([(SIZE, 256)])
    with pytest.raises(ValueError):
        a.get_transfer_channel_address([(SIZE - 128, 256)])
    client = a.get_transfer_channel_client(b.advertise_url)
    with pytest.raises(ValueError):
        client.submit_read(a.get_transfer_channel_address([(0, 256)]),
                           b.get_transfer_channel_address([(0, 256), (256, 256)]))
    with pytest.raises(KeyError):
        client.query_read_status(99999)


def test_one_client_per_peer_counted_on_both_sides_and_removable(pair):
    a, _, b, _ = pair
    assert a.get_num_connected_clients() == 0 and b.get_num_connected_clients() == 0
    first = a.get_transfer_channel_client(b.advertise_url)
    assert a.get_transfer_channel_client(b.advertise_url) is first
    assert a.get_num_connected_clients() == 1
    assert b.get_num_connected_clients() == 1  # b learned of a (its reverse client)
    assert a.get_transfer_channel_server() is not None
    a.remove_transfer_channel_client(b.advertise_url)
    assert a.get_num_connected_clients() == 0
    again = a.get_transfer_channel_client(b.advertise_url)
    assert again is not first
    assert read(again, a.get_transfer_channel_address([(0, 256)]),
                b.get_transfer_channel_address([(0, 256)])).succeeded_mask == [True]


def test_a_read_from_a_closed_peer_finishes_failed(pair, np):
    a, _, b, _ = pair
    L1MemoryDesc, factory = _lmcache()
    gone = np.zeros(4096, dtype=np.uint8)
    url = free_url()
    c = factory.create_transfer_channel_context(
        transfer_channel_type="ferry" if type(b).__name__.startswith("Ferry") else "nixl",
        l1_memory_desc=L1MemoryDesc(ptr=gone.ctypes.data, size=4096, align_bytes=ALIGN),
        listen_url=url, advertise_url=url)
    client = a.get_transfer_channel_client(url)
    local, remote = a.get_transfer_channel_address([(0, 256)]), c.get_transfer_channel_address([(0, 256)])
    c.close()
    del c
    gc.collect()
    try:
        task = client.submit_read(local, remote)
    except Exception:  # refused at once: nothing read, as the contract allows
        return
    while not (result := client.query_read_status(task)).is_finished():
        pass
    assert result.succeeded_mask == [False]


def test_the_ferry_channel_is_registered_once(np):
    _, factory = _lmcache()
    importlib.import_module("ferry.lmcache").register()  # again: nothing
    with pytest.raises(ValueError):
        factory.register_transfer_channel_factory("ferry", lambda **kw: None)

