"""Ray's ``FERRY`` tensor transport (ferry.ray) against the real Ray: two actors on one host,
Ray's node and every Ferry engine on 127.0.0.1.

Needs Ray (2.60) and torch in the environment (``target/frameworks-venv`` has both; docs/ray.md).
Without them the module skips with the reason, or fails under ``FERRY_REQUIRE_RAY=1``.
"""

import hashlib
import os
import signal
import sys
import threading
import time

import pytest

try:
    import ray
    import torch
    from ray.experimental.rdt.tensor_transport_manager import TensorTransportManager
except ImportError as e:  # pragma: no cover - depends on the environment
    if os.environ.get("FERRY_REQUIRE_RAY") == "1":
        raise
    pytest.skip(
        f"Ray and torch are needed for ferry.ray ({e}); set FERRY_REQUIRE_RAY=1 to make this "
        "a failure",
        allow_module_level=True,
    )

import ferry.ray

# Before any class names the transport in @ray.method (Ray checks the name there).
ferry.ray.register()

WAIT = 60.0  # seconds any awaited event may take before the test fails


def _env() -> dict:
    return {
        # Ray turns 127.0.0.1 into the machine's address unless clusters are off
        # (ray._private.services.get_node_ip_address): this keeps Ray on loopback.
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "FERRY_BIND_ADDRESS": "127.0.0.1",
    }


@pytest.fixture(scope="module")
def cluster():
    from ray._private import ray_constants

    for k, v in _env().items():
        os.environ[k] = v  # for Ray's processes
    ray_constants.ENABLE_RAY_CLUSTER = False  # read at import in this one
    ray.init(
        _node_ip_address="127.0.0.1",
        num_cpus=16,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": _env()},
    )
    # Ray's workers cannot import this test module: its actor classes travel by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ferry.ray.register()
    ferry.ray.register()  # idempotent
    assert ray._private.worker.global_worker.node_ip_address == "127.0.0.1"
    yield
    ray.shutdown()


def made(ref):
    """Waits until the source made the object and its metadata reached this owner: only then
    may the ref be passed inside a list (Ray borrows it)."""
    ray.wait([ref], timeout=WAIT)
    rdt = ray._private.worker.global_worker.rdt_manager
    assert rdt.wait_for_tensor_transport_metadata(ref.hex(), WAIT) is not None
    return ref


