"""Ray tensor transports on one host: a float32 tensor (256 MiB by default) returned by one
actor and consumed (summed) by another, as issue 47 measured it.

Paths, in one Ray session, in alternating order from round to round:

- ``store``: Ray's object store (no tensor transport);
- ``nixl-real``: Ray's own NIXL transport on the real NIXL wheel (UCX), in a second pair of
  actors whose ``PYTHONPATH`` holds that wheel (``--nixl-site``: the ``site-packages`` of an
  environment with ``nixl`` and ``nixl-cu13`` 1.5.1; only those packages are linked in);
- ``nixl``: Ray's own NIXL transport, its ``nixl`` being Ferry's under ``FERRY_AS_NIXL=1``
  (the actors run with it; docs/nixl.md);
- ``ferry``: Ferry's native ``FERRY`` transport (ferry.ray);
- ``ferry-pinned``: the same, the source's tensor kept published by
  ``ferry.ray.register_memory`` (as weights are): no registration per object;
- ``ferry-target``: ``ferry-pinned`` into a preallocated tensor (``set_target_for_ref``), timed
  from the reader's ``ray.get`` to its return (the object already made; no sum);
- ``memcpy``: one ``copy_`` of the same size in the reader (the reference);
- ``ferry-many`` / ``relay-many``: one object read by ``--readers`` actors at once (each sums
  it), on ``FERRY`` (each reader reads the source) and on ``FERRY_RELAY`` (readers relay to one
  another); timed from the first ``.remote`` to the last sum; the row gives the object's size
  over that time, and ``relay-many`` the source's egress in copies (Ferry's counters).

``--parts 64`` makes each object a list of 64 tensors (their own storages) instead of one.

Each path: one warm-up, then ``--transfers`` timed ones; the table gives the median per round.
Run with the environment that has Ray and torch::

    target/frameworks-venv/bin/python crates/python/benches/bench_ray.py [--mib 256] [--rounds 2]
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

import ray
import torch

import ferry.ray

ferry.ray.register()

ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray's node on 127.0.0.1
    "FERRY_BIND_ADDRESS": "127.0.0.1",
    "FERRY_AS_NIXL": "1",  # Ray's `import nixl` is Ferry's in the actors
}


@ray.remote(enable_tensor_transport=True)
class Source:
    def __init__(self, n: int, parts: int, path: str = ""):
        if path:  # the real nixl wheel's packages (Ray's env_vars do not reach sys.path)
            import sys

            sys.path.insert(0, path)
        ferry.ray.register()
        t = torch.randn(n, generator=torch.Generator().manual_seed(1))
        # One tensor, or `parts` tensors of their own storage each (a list in one object).
        self.t = t if parts == 1 else [p.clone() for p in t.chunk(parts)]
        self.pinned = t.clone() if parts == 1 else [p.clone() for p in self.t]
        for p in self.pinned if parts > 1 else [self.pinned]:
            ferry.ray.register_memory(p)  # published for the life of the actor

    def plain(self):
        return self.t

    @ray.method(tensor_transport="FERRY")
    def ferry(self):
        return self.t

    @ray.method(tensor_transport="FERRY")
    def ferry_pinned(self):
        return self.pinned

    @ray.method(tensor_transport="NIXL")
    def nixl(self):
        return self.t

    @ray.method(tensor_transport="FERRY_RELAY")
    def relay(self):
        return self.t

    def nixl_module(self) -> str:
        import nixl._api

        return nixl._api.__file__


@ray.remote(enable_tensor_transport=True)
class Reader:
    def __init__(self, n: int, parts: int, path: str = ""):
        if path:
            import sys

            sys.path.insert(0, path)
        ferry.ray.register()
        self.buf = torch.empty(n)
        self.buf.fill_(0)
        self.bufs = [self.buf] if parts == 1 else list(self.buf.chunk(parts))

    def consume(self, t) -> float:
        return float(t.sum()) if isinstance(t, torch.Tensor) else float(sum(p.sum() for p in t))

    def get_into(self, refs) -> float:
        ray.experimental.set_target_for_ref(refs[0], self.bufs)
        t0 = time.perf_counter()
        out = ray.get(refs[0])
        dt = time.perf_counter() - t0
        out = [out] if isinstance(out, torch.Tensor) else out
        assert [o.data_ptr() for o in out] == [b.data_ptr() for b in self.bufs]
        return dt

    def egress(self, obj_id: str) -> float:
        s = ferry.ray.manager().relay_summary(obj_id, 120)
        return s["from_source"] if s else float("nan")

    def memcpy(self, n: int) -> float:
        src = torch.randn(n)
        t0 = time.perf_counter()
        self.buf.copy_(src)
        return time.perf_counter() - t0


def exit_on_signals(limit_s: float) -> None:
    """SIGTERM, SIGINT, SIGHUP and the run's own time limit (SIGALRM after ``limit_s``) become
    ``SystemExit``, so every exit path runs the ``finally`` that stops this run's Ray processes
    (Python's default would end the process at once, leaving them)."""

    def stop(signum, _frame):
        raise SystemExit(f"bench_ray: stopped by {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM):
        signal.signal(sig, stop)
    if limit_s > 0:
        signal.setitimer(signal.ITIMER_REAL, limit_s)


def _started(pid: int) -> str:
    """A process's start time (``/proc/PID/stat``'s 22nd field): with the id, names one
    process (an id can be reused once it ended). Empty when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def ray_processes(temp_dir: str) -> dict[int, str]:
    """The processes of the Ray session under ``temp_dir`` (this run's own: Ray's node processes
    name it on their command line) and their descendants (the workers, whose titles do not),
    as id -> start time."""
    parent, mine = {}, set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{name}/stat") as f:
                parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if temp_dir.encode() in cmd:
            mine.add(int(name))
    grew = True
    while grew:
        more = {pid for pid, pp in parent.items() if pp in mine and pid not in mine}
        mine |= more
        grew = bool(more)
    mine.discard(os.getpid())
    return {pid: t for pid in mine if (t := _started(pid))}


def end_processes(procs: dict[int, str], timeout: float = 30.0) -> list[int]:
    """Waits up to ``timeout`` for ``procs`` (id -> start time) to end, killing (SIGKILL, by id)
    those still there after the first third of it; returns the ones that outlived it."""
    deadline = time.monotonic() + timeout
    killed = False
    while True:
        left = [pid for pid, t in procs.items() if _started(pid) == t]
        if not left or time.monotonic() > deadline:
            return left
        if not killed and time.monotonic() > deadline - timeout * 2 / 3:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            killed = True
        time.sleep(0.05)  # poll: they end asynchronously


class OwnRay:
    """This run's local Ray session (``ray.init`` in a temporary directory of its own) and
    everything it started: ``close`` shuts Ray down, then ends whatever of it is left, and
    raises if anything outlived that (the check)."""

    def __init__(self, **init) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="fbr-")  # short: Ray's socket paths live under it
        self.seen: dict[int, str] = {}
        try:
            ray.init(_temp_dir=self.temp_dir, **init)
        except BaseException:  # a signal or the time limit while Ray starts
            self.close()
            raise
        self.note()

    def note(self) -> dict[int, str]:
        """Records the session's processes as they are now (a worker orphaned later by a dying
        raylet is still known)."""
        self.seen.update(ray_processes(self.temp_dir))
        return self.seen

    def close(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        self.note()
        try:
            ray.shutdown()
        finally:
            left = end_processes({**self.seen, **ray_processes(self.temp_dir)})
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        if left:
            raise RuntimeError(f"bench_ray: Ray processes {left} outlived ray.shutdown and SIGKILL")
        print(f"bench_ray: every process of this run's Ray session ended ({len(self.seen)})",
              file=sys.stderr)


def made(ref):
    ray.wait([ref])
    rdt = ray._private.worker.global_worker.rdt_manager
    assert rdt.wait_for_tensor_transport_metadata(ref.hex(), 120) is not None
    return ref


def many(mode: str, src, readers, n: int, expect: float, egress: list) -> float:
    method = src.ferry if mode == "ferry-many" else src.relay
    t0 = time.perf_counter()
    ref = method.remote()
    got = ray.get([r.consume.remote(ref) for r in readers])
    dt = time.perf_counter() - t0
    assert all(abs(g - expect) <= 1e-5 * n + 1.0 for g in got), (mode, got, expect)
    if mode == "relay-many":
        egress.append(sum(ray.get([r.egress.remote(ref.hex()) for r in readers])) / (4 * n))
    return dt


def nixl_path(site: str, under: str) -> str:
    """A folder under ``under`` that links the real NIXL wheel's packages of ``site`` (and
    nothing else of that environment), for the real-NIXL actors' ``PYTHONPATH``."""
    d = tempfile.mkdtemp(prefix="nixl-", dir=under)
    site = os.path.abspath(site)
    for name in os.listdir(site):
        if name.startswith(("nixl", "nixl_cu")) or name == "nixl_meta_utils.py":
            os.symlink(os.path.join(site, name), os.path.join(d, name))
    return d


