//! What the metadata server answers, IO-free: the key-value [`Store`] and its
//! [`handle`](Store::handle), Mooncake's HTTP metadata protocol.
//!
//! - `GET /metadata?key=K`: 200 with the stored bytes (`application/json`), or 404
//!   `metadata not found`.
//! - `PUT /metadata?key=K`: stores the body, 200 `metadata updated`. A key containing
//!   `rpc_meta` (an engine's RPC address, `mooncake/rpc_meta/NAME`) that is already stored is
//!   not overwritten: the same bytes again are 200 `metadata unchanged`, other bytes 400
//!   `Duplicate rpc_meta key not allowed` (two engines claiming one name), as Mooncake's own
//!   server (`mooncake-store/src/http_metadata_server.cpp`) answers.
//! - `DELETE /metadata?key=K`: 200 `metadata deleted`, or 404 `metadata not found`.
//! - `/metadata` without a key (or with an empty one): 400 `Missing key parameter`; another
//!   method: 405. `GET /health`: 200 `OK`. Any other path: 404.
//!
//! The key is the first `key` parameter of the query, percent-decoded (`+` is a space, as in a
//! form); a malformed escape is 400.
//!
//! Ferry's own additions, which a client that does not know them never meets:
//!
//! - **Owned records.** A PUT that stores a record with a `Ferry-Owner-Token: SECRET` header
//!   (16 to 256 visible ASCII characters, else 400) makes the record owned: only the SHA-256 of
//!   the secret is kept, and a later PUT or DELETE of that key without the same secret is 403
//!   `metadata owned by another client`, the record untouched. Ferry's engines
//!   (`ferry.mooncake`) send one. A record stored without a token is anyone's, as in
//!   Mooncake's protocol: any PUT replaces it, and a PUT with a token over it makes it owned.
//!   GET stays open to all.
//! - **Bounded state.** At most [`Limits::max_entries`] records, and [`Limits::max_bytes`] of
//!   keys and values together (a record itself is at most
//!   [`MAX_BODY`](super::http::MAX_BODY), refused before it is read); a PUT past either is 507
//!   `metadata store full: ...`, nothing stored. Replacing a record counts only what it adds.

use std::collections::HashMap;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::http::{Body, Response};

/// Records at most, by default.
pub(crate) const MAX_ENTRIES: usize = 65_536;
/// Bytes of keys and values together at most, by default.
pub(crate) const MAX_BYTES: usize = 128 << 20;
/// The shortest owner token taken (a guessable one would protect nothing).
pub(crate) const MIN_TOKEN: usize = 16;
/// The longest owner token taken.
pub(crate) const MAX_TOKEN: usize = 256;

/// What a store holds at most.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Records.
    pub(crate) max_entries: usize,
    /// Bytes of keys and values together.
    pub(crate) max_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_entries: MAX_ENTRIES,
            max_bytes: MAX_BYTES,
        }
    }
}

/// The SHA-256 of an owner token: all a store keeps of it.
type Owner = [u8; 32];

/// One record.
#[derive(Debug)]
struct Entry {
    value: Arc<Vec<u8>>,
    /// Set when a PUT with a token stored it.
    owner: Option<Owner>,
}

/// The `Content-Type` of every `/metadata` answer, as Mooncake's servers send it.
pub(crate) const JSON: &str = "application/json";

/// The metadata: keys (bytes, as decoded from the query) to the bytes last PUT, within
/// [`Limits`].
#[derive(Debug, Default)]
pub(crate) struct Store {
    entries: HashMap<Vec<u8>, Entry>,
    /// Bytes of keys and values stored.
    bytes: usize,
    limits: Limits,
}

fn json(status: u16, text: &'static str) -> Response {
    Response {
        status,
        content_type: JSON,
        allow: None,
        body: Body::Text(text),
    }
}

impl Store {
    pub(crate) fn new(limits: Limits) -> Self {
        Self {
            limits,
            ..Self::default()
        }
    }

