//! Ferry's portable data plane over TCP (tokio).
