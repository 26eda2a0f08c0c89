"""ferry.broadcast: NumPy tensors published from a trainer's memory and pulled into receivers'
live arrays (in place, relayed, and staged until commit), versions side by side, a mismatch
refused before any byte moves, weights from a .safetensors file written by PyPI's
``safetensors``, and GPU destinations and sources against the fake CUDA driver."""

import asyncio
import platform
import threading

import pytest

import ferry
import ferry.broadcast
from ferry.broadcast import (
    BroadcastError,
    Publisher,
    TensorMismatch,
    Torn,
    TornError,
    held,
    pull,
    pull_async,
)


# Copies per byte of the check at rest: none where the CPU computes CRC-32C over memory in place
# (x86-64, SSE 4.2), else one (`MemoryRegion::crc32c_in_place`).
AT_REST = 0.0 if platform.machine() in ("x86_64", "AMD64") else 1.0


def engine():
    return ferry.Engine(listen="127.0.0.1:0", data_plane="tcp")


def weights(np, seed):
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.standard_normal((300, 64)).astype(np.float32),
        "norm": rng.standard_normal(64).astype(np.float16),
        "head": rng.integers(0, 1 << 30, size=(40_000,), dtype=np.int64),
    }


def empty_like(np, ws):
    return {k: np.zeros_like(v) for k, v in ws.items()}


def test_error_classes_are_ferry_errors():
    assert issubclass(BroadcastError, ferry.FerryError)
    assert issubclass(TensorMismatch, BroadcastError) and issubclass(TensorMismatch, ValueError)
    assert issubclass(TornError, BroadcastError)


