//! A client stream's receive side on its ring: the response header, a READ's payload straight
//! into its chunk's memory, and the responses a direct reader hands back.

use std::io;

use ferry_core::countdown::Executing;
use ferry_core::stream::Resolution;
use ferry_core::wire::DATA_RESPONSE_LEN;
use ferry_net::RECV_LOW_MARK as LOWAT;
use tracing::debug;

use super::conn::{Conn, Incoming, Op, on_fd, set_lowat};
use super::state::NotifHold;
use crate::ring::host::Io;
use crate::ring::iovecs_from;

/// Keeps the receive side going: resolves what came, then arms the next receive (a header's
/// rest, or a payload's, after moving what the socket holds now). `Err`: the stream is broken
/// (with the native error, if any).
pub(super) fn receive(io: &mut Io<'_, NotifHold>, c: &mut Conn) -> Result<(), Option<i32>> {
    loop {
        if c.recv_inflight {
            return Ok(());
        }
        if c.incoming.is_none() {
            // The next header: the low mark must be back at 1 (a 16-byte header must wake us).
            if c.lowat > 1 {
                set_lowat(c, 1).map_err(|e| e.raw_os_error())?;
            }
            // With responses still due, the next one is often in the socket already.
            let due = c.head_at > 0 || c.sh.lock().proto.in_flight() > 0;
            if due {
                let at = c.head_at;
                // SAFETY: receives at most the header's missing bytes into the stream's own
                // header buffer.
                let n = unsafe {
                    libc::recv(
                        c.fd,
                        c.head.as_mut_ptr().add(at).cast(),
                        DATA_RESPONSE_LEN - at,
                        libc::MSG_DONTWAIT,
                    )
                };
                match received(n) {
                    Ok(Some(n)) => {
                        on_header_bytes(c, n)?;
                        continue;
                    }
                    Ok(None) => {}
                    Err(native) => return Err(native),
                }
            }
            let at = c.head_at;
            let e = on_fd!(
                c,
                Recv::new(
                    // SAFETY: `at < DATA_RESPONSE_LEN`, inside the header buffer.
                    unsafe { c.head.as_mut_ptr().add(at) },
                    (DATA_RESPONSE_LEN - at) as u32
                )
                .flags(libc::MSG_WAITALL)
            );
            // SAFETY: the header buffer lives in the boxed `Conn`, freed only once no receive
            // is in flight.
            unsafe { io.push(Op::Recv, e) }.map_err(|e| e.raw_os_error())?;
            c.recv_inflight = true;
            return Ok(());
        }
        receive_payload(io, c)?;
    }
}

/// Moves the payload being received (`c.incoming`) on: acknowledges it once whole; else what
/// the socket holds at the payload's start moves with one call, and the rest through a ring
/// receive (armed; `recv_inflight`).
fn receive_payload(io: &mut Io<'_, NotifHold>, c: &mut Conn) -> Result<(), Option<i32>> {
    loop {
        if c.recv_inflight {
            return Ok(());
        }
        let Some(inc) = c.incoming.as_mut() else {
            return Ok(());
        };
        let (parts, total, done) = inc.parts();
        if done >= total {
            if let Some(inc) = c.incoming.take() {
                inc.acked();
            }
            return Ok(());
        }
        iovecs_from(parts, done, &mut c.riov);
        c.rmsg.msg_iov = c.riov.as_mut_ptr();
        c.rmsg.msg_iovlen = c.riov.len() as _;
        if done == 0 {
            // What the socket holds when the payload starts moves with one call; after a ring
            // receive the socket holds less than the mark, so the ring waits for the rest.
            // SAFETY: the iovecs cover the chunks' checked local ranges, which their requests
            // own until drained (the chunks keep the regions alive) and nothing else touches
            // meanwhile.
            let n = unsafe { libc::recvmsg(c.fd, &mut c.rmsg, libc::MSG_DONTWAIT) };
            match received(n) {
                Ok(Some(n)) => {
                    inc.advance(n);
                    continue;
                }
                Ok(None) => {}
                Err(native) => return Err(native),
            }
        }
        // The rest through the ring: with the low mark raised for a large payload (one wake-up
        // per mark, not per segment) the receive completes with what is there.
        let rest = total - done;
        let mut flags = libc::MSG_WAITALL;
        if total > LOWAT && c.lowat != 0 && set_lowat(c, rest.min(LOWAT)).is_ok() {
            flags = 0;
        }
        let msg: *mut libc::msghdr = &mut c.rmsg;
        let e = on_fd!(c, RecvMsg::new(msg).flags(flags as u32));
        // SAFETY: the message and iovecs live in the boxed `Conn`; the ranges as above.
        unsafe { io.push(Op::Recv, e) }.map_err(|e| e.raw_os_error())?;
        c.recv_inflight = true;
        return Ok(());
    }
}

