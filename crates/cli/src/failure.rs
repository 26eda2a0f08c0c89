//! What a failed command says: its error chain with each cause once, a kind a script can branch
//! on, and a hint that says what to do next. Under `--json`, `bench` and `pull` print the same as
//! one JSON object, `{"error": {"kind", "message", "hint"}, ...what was done before}`.

use std::io::ErrorKind;

use ferry::core_types::wire::WireError;
use ferry_broadcast::BroadcastError;

use crate::parse::NO_PORT_HINT;

/// A failure as the user sees it.
#[derive(Debug)]
pub(crate) struct Failure {
    /// A word a script can branch on: `connection_refused`, `not_ferry`, `unknown_segment`,
    /// `timeout`, `peer_lost`, `auth`, `bad_address`, a broadcast's own (`stalled`,
    /// `source_restarted`, `manifest_mismatch`, `bad_manifest`, `unbound_source`, `wrong_peer`,
    /// `no_source`, `discovery`, `io`), and `error` for the rest.
    pub(crate) kind: &'static str,
    /// The error chain, each cause once.
    pub(crate) message: String,
    /// What to do about it: where nothing specific is known, how to learn more.
    pub(crate) hint: Option<String>,
}

/// The error a command returns once it has printed its failure itself (with the facts it
/// keeps): `main` exits 1 and prints nothing more.
#[derive(Debug, thiserror::Error)]
#[error("reported")]
pub(crate) struct Reported;

/// A segment the peer does not publish, with the names it does.
#[derive(Debug, thiserror::Error)]
#[error("{source}; it publishes {}", published_list(.published))]
pub(crate) struct UnknownSegment {
    /// The facade's error, naming the peer and the segment.
    #[source]
    pub(crate) source: ferry::Error,
    /// What the peer publishes (to this client).
    pub(crate) published: Vec<String>,
}

fn published_list(names: &[String]) -> String {
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

/// The peer's port is another service's (see `probe`).
#[derive(Debug, thiserror::Error)]
#[error("{addr} is {what}, not a Ferry peer")]
pub(crate) struct NotFerry {
    /// The address dialled.
    pub(crate) addr: String,
    /// What answered there.
    pub(crate) what: String,
}

/// A request of a run failed (its outcome's failure).
#[derive(Debug, thiserror::Error)]
#[error("request {request} failed: {} (op {})", .failure.kind, .failure.op_index)]
pub(crate) struct RequestFailed {
    /// Which request of the run.
    pub(crate) request: u64,
    /// The outcome's failure.
    pub(crate) failure: ferry::Failure,
}

/// What the command talks to: what a refused connection asks about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Server {
    /// `ferry serve` (bench and most commands).
    Serve,
    /// `ferry publish` (pull).
    Publish,
}

impl Server {
    fn refused_hint(self) -> String {
        let (cmd, port) = match self {
            Server::Serve => ("ferry serve", 7400),
            Server::Publish => ("ferry publish", 7500),
        };
        format!(
            "nothing listens there: is `{cmd}` running on that host and port? (it listens on \
             port {port} by default)"
        )
    }
}

impl Failure {
    pub(crate) fn of(e: &anyhow::Error, server: Server) -> Self {
        let message = chain_once(e);
        let (kind, hint) = classify(e, server);
        Self {
            kind,
            message,
            hint,
        }
    }

    /// `{"kind", "message", "hint"}` (hint null when none).
    pub(crate) fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "kind": self.kind,
            "message": self.message,
            "hint": self.hint,
        })
    }

    /// `ferry: MESSAGE`, then `hint: HINT` when there is one.
    pub(crate) fn print(&self) {
        eprintln!("ferry: {}", self.message);
        if let Some(h) = &self.hint {
            eprintln!("hint: {h}");
        }
    }
}

