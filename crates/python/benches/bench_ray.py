"""Ray tensor transports on one host: a float32 tensor (256 MiB by default) returned by one
actor and consumed (summed) by another, as issue 47 measured it.

Paths, in one Ray session, in alternating order from round to round:

- ``store``: Ray's object store (no tensor transport);
- ``nixl``: Ray's own NIXL transport, its ``nixl`` being Ferry's under ``FERRY_AS_NIXL=1``
  (the actors run with it; docs/nixl.md);
- ``ferry``: Ferry's native ``FERRY`` transport (ferry.ray);
- ``ferry-pinned``: the same, the source's tensor kept published by
  ``ferry.ray.register_memory`` (as weights are): no registration per object;
- ``ferry-target``: ``ferry-pinned`` into a preallocated tensor (``set_target_for_ref``), timed
  from the reader's ``ray.get`` to its return (the object already made; no sum);
- ``memcpy``: one ``copy_`` of the same size in the reader (the reference).

``--parts 64`` makes each object a list of 64 tensors (their own storages) instead of one.

Each path: one warm-up, then ``--transfers`` timed ones; the table gives the median per round.
Run with the environment that has Ray and torch::

    target/frameworks-venv/bin/python crates/python/benches/bench_ray.py [--mib 256] [--rounds 2]
"""

import argparse
import json
import os
import statistics
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
    def __init__(self, n: int, parts: int):
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

    def nixl_module(self) -> str:
        import nixl._api

        return nixl._api.__file__


@ray.remote(enable_tensor_transport=True)
class Reader:
    def __init__(self, n: int, parts: int):
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


def one(mode: str, src, dst, n: int, expect: float) -> float:
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
    p.add_argument("--modes", default="store,nixl,ferry,ferry-pinned,ferry-target,memcpy")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args()
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
    expect = float(torch.randn(n, generator=torch.Generator().manual_seed(1)).sum())
    results: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        order = modes if r % 2 == 0 else list(reversed(modes))
        for mode in order:
            one(mode, src, dst, n, expect)  # warm-up
            times = [one(mode, src, dst, n, expect) for _ in range(args.transfers)]
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "medians_s": results}, f, indent=1)
    ray.shutdown()


if __name__ == "__main__":
    main()