def wait_gone(pid: int) -> None:
    """Waits until process ``pid`` (of this host) has ended."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} still runs {WAIT}s after it was killed")


def tensor(n: int, seed: int, dtype=None) -> "torch.Tensor":
    t = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return t if dtype is None else t.to(dtype)


def digest(t: "torch.Tensor") -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@ray.remote(enable_tensor_transport=True)
class Source:
    def __init__(self):
        ferry.ray.register()  # again in the actor: harmless
        self.base = tensor(1 << 20, 7)

    def pid(self) -> int:
        return os.getpid()

    def addr(self) -> str:
        return ferry.ray.manager().engine().listen_addr

    @ray.method(tensor_transport="FERRY")
    def make(self, n: int, seed: int):
        return tensor(n, seed)

    @ray.method(tensor_transport="FERRY")
    def mixed(self):
        return {
            "f32": tensor(1000, 1).reshape(10, 100),
            "bf16": tensor(4097, 2, torch.bfloat16),
            "i64": torch.arange(333, dtype=torch.int64),
            "empty": torch.empty(0),
        }

    @ray.method(tensor_transport="FERRY")
    def parts(self, n: int, seed: int, k: int):
        # k tensors of their own storages in one object, one of another dtype.
        return [tensor(n, seed + i, torch.bfloat16 if i == 1 else None) for i in range(k)]

    @ray.method(tensor_transport="FERRY")
    def view(self, start: int, stop: int):
        # Views of one storage: one registration, held by every object that uses it.
        return self.base[start:stop]

    @ray.method(tensor_transport="FERRY")
    def big(self):
        return self.base

    def pin(self, on: bool) -> None:
        if on:
            ferry.ray.register_memory(self.base)
        else:
            ferry.ray.deregister_memory(self.base)

    def registered(self) -> int:
        return ferry.ray.manager().registered_storages()

    def wait_registered(self, n: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        m = ferry.ray.manager()
        while m.registered_storages() != n and time.monotonic() < deadline:
            time.sleep(0.01)
        return m.registered_storages()


@ray.remote(enable_tensor_transport=True)
class Reader:
    def __init__(self):
        ferry.ray.register()
        self.gets: dict = {}
        self.targets: dict = {}

    def digest(self, t) -> str:
        return digest(t)

    def keep(self, t) -> int:
        """Keeps the received tensor ``t`` (its buffer stays in use); returns its address."""
        self.kept = getattr(self, "kept", []) + [t]
        return t.data_ptr()

    def kept_digests(self) -> list:
        return [digest(t) for t in self.kept]

    def keep_one(self, ts, i: int) -> list:
        """Keeps item ``i`` of the received list ``ts``; returns every item's (address, bytes,
        digest)."""
        self.kept = getattr(self, "kept", []) + [ts[i]]
        return [(t.data_ptr(), t.numel() * t.element_size(), digest(t)) for t in ts]

    def spans(self, ts) -> list:
        return [(t.data_ptr(), t.numel() * t.element_size(), digest(t)) for t in ts]

    def drop_kept(self) -> None:
        self.kept = []

    def address(self, t) -> int:
        return t.data_ptr()

    def digests(self, d) -> dict:
        return {k: (digest(v), tuple(v.shape), str(v.dtype)) for k, v in d.items()}

    def get_into(self, refs, shape, key: str = "t", fill: float = -1.0):
        """ray.get of ``refs[0]`` into a preallocated tensor: Ray's target buffers."""
        buf = torch.full(shape, fill)
        self.targets[key] = buf
        ray.experimental.set_target_for_ref(refs[0], [buf])
        out = ray.get(refs[0])
        return out.data_ptr() == buf.data_ptr(), digest(buf)

    def start_get(self, refs, key: str, shape=None, fill: float = -1.0) -> None:
        """Starts ``ray.get(refs[0])`` in a thread (into a target buffer when ``shape``)."""
        if shape is not None:
            buf = torch.full(shape, fill)
            self.targets[key] = buf
            ray.experimental.set_target_for_ref(refs[0], [buf])
        box: dict = {}

        def run():
            try:
                box["value"] = digest(ray.get(refs[0]))
            except BaseException as e:  # reported by join
                box["error"] = (type(e).__name__, str(e))

        th = threading.Thread(target=run, daemon=True)
        self.gets[key] = (th, box)
        th.start()

    def wait_inflight(self, n: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        m = ferry.ray.manager()
        while m.inflight() < n and time.monotonic() < deadline:
            time.sleep(0.005)
        return m.inflight()

    def abort(self, obj_id: str) -> float:
        t0 = time.monotonic()
        ferry.ray.manager().abort_transport(obj_id, ferry.ray.FerryCommunicatorMetadata())
        return time.monotonic() - t0

    def join(self, key: str, timeout: float):
        th, box = self.gets.pop(key)
        th.join(timeout)
        if th.is_alive():
            return ("running",)
        if "error" in box:
            return ("error",) + box["error"]
        return ("ok", box["value"])

    def target_changed(self, key: str, fill: float = -1.0) -> int:
        """How many elements of the target buffer ``key`` differ from its fill."""
        return int((self.targets[key] != fill).sum())

    def inflight(self) -> int:
        return ferry.ray.manager().inflight()


def test_the_contract_is_ferrys():
    m = ferry.ray.FerryTensorTransport()
    assert isinstance(m, TensorTransportManager)
    assert m.tensor_transport_backend() == "FERRY"
    assert m.is_one_sided() and m.can_abort_transport()


def test_register_is_idempotent(cluster):
    from ray.experimental.rdt import util

    ferry.ray.register()
    assert util.transport_manager_info["FERRY"].transport_manager_class is (
        ferry.ray.FerryTensorTransport
    )


def test_actor_to_actor_moves_every_byte(cluster):
    src, dst = Source.remote(), Reader.remote()
    for seed, n in [(1, 1), (2, (1 << 20) + 3), (3, 5 << 20)]:
        assert ray.get(dst.digest.remote(src.make.remote(n, seed)), timeout=WAIT) == digest(
            tensor(n, seed)
        )
    got = ray.get(dst.digests.remote(src.mixed.remote()), timeout=WAIT)
    want = {
        "f32": tensor(1000, 1).reshape(10, 100),
        "bf16": tensor(4097, 2, torch.bfloat16),
        "i64": torch.arange(333, dtype=torch.int64),
        "empty": torch.empty(0),
    }
    assert got == {k: (digest(v), tuple(v.shape), str(v.dtype)) for k, v in want.items()}
    # The driver reads too (ray.get of the actor's object).
    assert digest(ray.get(src.make.remote(77777, 4), timeout=WAIT)) == digest(tensor(77777, 4))
    # The source's engine listens on Ray's node address, loopback here.
    addr = ray.get(src.addr.remote())
    assert addr.startswith("127.0.0.1:")
    assert ferry.ray.manager().transports().get(addr) == "local"


def test_one_object_read_by_several_actors_at_once(cluster):
    src = Source.remote()
    readers = [Reader.remote() for _ in range(3)]
    ref = src.make.remote(1 << 20, 13)
    got = ray.get([r.digest.remote(ref) for r in readers], timeout=WAIT)
    assert got == [digest(tensor(1 << 20, 13))] * 3


def test_the_receive_pool_reuses_a_buffer_only_once_nothing_refers_to_it():
    pool = ferry.ray._RecvPool()
    a = pool.take(4 << 20)
    first = a.ctypes.data
    held = torch.from_numpy(a).view(torch.float32)[10:20]  # a view over part of it
    del a
    b = pool.take(4 << 20)
    assert b.ctypes.data != first, "a buffer a view still refers to was handed out again"
    del held
    assert pool.take(4 << 20).ctypes.data == first, "a free buffer was not reused"
    assert pool.take(1000).nbytes == 1000  # small: not pooled, still the right size
    del b


def test_received_tensors_the_reader_keeps_are_never_overwritten(cluster):
    src, dst = Source.remote(), Reader.remote()
    n = 2 << 20  # 8 MiB: from the receive pool
    kept = [ray.get(dst.keep.remote(src.make.remote(n, seed)), timeout=WAIT) for seed in (21, 22)]
    assert kept[0] != kept[1], "a kept tensor's buffer was handed to the next object"
    assert ray.get(dst.kept_digests.remote(), timeout=WAIT) == [
        digest(tensor(n, 21)),
        digest(tensor(n, 22)),
    ]
    # A tensor the reader dropped gives its buffer back: the next object of its size reuses it.
    a = ray.get(dst.address.remote(src.make.remote(n, 23)), timeout=WAIT)
    assert ray.get(dst.address.remote(src.make.remote(n, 24)), timeout=WAIT) == a
    assert ray.get(dst.digest.remote(src.make.remote(n, 25)), timeout=WAIT) == digest(
        tensor(n, 25)
    )
    assert ray.get(dst.kept_digests.remote(), timeout=WAIT) == [
        digest(tensor(n, 21)),
        digest(tensor(n, 22)),
    ]


def test_an_object_of_many_tensors_arrives_in_one_pooled_buffer_never_reused_while_kept(cluster):
    src, dst = Source.remote(), Reader.remote()
    n, k = (1 << 20) + 3, 4  # 4 MiB and odd sizes: offsets in the buffer are aligned up
    want = lambda seed: [digest(tensor(n, seed + i, torch.bfloat16 if i == 1 else None))  # noqa: E731
                         for i in range(k)]
    first = ray.get(dst.keep_one.remote(src.parts.remote(n, 30, k), 2), timeout=WAIT)
    assert [d for _, _, d in first] == want(30)
    # One buffer: the object's tensors lie one after another, none overlapping.
    spans = sorted((a, a + b) for a, b, _ in first)
    assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:])), spans
    assert spans[-1][1] - spans[0][0] < sum(b for _, b, _ in first) + 64 * k, spans
    # Item 2 is kept: the next object of the same shapes must not land in that buffer.
    second = ray.get(dst.spans.remote(src.parts.remote(n, 40, k)), timeout=WAIT)
    assert [d for _, _, d in second] == want(40)
    lo, hi = spans[0][0], spans[-1][1]
    assert all(a + b <= lo or a >= hi for a, b, _ in second), "a kept tensor's buffer was reused"
    assert ray.get(dst.kept_digests.remote(), timeout=WAIT) == [want(30)[2]]
    # Once nothing refers to it, the buffer is handed out again.
    ray.get(dst.drop_kept.remote())
    third = ray.get(dst.spans.remote(src.parts.remote(n, 50, k)), timeout=WAIT)
    assert [d for _, _, d in third] == want(50)
    assert third[0][0] in (first[0][0], second[0][0]), "a free buffer was not reused"