/// Prints `e` (on stderr; with `json` also as one object on stdout, `facts` beside `error`), and
/// returns [`Reported`] for the caller to return.
/// `done`, when given, is a line saying what was done before the failure (stderr only).
pub(crate) fn report(
    e: anyhow::Error,
    server: Server,
    json: bool,
    facts: serde_json::Map<String, serde_json::Value>,
    done: Option<String>,
) -> anyhow::Error {
    let f = Failure::of(&e, server);
    if json {
        let mut obj = facts;
        obj.insert("error".into(), f.to_json());
        crate::out::say(format_args!("{}", serde_json::Value::Object(obj)));
    }
    f.print();
    if let Some(d) = done {
        eprintln!("{d}");
    }
    anyhow::Error::new(Reported)
}

/// The chain joined by `: `, leaving out a cause whose text the chain already holds (an I/O
/// error's message is often in its wrapper's too: `connect to X: Connection refused`).
pub(crate) fn chain_once(e: &anyhow::Error) -> String {
    let mut msg = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if text.is_empty() || msg.contains(&text) {
            continue;
        }
        if !msg.is_empty() {
            msg.push_str(": ");
        }
        msg.push_str(&text);
    }
    msg
}

/// What a failed command says when nothing more specific is known.
const GENERIC_HINT: &str = "run it again with -v (or RUST_LOG=debug) for the log of what it \
                            tried; `ferry doctor` shows what this machine can use";

fn classify(e: &anyhow::Error, server: Server) -> (&'static str, Option<String>) {
    let (kind, hint) = classify_known(e, server);
    (kind, Some(hint.unwrap_or_else(|| GENERIC_HINT.to_owned())))
}

/// A broadcast's own failures: a kind each, and what to do.
fn broadcast(e: &BroadcastError) -> Option<(&'static str, String)> {
    Some(match e {
        BroadcastError::Stalled { holder, reason, .. } => (
            "stalled",
            format!(
                "{} {}: check that {} still runs and is reachable, then pull again; \
                 --stall-after sets how long a silent holder is waited for",
                holder.split(" (id ").next().unwrap_or(holder),
                if reason.starts_with("sent nothing") || reason.starts_with("advertised nothing") {
                    "stopped sending (stopped, frozen or cut off)"
                } else {
                    "went away (its process ended, or the link broke)"
                },
                if holder.starts_with("the source") {
                    "`ferry publish`"
                } else {
                    "it"
                }
            ),
        ),
        BroadcastError::NoHolder { .. } => (
            "stalled",
            "every holder of a chunk was given up, the source too: check that `ferry publish` \
             still runs and is reachable, then pull again"
                .to_owned(),
        ),
        BroadcastError::SourceRestarted { .. } => (
            "source_restarted",
            "the publisher restarted mid-pull: pull again to fetch what it publishes \
             now"
            .to_owned(),
        ),
        BroadcastError::ManifestDigest { .. } => (
            "manifest_mismatch",
            "check --expect-manifest against the digest `ferry publish` printed for this version \
             (and --weights-version)"
                .to_owned(),
        ),
        BroadcastError::ManifestFrom { .. } | BroadcastError::Manifest(_) => (
            "bad_manifest",
            "the publisher's manifest was refused: check the publisher's version of ferry, and \
             --max-bytes where a pull is capped"
                .to_owned(),
        ),
        BroadcastError::UnboundSource { .. } => (
            "unbound_source",
            "give --auth-key-file (the broadcast's keys) or --expect-manifest (the digest `ferry \
             publish` printed)"
                .to_owned(),
        ),
        BroadcastError::WrongPeer { .. } => (
            "wrong_peer",
            "a member record names another process than the one answering there (stale or \
             forged): check what else writes the discovery backend"
                .to_owned(),
        ),
        BroadcastError::NoSource { .. } => (
            "no_source",
            "is `ferry publish --name NAME --etcd URL` running, under that name and etcd?"
                .to_owned(),
        ),
        BroadcastError::Discovery { .. } => (
            "discovery",
            "check that the discovery backend (the publisher's control port, or etcd) runs and \
             is reachable"
                .to_owned(),
        ),
        BroadcastError::TimedOut { .. } => (
            "timeout",
            "the pull did not complete in the time given: give it longer".to_owned(),
        ),
        BroadcastError::Io { .. } => (
            "io",
            "check the directory: its filesystem's free space and permissions".to_owned(),
        ),
        _ => return None,
    })
}

