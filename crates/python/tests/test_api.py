"""describe(), doctor(), handles' properties, the bench and the example."""

import json
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import ferry
import ferry.broadcast
import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_describe_is_a_plain_dict(loopback):
    server, client, peer, _ = loopback
    d = server.describe()
    assert isinstance(d, dict)
    assert d["listen"] == server.listen_addr
    assert {s["name"] for s in d["published"]} == {"seg", "ro"}
    json.dumps(d)  # plain values only
    assert peer.epoch == server.epoch and peer.peer_id == server.peer_id
    # Both ends are in this process, so on this host: the same-host plane.
    assert peer.transport == "local"


def test_version_is_the_workspace_version():
    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())
    assert ferry.__version__ == cargo["workspace"]["package"]["version"]


def test_doctor_rows():
    d = ferry.doctor()
    names = [c["name"] for c in d["checks"]]
    assert "build" in names and "io_uring" in names
    assert d["summary"]["transports"][0] == "tcp"
    assert ("uring" in d["summary"]["transports"]) == bool(d["summary"]["uring_opcodes"])
    for c in d["checks"]:
        assert c["status"] in ("ok", "unavailable", "absent", "error")


def test_handles(loopback):
    _, client, peer, _ = loopback
    seg = peer.segment("seg")
    assert len(seg) == 64 << 10 and seg.access == "read+write" and seg.name == "seg"
    reg = client.register(bytearray(10), name="ten", access="read")
    assert (reg.name, len(reg), reg.access, reg.readonly, reg.closed) == (
        "ten", 10, "read", False, False
    )
    assert "ten" in repr(reg)
    reg.close()
    reg.close()
    assert reg.closed


def test_publish_file(tmp_path):
    path = tmp_path / "shard.bin"
    path.write_bytes(bytes(range(256)) * 16)
    server = ferry.Engine(listen="127.0.0.1:0")
    with server.publish_file(path, name="shard") as f:
        assert len(f) == 4096
        client = ferry.Engine()
        peer = client.connect(server.listen_addr)
        buf = bytearray(4096)
        reg = client.register(buf)
        client.read(reg, peer.segment("shard")).wait(timeout=30).raise_for_failure()
        assert bytes(buf) == path.read_bytes()


def test_python_bench_runs():
    out = subprocess.run(
        [sys.executable, "-m", "ferry", "bench", "--op", "read", "--total", "64MiB", "--json"],
        check=True, capture_output=True, text=True, timeout=120,
    )
    r = json.loads(out.stdout)
    assert r["total_bytes"] == 64 << 20 and r["gb_per_s"] > 0


def _ferry_module(*args):
    return subprocess.run(
        [sys.executable, "-m", "ferry", *args], capture_output=True, text=True, timeout=120
    )