def test_driver_put_is_read_by_an_actor(cluster):
    dst = Reader.remote()
    t = tensor(123457, 9)
    ref = ray.put(t, _tensor_transport="ferry")
    assert ray.get(dst.digest.remote(ref), timeout=WAIT) == digest(t)


def test_target_buffers_are_read_into_in_place(cluster):
    src, dst = Source.remote(), Reader.remote()
    n = 3 << 20
    same, got = ray.get(dst.get_into.remote([made(src.make.remote(n, 11))], (n,)), timeout=WAIT)
    assert same, "the tensor Ray returned is not the target buffer"
    assert got == digest(tensor(n, 11))


def test_garbage_collect_releases_the_registration_with_the_last_object(cluster):
    src, dst = Source.remote(), Reader.remote()
    assert ray.get(src.registered.remote()) == 0
    base = tensor(1 << 20, 7)
    a = src.view.remote(0, 1000)
    b = src.view.remote(500, 5000)  # overlaps a: the same storage
    assert ray.get(dst.digest.remote(a), timeout=WAIT) == digest(base[0:1000])
    assert ray.get(dst.digest.remote(b), timeout=WAIT) == digest(base[500:5000])
    assert ray.get(src.registered.remote()) == 1
    del a
    # b still holds the storage: it stays registered, and readable.
    assert ray.get(dst.digest.remote(b), timeout=WAIT) == digest(base[500:5000])
    assert ray.get(src.registered.remote()) == 1
    del b
    assert ray.get(src.wait_registered.remote(0, WAIT)) == 0
    # A new object of the same storage registers it again.
    c = src.view.remote(10, 20)
    assert ray.get(dst.digest.remote(c), timeout=WAIT) == digest(base[10:20])
    assert ray.get(src.registered.remote()) == 1