def test_numpy_in_place_relayed_then_the_next_version(np):
    trainer = engine()
    w1 = weights(np, 1)
    with Publisher(trainer, w1, name="policy", version=1, chunk_size=16 << 10) as pub:
        receivers = [engine() for _ in range(3)]
        lives = [empty_like(np, w1) for _ in receivers]
        out: dict = {}

        def run(i):
            try:
                out[i] = pull(receivers[i], pub.addr, lives[i], name="policy", timeout=60)
            except BaseException as e:  # reported below
                out[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sums = [out[i] for i in range(3)]
        for s in sums:
            assert not isinstance(s, BaseException), s
            assert s.version == 1 and s.refetched == 0
            assert s.bytes == sum(v.nbytes for v in w1.values())
            assert s.from_source + s.from_relays >= s.bytes
            # The native summary's give-up counters reach Python (whatever their values).
            for k in ("parents_given_up", "holders_stalled", "holders_left"):
                assert isinstance(getattr(s, k), int) and getattr(s, k) >= 0, (k, s)
            # Copied out once to be hashed as it lands; checked at rest where it lies.
            assert s.copies_per_byte == 1.0 + AT_REST
        assert sum(s.from_relays for s in sums) > 0, "receivers relay to each other"
        for live in lives:
            for k in w1:
                assert np.array_equal(live[k], w1[k]), k
                assert held(live[k]) == 1

        # Version 2 from other arrays: the publisher keeps version 1 meanwhile.
        w2 = weights(np, 2)
        pub.publish(w2, 2)
        assert pub.versions == [1, 2]
        s = pull(receivers[0], pub.addr, lives[0], name="policy", relay=False, verify_at_rest=False)
        assert s.version == 2
        assert s.copies_per_byte == 1.0  # hashed once, as it lands
        for k in w2:
            assert np.array_equal(lives[0][k], w2[k]), k
            assert held(lives[0][k]) == 2
        # Version 1 is still served to whoever asks for it by number.
        old = empty_like(np, w1)
        assert pull(receivers[1], pub.addr, old, version=1, relay=False).version == 1
        assert all(np.array_equal(old[k], w1[k]) for k in w1)


def test_mismatch_is_one_error_before_any_byte_moves(np):
    trainer = engine()
    w = weights(np, 3)
    with Publisher(trainer, w, name="policy") as pub:
        r = engine()
        into = {
            "embed": np.zeros_like(w["embed"]),
            "head": np.zeros(10, np.int64),  # wrong size
            "bias": np.zeros(8, np.float32),  # not published
        }  # and "norm" is missing
        with pytest.raises(TensorMismatch) as ei:
            pull(r, pub.addr, into, name="policy")
        e = ei.value
        assert isinstance(e, ferry.FerryError)
        assert e.name == "policy" and e.version == 1 and len(e.problems) == 3
        msg = str(e)
        assert "norm" in msg and "head" in msg and "bias" in msg
        assert all(not v.any() for v in into.values()), "nothing moved"
        assert held(into["embed"]) is None
        # A subset with a rename is fine.
        sub = {"lm_head": np.zeros_like(w["head"])}
        s = pull(r, pub.addr, sub, rename={"head": "lm_head"}, subset=True, relay=False)
        assert np.array_equal(sub["lm_head"], w["head"]) and s.version == 1
        # Tensor-parallel rank 1 of 2: the second half of the rows of "embed".
        rows = w["embed"].shape[0] // 2
        shard = {"embed": np.zeros((rows, 64), np.float32)}
        pull(r, pub.addr, shard, subset=True, shards={"embed": rows * 64 * 4}, relay=False)
        assert np.array_equal(shard["embed"], w["embed"][rows:])
        # The same bytes as another dtype, or another shape, are refused before anything moves.
        as_ints = {"embed": np.zeros(w["embed"].shape, np.int32)}
        with pytest.raises(TensorMismatch, match="published as F32, destination is I32"):
            pull(r, pub.addr, as_ints, subset=True, relay=False)
        flat = {"embed": np.zeros(w["embed"].size, np.float32)}
        with pytest.raises(TensorMismatch, match="shape"):
            pull(r, pub.addr, flat, subset=True, relay=False)
        assert not as_ints["embed"].any() and not flat["embed"].any()
        # Bad numbers are a ValueError, never a panic, and the engine pulls at once after.
        for bad in (-1, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="timeout"):
                pull(r, pub.addr, sub, rename={"head": "lm_head"}, subset=True, timeout=bad)
        with pytest.raises(ValueError, match="linger"):
            pull(r, pub.addr, sub, rename={"head": "lm_head"}, subset=True, linger=-1)
        pull(r, pub.addr, sub, rename={"head": "lm_head"}, subset=True, relay=False)
        # Two published tensors renamed into one destination: refused.
        one = {"x": np.zeros_like(w["head"])}
        with pytest.raises(TensorMismatch, match="two published tensors"):
            pull(r, pub.addr, one, rename={"head": "x", "norm": "x"}, subset=True, relay=False)


def test_staged_pull_leaves_live_tensors_until_commit(np):
    trainer = engine()
    w1, w2 = weights(np, 4), weights(np, 5)
    with Publisher(trainer, w1, name="policy", version=7) as pub:
        r = engine()
        live = empty_like(np, w1)
        pull(r, pub.addr, live, relay=False)
        pub.publish(w2, 8)
        staging = empty_like(np, w2)
        s = pull(r, pub.addr, live, mode="staged", staging=staging, relay=False)
        assert s.version == 8
        assert all(np.array_equal(live[k], w1[k]) for k in w1), "untouched before commit"
        assert held(live["embed"]) == 7
        assert s.copies_per_byte == 1.0 + AT_REST
        took = s.commit()
        assert took >= 0
        assert s.copies_per_byte == 2.0 + AT_REST  # and the commit, one direct copy
        assert all(np.array_equal(live[k], w2[k]) for k in w2)
        assert held(live["embed"]) == 8
        # A staged version dropped without a commit leaves the live tensors as they were.
        pub.publish(weights(np, 12), 9)
        s = pull(r, pub.addr, live, mode="staged", staging=staging, relay=False)
        s.close()
        assert all(np.array_equal(live[k], w2[k]) for k in w2) and held(live["embed"]) == 8
        with pytest.raises(ValueError, match="staging"):
            pull(r, pub.addr, live, mode="staged")
        with pytest.raises(BroadcastError, match="staged"):
            pull(r, pub.addr, live, relay=False).commit()


def test_weights_from_a_safetensors_file(np, safetensors_numpy, tmp_path):
    st = safetensors_numpy
    path = tmp_path / "model.safetensors"
    st.save_file(weights(np, 6), str(path))
    loaded = st.load_file(str(path))
    trainer = engine()
    with Publisher(trainer, loaded, name="ckpt") as pub:
        live = empty_like(np, loaded)
        s = pull(engine(), pub.addr, live, relay=False)
        assert s.version == 1
        for k in loaded:
            assert np.array_equal(live[k], loaded[k]), k


def test_asyncio_pull_and_progress(np):
    trainer = engine()
    w = weights(np, 7)
    seen = []
    with Publisher(trainer, w, name="policy", chunk_size=4096) as pub:
        live = empty_like(np, w)

        async def main():
            return await pull_async(
                engine(), pub.addr, live, relay=False, progress=lambda b, t: seen.append((b, t))
            )

        s = asyncio.run(main())
        assert s.version == 1
        assert all(np.array_equal(live[k], w[k]) for k in w)
        total = sum(v.nbytes for v in w.values())
        assert seen and seen[-1] == (total, total)
        assert all(b <= t for b, t in seen)


def test_read_only_destinations_and_bad_modes_are_refused(np):
    trainer = engine()
    w = weights(np, 8)
    with Publisher(trainer, w, name="policy") as pub:
        live = empty_like(np, w)
        live["norm"].flags.writeable = False
        with pytest.raises(TypeError, match="read-only"):
            pull(engine(), pub.addr, live)
        with pytest.raises(ValueError, match="mode"):
            pull(engine(), pub.addr, empty_like(np, w), mode="eventually")


def test_torn_is_a_version(np):
    assert Torn(3) == Torn(moving_to=3) and Torn(3) != 3


def test_gpu_destinations_and_gpu_source(np, cuda_driver):
    trainer = engine()
    w = weights(np, 9)
    with Publisher(trainer, w, name="policy") as pub:
        r = engine()
        gpu = {k: r.alloc_gpu(0, v.nbytes, access="read") for k, v in w.items()}
        s = pull(r, pub.addr, gpu, relay=False)
        assert s.version == 1
        for k, v in w.items():
            assert gpu[k].to_bytes() == v.tobytes(), k
    # A source of GPU memory, pulled into host arrays.
    g = engine()
    src = {}
    for k, v in w.items():
        reg = g.alloc_gpu(0, v.nbytes, access="read")
        reg.copy_from(v.tobytes())
        src[k] = reg
    with Publisher(g, src, name="gpu") as pub:
        live = empty_like(np, w)
        pull(engine(), pub.addr, live, relay=False)
        for k in w:
            assert np.array_equal(live[k], w[k]), k


def test_publisher_and_receivers_meet_in_a_real_etcd(np, etcd_server):
    """Publisher(discovery="etcd://...") lists itself in etcd; pulls given
    etcd://HOST:PORT/NAME find it and one another there, relaying, and pull the next version."""
    trainer = engine()
    w1 = weights(np, 21)
    with Publisher(trainer, w1, name="policy", chunk_size=16 << 10, discovery=etcd_server) as pub:
        source = pub.etcd_source
        assert source == f"{etcd_server}/policy"
        receivers = [engine() for _ in range(2)]
        lives = [empty_like(np, w1) for _ in receivers]
        out: dict = {}

        # What etcd lists proves nothing: unbound, a pull is refused naming what binds it.
        with pytest.raises(BroadcastError, match="--expect-manifest"):
            pull(engine(), source, empty_like(np, w1), timeout=10)
        digest = pub.digest

        def run(i):
            try:
                out[i] = pull(receivers[i], source, lives[i], timeout=60, expect_manifest=digest)
            except BaseException as e:  # reported below
                out[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i in range(2):
            assert not isinstance(out[i], BaseException), out[i]
            assert out[i].version == 1
            assert all(np.array_equal(lives[i][k], w1[k]) for k in w1), i
        w2 = weights(np, 22)
        pub.publish(w2, 2)
        s = pull(receivers[0], source, lives[0], version=2, relay=False, timeout=60, expect_manifest=pub.digest)
        assert s.version == 2 and all(np.array_equal(lives[0][k], w2[k]) for k in w2)
        with pytest.raises(ValueError, match="names the broadcast"):
            pull(receivers[1], source, lives[1], name="other", expect_manifest=digest)
    # Nobody is listed once the publisher closed.
    with pytest.raises(BroadcastError, match="policy"):
        pull(engine(), source, empty_like(np, w1), timeout=10, expect_manifest=digest)


def test_etcd_addresses_are_checked(np):
    w = weights(np, 23)
    with pytest.raises(ValueError, match="etcd://HOST:PORT"):
        Publisher(engine(), w, name="policy", discovery="etcd://no-port")
    with pytest.raises(ValueError, match="names the broadcast"):
        Publisher(engine(), w, name="policy", discovery="etcd://127.0.0.1:1/other")
    with pytest.raises(ValueError, match="NAME"):
        pull(engine(), "etcd://127.0.0.1:1", empty_like(np, w))


def test_rl_weight_update_example_with_etcd(np, safetensors_numpy, etcd_available):
    """The example's --etcd: it starts a real etcd, the trainer lists itself there and the
    inference processes find it (and one another) through it."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[3] / "examples" / "python" / "rl_weight_update.py"
    out = subprocess.run(
        [sys.executable, str(example), "--rounds", "2", "--mb", "4", "--etcd"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("etcd: etcd://127.0.0.1:"), out.stdout
    assert [line.split()[:2] for line in lines[2:4]] == [["1", "2"], ["2", "3"]], out.stdout
    assert "matched the trainer's" in lines[-1]


def test_rl_weight_update_example(np, safetensors_numpy):
    """The example runs in CI: one trainer, three inference processes (two in place, one
    staged), every tensor's hash checked each round, a table printed."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[3] / "examples" / "python" / "rl_weight_update.py"
    out = subprocess.run(
        [sys.executable, str(example), "--rounds", "2", "--mb", "4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:4] == ["round", "version", "seconds", "GB/s"], out.stdout
    assert [line.split()[:2] for line in lines[1:3]] == [["1", "2"], ["2", "3"]], out.stdout
    assert "matched the trainer's" in lines[-1]


def test_gpu_destinations_relay_to_each_other(np, cuda_driver):
    trainer = engine()
    w = weights(np, 10)
    with Publisher(trainer, w, name="policy", chunk_size=16 << 10) as pub:
        rs = [engine() for _ in range(2)]
        gpus = [{k: r.alloc_gpu(0, v.nbytes, access="read") for k, v in w.items()} for r in rs]
        out: dict = {}

        def run(i):
            try:
                out[i] = pull(rs[i], pub.addr, gpus[i], timeout=60)
            except BaseException as e:  # reported below
                out[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i in range(2):
            assert not isinstance(out[i], BaseException), out[i]
            for k, v in w.items():
                assert gpus[i][k].to_bytes() == v.tobytes(), (i, k)
        assert out[0].from_relays + out[1].from_relays > 0, "one read the other's GPU memory"
        assert out[0].copies_per_byte == 0.0, "GPU memory is hashed from driver copies"


def test_a_timeout_is_torn_exactly_when_bytes_were_written(np):
    trainer = engine()
    w = weights(np, 11)
    with Publisher(trainer, w, name="policy", chunk_size=4096) as pub:
        live = empty_like(np, w)
        with pytest.raises((ferry.broadcast.PullTimeout, TornError)) as ei:
            pull(engine(), pub.addr, live, relay=False, timeout=1e-6)
        if isinstance(ei.value, TornError):
            assert held(live["embed"]) == Torn(1) and ei.value.version == 1
            assert sorted(ei.value.tensors) == sorted(w)
        else:
            assert isinstance(ei.value, TimeoutError) and held(live["embed"]) is None


def test_registrations_and_slices_of_them_as_tensors(np):
    trainer = engine()
    w = weights(np, 13)
    # The publisher's tensors: one arena registration, sliced.
    arena = np.concatenate([w[k].view(np.uint8).ravel() for k in ("embed", "norm", "head")])
    areg = trainer.register(arena, name="arena", access="read")
    sizes = [w[k].nbytes for k in ("embed", "norm", "head")]
    offs = [0, sizes[0], sizes[0] + sizes[1]]
    tensors = {k: (areg, o, n) for k, o, n in zip(("embed", "norm", "head"), offs, sizes)}
    with Publisher(trainer, tensors, name="policy") as pub:
        r = engine()
        live = empty_like(np, w)
        # Registered once by the caller, reused across pulls.
        regs = {k: r.register(v, access="read") for k, v in live.items()}
        for _ in range(2):
            s = pull(r, pub.addr, regs, relay=False)
            assert s.version == 1
        for k in w:
            assert np.array_equal(live[k], w[k]), k
        assert not any(reg.closed for reg in regs.values()), "the caller's stay open"


KEY = "fleet 000102030405060708090a0b0c0d0e0f"


@pytest.fixture
def broadcast_key(tmp_path):
    path = tmp_path / "fleet.key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    return str(path)


def test_a_keyed_broadcast_pulls_with_the_key_and_refuses_a_pull_without_it(np, broadcast_key):
    trainer = ferry.Engine(listen="127.0.0.1:0", data_plane="tcp", auth_key_file=broadcast_key)
    w = weights(np, 7)
    with Publisher(trainer, w, name="keyed", chunk_size=16 << 10, auth_key_file=broadcast_key) as pub:
        # Without the key: refused before anything is written.
        stranger = engine()
        live = empty_like(np, w)
        with pytest.raises(ferry.FerryError):
            pull(stranger, pub.addr, live, name="keyed", timeout=20, linger=0)
        for k in w:
            assert not live[k].any(), f"{k} was written without the key"
            assert held(live[k]) is None
        # With it (the engine keyed too): every byte arrives.
        member = ferry.Engine(listen="127.0.0.1:0", data_plane="tcp", auth_key_file=broadcast_key)
        live = empty_like(np, w)
        s = pull(member, pub.addr, live, name="keyed", timeout=60, linger=0, auth_key_file=broadcast_key)
        assert s.version == 1
        for k in w:
            assert np.array_equal(live[k], w[k]), k


def test_expect_manifest_pulls_the_publishers_digest_and_refuses_another(np):
    trainer = engine()
    w = weights(np, 8)
    with Publisher(trainer, w, name="bound", chunk_size=16 << 10) as pub:
        digest = pub.digest
        assert len(digest) == 64 and int(digest, 16) >= 0
        live = empty_like(np, w)
        with pytest.raises(BroadcastError, match="digest"):
            pull(engine(), pub.addr, live, name="bound", timeout=20, linger=0, expect_manifest="ab" * 32)
        for k in w:
            assert not live[k].any(), f"{k} was written for another manifest"
        with pytest.raises(ValueError, match="64 hex digits"):
            pull(engine(), pub.addr, live, name="bound", timeout=20, linger=0, expect_manifest="nope")
        s = pull(engine(), pub.addr, live, name="bound", timeout=60, linger=0, expect_manifest=digest)
        assert s.version == 1
        for k in w:
            assert np.array_equal(live[k], w[k]), k
