//! The control service every member runs beside its Ferry listener: one JSON object per line
//! over TCP, each request answered by one line.
//!
//! Requests: `manifest` (the source answers with the manifest of the version asked for, or of
//! its newest, and its epoch), `progress` (the member's verified prefix of the version it
//! holds, answered once it passes `after` or after `wait_ms`: a long poll that lets a child
//! follow its parent chunk by chunk), `layout` (where a receiver holds each segment, so that
//! a child can read its chunks from the receiver's own destinations), and, at a source running the embedded
//! discovery, `join`, `heartbeat`, `members` and `leave` (the tracker, see
//! [`discovery`](crate::discovery)). Every answer carries the answering member's source epoch.
//! Lines are capped in length before they are parsed (requests at [`MAX_REQUEST`], answers,
//! which carry manifests, at a manifest's limit); a bad line is answered with an error and
//! closes that connection.
//!
//! **Keys.** A member given a keyring authenticates every connection to its control service
//! before it answers anything on it: `auth_hello` and `auth_proof` carry the engine's own
//! challenge-response (`ferry::core_types::auth`, HMAC-SHA256 over both nonces, both ids and
//! the key name; the same code the data plane's handshake runs), and any other request before
//! the proof is refused and closes the connection. A client given a keyring refuses a member
//! that cannot prove the key.
//!
//! **Before the proof** (a keyless member: before the first request), a connection costs a
//! stranger little, through the same gate as the data planes' listeners
//! ([`ferry::HandshakeGate`], [`ferry::HandshakeLimits`]): at most `max_pending` such connections
//! at once (past them the oldest of the source address holding the most is closed to make
//! room), all of it within `timeout` of the accept (else closed), and request lines of at most
//! `MAX_PREAUTH_REQUEST` (1 KiB) on a keyed member, `MAX_REQUEST` (64 KiB) once proven.
//! Accept errors (out of descriptors) back off instead of spinning.
//!
//! **After the proof** (keyless: once the first request is answered), a connection is charged
//! to the key name it proved (keyless: to its source address), through [`proven`]: at most 256
//! such connections per key and 1024 in all, past which the least recently active of the key's
//! connections waiting for a request (past the total: of the key holding the most) is closed to
//! make room, or the newcomer refused where all of them are being answered; and a connection
//! waiting longer than 60 s for its next request is closed. So connections that each sent one
//! request and went idle cannot hold the member's descriptors.
//!
//! **Entries are their members'.** The tracker answers a `join` with a secret token of the
//! new entry (32 random bytes); a heartbeat or a leave of that entry must carry it, and a join
//! under an id already listed must too, so no one else can renew, move or remove it. Receivers
//! only: a join claiming the source's role is refused. At most [`MAX_MEMBERS`] are listed.
//!
//! The parts, each importing only those listed before it: [`messages`] (the requests, answers
//! and line limits), [`tracker`] (the embedded discovery's list), [`auth`] (the
//! challenge-response steps of one connection), [`proven`] (the proven connections per key),
//! [`server`] (the service) and [`client`].

mod auth;
mod client;
mod messages;
mod proven;
mod server;
mod tracker;

pub(crate) use client::CtlClient;
pub(crate) use messages::{Hex32, Progress, Reply, Request};
pub(crate) use server::{CtlState, Service};
pub use tracker::Departure;
pub(crate) use tracker::Tracker;

#[cfg(test)]
mod tests;
