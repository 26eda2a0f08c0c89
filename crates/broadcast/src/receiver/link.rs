//! A receiver's data paths to its holders: attaching one (its layout, its progress poller),
//! and the fetch of a chunk from it (READs, then the BLAKE3 of what landed).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use ferry::{Batch, Peer, RemoteSegment};
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};

use crate::control::{CtlClient, Reply, Request};
use crate::error::BroadcastError;
use crate::landing::land;
use crate::layout;
use crate::manifest::Manifest;
use crate::plan::{Member, Role};
use crate::pull::Event;

use super::join::{control_err, reachable};
use super::{Origin, Receiver};
use crate::hashing::blake3_of;

/// An attached holder's data path: what fetches read from. What it advertised and every
/// decision about it are [`Pull`](crate::pull::Pull)'s.
pub(super) struct Link {
    pub(super) peer: Peer,
    pub(super) from_source: bool,
    /// Per segment: `(offset in the segment, offset in the remote segment, remote segment)`.
    pub(super) segs: Vec<Vec<(u64, u64, RemoteSegment)>>,
    /// `segs` as `(offset in the segment, length)`.
    pub(super) ranges: Vec<Vec<(u64, u64)>>,
    pub(super) poll: JoinHandle<()>,
}

impl Drop for Link {
    fn drop(&mut self) {
        self.poll.abort();
    }
}

/// What a fetch task reports.
pub(super) struct Fetched {
    pub(super) chunk: usize,
    pub(super) from: String,
    /// The holder's attachment the fetch was asked of ([`Command::Fetch`](crate::pull::Command::Fetch)).
    pub(super) generation: u64,
    pub(super) from_source: bool,
    /// `Ok(true)`: verified; `Ok(false)`: BLAKE3 mismatch; `Err`: the READ failed.
    pub(super) result: Result<bool, String>,
    /// Pulling into files: the verified chunk could not be written to its file.
    pub(super) write_failed: Option<std::io::Error>,
}

/// What attaching a holder needs, owned, so that an attachment runs as a task beside the pull
/// and ends as an event, as a fetch does, rather than inside the command loop (up to
/// `stall_after` and 2 s for a member that does not answer).
#[derive(Clone)]
pub(super) struct Attacher {
    engine: ferry::TransferEngine,
    keys: Option<ferry::Keyring>,
    manifest: Arc<Manifest>,
    origin: Origin,
    stall_after: Duration,
}

impl Receiver {
    /// What attaching a holder needs, for this pull.
    pub(super) fn attacher(&self) -> Attacher {
        Attacher {
            engine: self.engine.clone(),
            keys: self.opts.keys.clone(),
            manifest: Arc::new(self.manifest.clone()),
            origin: self.origin.clone(),
            stall_after: self.opts.stall_after,
        }
    }
}

impl Attacher {
    /// The handshake with `m`'s data plane at `data_addr`: keyed, naming the server identity
    /// `m`'s record lists (so another key holder answering there is refused); keyless, or for a
    /// record without one, a plain connect (its incarnation is checked after).
    async fn connect_holder(
        &self,
        m: &Member,
        data_addr: &str,
    ) -> Result<ferry::Peer, ferry::Error> {
        match (&self.keys, &m.identity) {
            (Some(_), Some(hex)) => {
                let identity: ferry::ServerIdentity =
                    hex.parse().map_err(|e| ferry::Error::InvalidRequest {
                        reason: format!(
                            "member {}'s record lists a bad server identity: {e}",
                            m.id
                        ),
                    })?;
                self.engine.connect_expecting(data_addr, identity).await
            }
            _ => self.engine.connect(data_addr).await,
        }
    }

