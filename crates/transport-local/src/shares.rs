//! Shared registrations on the same-host plane: the share stream's two ends.
//!
//! *Serving* ([`serve`]): a share stream's requests name a token; the peer's view resolves it
//! (as it does a data request), the registration's memfd decides
//! (`ferry_core::SharedMemory::grant`: the I/O-free `ferry_core::share::ShareState`), and
//! the memfd goes over the socket (`SCM_RIGHTS`; a read-only grant's descriptor reopened
//! read-only besides the seal), or the refusal's code. The client is checked to be the process
//! and program that attached before each answer, as before each data request.
//!
//! *Using* ([`Shares`]): a channel maps what it is granted, once per token, and then moves a
//! request all of whose ops are host READs and WRITEs of mapped segments (inside their bounds,
//! a WRITE only on a read-write grant) with `memcpy`: one-sided, the owner's threads never
//! woken. A request of at most a chunk in all (the channel's chunk size, 4 MiB by default) is
//! copied in the submitting thread before `execute` returns; a larger one is cut in pieces of
//! 1 MiB (`PIECE`) copied side by side by the submitting thread and the process's copy threads
//! (`crate::pool`: half the CPUs, one to four), each piece's parts recorded in the ledger as
//! they are posted and copied, its future resolving once the last piece was copied, never
//! before (issue 51: no copy of a request that resolved is still running). A stopped request
//! (`RequestControl::stopped`) copies none of the pieces not started yet; they fail with the
//! stop. Anything else takes the owner's copies. A token seen for the
//! first time is asked for on a thread of its own while its ops go the owner's way, so a
//! request never waits for a grant. A revoked registration (its owner's revoked word set)
//! fails the ops that see it, `UnknownSegment` as the owner would answer, and its mapping is
//! dropped. A request is moved one-sidedly only while the owner's end of the share stream is
//! open (one `poll` per request): an owner that died or shut its server down is copied with
//! no more, and its requests fail as on the streams.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use ferry_core::share::{Grant, ShareRefusal};
use ferry_core::stream::ServerStream;
use ferry_core::{BoxFuture, FailureKind, Op, OpKind, Outcome, RemoteStatus, RequestControl};
use ferry_core::{SegmentLease, SegmentToken};
use tracing::debug;

use crate::pool::{self, Pieces, Pool};
use crate::shm::{Mapped, Revoked, recv_fd, send_fd};
use crate::wire::{
    SHARE_GRANT_LEN, SHARE_GRANTED, SHARE_READ_ONLY, SHARE_READ_WRITE, SHARE_REFUSED,
};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Serves a share stream until the client ends it: each token resolved through `proto`'s view,
/// granted or refused. `check` runs before each answer (the client still the process that
/// attached; an error ends the stream). The socket is shut down at the end.
pub(crate) fn serve(sock: &UnixStream, proto: &ServerStream, check: impl Fn() -> io::Result<()>) {
    match serve_requests(sock, proto, check) {
        Ok(()) => debug!("same-host share stream ended"),
        Err(e) => debug!(error = %e, "same-host share stream failed"),
    }
    let _ = sock.shutdown(std::net::Shutdown::Both);
}

fn serve_requests(
    sock: &UnixStream,
    proto: &ServerStream,
    check: impl Fn() -> io::Result<()>,
) -> io::Result<()> {
    loop {
        let mut token = [0u8; 8];
        match (&*sock).read_exact(&mut token) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        check()?;
        // The lease is let go before the answer: once the client has it, the server holds
        // nothing of the registration (its end is not delayed by a grant).
        let granted = {
            let lease = proto.resolve(SegmentToken(u64::from_le_bytes(token)));
            grant(lease.as_ref()).and_then(|(grant, lease)| describe(grant, lease))
        };
        match granted {
            Ok((fd, details)) => {
                send_fd(sock, SHARE_GRANTED, Some(&fd))?;
                (&*sock).write_all(&details)?;
            }
            Err(refusal) => {
                debug!(%refusal, "a shared registration refused");
                (&*sock).write_all(&[SHARE_REFUSED, refusal.code()])?;
            }
        }
    }
}

/// The decision for one resolved token (`None`: not in the peer's view).
fn grant(lease: Option<&SegmentLease>) -> Result<(Grant, &SegmentLease), ShareRefusal> {
    let Some(lease) = lease else {
        return Err(ShareRefusal::NotVisible);
    };
    let Some(shared) = lease.region.shared() else {
        return Err(ShareRefusal::NotShareable);
    };
    Ok((shared.grant(true, lease.access)?, lease))
}

