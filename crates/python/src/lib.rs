//! Ferry for Python: the native part (`ferry._ferry`) of the `ferry` package, which the
//! distribution `ferry-transfer` installs. Built by maturin as an abi3 extension module for
//! CPython 3.11 and later (3.11 is the first whose stable ABI has the buffer protocol).
//!
//! Contract: the Python API mirrors the facade crate `ferry` (`Engine` is a `TransferEngine`,
//! `register` takes any buffer-protocol object without copying it, `connect` gives a `Peer`,
//! `read`/`write`/`submit` give a `Request` whose `wait()` releases the GIL and which asyncio
//! can await). Ferry's errors become `FerryError` subclasses with Rust's message; bad arguments
//! raise `TypeError`/`ValueError` before anything moves. No Rust panic crosses into Python: every
//! call that reaches the engine runs under one of `runtime`'s shields, which turn a panic into a
//! `FerryError` (the engine stays usable), and a panic on the runtime ends a request's watch
//! with a `FerryError` instead of leaving its waiters hanging. Every blocking wait releases the
//! GIL and lets Python handle signals at least every 50 ms: Ctrl-C raises `KeyboardInterrupt`
//! and cancels what was waited for. No runtime worker thread ever waits for the GIL (see
//! `request` and `buffer`).
//!
//! It depends on the facade (GPU memory through the facade's `ferry::cuda` re-export) and on
//! `ferry-broadcast`, whose tensor publisher and in-place receiver `broadcast` binds for the
//! Python module `ferry.broadcast`. GPU memory: `Engine.alloc_gpu` and `Engine.register_gpu` (any
//! object with `__cuda_array_interface__`) give a `GpuRegistration`, which read/write/Batch take
//! wherever they take a `Registration` (see `gpu`).

mod args;
mod broadcast;
mod buffer;
mod engine;
mod errors;
mod gpu;
mod handles;
mod kv;
mod raw;
mod request;
mod runtime;
mod telemetry;

use pyo3::prelude::*;

/// The native module `ferry._ferry`; `ferry/__init__.py` re-exports it.
#[pymodule]
fn _ferry(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::add_to(m)?;
    engine::add_to(m)?;
    gpu::add_to(m)?;
    request::add_to(m)?;
    broadcast::add_to(m)?;
    raw::add_to(m)?;
    kv::add_to(m)?;
    telemetry::add_to(m)?;
    m.add_function(wrap_pyfunction!(runtime::_panic_for_tests, m)?)?;
    Ok(())
}