    /// Connects to `m` as a holder and starts following its progress.
    pub(super) async fn attach(
        &self,
        m: &Member,
        polls: &mpsc::UnboundedSender<Event>,
    ) -> Result<Link, BroadcastError> {
        let data_addr = reachable(&m.data_addr, self.origin.ip);
        let ctl_addr = reachable(&m.ctl_addr, self.origin.ip);
        let peer = match self.connect_holder(m, &data_addr).await {
            Ok(p) => p,
            Err(ferry::Error::StaleEpoch { found, .. }) if m.role == Role::Source => {
                return Err(self.origin.restarted(&self.manifest.name, found.0));
            }
            Err(e) => return Err(e.into()),
        };
        if m.role == Role::Source && peer.epoch().0 != self.origin.epoch {
            return Err(self.origin.restarted(&self.manifest.name, peer.epoch().0));
        }
        crate::discovery::check_incarnation(m, peer.id(), peer.epoch())?;
        let keys = self.keys.as_ref();
        let mut ctl = CtlClient::connect_keyed(&ctl_addr, Duration::from_secs(3), keys).await?;
        let version = self.manifest.version;
        let wire = if m.role == Role::Source {
            let asked = Request::Layout {
                version: Some(version),
            };
            match ctl.call(&asked, Duration::from_secs(3)).await {
                Ok(Reply::Layout {
                    version: v,
                    segments,
                    ..
                }) if v == version => segments,
                Ok(_) => {
                    return Err(control_err(
                        &ctl_addr,
                        format!("answered layout of version {version} with another"),
                    ));
                }
                Err(e) => {
                    // A source from before layouts (it closed the connection on the request):
                    // every segment under its own name.
                    tracing::debug!(error = %e, "source gave no layout; taking the identity");
                    ctl = CtlClient::connect_keyed(&ctl_addr, Duration::from_secs(3), keys).await?;
                    layout::identity(&self.manifest)
                }
            }
        } else {
            match ctl
                .call(&Request::Layout { version: None }, Duration::from_secs(3))
                .await?
            {
                Reply::Layout {
                    version, segments, ..
                } if version == self.manifest.version => segments,
                Reply::Layout { version, .. } => {
                    return Err(control_err(
                        &ctl_addr,
                        format!("holds version {version}, not {}", self.manifest.version),
                    ));
                }
                _ => {
                    return Err(control_err(
                        &ctl_addr,
                        "answered layout with something else",
                    ));
                }
            }
        };
        layout::check(&self.manifest, &wire).map_err(|e| control_err(&ctl_addr, e))?;
        let mut resolved: HashMap<String, RemoteSegment> = HashMap::new();
        let mut segs = Vec::with_capacity(wire.len());
        let mut ranges = Vec::with_capacity(wire.len());
        for ext in wire {
            let mut v = Vec::with_capacity(ext.len());
            let mut r = Vec::with_capacity(ext.len());
            for e in ext {
                let seg = match resolved.get(&e.segment) {
                    Some(s) => s.clone(),
                    None => {
                        let s = peer.segment(&e.segment)?;
                        resolved.insert(e.segment.clone(), s.clone());
                        s
                    }
                };
                if e.offset + e.len > seg.len() {
                    return Err(control_err(
                        &data_addr,
                        format!(
                            "segment {:?} has {} bytes, the layout names {} at {}",
                            e.segment,
                            seg.len(),
                            e.len,
                            e.offset
                        ),
                    ));
                }
                r.push((e.seg_offset, e.len));
                v.push((e.seg_offset, e.offset, seg));
            }
            segs.push(v);
            ranges.push(r);
        }
        let relay = m.role == Role::Receiver;
        let poll = follow_progress(ctl, m.id.clone(), relay, polls.clone(), self.stall_after);
        tracing::info!(holder = %m.id, %data_addr, role = ?m.role, "attached");
        Ok(Link {
            peer,
            from_source: m.role == Role::Source,
            segs,
            ranges,
            poll,
        })
    }

    /// Attaches `m` (within `stall_after` and 2 s more: a member that does not answer its
    /// handshake is not waited on longer than one that stalls).
    pub(super) async fn attach_within(
        &self,
        m: &Member,
        polls: &mpsc::UnboundedSender<Event>,
    ) -> Result<Link, BroadcastError> {
        let limit = self.stall_after + Duration::from_secs(2);
        match tokio::time::timeout(limit, self.attach(m, polls)).await {
            Ok(r) => r,
            Err(_) => Err(control_err(
                &m.data_addr,
                format!("did not answer within {:.1} s", limit.as_secs_f64()),
            )),
        }
    }
}

impl Receiver {
    /// Starts the READs of chunk `i` from `h` (one per piece where `h`'s extents and this
    /// receiver's meet) into where it lands here, then its verification over those pieces;
    /// pulling into files, into a free landing slot, verified there and written to its file.
    /// Returns whether it started (a pull into files with no slot free starts nothing).
    pub(super) fn fetch(
        &self,
        set: &mut JoinSet<Fetched>,
        h: &Link,
        from: &str,
        generation: u64,
        i: usize,
    ) -> bool {
        let c = self.manifest.chunks[i];
        let seg = c.segment as usize;
        // Pulling into files: the chunk lands in a slot of its own.
        let slot = match &self.payload.files {
            None => None,
            Some(l) => match l
                .free
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .pop()
            {
                Some(k) => Some((
                    k,
                    l.slots[k].clone(),
                    l.free.clone(),
                    l.segs[seg].file.clone(),
                )),
                None => return false,
            },
        };
        let mut batch = Batch::new();
        let mut covered = 0;
        match &slot {
            None => {
                for (li, ri, at, n) in
                    layout::pieces(&self.payload.ranges[seg], &h.ranges[seg], c.offset, c.len)
                {
                    let (lstart, slice) = &self.payload.layout[seg][li];
                    let (rstart, roff, remote) = &h.segs[seg][ri];
                    batch.push(
                        ferry::OpKind::Read,
                        slice.memory(),
                        slice.offset() + (at - lstart),
                        remote,
                        roff + (at - rstart),
                        n,
                    );
                    covered += n;
                }
            }
            Some((_, slice, _, _)) => {
                for (_, ri, at, n) in
                    layout::pieces(&[(c.offset, c.len)], &h.ranges[seg], c.offset, c.len)
                {
                    let (rstart, roff, remote) = &h.segs[seg][ri];
                    batch.push(
                        ferry::OpKind::Read,
                        slice.memory(),
                        slice.offset() + (at - c.offset),
                        remote,
                        roff + (at - rstart),
                        n,
                    );
                    covered += n;
                }
            }
        }
        let pieces = if slot.is_some() {
            Vec::new()
        } else {
            self.payload.pieces(&c)
        };
        let copied = self.payload.copied.clone();
        let from = from.to_owned();
        let from_source = h.from_source;
        let submitted = if covered == c.len {
            self.payload.touched.store(true, Ordering::Relaxed);
            self.engine.submit(batch).map_err(|e| e.to_string())
        } else {
            Err(format!(
                "the layouts cover {covered} of the chunk's {} bytes",
                c.len
            ))
        };
        set.spawn(async move {
            let mut write_failed = None;
            let result = match submitted {
                Err(e) => Err(e),
                Ok(handle) => {
                    // Wait for the buffers to be free, not just the logical outcome: a chunk
                    // given up on must not land later over one fetched elsewhere.
                    let outcome = handle.drained().await;
                    match (outcome.failure, &slot) {
                        (Some(f), _) => Err(format!("READ failed: {}", f.kind)),
                        (None, None) => {
                            Ok(blake3_of(&pieces, &copied).is_ok_and(|h| h == c.blake3))
                        }
                        (None, Some((_, slice, _, file))) => match land(slice, &c, file, &copied) {
                            Ok(v) => Ok(v),
                            Err(e) => {
                                write_failed = Some(e);
                                Ok(false)
                            }
                        },
                    }
                }
            };
            if let Some((k, _, free, _)) = slot {
                free.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(k);
            }
            Fetched {
                chunk: i,
                from,
                generation,
                from_source,
                result,
                write_failed,
            }
        });
        true
    }
}