    /// Entries stored.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Bytes of keys and values stored.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// The answer to `method target` with `body` (and the `Ferry-Owner-Token` header's value
    /// `token`, if sent), the store changed accordingly.
    pub(crate) fn handle(
        &mut self,
        method: &str,
        target: &str,
        token: Option<&[u8]>,
        body: Vec<u8>,
    ) -> Response {
        let target = target.split_once('#').map_or(target, |(t, _)| t);
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        match path {
            "/metadata" => self.metadata(method, query, token, body),
            "/health" => match method {
                "GET" | "HEAD" => Response::text(200, "OK"),
                _ => Response {
                    allow: Some("GET, HEAD"),
                    ..Response::text(405, "Method not allowed")
                },
            },
            _ => Response::text(404, "404 page not found"),
        }
    }

    fn metadata(
        &mut self,
        method: &str,
        query: &str,
        token: Option<&[u8]>,
        mut body: Vec<u8>,
    ) -> Response {
        if !matches!(method, "GET" | "PUT" | "DELETE") {
            return Response {
                allow: Some("GET, PUT, DELETE"),
                ..json(405, "Method not allowed")
            };
        }
        let key = match query_value(query, "key") {
            Err(BadEscape) => return json(400, "malformed percent-encoding in the query"),
            Ok(None) => return json(400, "Missing key parameter"),
            Ok(Some(k)) if k.is_empty() => return json(400, "Missing key parameter"),
            Ok(Some(k)) => k,
        };
        if method == "GET" {
            return match self.entries.get(&key) {
                Some(entry) => Response {
                    body: Body::Bytes(entry.value.clone()),
                    ..json(200, "")
                },
                None => json(404, "metadata not found"),
            };
        }
        let token = match token.map(owner_of).transpose() {
            Ok(t) => t,
            Err(BadToken) => {
                return json(
                    400,
                    "Ferry-Owner-Token must be 16 to 256 visible ASCII characters",
                );
            }
        };
        let stored = self.entries.get(&key);
        if let Some(owner) = stored.and_then(|e| e.owner.as_ref())
            && !token.is_some_and(|t| same_owner(&t, owner))
        {
            return json(
                403,
                "metadata owned by another client: its Ferry-Owner-Token is required",
            );
        }
        if method == "DELETE" {
            return match self.entries.remove(&key) {
                Some(entry) => {
                    self.bytes -= key.len() + entry.value.len();
                    json(200, "metadata deleted")
                }
                None => json(404, "metadata not found"),
            };
        }
        if contains(&key, b"rpc_meta")
            && let Some(stored) = stored
        {
            return if *stored.value == body {
                json(200, "metadata unchanged")
            } else {
                json(400, "Duplicate rpc_meta key not allowed")
            };
        }
        let freed = stored.map_or(0, |e| key.len() + e.value.len());
        if stored.is_none() && self.entries.len() >= self.limits.max_entries {
            return json(507, "metadata store full: too many records");
        }
        if self.bytes - freed + key.len() + body.len() > self.limits.max_bytes {
            return json(507, "metadata store full: no room for this record's bytes");
        }
        // The body was read into a buffer that may have grown past it.
        body.shrink_to_fit();
        // A record stays its owner's; one that had none takes the token it is PUT with.
        let owner = stored.and_then(|e| e.owner).or(token);
        self.bytes = self.bytes - freed + key.len() + body.len();
        self.entries.insert(
            key,
            Entry {
                value: Arc::new(body),
                owner,
            },
        );
        json(200, "metadata updated")
    }
}

/// An owner token that is too short, too long or not visible ASCII.
#[derive(Debug, PartialEq, Eq)]
struct BadToken;

/// What a store keeps of owner token `token`.
fn owner_of(token: &[u8]) -> Result<Owner, BadToken> {
    if !(MIN_TOKEN..=MAX_TOKEN).contains(&token.len()) || !token.iter().all(u8::is_ascii_graphic) {
        return Err(BadToken);
    }
    Ok(Sha256::new()
        .chain_update(b"ferry metadata-server owner token\0")
        .chain_update(token)
        .finalize()
        .into())
}

/// Whether two owners are one, in time that does not depend on where they differ.
fn same_owner(a: &Owner, b: &Owner) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// A `%` not followed by two hex digits.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct BadEscape;

