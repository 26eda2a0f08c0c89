"""Conformance of ``ferry.nixl`` to NIXL 1.5's agent API (``nixl._api``): vLLM's NixlConnector
call sequence between two processes, notifications ordered after their transfer's bytes,
metadata by value, by address and through etcd, failures with NIXL's exceptions or "ERR",
keyed agents, and both alias mechanisms. docs/nixl.md is the contract."""

import ctypes
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ferry
from ferry.nixl import (
    nixl_agent,
    nixlBackendError,
    nixl_agent_config,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotFoundError,
    nixlRepostActiveError,
)

HERE = Path(__file__).resolve().parent
SIZE = 1 << 20
BLOCK = 16 << 10


@pytest.fixture(autouse=True)
def loopback(monkeypatch):
    """Agents listen on loopback here (FERRY_BIND_ADDRESS), their peers too."""
    monkeypatch.setenv("FERRY_BIND_ADDRESS", "127.0.0.1")


def pattern(np, n: int, seed: int):
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


class Peer:
    """A ``nixl_peer.py`` process."""

    def __init__(self, name: str, size: int = SIZE, listen_port=None, env=None):
        args = [sys.executable, str(HERE / "nixl_peer.py"), name, str(size)]
        if listen_port is not None:
            args.append(str(listen_port))
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})})
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"nixl peer exited: {self.proc.wait()}")
        info = json.loads(line)
        self.metadata = bytes.fromhex(info["metadata"])
        self.buffer = info["buffer"]
        self.port = info["port"]

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> int:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
        return self.proc.wait(timeout=30)


@pytest.fixture
def peer(np):
    p = Peer("prefill-0")
    yield p
    p.close()


def blocks(base: int, n: int, dev: int = 0):
    return [(base + i * BLOCK, BLOCK, dev) for i in range(n)]


def test_vllm_connector_sequence_between_two_processes(np, peer):
    """Agents, registration, metadata exchange, prepped lists, READ by index with a
    notification, WRITE, telemetry, release and removal; both processes exit cleanly."""
    agent = nixl_agent("decode-0", nixl_agent_config(num_threads=4, capture_telemetry=True))
    kv = np.zeros(SIZE, dtype=np.uint8)
    descs = agent.get_reg_descs([(kv.ctypes.data, SIZE, 0, "")], "DRAM")
    agent.register_memory(descs, backends=["UCX"])
    n = SIZE // BLOCK
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(blocks(kv.ctypes.data, n), "DRAM"))
    name = agent.add_remote_agent(peer.metadata)
    assert name == b"prefill-0"
    remote = agent.prep_xfer_dlist(name, agent.get_xfer_descs(blocks(peer.buffer, n), "DRAM"))
    assert peer.ask("fill 5") == "ok"
    ids = np.arange(n, dtype=np.int64)
    rev = ids[::-1].copy()
    handle = agent.make_prepped_xfer("READ", local, ids, remote, rev, notif_msg=b"req-7:1")
    assert agent.transfer(handle) in ("PROC", "DONE")
    while (state := agent.check_xfer_state(handle)) == "PROC":
        pass
    assert state == "DONE"
    want = pattern(np, SIZE, 5).reshape(n, BLOCK)[::-1].reshape(-1)
    assert np.array_equal(kv, want)
    tele = agent.get_xfer_telemetry(handle)
    assert (tele.totalBytes, tele.descCount) == (SIZE, n) and tele.xferDuration >= 0
    agent.release_xfer_handle(handle)
    notifs = json.loads(peer.ask("notifs"))
    assert notifs == {"decode-0": [b"req-7:1".hex()]}
    # A WRITE of some blocks back, its notification arriving after the bytes.
    kv[:] = pattern(np, SIZE, 6)
    h = agent.make_prepped_xfer("WRITE", local, ids, remote, ids, notif_msg="written")
    agent.transfer(h)
    assert peer.ask("wait written 6") == "ok"
    while agent.check_xfer_state(h) == "PROC":
        pass
    assert agent.check_xfer_state(h) == "DONE"
    h.release()
    # A standalone notification and initialize_xfer.
    agent.send_notif(name, notif_msg=b"ping")
    assert json.loads(peer.ask("notifs")) == {"decode-0": [b"ping".hex()]}
    h = agent.initialize_xfer("READ", agent.get_xfer_descs(blocks(kv.ctypes.data, 2), "DRAM"),
                              agent.get_xfer_descs(blocks(peer.buffer, 2), "DRAM"), name)
    agent.transfer(h)
    while agent.check_xfer_state(h) == "PROC":
        pass
    assert agent.check_xfer_state(h) == "DONE"
    agent.release_xfer_handle(h)
    agent.release_dlist_handle(local)
    agent.release_dlist_handle(remote)
    agent.release_dlist_handle(remote)  # twice: nothing, as NIXL
    agent.remove_remote_agent(name)
    agent.remove_remote_agent(name)
    with pytest.raises(nixlNotFoundError):
        agent.prep_xfer_dlist(name, blocks(peer.buffer, 1), "DRAM")
    agent.deregister_memory(descs)
    assert peer.close() == 0