/// Follows holder `id`'s progress over its control connection `ctl` (long polls of at most
/// `stall` or 2 s, whichever is less), reporting each answer to `tx` as an
/// [`Event::Progress`], and its failure as an [`Event::PollFailed`], until it is done; then,
/// for a `relay` (a receiver, not the source), keeps the connection open and reports its end
/// as an [`Event::Left`] ([`until_left`]).
fn follow_progress(
    mut ctl: CtlClient,
    id: String,
    relay: bool,
    tx: mpsc::UnboundedSender<Event>,
    stall: Duration,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut after = 0u64;
        let mut after_count = 0u64;
        let wait = stall.min(Duration::from_secs(2));
        loop {
            let req = Request::Progress {
                after,
                wait_ms: wait.as_millis() as u64,
                after_count: Some(after_count),
            };
            match ctl.call(&req, wait + Duration::from_secs(2)).await {
                Ok(Reply::Progress {
                    source_epoch,
                    prefix,
                    done,
                    version,
                    count,
                    stripes,
                }) => {
                    after = prefix;
                    after_count = count;
                    let msg = Event::Progress {
                        id: id.clone(),
                        source_epoch,
                        prefix,
                        done,
                        version,
                        count,
                        stripes,
                    };
                    if tx.send(msg).is_err() {
                        return;
                    }
                    if done {
                        if relay {
                            until_left(ctl, id, &tx).await;
                        }
                        return;
                    }
                }
                Ok(_) => {
                    let _ = tx.send(Event::PollFailed {
                        id,
                        reason: "answered progress with something else".into(),
                    });
                    return;
                }
                Err(e) => {
                    let _ = tx.send(Event::PollFailed {
                        id,
                        reason: e.to_string(),
                    });
                    return;
                }
            }
        }
    })
}

/// How often the control connection to a finished holder is asked for its progress while
/// [`until_left`] holds it: well within the idle limit members close proven connections at
/// (60 s), so that only the holder leaving (or failing) ends it.
const FINISHED_KEEPALIVE: Duration = Duration::from_secs(20);

/// Holds the control connection to finished holder `id` until it ends, and reports that to
/// `tx` as an [`Event::Left`]: a member that leaves closes its control service, and with it
/// this connection, at once, so a receiver still reading from it re-plans then rather than
/// when the member list next shows it gone (or, for fetches that hang, after `stall_after`).
/// Asks for its progress every [`FINISHED_KEEPALIVE`] meanwhile.
async fn until_left(mut ctl: CtlClient, id: String, tx: &mpsc::UnboundedSender<Event>) {
    let req = Request::Progress {
        after: 0,
        wait_ms: 0,
        after_count: Some(0),
    };
    let reason = loop {
        tokio::select! {
            end = ctl.closed() => break match end {
                Ok(()) => "its control connection closed".to_owned(),
                Err(e) => format!("its control connection failed: {e}"),
            },
            () = tokio::time::sleep(FINISHED_KEEPALIVE) => {
                if let Err(e) = ctl.call(&req, Duration::from_secs(5)).await {
                    break format!("its control connection failed: {e}");
                }
            }
        }
    };
    tracing::debug!(holder = %id, %reason, "finished holder left");
    let _ = tx.send(Event::Left { id, reason });
}