/// A granted memfd's descriptor to send (a read-only grant's reopened read-only too: the seal
/// is what holds, since a descriptor can be reopened; this only keeps it from adding seals or
/// resizing) and the grant's details.
fn describe(
    grant: Grant,
    lease: &SegmentLease,
) -> Result<(OwnedFd, [u8; SHARE_GRANT_LEN]), ShareRefusal> {
    let Some(shared) = lease.region.shared() else {
        return Err(ShareRefusal::NotShareable);
    };
    let mut details = [0u8; SHARE_GRANT_LEN];
    details[0] = match grant {
        Grant::ReadOnly => SHARE_READ_ONLY,
        Grant::ReadWrite => SHARE_READ_WRITE,
    };
    details[1..9].copy_from_slice(&lease.base.to_le_bytes());
    details[9..17].copy_from_slice(&lease.len.to_le_bytes());
    details[17..25].copy_from_slice(&(lease.region.len() as u64).to_le_bytes());
    let reopened = match grant {
        Grant::ReadOnly => {
            std::fs::File::open(format!("/proc/self/fd/{}", shared.fd().as_raw_fd()))
                .map(OwnedFd::from)
                .ok()
        }
        Grant::ReadWrite => None,
    };
    let fd = match reopened {
        Some(fd) => fd,
        None => shared.fd().try_clone_to_owned().map_err(|e| {
            debug!(error = %e, "cannot duplicate a shareable memfd; not granted");
            ShareRefusal::NotShareable
        })?,
    };
    Ok((fd, details))
}

/// A segment a channel mapped: the mapping and where the segment lies in it.
#[derive(Debug)]
struct Segment {
    map: Mapped,
    base: u64,
    len: u64,
}

#[derive(Debug)]
enum Entry {
    /// Asked for; not answered yet.
    Asked,
    Mapped(Arc<Segment>),
    Refused(ShareRefusal),
}

/// A channel's shared registrations: its share stream, and what it mapped or was refused, per
/// token.
#[derive(Debug)]
pub(crate) struct Shares {
    sock: Mutex<UnixStream>,
    /// The same socket, to end it while an ask waits on it.
    closer: Option<UnixStream>,
    map: Mutex<HashMap<SegmentToken, Entry>>,
    one_sided: AtomicU64,
}

impl Shares {
    pub(crate) fn new(sock: UnixStream) -> Self {
        Self {
            closer: sock.try_clone().ok(),
            sock: Mutex::new(sock),
            map: Mutex::default(),
            one_sided: AtomicU64::new(0),
        }
    }

    /// Ends the share stream (the mappings stay until dropped; nothing more is asked for).
    pub(crate) fn close(&self) {
        if let Some(s) = &self.closer {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Ops moved one-sidedly so far.
    pub(crate) fn one_sided_ops(&self) -> u64 {
        self.one_sided.load(Ordering::Relaxed)
    }

    /// Segments mapped now.
    pub(crate) fn mapped(&self) -> usize {
        lock(&self.map)
            .values()
            .filter(|e| matches!(e, Entry::Mapped(_)))
            .count()
    }

    /// Asks for `token`'s memfd now (blocking on the share stream) and maps it, unless it was
    /// mapped or refused before: the grant, or why not.
    pub(crate) fn map(&self, token: SegmentToken) -> Result<Grant, ShareRefusal> {
        match lock(&self.map).get(&token) {
            Some(Entry::Mapped(s)) if s.map.revoked() => {}
            Some(Entry::Mapped(s)) => return Ok(grant_of(s)),
            Some(Entry::Refused(r)) => return Err(*r),
            Some(Entry::Asked) | None => {}
        }
        let got = self.ask(token);
        let mut map = lock(&self.map);
        match got {
            Ok(seg) => {
                let g = grant_of(&seg);
                map.insert(token, Entry::Mapped(Arc::new(seg)));
                Ok(g)
            }
            Err(r) => {
                map.insert(token, Entry::Refused(r));
                Err(r)
            }
        }
    }

    /// One share request on the stream (one at a time).
    fn ask(&self, token: SegmentToken) -> Result<Segment, ShareRefusal> {
        let sock = lock(&self.sock);
        let asked = (|| {
            (&*sock).write_all(&token.0.to_le_bytes())?;
            let (status, fd) = recv_fd(&sock)?;
            match (status, fd) {
                (SHARE_GRANTED, Some(fd)) => {
                    let mut d = [0u8; SHARE_GRANT_LEN];
                    (&*sock).read_exact(&mut d)?;
                    Ok(adopt(&fd, &d))
                }
                (SHARE_REFUSED, None) => {
                    let mut code = [0u8; 1];
                    (&*sock).read_exact(&mut code)?;
                    Ok(Err(
                        ShareRefusal::from_code(code[0]).unwrap_or(ShareRefusal::NotShareable)
                    ))
                }
                _ => Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a share answer that is neither a grant with its memfd nor a refusal",
                )),
            }
        })();
        match asked {
            Ok(r) => r,
            Err(e) => {
                debug!(error = %e, "the share stream failed; the owner copies from now on");
                let _ = sock.shutdown(std::net::Shutdown::Both);
                Err(ShareRefusal::NotShareable)
            }
        }
    }