/// The first value of parameter `name` in `query` (`a=1&b=2`), decoded; a parameter without
/// `=` has the empty value.
pub(crate) fn query_value(query: &str, name: &str) -> Result<Option<Vec<u8>>, BadEscape> {
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (n, v) = pair.split_once('=').unwrap_or((pair, ""));
        if form_decode(n)? == name.as_bytes() {
            return form_decode(v).map(Some);
        }
    }
    Ok(None)
}

/// `s` with `%XX` escapes decoded and `+` as a space.
fn form_decode(s: &str) -> Result<Vec<u8>, BadEscape> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = |j: usize| {
                    b.get(j)
                        .and_then(|c| (*c as char).to_digit(16))
                        .ok_or(BadEscape)
                };
                out.push((hex(i + 1)? * 16 + hex(i + 2)?) as u8);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(s: &mut Store, method: &str, target: &str, body: &[u8]) -> (u16, Vec<u8>) {
        let r = s.handle(method, target, None, body.to_vec());
        if target == "/metadata" || target.starts_with("/metadata?") {
            assert_eq!(r.content_type, JSON, "{method} {target}");
        }
        (r.status, r.body.as_bytes().to_vec())
    }

    #[test]
    fn put_get_delete() {
        let mut s = Store::new(Limits::default());
        let t = "/metadata?key=mooncake%2Fram%2Fhost%3A1";
        assert_eq!(
            call(&mut s, "GET", t, b""),
            (404, b"metadata not found".to_vec())
        );
        assert_eq!(
            call(&mut s, "PUT", t, b"{\"a\":1}"),
            (200, b"metadata updated".to_vec())
        );
        assert_eq!(call(&mut s, "GET", t, b""), (200, b"{\"a\":1}".to_vec()));
        // The decoded key is the key, however it was escaped.
        assert_eq!(
            call(&mut s, "GET", "/metadata?key=mooncake/ram/host:1", b""),
            (200, b"{\"a\":1}".to_vec())
        );
        assert_eq!(call(&mut s, "PUT", t, b"{\"a\":2}").0, 200);
        assert_eq!(call(&mut s, "GET", t, b"").1, b"{\"a\":2}");
        assert_eq!(s.len(), 1);
        assert_eq!(
            call(&mut s, "DELETE", t, b""),
            (200, b"metadata deleted".to_vec())
        );
        assert_eq!(
            call(&mut s, "DELETE", t, b""),
            (404, b"metadata not found".to_vec())
        );
        assert_eq!(call(&mut s, "GET", t, b"").0, 404);
        assert_eq!(s.len(), 0);
    }

    #[test]
    fn empty_values_and_odd_keys() {
        let mut s = Store::new(Limits::default());
        assert_eq!(call(&mut s, "PUT", "/metadata?key=a+b", b"").0, 200);
        assert_eq!(
            call(&mut s, "GET", "/metadata?key=a%20b", b""),
            (200, vec![])
        );
        assert_eq!(
            call(&mut s, "PUT", "/metadata?x=1&key=%FF%00&key=other", b"v").0,
            200
        );
        assert_eq!(call(&mut s, "GET", "/metadata?key=%ff%00", b"").1, b"v");
        assert_eq!(call(&mut s, "GET", "/metadata?key=other", b"").0, 404);
        assert_eq!(
            call(&mut s, "GET", "/metadata?key=%ff%00#frag", b"").1,
            b"v"
        );
    }

    #[test]
    fn rpc_meta_keys_are_not_overwritten() {
        let mut s = Store::new(Limits::default());
        let t = "/metadata?key=mooncake%2Frpc_meta%2F10.0.0.1%3A12384";
        let a = br#"{"ip_or_host_name":"10.0.0.1","rpc_port":15228}"#;
        let b = br#"{"ip_or_host_name":"10.0.0.1","rpc_port":16000}"#;
        assert_eq!(
            call(&mut s, "PUT", t, a),
            (200, b"metadata updated".to_vec())
        );
        assert_eq!(
            call(&mut s, "PUT", t, a),
            (200, b"metadata unchanged".to_vec())
        );
        assert_eq!(
            call(&mut s, "PUT", t, b),
            (400, b"Duplicate rpc_meta key not allowed".to_vec())
        );
        assert_eq!(call(&mut s, "GET", t, b"").1, a);
        // Deleted, it may be claimed again.
        assert_eq!(call(&mut s, "DELETE", t, b"").0, 200);
        assert_eq!(call(&mut s, "PUT", t, b).0, 200);
        assert_eq!(call(&mut s, "GET", t, b"").1, b);
    }

    /// `method target` with owner token `token`: (status, body).
    fn with(s: &mut Store, method: &str, target: &str, token: &str, body: &[u8]) -> (u16, Vec<u8>) {
        let r = s.handle(method, target, Some(token.as_bytes()), body.to_vec());
        (r.status, r.body.as_bytes().to_vec())
    }

    #[test]
    fn a_record_put_with_a_token_is_changed_only_with_it() {
        let mut s = Store::new(Limits::default());
        let t = "/metadata?key=mooncake%2Fferry%2Fprefill";
        let owner = "0123456789abcdef-the-owner";
        let stranger = "0123456789abcdef-a-stranger";
        let forbidden = (
            403,
            b"metadata owned by another client: its Ferry-Owner-Token is required".to_vec(),
        );
        assert_eq!(
            with(&mut s, "PUT", t, owner, b"mine"),
            (200, b"metadata updated".to_vec())
        );
        // A stranger, with no token or another, neither replaces nor deletes it.
        assert_eq!(call(&mut s, "PUT", t, b"theirs"), forbidden);
        assert_eq!(with(&mut s, "PUT", t, stranger, b"theirs"), forbidden);
        assert_eq!(call(&mut s, "DELETE", t, b""), forbidden);
        assert_eq!(with(&mut s, "DELETE", t, stranger, b""), forbidden);
        // Everyone reads it.
        assert_eq!(call(&mut s, "GET", t, b""), (200, b"mine".to_vec()));
        // Its owner replaces it (and keeps it) and deletes it.
        assert_eq!(with(&mut s, "PUT", t, owner, b"mine, 2").0, 200);
        assert_eq!(call(&mut s, "PUT", t, b"theirs"), forbidden);
        assert_eq!(call(&mut s, "GET", t, b"").1, b"mine, 2");
        assert_eq!(with(&mut s, "DELETE", t, owner, b"").0, 200);
        assert_eq!((s.len(), s.bytes()), (0, 0));
        // Deleted, anyone may claim the name again.
        assert_eq!(with(&mut s, "PUT", t, stranger, b"theirs").0, 200);
        assert_eq!(with(&mut s, "PUT", t, owner, b"mine"), forbidden);
    }

    #[test]
    fn a_record_without_a_token_is_anyones_as_in_mooncake() {
        let mut s = Store::new(Limits::default());
        let t = "/metadata?key=mooncake%2Fram%2Fhost%3A1";
        assert_eq!(call(&mut s, "PUT", t, b"a").0, 200);
        assert_eq!(call(&mut s, "PUT", t, b"b").0, 200);
        // A PUT with a token takes it, and from then on it is owned.
        let token = "0123456789abcdef";
        assert_eq!(with(&mut s, "PUT", t, token, b"c").0, 200);
        assert_eq!(call(&mut s, "PUT", t, b"d").0, 403);
        assert_eq!(call(&mut s, "DELETE", t, b"").0, 403);
        assert_eq!(call(&mut s, "GET", t, b"").1, b"c");
        // A token of the wrong shape is refused, nothing changed.
        for bad in [
            "0123456789abcde",
            "0123456789abcdef 0",
            "0123456789abcdef\u{e9}",
        ] {
            let r = with(&mut s, "PUT", "/metadata?key=other", bad, b"x");
            assert_eq!(r.0, 400, "{bad:?}");
        }
        let long = "x".repeat(MAX_TOKEN + 1);
        assert_eq!(
            with(&mut s, "PUT", "/metadata?key=other", &long, b"x").0,
            400
        );
        assert_eq!(
            with(&mut s, "PUT", "/metadata?key=other", &long[1..], b"x").0,
            200
        );
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn records_and_bytes_are_capped() {
        let mut s = Store::new(Limits {
            max_entries: 3,
            max_bytes: 100,
        });
        let full_records = (507, b"metadata store full: too many records".to_vec());
        let full_bytes = (
            507,
            b"metadata store full: no room for this record's bytes".to_vec(),
        );
        for k in ["a", "b", "c"] {
            assert_eq!(
                call(&mut s, "PUT", &format!("/metadata?key={k}"), b"0123456789").0,
                200
            );
        }
        assert_eq!(s.bytes(), 33);
        assert_eq!(call(&mut s, "PUT", "/metadata?key=d", b""), full_records);
        // Replacing a record is no new record, and counts only the bytes it adds.
        assert_eq!(call(&mut s, "PUT", "/metadata?key=a", &[b'x'; 77]).0, 200);
        assert_eq!(s.bytes(), 100);
        assert_eq!(
            call(&mut s, "PUT", "/metadata?key=b", &[b'x'; 11]),
            full_bytes
        );
        assert_eq!(call(&mut s, "PUT", "/metadata?key=b", &[b'x'; 10]).0, 200);
        assert_eq!(call(&mut s, "GET", "/metadata?key=b", b"").1, [b'x'; 10]);
        // Deleting makes room.
        assert_eq!(call(&mut s, "DELETE", "/metadata?key=a", b"").0, 200);
        assert_eq!((s.len(), s.bytes()), (2, 22));
        assert_eq!(call(&mut s, "PUT", "/metadata?key=d", &[b'y'; 77]).0, 200);
        assert_eq!(call(&mut s, "PUT", "/metadata?key=e", b""), full_records);
        // The key's bytes count too.
        assert_eq!(call(&mut s, "DELETE", "/metadata?key=d", b"").0, 200);
        assert_eq!(
            call(&mut s, "PUT", "/metadata?key=dd", &[b'y'; 77]),
            full_bytes
        );
        assert_eq!((s.len(), s.bytes()), (2, 22));
    }

    #[test]
    fn refusals() {
        let mut s = Store::new(Limits::default());
        for t in [
            "/metadata",
            "/metadata?",
            "/metadata?key=",
            "/metadata?keys=a&k=b",
        ] {
            for m in ["GET", "PUT", "DELETE"] {
                assert_eq!(
                    call(&mut s, m, t, b"x"),
                    (400, b"Missing key parameter".to_vec()),
                    "{m} {t}"
                );
            }
        }
        assert_eq!(call(&mut s, "GET", "/metadata?key=%4", b"").0, 400);
        assert_eq!(call(&mut s, "GET", "/metadata?key=%zz", b"").0, 400);
        assert_eq!(call(&mut s, "GET", "/metadata?k%=1", b"").0, 400);
        let r = s.handle("POST", "/metadata?key=a", None, b"x".to_vec());
        assert_eq!((r.status, r.allow), (405, Some("GET, PUT, DELETE")));
        assert_eq!(call(&mut s, "HEAD", "/metadata?key=a", b"").0, 405);
        assert_eq!(call(&mut s, "get", "/metadata?key=a", b"").0, 405);
        assert_eq!(call(&mut s, "GET", "/metadata/x?key=a", b"").0, 404);
        assert_eq!(call(&mut s, "PUT", "/", b"x").0, 404);
        assert_eq!(call(&mut s, "GET", "*", b"").0, 404);
        assert_eq!(s.len(), 0, "nothing refused was stored");
    }

    #[test]
    fn health() {
        let mut s = Store::new(Limits::default());
        assert_eq!(call(&mut s, "GET", "/health", b""), (200, b"OK".to_vec()));
        assert_eq!(call(&mut s, "PUT", "/health", b"").0, 405);
    }

    #[test]
    fn query_values() {
        assert_eq!(
            query_value("a=1&key=x%2By+z", "key"),
            Ok(Some(b"x+y z".to_vec()))
        );
        assert_eq!(query_value("key", "key"), Ok(Some(vec![])));
        assert_eq!(query_value("k%65y=v", "key"), Ok(Some(b"v".to_vec())));
        assert_eq!(query_value("a=1&&b", "key"), Ok(None));
        assert_eq!(query_value("key=%", "key"), Err(BadEscape));
        assert_eq!(query_value("key=%+1", "key"), Err(BadEscape));
    }
}