def test_bad_input_raises_nixls_exceptions_and_moves_nothing(np, peer):
    agent = nixl_agent("decode-1", nixl_agent_config(capture_telemetry=False))
    kv = np.zeros(SIZE, dtype=np.uint8)
    reg = agent.register_memory([(kv.ctypes.data, SIZE, 0, "")], "DRAM")
    name = agent.add_remote_agent(peer.metadata)
    assert peer.ask("fill 9") == "ok"
    with pytest.raises(nixlMismatchError):
        agent.add_remote_agent(b"not metadata")
    with pytest.raises(nixlNotFoundError):
        agent.prep_xfer_dlist("unknown-agent", blocks(peer.buffer, 1), "DRAM")
    with pytest.raises(nixlNotFoundError, match="passes the end"):
        agent.prep_xfer_dlist(name, [(peer.buffer + SIZE - 8, 16, 0)], "DRAM")
    with pytest.raises(nixlNotFoundError):
        agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(0x1000, 16, 0)], "DRAM")
    local = agent.prep_xfer_dlist("", blocks(kv.ctypes.data, 4), "DRAM")
    remote = agent.prep_xfer_dlist(name, blocks(peer.buffer, 4), "DRAM")
    for li, ri in (([0, 1], [0]), ([], []), ([9], [0]), ([-1], [0])):
        with pytest.raises(nixlInvalidParamError):
            agent.make_prepped_xfer("READ", local, li, remote, ri)
    with pytest.raises(nixlInvalidParamError):
        agent.make_prepped_xfer("READ", local, [0], local, [0])  # both local
    with pytest.raises(KeyError):
        agent.make_prepped_xfer("COPY", local, [0], remote, [0])
    short = agent.prep_xfer_dlist("", [(kv.ctypes.data, 8, 0)], "DRAM")
    with pytest.raises(nixlInvalidParamError, match="length mismatch"):
        agent.make_prepped_xfer("READ", short, [0], remote, [0])
    # A released handle used again.
    h = agent.make_prepped_xfer("READ", local, [0], remote, [0])
    agent.release_xfer_handle(h)
    with pytest.raises(nixlInvalidParamError):
        agent.check_xfer_state(h)
    with pytest.raises(nixlInvalidParamError):
        agent.transfer(h)
    agent.release_dlist_handle(remote)
    with pytest.raises(nixlInvalidParamError):
        agent.make_prepped_xfer("READ", local, [0], remote, [0])
    h = agent.make_prepped_xfer("READ", local, [0], agent.prep_xfer_dlist(name, blocks(peer.buffer, 1), "DRAM"), [0])
    agent.transfer(h)
    while agent.check_xfer_state(h) == "PROC":
        pass
    with pytest.raises(nixlNoTelemetryError):
        agent.get_xfer_telemetry(h)
    with pytest.raises(nixlNotFoundError):
        agent.send_notif("unknown-agent", b"x")
    with pytest.raises(nixlNotFoundError):
        agent.deregister_memory(agent.get_reg_descs([(0x1000, 16, 0, "")], "DRAM"))
    # Errors are FerryErrors too, with NIXL's status name first.
    try:
        agent.prep_xfer_dlist("unknown-agent", blocks(peer.buffer, 1), "DRAM")
    except nixlNotFoundError as e:
        assert isinstance(e, ferry.FerryError) and str(e).startswith("NIXL_ERR_NOT_FOUND")
    # Nothing moved into the peer's buffer, nothing into ours but the one READ.
    assert peer.ask("check 9") == "ok"
    agent.deregister_memory(reg)


def test_a_lost_peer_gives_err_and_says_what_may_have_landed(np):
    import signal

    p = Peer("prefill-lost", size=64 << 20)
    agent = nixl_agent("decode-2")
    kv = np.zeros(64 << 20, dtype=np.uint8)
    agent.register_memory([(kv.ctypes.data, kv.nbytes, 0, "")], "DRAM")
    name = agent.add_remote_agent(p.metadata)
    local = agent.prep_xfer_dlist("", [(kv.ctypes.data + i * (1 << 20), 1 << 20, 0) for i in range(64)], "DRAM")
    remote = agent.prep_xfer_dlist(name, [(p.buffer + i * (1 << 20), 1 << 20, 0) for i in range(64)], "DRAM")
    p.proc.send_signal(signal.SIGSTOP)
    h = agent.make_prepped_xfer("WRITE", local, list(range(64)), remote, list(range(64)), notif_msg=b"never")
    assert agent.transfer(h) == "PROC"
    with pytest.raises(nixlRepostActiveError):  # the peer is stopped: it cannot have ended
        agent.transfer(h)
    p.proc.kill()
    p.proc.wait()
    while (state := agent.check_xfer_state(h)) == "PROC":
        pass
    assert state == "ERR"
    why = agent.ferry_error(h)
    assert "may have landed" in why or "uncertain" in why, why
    agent.release_xfer_handle(h)


def test_metadata_by_address_and_by_notification(np):
    # The listener takes a free port itself (listen_port 0) and says which: no port is bound,
    # dropped and bound again.
    target = Peer("listener", listen_port=0)
    port = target.port
    try:
        assert port > 0
        agent = nixl_agent("fetcher", nixl_agent_config(enable_listen_thread=False))
        assert not agent.check_remote_metadata("listener")
        agent.fetch_remote_metadata("listener", "127.0.0.1", port)
        assert agent.check_remote_metadata("listener")
        assert agent.check_remote_metadata("listener", agent.get_xfer_descs(blocks(target.buffer, 1), "DRAM"))
        assert not agent.check_remote_metadata("listener", agent.get_xfer_descs([(0x1000, 8, 0)], "DRAM"))
        with pytest.raises(nixlNotFoundError):
            agent.fetch_remote_metadata("someone-else", "127.0.0.1", port)
        # send_local_metadata: the listener loads ours when it next looks.
        agent.send_local_metadata("127.0.0.1", port)
        kv = np.zeros(BLOCK, dtype=np.uint8)
        agent.register_memory([(kv.ctypes.data, BLOCK, 0, "")], "DRAM")
        agent.send_notif("listener", b"after-metadata")
        assert json.loads(target.ask("notifs")) == {"fetcher": [b"after-metadata".hex()]}
    finally:
        target.close()