def one(mode: str, src, dst, n: int, expect: float) -> float:
    if mode == "nixl-real":
        mode = "nixl"
    if mode == "ferry-target":
        return ray.get(dst.get_into.remote([made(src.ferry_pinned.remote())]))
    if mode == "memcpy":
        return ray.get(dst.memcpy.remote(n))
    method = {
        "store": src.plain,
        "nixl": src.nixl,
        "ferry": src.ferry,
        "ferry-pinned": src.ferry_pinned,
    }[mode]
    t0 = time.perf_counter()
    got = ray.get(dst.consume.remote(method.remote()))
    dt = time.perf_counter() - t0
    assert abs(got - expect) <= 1e-5 * n + 1.0, (mode, got, expect)
    return dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--parts", type=int, default=1, help="tensors per object (each 1/parts)")
    p.add_argument("--transfers", type=int, default=7)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--modes",
        default="store,nixl-real,nixl,ferry,ferry-pinned,ferry-target,memcpy,ferry-many,relay-many",
    )
    p.add_argument("--readers", type=int, default=4, help="readers of the *-many rows")
    p.add_argument("--nixl-site", help="site-packages holding the real nixl wheel (nixl-real)")
    p.add_argument("--json", help="write the results here too")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="the two-node cluster in two network namespaces against iperf3 (root, ip, iperf3)",
    )
    p.add_argument(
        "--limit",
        type=float,
        default=3600.0,
        help="seconds the whole run may take; past it the run stops, and its Ray processes too",
    )
    p.add_argument(
        "--fleet",
        action="store_true",
        help="one object read by --readers actors on as many nodes, each in a namespace behind "
        "a link shaped to --rate, against one reader alone (root, ip, tc)",
    )
    p.add_argument("--rate", default="200mbit", help="--fleet: each link's rate (tc units)")
    p.add_argument("--fleet-modes", default="one,relay-many",
                   help="--fleet: of one, one-relay, relay-many, ferry-many")
    p.add_argument("--object-store-mib", type=int, default=100,
                   help="--fleet: each Ray node's object store (Ray's minimum is 75 MiB)")
    args = p.parse_args()
    exit_on_signals(args.limit)
    if args.cluster:
        cluster_main(args)
        return
    if args.fleet:
        fleet_main(args)
        return
    for k, v in ENV.items():
        if k != "FERRY_AS_NIXL":
            os.environ[k] = v
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    own = OwnRay(
        _node_ip_address="127.0.0.1",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": ENV},
    )
    try:
        run_one_host(args, own)
    finally:
        own.close()


