"""NIXL's Prometheus exporter on Ferry (``ferry.nixl._telemetry``): NIXL's series names and
labels beside Ferry's own on one endpoint, NIXL's variables, no second HTTP server when Ferry's
metrics endpoint is on, a real Prometheus computing a rate over ``agent_tx_bytes_total`` while
transfers run; and ``query_xfer_backend`` as NIXL picks the backend. docs/nixl.md is the
contract."""

import gc
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request

import pytest

import ferry
from ferry import _ferry
from ferry.nixl import nixl_agent, nixl_agent_config, nixlInvalidParamError, nixlNotFoundError

HOST = socket.gethostname()


@pytest.fixture(autouse=True)
def loopback(monkeypatch):
    monkeypatch.setenv("FERRY_BIND_ADDRESS", "127.0.0.1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def exporter(monkeypatch):
    """NIXL's variables for the Prometheus exporter on a free loopback port; the port."""
    port = free_port()
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "y")
    monkeypatch.setenv("NIXL_TELEMETRY_EXPORTER", "prometheus")
    monkeypatch.setenv("NIXL_TELEMETRY_PROMETHEUS_PORT", str(port))
    monkeypatch.setenv("NIXL_TELEMETRY_PROMETHEUS_LOCAL", "y")
    gc.collect()  # engines of earlier tests, and their endpoints, gone
    assert _ferry.metrics_endpoints() == [], "an endpoint left over from another test"
    return port


def scrape(addr: str) -> str:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        return r.read().decode()


