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
import statistics
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


def nixl_path(site: str) -> str:
    """A folder that links the real NIXL wheel's packages of ``site`` (and nothing else of that
    environment), for the real-NIXL actors' ``PYTHONPATH``."""
    d = tempfile.mkdtemp(prefix="ferry-bench-ray-nixl-")
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
    args = p.parse_args()
    if args.cluster:
        cluster_main(args)
        return
    for k, v in ENV.items():
        if k != "FERRY_AS_NIXL":
            os.environ[k] = v
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(
        _node_ip_address="127.0.0.1",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": ENV},
    )
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
            path = nixl_path(args.nixl_site)
            opts = {"runtime_env": {"env_vars": {**ENV, "FERRY_AS_NIXL": "0"}}}
            real = (
                Source.options(**opts).remote(n, args.parts, path),
                Reader.options(**opts).remote(n, args.parts, path),
            )
            print("real actors' nixl._api:", ray.get(real[0].nixl_module.remote()))
    readers = []
    if any(m.endswith("-many") for m in modes):
        readers = [Reader.remote(n, args.parts) for _ in range(args.readers)]
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
            print(f"round {r + 1} {mode:13s} median {med * 1e3:8.1f} ms  {nbytes / med / 1e9:6.2f} GB/s")
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
    ray.shutdown()
    if real is not None:
        shutil.rmtree(path, ignore_errors=True)


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


def iperf3_gbps(ns, seconds: int = 5) -> float:
    """iperf3 (one TCP stream) from namespace ``a`` to ``b``, Gbit/s received."""
    import subprocess

    server = subprocess.Popen(
        ["ip", "netns", "exec", ns.b, "iperf3", "-s", "-1", "--forceflush", "-B", ns.b_addr],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for line in server.stdout:
            if "Server listening" in line:
                break
        out = subprocess.run(
            ["ip", "netns", "exec", ns.a, "iperf3", "-c", ns.b_addr, "-t", str(seconds), "-J"],
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        server.wait(timeout=30)
    return json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"] / 1e9


def cluster_main(args) -> None:
    """Two Ray nodes in two network namespaces joined by a veth pair (test_ray_cluster.py's):
    a source on the worker node, a reader on the head; 256 MiB (``--mib``) over Ferry's network
    plane, into a target buffer and end to end, against iperf3 between the namespaces; rounds
    alternate the two."""
    import subprocess
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from test_ray_cluster import RayNode, TwoNamespaces

    n = args.mib * (1 << 20) // 4
    nbytes = n * 4
    ns = TwoNamespaces()
    tmp = tempfile.mkdtemp(prefix="fr-")  # short: Ray's socket paths live under it
    env = dict(os.environ)
    env.update(
        {
            "FERRY_SAME_HOST": "off",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": os.urandom(32).hex(),
        }
    )
    env.pop("FERRY_BIND_ADDRESS", None)
    env.pop("FERRY_AS_NIXL", None)
    head_addr = f"{ns.a_addr}:6379"
    nodes = []
    rows: dict[str, list[float]] = {"iperf3": [], "ferry-target": [], "ferry": []}
    try:
        nodes.append(RayNode(ns.a, ["--head", "--node-ip-address", ns.a_addr, "--port", "6379",
                                    "--num-cpus", "2", "--resources", json.dumps({"node_a": 1}),
                                    "--include-dashboard", "false", "--disable-usage-stats"],
                             env, os.path.join(tmp, "a")))
        nodes[0].wait_started(120)
        nodes.append(RayNode(ns.b, ["--address", head_addr, "--node-ip-address", ns.b_addr,
                                    "--num-cpus", "2", "--resources", json.dumps({"node_b": 1})],
                             env, os.path.join(tmp, "b")))
        nodes[1].wait_started(120)
        script = os.path.join(tmp, "driver.py")
        with open(script, "w") as f:
            f.write(CLUSTER_DRIVER)
        for r in range(args.rounds):
            steps = ["iperf3", "ferry"] if r % 2 == 0 else ["ferry", "iperf3"]
            for step in steps:
                if step == "iperf3":
                    g = iperf3_gbps(ns)
                    rows["iperf3"].append(g / 8)
                    print(f"round {r + 1} iperf3        {g / 8:6.2f} GB/s")
                    continue
                out = subprocess.run(
                    ["ip", "netns", "exec", ns.a, sys.executable, script, head_addr, str(n),
                     str(args.transfers)],
                    env=env, capture_output=True, text=True, timeout=600,
                )
                if out.returncode != 0:
                    raise RuntimeError(f"cluster driver failed:\n{out.stdout}\n{out.stderr[-4000:]}")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                for key, name in (("target_s", "ferry-target"), ("e2e_s", "ferry")):
                    g = nbytes / statistics.median(res[key]) / 1e9
                    rows[name].append(g)
                    print(f"round {r + 1} {name:13s} {g:6.2f} GB/s  ({res['transports']})")
    finally:
        for node in reversed(nodes):
            node.stop()
        ns.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(f"| two-node cluster ({args.mib} MiB float32, median of {args.transfers}) | GB/s | x iperf3 |")
    print("|---|---|---|")
    ip = statistics.median(rows["iperf3"])
    for name, v in rows.items():
        v = sorted(v)
        print(f"| {name} | {' / '.join(f'{g:.2f}' for g in v)} | {statistics.median(v) / ip:.2f} |")


if __name__ == "__main__":
    main()