fn classify_known(e: &anyhow::Error, server: Server) -> (&'static str, Option<String>) {
    for cause in e.chain() {
        if let Some(b) = cause.downcast_ref::<BroadcastError>()
            && let Some((kind, hint)) = broadcast(b)
        {
            return (kind, Some(hint));
        }
        if let Some(r) = cause.downcast_ref::<RequestFailed>() {
            return match r.failure.kind {
                ferry::FailureKind::PeerLost => (
                    "peer_lost",
                    Some(
                        "the peer went away mid-run: check that its `ferry serve` still runs \
                         (--dead-peer-after says how long a silent one is waited for)"
                            .into(),
                    ),
                ),
                ferry::FailureKind::Timeout => (
                    "timeout",
                    Some(
                        "the peer did not answer in time: check its load and the link, or give \
                         the request longer"
                            .into(),
                    ),
                ),
                ferry::FailureKind::Remote(_) => (
                    "refused_by_peer",
                    Some("the peer refused the request: its log says why (run it with -v)".into()),
                ),
                _ => ("request_failed", None),
            };
        }
        if cause.downcast_ref::<NotFerry>().is_some() {
            return (
                "not_ferry",
                Some(
                    "check the port: `ferry serve` listens on 7400 unless its --listen says \
                     otherwise (its --metrics port serves HTTP)"
                        .into(),
                ),
            );
        }
        if let Some(w) = cause.downcast_ref::<WireError>()
            && let WireError::BadMagic(m) = w
        {
            return ("not_ferry", Some(not_ferry_hint(m)));
        }
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            match io.kind() {
                ErrorKind::ConnectionRefused => {
                    return ("connection_refused", Some(server.refused_hint()));
                }
                ErrorKind::InvalidInput if io.to_string().contains("invalid socket address") => {
                    return ("bad_address", Some(NO_PORT_HINT.into()));
                }
                _ => {}
            }
        }
        if let Some(err) = cause.downcast_ref::<ferry::Error>() {
            match err {
                ferry::Error::UnknownSegmentName { .. } => {
                    return (
                        "unknown_segment",
                        Some(
                            "name one the peer publishes with --segment NAME (a plain `ferry \
                             serve` publishes `bench`; `ferry serve --segment NAME=SIZE` others)"
                                .into(),
                        ),
                    );
                }
                ferry::Error::Timeout { what, .. } if what.contains("handshake") => {
                    return (
                        "timeout",
                        Some(
                            "the peer took the connection but never answered as Ferry does: is \
                             that port a `ferry serve`?"
                                .into(),
                        ),
                    );
                }
                ferry::Error::Timeout { .. } => {
                    return (
                        "timeout",
                        Some(
                            "the peer did not answer in time: is it running, reachable, and not \
                             stopped?"
                                .into(),
                        ),
                    );
                }
                ferry::Error::Unavailable { .. } => {
                    return (
                        "unavailable",
                        Some(
                            "`ferry doctor` shows what this machine can use, and why not the rest"
                                .into(),
                        ),
                    );
                }
                ferry::Error::PeerLost { during, .. } if during.contains("handshake") => {
                    return (
                        "not_ferry",
                        Some(
                            "the peer closed the connection in the handshake: is that port a \
                             `ferry serve` (not another service, e.g. TLS), with a key file if it \
                             requires one?"
                                .into(),
                        ),
                    );
                }
                ferry::Error::PeerLost { .. } => {
                    return (
                        "peer_lost",
                        Some("the peer went away: check that its `ferry serve` still runs".into()),
                    );
                }
                ferry::Error::Authentication { .. } | ferry::Error::AuthKey { .. } => {
                    return (
                        "auth",
                        Some(
                            "both sides need a key of the same name and value: check \
                             --auth-key-file (or FERRY_AUTH_KEY_FILE) on each"
                                .into(),
                        ),
                    );
                }
                _ => {}
            }
        }
    }
    by_text(e, server)
}