    /// Moves the request one-sidedly when every op can be (see the module); `None`: it takes
    /// the owner's copies (and tokens never asked for are asked for, on a thread of their own).
    /// A request of at most `chunk` bytes is copied in this thread before this returns; a
    /// larger one in pieces side by side (`crate::pool`), its future resolving once the last
    /// piece was copied.
    pub(crate) fn execute(
        self: &Arc<Self>,
        ops: &Arc<[Op]>,
        control: &Arc<RequestControl>,
        chunk: u64,
    ) -> Option<BoxFuture<'static, Outcome>> {
        let segs = self.segments(ops)?;
        // The owner still there: a process that died closed its end of the share stream. Looked
        // at once per request, so that no copy succeeds on the memory of an owner known gone
        // (an answer to an ask in flight makes it readable too: the owner copies that request).
        if self.closer.as_ref().is_none_or(crate::host::readable_now) {
            return None;
        }
        if let Some(why) = control.stopped() {
            control.with_ledger(|l| {
                for i in 0..ops.len() {
                    l.not_posted(i, why, None);
                }
            });
            return Some(done(control));
        }
        self.one_sided
            .fetch_add(ops.len() as u64, Ordering::Relaxed);
        if ops.iter().map(|o| o.len).sum::<u64>() > chunk {
            return Some(self.side_by_side(ops, segs, control));
        }
        for (i, (op, seg)) in ops.iter().zip(&segs).enumerate() {
            control.with_ledger(|l| {
                l.plan(i, 1);
                l.posted(i);
            });
            let moved = copy(op, seg, 0, op.len);
            control.with_ledger(|l| match moved {
                Ok(()) => l.acked(i),
                Err(_) => l.refused(i, RemoteStatus::UnknownSegment),
            });
            if moved.is_err() {
                self.forget_revoked(op.token);
            }
        }
        Some(done(control))
    }

    /// Copies a large request in pieces of [`PIECE`] bytes on this thread and the pool's.
    fn side_by_side(
        self: &Arc<Self>,
        ops: &Arc<[Op]>,
        segs: Vec<Arc<Segment>>,
        control: &Arc<RequestControl>,
    ) -> BoxFuture<'static, Outcome> {
        let cut = Cut::new(ops.iter().map(|o| o.len), PIECE);
        control.with_ledger(|l| {
            for (i, n) in cut.per_op.iter().enumerate() {
                l.plan(i, *n);
            }
        });
        let request = Request {
            shares: self.clone(),
            ops: ops.clone(),
            segs,
            cut,
            control: control.clone(),
        };
        let copying = pool::side_by_side(Pool::shared(), request);
        if copying.done() {
            return done(control);
        }
        let control = control.clone();
        Box::pin(async move {
            copying.await;
            control.outcome(true)
        })
    }

    /// A registration seen revoked: dropped here (unmapped once no copy holds it), and never
    /// asked for again.
    fn forget_revoked(&self, token: SegmentToken) {
        lock(&self.map).insert(token, Entry::Refused(ShareRefusal::Revoked));
    }

    /// The mapped segment of every op, when each is a host READ or WRITE the grant allows
    /// inside the segment's bounds; asks for tokens never seen.
    fn segments(self: &Arc<Self>, ops: &[Op]) -> Option<Vec<Arc<Segment>>> {
        let mut segs = Vec::with_capacity(ops.len());
        let mut unseen = Vec::new();
        {
            let mut map = lock(&self.map);
            for op in ops {
                match map.get(&op.token) {
                    Some(Entry::Mapped(s)) if s.map.revoked() => {
                        // Dropped here (unmapped once no copy holds it).
                        map.insert(op.token, Entry::Refused(ShareRefusal::Revoked));
                    }
                    Some(Entry::Mapped(s)) if fits(op, s) => segs.push(s.clone()),
                    None => unseen.push(op.token),
                    _ => {}
                }
            }
        }
        if !unseen.is_empty() {
            self.ask_later(unseen);
        }
        (segs.len() == ops.len()).then_some(segs)
    }

    /// Asks for `tokens` on a thread of its own (each marked asked first, so once only).
    fn ask_later(self: &Arc<Self>, mut tokens: Vec<SegmentToken>) {
        {
            let mut map = lock(&self.map);
            tokens.retain(|t| !map.contains_key(t));
            for t in &tokens {
                map.insert(*t, Entry::Asked);
            }
        }
        if tokens.is_empty() {
            return;
        }
        let this = self.clone();
        let started = std::thread::Builder::new()
            .name("ferry-local-share".into())
            .spawn(move || {
                for t in tokens {
                    let _ = this.map(t);
                }
            });
        if let Err(e) = started {
            debug!(error = %e, "cannot ask for a shared registration; the owner copies");
        }
    }
}

