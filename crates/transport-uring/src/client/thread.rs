//! A client stream on a thread of its own with its own ring: the driver of
//! [`UringConfig::caller_receives`](crate::UringConfig::caller_receives), whose direct readers
//! take the reading over from it (see [`super::CallerRead`]).
//!
//! The thread writes request headers and WRITE payloads (SEND_ZC from registered memory where
//! possible, or vmsplice + splice to a loopback peer) in order, resending whatever the kernel
//! did not take, and keeps a receive for the next response armed on the same ring, so a response
//! that arrives while it sends is picked up by the send's own wait. READ payloads are read
//! straight into registered memory.

use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ferry_core::FailureKind;
use ferry_core::OpKind;
use ferry_core::queue::Next;
use ferry_core::stream::{Chunk, Post, Resolution};
use ferry_core::wire::DATA_RESPONSE_LEN;
use tracing::debug;

use super::state::{Job, NotifHold, Queue, Reader, StreamShared, shutdown};
use crate::ring::{Body, IoStats, SockIo};

/// What a stream thread owns besides its ring.
pub(super) struct StreamCtx {
    pub(super) splice: bool,
    /// See [`SendPlan::caller_receives`]: while idle (or while a direct reader reads) the
    /// thread keeps only a hang-up poll armed, no receive.
    pub(super) caller_receives: bool,
    pub(super) socket: Arc<TcpStream>,
    pub(super) dead: Arc<AtomicBool>,
    pub(super) queue: Arc<Queue>,
    pub(super) peer: SocketAddr,
    pub(super) index: usize,
    pub(super) stats: Arc<IoStats>,
}

impl StreamCtx {
    /// The thread no longer waits on its ring.
    fn rise(&self) {
        if let Some(t) = self.queue.taker(self.index) {
            t.rise();
        }
    }
}

