//! A served stream's socket operations: what moves at once with one non-blocking syscall, the
//! ring operation of the front step for the rest, its completion (a file piece's too), and the
//! receive low mark.

use std::io;
use std::os::fd::{AsRawFd, RawFd};

use ferry_core::wire::DATA_REQUEST_LEN;
use ferry_net::RECV_LOW_MARK as LOWAT;
use io_uring::{opcode, squeue, types};
use tracing::debug;

use super::conn::{Conn, Step, total};
use super::plan::plan_table;
use crate::ring::{MAX_IOV, iovecs_from};

/// Receives what the socket holds now of the rest of the next request header into `c.head`
/// (one non-blocking syscall, none if all of it came with the payload): whether all of it is in.
/// A part stays counted in `c.head_got`; an error or the peer's end is left to the next
/// receive, which sees it again.
pub(super) fn head_now(c: &mut Conn) -> bool {
    if c.head_got < DATA_REQUEST_LEN {
        let rest = &mut c.head[c.head_got..];
        // SAFETY: receives at most `rest.len()` bytes into the stream's own header buffer.
        let n = unsafe {
            libc::recv(
                c.stream.as_raw_fd(),
                rest.as_mut_ptr().cast(),
                rest.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n > 0 {
            c.head_got += n as usize;
        }
    }
    c.head_got >= DATA_REQUEST_LEN
}

/// Appends to `iov` (which covers all of a WRITE payload's `rest` bytes) the part of the next
/// request header not received yet, so that the same receive takes what is there of it.
pub(super) fn with_head(
    iov: &mut Vec<libc::iovec>,
    rest: usize,
    head: &mut [u8; DATA_REQUEST_LEN],
    got: usize,
) {
    let covered: usize = iov.iter().map(|v| v.iov_len).sum();
    if covered == rest && got < DATA_REQUEST_LEN && iov.len() < MAX_IOV {
        iov.push(libc::iovec {
            iov_base: head[got..].as_mut_ptr().cast(),
            iov_len: DATA_REQUEST_LEN - got,
        });
    }
}

/// Counts `n` bytes received by a payload's receive that may have taken the next header too:
/// those past the payload's rest are the header's.
pub(super) fn received(done: &mut usize, all: usize, head_got: &mut usize, n: usize) {
    let rest = all.saturating_sub(*done);
    if n > rest {
        *head_got += n - rest;
        *done = all;
    } else {
        *done += n;
    }
}

/// Sets the socket's receive low mark for `c`'s front step, as the client rings do: a payload
/// receive of more than [`LOWAT`] wakes the ring once per
/// [`LOWAT`] (or the rest, for its tail), not once per segment; every other receive (a header
/// next) needs the mark back at 1. A refused mark is not tried again on the socket.
pub(super) fn low_mark(c: &mut Conn) {
    if c.lowat == 0 {
        return;
    }
    let want = match c.steps.front() {
        Some(Step::Recv { parts, done, .. }) if total(parts) > LOWAT => {
            (total(parts) - done).clamp(1, LOWAT)
        }
        Some(Step::Send { .. } | Step::SendZc { .. }) => return,
        _ => 1,
    };
    if want == c.lowat {
        return;
    }
    // SAFETY: the descriptor of the stream's socket, which `c` keeps open.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(c.stream.as_raw_fd()) };
    match ferry_net::set_recv_low_mark(fd, want) {
        Ok(()) => c.lowat = want,
        Err(e) => {
            debug!(error = %e, "SO_RCVLOWAT refused; receiving without it");
            if c.lowat != 1 {
                // Still raised: a header would wait for the old mark.
                let _ = ferry_net::set_recv_low_mark(fd, 1);
            }
            c.lowat = 0;
        }
    }
}

/// Brings the socket's receive low mark back to 1 (or finds it there): whether it is.
pub(super) fn mark_one(c: &mut Conn) -> bool {
    if c.lowat <= 1 {
        return true;
    }
    // SAFETY: the descriptor of the stream's socket, which `c` keeps open.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(c.stream.as_raw_fd()) };
    if ferry_net::set_recv_low_mark(fd, 1).is_ok() {
        c.lowat = 1;
        true
    } else {
        false
    }
}

/// Moves as much of `c`'s front step (a send or a payload receive) as the socket takes or holds
/// now, without waiting: `true` once all of it moved.
pub(super) fn direct(c: &mut Conn) -> io::Result<bool> {
    let fd = c.stream.as_raw_fd();
    let Conn {
        steps,
        iov,
        head,
        head_got,
        ..
    } = c;
    let (send, parts, done, head_too) = match steps.front_mut() {
        Some(Step::Send { parts, done, .. }) => (true, &*parts, done, false),
        Some(Step::Recv {
            parts,
            done,
            head_too,
            ..
        }) => (false, &*parts, done, *head_too),
        _ => return Ok(false),
    };
    let all = total(parts);
    if *done >= all {
        return Ok(true);
    }
    iovecs_from(parts, *done, iov);
    if head_too {
        // Never waits: what is there of the next header comes with the payload's rest.
        with_head(iov, all - *done, head, *head_got);
    }
    // SAFETY: a zeroed msghdr is valid (no name, no control).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
    // SAFETY: the iovecs cover memory the step keeps alive (its `Keep`, checked ranges of
    // leased regions) and that nothing else reads or writes meanwhile; the call does not keep
    // them past its return.
    let n = unsafe {
        if send {
            libc::sendmsg(fd, &msg, flags)
        } else {
            libc::recvmsg(fd, &mut msg, flags)
        }
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EAGAIN | libc::EINTR) => Ok(false),
            _ => Err(e),
        };
    }
    if n == 0 {
        return Err(if send {
            io::Error::new(io::ErrorKind::WriteZero, "send took nothing")
        } else {
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "peer closed the stream in a payload",
            )
        });
    }
    received(done, all, head_got, n as usize);
    Ok(*done >= all)
}