/// The receive side with `caller_receives`: who reads is in the shared state (the ring, or a
/// task awaiting the one request it sent directly). While a direct reader reads, the ring
/// arms nothing; while the stream is idle, only a hang-up poll (arriving bytes do not end it),
/// so a response to a direct send wakes no ring. Otherwise it finishes a payload a direct
/// reader left, then receives the header's rest (its bytes kept in the shared state).
pub(super) fn receive_shared(io: &mut Io<'_, NotifHold>, c: &mut Conn) -> Result<(), Option<i32>> {
    loop {
        if c.recv_inflight {
            return Ok(());
        }
        if c.incoming.is_some() {
            // A payload the ring receives, as without direct readers; meanwhile no submitter
            // may make itself a reader (the chunk is no longer in flight).
            c.sh.lock().owners.ring_armed(true);
            receive_payload(io, c)?;
            if c.incoming.is_some() || c.recv_inflight {
                return Ok(());
            }
            continue;
        }
        let mut g = c.sh.lock();
        if !g.owners.ring_is_reader() {
            // A direct reader meets the stream's end itself and hands the reading back.
            return Ok(());
        }
        if let Some((chunk, done)) = g.owners.take_payload() {
            drop(g);
            let len = chunk.payload_len() as usize;
            let ptr = (chunk.op().local.as_ptr() as usize + chunk.local_at() as usize) as *const u8;
            c.incoming = Some(Incoming::One {
                chunk,
                part: (ptr, len),
                done,
            });
            continue;
        }
        if g.proto.in_flight() == 0 && !g.owners.header_begun() {
            g.owners.ring_armed(false);
            drop(g);
            if c.hangup_inflight {
                return Ok(());
            }
            let mask = (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) as u32;
            let e = on_fd!(c, PollAdd::new(mask));
            // SAFETY: a poll carries no buffer.
            unsafe { io.push(Op::Hangup, e) }.map_err(|e| e.raw_os_error())?;
            c.hangup_inflight = true;
            return Ok(());
        }
        // The header's rest lands in `head` and is moved to the shared state when it comes.
        let want = g.owners.header_rest().len();
        g.owners.ring_armed(true);
        drop(g);
        if c.lowat > 1 {
            set_lowat(c, 1).map_err(|e| e.raw_os_error())?;
        }
        let e = on_fd!(
            c,
            Recv::new(c.head.as_mut_ptr(), want as u32).flags(libc::MSG_WAITALL)
        );
        // SAFETY: the header buffer lives in the boxed `Conn`, freed only once no receive is
        // in flight.
        unsafe { io.push(Op::Recv, e) }.map_err(|e| e.raw_os_error())?;
        c.recv_inflight = true;
        return Ok(());
    }
}

/// A header receive of [`receive_shared`] completed with `res`: its bytes join the shared
/// header; a whole one is resolved under the same lock.
pub(super) fn on_received_shared(c: &mut Conn, res: i32) -> Result<(), Option<i32>> {
    let mut g = c.sh.lock();
    // Until the ring arms its next receive, no receive of its is pending, unless a payload
    // follows this header (below): then no submitter may make itself a reader meanwhile.
    g.owners.ring_armed(false);
    let Some(n) = receive_result(c, res)? else {
        return Ok(());
    };
    let rest = g.owners.header_rest();
    let n = n.min(rest.len());
    rest[..n].copy_from_slice(&c.head[..n]);
    let Some(head) = g.owners.header_read(n) else {
        return Ok(());
    };
    let resolved = g.proto.on_response(&head);
    g.owners.ring_armed(match &resolved {
        Ok(Resolution::Payload(chunk)) => chunk.payload_len() > 0,
        Ok(Resolution::Pieces(_)) => true,
        _ => false,
    });
    drop(g);
    resolve(c, resolved)
}