/// One stream's thread: it sends requests in order (WRITE payloads from registered memory) and
/// reads the responses with a receive kept armed on the same ring (idle or not), so that a
/// response arriving while the thread sends is picked up by that send's wait, with no second
/// thread to wake, and a response to a request a submitter sent itself wakes the thread.
pub(super) fn stream(mut io: SockIo<NotifHold>, cx: StreamCtx, sh: Arc<StreamShared>) {
    let mut open = true;
    // Without `caller_receives` the thread is the only reader: it keeps the header it is
    // receiving to itself, with no lock per response (the shared one is for direct readers).
    let mut own = [0u8; DATA_RESPONSE_LEN];
    let mut own_at = 0usize;
    let broken = 'run: loop {
        // A READ's payload a direct reader left (it handed the reading back).
        if cx.caller_receives
            && let Err(native) = finish_payload(&mut io, &sh, &cx)
        {
            break 'run native;
        }
        // Responses that arrived meanwhile.
        while let Some(got) = io.take_armed() {
            let head = if !cx.caller_receives {
                match got {
                    Ok([]) => {
                        debug!(peer = %cx.peer, stream = cx.index, "peer closed the stream");
                        break 'run None;
                    }
                    Ok(bytes) => {
                        let n = bytes.len().min(DATA_RESPONSE_LEN - own_at);
                        own[own_at..own_at + n].copy_from_slice(&bytes[..n]);
                        own_at += n;
                    }
                    Err(e) => {
                        debug!(peer = %cx.peer, stream = cx.index, error = %e, "receive failed; stream closed");
                        break 'run e.raw_os_error();
                    }
                }
                (own_at == DATA_RESPONSE_LEN).then(|| {
                    own_at = 0;
                    own
                })
            } else {
                let mut g = sh.lock();
                g.recv_armed = false;
                match got {
                    Ok([]) => {
                        debug!(peer = %cx.peer, stream = cx.index, "peer closed the stream");
                        break 'run None;
                    }
                    Ok(bytes) => {
                        let at = g.resp_at;
                        let n = bytes.len().min(DATA_RESPONSE_LEN - at);
                        g.resp[at..at + n].copy_from_slice(&bytes[..n]);
                        g.resp_at += n;
                    }
                    Err(e) => {
                        debug!(peer = %cx.peer, stream = cx.index, error = %e, "receive failed; stream closed");
                        break 'run e.raw_os_error();
                    }
                }
                if g.resp_at == DATA_RESPONSE_LEN {
                    g.resp_at = 0;
                    Some(g.resp)
                } else {
                    None
                }
            };
            if let Some(head) = head
                && let Err(native) = on_response(&mut io, &head, &sh, &cx)
            {
                break 'run native;
            }
            if let Err(e) = arm(&mut io, &sh, &cx, own_at) {
                debug!(peer = %cx.peer, stream = cx.index, error = %e, "cannot arm a receive");
                break 'run None;
            }
        }
        if io.take_hangup() {
            let g = sh.lock();
            // With chunks in flight the armed receive meets the end (a direct reader, if any,
            // hands the reading back when it does).
            if g.reader == Reader::Ring && g.proto.in_flight() == 0 && g.resp_at == 0 {
                debug!(peer = %cx.peer, stream = cx.index, "peer closed the stream");
                break 'run None;
            }
        }
        if let Err(e) = arm(&mut io, &sh, &cx, own_at) {
            debug!(peer = %cx.peer, stream = cx.index, error = %e, "cannot arm a receive");
            break 'run None;
        }
        // What a submitter left unsent goes out before anything else.
        if let Err(native) = flush_tail(&mut io, &sh, &cx) {
            break 'run native;
        }
        // New work, while fewer than `depth` chunks are in flight. The send side is claimed
        // (`busy`) before the look, so that a submitter cannot send past a chunk taken here.
        let mut job = None;
        let (room, in_flight) = {
            let mut g = sh.lock();
            let room = open && g.proto.has_room();
            g.busy = room;
            (room, g.proto.in_flight())
        };
        if room {
            let idle = in_flight == 0;
            // Nothing found: the wait stays announced, so a job dealt after the last look writes
            // the eventfd.
            match cx.queue.next_or_wait(cx.index, idle) {
                Next::Job(j) => job = Some(j),
                Next::Closed => open = false,
                Next::Empty => {}
            }
        }
        let Some(job) = job else {
            let (in_flight, tail, resp_at) = {
                let mut g = sh.lock();
                g.busy = false;
                let payload = g.payload.is_some();
                (
                    g.proto.in_flight(),
                    !g.tail.is_empty(),
                    g.resp_at + own_at + usize::from(payload),
                )
            };
            if !open && in_flight == 0 && resp_at == 0 && !tail {
                cx.rise();
                break 'run None;
            }
            // Wait for a response, a zero-copy notification or new work (the wait was
            // announced above if new work could be taken; with `depth` chunks in flight posters need not
            // wake us: a response will; a submitter that leaves a tail writes the eventfd).
            if !tail {
                io.wait(Duration::from_secs(1));
            }
            cx.rise();
            continue;
        };
        cx.rise();
        if cx.caller_receives {
            // This chunk's response follows any a direct reader awaits: the thread reads both.
            let took = {
                let mut g = sh.lock();
                let took = g.reader != Reader::Ring;
                g.reader = Reader::Ring;
                took
            };
            if took {
                IoStats::add(&cx.stats.caller_handbacks, 1);
            }
            if let Err(native) = finish_payload(&mut io, &sh, &cx) {
                job.not_posted(FailureKind::PeerLost);
                break 'run native;
            }
            if let Err(e) = arm_recv(&mut io, &sh) {
                debug!(peer = %cx.peer, stream = cx.index, error = %e, "cannot arm a receive");
                break 'run None;
            }
        }
        let res = post(&mut io, job, &sh, &cx);
        sh.lock().busy = false;
        if let Err(native) = res {
            break 'run native;
        }
    };
    cx.dead.store(true, Ordering::Release);
    shutdown(&cx.socket);
    {
        let mut g = sh.lock();
        if let Some((chunk, _)) = g.payload.take() {
            chunk.lost(broken);
        }
        g.proto.fail_all(broken);
    }
    // The other streams take what was dealt to this one; the last one to end fails it.
    for job in cx.queue.leave(cx.index) {
        job.not_posted(FailureKind::PeerLost);
    }
    // Until they are notified the kernel may still read the buffers of zero-copy sends.
    io.finish(crate::FINISH_GRACE);
}

