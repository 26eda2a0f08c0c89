//! A client stream's send side on its ring: requests and their WRITE payloads in order (a copying
//! send, SEND_ZC, or vmsplice + splice to a loopback peer), and their completions.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;

use ferry_core::countdown::Executing;
use ferry_core::queue::Next;
use ferry_core::stream::{Outgoing, Post};
use ferry_core::{FailureKind, OpKind};
use tracing::debug;

use super::conn::{Body, Conn, Keep, Op, Out, SendOp, on_fd};
use super::state::NotifHold;
use crate::ring::host::Io;
use crate::ring::{IoStats, iovecs_from};

/// Keeps the send side going: finishes the send under way, then what a submitter left unsent,
/// then new chunks while fewer than `depth` are in flight. `Ok(false)`: the stream is over (the
/// channel is gone and nothing is left to do); `Err`: broken.
pub(super) fn send(io: &mut Io<'_, NotifHold>, c: &mut Conn) -> Result<bool, Option<i32>> {
    loop {
        if c.send_inflight.is_some() {
            return Ok(true);
        }
        if c.out.is_some() {
            if !push_out(io, c)? {
                return Ok(true);
            }
            if let Some(seq) = c.out.take().and_then(|o| o.write_seq) {
                // A WRITE's answer counts only from here: its payload has left local memory
                // (copied into the socket, spliced, or handed to SEND_ZC, whose notification
                // the request waits for besides).
                c.sh.lock().proto.sent(seq);
            }
        }
        // What a submitter left unsent goes out before anything else; the send side is claimed
        // (`busy`) before the look, so that a submitter cannot send past a chunk taken here.
        let (room, in_flight) = {
            let mut g = c.sh.lock();
            if let Some(tail) = g.owners.ring_takes_tail() {
                drop(g);
                let parts = vec![(tail.as_ptr(), tail.len())];
                c.out = Some(Out {
                    write_seq: None,
                    total: tail.len(),
                    parts,
                    done: 0,
                    body: Body::None,
                    _keep: Keep::Bytes(tail),
                });
                continue;
            }
            let room = c.open && g.proto.has_room();
            g.owners.ring_sending(room);
            (room, g.proto.in_flight())
        };
        let mut job = None;
        if room {
            // Nothing found: the wait stays announced, so a job dealt after the last look wakes
            // the stream through its ring.
            match c.queue.next_or_wait(c.index, in_flight == 0) {
                Next::Job(j) => job = Some(j),
                Next::Closed => c.open = false,
                Next::Empty => {}
            }
        }
        let Some(job) = job else {
            let over = {
                let mut g = c.sh.lock();
                g.owners.ring_sending(false);
                !c.open
                    && g.proto.in_flight() == 0
                    && !g.owners.has_tail()
                    && !g.owners.mid_response()
            };
            if over && c.head_at == 0 && c.incoming.is_none() {
                if let Some(t) = c.queue.taker(c.index) {
                    t.rise();
                }
                return Ok(false);
            }
            return Ok(true);
        };
        if let Some(t) = c.queue.taker(c.index) {
            t.rise();
        }
        if c.sh.dead.load(Ordering::Acquire) {
            job.not_posted(FailureKind::PeerLost);
            continue;
        }
        if c.caller_receives {
            // This chunk's response follows any a direct reader awaits: the ring reads both.
            let took = c.sh.lock().owners.ring_reads();
            if took {
                IoStats::add(&c.stats.caller_handbacks, 1);
            }
        }
        let (posted, tail) = {
            let mut g = c.sh.lock();
            (g.proto.post(job), g.owners.take_tail())
        };
        let out = match posted {
            Post::Send(out) => Box::new(out),
            Post::Resolved => continue,
            Post::Broken(job) => {
                job.not_posted(FailureKind::PeerLost);
                continue;
            }
        };
        c.out = Some(plan_out(c, out, tail));
    }
}

/// How one posted request goes out: its header (and piece table) copied, then its WRITE
/// payload copied, by SEND_ZC or spliced. `tail`: a submitter's leftover bytes, which precede
/// it on the wire.
fn plan_out(c: &Conn, out: Box<Outgoing<Executing>>, tail: Vec<u8>) -> Out {
    let mut parts: Vec<(*const u8, usize)> = Vec::with_capacity(3);
    // Leftover bytes of a submitter (rare: a direct send past a chunk taken here cannot
    // happen, but a tail left before is sent first) go first; kept with the request.
    let mut keep_tail = None;
    if !tail.is_empty() {
        parts.push((tail.as_ptr(), tail.len()));
        keep_tail = Some(tail);
    }
    parts.push((out.head.as_ptr(), out.head.len()));
    let is_write = out.kind == OpKind::Write;
    let at = (out.region.as_ptr() as usize + out.local_at as usize) as *const u8;
    let body = if !out.scatter.is_empty() {
        parts.push((out.table.as_ptr(), out.table.len()));
        if is_write {
            parts.extend(out.scatter.iter().map(|r| {
                (
                    (r.region.as_ptr() as usize + r.at as usize) as *const u8,
                    r.len,
                )
            }));
        }
        Body::None
    } else if !is_write || out.len == 0 {
        Body::None
    } else if c.splice {
        Body::Splice {
            ptr: at,
            len: out.len,
            done: 0,
            piped: 0,
        }
    } else if c.zero_copy {
        Body::Zc {
            ptr: at,
            len: out.len,
            done: 0,
            region: out.region.clone(),
            req: out.req.clone(),
        }
    } else {
        parts.push((at, out.len));
        Body::None
    };
    if is_write && matches!(body, Body::None) && out.len > 0 {
        IoStats::add(&c.stats.copy_sends, 1);
    }
    let total = parts.iter().map(|p| p.1).sum();
    Out {
        write_seq: is_write.then_some(out.seq),
        parts,
        done: 0,
        total,
        body,
        _keep: Keep::Posted(out, keep_tail),
    }
}

