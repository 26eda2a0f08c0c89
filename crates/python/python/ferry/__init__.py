"""Ferry: move bytes between registered memory of processes and hosts over RDMA, io_uring or TCP.

A server publishes memory; a client connects and reads or writes it::

    import numpy as np, ferry

    server = ferry.Engine(listen="127.0.0.1:0")
    weights = np.arange(1 << 20, dtype=np.float32)
    pub = server.register(weights, name="weights", access="read")

    client = ferry.Engine()
    dst = np.empty_like(weights)
    local = client.register(dst)
    peer = client.connect(server.listen_addr)
    outcome = client.read(local, peer.segment("weights")).wait()
    outcome.raise_for_failure()
    assert (dst == weights).all()

Registrations are zero-copy (any object with the buffer protocol). GPU memory comes in by
``Engine.alloc_gpu`` or ``Engine.register_gpu(tensor)`` (anything with
``__cuda_array_interface__``) and goes wherever a registration does. ``Request.wait()`` releases
the GIL and raises a failed request's error (``wait(check=False)`` returns its ``Outcome``), and
``await request`` works in asyncio. Errors are ``FerryError`` subclasses carrying the Rust
engine's message, which names the segment, registration or file.
"""

from ferry._ferry import (
    AccessDenied,
    AuthenticationFailed,
    AuthKeyError,
    Batch,
    Cancelled,
    Engine,
    Failure,
    FerryError,
    FileRegistration,
    GpuRegistration,
    HandshakeRefused,
    InvalidArgument,
    InvalidRequest,
    IoError,
    Malformed,
    NoRoute,
    Outcome,
    OutOfBounds,
    Peer,
    PeerLost,
    ProtocolMismatch,
    Registration,
    RegistrationError,
    RemoteSegment,
    Request,
    ResourceExhausted,
    StaleEpoch,
    Timeout,
    Unavailable,
    UnknownAddress,
    UnknownSegment,
    UnknownSegmentName,
    Unquiesced,
    __version__,
    doctor,
)

__all__ = [
    "AccessDenied",
    "AuthKeyError",
    "AuthenticationFailed",
    "Batch",
    "Cancelled",
    "Engine",
    "Failure",
    "FerryError",
    "FileRegistration",
    "GpuRegistration",
    "HandshakeRefused",
    "InvalidArgument",
    "InvalidRequest",
    "IoError",
    "Malformed",
    "NoRoute",
    "Outcome",
    "OutOfBounds",
    "Peer",
    "PeerLost",
    "ProtocolMismatch",
    "Registration",
    "RegistrationError",
    "RemoteSegment",
    "Request",
    "ResourceExhausted",
    "StaleEpoch",
    "Timeout",
    "Unavailable",
    "UnknownAddress",
    "UnknownSegment",
    "UnknownSegmentName",
    "Unquiesced",
    "__version__",
    "doctor",
]