def test_metadata_through_etcd(np, etcd_server, monkeypatch):
    monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", etcd_server.replace("etcd://", "http://"))
    a, b = nixl_agent("etcd-a"), nixl_agent("etcd-b")
    buf = np.zeros(BLOCK, dtype=np.uint8)
    b.register_memory([(buf.ctypes.data, BLOCK, 0, "")], "DRAM")
    b.send_local_metadata()
    a.fetch_remote_metadata("etcd-b")
    assert a.check_remote_metadata("etcd-b")
    src = np.full(BLOCK, 7, dtype=np.uint8)
    a.register_memory([(src.ctypes.data, BLOCK, 0, "")], "DRAM")
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(src.ctypes.data, BLOCK, 0)], "DRAM"),
                          a.get_xfer_descs([(buf.ctypes.data, BLOCK, 0)], "DRAM"), "etcd-b", b"etcd")
    a.transfer(h)
    while a.check_xfer_state(h) == "PROC":
        pass
    assert a.check_xfer_state(h) == "DONE" and (buf == 7).all()
    assert b.check_remote_xfer_done("etcd-a", b"etc")
    b.invalidate_local_metadata()
    with pytest.raises(nixlNotFoundError):
        a.fetch_remote_metadata("etcd-b")
    a.release_xfer_handle(h)


def test_a_keyed_agents_metadata_lets_no_stranger_in(np, tmp_path, monkeypatch):
    key = tmp_path / "fleet.key"
    key.write_text("fleet 000102030405060708090a0b0c0d0e0f\n")
    key.chmod(0o600)
    target = Peer("keyed", env={"FERRY_AUTH_KEY_FILE": str(key)})
    try:
        stranger = nixl_agent("stranger")
        name = stranger.add_remote_agent(target.metadata)
        with pytest.raises(nixlNotFoundError):
            stranger.prep_xfer_dlist(name, blocks(target.buffer, 1), "DRAM")
        monkeypatch.setenv("FERRY_AUTH_KEY_FILE", str(key))
        friend = nixl_agent("friend")
        kv = np.zeros(BLOCK, dtype=np.uint8)
        friend.register_memory([(kv.ctypes.data, BLOCK, 0, "")], "DRAM")
        name = friend.add_remote_agent(target.metadata)
        h = friend.initialize_xfer("READ", friend.get_xfer_descs([(kv.ctypes.data, BLOCK, 0)], "DRAM"),
                                   friend.get_xfer_descs([(target.buffer, BLOCK, 0)], "DRAM"), name)
        friend.transfer(h)
        while friend.check_xfer_state(h) == "PROC":
            pass
        assert friend.check_xfer_state(h) == "DONE"
        friend.release_xfer_handle(h)
    finally:
        target.close()


def keyrings(tmp_path, names):
    """Per-peer keyrings: for each name, a file holding every name's key, its own first (the
    key an engine proves is its first); key names are the agents' names."""
    keys = {n: bytes([i + 1]) * 16 for i, n in enumerate(names)}
    files = {}
    for n in names:
        f = tmp_path / f"{n}.key"
        f.write_text("".join(f"{m} {keys[m].hex()}\n" for m in [n] + [m for m in names if m != n]))
        f.chmod(0o600)
        files[n] = str(f)
    return files


def agent_as(name, monkeypatch, key_file=None, **conf):
    """A NIXL agent in this process, proving ``key_file``'s first key (None: keyless)."""
    if key_file is None:
        monkeypatch.delenv("FERRY_AUTH_KEY_FILE", raising=False)
    else:
        monkeypatch.setenv("FERRY_AUTH_KEY_FILE", key_file)
    return nixl_agent(name, nixl_agent_config(enable_listen_thread=True, listen_port=0, **conf))


def port_of(agent):
    return int(agent._addr.rsplit(":", 1)[1])