def run_one_host(args, own: OwnRay) -> None:
    """The one-host rows (the module's docs)."""
    n = args.mib * (1 << 20) // 4
    nbytes = n * 4
    src, dst = Source.remote(n, args.parts), Reader.remote(n, args.parts)
    modes = args.modes.split(",")
    if "nixl" in modes:
        print("actors' nixl._api:", ray.get(src.nixl_module.remote()))
    real = None
    if "nixl-real" in modes:
        if not args.nixl_site:
            print("nixl-real: skipped (no --nixl-site: an environment with the real nixl wheel)")
            modes.remove("nixl-real")
        else:
            path = nixl_path(args.nixl_site, own.temp_dir)
            opts = {"runtime_env": {"env_vars": {**ENV, "FERRY_AS_NIXL": "0"}}}
            real = (
                Source.options(**opts).remote(n, args.parts, path),
                Reader.options(**opts).remote(n, args.parts, path),
            )
            print("real actors' nixl._api:", ray.get(real[0].nixl_module.remote()))
    readers = []
    if any(m.endswith("-many") for m in modes):
        readers = [Reader.remote(n, args.parts) for _ in range(args.readers)]
    ray.get([a.__ray_ready__.remote() for a in [src, dst, *readers, *(real or ())]])
    print(f"bench_ray: Ray session in {own.temp_dir}, {len(own.note())} processes", flush=True)
    egress: list[float] = []
    expect = float(torch.randn(n, generator=torch.Generator().manual_seed(1)).sum())
    results: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        order = modes if r % 2 == 0 else list(reversed(modes))
        for mode in order:
            if mode.endswith("-many"):
                run = lambda: many(mode, src, readers, n, expect, egress)  # noqa: E731
            elif mode == "nixl-real":
                run = lambda: one(mode, real[0], real[1], n, expect)  # noqa: E731
            else:
                run = lambda: one(mode, src, dst, n, expect)  # noqa: E731
            run()  # warm-up
            times = [run() for _ in range(args.transfers)]
            med = statistics.median(times)
            results[mode].append(med)
            print(f"round {r + 1} {mode:13s} median {med * 1e3:8.1f} ms  {nbytes / med / 1e9:6.2f} GB/s",
                  flush=True)
    print()
    what = f"{args.mib} MiB float32" + (f" in {args.parts} tensors" if args.parts > 1 else "")
    print(f"| path ({what}, median of {args.transfers}, {args.rounds} rounds) | GB/s |")
    print("|---|---|")
    for mode in modes:
        gbs = sorted(nbytes / t / 1e9 for t in results[mode])
        print(f"| {mode} | {' / '.join(f'{g:.2f}' for g in gbs)} |")
    if egress:
        e = sorted(egress)
        print(f"relay-many: the source sent {e[0]:.2f}-{e[-1]:.2f} copies of each object "
              f"to {args.readers} readers (median {statistics.median(e):.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "medians_s": results, "relay_egress": egress}, f, indent=1)


CLUSTER_DRIVER = r"""
import json, statistics, sys, time
import ray, torch
import ferry.ray

ferry.ray.register()
head, n, transfers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ray.init(address=head, log_to_driver=False)
deadline = time.monotonic() + 120
while sum(1 for x in ray.nodes() if x["Alive"]) < 2 and time.monotonic() < deadline:
    time.sleep(0.1)

@ray.remote(enable_tensor_transport=True, resources={"node_b": 0.01})
class Source:
    def __init__(self, n):
        ferry.ray.register()
        self.t = torch.randn(n, generator=torch.Generator().manual_seed(1))
        ferry.ray.register_memory(self.t)
    @ray.method(tensor_transport="FERRY")
    def get(self):
        return self.t

@ray.remote(enable_tensor_transport=True, resources={"node_a": 0.01})
class Reader:
    def __init__(self, n):
        ferry.ray.register()
        self.buf = torch.zeros(n)
    def get_into(self, refs):
        ray.experimental.set_target_for_ref(refs[0], [self.buf])
        t0 = time.perf_counter()
        ray.get(refs[0])
        return time.perf_counter() - t0
    def consume(self, t):
        return float(t.sum())
    def transports(self):
        return ferry.ray.manager().transports()

def made(ref):
    ray.wait([ref])
    assert ray._private.worker.global_worker.rdt_manager.wait_for_tensor_transport_metadata(ref.hex(), 120) is not None
    return ref

src, dst = Source.remote(n), Reader.remote(n)
target, e2e = [], []
for i in range(transfers + 1):
    dt = ray.get(dst.get_into.remote([made(src.get.remote())]))
    t0 = time.perf_counter()
    ray.get(dst.consume.remote(src.get.remote()))
    if i:
        target.append(dt)
        e2e.append(time.perf_counter() - t0)
print(json.dumps({"target_s": target, "e2e_s": e2e, "transports": ray.get(dst.transports.remote())}))
"""


def iperf3_gbps(ns: str, addr: str, client_ns: str, seconds: int = 5) -> float:
    """iperf3 (one TCP stream) from namespace ``client_ns`` to ``addr`` in ``ns``, Gbit/s
    received."""
    import subprocess

    server = subprocess.Popen(
        ["ip", "netns", "exec", ns, "iperf3", "-s", "-1", "--forceflush", "-B", addr],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for line in server.stdout:
            if "Server listening" in line:
                break
        out = subprocess.run(
            ["ip", "netns", "exec", client_ns, "iperf3", "-c", addr, "-t", str(seconds), "-J"],
            capture_output=True,
            text=True,
            check=True,
        )
        server.wait(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"] / 1e9


def _tests_module():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import test_ray_cluster

    return test_ray_cluster


class NsCluster:
    """Ray nodes started by this run in network namespaces of its own (``net``: the tests'
    ``TwoNamespaces`` or ``Fleet``), each ``ray start --block`` in its own process group.
    ``close`` (every exit path) kills the nodes' groups, then every process still in the
    namespaces (their workers, a driver), deletes the namespaces and raises if a process
    outlived that (the check). Not ``ray stop --force``: it would stop every Ray on the machine."""

    def __init__(self, net) -> None:
        self.net = net
        self.nodes: list = []
        self.tmp = tempfile.mkdtemp(prefix="fr-")  # short: Ray's socket paths live under it
        self.env = dict(os.environ)
        self.env.update(
            {
                "FERRY_SAME_HOST": "off",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
                "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN": os.urandom(32).hex(),
            }
        )
        self.env.pop("FERRY_BIND_ADDRESS", None)  # each engine listens on its node's address
        self.env.pop("FERRY_AS_NIXL", None)

    def start(self, ns: str, args: list[str], wait: bool = True) -> None:
        """``ray start`` in ``ns``; waits for it to run unless ``wait`` is false (then
        ``wait_started``)."""
        node = _tests_module().RayNode(ns, args, self.env, os.path.join(self.tmp, str(len(self.nodes))))
        self.nodes.append(node)
        if wait:
            node.wait_started(120)

    def wait_started(self) -> None:
        for node in self.nodes:
            node.wait_started(180)

    def driver(self, ns: str, text: str, args: list[str], timeout: float = 600,
               all_lines: bool = False):
        """Runs the driver script ``text`` in ``ns``; its last line of output, as JSON (every
        line, as text, with ``all_lines``)."""
        import subprocess

        script = os.path.join(self.tmp, "driver.py")
        with open(script, "w") as f:
            f.write(text)
        out = subprocess.run(  # killed if this run stops meanwhile (run's own handling)
            ["ip", "netns", "exec", ns, sys.executable, script, *args],
            env=self.env, capture_output=True, text=True, timeout=timeout,
        )
        if out.returncode != 0:
            raise RuntimeError(f"cluster driver failed:\n{out.stdout}\n{out.stderr[-4000:]}")
        lines = out.stdout.strip().splitlines()
        return lines if all_lines else json.loads(lines[-1])

    def close(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        names = self.net.names()
        try:
            for node in reversed(self.nodes):
                node.stop()
        finally:
            try:
                self.net.close()  # raises if a process outlived SIGKILL
            finally:
                shutil.rmtree(self.tmp, ignore_errors=True)
        import subprocess

        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        still = [ns for ns in names if ns in listed.split()]
        if still:
            raise RuntimeError(f"bench_ray: namespaces {still} outlived the run")
        print(f"bench_ray: no process left in this run's namespaces, and they are gone ({len(names)})",
              file=sys.stderr)


def cluster_main(args) -> None:
    """Two Ray nodes in two network namespaces joined by a veth pair (test_ray_cluster.py's):
    a source on the worker node, a reader on the head; 256 MiB (``--mib``) over Ferry's network
    plane, into a target buffer and end to end, against iperf3 between the namespaces; rounds
    alternate the two."""
    n = args.mib * (1 << 20) // 4
    nbytes = n * 4
    ns = _tests_module().TwoNamespaces()
    cluster = NsCluster(ns)
    head_addr = f"{ns.a_addr}:6379"
    rows: dict[str, list[float]] = {"iperf3": [], "ferry-target": [], "ferry": []}
    try:
        cluster.start(ns.a, ["--head", "--node-ip-address", ns.a_addr, "--port", "6379",
                             "--num-cpus", "2", "--resources", json.dumps({"node_a": 1}),
                             "--include-dashboard", "false", "--disable-usage-stats"])
        cluster.start(ns.b, ["--address", head_addr, "--node-ip-address", ns.b_addr,
                             "--num-cpus", "2", "--resources", json.dumps({"node_b": 1})])
        print(f"bench_ray: Ray nodes in namespaces {', '.join(ns.names())}", flush=True)
        for r in range(args.rounds):
            steps = ["iperf3", "ferry"] if r % 2 == 0 else ["ferry", "iperf3"]
            for step in steps:
                if step == "iperf3":
                    g = iperf3_gbps(ns.b, ns.b_addr, ns.a)
                    rows["iperf3"].append(g / 8)
                    print(f"round {r + 1} iperf3        {g / 8:6.2f} GB/s", flush=True)
                    continue
                res = cluster.driver(ns.a, CLUSTER_DRIVER, [head_addr, str(n), str(args.transfers)])
                for key, name in (("target_s", "ferry-target"), ("e2e_s", "ferry")):
                    g = nbytes / statistics.median(res[key]) / 1e9
                    rows[name].append(g)
                    print(f"round {r + 1} {name:13s} {g:6.2f} GB/s  ({res['transports']})", flush=True)
    finally:
        cluster.close()
    print()
    print(f"| two-node cluster ({args.mib} MiB float32, median of {args.transfers}) | GB/s | x iperf3 |")
    print("|---|---|---|")
    ip = statistics.median(rows["iperf3"])
    for name, v in rows.items():
        v = sorted(v)
        print(f"| {name} | {' / '.join(f'{g:.2f}' for g in v)} | {statistics.median(v) / ip:.2f} |")


FLEET_DRIVER = r"""
import json, sys, time
import ray, torch
import ferry.ray

ferry.ray.register()
head, n, transfers, readers, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
modes = sys.argv[6].split(",")
ray.init(address=head, log_to_driver=False)
deadline = time.monotonic() + 180
while sum(1 for x in ray.nodes() if x["Alive"]) < readers + 1:
    assert time.monotonic() < deadline, "the worker nodes did not join"
    time.sleep(0.1)

@ray.remote(enable_tensor_transport=True, num_cpus=0)
class Source:
    def __init__(self, n):
        ferry.ray.register()
        self.t = torch.randn(n, generator=torch.Generator().manual_seed(1))
        ferry.ray.register_memory(self.t)
    @ray.method(tensor_transport="FERRY")
    def plain(self):
        return self.t
    @ray.method(tensor_transport="FERRY_RELAY")
    def relay(self):
        return self.t
    def where(self):
        return ray.util.get_node_ip_address()

@ray.remote(enable_tensor_transport=True, num_cpus=0)
class Reader:
    def __init__(self):
        ferry.ray.register()
    def consume(self, t):
        return float(t.sum())
    def from_source(self, obj_id):
        s = ferry.ray.manager().relay_summary(obj_id, 120)
        return s["from_source"] if s else float("nan")
    def where(self):
        return ray.util.get_node_ip_address(), ferry.ray.manager().transports()

src = Source.options(resources={"host0": 0.01}).remote(n)
rs = [Reader.options(resources={f"host{i}": 0.01}).remote() for i in range(1, readers + 1)]
expect = float(torch.randn(n, generator=torch.Generator().manual_seed(1)).sum())
where = {"source": ray.get(src.where.remote()), "readers": [ray.get(r.where.remote())[0] for r in rs]}
print(json.dumps({"where": where}), flush=True)

def once(mode):
    method = src.relay if "relay" in mode else src.plain
    who = rs if mode.endswith("many") else rs[:1]
    t0 = time.perf_counter()
    ref = method.remote()
    got = ray.get([r.consume.remote(ref) for r in who])
    dt = time.perf_counter() - t0
    assert all(abs(g - expect) <= 1e-5 * n + 1.0 for g in got), (mode, got, expect)
    copies = None
    if "relay" in mode:
        copies = sum(ray.get([r.from_source.remote(ref.hex()) for r in who])) / (4 * n)
    del ref
    return dt, copies

out = {m: [] for m in modes}
copies = {m: [] for m in modes}
for r in range(rounds):
    for mode in (modes if r % 2 == 0 else modes[::-1]):
        once(mode)  # warm-up: connections, the readers' receive pools
        for _ in range(transfers):
            dt, c = once(mode)
            out[mode].append(dt)
            if c is not None:
                copies[mode].append(c)
        print(json.dumps({"round": r + 1, "mode": mode, "s": out[mode][-transfers:],
                          "copies": copies[mode][-transfers:]}), flush=True)
print(json.dumps({"s": out, "copies": copies,
                  "transports": ray.get(rs[0].where.remote())[1]}), flush=True)
"""


def fleet_main(args) -> None:
    """One object read by ``--readers`` actors on as many worker nodes, each node (and the head,
    where the source is) in a network namespace of its own behind a link shaped to ``--rate``
    (TBF both ways; tests' ``Fleet``, the layout of ``cargo xtask bench broadcast``), against
    ideal: one reader alone behind the same link (``one``, ``FERRY``). Modes (``--fleet-modes``):
    ``one``, ``one-relay`` (one reader on ``FERRY_RELAY``), ``relay-many`` (every reader, one
    object, ``FERRY_RELAY``), ``ferry-many`` (every reader, ``FERRY``: each reads the source)."""
    hosts = args.readers + 1
    net = _tests_module().Fleet(hosts, args.rate)
    cluster = NsCluster(net)
    n = args.mib * (1 << 20) // 4
    nbytes = n * 4
    head_addr = f"{net.addr(0)}:6379"
    small = ["--num-cpus", "1", "--object-store-memory", str(args.object_store_mib << 20)]
    modes = args.fleet_modes.split(",")
    try:
        cluster.start(net.name(0), ["--head", "--node-ip-address", net.addr(0), "--port", "6379",
                                    "--resources", json.dumps({"host0": 1}), *small,
                                    "--include-dashboard", "false", "--disable-usage-stats"])
        for i in range(1, hosts):
            cluster.start(net.name(i), ["--address", head_addr, "--node-ip-address", net.addr(i),
                                        "--resources", json.dumps({f"host{i}": 1}), *small],
                          wait=False)
        cluster.wait_started()
        print(f"bench_ray: Ray nodes in namespaces {', '.join(net.names())}", flush=True)
        lines = cluster.driver(
            net.name(0), FLEET_DRIVER,
            [head_addr, str(n), str(args.transfers), str(args.readers), str(args.rounds), ",".join(modes)],
            timeout=args.limit, all_lines=True,
        )
    finally:
        cluster.close()
    for line in lines[:-1]:
        print(line)
    res = json.loads(lines[-1])
    ideal = statistics.median(res["s"]["one"]) if res["s"].get("one") else None
    print()
    print(f"| {args.mib} MiB, {args.readers} readers on {args.readers} nodes behind {args.rate} "
          f"(median of {args.transfers} x {args.rounds} rounds) | s per round | MB/s | x ideal | source sent (copies) |")
    print("|---|---|---|---|---|")
    for mode in modes:
        s = res["s"][mode]
        per = [statistics.median(s[i:i + args.transfers]) for i in range(0, len(s), args.transfers)]
        med = statistics.median(s)
        x = f"{ideal / med:.2f}" if ideal else "-"
        c = res["copies"].get(mode) or []
        cs = f"{min(c):.2f}-{max(c):.2f} (median {statistics.median(c):.2f})" if c else ""
        print(f"| {mode} | {' / '.join(f'{p:.2f}' for p in per)} | {nbytes / med / 1e6:.1f} | {x} | {cs} |")
    print(f"readers' planes: {res['transports']}")


if __name__ == "__main__":
    main()
