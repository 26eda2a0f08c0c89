//! What a served stream queues for a request: the steps of the stream protocol's action, and
//! of a vectored request's piece table.

use std::collections::VecDeque;
use std::sync::Arc;

use ferry_core::checksum::FileCrc;
use ferry_core::stream::{Action, Target};
use ferry_core::wire::{DATA_REQUEST_LEN, DATA_RESPONSE_LEN, VectoredRequest};
use ferry_core::{FileSource, MemoryRegion, OpKind};
use tracing::{debug, warn};

use super::conn::{Conn, DISCARD_BUF, Keep, Step};
use super::files::{FILE_PIECE, FileIo};
use super::shared::Ctx;
use crate::ring::IoStats;

/// Queues what request `head` asks (as the stream protocol decides).
pub(super) fn plan(c: &mut Conn, ctx: &Ctx, head: &[u8; DATA_REQUEST_LEN]) {
    let action = c.proto.on_request(head);
    // Only an accepted WRITE to memory may join the held-back responses; any other answer must
    // not overtake them.
    if !action.joins_held()
        && let Some(r) = c.proto.flush()
    {
        c.steps.push_back(Step::send_owned(r.to_vec()));
    }
    match action {
        Action::WriteMemory {
            lease,
            token,
            at,
            len,
            seq,
            ack_slack,
        } => {
            let ptr = (lease.region.as_ptr() as usize + at as usize) as *const u8;
            if len > 0 {
                c.steps.push_back(Step::Recv {
                    parts: vec![(ptr, len)],
                    done: 0,
                    head_too: true,
                    _keep: Keep {
                        _lease: Some(lease.clone()),
                        ..Keep::default()
                    },
                });
            }
            c.steps.push_back(Step::Answer {
                lease,
                token,
                seq,
                ack_slack,
            });
        }
        Action::ReadMemory {
            lease,
            at,
            len,
            response,
        } => {
            if c.zero_copy && len > 0 {
                c.steps.push_back(Step::SendZc {
                    head: response.to_vec(),
                    head_done: 0,
                    lease,
                    at,
                    len,
                    done: 0,
                });
                return;
            }
            let bytes = response.to_vec();
            let mut parts = vec![(bytes.as_ptr(), bytes.len())];
            if len > 0 {
                parts.push((
                    (lease.region.as_ptr() as usize + at as usize) as *const u8,
                    len,
                ));
            }
            IoStats::add(&ctx.stats.copy_sends, 1);
            c.steps.push_back(Step::Send {
                parts,
                done: 0,
                _keep: Keep {
                    _bytes: bytes,
                    _lease: Some(lease),
                    ..Keep::default()
                },
            });
        }
        Action::ReadFile {
            file,
            at,
            len,
            response,
        } => plan_read_file(c, file, at, len, &response),
        Action::WriteFile {
            file,
            at,
            len,
            response,
        } => plan_write_file(c, file, at, len, &response),
        Action::Refuse {
            kind,
            token,
            status,
            discard,
            response,
        } => {
            debug!(from = %c.from, %token, %kind, %status, "refused chunk");
            if discard > 0 {
                c.steps.push_back(Step::Discard {
                    left: discard,
                    buf: vec![0u8; DISCARD_BUF].into_boxed_slice(),
                });
            }
            c.steps.push_back(Step::send_owned(response.to_vec()));
        }
        Action::ChecksumMemory { lease, sum, seq } => {
            c.steps.push_back(Step::Crc {
                sum,
                seq,
                _lease: lease,
            });
        }
        Action::ChecksumFile { file, at, len, seq } => {
            c.steps.push_back(Step::CrcFile {
                sum: FileCrc::new(file, at, len),
                seq,
            });
        }
        Action::Close { error, response } => {
            warn!(from = %c.from, %error, "malformed data request; closing stream");
            c.steps.push_back(Step::send_owned(response.to_vec()));
            c.steps.push_back(Step::Close);
        }
        Action::Table { req } => {
            c.steps.push_back(Step::Table {
                req,
                bytes: vec![0u8; req.table_len()],
                got: 0,
            });
        }
        Action::Vectored { .. } => {
            warn!(from = %c.from, "a vectored action without its table; closing stream");
            c.steps.push_back(Step::Close);
        }
    }
}

/// Queues a file READ: each piece read into the staging buffer, then sent (the response header
/// with the first).
fn plan_read_file(
    c: &mut Conn,
    file: Arc<dyn FileSource>,
    at: u64,
    len: usize,
    response: &[u8; DATA_RESPONSE_LEN],
) {
    let f = Arc::new(FileIo::new(file));
    if len == 0 {
        c.steps.push_back(Step::send_owned(response.to_vec()));
    }
    let mut done = 0usize;
    let mut first = true;
    while done < len {
        let n = FILE_PIECE.min(len - done);
        let Some(stage) = stage_for(c, n) else {
            return;
        };
        c.steps.push_back(Step::FileRead {
            file: f.clone(),
            at: at + done as u64,
            len: n,
            done: 0,
            stage: stage.clone(),
        });
        let bytes = if first { response.to_vec() } else { Vec::new() };
        first = false;
        let mut parts = Vec::with_capacity(2);
        if !bytes.is_empty() {
            parts.push((bytes.as_ptr(), bytes.len()));
        }
        parts.push((stage.as_ptr() as *const u8, n));
        c.steps.push_back(Step::Send {
            parts,
            done: 0,
            _keep: Keep {
                _bytes: bytes,
                _region: Some(stage),
                ..Keep::default()
            },
        });
        done += n;
    }
}

