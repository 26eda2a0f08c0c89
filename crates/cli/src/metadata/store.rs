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

use std::collections::HashMap;
use std::sync::Arc;

use super::http::{Body, Response};

/// The `Content-Type` of every `/metadata` answer, as Mooncake's servers send it.
pub(crate) const JSON: &str = "application/json";

/// The metadata: keys (bytes, as decoded from the query) to the bytes last PUT.
#[derive(Debug, Default)]
pub(crate) struct Store {
    entries: HashMap<Vec<u8>, Arc<Vec<u8>>>,
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
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Entries stored.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// The answer to `method target` with `body`, the store changed accordingly.
    pub(crate) fn handle(&mut self, method: &str, target: &str, body: Vec<u8>) -> Response {
        let target = target.split_once('#').map_or(target, |(t, _)| t);
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        match path {
            "/metadata" => self.metadata(method, query, body),
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

    fn metadata(&mut self, method: &str, query: &str, body: Vec<u8>) -> Response {
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
        match method {
            "GET" => match self.entries.get(&key) {
                Some(value) => Response {
                    body: Body::Bytes(value.clone()),
                    ..json(200, "")
                },
                None => json(404, "metadata not found"),
            },
            "PUT" => {
                if contains(&key, b"rpc_meta")
                    && let Some(stored) = self.entries.get(&key)
                {
                    return if **stored == body {
                        json(200, "metadata unchanged")
                    } else {
                        json(400, "Duplicate rpc_meta key not allowed")
                    };
                }
                self.entries.insert(key, Arc::new(body));
                json(200, "metadata updated")
            }
            _ => match self.entries.remove(&key) {
                Some(_) => json(200, "metadata deleted"),
                None => json(404, "metadata not found"),
            },
        }
    }
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
        let r = s.handle(method, target, body.to_vec());
        if target == "/metadata" || target.starts_with("/metadata?") {
            assert_eq!(r.content_type, JSON, "{method} {target}");
        }
        (r.status, r.body.as_bytes().to_vec())
    }

    #[test]
    fn put_get_delete() {
        let mut s = Store::new();
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
        let mut s = Store::new();
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
        let mut s = Store::new();
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

    #[test]
    fn refusals() {
        let mut s = Store::new();
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
        let r = s.handle("POST", "/metadata?key=a", b"x".to_vec());
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
        let mut s = Store::new();
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
