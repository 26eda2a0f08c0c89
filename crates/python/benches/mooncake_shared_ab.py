"""What shared registrations give the Mooncake API's small WRITE (issue 50): 4 KiB
``transfer_sync_write`` from one process into another's managed buffer on this host, 20,000
awaited one at a time after 2,000 to warm up (the mapping is asked for on the first), with
``FERRY_SAME_HOST_SHARED`` on (one-sided) and off (the owner copies, as before), in alternating
rounds. Prints p50, p90, p99 and the mean per run, then the medians (docs/performance.md,
"Shared registrations").

    PYTHONPATH=crates/python/python python crates/python/benches/mooncake_shared_ab.py crates/python/tests ROUNDS

The target is ``crates/python/tests/mooncake_peer.py`` (its buffer a managed one).
"""
import json, os, subprocess, sys, time
HERE = sys.argv[1]
peer = subprocess.Popen([sys.executable, os.path.join(HERE, "mooncake_peer.py"), "127.0.0.1", "P2PHANDSHAKE", str(1 << 20)],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
info = json.loads(peer.stdout.readline())
INIT = r'''
import sys, time
from ferry.mooncake import TransferEngine
name, remote, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = te.allocate_managed_buffer(1 << 20)
for _ in range(2000):
    assert te.transfer_sync_write(name, buf, remote, 4096) == 0
lat = []
for _ in range(n):
    t = time.perf_counter()
    te.transfer_sync_write(name, buf, remote, 4096)
    lat.append(time.perf_counter() - t)
lat.sort()
print(f"{lat[len(lat)//2]*1e6:.2f} {sum(lat)/len(lat)*1e6:.2f} {lat[len(lat)*9//10]*1e6:.2f} {lat[len(lat)*99//100]*1e6:.2f}")
te.close()
'''
res = {"on": [], "off": []}
for r in range(int(sys.argv[2])):
    for mode in (["on", "off"] if r % 2 == 0 else ["off", "on"]):
        env = {**os.environ, "FERRY_SAME_HOST_SHARED": mode}
        out = subprocess.run([sys.executable, "-c", INIT, info["name"], str(info["buffer"]), "20000"],
                             env=env, capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr[-2000:]); sys.exit(1)
        p50, mean, p90, p99 = map(float, out.stdout.split())
        res[mode].append((p50, mean, p90, p99))
        print(f"round {r} shared {mode}: p50 {p50} p90 {p90} p99 {p99} mean {mean} us", flush=True)
peer.stdin.write("quit\n"); peer.stdin.flush(); peer.wait()
for mode in res:
    p = sorted(x[0] for x in res[mode]); m = sorted(x[1] for x in res[mode])
    print(mode, "p50 median", p[len(p)//2], "range", p[0], p[-1], "mean median", m[len(m)//2])