/// Bytes a piece of a large one-sided request copies: a 1 MiB op is one piece, a larger one
/// several, smaller ones share one.
const PIECE: u64 = 1 << 20;

/// Copies `n` bytes of `op` from `at` on in its segment (a READ out of it, a WRITE into it).
fn copy(op: &Op, seg: &Segment, at: u64, n: u64) -> Result<(), Revoked> {
    let off = (seg.base + op.remote_offset + at) as usize;
    let local = op.local_offset + at;
    match op.kind {
        OpKind::Read => seg.map.copy_out(off, &op.local, local, n as usize),
        _ => seg.map.copy_in(off, &op.local, local, n as usize),
    }
}

/// Bytes `at..at + len` of op `op`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Part {
    op: usize,
    at: u64,
    len: u64,
}

/// A request's ops cut in pieces: its bytes, op after op, cut every `piece` bytes, each piece
/// the parts of the ops it holds. An op of no bytes is a part of no bytes.
#[derive(Debug, PartialEq, Eq)]
struct Cut {
    parts: Vec<Part>,
    /// Where each piece's parts end in `parts`.
    ends: Vec<usize>,
    /// Parts per op (the ledger's chunks).
    per_op: Vec<u32>,
}

impl Cut {
    fn new(lens: impl IntoIterator<Item = u64>, piece: u64) -> Self {
        let piece = piece.max(1);
        let mut cut = Self {
            parts: Vec::new(),
            ends: Vec::new(),
            per_op: Vec::new(),
        };
        // Bytes in the piece being filled.
        let mut filled = 0;
        for (op, len) in lens.into_iter().enumerate() {
            let mut parts = 0u32;
            let mut at = 0;
            loop {
                let n = (len - at).min(piece - filled);
                cut.parts.push(Part { op, at, len: n });
                parts += 1;
                at += n;
                filled += n;
                if filled == piece {
                    cut.ends.push(cut.parts.len());
                    filled = 0;
                }
                if at == len {
                    break;
                }
            }
            cut.per_op.push(parts);
        }
        if cut.ends.last() != Some(&cut.parts.len()) {
            cut.ends.push(cut.parts.len());
        }
        cut
    }

    /// Piece `p`'s parts.
    fn piece(&self, p: usize) -> &[Part] {
        let start = if p == 0 { 0 } else { self.ends[p - 1] };
        &self.parts[start..self.ends[p]]
    }
}

/// A large request copied one-sidedly in pieces (`crate::pool`): each piece's parts are
/// posted, copied and acknowledged (or refused, the registration revoked) in the ledger as
/// one op of a small request is.
struct Request {
    shares: Arc<Shares>,
    ops: Arc<[Op]>,
    segs: Vec<Arc<Segment>>,
    cut: Cut,
    control: Arc<RequestControl>,
}

impl Pieces for Request {
    fn count(&self) -> usize {
        self.cut.ends.len()
    }

    fn stopped(&self) -> bool {
        self.control.stopped().is_some()
    }

    fn copy(&self, p: usize) {
        let parts = self.cut.piece(p);
        self.control.with_ledger(|l| {
            for part in parts {
                l.posted(part.op);
            }
        });
        for part in parts {
            let op = &self.ops[part.op];
            let moved = copy(op, &self.segs[part.op], part.at, part.len);
            self.control.with_ledger(|l| match moved {
                Ok(()) => l.acked(part.op),
                Err(_) => l.refused(part.op, RemoteStatus::UnknownSegment),
            });
            if moved.is_err() {
                self.shares.forget_revoked(op.token);
            }
        }
    }