@pytest.mark.parametrize("keys", ["keyless", "per-peer-keyrings"])
def test_a_third_agent_naming_another_changes_no_completion_metadata_or_address(
        np, tmp_path, monkeypatch, caplog, keys):
    """Issue 46: a third agent (keyless, or holding a key of its own) that calls itself
    ``prefill`` forges no completion, loads no metadata and invalidates nothing of prefill at
    decode: decode's next READ from prefill still returns prefill's bytes; prefill's own
    notification is taken. Each forgery is dropped with a WARNING on ``ferry.nixl``. Keyless,
    prefill's loaded metadata binds the name; with per-peer keyrings prefill's key does, so
    the forgeries come before decode loaded anything of prefill."""
    files = (keyrings(tmp_path, ["decode", "prefill", "mallory"]) if keys != "keyless"
             else {"decode": None, "prefill": None, "mallory": None})
    decode = agent_as("decode", monkeypatch, files["decode"])
    prefill = agent_as("prefill", monkeypatch, files["prefill"])
    # The third agent, with its own engine (and key), names itself "prefill".
    impostor = agent_as("prefill", monkeypatch, files["mallory"])
    kv = np.zeros(BLOCK, dtype=np.uint8)
    decode.register_memory([(kv.ctypes.data, BLOCK, 0, "")], "DRAM")
    real = np.full(BLOCK, 0x11, dtype=np.uint8)
    prefill.register_memory([(real.ctypes.data, BLOCK, 0, "")], "DRAM")
    fake = np.full(BLOCK, 0xEE, dtype=np.uint8)
    impostor.register_memory([(fake.ctypes.data, BLOCK, 0, "")], "DRAM")
    if keys == "keyless":
        assert decode.add_remote_agent(prefill.get_agent_metadata()) == b"prefill"
    impostor.add_remote_agent(decode.get_agent_metadata())
    caplog.set_level(logging.WARNING, logger="ferry.nixl")
    caplog.clear()

    # A forged completion, forged metadata pointing "prefill" at the impostor, a forged
    # invalidation: each returns once decode's engine holds it.
    impostor.send_notif("decode", b"kv-done:req-1")
    impostor.send_local_metadata("127.0.0.1", port_of(decode))
    impostor.invalidate_local_metadata("127.0.0.1", port_of(decode))
    assert not decode.check_remote_xfer_done("prefill", b"kv-done")
    assert decode.get_new_notifs() == {}
    if keys != "keyless":
        assert not decode.check_remote_metadata("prefill")
        assert decode.add_remote_agent(prefill.get_agent_metadata()) == b"prefill"
    assert decode.check_remote_metadata("prefill", decode.get_xfer_descs([(real.ctypes.data, BLOCK, 0)], "DRAM"))
    assert not decode.check_remote_metadata("prefill", decode.get_xfer_descs([(fake.ctypes.data, BLOCK, 0)], "DRAM"))
    dropped = [r.getMessage() for r in caplog.records
               if r.name == "ferry.nixl" and r.levelno == logging.WARNING and "dropped" in r.getMessage()]
    assert len(dropped) == 3, dropped
    assert all("'prefill'" in m for m in dropped), dropped

    # decode's next READ from prefill returns prefill's bytes.
    h = decode.initialize_xfer("READ", decode.get_xfer_descs([(kv.ctypes.data, BLOCK, 0)], "DRAM"),
                               decode.get_xfer_descs([(real.ctypes.data, BLOCK, 0)], "DRAM"), "prefill")
    decode.transfer(h)
    while decode.check_xfer_state(h) == "PROC":
        pass
    assert decode.check_xfer_state(h) == "DONE"
    assert (kv == 0x11).all()
    decode.release_xfer_handle(h)

    # The real prefill's completion is taken, filed under its name.
    prefill.add_remote_agent(decode.get_agent_metadata())
    prefill.send_notif("decode", b"kv-done:req-1")
    assert decode.check_remote_xfer_done("prefill", b"kv-done")


def test_redirected_metadata_pointing_at_another_key_holder_is_refused(np, tmp_path, monkeypatch):
    """Issue 46, S3: with per-peer keyrings mallory holds decode's key, so its engine passes
    decode's handshake. prefill's metadata, rewritten to send decode to mallory's address,
    still names prefill's server identity: decode refuses mallory there (nixlBackendError
    naming the address and the identity) and no READ of it returns mallory's bytes. prefill's
    own metadata loaded, decode reads prefill's bytes."""
    files = keyrings(tmp_path, ["decode", "prefill", "mallory"])
    decode = agent_as("decode", monkeypatch, files["decode"])
    prefill = agent_as("prefill", monkeypatch, files["prefill"])
    mallory = agent_as("mallory", monkeypatch, files["mallory"])
    kv = np.zeros(BLOCK, dtype=np.uint8)
    decode.register_memory([(kv.ctypes.data, BLOCK, 0, "")], "DRAM")
    real = np.full(BLOCK, 0x11, dtype=np.uint8)
    prefill.register_memory([(real.ctypes.data, BLOCK, 0, "")], "DRAM")
    fake = np.full(BLOCK, 0xEE, dtype=np.uint8)
    mallory.register_memory([(fake.ctypes.data, BLOCK, 0, "")], "DRAM")
    md = prefill.get_agent_metadata()
    magic, body = md[:md.index(b"{")], json.loads(md[md.index(b"{"):])
    assert body["server_identity"] == prefill._engine.server_identity
    redirected = dict(body, addr=mallory._addr)
    assert decode.add_remote_agent(magic + json.dumps(redirected).encode()) == b"prefill"

    with pytest.raises(nixlBackendError) as e:
        decode.make_connection("prefill")
    assert mallory._addr in str(e.value) and body["server_identity"] in str(e.value), str(e.value)
    # Nor does a transfer reach it: refused when it is created (its descriptors are checked
    # against a listing only the expected server may give).
    with pytest.raises(nixlNotFoundError):
        decode.initialize_xfer("READ", decode.get_xfer_descs([(kv.ctypes.data, BLOCK, 0)], "DRAM"),
                               decode.get_xfer_descs([(fake.ctypes.data, BLOCK, 0)], "DRAM"), "prefill")
    assert not (kv == 0xEE).any(), "mallory's bytes were read as prefill's"

    assert decode.add_remote_agent(md) == b"prefill"
    decode.make_connection("prefill")
    h = decode.initialize_xfer("READ", decode.get_xfer_descs([(kv.ctypes.data, BLOCK, 0)], "DRAM"),
                               decode.get_xfer_descs([(real.ctypes.data, BLOCK, 0)], "DRAM"), "prefill")
    decode.transfer(h)
    while decode.check_xfer_state(h) == "PROC":
        pass
    assert decode.check_xfer_state(h) == "DONE"
    assert (kv == 0x11).all()
    decode.release_xfer_handle(h)