def series(text: str, name: str, agent: str) -> float:
    """The value of ``name`` for ``agent`` (NIXL's labels: hostname, agent_name)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and f'agent_name="{agent}"' in line:
            assert f'hostname="{HOST}"' in line, line
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} for {agent} in\n{text}")


def two_agents(np, size=4096):
    a = nixl_agent("a-" + os.urandom(4).hex())
    b = nixl_agent("b-" + os.urandom(4).hex())
    abuf, bbuf = np.zeros(size, dtype=np.uint8), np.zeros(size, dtype=np.uint8)
    a.register_memory([(abuf.ctypes.data, size, 0, "")], "DRAM")
    b.register_memory([(bbuf.ctypes.data, size, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    return a, b, abuf, bbuf


def move(a, b, abuf, bbuf, op: str, n: int):
    h = a.initialize_xfer(op, a.get_xfer_descs([(abuf.ctypes.data, n, 0)], "DRAM"),
                          a.get_xfer_descs([(bbuf.ctypes.data, n, 0)], "DRAM"), b.name)
    state = a.transfer(h)
    while state == "PROC":
        state = a.check_xfer_state(h)
    assert state == "DONE"
    for _ in range(3):  # seen done again: counted once
        assert a.check_xfer_state(h) == "DONE"
    return h


def test_nixl_series_are_served_under_nixls_names_beside_ferrys(np, exporter):
    a, b, abuf, bbuf = two_agents(np)
    # One endpoint for the process: the first agent's engine opened it, the second shares it.
    assert _ferry.metrics_endpoints() == [f"127.0.0.1:{exporter}"]
    assert a._engine.metrics_addr == f"127.0.0.1:{exporter}" and b._engine.metrics_addr is None
    move(a, b, abuf, bbuf, "WRITE", 1000)
    move(a, b, abuf, bbuf, "WRITE", 300)
    move(a, b, abuf, bbuf, "READ", 64)
    a.deregister_memory(a.get_reg_descs([(abuf.ctypes.data, 4096, 0, "")], "DRAM"))
    text = scrape(f"127.0.0.1:{exporter}")
    for name, want in [
        ("agent_tx_bytes_total", 1300), ("agent_tx_last_bytes", 300),
        ("agent_rx_bytes_total", 64), ("agent_rx_last_bytes", 64),
        ("agent_tx_requests_num_total", 2), ("agent_rx_requests_num_total", 1),
        ("agent_memory_registered_total", 4096), ("agent_memory_registered_last_bytes", 4096),
        ("agent_memory_deregistered_total", 4096), ("agent_xfer_time_us_count", 3),
        ("agent_xfer_post_time_us_count", 3), ("agent_telemetry_events_dropped_total", 0),
    ]:
        assert series(text, name, a.name) == want, name
    assert series(text, "agent_xfer_time_total", a.name) >= series(text, "agent_xfer_time", a.name) > 0
    assert series(text, "agent_xfer_time_us_bucket", a.name) >= 0
    assert re.search(r'agent_xfer_time_us_bucket\{[^}]*le="\+Inf"\} 3', text), text
    # The second agent's series on the same endpoint; Ferry's own series there too.
    assert series(text, "agent_memory_registered_total", b.name) == 4096
    assert series(text, "agent_tx_bytes_total", b.name) == 0
    assert "# TYPE agent_tx_bytes_total counter" in text and "# TYPE agent_xfer_time gauge" in text
    assert re.search(r"^ferry_registrations \d+", text, re.M), text
    # An agent gone takes its series with it.
    name = b.name
    del b
    gc.collect()
    assert f'agent_name="{name}"' not in scrape(f"127.0.0.1:{exporter}")


def test_the_transfer_calls_errors_are_counted_by_status(np, exporter):
    a, b, abuf, bbuf = two_agents(np)
    with pytest.raises(nixlNotFoundError):
        a.prep_xfer_dlist("nobody", [(abuf.ctypes.data, 8, 0)], "DRAM")
    local = a.prep_xfer_dlist("", [(abuf.ctypes.data, 8, 0)], "DRAM")
    remote = a.prep_xfer_dlist(b.name, [(bbuf.ctypes.data, 8, 0)], "DRAM")
    for _ in range(2):
        with pytest.raises(nixlInvalidParamError):
            a.make_prepped_xfer("WRITE", local, [0], remote, [5])
    a.remove_remote_agent(b.name)
    h = a.make_prepped_xfer("WRITE", local, [0], remote, [0])
    assert a.transfer(h) == "ERR"  # its remote agent is gone
    text = scrape(f"127.0.0.1:{exporter}")
    statuses = dict(re.findall(
        rf'agent_errors_total{{[^}}]*agent_name="{a.name}",status="(\w+)"}} (\d+)', text))
    assert len(statuses) == 12, text
    assert statuses.pop("not_found") == "1" and statuses.pop("invalid_param") == "2"
    assert statuses.pop("backend") == "1" and set(statuses.values()) == {"0"}, statuses


def test_ferrys_metrics_endpoint_serves_them_and_no_second_server_opens(np, exporter):
    mine = ferry.Engine(metrics="127.0.0.1:0")
    a, b, abuf, bbuf = two_agents(np)
    assert _ferry.metrics_endpoints() == [mine.metrics_addr]
    assert a._engine.metrics_addr is None and b._engine.metrics_addr is None
    with socket.socket() as s:  # NIXL's port stays free
        s.bind(("127.0.0.1", exporter))
    move(a, b, abuf, bbuf, "WRITE", 128)
    assert series(scrape(mine.metrics_addr), "agent_tx_bytes_total", a.name) == 128


def test_without_the_exporter_nothing_is_served(np, monkeypatch):
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "y")
    monkeypatch.delenv("NIXL_TELEMETRY_EXPORTER", raising=False)
    a, b, abuf, bbuf = two_agents(np)
    assert a._tm is None and _ferry.metrics_endpoints() == []
    move(a, b, abuf, bbuf, "WRITE", 8)
    assert a.get_xfer_telemetry(move(a, b, abuf, bbuf, "WRITE", 8)).totalBytes == 8
    # Telemetry off: the exporter variable alone exports nothing, as in NIXL.
    monkeypatch.setenv("NIXL_TELEMETRY_EXPORTER", "prometheus")
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "n")
    assert nixl_agent("quiet")._tm is None and _ferry.metrics_endpoints() == []


def test_nixls_variables_are_checked_as_nixl_checks_them(np, exporter, monkeypatch, caplog):
    a = nixl_agent("dup")
    with pytest.raises(RuntimeError, match="dup"):
        nixl_agent("dup")  # a name has one exporter at a time, as in NIXL
    del a
    for var, value, cls in [("NIXL_TELEMETRY_PROMETHEUS_PORT", "http", RuntimeError),
                            ("NIXL_TELEMETRY_PROMETHEUS_PORT", "70000", RuntimeError),
                            ("NIXL_TELEMETRY_PROMETHEUS_LOCAL", "maybe", RuntimeError),
                            ("NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US", "10,5", ValueError),
                            ("NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US", "0,5", ValueError)]:
        with monkeypatch.context() as m:
            m.setenv(var, value)
            with pytest.raises(cls, match=var):
                nixl_agent("bad-" + var)
    monkeypatch.setenv("NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US", "7,70000")
    a, b, abuf, bbuf = two_agents(np)
    move(a, b, abuf, bbuf, "WRITE", 8)
    text = scrape(f"127.0.0.1:{exporter}")
    les = re.findall(rf'agent_xfer_time_us_bucket\{{[^}}]*agent_name="{a.name}"[^}}]*le="([^"]+)"', text)
    assert [float(x) for x in les] == [7, 70000, float("inf")], les
    # Another exporter name: a warning, per-transfer telemetry kept, nothing served.
    monkeypatch.setenv("NIXL_TELEMETRY_EXPORTER", "buffer")
    with caplog.at_level(logging.WARNING, logger="ferry.nixl"):
        assert nixl_agent("buffered")._tm is None
    assert "prometheus exporter only" in caplog.text


def test_a_port_held_elsewhere_is_a_warning_and_the_agent_works(np, exporter, caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", exporter))
        s.listen()
        with caplog.at_level(logging.WARNING, logger="ferry.nixl"):
            a, b, abuf, bbuf = two_agents(np)
        assert "could not be bound" in caplog.text
        assert _ferry.metrics_endpoints() == []
        move(a, b, abuf, bbuf, "READ", 16)
        assert a._tm.describe()["rx_bytes"] == 16


def test_query_xfer_backend_names_the_backend_nixl_picks(np):
    a = nixl_agent("pick-" + os.urandom(4).hex(), nixl_agent_config(backends=["POSIX", "UCX"]))
    b = nixl_agent("pick-b-" + os.urandom(4).hex())
    abuf, bbuf = np.zeros(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    a.register_memory([(abuf.ctypes.data, 64, 0, "")], "DRAM")
    b.register_memory([(bbuf.ctypes.data, 64, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    src = a.get_xfer_descs([(abuf.ctypes.data, 64, 0)], "DRAM")
    dst = a.get_xfer_descs([(bbuf.ctypes.data, 64, 0)], "DRAM")
    # POSIX serves files: the first backend that moves memory is picked.
    assert a.query_xfer_backend(a.initialize_xfer("WRITE", src, dst, b.name)) == "UCX"
    a.create_backend("LIBFABRIC")
    h = a.initialize_xfer("WRITE", src, dst, b.name, backends=["LIBFABRIC"])
    assert a.query_xfer_backend(h) == "LIBFABRIC"
    local = a.prep_xfer_dlist("", src)
    remote = a.prep_xfer_dlist(b.name, dst)
    h2 = a.make_prepped_xfer("READ", local, [0], remote, [0], backends=["LIBFABRIC"])
    assert a.query_xfer_backend(h2) == "LIBFABRIC"
    # No backend that moves memory: nixlNotFoundError, as NIXL's createXferReq.
    files = nixl_agent("files-" + os.urandom(4).hex(), nixl_agent_config(backends=["POSIX"]))
    files.register_memory([(abuf.ctypes.data, 64, 0, "")], "DRAM")
    files.add_remote_agent(b.get_agent_metadata())
    with pytest.raises(nixlNotFoundError, match="no specified or potential backend"):
        files.initialize_xfer("WRITE", src, dst, b.name)


def _prometheus() -> str | None:
    return shutil.which("prometheus") or (
        "/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus") else None)


def test_a_real_prometheus_scrapes_nixls_series_while_transfers_run(np, exporter):
    """The operations test (crates/cli/tests/prometheus.rs) for NIXL's names: a Prometheus
    server scrapes the agent's endpoint every second while WRITEs run, and its rate over
    ``agent_tx_bytes_total`` comes out above zero."""
    binary = _prometheus()
    if binary is None:
        if os.environ.get("FERRY_REQUIRE_PROMETHEUS") == "1":
            pytest.fail("no prometheus binary (FERRY_REQUIRE_PROMETHEUS=1 says it must be here)")
        pytest.skip("no prometheus binary (Debian: apt-get install prometheus; "
                    "FERRY_REQUIRE_PROMETHEUS=1 makes this a failure)")
    a, b, abuf, bbuf = two_agents(np, size=1 << 20)
    stop = threading.Event()

    def writes():
        while not stop.is_set():
            move(a, b, abuf, bbuf, "WRITE", 1 << 20)

    mover = threading.Thread(target=writes, daemon=True)
    mover.start()
    web = free_port()
    with tempfile.TemporaryDirectory() as d:
        config = os.path.join(d, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                    "scrape_configs:\n  - job_name: nixl\n    static_configs:\n"
                    f"      - targets: ['127.0.0.1:{exporter}']\n")
        prom = subprocess.Popen([binary, f"--config.file={config}",
                                 f"--storage.tsdb.path={os.path.join(d, 'data')}",
                                 f"--web.listen-address=127.0.0.1:{web}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            query = f'rate(agent_tx_bytes_total{{agent_name="{a.name}"}}[10s])'
            url = f"http://127.0.0.1:{web}/api/v1/query?query={urllib.parse.quote(query)}"
            deadline, last, rate = time.monotonic() + 120, "(no answer yet)", 0.0
            while rate <= 0:
                assert time.monotonic() < deadline, f"no positive {query} in 120 s: {last}"
                try:
                    with urllib.request.urlopen(url, timeout=5) as r:
                        last = r.read().decode()
                    result = json.loads(last)["data"]["result"]
                    rate = float(result[0]["value"][1]) if result else 0.0
                except OSError as e:  # Prometheus still starting
                    last = str(e)
                # Prometheus answers anew only at its next evaluation: ask again shortly.
                stop.wait(0.25)
            print(f"prometheus: {query} = {rate:.0f} bytes/s")
        finally:
            stop.set()
            prom.terminate()
            prom.wait(timeout=30)
            mover.join(timeout=30)
