"""Shared fixtures: facility gates in the FERRY_REQUIRE_* convention, peer processes, and
Ferry's fake CUDA driver.

A test whose facility is missing skips with the reason, unless ``FERRY_REQUIRE_PYTHON=1``
says this machine has everything the Python suite needs (``.ci/run`` sets it): then the skip
is a failure. The fake CUDA driver needs ``cc``, gated by ``FERRY_REQUIRE_TOOLS`` as in the Rust
tests.
"""

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
FAKE_CUDA_SOURCE = REPO / "tests" / "fake-cuda" / "fake_cuda.c"

# What pytest_configure found for the GPU tests: {"path": driver} or {"reason": why not}.
_CUDA: dict[str, str] = {}


def pytest_configure(config):
    """Points ``FERRY_LIBCUDA`` at Ferry's fake CUDA driver, compiled here with ``cc``, unless
    the environment already names a driver (a real GPU machine can run the GPU tests on
    ``FERRY_LIBCUDA=libcuda.so.1``).

    Done here, before any test made an engine, for two reasons: each engine loads the driver
    on its first GPU call and reads ``FERRY_LIBCUDA`` then (an engine that loaded none keeps
    that error), and changing the environment while Ferry's threads run would race with their
    reads of it. Other tests never touch CUDA, so the variable changes nothing for them.
    """
    preset = os.environ.get("FERRY_LIBCUDA")
    if preset:
        _CUDA["path"] = preset
        return
    cc = shutil.which("cc")
    if cc is None:
        _CUDA["reason"] = "no C compiler `cc` here to build Ferry's fake CUDA driver"
        return
    out_dir = Path(tempfile.mkdtemp(prefix="ferry-py-fake-cuda-"))
    _CUDA["dir"] = str(out_dir)
    out = out_dir / "libcuda.so.1"
    built = subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-pthread", "-o", str(out), str(FAKE_CUDA_SOURCE)],
        capture_output=True,
        text=True,
    )
    if built.returncode != 0:
        _CUDA["reason"] = f"cc could not build {FAKE_CUDA_SOURCE}: {built.stderr.strip()}"
        return
    os.environ["FERRY_LIBCUDA"] = str(out)
    _CUDA["path"] = str(out)


def pytest_unconfigure(config):
    if "dir" in _CUDA:
        shutil.rmtree(_CUDA["dir"], ignore_errors=True)


class CudaDriver:
    """The driver the GPU tests run against, and the fake's counters when it is the fake."""

    def __init__(self, path: str):
        self.path = path
        lib = ctypes.CDLL(path)  # the handle the engines get too (same path)
        self.fake = hasattr(lib, "ferry_fake_cuda")
        self._lib = lib

    def live_device_allocs(self) -> int:
        """Device allocations not freed yet (the fake only)."""
        f = self._lib.ferry_fake_cuda_live_device_allocs
        f.restype = ctypes.c_long
        return f()


@pytest.fixture(scope="session")
def cuda_driver() -> CudaDriver:
    """The CUDA driver ``FERRY_LIBCUDA`` names for this run (Ferry's fake unless the environment
    named another). Skips without ``cc`` to build the fake, or fails under
    ``FERRY_REQUIRE_TOOLS=1``."""
    if "path" not in _CUDA:
        reason = _CUDA.get("reason", "the fake CUDA driver was not built")
        if os.environ.get("FERRY_REQUIRE_TOOLS") == "1":
            pytest.fail(f"{reason} (FERRY_REQUIRE_TOOLS=1 says this machine has cc)")
        pytest.skip(f"{reason} (set FERRY_REQUIRE_TOOLS=1 to make this a failure)")
    return CudaDriver(_CUDA["path"])


