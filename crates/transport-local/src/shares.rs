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
//! a WRITE only on a read-write grant), of at most a chunk in all (the channel's chunk size,
//! 4 MiB by default: a larger one is copied faster by the owner's streams side by side than by
//! one thread), with `memcpy` in the submitting thread: one-sided, the owner's threads never
//! woken. Anything else takes the owner's copies. A token seen for the
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
use ferry_core::{BoxFuture, Op, OpKind, Outcome, RemoteStatus, RequestControl};
use ferry_core::{SegmentLease, SegmentToken};
use tracing::debug;

use crate::shm::{Mapped, recv_fd, send_fd};
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
    pub(crate) fn execute(
        self: &Arc<Self>,
        ops: &[Op],
        control: &Arc<RequestControl>,
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
        let mut revoked = Vec::new();
        for (i, (op, seg)) in ops.iter().zip(&segs).enumerate() {
            control.with_ledger(|l| {
                l.plan(i, 1);
                l.posted(i);
            });
            let off = (seg.base + op.remote_offset) as usize;
            let n = op.len as usize;
            let moved = match op.kind {
                OpKind::Read => seg.map.copy_out(off, &op.local, op.local_offset, n),
                _ => seg.map.copy_in(off, &op.local, op.local_offset, n),
            };
            control.with_ledger(|l| match moved {
                Ok(()) => l.acked(i),
                Err(_) => l.refused(i, RemoteStatus::UnknownSegment),
            });
            if moved.is_err() {
                revoked.push(op.token);
            }
        }
        self.one_sided
            .fetch_add(ops.len() as u64, Ordering::Relaxed);
        if !revoked.is_empty() {
            let mut map = lock(&self.map);
            for t in revoked {
                map.insert(t, Entry::Refused(ShareRefusal::Revoked));
            }
        }
        Some(done(control))
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
