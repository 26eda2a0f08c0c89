//! How many data streams one key name may hold attached to a server at once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

/// The default of [`StreamCap`]: data streams attached at once under one key name (or, on a
/// server without keys, in all).
pub const DEFAULT_STREAMS_PER_KEY: usize = 1024;

/// Counts the data streams attached under each key name and admits a new one only below the
/// cap, so that one key holder cannot pin an unbounded number of streams (sockets, tasks,
/// buffers) on a server. Shared by the streams of one server (every plane it serves); a stream
/// holds its [`StreamPermit`] for its life. Peers without a key (a server without keys) count as
/// one name.
#[derive(Debug)]
pub struct StreamCap {
    per_key: usize,
    held: Mutex<HashMap<Option<Arc<str>>, usize>>,
}

/// One attached stream's place under its key name's cap; dropping it frees the place.
#[derive(Debug)]
pub struct StreamPermit {
    cap: Arc<StreamCap>,
    key: Option<Arc<str>>,
}

/// A stream refused: its key name already holds the cap's worth.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{held} data streams are attached under {} now, the cap of this server", key_label(.key.as_deref()))]
pub struct CapReached {
    /// The key name (`None`: a peer without a key).
    pub key: Option<Arc<str>>,
    /// Streams it holds.
    pub held: usize,
}

fn key_label(key: Option<&str>) -> String {
    match key {
        Some(k) => format!("key name {k:?}"),
        None => "peers without a key".into(),
    }
}

impl StreamCap {
    /// A cap of `per_key` streams (at least 1) per key name.
    pub fn new(per_key: usize) -> Arc<Self> {
        Arc::new(Self {
            per_key: per_key.max(1),
            held: Mutex::new(HashMap::new()),
        })
    }

    /// The cap.
    pub fn per_key(&self) -> usize {
        self.per_key
    }

    /// Streams attached under `key` now.
    pub fn held(&self, key: Option<&str>) -> usize {
        let held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.get(&key.map(Arc::from)).copied().unwrap_or(0)
    }

    /// A place for one more stream under `key`, or the refusal when it holds the cap's worth.
    pub fn admit(self: &Arc<Self>, key: Option<Arc<str>>) -> Result<StreamPermit, CapReached> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let n = held.entry(key.clone()).or_insert(0);
        if *n >= self.per_key {
            return Err(CapReached { key, held: *n });
        }
        *n += 1;
        Ok(StreamPermit {
            cap: self.clone(),
            key,
        })
    }
}

impl Drop for StreamPermit {
    fn drop(&mut self) {
        let mut held = self.cap.held.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = held.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cap holds per key name; a dropped permit frees its place; keyless peers are one name;
    /// the table keeps no entry for a name with nothing attached.
    #[test]
    fn streams_are_capped_per_key_name_and_released_on_drop() {
        let cap = StreamCap::new(2);
        let alice: Option<Arc<str>> = Some("alice".into());
        let a1 = cap.admit(alice.clone()).unwrap();
        let _a2 = cap.admit(alice.clone()).unwrap();
        let refused = cap.admit(alice.clone()).unwrap_err();
        assert_eq!(refused.held, 2);
        assert!(refused.to_string().contains("\"alice\""), "{refused}");
        let _b = cap.admit(Some("bob".into())).unwrap();
        let _k1 = cap.admit(None).unwrap();
        let _k2 = cap.admit(None).unwrap();
        assert!(cap.admit(None).is_err());
        drop(a1);
        assert_eq!(cap.held(Some("alice")), 1);
        let _a3 = cap.admit(alice).unwrap();
        drop(_b);
        assert!(!cap.held.lock().unwrap().contains_key(&Some("bob".into())));
    }
}