/// Moves `c.out` on: its copied bytes (what the socket takes now with one call, the rest by a
/// SENDMSG on the ring), then its body. `Ok(true)`: all of it went; `Ok(false)`: an operation
/// is in flight.
fn push_out(io: &mut Io<'_, NotifHold>, c: &mut Conn) -> Result<bool, Option<i32>> {
    let fail = |c: &Conn, e: io::Error| {
        debug!(peer = %c.peer, stream = c.index, error = %e, "send failed; stream closed");
        e.raw_os_error()
    };
    loop {
        let Some(out) = c.out.as_mut() else {
            return Ok(true);
        };
        if out.done < out.total {
            let more = if matches!(out.body, Body::None) {
                0
            } else {
                libc::MSG_MORE
            };
            iovecs_from(&out.parts, out.done, &mut c.siov);
            c.smsg.msg_iov = c.siov.as_mut_ptr();
            c.smsg.msg_iovlen = c.siov.len() as _;
            // SAFETY: the iovecs cover the request's header and table (in its boxed
            // `Outgoing`) and checked ranges of the regions it keeps alive, or leftover bytes
            // the send owns; the call keeps none of them past its return.
            let n = unsafe {
                libc::sendmsg(
                    c.fd,
                    &c.smsg,
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL | more,
                )
            };
            if n > 0 {
                out.done += n as usize;
                continue;
            }
            let e = io::Error::last_os_error();
            if n == 0 || !matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EINTR)) {
                let e = if n == 0 {
                    io::Error::new(io::ErrorKind::WriteZero, "send took nothing")
                } else {
                    e
                };
                return Err(fail(c, e));
            }
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            // The rest through the ring, all of it before the completion.
            let flags = (libc::MSG_WAITALL | libc::MSG_NOSIGNAL | more) as u32;
            let msg: *const libc::msghdr = &c.smsg;
            let e = on_fd!(c, SendMsg::new(msg).flags(flags));
            // SAFETY: as for the call above; the send (and so its memory) is kept until the
            // completion was reaped.
            unsafe { io.push(Op::Send, e) }.map_err(|e| fail(c, e))?;
            c.send_inflight = Some(SendOp::Copy);
            return Ok(false);
        }
        match &mut out.body {
            Body::None => return Ok(true),
            Body::Zc {
                ptr,
                len,
                done,
                region,
                req,
            } => {
                if *done >= *len {
                    return Ok(true);
                }
                let n = (*len - *done).min(u32::MAX as usize & !4095) as u32;
                // SAFETY: `done < len`, inside the checked range.
                let at = unsafe { ptr.add(*done) };
                let index = io.buf_index(region);
                // The hold is in place before the send can complete, so the request cannot be
                // seen as drained in between (the host keeps it until the notification).
                let hold = super::state::NotifHold::new(req);
                let e = on_fd!(
                    c,
                    SendZc::new(at, n)
                        .buf_index(index)
                        .flags(libc::MSG_WAITALL | libc::MSG_NOSIGNAL)
                );
                IoStats::add(&c.stats.zc_sends, 1);
                if index.is_some() {
                    IoStats::add(&c.stats.fixed_sends, 1);
                }
                // SAFETY: the range was checked against the region at post; the hold the host
                // keeps holds the request, and so the region, until the kernel's notification.
                unsafe { io.push_zc(e, hold) }.map_err(|e| fail(c, e))?;
                c.send_inflight = Some(SendOp::Zc);
                return Ok(false);
            }
            Body::Splice {
                ptr,
                len,
                done,
                piped,
            } => {
                let (ptr, len) = (*ptr, *len);
                let (mut d, mut p) = (*done, *piped);
                let r = splice_some(c, ptr, len, &mut d, &mut p);
                if let Some(Body::Splice { done, piped, .. }) = c.out.as_mut().map(|o| &mut o.body)
                {
                    (*done, *piped) = (d, p);
                }
                match r {
                    Ok(true) => return Ok(true),
                    Ok(false) => {
                        // The socket is full: wait for room on the ring.
                        let e = on_fd!(c, PollAdd::new(libc::POLLOUT as u32));
                        // SAFETY: a poll carries no buffer.
                        unsafe { io.push(Op::Poll, e) }.map_err(|e| fail(c, e))?;
                        IoStats::add(&c.stats.room_waits, 1);
                        c.send_inflight = Some(SendOp::Room);
                        return Ok(false);
                    }
                    Err(e) => return Err(fail(c, e)),
                }
            }
        }
    }
}