/// Arms what the stream thread waits on besides new work: a receive of the next response
/// header, unless [`SendPlan::caller_receives`] and no response is due to the thread (none in
/// flight, or a direct reader reads it); idle, a hang-up poll instead, which bytes arriving do
/// not end. (A direct reader meets the stream's end itself and hands the reading back.)
fn arm(
    io: &mut SockIo<NotifHold>,
    sh: &StreamShared,
    cx: &StreamCtx,
    own_at: usize,
) -> std::io::Result<()> {
    if !cx.caller_receives {
        // The thread's own header (`own_at` bytes of it so far); nothing shared to update.
        return if io.armed() {
            Ok(())
        } else {
            io.arm_recv(DATA_RESPONSE_LEN - own_at)
        };
    }
    let (due, idle) = {
        let g = sh.lock();
        let ring = g.reader == Reader::Ring;
        let pending = g.proto.in_flight() > 0 || g.resp_at > 0;
        (ring && pending, ring && !pending)
    };
    if due {
        arm_recv(io, sh)?;
    }
    if idle {
        io.arm_hangup()?;
    }
    Ok(())
}

/// Receives the rest of a READ's payload a direct reader started, if the thread is the reader
/// and one is left, into its chunk's memory (waiting on the ring). `Err`: the stream is broken.
fn finish_payload(
    io: &mut SockIo<NotifHold>,
    sh: &StreamShared,
    cx: &StreamCtx,
) -> Result<(), Option<i32>> {
    let left = {
        let mut g = sh.lock();
        if g.reader != Reader::Ring {
            return Ok(());
        }
        g.payload.take()
    };
    let Some((chunk, done)) = left else {
        return Ok(());
    };
    let len = chunk.payload_len() as usize;
    let ptr = (chunk.op().local.as_ptr() as usize + chunk.local_at() as usize + done) as *mut u8;
    // SAFETY: the stream protocol checked the chunk's range against its region at post; the
    // request owns the range until drained, keeps the region alive through the chunk's Arc,
    // and no Rust reference to it exists; `done <= len`.
    match unsafe { io.recv_exact(ptr, len - done) } {
        Ok(()) => {
            chunk.acked();
            Ok(())
        }
        Err(e) => {
            debug!(peer = %cx.peer, stream = cx.index, error = %e, "receive failed; stream closed");
            let native = e.raw_os_error();
            chunk.lost(native);
            Err(native)
        }
    }
}

/// Arms the receive of the next response header's rest, unless one is armed.
fn arm_recv(io: &mut SockIo<NotifHold>, sh: &StreamShared) -> std::io::Result<()> {
    if io.armed() {
        return Ok(());
    }
    let mut g = sh.lock();
    io.arm_recv(DATA_RESPONSE_LEN - g.resp_at)?;
    g.recv_armed = true;
    Ok(())
}

/// Sends what a submitter's send left over, if anything. `Err`: the stream is broken.
fn flush_tail(
    io: &mut SockIo<NotifHold>,
    sh: &StreamShared,
    cx: &StreamCtx,
) -> Result<(), Option<i32>> {
    let tail = {
        let mut g = sh.lock();
        if g.tail.is_empty() {
            return Ok(());
        }
        g.busy = true;
        std::mem::take(&mut g.tail)
    };
    let res = io.send_buf(&tail);
    sh.lock().busy = false;
    res.map_err(|e| {
        debug!(peer = %cx.peer, stream = cx.index, error = %e, "send failed; stream closed");
        e.raw_os_error()
    })
}