/// Queues a file WRITE: each piece received into the staging buffer, then written; the response
/// after the last.
fn plan_write_file(
    c: &mut Conn,
    file: Arc<dyn FileSource>,
    at: u64,
    len: usize,
    response: &[u8; DATA_RESPONSE_LEN],
) {
    let f = Arc::new(FileIo::new(file));
    let mut done = 0usize;
    while done < len {
        let n = FILE_PIECE.min(len - done);
        let Some(stage) = stage_for(c, n) else {
            return;
        };
        c.steps.push_back(Step::Recv {
            parts: vec![(stage.as_ptr() as *const u8, n)],
            done: 0,
            head_too: false,
            _keep: Keep {
                _region: Some(stage.clone()),
                ..Keep::default()
            },
        });
        c.steps.push_back(Step::FileWrite {
            file: f.clone(),
            at: at + done as u64,
            len: n,
            done: 0,
            stage,
        });
        done += n;
    }
    c.steps.push_back(Step::send_owned(response.to_vec()));
}

/// The stream's staging buffer for a file piece of `n` bytes (`None`: it cannot be had; the
/// stream is closed).
pub(super) fn stage_for(c: &mut Conn, n: usize) -> Option<Arc<MemoryRegion>> {
    match c.stage.get(n) {
        Ok(r) => Some(r.clone()),
        Err(e) => {
            warn!(from = %c.from, error = %e, "no staging buffer; closing stream");
            c.steps.push_back(Step::Close);
            None
        }
    }
}

/// Queues a vectored request's pieces, its piece table received: runs of memory pieces as one
/// vectored receive or send, file pieces through the staging buffer.
pub(super) fn plan_table(c: &mut Conn, req: &VectoredRequest, bytes: &[u8]) {
    let (kind, targets, discard, response) = match c.proto.on_table(req, bytes) {
        Action::Vectored {
            kind,
            targets,
            discard,
            response,
        } => (kind, Arc::new(targets), discard, response),
        Action::Close { error, response } => {
            warn!(from = %c.from, %error, "malformed piece table; closing stream");
            c.steps.push_front(Step::Close);
            c.steps.push_front(Step::send_owned(response.to_vec()));
            return;
        }
        other => {
            warn!(from = %c.from, ?other, "unexpected answer to a piece table; closing stream");
            c.steps.push_front(Step::Close);
            return;
        }
    };
    // Built apart, then put in front of whatever is queued (nothing: the table was the request's
    // last step).
    let mut steps = VecDeque::new();
    let keep = |bytes: Vec<u8>| Keep {
        _bytes: bytes,
        _targets: Some(targets.clone()),
        ..Keep::default()
    };
    let mut parts: Vec<(*const u8, usize)> = Vec::new();
    let mut head = if kind == OpKind::Write {
        Vec::new()
    } else {
        response.to_vec()
    };
    if !head.is_empty() {
        parts.push((head.as_ptr(), head.len()));
    }
    let flush =
        |steps: &mut VecDeque<Step>, parts: &mut Vec<(*const u8, usize)>, head: &mut Vec<u8>| {
            if parts.iter().all(|p| p.1 == 0) {
                parts.clear();
                return;
            }
            let p = std::mem::take(parts);
            let k = keep(std::mem::take(head));
            steps.push_back(if kind == OpKind::Write {
                Step::Recv {
                    parts: p,
                    done: 0,
                    head_too: false,
                    _keep: k,
                }
            } else {
                Step::Send {
                    parts: p,
                    done: 0,
                    _keep: k,
                }
            });
        };
    for t in targets.iter() {
        match t {
            Target::Memory { lease, at, len } => parts.push((
                (lease.region.as_ptr() as usize + *at as usize) as *const u8,
                *len,
            )),
            Target::File { file, at, len } => {
                flush(&mut steps, &mut parts, &mut head);
                let f = Arc::new(FileIo::Source(file.clone()));
                let mut off = 0usize;
                while off < *len {
                    let n = FILE_PIECE.min(len - off);
                    let Some(stage) = stage_for(c, n) else {
                        return;
                    };
                    let piece = vec![(stage.as_ptr() as *const u8, n)];
                    let k = Keep {
                        _region: Some(stage.clone()),
                        ..Keep::default()
                    };
                    let io = (f.clone(), *at + off as u64, n, stage);
                    if kind == OpKind::Write {
                        steps.push_back(Step::Recv {
                            parts: piece,
                            done: 0,
                            head_too: false,
                            _keep: k,
                        });
                        steps.push_back(Step::FileWrite {
                            file: io.0,
                            at: io.1,
                            len: io.2,
                            done: 0,
                            stage: io.3,
                        });
                    } else {
                        steps.push_back(Step::FileRead {
                            file: io.0,
                            at: io.1,
                            len: io.2,
                            done: 0,
                            stage: io.3,
                        });
                        steps.push_back(Step::Send {
                            parts: piece,
                            done: 0,
                            _keep: k,
                        });
                    }
                    off += n;
                }
            }
        }
    }
    flush(&mut steps, &mut parts, &mut head);
    if kind == OpKind::Write {
        if discard > 0 {
            steps.push_back(Step::Discard {
                left: discard,
                buf: vec![0u8; DISCARD_BUF].into_boxed_slice(),
            });
        }
        steps.push_back(Step::send_owned(response.to_vec()));
    }
    while let Some(s) = steps.pop_back() {
        c.steps.push_front(s);
    }
}
