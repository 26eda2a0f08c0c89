//! Who owns a client stream's bytes, and when: the rules by which the stream's ring, a thread
//! that submits to the idle stream itself, the task awaiting a request it sent so, and the ring
//! taking the reading over after a tick share the stream's socket. No I/O: the stream's lock
//! ([`StreamShared`](super::state::StreamShared)) holds this state with the stream protocol, and
//! each of them asks it before touching the socket.
//!
//! - The send side: the ring claims it while it takes or sends a chunk; a submitter sends
//!   directly only on a stream whose send side and receive side are both free, and what the
//!   kernel did not take of its send (the tail) waits for the ring, which sends it before
//!   anything else.
//! - The receive side has one reader: the ring, or the task awaiting the one request it sent
//!   directly (a caller, numbered by a token). The ring takes the reading back when it takes a
//!   new chunk, or when a response waited unread for a tick; the caller gives it back when its
//!   chunk is resolved, when it is dropped, or when it meets the stream's end. A token that is
//!   no longer the reader changes nothing.
//! - The response header read so far and a READ payload's progress are the stream's, not a
//!   reader's: whoever reads next goes on from there.
//! - While the ring has a receive armed (or its result not taken yet), no submitter becomes a
//!   reader.

use ferry_core::wire::DATA_RESPONSE_LEN;

/// Who reads a stream's responses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reader {
    /// The stream's ring, with a receive armed on its ring while chunks are in flight.
    Ring,
    /// The task that awaits the one chunk in flight (its number): it receives without blocking
    /// when its runtime's reactor says the socket is readable, so no thread is woken but the
    /// one that runs it.
    Caller(u64),
}

/// The ownership of one stream's send and receive sides; `P` is what a READ's payload is
/// received for (its chunk).
#[derive(Debug)]
pub(crate) struct Owners<P> {
    /// The ring is taking or sending a chunk (or a tail): nobody else writes the socket.
    sending: bool,
    /// Bytes of a submitter's send that the kernel did not take at once.
    tail: Vec<u8>,
    reader: Reader,
    /// The last caller's number.
    readers: u64,
    /// The response header read so far (`header_at` bytes of it), by whichever reader.
    header: [u8; DATA_RESPONSE_LEN],
    header_at: usize,
    /// The ring has a receive armed (or completed and not yet taken).
    armed: bool,
    /// A READ's payload a caller is receiving (its chunk, bytes received).
    payload: Option<(P, usize)>,
}

impl<P> Default for Owners<P> {
    fn default() -> Self {
        Self {
            sending: false,
            tail: Vec::new(),
            reader: Reader::Ring,
            readers: 0,
            header: [0; DATA_RESPONSE_LEN],
            header_at: 0,
            armed: false,
            payload: None,
        }
    }
}

impl<P> Owners<P> {
    /// Whether a submitter may send directly (the stream protocol's own checks aside: nothing in
    /// flight, not broken): the ring is not sending, no tail waits, the ring reads and no
    /// response is partly read, and, where callers may read (`caller_receives`), the ring has no
    /// receive armed.
    pub(crate) fn may_send_directly(&self, caller_receives: bool) -> bool {
        !self.sending
            && self.tail.is_empty()
            && self.reader == Reader::Ring
            && !self.mid_response()
            && !(caller_receives && self.armed)
    }

    /// A submitter's direct send left `tail` unsent: the ring sends it before anything else.
    pub(crate) fn leave_tail(&mut self, tail: Vec<u8>) {
        self.tail = tail;
    }

    /// Whether a tail waits for the ring.
    pub(crate) fn has_tail(&self) -> bool {
        !self.tail.is_empty()
    }

    /// The ring takes the waiting tail, if any, and with it the send side.
    pub(crate) fn ring_takes_tail(&mut self) -> Option<Vec<u8>> {
        if self.tail.is_empty() {
            return None;
        }
        self.sending = true;
        Some(std::mem::take(&mut self.tail))
    }

    /// Whatever tail waits (none: empty), taken to go out after the request being posted.
    pub(crate) fn take_tail(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.tail)
    }

    /// The ring claims the send side (`true`: it is about to take a chunk) or lets it go.
    pub(crate) fn ring_sending(&mut self, sending: bool) {
        self.sending = sending;
    }

    /// The submitter that just sent a request whole becomes its reader: its token.
    pub(crate) fn caller_reads(&mut self) -> u64 {
        self.readers += 1;
        self.reader = Reader::Caller(self.readers);
        self.readers
    }

    /// Whether the caller numbered `token` is the reader.
    pub(crate) fn reads(&self, token: u64) -> bool {
        self.reader == Reader::Caller(token)
    }

    /// Whether the ring is the reader.
    pub(crate) fn ring_is_reader(&self) -> bool {
        self.reader == Reader::Ring
    }

    /// The ring reads from now on (it takes a new chunk, takes over after a tick, or the
    /// caller's chunk is resolved): whether a caller was the reader.
    pub(crate) fn ring_reads(&mut self) -> bool {
        let took = self.reader != Reader::Ring;
        self.reader = Reader::Ring;
        took
    }

    /// The caller numbered `token` gives the reading back to the ring: whether it was the
    /// reader (a stale token changes nothing).
    pub(crate) fn give_back(&mut self, token: u64) -> bool {
        if !self.reads(token) {
            return false;
        }
        self.reader = Reader::Ring;
        true
    }

    /// Whether a response is partly read (header bytes, or a READ's payload under way).
    pub(crate) fn mid_response(&self) -> bool {
        self.header_at > 0 || self.payload.is_some()
    }

    /// Whether some of the next response header is read.
    pub(crate) fn header_begun(&self) -> bool {
        self.header_at > 0
    }

    /// The part of the response header still to read.
    pub(crate) fn header_rest(&mut self) -> &mut [u8] {
        &mut self.header[self.header_at..]
    }

    /// `n` more bytes of the header were read into [`Owners::header_rest`]: the whole header
    /// once it is in (the next one then starts empty).
    pub(crate) fn header_read(&mut self, n: usize) -> Option<[u8; DATA_RESPONSE_LEN]> {
        self.header_at += n;
        if self.header_at < DATA_RESPONSE_LEN {
            return None;
        }
        self.header_at = 0;
        Some(self.header)
    }

    /// The ring armed a receive, or has its result still to take (`true`; a submitter may then
    /// not become a reader), or has none (`false`).
    pub(crate) fn ring_armed(&mut self, armed: bool) {
        self.armed = armed;
    }

    /// A caller's READ response announced a payload (for `chunk`), not received yet.
    pub(crate) fn payload_comes(&mut self, chunk: P) {
        self.payload = Some((chunk, 0));
    }

    /// The payload under way and the bytes of it received.
    pub(crate) fn payload(&self) -> Option<&(P, usize)> {
        self.payload.as_ref()
    }

    /// `done` bytes of the payload under way are received.
    pub(crate) fn payload_at(&mut self, done: usize) {
        if let Some(p) = self.payload.as_mut() {
            p.1 = done;
        }
    }

    /// The payload under way (its chunk and bytes received), taken to finish or fail it.
    pub(crate) fn take_payload(&mut self) -> Option<(P, usize)> {
        self.payload.take()
    }
}

