//! Notifications: short messages peers send this engine (one control connection each, after
//! their handshake's authentication where keys are in use), kept in a bounded inbox until the
//! application takes them. The layers above give them meaning: Mooncake's `TransferNotify`,
//! NIXL's notifications.
//!
//! A sender calls [`TransferEngine::notify`](crate::TransferEngine::notify) once the transfer
//! the message speaks of has completed, so a notification never arrives before the bytes of
//! the transfer it follows. The inbox holds at most [`MAX_MESSAGES`] messages and
//! [`MAX_BYTES`] bytes, and each sender at most its share of them ([`MAX_SENDER_MESSAGES`],
//! [`MAX_SENDER_BYTES`]), so that one sender cannot crowd the others out; past any of these, a
//! notification is refused (the sender's call fails with `HandshakeRefused` saying so), never an
//! older one dropped. A sender is the key name it proved where the server requires keys
//! (every peer holding that key shares its share), otherwise the peer id it claims: without
//! keys nothing is proven, and a sender that claims many peer ids takes many shares.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Mutex, PoisonError};

use ferry_core::{Epoch, PeerId};

/// Messages the inbox holds at most.
pub const MAX_MESSAGES: usize = 65_536;

/// Bytes of messages the inbox holds at most.
pub const MAX_BYTES: usize = 64 << 20;

/// Messages the inbox holds at most from one sender (its proven key name, or without keys its
/// peer id): an eighth of [`MAX_MESSAGES`].
pub const MAX_SENDER_MESSAGES: usize = MAX_MESSAGES / 8;

/// Bytes of messages the inbox holds at most from one sender: an eighth of [`MAX_BYTES`].
pub const MAX_SENDER_BYTES: usize = MAX_BYTES / 8;

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
    /// Messages and bytes held per sender; a sender holding none has no entry.
    held: HashMap<Sender, Held>,
}

/// Whom a notification's share is counted against.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Sender {
    /// The key name the sender proved.
    Key(String),
    /// Without keys: the peer id the sender claims.
    Peer(PeerId),
}

impl Sender {
    fn of(n: &Notification) -> Self {
        match &n.key_name {
            Some(k) => Self::Key(k.clone()),
            None => Self::Peer(n.from),
        }
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Held {
    messages: usize,
    bytes: usize,
}

impl Inbox {
    /// Adds `n`, or says why not (the inbox is full, or its sender's share is).
    pub(crate) fn push(&self, n: Notification) -> Result<(), String> {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let len = n.message.len();
        if st.queue.len() >= MAX_MESSAGES || st.bytes + len > MAX_BYTES {
            return Err(format!(
                "the inbox is full ({} notifications, {} bytes; at most {MAX_MESSAGES} and \
                 {MAX_BYTES}): the application takes none",
                st.queue.len(),
                st.bytes
            ));
        }
        let sender = Sender::of(&n);
        let held = st.held.get(&sender).copied().unwrap_or_default();
        if held.messages >= MAX_SENDER_MESSAGES || held.bytes + len > MAX_SENDER_BYTES {
            return Err(format!(
                "this sender's share of the inbox is full ({} notifications, {} bytes; at most \
                 {MAX_SENDER_MESSAGES} and {MAX_SENDER_BYTES} per sender): the application \
                 takes none",
                held.messages, held.bytes
            ));
        }
        st.held.insert(
            sender,
            Held {
                messages: held.messages + 1,
                bytes: held.bytes + len,
            },
        );
        st.bytes += len;
        st.queue.push_back(n);
        Ok(())
    }

    /// Every notification held, oldest first; the inbox is empty after.
    pub(crate) fn take(&self) -> Vec<Notification> {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.bytes = 0;
        st.held.clear();
        st.queue.drain(..).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(len: usize) -> Notification {
        from(1, None, len)
    }

    fn from(peer: u128, key_name: Option<&str>, len: usize) -> Notification {
        Notification {
            from: PeerId(peer),
            epoch: Epoch(2),
            name: "a".into(),
            key_name: key_name.map(str::to_owned),
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
        // Eight senders fill the bytes, each to its share but the last 10 bytes.
        for peer in 0..8 {
            let len = MAX_SENDER_BYTES - if peer == 7 { 10 } else { 0 };
            inbox.push(from(peer, None, len)).unwrap();
        }
        let e = inbox.push(from(8, None, 11)).unwrap_err();
        assert!(e.contains("the inbox is full"), "{e}");
        inbox.push(from(8, None, 10)).unwrap();
        assert_eq!(inbox.take().len(), 9);
        // Eight senders fill the count.
        for i in 0..MAX_MESSAGES {
            inbox
                .push(from((i / MAX_SENDER_MESSAGES) as u128, None, 0))
                .unwrap();
        }
        let e = inbox.push(from(99, None, 0)).unwrap_err();
        assert!(e.contains("the inbox is full"), "{e}");
        assert_eq!(inbox.take().len(), MAX_MESSAGES);
    }

    /// One sender filling what it may (in count, then in bytes) leaves room for another's, and
    /// a sender is its proven key name where there is one, whatever peer id it claims.
    #[test]
    fn one_sender_cannot_crowd_another_out() {
        let inbox = Inbox::default();
        let mut sent = 0;
        while inbox.push(from(1, None, 0)).is_ok() {
            sent += 1;
            assert!(sent <= MAX_MESSAGES, "one sender filled the whole inbox");
        }
        assert_eq!(sent, MAX_SENDER_MESSAGES);
        let e = inbox.push(from(1, None, 0)).unwrap_err();
        assert!(e.contains("share"), "{e}");
        inbox.push(from(2, None, 5)).unwrap();
        let got = inbox.take();
        assert_eq!(got.len(), MAX_SENDER_MESSAGES + 1);
        assert_eq!(got.last().unwrap().from, PeerId(2));
        // Taking frees the share.
        inbox.push(from(1, None, 0)).unwrap();
        inbox.take();

        // In bytes, and under a key name: other peer ids proving the same key share its share.
        let big = ferry_core::wire::MAX_NOTIFY_LEN;
        let mut peer = 10;
        while inbox.push(from(peer, Some("mallory"), big)).is_ok() {
            peer += 1;
            assert!(
                peer < 10 + (MAX_BYTES / big) as u128,
                "one key filled the whole inbox"
            );
        }
        assert_eq!((peer - 10) as usize, MAX_SENDER_BYTES / big);
        inbox.push(from(peer, Some("alice"), big)).unwrap();
        // Without keys, a peer id is its own sender.
        inbox.push(from(peer, None, big)).unwrap();
        assert_eq!(inbox.take().len(), MAX_SENDER_BYTES / big + 2);
    }
}
