"""Ray's ``FERRY`` transport across a two-node Ray cluster: the head node in one network
namespace, a worker node in another, joined by a veth pair (as the Rust broadcast tests join
theirs, tests/src/netns.rs). A source actor pinned to the worker node returns tensors; a reader
pinned to the head node reads them over Ferry's network plane (the actors run with
``FERRY_SAME_HOST=off``: the two "nodes" share this machine, and the same-host plane would
otherwise copy between them). Bytes are checked by digest.

Skips with the reason where namespaces cannot be made (not root, no ``ip``), or fails under
``FERRY_REQUIRE_NETNS=1``; skips without Ray and torch, or fails under ``FERRY_REQUIRE_RAY=1``.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import pytest

try:
    import ray  # noqa: F401
    import torch
except ImportError as e:  # pragma: no cover - depends on the environment
    if os.environ.get("FERRY_REQUIRE_RAY") == "1":
        raise
    pytest.skip(
        f"Ray and torch are needed for ferry.ray ({e}); set FERRY_REQUIRE_RAY=1 to make this "
        "a failure",
        allow_module_level=True,
    )

WAIT = 120.0


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("FERRY_REQUIRE_NETNS") == "1":
        pytest.fail(f"{reason} (FERRY_REQUIRE_NETNS=1 says namespaces can be made here)")
    pytest.skip(f"{reason} (set FERRY_REQUIRE_NETNS=1 to make this a failure)")


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {out.stderr.strip()}")


def namespace_pids(ns: str) -> list[int]:
    """The processes in network namespace ``ns`` (``ip netns pids``); none once it is gone."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()] if out.returncode == 0 else []


def end_namespace_processes(namespaces: list[str], timeout: float = 30.0) -> list[int]:
    """Kills (SIGKILL, by id) every process in ``namespaces`` (only processes this run started
    live there: Ray's nodes, their workers, the drivers) until none is left or ``timeout`` ran
    out; returns the ids still there. ``ray stop`` is not used: it stops every Ray process on
    the machine, namespaces or not."""
    deadline = time.monotonic() + timeout
    while True:
        left = [pid for ns in namespaces for pid in namespace_pids(ns)]
        if not left or time.monotonic() > deadline:
            return left
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)  # poll: a killed process leaves the namespace asynchronously


def _close_namespaces(made: list[str]) -> None:
    left = end_namespace_processes(made)
    for ns in made:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    if left:
        raise RuntimeError(f"processes {left} outlived SIGKILL in namespaces {made}")


