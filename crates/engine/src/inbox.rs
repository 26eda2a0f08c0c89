//! Notifications: short messages peers send this engine (one control connection each, after
//! their handshake's authentication where keys are in use), kept in a bounded inbox until the
//! application takes them. The layers above give them meaning: Mooncake's `TransferNotify`,
//! NIXL's notifications.
//!
//! A sender calls [`TransferEngine::notify`](crate::TransferEngine::notify) once the transfer
//! the message speaks of has completed, so a notification never arrives before the bytes of
//! the transfer it follows. The inbox holds at most [`MAX_MESSAGES`] messages and
//! [`MAX_BYTES`] bytes; past either, a notification is refused (the sender's call fails with
//! `HandshakeRefused` saying so), never an older one dropped.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Mutex, PoisonError};

use ferry_core::{Epoch, PeerId};

/// Messages the inbox holds at most.
pub const MAX_MESSAGES: usize = 65_536;

/// Bytes of messages the inbox holds at most.
pub const MAX_BYTES: usize = 64 << 20;

/// A notification as it arrived.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Notification {
    /// The sender's peer id.
    pub from: PeerId,
    /// The sender's epoch.
    pub epoch: Epoch,
    /// The name the sender gave itself (an agent's name, say); not proven.
    pub name: String,
    /// The key name the sender proved, where the server requires keys.
    pub key_name: Option<String>,
    /// Where it came from.
    pub addr: SocketAddr,
    /// The message.
    pub message: Vec<u8>,
}

/// The bounded inbox (no I/O).
#[derive(Debug, Default)]
pub(crate) struct Inbox {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    queue: VecDeque<Notification>,
    bytes: usize,
}

impl Inbox {
    /// Adds `n`, or says why not (the inbox is full).
    pub(crate) fn push(&self, n: Notification) -> Result<(), String> {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if st.queue.len() >= MAX_MESSAGES || st.bytes + n.message.len() > MAX_BYTES {
            return Err(format!(
                "the inbox is full ({} notifications, {} bytes; at most {MAX_MESSAGES} and \
                 {MAX_BYTES}): the application takes none",
                st.queue.len(),
                st.bytes
            ));
        }
        st.bytes += n.message.len();
        st.queue.push_back(n);
        Ok(())
    }

    /// Every notification held, oldest first; the inbox is empty after.
    pub(crate) fn take(&self) -> Vec<Notification> {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.bytes = 0;
        st.queue.drain(..).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(len: usize) -> Notification {
        Notification {
            from: PeerId(1),
            epoch: Epoch(2),
            name: "a".into(),
            key_name: None,
            addr: "127.0.0.1:1".parse().unwrap(),
            message: vec![7; len],
        }
    }

    #[test]
    fn notifications_come_out_in_order_and_once() {
        let inbox = Inbox::default();
        for len in [1, 2, 3] {
            inbox.push(n(len)).unwrap();
        }
        let got: Vec<usize> = inbox.take().iter().map(|n| n.message.len()).collect();
        assert_eq!(got, [1, 2, 3]);
        assert!(inbox.take().is_empty());
    }

    #[test]
    fn a_full_inbox_refuses_the_new_one_and_keeps_the_old() {
        let inbox = Inbox::default();
        inbox.push(n(MAX_BYTES - 10)).unwrap();
        let e = inbox.push(n(11)).unwrap_err();
        assert!(e.contains("full"), "{e}");
        inbox.push(n(10)).unwrap();
        assert_eq!(inbox.take().len(), 2);
        inbox.push(n(11)).unwrap();
        for _ in 1..MAX_MESSAGES {
            inbox.push(n(0)).unwrap();
        }
        assert!(inbox.push(n(0)).is_err());
        assert_eq!(inbox.take().len(), MAX_MESSAGES);
    }
}