def test_notifications_from_an_agent_whose_metadata_was_not_loaded_bind_its_name(np, monkeypatch, caplog):
    """A receiver that never loaded the sender's metadata (vLLM's prefill side) files the
    first speaker's notifications under its name, and drops another incarnation's later."""
    target = agent_as("target", monkeypatch)
    first, second = agent_as("sender", monkeypatch), agent_as("sender", monkeypatch)
    for a in (first, second):
        a.add_remote_agent(target.get_agent_metadata())
    caplog.set_level(logging.WARNING, logger="ferry.nixl")
    first.send_notif("target", b"one")
    second.send_notif("target", b"forged")
    first.send_notif("target", b"two")
    assert target.get_new_notifs() == {"sender": [b"one", b"two"]}
    assert any("dropped a notification naming agent 'sender'" in r.getMessage() for r in caplog.records)
    # Once the application forgets the name, the next speaker binds it.
    target.remove_remote_agent("sender")
    second.send_notif("target", b"three")
    assert target.get_new_notifs() == {"sender": [b"three"]}


def test_keyless_off_loopback_warns_on_the_ferry_nixl_logger(monkeypatch, tmp_path, caplog):
    """S4: an agent listening off loopback without keys says so where its user looks (Python
    logging, ``ferry.nixl``); on loopback, or with keys, it does not."""
    caplog.set_level(logging.WARNING, logger="ferry.nixl")
    monkeypatch.setenv("FERRY_BIND_ADDRESS", "0.0.0.0")
    agent_as("open", monkeypatch)
    warned = [r for r in caplog.records if r.name == "ferry.nixl" and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "without authentication keys" in warned[0].getMessage()
    assert "FERRY_AUTH_KEY_FILE" in warned[0].getMessage()
    caplog.clear()
    agent_as("keyed", monkeypatch, keyrings(tmp_path, ["keyed"])["keyed"])
    monkeypatch.setenv("FERRY_BIND_ADDRESS", "127.0.0.1")
    agent_as("local", monkeypatch)
    assert not [r for r in caplog.records if "without authentication keys" in r.getMessage()]


def test_the_rest_of_the_surface(np):
    agent = nixl_agent("misc", instantiate_all=True)
    assert "UCX" in agent.get_plugin_list()
    assert agent.get_backend_mem_types("UCX") == ["DRAM_SEG", "VRAM_SEG"]
    assert agent.get_plugin_mem_types("NOPE") == [] and agent.get_backend_params("NOPE") == {}
    with pytest.raises(nixlNotFoundError):
        agent.create_backend("NOPE_PLUGIN")
    arr = np.zeros((2, 3), dtype=np.uint64)
    arr[:, 1] = 8
    assert len(agent.get_xfer_descs(arr, "DRAM")) == 2
    assert agent.get_xfer_descs([(1, 2, 0, "x")], "DRAM") is None
    assert agent.get_reg_descs([(1, 2, 0)], "DRAM") is None
    d = agent.get_xfer_descs([(1, 2, 0)], "DRAM")
    assert agent.deserialize_descs(agent.get_serialized_descs(d)) == d
    buf = np.zeros(4 * BLOCK, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    strided = np.array([[buf.ctypes.data, 16, 0, BLOCK, 4]], dtype=np.uint64)
    h = agent.prep_xfer_dlist("", strided, "DRAM")
    assert len(agent._dlists[h._handle].descs) == 4
    # Loopback: a transfer to this agent itself.
    h2 = agent.prep_xfer_dlist("misc", blocks(buf.ctypes.data, 2), "DRAM")
    h1 = agent.prep_xfer_dlist("", blocks(buf.ctypes.data + 2 * BLOCK, 2), "DRAM")
    buf[: 2 * BLOCK] = 3
    x = agent.make_prepped_xfer("READ", h1, [0, 1], h2, [0, 1])
    agent.transfer(x)
    while agent.check_xfer_state(x) == "PROC":
        pass
    assert agent.check_xfer_state(x) == "DONE" and (buf[2 * BLOCK:] == 3).all()
    assert agent.estimate_xfer_cost(x)[2] == "UNKNOWN"
    assert agent.query_xfer_backend(x) in agent.get_plugin_list()


SCRIPT = """
from nixl._api import nixl_agent, nixl_agent_config
from nixl._bindings import nixlXferTelemetry, nixlNotFoundError
from nixl.logging import get_logger
import nixl
a = nixl_agent("alias", nixl_agent_config(capture_telemetry=True))
print("ferry" if nixl_agent.__module__.startswith("ferry.") else "other", hasattr(nixl, "nixl_agent"))
"""


def test_python_m_ferry_nixl_runs_unchanged_nixl_code(tmp_path):
    script = tmp_path / "uses_nixl.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "FERRY_AS_NIXL"}
    out = subprocess.run([sys.executable, "-m", "ferry.nixl", str(script)], capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ferry", "True"]
    plain = subprocess.run([sys.executable, "-c", "import nixl._api"], capture_output=True,
                           text=True, env=env, timeout=60)
    assert plain.returncode != 0 and "No module named 'nixl'" in plain.stderr
    refused = subprocess.run([sys.executable, "-m", "ferry.nixl", "-c"], capture_output=True,
                             text=True, env=env, timeout=60)
    assert refused.returncode != 0


def test_ferry_as_nixl_in_the_environment_reaches_every_process(tmp_path):
    import site

    from conftest import require

    hooks = [Path(p) / "ferry_aliases.pth" for p in site.getsitepackages()]
    require(any(h.is_file() for h in hooks),
            f"no ferry_aliases.pth in {site.getsitepackages()} (an editable build has none; "
            "the wheel installs it)")
    script = tmp_path / "uses_nixl.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env={**os.environ, "FERRY_AS_NIXL": "1"}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ferry", "True"]


def test_vram_registers_through_the_gpu_path(cuda_driver, np):
    """VRAM descriptors (Ferry's fake driver here) register through the CUDA driver and move
    to and from a peer agent's DRAM."""
    owner = ferry.Engine()
    dev = owner.alloc_gpu(0, 1 << 20)
    dev.copy_from(b"vram bytes" + bytes(54), 0)
    a, b = nixl_agent("gpu-side"), nixl_agent("host-side")
    reg = a.register_memory([(dev.ptr, 1 << 20, 0, "")], "VRAM")
    host = np.zeros(BLOCK, dtype=np.uint8)
    b.register_memory([(host.ctypes.data, BLOCK, 0, "")], "DRAM")
    name = a.add_remote_agent(b.get_agent_metadata())
    local = a.prep_xfer_dlist("", [(dev.ptr, 64, 0)], "VRAM")
    remote = a.prep_xfer_dlist(name, [(host.ctypes.data, 64, 0)], "DRAM")
    h = a.make_prepped_xfer("WRITE", local, [0], remote, [0], notif_msg=b"gpu")
    a.transfer(h)
    while a.check_xfer_state(h) == "PROC":
        pass
    assert a.check_xfer_state(h) == "DONE"
    assert bytes(host[:10]) == b"vram bytes"
    assert b.get_new_notifs() == {"gpu-side": [b"gpu"]}
    a.release_xfer_handle(h)
    a.deregister_memory(reg)
    with pytest.raises(nixlInvalidParamError, match="GPU 0, not on cuda:3"):
        a.register_memory([(dev.ptr, 4096, 3, "")], "VRAM")


# ----- what NIXL's own Python tests exercise (issue 49) ---------------------------------------
# NIXL's test/python/test_nixl_api.py and test_nixl_bindings.py run unchanged on Ferry
# (docs/nixl.md gives the commands); each behaviour they use has its own test here.


def two_agents(np, telemetry=False, size=4 * BLOCK):
    """Two agents in this process, each with ``size`` registered bytes, the first knowing the
    second."""
    a = nixl_agent("a-" + os.urandom(4).hex(), nixl_agent_config(capture_telemetry=telemetry))
    b = nixl_agent("b-" + os.urandom(4).hex())
    abuf, bbuf = np.zeros(size, dtype=np.uint8), np.zeros(size, dtype=np.uint8)
    a.register_memory([(abuf.ctypes.data, size, 0, "")], "DRAM")
    b.register_memory([(bbuf.ctypes.data, size, 0, "")], "DRAM")
    assert a.add_remote_agent(b.get_agent_metadata()) == b.name.encode()
    return a, b, abuf, bbuf


def finish(agent, handle):
    while (state := agent.check_xfer_state(handle)) == "PROC":
        pass
    return state


def test_nixl_utils_allocates_fills_and_verifies():
    from ferry._alias import NIXL
    from ferry.nixl import _utils

    assert NIXL.modules["nixl._utils"] == "ferry.nixl._utils"
    a, b = _utils.malloc_passthru(100), _utils.malloc_passthru(100)
    try:
        assert a and b and a % 4096 == 0 and b % 4096 == 0
        _utils.ba_buf(a, 100)
        _utils.ba_buf(b, 100)
        assert ctypes.string_at(a, 100) == b"\xba" * 100
        _utils.verify_transfer(a, b, 100)
        ctypes.memset(b + 50, 1, 1)
        with pytest.raises(AssertionError, match="byte 50"):
            _utils.verify_transfer(a, b, 100)
    finally:
        _utils.free_passthru(a)
        _utils.free_passthru(b)


def test_descriptor_lists_edit_compare_and_pickle(capsys):
    import pickle

    from ferry.nixl import DRAM_SEG, nixlRegDList, nixlXferDList

    descs = [(1000, 105, 0), (2000, 30, 0), (1010, 20, 0)]
    xl = nixlXferDList(DRAM_SEG, descs)
    xl.print()
    assert "3 descriptors" in capsys.readouterr().out
    assert pickle.loads(pickle.dumps(xl)) == xl and xl.getType() == DRAM_SEG
    assert xl.index((2000, 30, 0)) == 1
    xl.remDesc(1)
    assert xl.descCount() == 2 and xl[0] == descs[0] and xl[1] == descs[2]
    with pytest.raises(nixlNotFoundError):
        xl.index((2000, 30, 0))
    xl.clear()
    assert xl.isEmpty()
    xl.addDesc((2000, 100, 0))
    assert list(xl) == [(2000, 100, 0)]
    rl = nixlRegDList(DRAM_SEG)
    rl.addDesc((1, 2, 0, "dead"))
    assert rl.descCount() == 1
    with pytest.raises(ValueError):
        rl.addDesc((1, 2, 0))


@pytest.mark.parametrize("listen", [True, False])
@pytest.mark.parametrize("sync", [None, "NIXL_THREAD_SYNC_NONE", "NIXL_THREAD_SYNC_STRICT", "NIXL_THREAD_SYNC_RW"])
def test_an_agent_stands_on_a_nixlAgent_with_nixls_sync_mode(monkeypatch, listen, sync):
    """NIXL's nixl_agent makes a _bindings.nixlAgent from a nixlAgentConfig: the sync mode
    given, else STRICT with a listener and NONE without."""
    from ferry.nixl import _api, _bindings, nixl_thread_sync_t

    assert nixl_thread_sync_t is _api.nixl_thread_sync_t  # nixl's, not _bindings' enum

    seen = {}
    real = _bindings.nixlAgent

    def spy(name, config):
        seen["config"] = config
        return real(name, config)

    monkeypatch.setattr(_bindings, "nixlAgent", spy)
    mode = None if sync is None else nixl_thread_sync_t[sync]
    agent = nixl_agent("sync-" + os.urandom(4).hex(), nixl_agent_config(
        sync_mode=mode, enable_listen_thread=listen, listen_port=0, capture_telemetry=True))
    want = mode or (nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if listen
                    else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE)
    assert seen["config"].syncMode == want.value
    assert seen["config"].useListenThread is listen and seen["config"].captureTelemetry is True
    assert agent.agent.name == agent.name


def test_an_empty_agent_name_is_valueerror():
    from ferry.nixl import nixlAgent, nixlAgentConfig

    with pytest.raises(ValueError):
        nixl_agent("")
    with pytest.raises(ValueError):
        nixlAgent("", nixlAgentConfig())


def test_the_bindings_agent_moves_bytes_notifies_and_reports_telemetry(monkeypatch):
    """The C++-named API NIXL's test_nixl_bindings.py drives: statuses, integer handles,
    getNotifs filling the map it is given."""
    from ferry.nixl import _bindings as nb
    from ferry.nixl import _utils

    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "y")
    cfg = nb.nixlAgentConfig()
    cfg.useProgThread = False
    a1, a2 = nb.nixlAgent("bind-1", cfg), nb.nixlAgent("bind-2", cfg)
    with pytest.raises(nb.nixlNotFoundError):
        a1.getPluginParams("UVX")
    params, mems = a1.getPluginParams("UCX")
    assert params == {} and "DRAM_SEG" in mems
    u1, u2 = a1.createBackend("UCX", {}), a2.createBackend("UCX", {})
    size = 256
    p1, p2 = _utils.malloc_passthru(size), _utils.malloc_passthru(size)
    try:
        _utils.ba_buf(p1, size)
        ctypes.memset(p2, 0, size)
        r1, r2 = nb.nixlRegDList(nb.DRAM_SEG), nb.nixlRegDList(nb.DRAM_SEG)
        r1.addDesc((p1, size, 0, "dead"))
        r2.addDesc((p2, size, 0, "dead"))
        assert a1.registerMem(r1, [u1]) == nb.NIXL_SUCCESS
        assert a2.registerMem(r2, [u2]) == nb.NIXL_SUCCESS
        assert a1.loadRemoteMD(a2.getLocalMD()) == b"bind-2"
        assert a2.loadRemoteMD(a1.getLocalMD()) == b"bind-1"
        src, dst = nb.nixlXferDList(nb.DRAM_SEG), nb.nixlXferDList(nb.DRAM_SEG)
        src.addDesc((p1 + 8, 8, 0))
        dst.addDesc((p2 + 8, 8, 0))
        h = a1.createXferReq(nb.NIXL_WRITE, src, dst, "bind-2", "n\0tification")
        assert h != 0
        status = a1.postXferReq(h)
        notifs = {}
        while status != nb.NIXL_SUCCESS or not notifs:
            assert status in (nb.NIXL_SUCCESS, nb.NIXL_IN_PROG)
            if status != nb.NIXL_SUCCESS:
                status = a1.getXferStatus(h)
            if not notifs:
                notifs = a2.getNotifs(notifs)
        assert notifs == {"bind-1": [b"n\0tification"]}
        _utils.verify_transfer(p1 + 8, p2 + 8, 8)
        assert ctypes.string_at(p2, 8) == bytes(8)
        t = a1.getXferTelemetry(h)
        assert (t.descCount, t.totalBytes) == (1, 8) and t.startTime > 0
        assert 0 < t.postDuration <= t.xferDuration and t.backendName == "UCX"
        assert a1.releaseXferReq(h) == nb.NIXL_SUCCESS
        with pytest.raises(nb.nixlInvalidParamError):
            a1.getXferStatus(h)
        assert a1.deregisterMem(r1, [u1]) == nb.NIXL_SUCCESS
        assert a2.deregisterMem(r2, [u2]) == nb.NIXL_SUCCESS
        assert a1.invalidateRemoteMD("bind-2") == nb.NIXL_SUCCESS
        with pytest.raises(nb.nixlNotFoundError):
            a1.invalidateRemoteMD("bind-2")
    finally:
        _utils.free_passthru(p1)
        _utils.free_passthru(p2)


def test_posix_answers_query_memory_about_files(tmp_path):
    from ferry.nixl import _bindings as nb

    a = nb.nixlAgent("query", nb.nixlAgentConfig())
    params, mems = a.getPluginParams("POSIX")
    assert mems == ["FILE_SEG"]
    backend = a.createBackend("POSIX", params)
    descs = nb.nixlRegDList(nb.FILE_SEG)
    assert a.queryMem(descs, backend) == []
    f = tmp_path / "f"
    f.write_bytes(b"12345")
    descs.addDesc((0, 0, 0, str(f)))
    descs.addDesc((0, 0, 0, str(tmp_path / "missing")))
    got = a.queryMem(descs, backend)
    assert got[0]["size"] == "5" and int(got[0]["mode"]) == f.stat().st_mode and got[1] is None
    # UCX moves memory; it has nothing to say about files.
    from ferry.nixl import nixlNotSupportedError

    with pytest.raises(nixlNotSupportedError):
        a.queryMem(descs, a.createBackend("UCX", {}))


def test_an_unknown_operation_is_keyerror_before_anything_else():
    from ferry.nixl import DRAM_SEG, nixlXferDList

    agent = nixl_agent("ops", nixl_agent_config(backends=[]))
    with pytest.raises(KeyError):
        agent.make_prepped_xfer("RD", 0, [], 0, [])
    with pytest.raises(KeyError):
        agent.initialize_xfer("WR", nixlXferDList(DRAM_SEG), nixlXferDList(DRAM_SEG), "nobody")


def test_unknown_plugin_and_backend_names():
    agent = nixl_agent("names", nixl_agent_config(backends=["UCX"]))
    assert agent.get_plugin_mem_types("UVX") == [] and agent.get_plugin_params("UVX") == {}
    assert agent.get_backend_mem_types("UVX") == [] and agent.get_backend_params("UVX") == {}
    with pytest.raises(nixlNotFoundError):
        agent.create_backend("UVX")


def test_an_empty_tag_consumes_any_notification(np):
    a, b, _, _ = two_agents(np)
    a.send_notif(b.name, b"whatever")
    b.add_remote_agent(a.get_agent_metadata())
    deadline = time.monotonic() + 10
    while not b.check_remote_xfer_done(a.name, b""):
        assert time.monotonic() < deadline
    assert not b.check_remote_xfer_done(a.name, b"")  # consumed


class _FakeTensor:
    """Enough of a CPU torch.Tensor for the descriptor paths (``_is_torch_tensor``)."""

    def __init__(self, addr, nbytes, contiguous=True):
        self.addr, self.nbytes, self.contiguous = addr, nbytes, contiguous

    def is_contiguous(self):
        return self.contiguous

    def get_device(self):
        return -1

    def data_ptr(self):
        return self.addr

    def numel(self):
        return self.nbytes

    def element_size(self):
        return 1


def test_tensors_give_descriptors_and_non_contiguous_ones_none(monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(Tensor=_FakeTensor))
    agent = nixl_agent("tensors", nixl_agent_config(backends=[]))
    t = _FakeTensor(0x10000, 64)
    assert list(agent.get_xfer_descs(t)) == [(0x10000, 64, 0)]
    assert list(agent.get_reg_descs([t, _FakeTensor(0x20000, 8)])) == [
        (0x10000, 64, 0, ""), (0x20000, 8, 0, "")]
    bent = _FakeTensor(0x10000, 64, contiguous=False)
    assert agent.get_xfer_descs(bent) is None and agent.get_reg_descs(bent) is None
    assert agent.get_xfer_descs([t, bent]) is None


@pytest.mark.parametrize("env,capture,kept", [
    (None, True, True), (None, False, False), ("y", False, True), ("no", True, False),
    ("OFF", True, False), ("Enable", False, True)])
def test_telemetry_follows_nixl_telemetry_enable_over_the_config(np, monkeypatch, env, capture, kept):
    if env is None:
        monkeypatch.delenv("NIXL_TELEMETRY_ENABLE", raising=False)
    else:
        monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", env)
    a, b, abuf, bbuf = two_agents(np, telemetry=capture, size=128)
    src = a.get_xfer_descs([(abuf.ctypes.data, 64, 0), (abuf.ctypes.data + 64, 64, 0)], "DRAM")
    dst = a.get_xfer_descs([(bbuf.ctypes.data, 64, 0), (bbuf.ctypes.data + 64, 64, 0)], "DRAM")
    h = a.initialize_xfer("WRITE", src, dst, b.name, b"telem")
    assert a.transfer(h) in ("DONE", "PROC") and finish(a, h) == "DONE"
    if not kept:
        with pytest.raises(nixlNoTelemetryError):
            a.get_xfer_telemetry(h)
        return
    t = a.get_xfer_telemetry(h)
    assert (t.descCount, t.totalBytes, t.backendName) == (2, 128, "UCX")
    assert t.startTime > 0 and 0 < t.postDuration <= t.xferDuration


def test_a_bad_nixl_telemetry_enable_is_runtimeerror(monkeypatch):
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "perhaps")
    with pytest.raises(RuntimeError, match="NIXL_TELEMETRY_ENABLE"):
        nixl_agent("bad-telemetry-env")