/// The hang-up poll ended: with nothing due and the ring the reader, the peer closed an idle
/// stream (anything else is met by whoever reads).
pub(super) fn on_hangup(c: &mut Conn) -> Result<(), Option<i32>> {
    let g = c.sh.lock();
    if g.owners.ring_is_reader()
        && g.proto.in_flight() == 0
        && !g.owners.mid_response()
        && c.incoming.is_none()
    {
        debug!(peer = %c.peer, stream = c.index, "peer closed the stream");
        return Err(None);
    }
    Ok(())
}

/// What a non-blocking call's return value means: bytes moved (`Some`), nothing now (`None`),
/// or a broken stream (0 bytes from a receive: the peer closed it).
fn received(n: isize) -> Result<Option<usize>, Option<i32>> {
    if n > 0 {
        return Ok(Some(n as usize));
    }
    if n == 0 {
        return Err(None);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN | libc::EINTR) => Ok(None),
        native => Err(native),
    }
}

/// `n` more bytes of the response header came: once it is whole, the stream protocol resolves
/// it (a payload to receive next, or nothing).
fn on_header_bytes(c: &mut Conn, n: usize) -> Result<(), Option<i32>> {
    c.head_at += n;
    if c.head_at < DATA_RESPONSE_LEN {
        return Ok(());
    }
    c.head_at = 0;
    let head = c.head;
    let resolved = c.sh.lock().proto.on_response(&head);
    resolve(c, resolved)
}

/// What the stream protocol made of a whole response header: a payload to receive next, or
/// nothing. `Err`: the response broke the protocol.
fn resolve(
    c: &mut Conn,
    resolved: Result<Resolution<Executing>, ferry_core::stream::Violation>,
) -> Result<(), Option<i32>> {
    match resolved {
        Ok(Resolution::Done) => Ok(()),
        Ok(Resolution::Payload(chunk)) => {
            let len = chunk.payload_len() as usize;
            if len == 0 {
                chunk.acked();
                return Ok(());
            }
            let ptr = (chunk.op().local.as_ptr() as usize + chunk.local_at() as usize) as *const u8;
            c.incoming = Some(Incoming::One {
                chunk,
                part: (ptr, len),
                done: 0,
            });
            Ok(())
        }
        Ok(Resolution::Pieces(pieces)) => {
            let parts: Vec<(*const u8, usize)> = pieces
                .iter()
                .map(|p| {
                    (
                        (p.op().local.as_ptr() as usize + p.local_at() as usize) as *const u8,
                        p.payload_len() as usize,
                    )
                })
                .collect();
            let total = parts.iter().map(|p| p.1).sum();
            c.incoming = Some(Incoming::Pieces {
                pieces,
                parts,
                total,
                done: 0,
            });
            Ok(())
        }
        Err(v) => {
            debug!(peer = %c.peer, stream = c.index, error = %v, "bad response; stream closed");
            Err(None)
        }
    }
}

/// What a receive's completion `res` means: bytes received, nothing (interrupted: the
/// receive is armed again), or a broken stream (the peer closed it, or an error).
fn receive_result(c: &Conn, res: i32) -> Result<Option<usize>, Option<i32>> {
    if res == -libc::EINTR || res == -libc::EAGAIN {
        return Ok(None);
    }
    if res < 0 {
        debug!(peer = %c.peer, stream = c.index, error = %io::Error::from_raw_os_error(-res), "receive failed; stream closed");
        return Err(Some(-res));
    }
    if res == 0 {
        debug!(peer = %c.peer, stream = c.index, "peer closed the stream");
        return Err(None);
    }
    Ok(Some(res as usize))
}

/// A receive completed with `res`.
pub(super) fn on_received(c: &mut Conn, res: i32) -> Result<(), Option<i32>> {
    let Some(n) = receive_result(c, res)? else {
        return Ok(());
    };
    match c.incoming.as_mut() {
        Some(inc) => {
            inc.advance(n);
            Ok(())
        }
        None => on_header_bytes(c, n),
    }
}
