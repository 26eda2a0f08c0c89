//! A client stream as a ring host runs it ([`Stream`] for [`Conn`]): its turn (the receive side,
//! then the send side, each until it waits on the socket or, the send side, for work), its
//! operations' completions, and its end (what it had in flight fails, what was dealt to it goes
//! to the channel's other streams).

use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use ferry_core::FailureKind;

use super::conn::{Conn, Op};
use super::recv::{on_hangup, on_received, on_received_shared, receive, receive_shared};
use super::send::{on_sent, send};
use super::state::NotifHold;
use crate::ring::host::{Io, Stream, Turn};

impl Stream for Conn {
    type Op = Op;
    type Hold = NotifHold;
    /// The native error that broke it, if any.
    type Error = Option<i32>;
    const ZC_SENT: Op = Op::Send;

    fn socket(&self) -> &Arc<TcpStream> {
        &self.sh.socket
    }

    fn advance(&mut self, io: &mut Io<'_, NotifHold>) -> Turn<Option<i32>> {
        self.fixed = io.fixed();
        if let Some(t) = self.queue.taker(self.index) {
            t.rise();
        }
        let recv = if self.caller_receives {
            receive_shared
        } else {
            receive
        };
        let r = recv(io, self).and_then(|()| {
            let go = send(io, self)?;
            // A chunk taken from a direct reader's stream took the reading over.
            if go && self.caller_receives {
                recv(io, self)?;
            }
            Ok(go)
        });
        match r {
            Ok(true) => Turn::Wait,
            Ok(false) => Turn::End(None),
            Err(native) => Turn::End(Some(native)),
        }
    }

    fn complete(&mut self, op: Op, res: i32, _flags: u32) -> Result<(), Option<i32>> {
        match op {
            Op::Recv => {
                self.recv_inflight = false;
                if self.caller_receives && self.incoming.is_none() {
                    on_received_shared(self, res)
                } else {
                    on_received(self, res)
                }
            }
            Op::Hangup => {
                self.hangup_inflight = false;
                on_hangup(self)
            }
            Op::Send | Op::Poll => {
                let sent = self.send_inflight.take();
                on_sent(self, sent, res)
            }
        }
    }

    fn ending(&mut self) {
        self.sh.dead.store(true, Ordering::Release);
    }

    fn end(mut self: Box<Self>, why: Option<Option<i32>>) {
        let native = why.flatten();
        if let Some(inc) = self.incoming.take() {
            inc.lost(native);
        }
        self.out = None;
        {
            let mut g = self.sh.lock();
            if let Some((chunk, _)) = g.owners.take_payload() {
                chunk.lost(native);
            }
            g.proto.fail_all(native);
        }
        // The other streams take what was dealt to this one; the last one to end fails it.
        for job in self.queue.leave(self.index) {
            job.not_posted(FailureKind::PeerLost);
        }
    }
}