    fn skip(&self, p: usize) {
        // Stopped, or the request's future dropped (nobody reads that outcome).
        let why = self.control.stopped().unwrap_or(FailureKind::Cancelled);
        self.control.with_ledger(|l| {
            for part in self.cut.piece(p) {
                l.not_posted(part.op, why, None);
            }
        });
    }
}

fn grant_of(s: &Segment) -> Grant {
    if s.map.writable() {
        Grant::ReadWrite
    } else {
        Grant::ReadOnly
    }
}

/// Whether `op` moves one-sidedly on `seg`: host memory, a READ (or a WRITE on a writable
/// mapping), inside the segment, and the registration not revoked.
fn fits(op: &Op, seg: &Segment) -> bool {
    let kind = match op.kind {
        OpKind::Read => true,
        OpKind::Write => seg.map.writable(),
        OpKind::Checksum => false,
    };
    kind && op.local.is_host()
        && op.local.check(op.local_offset, op.len).is_ok()
        && ferry_core::check_range(op.remote_offset, op.len, seg.len).is_ok()
        && !seg.map.revoked()
}

/// Maps a granted memfd as its details say, or refuses it as not shareable (a memfd not sealed,
/// or of another layout: logged).
fn adopt(fd: &OwnedFd, d: &[u8; SHARE_GRANT_LEN]) -> Result<Segment, ShareRefusal> {
    let u64_at = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&d[i..i + 8]);
        u64::from_le_bytes(b)
    };
    let (base, len, region) = (u64_at(1), u64_at(9), u64_at(17));
    let writable = match d[0] {
        SHARE_READ_ONLY => false,
        SHARE_READ_WRITE => true,
        _ => return Err(ShareRefusal::NotShareable),
    };
    if ferry_core::check_range(base, len, region).is_err() {
        debug!(
            base,
            len, region, "a grant whose segment lies outside its region"
        );
        return Err(ShareRefusal::NotShareable);
    }
    let region = usize::try_from(region).map_err(|_| ShareRefusal::NotShareable)?;
    match Mapped::adopt(fd, region, writable) {
        Ok(map) => Ok(Segment { map, base, len }),
        Err(e) => {
            debug!(error = %e, "a granted memfd that cannot be mapped; the owner copies");
            Err(ShareRefusal::NotShareable)
        }
    }
}

fn done(control: &Arc<RequestControl>) -> BoxFuture<'static, Outcome> {
    let outcome = control.outcome(true);
    Box::pin(std::future::ready(outcome))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(op: usize, at: u64, len: u64) -> Part {
        Part { op, at, len }
    }

    /// The request's bytes are cut every piece, across ops; every byte is in exactly one part,
    /// in order, and each op's parts are counted.
    #[test]
    fn a_cut_covers_every_byte_once_in_pieces_of_at_most_a_piece() {
        let cut = Cut::new([10, 3, 0, 14, 1], 8);
        let pieces: Vec<&[Part]> = (0..cut.ends.len()).map(|p| cut.piece(p)).collect();
        assert_eq!(
            pieces,
            [
                &[part(0, 0, 8)][..],
                &[part(0, 8, 2), part(1, 0, 3), part(2, 0, 0), part(3, 0, 3)],
                &[part(3, 3, 8)],
                &[part(3, 11, 3), part(4, 0, 1)],
            ]
        );
        assert_eq!(cut.per_op, [2, 1, 1, 3, 1]);
        for lens in [
            vec![1 << 20; 64],
            vec![(4 << 20) + 5, 3, 7 << 19],
            vec![0, 0],
        ] {
            let cut = Cut::new(lens.iter().copied(), PIECE);
            for p in 0..cut.ends.len() {
                let bytes: u64 = cut.piece(p).iter().map(|x| x.len).sum();
                assert!(bytes <= PIECE && (bytes == PIECE || p + 1 == cut.ends.len()));
            }
            for (op, len) in lens.iter().enumerate() {
                let mine: Vec<_> = cut.parts.iter().filter(|x| x.op == op).collect();
                assert_eq!(mine.len() as u32, cut.per_op[op]);
                let mut at = 0;
                for x in mine {
                    assert_eq!(x.at, at);
                    at += x.len;
                }
                assert_eq!(at, *len);
            }
        }
        assert_eq!(
            Cut::new([1 << 20; 64], PIECE).ends.len(),
            64,
            "a 1 MiB op a piece"
        );
    }
}