/// Moves the body at `ptr` (`len` bytes, `done` of them in the socket, `piped` in the pipe) by
/// page reference: `vmsplice` into the stream's pipe, `splice` from it to the socket, with the
/// socket non-blocking for that call only (the ring's own operations on it must block). There
/// is no completion notification: the body must stay unmodified until the peer acknowledged it
/// (its response does). `Ok(true)`: all of it went; `Ok(false)`: the socket is full.
fn splice_some(
    c: &mut Conn,
    ptr: *const u8,
    len: usize,
    done: &mut usize,
    piped: &mut usize,
) -> io::Result<bool> {
    let (pr, pw, cap) = pipe(c)?;
    while *done < len {
        if *piped == 0 {
            let iov = libc::iovec {
                // SAFETY: `done < len`, inside the request's checked range.
                iov_base: unsafe { ptr.add(*done) } as *mut libc::c_void,
                iov_len: (len - *done).min(cap),
            };
            // SAFETY: the iovec points into the request's range, valid until its response;
            // vmsplice only takes page references.
            let n = unsafe { libc::vmsplice(pw, &iov, 1, 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            *piped = n as usize;
        }
        let more = if *done + *piped < len {
            libc::SPLICE_F_MORE
        } else {
            0
        };
        // SAFETY: fcntl and splice on descriptors this stream keeps open (its socket, its
        // pipe); no user memory is passed.
        let res = unsafe {
            libc::fcntl(c.fd, libc::F_SETFL, c.fl | libc::O_NONBLOCK);
            let res = libc::splice(
                pr,
                std::ptr::null_mut(),
                c.fd,
                std::ptr::null_mut(),
                *piped,
                libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK | more,
            );
            let e = io::Error::last_os_error();
            libc::fcntl(c.fd, libc::F_SETFL, c.fl);
            (res, e)
        };
        match res {
            (n, _) if n > 0 => {
                let n = n as usize;
                if n < *piped {
                    IoStats::add(&c.stats.short_sends, 1);
                }
                *done += n;
                *piped -= n;
                if *piped == 0 {
                    IoStats::add(&c.stats.spliced_sends, 1);
                }
            }
            (0, _) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "splice moved nothing",
                ));
            }
            (_, e) if e.kind() == io::ErrorKind::Interrupted => {}
            (_, e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            (_, e) => return Err(e),
        }
    }
    Ok(true)
}

/// The stream's pipe for spliced sends (read end, write end, capacity), made on first use.
fn pipe(c: &mut Conn) -> io::Result<(RawFd, RawFd, usize)> {
    if c.pipe.is_none() {
        let mut fds = [0i32; 2];
        // SAFETY: `fds` has room for the two descriptors pipe2 writes.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded, so both are fresh descriptors we now own.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: F_SETPIPE_SZ on our own pipe; failure leaves the default size.
        let cap = unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, 1 << 20) };
        let cap = if cap > 0 { cap as usize } else { 64 << 10 };
        c.pipe = Some((r, w, cap));
    }
    match &c.pipe {
        Some((r, w, cap)) => Ok((r.as_raw_fd(), w.as_raw_fd(), *cap)),
        None => Err(io::Error::other("pipe")),
    }
}

/// A send-side operation completed with `res`.
pub(super) fn on_sent(c: &mut Conn, op: Option<SendOp>, res: i32) -> Result<(), Option<i32>> {
    let Some(op) = op else {
        return Ok(());
    };
    if op == SendOp::Room || res == -libc::EINTR || res == -libc::EAGAIN || res == -libc::ECANCELED
    {
        // Room in the socket (or nothing sent): the send goes on from where it was.
        return Ok(());
    }
    if res < 0 {
        let e = io::Error::from_raw_os_error(-res);
        debug!(peer = %c.peer, stream = c.index, error = %e, "send failed; stream closed");
        return Err(Some(-res));
    }
    let n = res as usize;
    let Some(out) = c.out.as_mut() else {
        return Ok(());
    };
    match op {
        SendOp::Copy => {
            let asked = out.total - out.done;
            if n < asked {
                IoStats::add(&c.stats.short_sends, 1);
            }
            out.done += n.min(asked);
        }
        SendOp::Zc => {
            if let Body::Zc { len, done, .. } = &mut out.body {
                if n < *len - *done {
                    IoStats::add(&c.stats.short_sends, 1);
                }
                *done += n.min(*len - *done);
            }
        }
        SendOp::Room => {}
    }
    Ok(())
}
