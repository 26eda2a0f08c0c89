"""The Ray bench (crates/python/benches/bench_ray.py) stops every Ray process it started, on
every exit path: its own time limit on one host (``--limit``: Ray's local session), and a
SIGTERM while it runs its Ray cluster in network namespaces (``--cluster``: the nodes, their
workers and the driver in those namespaces, and the namespaces themselves).

Skips without Ray and torch (fails under ``FERRY_REQUIRE_RAY=1``); the cluster case also skips
where namespaces cannot be made (fails under ``FERRY_REQUIRE_NETNS=1``).
"""

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

try:
    import ray  # noqa: F401
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    if os.environ.get("FERRY_REQUIRE_RAY") == "1":
        raise
    pytest.skip(
        f"Ray and torch are needed for the Ray bench ({e}); set FERRY_REQUIRE_RAY=1 to make "
        "this a failure",
        allow_module_level=True,
    )

BENCHES = Path(__file__).resolve().parent.parent / "benches"
sys.path.insert(0, str(BENCHES))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ray import _started, ray_processes  # noqa: E402
from test_ray_cluster import _close_namespaces, _skip_or_fail, namespace_pids  # noqa: E402

WAIT = 240.0


class Bench:
    """bench_ray.py in a process of its own, its output read line by line in a thread."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(BENCHES / "bench_ray.py"), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: "queue.Queue[str | None]" = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_line(self, prefix: str, timeout: float = WAIT) -> str:
        """The first line starting with ``prefix``; fails if the bench ends or ``timeout``
        passes first."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                self.kill()
                pytest.fail(f"no line {prefix!r} from the bench:\n" + "\n".join(self.seen[-40:]))
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def finish(self, timeout: float = WAIT) -> tuple[int, str]:
        """Waits for the bench to end; its exit status and the rest of its output."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail("the bench did not stop:\n" + "\n".join(self.seen[-40:]))
        while (line := self.lines.get(timeout=WAIT)) is not None:
            self.seen.append(line)
        return rc, "\n".join(self.seen)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def _alive(procs: dict[int, str], timeout: float = 30.0) -> list[int]:
    """Those of ``procs`` (id -> start time) still running once ``timeout`` passed (returns as
    soon as none is)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [pid for pid, t in procs.items() if _started(pid) == t]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)  # poll: processes end asynchronously


def test_the_bench_stopped_by_its_time_limit_leaves_no_ray_process():
    # Rounds enough to run for hours: only the limit stops it.
    bench = Bench("--mib", "1", "--transfers", "1", "--rounds", "1000000", "--modes", "ferry",
                  "--limit", "60")
    line = bench.wait_line("bench_ray: Ray session in ")
    temp = line[len("bench_ray: Ray session in "):].split(",")[0]
    procs = ray_processes(temp)
    assert len(procs) >= 3, (line, procs)  # gcs, raylet, the actors at least
    rc, out = bench.finish()
    assert rc != 0, out
    assert "stopped by SIGALRM" in out, out
    assert "every process of this run's Ray session ended" in out, out
    left = _alive(procs)
    assert not left, f"Ray processes {left} of the bench's session outlived it:\n{out[-3000:]}"
    assert not Path(temp).exists(), temp


def test_the_bench_terminated_mid_cluster_leaves_no_process_nor_namespace():
    if shutil.which("ip") is None or shutil.which("iperf3") is None:
        _skip_or_fail("the cluster bench needs `ip` and `iperf3`")
    if os.geteuid() != 0:
        _skip_or_fail("network namespaces need root")
    bench = Bench("--cluster", "--mib", "1", "--transfers", "1000000", "--rounds", "1")
    line = bench.wait_line("bench_ray: Ray nodes in namespaces ")
    names = line[len("bench_ray: Ray nodes in namespaces "):].split(", ")
    try:
        procs = {pid: _started(pid) for ns in names for pid in namespace_pids(ns)}
        assert len(procs) >= 4, (names, procs)  # two nodes' raylets and ray start, at least
        bench.proc.send_signal(signal.SIGTERM)
        rc, out = bench.finish()
        assert rc != 0, out
        assert "no process left in this run's namespaces" in out, out
        left = _alive(procs)
        assert not left, f"processes {left} of the bench's namespaces outlived it:\n{out[-3000:]}"
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not [ns for ns in names if ns in listed.split()], listed
    finally:  # what a failing bench left, so that the next run starts clean
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        _close_namespaces([ns for ns in names if ns in listed.split()])