/// The socket operation of `c`'s front step (its iovecs and message set up in `c`).
pub(super) fn sock_op(c: &mut Conn) -> Option<squeue::Entry> {
    let Conn {
        steps,
        iov,
        msg,
        fixed,
        stream,
        lowat,
        head,
        head_got,
        ..
    } = c;
    let (send, flags) = match steps.front_mut()? {
        Step::Send { parts, done, .. } => {
            iovecs_from(parts, *done, iov);
            // All of it before the completion (a full socket is waited out in the kernel,
            // not with a completion per piece).
            (true, libc::MSG_WAITALL)
        }
        Step::SendZc {
            head, head_done, ..
        } => {
            iovecs_from(&[(head.as_ptr(), head.len())], *head_done, iov);
            (true, libc::MSG_WAITALL | libc::MSG_MORE)
        }
        Step::Recv {
            parts,
            done,
            head_too,
            ..
        } => {
            iovecs_from(parts, *done, iov);
            // With the low mark raised the receive completes with what is there (at least the
            // mark, or the rest), and the next one sets the mark for the rest: waiting for all
            // of it under a mark above the rest would never wake.
            if *lowat > 1 {
                // It waits for no more than the mark (at most the payload's rest), so it may
                // also take what is there of the next header.
                if *head_too {
                    with_head(iov, total(parts) - *done, head, *head_got);
                }
                (false, 0)
            } else {
                (false, libc::MSG_WAITALL)
            }
        }
        Step::Discard { left, buf } => {
            let n = (*left).min(buf.len() as u64) as usize;
            iovecs_from(&[(buf.as_ptr(), n)], 0, iov);
            (false, 0)
        }
        Step::Head { buf, got } => {
            iovecs_from(&[(buf.as_ptr(), buf.len())], *got, iov);
            (false, libc::MSG_WAITALL)
        }
        Step::Table { bytes, got, .. } => {
            iovecs_from(&[(bytes.as_ptr(), bytes.len())], *got, iov);
            (false, libc::MSG_WAITALL)
        }
        _ => return None,
    };
    if iov.is_empty() {
        return None;
    }
    debug_assert!(iov.len() <= MAX_IOV);
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    let flags = (flags | libc::MSG_NOSIGNAL) as u32;
    let msg_ptr: *mut libc::msghdr = msg;
    Some(match (send, *fixed) {
        (true, Some(slot)) => opcode::SendMsg::new(types::Fixed(slot), msg_ptr)
            .flags(flags)
            .build(),
        (true, None) => opcode::SendMsg::new(types::Fd(stream.as_raw_fd() as RawFd), msg_ptr)
            .flags(flags)
            .build(),
        (false, Some(slot)) => opcode::RecvMsg::new(types::Fixed(slot), msg_ptr)
            .flags(flags)
            .build(),
        (false, None) => opcode::RecvMsg::new(types::Fd(stream.as_raw_fd() as RawFd), msg_ptr)
            .flags(flags)
            .build(),
    })
}