/// Sends one chunk's request (and WRITE payload); the receive for its response is armed
/// already. The caller holds the send side (`busy`). `Err` (with the native error, if any):
/// the stream is broken.
fn post(
    io: &mut SockIo<NotifHold>,
    job: Job,
    sh: &StreamShared,
    cx: &StreamCtx,
) -> Result<(), Option<i32>> {
    if cx.dead.load(Ordering::Acquire) {
        job.not_posted(FailureKind::PeerLost);
        return Ok(());
    }
    let (posted, tail) = {
        let mut g = sh.lock();
        let posted = g.proto.post(job);
        (posted, std::mem::take(&mut g.tail))
    };
    let out = match posted {
        Post::Send(out) => out,
        Post::Resolved => return Ok(()),
        Post::Broken(job) => {
            job.not_posted(FailureKind::PeerLost);
            return Ok(());
        }
    };
    let fail = |e: std::io::Error| {
        debug!(peer = %cx.peer, stream = cx.index, error = %e, "send failed; stream closed");
        e.raw_os_error()
    };
    // A submitter's leftover bytes precede this request on the wire.
    if !tail.is_empty() {
        io.send_buf(&tail).map_err(fail)?;
    }
    let is_write = out.kind == OpKind::Write;
    let res = if !out.scatter.is_empty() {
        let mut parts: Vec<(*const u8, usize)> =
            Vec::with_capacity(2 + if is_write { out.scatter.len() } else { 0 });
        parts.push((out.head.as_ptr(), out.head.len()));
        parts.push((out.table.as_ptr(), out.table.len()));
        if is_write {
            parts.extend(out.scatter.iter().map(|r| {
                (
                    (r.region.as_ptr() as usize + r.at as usize) as *const u8,
                    r.len,
                )
            }));
        }
        // SAFETY: the header and table live in `out` across the call; each piece's range was
        // checked against its region at post, and `out.scatter` keeps the regions alive; the
        // send is a copying one, done when the call returns.
        unsafe { io.send_vectored(&parts) }
    } else if is_write && cx.splice {
        let ptr = (out.region.as_ptr() as usize + out.local_at as usize) as *const u8;
        // SAFETY: the stream protocol checked the range against the region at post; the
        // request owns the range and keeps the region alive until its response is read (the
        // chunk in flight holds the ops), and the peer answers only after it received every
        // byte, so no page reference outlives that.
        unsafe { io.send_spliced(&out.head, ptr, out.len) }
    } else if is_write {
        let body = Body {
            region: &out.region,
            offset: out.local_at,
            len: out.len,
        };
        let mut hold = || NotifHold::new(&out.req);
        // SAFETY: the range was checked against the region at post; the request owns it until
        // drained, which waits for every hold made here (each keeps the request, and so its
        // ops' regions, alive until the send's notification).
        unsafe { io.send(&out.head, Some(body), Some(&mut hold)) }
    } else {
        io.send_buf(&out.head)
    };
    res.map_err(fail)
}

/// Resolves the oldest chunks in flight with `head` (reading a READ's payload into registered
/// memory first). `Err`: the stream is broken.
fn on_response(
    io: &mut SockIo<NotifHold>,
    head: &[u8; DATA_RESPONSE_LEN],
    sh: &StreamShared,
    cx: &StreamCtx,
) -> Result<(), Option<i32>> {
    let resolved = sh.lock().proto.on_response(head);
    let chunk = match resolved {
        Ok(Resolution::Done) => return Ok(()),
        Ok(Resolution::Pieces(pieces)) => {
            let parts: Vec<(*mut u8, usize)> = pieces
                .iter()
                .map(|c| {
                    (
                        (c.op().local.as_ptr() as usize + c.local_at() as usize) as *mut u8,
                        c.payload_len() as usize,
                    )
                })
                .collect();
            // SAFETY: each piece's range was checked against its region at post; the request
            // owns the ranges until drained, keeps the regions alive through the chunks' Arcs,
            // and no Rust reference to them exists.
            return match unsafe { io.recv_vectored(&parts) } {
                Ok(()) => {
                    pieces.into_iter().for_each(Chunk::acked);
                    Ok(())
                }
                Err(e) => {
                    debug!(peer = %cx.peer, stream = cx.index, error = %e, "receive failed; stream closed");
                    let native = e.raw_os_error();
                    pieces.into_iter().for_each(|c| c.lost(native));
                    Err(native)
                }
            };
        }
        Ok(Resolution::Payload(chunk)) => chunk,
        Err(v) => {
            debug!(peer = %cx.peer, stream = cx.index, error = %v, "bad response; stream closed");
            return Err(None);
        }
    };
    let ptr = (chunk.op().local.as_ptr() as usize + chunk.local_at() as usize) as *mut u8;
    // SAFETY: the stream protocol checked the range against the region at post; the request
    // owns the range until drained, keeps the region alive through the chunk's Arc, and no Rust
    // reference to it exists.
    match unsafe { io.recv_exact(ptr, chunk.payload_len() as usize) } {
        Ok(()) => {
            chunk.acked();
            Ok(())
        }
        Err(e) => {
            debug!(peer = %cx.peer, stream = cx.index, error = %e, "receive failed; stream closed");
            let native = e.raw_os_error();
            chunk.lost(native);
            Err(native)
        }
    }
}