class TwoNamespaces:
    """Namespaces ``a`` and ``b`` joined by one veth pair, addresses from 198.19.0.0/16
    (RFC 2544's benchmarking range; the Rust tests use 198.18.0.0/16)."""

    def __init__(self) -> None:
        pid = os.getpid()
        slot = pid % (1 << 14)
        base = (198 << 24) | (19 << 16) | (slot * 4)
        dotted = lambda n: ".".join(str((n >> s) & 255) for s in (24, 16, 8, 0))  # noqa: E731
        self.a_addr, self.b_addr = dotted(base + 1), dotted(base + 2)
        self.a, self.b = f"ferry-ray-{pid}-a", f"ferry-ray-{pid}-b"
        tag = f"{pid & 0xFFFFF:x}"
        self.made: list[str] = []
        try:
            for ns in (self.a, self.b):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
                _ip("netns", "add", ns)
                self.made.append(ns)
            _ip("link", "add", f"fra{tag}", "type", "veth", "peer", "name", f"frb{tag}")
            _ip("link", "set", f"fra{tag}", "netns", self.a)
            _ip("link", "set", f"frb{tag}", "netns", self.b)
            for ns, link, addr in ((self.a, f"fra{tag}", self.a_addr), (self.b, f"frb{tag}", self.b_addr)):
                _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", link)
                _ip("-n", ns, "link", "set", link, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except Exception:
            self.close()
            raise

    def names(self) -> list[str]:
        return list(self.made)

    def close(self) -> None:
        """Ends every process left in the namespaces, then deletes them."""
        made, self.made = self.made, []
        _close_namespaces(made)


class Fleet:
    """Hosts ``0..hosts-1``, each in a namespace of its own, joined by a bridge in a hub
    namespace, each host's link shaped by TBF in both directions to ``rate`` (tc units) when
    given: the layout of tests/src/fleet.rs (``cargo xtask bench broadcast``'s fleet) and
    ``shared/tools/netns/fleet.sh``, its names and commands the same, for Python. Addresses
    198.19.H.(i+1)/24, H from the process id."""

    def __init__(self, hosts: int, rate: Optional[str] = None) -> None:
        pid = os.getpid()
        self.prefix = f"frf{pid & 0xFFFFF:x}"
        self.net = (pid * 7 + 1) % 250
        self.made: list[str] = []
        self.hosts = hosts
        hub = f"{self.prefix}-hub"
        try:
            for ns in [hub] + [self.name(i) for i in range(hosts)]:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
                _ip("netns", "add", ns)
                self.made.append(ns)
            _ip("-n", hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", hub, "link", "set", "br0", "up")
            for i in range(hosts):
                ns, h, p = self.name(i), f"h{i}", f"p{i}"
                _ip("link", "add", h, "netns", ns, "type", "veth", "peer", "name", p, "netns", hub)
                _ip("-n", hub, "link", "set", p, "master", "br0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", h)
                _ip("-n", ns, "link", "set", h, "up")
                if rate:
                    for space, dev in ((ns, h), (hub, p)):
                        _ip("netns", "exec", space, "tc", "qdisc", "add", "dev", dev, "root",
                            "tbf", "rate", rate, "burst", "256kb", "latency", "50ms")
        except Exception:
            self.close()
            raise

    def name(self, i: int) -> str:
        return f"{self.prefix}-{i}"

    def addr(self, i: int) -> str:
        return f"198.19.{self.net}.{i + 1}"

    def names(self) -> list[str]:
        return list(self.made)

    def tx_bytes(self, i: int) -> int:
        """Bytes host ``i`` has sent on its link."""
        out = subprocess.run(
            ["ip", "netns", "exec", self.name(i), "cat", f"/sys/class/net/h{i}/statistics/tx_bytes"],
            capture_output=True, text=True, check=True,
        )
        return int(out.stdout)

    def close(self) -> None:
        """Ends every process left in the fleet's namespaces, then deletes them."""
        made, self.made = self.made, []
        _close_namespaces(made)


DRIVER = r'''
import hashlib, json, sys, time
import ray, torch
import ferry.ray

ferry.ray.register()
head = sys.argv[1]
ray.init(address=head, log_to_driver=False)
deadline = time.monotonic() + 120
while sum(1 for n in ray.nodes() if n["Alive"]) < 2 and time.monotonic() < deadline:
    time.sleep(0.1)

def tensor(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))

def digest(t):
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()

@ray.remote(enable_tensor_transport=True, resources={"node_b": 0.01})
class Source:
    def where(self):
        return ray.util.get_node_ip_address(), ferry.ray.manager().engine().listen_addr
    @ray.method(tensor_transport="FERRY")
    def make(self, n, seed):
        return tensor(n, seed)

@ray.remote(enable_tensor_transport=True, resources={"node_a": 0.01})
class Reader:
    def where(self):
        return ray.util.get_node_ip_address(), ferry.ray.manager().engine().listen_addr
    def digest(self, t):
        return digest(t)
    def transports(self):
        return ferry.ray.manager().transports()

src, dst = Source.remote(), Reader.remote()
sizes = [(1, 1), (2, (1 << 20) + 3), (3, 16 << 20)]
got = [ray.get(dst.digest.remote(src.make.remote(n, seed))) for seed, n in sizes]
want = [digest(tensor(n, seed)) for seed, n in sizes]
print(json.dumps({
    "nodes": sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]),
    "source": ray.get(src.where.remote()),
    "reader": ray.get(dst.where.remote()),
    "transports": ray.get(dst.transports.remote()),
    "ok": got == want,
}))
'''


@pytest.fixture
def namespaces():
    if shutil.which("ip") is None:
        _skip_or_fail("no `ip` command here")
    try:
        ns = TwoNamespaces()
    except Exception as e:
        _skip_or_fail(f"cannot make network namespaces here: {e}")
    yield ns
    ns.close()


class RayNode:
    """``ray start --block`` in a namespace, in its own process group (ended by killing that
    group: ``ray stop`` would stop every Ray on the machine)."""

    def __init__(self, ns: str, args: list[str], env: dict, temp_dir: str):
        # Ray's CLI through this interpreter: the `ray` script's first line may name another
        # environment (one made elsewhere and moved keeps its scripts' old interpreter path).
        ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, *ray_cli, "start", "--block", "--temp-dir", temp_dir, *args],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_started(self, timeout: float) -> None:
        """Waits for ``ray start`` to say the node runs (or to end)."""
        deadline = time.monotonic() + timeout
        while "Ray runtime started" not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"ray start did not start:\n{self.output()[-3000:]}")
            time.sleep(0.05)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