def test_register_memory_keeps_a_storage_published_past_its_objects(cluster):
    src, dst = Source.remote(), Reader.remote()
    ray.get(src.pin.remote(True))
    assert ray.get(src.registered.remote()) == 1
    a = src.view.remote(0, 100)
    assert ray.get(dst.digest.remote(a), timeout=WAIT) == digest(tensor(1 << 20, 7)[0:100])
    del a
    b = src.view.remote(100, 200)
    assert ray.get(dst.digest.remote(b), timeout=WAIT) == digest(tensor(1 << 20, 7)[100:200])
    del b
    ray.get(src.pin.remote(False))
    assert ray.get(src.wait_registered.remote(0, WAIT)) == 0


def test_abort_returns_once_nothing_can_move(cluster):
    src, dst = Source.remote(), Reader.remote()
    base = tensor(1 << 20, 7)
    # A first read connects the reader to the source and lists the storage, which stays
    # published while `first` lives.
    first = src.big.remote()
    assert ray.get(dst.digest.remote(first), timeout=WAIT) == digest(base)
    ref = made(src.big.remote())  # the same storage: no new listing needed
    pid = ray.get(src.pid.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        ray.get(dst.start_get.remote([ref], "a", (1 << 20,)), timeout=WAIT)
        assert ray.get(dst.wait_inflight.remote(1, WAIT)) == 1
        took = ray.get(dst.abort.remote(ref.hex()), timeout=WAIT)
        assert took < 5.0
        result = ray.get(dst.join.remote("a", WAIT))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert result[0] == "error" and result[1] == "RayDirectTransportError", result
    assert ref.hex() in result[2] and "cancelled" in result[2], result[2]
    assert ray.get(dst.inflight.remote()) == 0
    # The source runs again; the aborted read moved no byte, and none moves now.
    assert ray.get(src.pid.remote(), timeout=WAIT) == pid
    assert ray.get(dst.digest.remote(src.make.remote(1000, 5)), timeout=WAIT) == digest(
        tensor(1000, 5)
    )
    assert ray.get(dst.target_changed.remote("a")) == 0
    # The next transfer of the same object works.
    assert ray.get(dst.digest.remote(src.big.remote()), timeout=WAIT) == digest(base)


def test_a_killed_source_is_rays_error_and_the_next_transfer_works(cluster):
    src, dst = Source.remote(), Reader.remote()
    base = tensor(1 << 20, 7)
    first = src.big.remote()  # keeps the storage published (and listed to the reader)
    assert ray.get(dst.digest.remote(first), timeout=WAIT) == digest(base)
    src_actor_id = src._actor_id.hex()

    # Killed during the read: the reader's read fails with Ray's error, naming the object,
    # the source actor and Ferry's reason.
    ref = made(src.big.remote())
    pid = ray.get(src.pid.remote())
    os.kill(pid, signal.SIGSTOP)
    ray.get(dst.start_get.remote([ref], "k"), timeout=WAIT)
    assert ray.get(dst.wait_inflight.remote(1, WAIT)) == 1
    os.kill(pid, signal.SIGKILL)
    result = ray.get(dst.join.remote("k", WAIT))
    assert result[0] == "error" and result[1] == "RayDirectTransportError", result
    assert ref.hex() in result[2] and src_actor_id in result[2], result[2]
    # ...the receiving actor, and Ferry's reason after "failed:".
    assert dst._actor_id.hex() in result[2], result[2]
    assert "failed: " in result[2] and "may have died" in result[2], result[2]

    # Killed before the read: the same error (the connect is refused).
    src2 = Source.remote()
    ref2 = made(src2.make.remote(1000, 3))
    pid2 = ray.get(src2.pid.remote())
    ray.kill(src2)
    wait_gone(pid2)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(src2.pid.remote(), timeout=WAIT)
    with pytest.raises(ray.exceptions.RayDirectTransportError) as e:
        ray.get(dst.digest.remote(ref2), timeout=WAIT)
    assert ref2.hex() in str(e.value) and "may have died" in str(e.value), str(e.value)

    # The reader's next transfer, from a live source, works.
    src3 = Source.remote()
    assert ray.get(dst.digest.remote(src3.make.remote(4096, 8)), timeout=WAIT) == digest(
        tensor(4096, 8)
    )
    assert ray.get(dst.inflight.remote()) == 0


def test_a_key_file_reaches_the_actors_and_a_stranger_reads_nothing(cluster, tmp_path):
    key_file = tmp_path / "ray.key"
    key_file.write_text("ray-fleet 000102030405060708090a0b0c0d0e0f\n")
    key_file.chmod(0o600)
    keyed = {"runtime_env": {"env_vars": {**_env(), "FERRY_AUTH_KEY_FILE": str(key_file)}}}
    src, dst = Source.options(**keyed).remote(), Reader.options(**keyed).remote()
    ref = src.make.remote(10_000, 21)
    assert ray.get(dst.digest.remote(ref), timeout=WAIT) == digest(tensor(10_000, 21))
    # The source's engine serves key holders only: a keyless engine is refused...
    addr = ray.get(src.addr.remote())
    with pytest.raises(ferry.HandshakeRefused):
        ferry.Engine().connect(addr)
    # ...and so is a keyless actor's read, with Ray's error naming the object.
    stranger = Reader.remote()
    ref2 = made(src.make.remote(10_000, 22))
    result = ray.get(stranger.start_get.remote([ref2], "s"), timeout=WAIT)
    result = ray.get(stranger.join.remote("s", WAIT))
    assert result[0] == "error" and result[1] == "RayDirectTransportError", result
    assert ref2.hex() in result[2] and "authentication" in result[2].lower(), result[2]
    # The key holder still reads it.
    assert ray.get(dst.digest.remote(ref2), timeout=WAIT) == digest(tensor(10_000, 22))


@ray.remote(enable_tensor_transport=True)
class NixlSource:
    """A source on Ray's own NIXL transport (run with FERRY_AS_NIXL=1: its nixl is Ferry's)."""

    def __init__(self):
        self.base = tensor(1 << 20, 7)

    def pid(self) -> int:
        return os.getpid()

    def nixl_module(self) -> str:
        import nixl._api

        return nixl._api.__file__

    @ray.method(tensor_transport="NIXL")
    def make(self, n: int, seed: int):
        return tensor(n, seed)

    @ray.method(tensor_transport="NIXL")
    def big(self):
        return self.base


def test_rays_nixl_transport_runs_on_ferry_as_nixl(cluster):
    """Ray's NIXL transport, unchanged, with FERRY_AS_NIXL=1 in the actors: bytes, agent reuse
    after garbage collection, a source killed during a read (Ray's error text) and the next
    transfer."""
    opts = {"runtime_env": {"env_vars": {**_env(), "FERRY_AS_NIXL": "1"}}}
    src, dst = NixlSource.options(**opts).remote(), Reader.options(**opts).remote()
    assert "/ferry/nixl/" in ray.get(src.nixl_module.remote(), timeout=WAIT)
    # Each object is collected before the next: Ray deregisters its memory, bumps the agent's
    # metadata version, and the reader reloads the agent.
    for i in range(3):
        n = 4096 + 1000 * i
        assert ray.get(dst.digest.remote(src.make.remote(n, 40 + i)), timeout=WAIT) == digest(
            tensor(n, 40 + i)
        )
    ref = made(src.big.remote())
    pid = ray.get(src.pid.remote())
    os.kill(pid, signal.SIGSTOP)
    ray.get(dst.start_get.remote([ref], "n"), timeout=WAIT)
    os.kill(pid, signal.SIGKILL)
    result = ray.get(dst.join.remote("n", WAIT))
    assert result[0] == "error" and result[1] == "RayDirectTransportError", result
    assert "The source actor may have died" in result[2], result[2]
    src2 = NixlSource.options(**opts).remote()
    assert ray.get(dst.digest.remote(src2.make.remote(5000, 50)), timeout=WAIT) == digest(
        tensor(5000, 50)
    )


def array(n: int, seed: int, dtype="float32"):
    import numpy as np

    return np.random.default_rng(seed).standard_normal(n).astype(dtype)


def array_digest(a) -> str:
    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


@ray.remote(enable_tensor_transport=True)
class NumpySource:
    def __init__(self):
        ferry.ray.register()
        self.base = array(1 << 20, 7)

    @ray.method(tensor_transport="FERRY_NUMPY")
    def make(self, n: int, seed: int, dtype: str = "float32"):
        return array(n, seed, dtype)

    @ray.method(tensor_transport="FERRY_NUMPY")
    def several(self):
        import numpy as np

        return {
            "f64": array(1000, 1, "float64").reshape(10, 100),
            "i16": np.arange(4097, dtype=np.int16),
            "scalar": np.array(3.5, dtype=np.float32),
            "empty": np.empty((0, 4), dtype=np.float32),
        }

    @ray.method(tensor_transport="FERRY_NUMPY")
    def view(self, start: int, stop: int):
        # Views of one array: one registration (its root's memory), shared by every object.
        return self.base[start:stop].reshape(-1, 1)

    def registered(self) -> int:
        return ferry.ray.manager().registered_storages()

    def wait_registered(self, n: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        m = ferry.ray.manager()
        while m.registered_storages() != n and time.monotonic() < deadline:
            time.sleep(0.01)
        return m.registered_storages()


@ray.remote(enable_tensor_transport=True)
class NumpyReader:
    def __init__(self):
        ferry.ray.register()

    def described(self, a) -> tuple:
        """What arrived: its type, shape, dtype and digest (a dict's values, by key)."""
        import numpy as np

        def one(x):
            return (type(x).__name__, tuple(x.shape), str(x.dtype), array_digest(x))

        assert isinstance(a, (dict, np.ndarray)), type(a)
        return {k: one(v) for k, v in a.items()} if isinstance(a, dict) else one(a)

    def plane(self) -> dict:
        return ferry.ray.manager().transports()


def test_numpy_arrays_move_as_numpy_arrays(cluster):
    """FERRY_NUMPY: numpy.ndarray objects (Ray's data type for that name), read into numpy
    arrays of the same shapes and dtypes, on the same-host plane."""
    import numpy as np

    src, dst = NumpySource.remote(), NumpyReader.remote()
    for n, seed, dtype in [(1, 1, "float32"), ((1 << 20) + 3, 2, "float64"), (5 << 20, 3, "int8")]:
        a = array(n, seed, dtype)
        got = ray.get(dst.described.remote(src.make.remote(n, seed, dtype)), timeout=WAIT)
        assert got == ("ndarray", a.shape, str(a.dtype), array_digest(a))
    want = {
        "f64": array(1000, 1, "float64").reshape(10, 100),
        "i16": np.arange(4097, dtype=np.int16),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.empty((0, 4), dtype=np.float32),
    }
    got = ray.get(dst.described.remote(src.several.remote()), timeout=WAIT)
    assert got == {
        k: ("ndarray", v.shape, str(v.dtype), array_digest(v)) for k, v in want.items()
    }
    assert set(ray.get(dst.plane.remote()).values()) == {"local"}
    # The driver puts one, an actor reads it; the driver reads an actor's.
    a = array(54321, 9, "float16")
    ref = ray.put(a, _tensor_transport="ferry_numpy")
    assert ray.get(dst.described.remote(ref), timeout=WAIT)[3] == array_digest(a)
    got = ray.get(src.make.remote(777, 4), timeout=WAIT)
    assert isinstance(got, np.ndarray) and array_digest(got) == array_digest(array(777, 4))


def test_numpy_views_share_one_registration_until_the_last_object_goes(cluster):
    src, dst = NumpySource.remote(), NumpyReader.remote()
    base = array(1 << 20, 7)
    a = src.view.remote(0, 1000)
    b = src.view.remote(500, 5000)  # overlaps a: the same root array
    assert ray.get(dst.described.remote(a), timeout=WAIT)[3] == array_digest(base[0:1000])
    assert ray.get(dst.described.remote(b), timeout=WAIT)[3] == array_digest(base[500:5000])
    assert ray.get(src.registered.remote()) == 1
    del a
    assert ray.get(dst.described.remote(b), timeout=WAIT)[3] == array_digest(base[500:5000])
    assert ray.get(src.registered.remote()) == 1
    del b
    assert ray.get(src.wait_registered.remote(0, WAIT)) == 0


@ray.remote(enable_tensor_transport=True)
class RelaySource:
    def __init__(self):
        ferry.ray.register()

    @ray.method(tensor_transport="FERRY_RELAY")
    def make(self, n: int, seed: int):
        return tensor(n, seed)

    def registered(self) -> int:
        return ferry.ray.manager().registered_storages()


@ray.remote(enable_tensor_transport=True)
class RelayReader:
    def __init__(self):
        ferry.ray.register()

    def digest(self, t) -> str:
        return digest(t)

    def relay_summary(self, obj_id: str):
        return ferry.ray.manager().relay_summary(obj_id, WAIT)


def test_one_object_read_by_four_actors_leaves_the_source_about_once(cluster):
    """FERRY_RELAY: four actors read one 32 MiB object at once; they relay verified chunks to
    one another, so the source sends about one copy of it (Ferry's broadcast counters: the
    bytes each reader took from the source), not four."""
    n = 8 << 20  # float32: 32 MiB
    src = RelaySource.remote()
    readers = [RelayReader.remote() for _ in range(4)]
    ray.get([r.digest.remote(made(src.make.remote(1, 1))) for r in readers], timeout=WAIT)
    ref = made(src.make.remote(n, 17))
    got = ray.get([r.digest.remote(ref) for r in readers], timeout=WAIT)
    assert got == [digest(tensor(n, 17))] * 4
    sums = ray.get([r.relay_summary.remote(ref.hex()) for r in readers], timeout=WAIT)
    assert all(s is not None for s in sums), sums
    size = n * 4
    assert all(s["bytes"] == size for s in sums), sums
    from_source = sum(s["from_source"] for s in sums)
    # About one copy (a chunk two readers asked for at the same moment may leave twice).
    assert from_source <= 1.5 * size, (from_source / size, sums)
    assert sum(s["from_relays"] for s in sums) >= 2.5 * size, sums
    del ref