#[cfg(test)]
mod tests {
    use super::Owners;
    use ferry_core::wire::DATA_RESPONSE_LEN;

    type O = Owners<&'static str>;

    #[test]
    fn a_direct_send_needs_both_sides_free() {
        let idle = O::default();
        assert!(idle.may_send_directly(false) && idle.may_send_directly(true));
        let mut o = O::default();
        o.ring_sending(true);
        assert!(!o.may_send_directly(false), "the ring is sending");
        let mut o = O::default();
        o.leave_tail(vec![1]);
        assert!(!o.may_send_directly(false), "a tail waits");
        let mut o = O::default();
        o.caller_reads();
        assert!(!o.may_send_directly(false), "a caller reads");
        let mut o = O::default();
        o.header_rest()[0] = 7;
        assert_eq!(o.header_read(1), None);
        assert!(!o.may_send_directly(false), "a header is partly read");
        let mut o = O::default();
        o.payload_comes("chunk");
        assert!(!o.may_send_directly(false), "a payload is under way");
        let mut o = O::default();
        o.ring_armed(true);
        assert!(
            o.may_send_directly(false),
            "an armed receive meets the response anyway"
        );
        assert!(
            !o.may_send_directly(true),
            "no caller while the ring's receive is armed"
        );
    }

    #[test]
    fn a_tail_goes_to_the_ring_first_and_holds_the_send_side() {
        let mut o = O::default();
        assert_eq!(o.ring_takes_tail(), None);
        o.leave_tail(vec![1, 2]);
        assert!(o.has_tail());
        assert_eq!(o.ring_takes_tail(), Some(vec![1, 2]));
        assert!(!o.has_tail());
        assert!(!o.may_send_directly(false), "the ring sends the tail");
        o.ring_sending(false);
        assert!(o.may_send_directly(false));
        o.leave_tail(vec![3]);
        assert_eq!(o.take_tail(), vec![3]);
        assert!(o.take_tail().is_empty());
    }

    #[test]
    fn only_the_current_caller_gives_the_reading_back() {
        let mut o = O::default();
        assert!(o.ring_is_reader());
        let first = o.caller_reads();
        assert!(o.reads(first) && !o.ring_is_reader());
        // The ring takes a new chunk: it reads from now on.
        assert!(o.ring_reads());
        assert!(!o.ring_reads(), "the ring already read");
        assert!(!o.give_back(first), "a stale token changes nothing");
        let second = o.caller_reads();
        assert_ne!(first, second);
        assert!(!o.reads(first) && !o.give_back(first));
        assert!(o.reads(second));
        assert!(o.give_back(second));
        assert!(o.ring_is_reader() && !o.give_back(second));
    }

    #[test]
    fn a_header_read_in_part_is_finished_by_the_next_reader() {
        let mut o = O::default();
        let token = o.caller_reads();
        let want: Vec<u8> = (1..=DATA_RESPONSE_LEN as u8).collect();
        o.header_rest()[..5].copy_from_slice(&want[..5]);
        assert_eq!(o.header_read(5), None);
        // The ring takes over after a tick and reads the rest.
        assert!(o.ring_reads() && !o.reads(token));
        assert!(o.header_begun());
        let rest = o.header_rest();
        assert_eq!(rest.len(), DATA_RESPONSE_LEN - 5);
        rest.copy_from_slice(&want[5..]);
        let whole = o.header_read(DATA_RESPONSE_LEN - 5).expect("whole");
        assert_eq!(&whole[..], &want[..]);
        assert!(!o.header_begun() && !o.mid_response());
        assert_eq!(o.header_rest().len(), DATA_RESPONSE_LEN);
    }

    #[test]
    fn a_payload_under_way_keeps_its_progress_for_the_next_reader() {
        let mut o = O::default();
        o.caller_reads();
        o.payload_comes("chunk");
        assert_eq!(o.payload(), Some(&("chunk", 0)));
        o.payload_at(100);
        assert!(o.mid_response());
        o.ring_reads();
        assert_eq!(o.take_payload(), Some(("chunk", 100)));
        assert!(!o.mid_response() && o.payload().is_none());
        o.payload_at(5);
        assert_eq!(o.payload(), None, "no payload, no progress");
    }
}