def require(facility_ok: bool, reason: str) -> None:
    """Skips the test with ``reason`` when the facility is missing, or fails under
    ``FERRY_REQUIRE_PYTHON=1``."""
    if facility_ok:
        return
    if os.environ.get("FERRY_REQUIRE_PYTHON") == "1":
        pytest.fail(f"{reason} (FERRY_REQUIRE_PYTHON=1 says it must be here)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def np():
    """NumPy, which most tests move."""
    try:
        import numpy
    except ImportError as e:  # pragma: no cover - depends on the machine
        require(False, f"numpy is not installed: {e}")
    return numpy


@pytest.fixture(scope="session")
def safetensors_numpy():
    """PyPI's ``safetensors`` (its NumPy API), which the broadcast tests write checkpoints with."""
    try:
        import safetensors.numpy
    except ImportError as e:  # pragma: no cover - depends on the machine
        require(False, f"safetensors is not installed: {e}")
    return safetensors.numpy


def _state(task: Path) -> str | None:
    """A thread's state letter from /proc (None once it is gone)."""
    try:
        for line in (task / "status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split()[1]
    except OSError:
        return None
    return None


class PeerProcess:
    """A ``peer.py`` process: its address, commands, and signals to stop or kill it."""

    def __init__(self, n: int):
        self.n = n
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "peer.py"), str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer process exited: {self.proc.wait()}")
        self.addr = json.loads(line)["addr"]

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def client(self, np):
        """A new engine connected to this peer, the peer, and a registration of ``n`` uint32
        zeros: what a test reads ``src`` into and writes ``sink`` from."""
        import ferry

        engine = ferry.Engine()
        peer = engine.connect(self.addr)
        reg = engine.register(np.zeros(self.n, dtype=np.uint32))
        return engine, peer, reg

    def stop(self) -> None:
        """SIGSTOP, and wait until every thread of the peer is stopped (delivery is async)."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if all(_state(t) in ("T", None) for t in Path(f"/proc/{self.proc.pid}/task").iterdir()):
                return
            time.sleep(0.005)
        raise RuntimeError("the peer did not stop within 10 s")

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.kill()


@pytest.fixture
def peer_process(np):
    """A peer in another process serving ``src``/``sink`` of 1 Mi uint32 (4 MiB) each."""
    p = PeerProcess(1 << 20)
    yield p
    p.close()


@pytest.fixture
def loopback():
    """A serving engine with one read+write 64 KiB ``seg``, and a client engine."""
    import ferry

    server = ferry.Engine(listen="127.0.0.1:0")
    buf = bytearray(64 << 10)
    reg = server.register(buf, name="seg", access="read+write")
    ro = server.register(bytearray(4096), name="ro", access="read")
    client = ferry.Engine()
    peer = client.connect(server.listen_addr)
    yield server, client, peer, buf
    reg.close()
    ro.close()
    server.shutdown()


def etcd_binary() -> str | None:
    """The etcd server binary (Debian's ``etcd-server``), or None after skipping with the reason;
    under ``FERRY_REQUIRE_ETCD=1`` (``.ci/run`` sets it) a missing one is a failure."""
    found = shutil.which("etcd")
    if found is None:
        reason = "no etcd binary (Debian: apt-get install etcd-server)"
        if os.environ.get("FERRY_REQUIRE_ETCD") == "1":
            pytest.fail(f"{reason} (FERRY_REQUIRE_ETCD=1 says it must be here)")
        pytest.skip(f"{reason} (set FERRY_REQUIRE_ETCD=1 to make this a failure)")
    return found


@pytest.fixture
def etcd_available() -> str:
    """The etcd server binary, for a test that starts etcd itself (see ``etcd_binary``)."""
    return etcd_binary()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd_server():
    """A real etcd on loopback ports, its data in a temporary directory; yields its address as
    ``etcd://127.0.0.1:PORT`` once it accepts connections, and kills it afterwards."""
    import socket

    binary = etcd_binary()
    client, peer = _free_port(), _free_port()
    url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    with tempfile.TemporaryDirectory(prefix="ferry-py-etcd-") as data, tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [binary, "--data-dir", data, "--name", "ferry-test",
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"ferry-test={peer_url}"],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            deadline = time.monotonic() + 20
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    pytest.fail(f"etcd exited with {proc.returncode}: {log.read()[-2000:]}")
                try:
                    socket.create_connection(("127.0.0.1", client), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        pytest.fail("etcd did not listen within 20 s")
                    time.sleep(0.05)  # polling for the listener, not a fixed wait
            yield f"etcd://127.0.0.1:{client}"
        finally:
            proc.kill()
            proc.wait()
