"""Weight update with Ferry: a trainer process publishes named NumPy arrays; an inference
process pulls them into arrays it allocated beforehand, then checks them.

    python examples/python/weight_update.py        # runs both processes

The trainer publishes each array zero-copy (``register(..., access="read")``), prints its
address, and on every ``step`` line from its parent updates the weights in place (a training
step) and answers ``ready``. The inference side reads every tensor in one batch (one request,
one round of checks before anything moves) after each step.
"""

import json
import subprocess
import sys

import numpy as np

import ferry

SHAPES = {
    "embed.weight": (1024, 256),
    "layer0.attn.qkv": (256, 768),
    "layer0.mlp.up": (256, 1024),
    "layer0.mlp.down": (1024, 256),
    "head.bias": (1024,),
}


def weights_at(step: int) -> dict[str, np.ndarray]:
    """The trainer's weights after ``step`` steps (deterministic, so both sides can check)."""
    rng = np.random.default_rng(step)
    return {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in SHAPES.items()}


def trainer() -> None:
    engine = ferry.Engine(listen="127.0.0.1:0")
    weights = weights_at(0)
    regs = [engine.register(a, name=name, access="read") for name, a in weights.items()]
    print(json.dumps({"addr": engine.listen_addr}), flush=True)
    for line in sys.stdin:
        if line.startswith("step"):
            step = int(line.split()[1])
            for name, a in weights_at(step).items():
                weights[name][...] = a  # in place: the registered memory
            print("ready", flush=True)
        elif line.startswith("quit"):
            break
    for r in regs:
        r.close()


def inference() -> None:
    proc = subprocess.Popen(
        [sys.executable, __file__, "trainer"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    addr = json.loads(proc.stdout.readline())["addr"]
    engine = ferry.Engine()
    peer = engine.connect(addr)
    # Preallocated once, registered once, refilled on every update.
    mine = {name: np.empty(shape, dtype=np.float32) for name, shape in SHAPES.items()}
    local = {name: engine.register(a, name=f"local/{name}") for name, a in mine.items()}
    remote = {name: peer.segment(name) for name in SHAPES}
    for step in (0, 1, 2):
        if step:
            proc.stdin.write(f"step {step}\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "ready"
        batch = ferry.Batch(timeout=30)
        for name in SHAPES:
            batch.read(local[name], remote[name])
        outcome = engine.submit(batch).wait()
        outcome.raise_for_failure()
        expected = weights_at(step)
        for name, a in mine.items():
            np.testing.assert_array_equal(a, expected[name], err_msg=name)
        print(f"step {step}: pulled {len(SHAPES)} tensors, {outcome.completed_bytes} bytes")
    proc.stdin.write("quit\n")
    proc.stdin.flush()
    proc.wait(timeout=10)
    print("all weights match")


if __name__ == "__main__":
    trainer() if sys.argv[1:] == ["trainer"] else inference()