def test_python_m_ferry_help_and_version():
    out = _ferry_module("--help")
    assert out.returncode == 0, out.stderr
    assert "bench" in out.stdout and "doctor" in out.stdout
    out = _ferry_module("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"ferry {ferry.__version__}"
    assert _ferry_module().returncode == 2


def test_python_bench_checks_its_numbers():
    for args, flag in [
        (["--depth", "0"], "--depth"),
        (["--streams", "0"], "--streams"),
        (["--op-size", "0"], "--op-size"),
        (["--duration", "0"], "--duration"),
        (["--total", "1.5"], "--total"),
    ]:
        out = _ferry_module("bench", *args)
        assert out.returncode == 2, (args, out.stderr)
        assert f"argument {flag}" in out.stderr, out.stderr
    out = _ferry_module("bench", "--duration", "300ms", "--op-size", "64KiB", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["seconds"] >= 0.3


def test_python_bench_fails_as_the_cli_does():
    # Numbers wrong together: refused as `ferry bench` refuses them, exit 1.
    out = _ferry_module("bench", "--total", "1")
    assert out.returncode == 1, out.stderr
    assert "--total 1 is less than one request" in out.stderr, out.stderr
    # A connection error: one line, no traceback; under --json one object too.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    addr = "127.0.0.1:%d" % s.getsockname()[1]
    s.close()
    out = _ferry_module("bench", addr, "--json")
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.startswith("ferry: "), out.stderr
    assert json.loads(out.stdout)["error"]["kind"] == "connection_refused", out.stdout
    # One stream is "1 stream"; IEC units as the CLI takes them (Kubernetes' `Mi` too).
    out = _ferry_module("bench", "--total", "1Mi", "--op-size", "64Ki")
    assert out.returncode == 0 and "1 stream," in out.stdout, out.stderr


def test_an_engine_that_does_not_listen_is_named_in_the_users_words(np):
    engine = ferry.Engine()
    with pytest.raises(ferry.InvalidArgument, match=r"ferry.Engine\(listen="):
        ferry.broadcast.Publisher(engine, {"w": np.zeros(4)}, name="x")
    with pytest.raises(ferry.InvalidArgument, match="relay=False"):
        ferry.broadcast.pull(engine, "127.0.0.1:1", {"w": np.zeros(4)})


def test_weight_update_example(np):
    example = ROOT / "examples" / "python" / "weight_update.py"
    out = subprocess.run(
        [sys.executable, str(example)], check=True, capture_output=True, text=True, timeout=120
    )
    assert "all weights match" in out.stdout


def test_metrics_are_served_over_http():
    import urllib.request

    engine = ferry.Engine(metrics="127.0.0.1:0")
    host, port = engine.metrics_addr.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    with urllib.request.urlopen(f"http://{engine.metrics_addr}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    assert "# TYPE ferry_registrations gauge" in text
    assert f'peer_id="{engine.peer_id}"' in text
    assert ferry.Engine().metrics_addr is None
    with pytest.raises(ferry.InvalidArgument, match="metrics must be HOST:PORT"):
        ferry.Engine(metrics="no-port")


def test_a_registration_stays_published_until_closed_or_its_engine_is():
    import gc

    server = ferry.Engine(listen="127.0.0.1:0")
    data = bytes(range(256)) * 16
    server.register(bytearray(data), name="kept", access="read")  # the handle is dropped
    with server.register(bytearray(4096), name="scoped", access="read"):
        pass
    gc.collect()
    client = ferry.Engine()
    peer = client.connect(server.listen_addr)
    assert [s["name"] for s in peer.segments] == ["kept"]
    buf = bytearray(len(data))
    client.read(client.register(buf), peer.segment("kept")).wait(timeout=30)
    assert bytes(buf) == data
    # Shut down, the engine unpublishes what it kept.
    with ferry.Engine(listen="127.0.0.1:0") as other:
        reg = other.register(bytearray(64), name="x", access="read")
    assert reg.closed


def test_metrics_on_a_bare_port_is_this_hosts():
    engine = ferry.Engine(metrics="0")
    assert engine.metrics_addr.startswith("127.0.0.1:"), engine.metrics_addr


def test_a_peer_on_this_host_is_reached_by_copies_unless_turned_off():
    data = bytes(range(256)) * 4096
    for same_host, expected in ((True, "local"), (False, None)):
        server = ferry.Engine(listen="127.0.0.1:0", same_host=same_host)
        seg = server.register(bytearray(data), name="w", access="read")
        client = ferry.Engine()
        peer = client.connect(server.listen_addr)
        buf = bytearray(len(data))
        client.read(client.register(buf), peer.segment("w")).wait(timeout=30)
        assert bytes(buf) == data
        d = client.describe()
        (route,) = d["routes"]
        if expected:
            assert route["transport"] == expected, route
            assert route["same_host"] is None
            assert server.describe()["same_host"].startswith(("on", "limited"))
        else:
            assert route["transport"] in ("uring", "tcp"), route
            assert "did not offer" in route["same_host"]
            assert server.describe()["same_host"].startswith("off")
        seg.close()
        server.shutdown()
    rows = {c["name"]: c for c in ferry.doctor()["checks"]}
    assert rows["same-host"]["status"] == "ok", rows["same-host"]


def test_done_polled_in_a_loop_sees_each_request_end_with_its_outcome():
    """`done()` resolves a request itself when polled, without waiting for the task that
    watches it: every request polled to its end has its bytes in place at once, and the
    outcomes `wait` and `wait_drained` give afterwards are that same end."""
    data = bytes(range(256)) * 256
    server = ferry.Engine(listen="127.0.0.1:0")
    seg = server.register(bytearray(data), name="w", access="read")
    client = ferry.Engine()
    peer = client.connect(server.listen_addr)
    buf = bytearray(len(data))
    reg = client.register(buf)
    for _ in range(200):
        buf[:] = bytes(len(data))
        req = client.read(reg, peer.segment("w"))
        deadline = time.monotonic() + 30
        while not req.done():
            assert time.monotonic() < deadline, "the request never ended"
        assert bytes(buf) == data
        logical = req.wait(timeout=30)
        drained = req.wait_drained(timeout=30)
        assert logical.ok and drained.ok and drained.drained
        assert logical.completed_bytes == drained.completed_bytes == len(data)
    seg.close()
    server.shutdown()