/// What the error's text says, for layers that keep an I/O error as text only.
fn by_text(e: &anyhow::Error, server: Server) -> (&'static str, Option<String>) {
    let text = chain_once(e);
    if text.contains("Connection refused") {
        return ("connection_refused", Some(server.refused_hint()));
    }
    if text.contains("not a `ferry publish` control port") {
        return (
            "not_ferry",
            Some(
                "pull from the address `ferry publish` prints after `control` (7500 unless its \
                 --listen says otherwise)"
                    .into(),
            ),
        );
    }
    if text.contains("has no port") {
        let hint = match server {
            Server::Serve => NO_PORT_HINT.to_owned(),
            Server::Publish => "give HOST:PORT as `ferry publish` prints it after `control` \
                                (7500 unless its --listen says otherwise)"
                .to_owned(),
        };
        return ("bad_address", Some(hint));
    }
    if server == Server::Publish
        && text.contains("control service at")
        && (text.contains("Connection reset") || text.contains("connection closed"))
    {
        return (
            "not_ferry",
            Some(
                "the port closed the connection at the first request: is it a `ferry publish` \
                 control port? (a Ferry engine's port, `ferry serve`'s or the publisher's data \
                 port, does that; pull from the address `ferry publish` prints after `control`, \
                 7500 unless --listen says otherwise)"
                    .into(),
            ),
        );
    }
    ("error", None)
}

/// What the first four bytes a peer sent say it is.
fn not_ferry_hint(magic: &[u8; 4]) -> String {
    let what = match magic {
        b"HTTP" => "an HTTP server (it answered \"HTTP\")",
        [0x16, 0x03, ..] => "a TLS server (it answered with a TLS handshake record)",
        [0x15, 0x03, ..] => "a TLS server (it answered with a TLS alert)",
        b"SSH-" => "an SSH server",
        b"{\"re" => "a `ferry publish` control port (`ferry pull ADDR` reads it)",
        _ => "not a Ferry peer (Ferry's frames open with \"FRRY\")",
    };
    format!("the peer is {what}, not `ferry serve`: check the port (ferry serve's default is 7400)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_cause_once() {
        let io = std::io::Error::from(ErrorKind::ConnectionRefused);
        let text = io.to_string();
        let e = anyhow::Error::new(ferry::Error::io("connect", "127.0.0.1:1", io))
            .context("connecting to 127.0.0.1:1");
        let f = Failure::of(&e, Server::Serve);
        assert_eq!(f.message.matches(&text).count(), 1, "{}", f.message);
        assert_eq!(f.message.matches("127.0.0.1:1").count(), 2, "{}", f.message);
        assert_eq!(f.kind, "connection_refused");
        assert!(f.hint.unwrap().contains("is `ferry serve` running"));
    }

    #[test]
    fn magic_says_what_answered() {
        assert!(not_ferry_hint(b"HTTP").contains("HTTP server"));
        assert!(not_ferry_hint(&[0x16, 0x03, 0x01, 0x00]).contains("TLS"));
        assert!(not_ferry_hint(b"abcd").contains("not a Ferry peer"));
        assert!(not_ferry_hint(b"{\"re").contains("`ferry publish` control port"));
    }

    #[test]
    fn a_stalled_source_is_its_own_kind_with_a_hint_and_every_failure_has_one() {
        let stalled = ferry_broadcast::BroadcastError::Stalled {
            name: "w".into(),
            version: 1,
            holder: "the source 127.0.0.1:7501 (id abc)".into(),
            reason: "sent nothing for 3.0 s while a chunk was requested from it".into(),
            verified: 3,
            chunks: 10,
            bytes: 3,
            total: 10,
        };
        let f = Failure::of(&anyhow::Error::new(stalled), Server::Publish);
        assert_eq!(f.kind, "stalled");
        let hint = f.hint.unwrap_or_default();
        assert!(!hint.contains("  "), "{hint}");
        assert!(
            hint.starts_with("the source 127.0.0.1:7501 stopped sending")
                && hint.contains("`ferry publish`"),
            "{hint}"
        );
        let f = Failure::of(
            &anyhow::anyhow!("something nobody foresaw"),
            Server::Publish,
        );
        assert_eq!(f.kind, "error");
        assert!(f.hint.is_some_and(|h| h.contains("-v")));
    }
}
