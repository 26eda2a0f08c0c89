"""GPU memory from Python: ``Engine.alloc_gpu`` and ``Engine.register_gpu`` against Ferry's fake
CUDA driver (``FERRY_LIBCUDA``, set by conftest before any engine exists), moved over TCP
loopback to a peer's host memory and to a peer's GPU memory and back; the CUDA Array Interface
both ways; the errors; and ``Unavailable`` without a driver (in a child process whose
``FERRY_LIBCUDA`` names no file)."""

import gc
import os
import random
import subprocess
import sys
import textwrap
import weakref

import pytest

import ferry

# Larger than one staging buffer (4 MiB), so transfers run several chunks through the pipeline,
# and not a multiple of it.
N = (9 << 20) + 7


def data(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


class CudaArray:
    """A hand-made exporter of the CUDA Array Interface (what PyTorch, CuPy and Numba give)."""

    def __init__(self, interface: dict, device=None):
        self.__cuda_array_interface__ = interface
        if device is not None:
            self.device = device


class TorchLikeDevice:
    def __init__(self, index):
        self.index = index


def interface(ptr: int, shape=(64,), typestr="|u1", readonly=False, **extra) -> dict:
    d = {"shape": shape, "typestr": typestr, "data": (ptr, readonly), "version": 3}
    d.update(extra)
    return d


@pytest.fixture
def gpu_pair(cuda_driver):
    """A serving engine and a client engine on the TCP data plane, connected."""
    server = ferry.Engine(listen="127.0.0.1:0", data_plane="tcp")
    client = ferry.Engine(data_plane="tcp")
    yield server, client
    server.shutdown()


def settle(engine, alive) -> None:
    """Lets queued decrefs run (an I/O thread may have dropped the last reference) until
    ``alive()`` is None or 100 rounds passed."""
    for _ in range(100):
        gc.collect()
        engine.describe()  # any call into the module runs PyO3's queued decrefs
        if alive() is None:
            return


def test_alloc_gpu_copy_round_trip_and_interface(cuda_driver):
    engine = ferry.Engine()
    reg = engine.alloc_gpu(0, 1000, name="g")
    assert (reg.name, len(reg), reg.device, reg.access, reg.readonly, reg.closed) == (
        "g", 1000, 0, "local", False, False
    )
    assert reg.route == "off" and "staged" in reg.why
    assert "GPU 0" in repr(reg)
    if cuda_driver.fake:
        assert reg.ptr & (1 << 62), "the fake's device pointers are tagged"
    assert reg.__cuda_array_interface__ == {
        "shape": (1000,),
        "typestr": "|u1",
        "data": (reg.ptr, False),
        "version": 3,
        "strides": None,
        "stream": None,
    }
    payload = data(1000, 1)
    reg.copy_from(payload)
    assert reg.to_bytes() == payload
    reg.copy_from(memoryview(b"xyz"), offset=10)
    assert reg.to_bytes(10, 3) == b"xyz"
    assert reg.to_bytes(997) == payload[997:]
    with pytest.raises(ferry.OutOfBounds, match="outside GPU registration"):
        reg.copy_from(b"ab", offset=999)
    with pytest.raises(ferry.OutOfBounds):
        reg.to_bytes(0, 1001)
    with pytest.raises(TypeError, match="bytes-like"):
        reg.copy_from("text")

    d = engine.describe()
    (desc,) = [g for g in d["gpu_registrations"] if g["name"] == "g"]
    assert desc["len"] == 1000 and desc["device"] == 0 and desc["route"]["route"] == "off"
    assert desc["served"] == "local only"
    assert d["staging"]["policy"] == "auto"

    reg.close()
    assert reg.closed and "closed" in repr(reg)
    assert not [g for g in engine.describe()["gpu_registrations"] if g["name"] == "g"]
    # The memory outlives close(): views of it stay valid while the object lives.
    assert reg.to_bytes(10, 3) == b"xyz"


def test_alloc_gpu_bad_arguments(cuda_driver):
    engine = ferry.Engine()
    with pytest.raises(ValueError, match="size must be at least 1"):
        engine.alloc_gpu(0, 0)
    with pytest.raises(ValueError, match="device must be >= 0"):
        engine.alloc_gpu(-1, 16)
    with pytest.raises(ferry.InvalidRequest, match="no GPU 7"):
        engine.alloc_gpu(7, 16)
    with pytest.raises(ValueError, match="access must be"):
        engine.alloc_gpu(0, 16, access="everything")


def test_alloc_gpu_memory_is_freed_with_the_object(cuda_driver):
    if not cuda_driver.fake:
        pytest.skip("counts allocations through the fake driver's counters; this is another driver")
    engine = ferry.Engine()
    gc.collect()
    # Other tests drain their requests (wait_drained), so no earlier allocation is freed
    # behind this test's back.
    before = cuda_driver.live_device_allocs()
    reg = engine.alloc_gpu(0, 4096)
    assert cuda_driver.live_device_allocs() == before + 1
    reg.close()
    assert cuda_driver.live_device_allocs() == before + 1  # the object still holds it
    del reg
    gc.collect()
    assert cuda_driver.live_device_allocs() == before


def test_gpu_to_peer_host_memory_and_back(gpu_pair):
    server, client = gpu_pair
    buf = bytearray(N)
    seg_reg = server.register(buf, name="seg", access="read+write")
    peer = client.connect(server.listen_addr)
    seg = peer.segment("seg")
    gpu = client.alloc_gpu(0, N, name="weights")
    payload = data(N, 2)
    gpu.copy_from(payload)

    outcome = client.write(gpu, seg).wait_drained(timeout=60)
    outcome.raise_for_failure()
    assert outcome.completed_bytes == N
    assert bytes(buf) == payload

    gpu.copy_from(bytes(N))
    outcome = client.read(gpu, seg).wait_drained(timeout=60)
    outcome.raise_for_failure()
    assert gpu.to_bytes() == payload

    # A batch mixing device and host memory, halves swapped.
    half = N // 2
    host = bytearray(N - half)
    host_reg = client.register(host)
    gpu.copy_from(bytes(N))
    batch = ferry.Batch(timeout=60).read(gpu, seg, 0, N - half, half).read(host_reg, seg, 0, 0, N - half)
    outcome = client.submit(batch).wait_drained(timeout=60)
    outcome.raise_for_failure()
    assert outcome.completed_ops == 2
    assert gpu.to_bytes(0, half) == payload[N - half :]
    assert bytes(host) == payload[: N - half]

    staging = client.describe()["staging"]
    assert staging["buffers"] > 0 and staging["buffers_in_use"] == 0
    assert staging["staged_bytes"] >= 2 * N + half
    seg_reg.close()


def test_gpu_to_peer_gpu_memory_and_back(gpu_pair):
    server, client = gpu_pair
    remote_gpu = server.alloc_gpu(0, N, name="gseg", access="read+write")
    assert remote_gpu.access == "read+write"
    (desc,) = [g for g in server.describe()["gpu_registrations"] if g["name"] == "gseg"]
    assert "staged" in desc["served"]
    peer = client.connect(server.listen_addr)
    seg = peer.segment("gseg")
    assert len(seg) == N and seg.access == "read+write" and seg.token == remote_gpu.token

    src = client.alloc_gpu(0, N)
    payload = data(N, 3)
    src.copy_from(payload)
    client.write(src, seg).wait_drained(timeout=60).raise_for_failure()
    assert remote_gpu.to_bytes() == payload

    dst = client.alloc_gpu(0, N)
    outcome = client.read(dst, seg, local_offset=5, remote_offset=5).wait_drained(timeout=60)
    outcome.raise_for_failure()
    assert outcome.completed_bytes == N - 5
    assert dst.to_bytes(5) == payload[5:]

    # Closed: unpublished (the peer refuses the token), and unusable locally.
    remote_gpu.close()
    outcome = client.read(dst, seg).wait_drained(timeout=60)
    assert outcome.failure is not None and outcome.failure.kind == "unknown_segment"
    dst.close()
    with pytest.raises(ferry.InvalidRequest, match="is closed"):
        client.read(dst, seg)


def test_register_gpu_wraps_an_exporter_and_keeps_it_alive(gpu_pair):
    server, client = gpu_pair
    buf = bytearray(4096)
    seg_reg = server.register(buf, name="seg", access="read+write")
    peer = client.connect(server.listen_addr)
    seg = peer.segment("seg")
    base = client.alloc_gpu(0, 4096)
    payload = data(2048, 4)
    base.copy_from(payload, offset=1024)

    # 512 little-endian uint32 from byte 1024 of `base`: 2048 bytes.
    obj = CudaArray(interface(base.ptr + 1024, shape=(512,), typestr="<u4"))
    alive = weakref.ref(obj)
    reg = client.register_gpu(obj, name="wrapped", access="read")
    assert (reg.name, len(reg), reg.device, reg.ptr, reg.readonly) == (
        "wrapped", 2048, 0, base.ptr + 1024, False
    )
    assert reg.to_bytes() == payload
    client.write(reg, seg).wait_drained(timeout=60).raise_for_failure()
    assert bytes(buf[:2048]) == payload

    # The registration owns the exporter: it outlives every other reference.
    del obj
    gc.collect()
    assert alive() is not None
    reg.close()
    del reg
    settle(client, alive)
    assert alive() is None
    seg_reg.close()


def test_register_gpu_device_ordinal(cuda_driver):
    engine = ferry.Engine()
    base = engine.alloc_gpu(0, 256)
    # C-contiguous strides are accepted; the driver places the memory, and the object's word
    # (obj.device.index, PyTorch) agrees.
    two_d = interface(base.ptr, shape=(4, 8), typestr="<u2", strides=(16, 2))
    reg = engine.register_gpu(CudaArray(two_d, device=TorchLikeDevice(0)))
    assert len(reg) == 64 and reg.device == 0
    # No word at all: the driver's.
    assert engine.register_gpu(CudaArray(interface(base.ptr))).device == 0
    # A claim the driver contradicts is refused, naming both.
    with pytest.raises(ValueError, match="on GPU 0, not GPU 3"):
        engine.register_gpu(CudaArray(interface(base.ptr), device=TorchLikeDevice(3)))
    # The argument is checked too, and wins over the object's word.
    reg = engine.register_gpu(CudaArray(interface(base.ptr), device=TorchLikeDevice(3)), device=0)
    assert reg.device == 0
    with pytest.raises(ValueError, match="device must be >= 0"):
        engine.register_gpu(CudaArray(interface(base.ptr)), device=-2)
    # The driver knows where allocations end, and which addresses are none of its.
    with pytest.raises(ferry.InvalidRequest, match="runs past its allocation"):
        engine.register_gpu(CudaArray(interface(base.ptr + 128, shape=(256,))))
    with pytest.raises(ferry.FerryError, match="cuPointerGetAttribute"):
        engine.register_gpu(CudaArray(interface(base.ptr + (1 << 40))))


def test_register_gpu_read_only_memory(gpu_pair):
    server, client = gpu_pair
    seg_reg = server.register(bytearray(64), name="seg", access="read+write")
    seg = client.connect(server.listen_addr).segment("seg")
    base = client.alloc_gpu(0, 64)
    ro = interface(base.ptr, readonly=True)
    with pytest.raises(TypeError, match="read-only"):
        client.register_gpu(CudaArray(ro), access="write")
    with pytest.raises(TypeError, match="read-only"):
        client.register_gpu(CudaArray(ro), access="read+write")
    reg = client.register_gpu(CudaArray(ro), access="read")
    assert reg.readonly and reg.__cuda_array_interface__["data"] == (base.ptr, True)
    with pytest.raises(TypeError, match="read-only"):
        client.read(reg, seg)
    with pytest.raises(TypeError, match="read-only"):
        ferry.Batch().read(reg, seg)
    with pytest.raises(TypeError, match="read-only"):
        reg.copy_from(b"x")
    client.write(reg, seg).wait_drained(timeout=60).raise_for_failure()  # a source is fine
    seg_reg.close()


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda p: bytearray(16), TypeError, "__cuda_array_interface__"),
        (lambda p: CudaArray(["not", "a", "dict"]), TypeError, "not a dict"),
        (lambda p: CudaArray(interface(p, shape=(8,), strides=(2,))), ValueError, "not contiguous"),
        (
            lambda p: CudaArray(interface(p, shape=(4, 4), strides=(1, 4))),
            ValueError,
            "not contiguous",
        ),
        (lambda p: CudaArray(interface(p, shape=(0,))), ValueError, "empty"),
        (lambda p: CudaArray(interface(p, shape=(3, 0, 2))), ValueError, "empty"),
        (lambda p: CudaArray(interface(p, typestr="|O8")), ValueError, "unknown typestr"),
        (lambda p: CudaArray(interface(p, typestr="u1")), ValueError, "unknown typestr"),
        (lambda p: CudaArray(interface(p, typestr="<f")), ValueError, "unknown typestr"),
        (lambda p: CudaArray(interface(p, typestr=4)), ValueError, "typestr must be a str"),
        (lambda p: CudaArray(interface(p, mask=object())), ValueError, "masked"),
        (lambda p: CudaArray(interface(0)), ValueError, "null"),
        (lambda p: CudaArray({"shape": (4,), "typestr": "|u1"}), ValueError, 'no "data" entry'),
        (lambda p: CudaArray(interface(p, shape=(-1,))), ValueError, "shape must be"),
    ],
    ids=[
        "no-interface", "not-a-dict", "strided", "fortran-order", "zero-size", "zero-extent",
        "object-typestr", "no-byte-order", "no-itemsize", "typestr-not-str", "masked",
        "null-pointer", "no-data", "negative-shape",
    ],
)
def test_register_gpu_refuses(cuda_driver, make, error, match):
    engine = ferry.Engine()
    base = engine.alloc_gpu(0, 64)
    with pytest.raises(error, match=match):
        engine.register_gpu(make(base.ptr))


