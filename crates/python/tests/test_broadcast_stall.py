"""ferry.broadcast.pull from a publisher whose process is stopped (SIGSTOP) in the middle of the
pull: its kernel still accepts and acknowledges, nothing comes back. The pull gives the source
up after the stall window (3 s by default) and raises, naming it and what was verified."""

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import ferry
from ferry.broadcast import BroadcastError, PullStalled, pull

PUBLISHER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import ferry
    from ferry.broadcast import Publisher

    engine = ferry.Engine(listen="127.0.0.1:0", data_plane="tcp")
    w = {"w": np.arange(16 << 20, dtype=np.uint32)}  # 64 MiB
    with Publisher(engine, w, name="stall", chunk_size=64 << 10) as pub:
        print(json.dumps({"addr": pub.addr}), flush=True)
        sys.stdin.readline()
    """
)


def test_a_pull_from_a_stopped_publisher_raises_within_the_stall_window(np):
    proc = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line, f"the publisher exited: {proc.wait()}"
        addr = json.loads(line)["addr"]
        engine = ferry.Engine(listen="127.0.0.1:0", data_plane="tcp")
        into = {"w": np.zeros(16 << 20, dtype=np.uint32)}
        stopped = []

        def progress(done: int, total: int) -> None:
            # At the first verified chunks: the publisher stops in the middle of the pull.
            if done > 0 and not stopped:
                proc.send_signal(signal.SIGSTOP)
                stopped.append(time.monotonic())

        with pytest.raises(BroadcastError) as e:
            pull(engine, addr, into, name="stall", relay=False, progress=progress, linger=0)
        took = time.monotonic() - stopped[0]
        msg = str(e.value)
        assert "the source" in msg and "chunks verified" in msg, msg
        # In place the pull is torn; why is a PullStalled naming the source.
        stalled = e.value if isinstance(e.value, PullStalled) else e.value.__cause__
        assert isinstance(stalled, PullStalled), repr(e.value)
        assert stalled.holder.startswith("the source"), stalled.holder
        assert stalled.chunks == 1024 and 0 < stalled.verified < 1024, (stalled.verified, stalled.chunks)
        # Given up within the stall window (3 s) and 10 s more, not the transport's 30 s.
        assert took < 13, f"raised {took:.1f} s after the publisher stopped: {msg}"
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()
