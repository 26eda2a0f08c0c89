//! `ferry metadata-server`: a drop-in for Mooncake's HTTP metadata server
//! (`mooncake_http_metadata_server`, the Go `example/http-metadata-server`, the one
//! `mooncake_master --enable_http_metadata_server` embeds), which Mooncake transfer engines
//! given `http://HOST:PORT/metadata` as their metadata server keep their segment descriptors
//! and RPC addresses in.
//!
//! - [`http`]: HTTP/1.1 framing as a state machine over bytes, with every limit on what a
//!   client may cost (head size, body size);
//! - [`store`]: the keys and values and Mooncake's protocol over them;
//! - [`server`]: the tokio driver, with the deadlines and the connection cap.
//!
//! `http` and `store` (which answers with `http`'s [`Response`](http::Response)) do no I/O and
//! are tested without sockets; `server` composes them.

pub(crate) mod http;
pub(crate) mod server;
pub(crate) mod store;