def test_local_must_be_a_registration(gpu_pair):
    server, client = gpu_pair
    seg_reg = server.register(bytearray(64), name="seg", access="read+write")
    seg = client.connect(server.listen_addr).segment("seg")
    with pytest.raises(TypeError, match="Registration or a GpuRegistration"):
        client.read(bytearray(64), seg)
    with pytest.raises(TypeError, match="Registration or a GpuRegistration"):
        ferry.Batch().write(object(), seg)
    seg_reg.close()


def test_without_libcuda_gpu_calls_raise_unavailable():
    """In a child process, so that FERRY_LIBCUDA is set before its engine loads anything."""
    missing = "/nonexistent/ferry-test/libcuda.so.1"
    script = textwrap.dedent(
        """
        import ferry

        class A:
            __cuda_array_interface__ = {"shape": (8,), "typestr": "|u1", "data": (4096, False)}

        e = ferry.Engine()
        for call in (lambda: e.alloc_gpu(0, 16), lambda: e.register_gpu(A())):
            try:
                call()
            except ferry.Unavailable as err:
                print("Unavailable:", err)
            else:
                print("no error")
        """
    )
    env = dict(os.environ, FERRY_LIBCUDA=missing)
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 2, run.stdout
    for line in lines:
        assert line.startswith("Unavailable: libcuda.so.1"), line
        assert missing in line, line  # the loader's reason names the file it tried


def test_read_file_into_gpu(cuda_driver, tmp_path):
    engine = ferry.Engine()
    payload = data(N, 5)
    f = tmp_path / "weights.bin"
    f.write_bytes(payload)
    dst = engine.alloc_gpu(0, N + 100)
    load = engine.read_file_into_gpu(dst, f, offset=100)
    assert load["bytes"] == N and load["path"].startswith(("gds", "compat"))
    assert dst.to_bytes(100) == payload
    assert engine.describe()["staging"]["last_file_path"] == load["path"]
    # A range of the file, at the start of `dst`.
    load = engine.read_file_into_gpu(dst, str(f), file_offset=7, length=1000)
    assert load["bytes"] == 1000 and dst.to_bytes(0, 1000) == payload[7:1007]
    with pytest.raises(ferry.OutOfBounds):
        engine.read_file_into_gpu(dst, f, offset=200, length=N)
    with pytest.raises(ferry.IoError, match="missing.bin"):
        engine.read_file_into_gpu(dst, tmp_path / "missing.bin")
    dst.close()
    with pytest.raises(ferry.InvalidRequest, match="is closed"):
        engine.read_file_into_gpu(dst, f)