# ----- defects a mutation run left uncaught (issue 49) ----------------------------------------


def test_initialize_xfer_checks_the_local_descriptors_and_moves_nothing(np):
    a, b, abuf, bbuf = two_agents(np)
    bbuf[:] = 7
    stray = np.zeros(BLOCK, dtype=np.uint8)  # never registered
    with pytest.raises(nixlNotFoundError):
        a.initialize_xfer("WRITE", a.get_xfer_descs([(stray.ctypes.data, BLOCK, 0)], "DRAM"),
                          a.get_xfer_descs([(bbuf.ctypes.data, BLOCK, 0)], "DRAM"), b.name, b"x")
    with pytest.raises(nixlNotFoundError):  # past the end of the local registration
        a.initialize_xfer("READ", a.get_xfer_descs([(abuf.ctypes.data + BLOCK, 4 * BLOCK, 0)], "DRAM"),
                          a.get_xfer_descs([(bbuf.ctypes.data, 4 * BLOCK, 0)], "DRAM"), b.name)
    assert (bbuf == 7).all() and not b.get_new_notifs()


def test_a_failed_notification_is_err_although_the_bytes_landed(np):
    """The notification goes after the bytes; if it cannot be sent (here: longer than a
    notification may be), the transfer is "ERR", not "DONE", and says why."""
    a, b, abuf, bbuf = two_agents(np)
    abuf[:] = 5
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(abuf.ctypes.data, BLOCK, 0)], "DRAM"),
                          a.get_xfer_descs([(bbuf.ctypes.data, BLOCK, 0)], "DRAM"), b.name,
                          b"n" * ((64 << 10) + 1))
    a.transfer(h)
    assert finish(a, h) == "ERR"
    assert "notification" in a.ferry_error(h)
    assert (bbuf[:BLOCK] == 5).all() and not b.get_new_notifs()
