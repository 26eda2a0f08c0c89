//! `ferry metadata-server`: serve Mooncake's HTTP metadata protocol until SIGINT or SIGTERM.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};

use crate::metadata::{server, store};
use crate::parse;

/// Arguments of `ferry metadata-server`.
#[derive(clap::Args, Debug)]
pub(crate) struct MetadataServerArgs {
    /// Address to listen on: HOST:PORT (`0.0.0.0:8080` for every interface, port 0 for any
    /// free port). Anyone who can reach it reads every key and changes every record not owned
    /// (Ferry's engines own theirs with a `Ferry-Owner-Token`; Mooncake's do not): keep it on a
    /// trusted network, as Mooncake's own server. It warns when listening off loopback.
    #[arg(long, default_value = DEFAULT_LISTEN, value_parser = parse::listen_addr)]
    listen: SocketAddr,
}

/// The address `metadata-server` listens on by default (Mooncake's server's port).
pub(crate) const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

/// Runs `ferry metadata-server`.
pub(crate) fn run(args: MetadataServerArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    rt.block_on(async move {
        // Before the address is printed: whoever read it may stop us at once.
        let stop = crate::stop::listen()?;
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("binding the metadata server's address {}", args.listen))?;
        let addr = listener.local_addr().context("the listener's address")?;
        tracing::info!(%addr, "metadata server listening");
        if !addr.ip().is_loopback() {
            tracing::warn!(%addr, "metadata server listening on an address other than \
                loopback, without authentication: anyone who can reach it reads every record, \
                and replaces or deletes every record stored without a Ferry-Owner-Token \
                (Mooncake's engines' records); keep it on a trusted network");
        }
        crate::out::say(format_args!("metadata server listening on {addr}"));
        let store = Arc::new(Mutex::new(store::Store::new(store::Limits::default())));
        let signal = tokio::select! {
            () = server::serve(listener, addr, store.clone(), server::Limits::default()) => {
                return Ok(());
            }
            signal = stop => signal,
        };
        // As every other command stopped by a signal: what it did, and 128 + the signal.
        let (records, bytes) = {
            let s = store
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            (s.len(), s.bytes())
        };
        crate::out::say(format_args!(
            "stopped by {}: metadata server on {addr} held {records} record{} ({})",
            signal.name(),
            if records == 1 { "" } else { "s" },
            crate::out::bytes(bytes as u64)
        ));
        Err(crate::stop::Stopped(signal).into())
    })
}