@pytest.fixture
def short_tmp():
    # Ray's socket paths live under its temp dir and must fit a Unix socket name.
    d = Path(tempfile.mkdtemp(prefix="fr-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_two_node_cluster_moves_tensors_over_the_network_plane(namespaces, short_tmp):
    tmp_path = short_tmp
    ns = namespaces
    env = dict(os.environ)
    env.update(
        {
            "FERRY_SAME_HOST": "off",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            # Ray's token authentication, with a token of this cluster's own for every node
            # and the driver.
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": os.urandom(32).hex(),
        }
    )
    env.pop("FERRY_BIND_ADDRESS", None)  # each engine listens on its node's address
    port = 6379
    head_addr = f"{ns.a_addr}:{port}"
    nodes = []
    try:
        head = RayNode(
            ns.a,
            ["--head", "--node-ip-address", ns.a_addr, "--port", str(port), "--num-cpus", "2",
             "--resources", json.dumps({"node_a": 1}), "--include-dashboard", "false",
             "--disable-usage-stats"],
            env,
            str(tmp_path / "a"),
        )
        nodes.append(head)
        head.wait_started(WAIT)
        worker = RayNode(
            ns.b,
            ["--address", head_addr, "--node-ip-address", ns.b_addr, "--num-cpus", "2",
             "--resources", json.dumps({"node_b": 1})],
            env,
            str(tmp_path / "b"),
        )
        nodes.append(worker)
        worker.wait_started(WAIT)
        script = tmp_path / "driver.py"
        script.write_text(DRIVER)
        run = subprocess.run(
            ["ip", "netns", "exec", ns.a, sys.executable, str(script), head_addr],
            env=env,
            capture_output=True,
            text=True,
            timeout=WAIT * 2,
        )
        assert run.returncode == 0, (
            f"driver failed:\n{run.stdout}\n{run.stderr[-4000:]}\n"
            f"head:\n{head.output()[-2000:]}\nworker:\n{worker.output()[-2000:]}"
        )
        result = json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        for node in reversed(nodes):
            node.stop()
    print("two-node result:", json.dumps(result))
    assert result["nodes"] == sorted([ns.a_addr, ns.b_addr]), result
    assert result["source"][0] == ns.b_addr and result["source"][1].startswith(ns.b_addr + ":")
    assert result["reader"][0] == ns.a_addr and result["reader"][1].startswith(ns.a_addr + ":")
    # The reader reached the source over a network plane (io_uring or TCP), not a copy
    # between processes.
    assert result["transports"], result
    assert set(result["transports"].values()) <= {"uring", "tcp", "rdma"}, result
    assert result["ok"], result