/// A socket operation of `c`'s front step completed with `res`: counts its bytes, pops the step
/// once it is done (a header starts the next request).
pub(super) fn on_complete(c: &mut Conn, res: i32) -> io::Result<()> {
    if res == -libc::EINTR || res == -libc::EAGAIN {
        return Ok(());
    }
    if res < 0 {
        return Err(io::Error::from_raw_os_error(-res));
    }
    let n = res as usize;
    let eof = |what: &str| io::Error::new(io::ErrorKind::UnexpectedEof, what.to_string());
    let finished = match c.steps.front_mut() {
        Some(Step::Send { parts, done, .. }) => {
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "send took nothing",
                ));
            }
            *done += n;
            *done >= total(parts)
        }
        Some(Step::SendZc {
            head,
            head_done,
            len,
            done,
            ..
        }) => {
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "send took nothing",
                ));
            }
            if *head_done < head.len() {
                *head_done += n;
            } else {
                *done += n;
            }
            *head_done >= head.len() && *done >= *len
        }
        Some(Step::Recv { parts, done, .. }) => {
            if n == 0 {
                return Err(eof("peer closed the stream in a payload"));
            }
            let all = total(parts);
            received(done, all, &mut c.head_got, n);
            *done >= all
        }
        Some(Step::Discard { left, .. }) => {
            if n == 0 {
                return Err(eof("peer closed the stream in a refused payload"));
            }
            *left = left.saturating_sub(n as u64);
            *left == 0
        }
        Some(Step::Head { buf, got }) => {
            if n == 0 && *got == 0 {
                // A clean end between requests.
                c.steps.clear();
                c.steps.push_back(Step::Close);
                return Ok(());
            }
            if n == 0 {
                return Err(eof("peer closed the stream in a request header"));
            }
            *got += n;
            if *got >= DATA_REQUEST_LEN {
                c.head = **buf;
                c.ready = true;
                true
            } else {
                false
            }
        }
        Some(Step::Table { bytes, got, .. }) => {
            if n == 0 {
                return Err(eof("peer closed the stream in a piece table"));
            }
            *got += n;
            *got >= bytes.len()
        }
        Some(Step::FileRead {
            file, len, done, ..
        }) => {
            if n == 0 {
                return Err(eof(&format!("file {} shrank under a READ", file.name())));
            }
            *done += n;
            *done >= *len
        }
        Some(Step::FileWrite {
            file, len, done, ..
        }) => {
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    format!("short write to file {}", file.name()),
                ));
            }
            *done += n;
            *done >= *len
        }
        _ => return Err(io::Error::other("a completion for a step without one")),
    };
    if finished {
        // Done: off the queue (a piece table then queues its pieces).
        let step = c.steps.pop_front();
        if let Some(Step::Table { req, bytes, .. }) = step {
            plan_table(c, &req, &bytes);
        }
    }
    Ok(())
}
