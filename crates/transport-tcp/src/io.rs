//! Raw socket I/O between the kernel and registered memory, driven by tokio readiness.
//!
//! The payload of a chunk goes straight from registered memory to `sendmsg` and straight from
//! `recv` into registered memory: no intermediate buffer, and no Rust reference into the region is
//! created (the region may be shared with other peers' traffic, see `ferry_core::memory`).

use std::io;
use std::os::fd::{AsFd, AsRawFd};

use ferry_net::RECV_LOW_MARK as LOWAT;

use tokio::io::Interest;
use tokio::net::TcpStream;

/// An address inside registered memory, kept as an integer so futures holding it stay `Send`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawRange {
    pub(crate) addr: usize,
    pub(crate) len: usize,
}

fn check(n: isize) -> io::Result<usize> {
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Sends `head` followed by `body` (either may be empty), resending remainders until all is sent.
///
/// # Safety
/// `body.addr..body.addr+body.len` must stay valid for reads until the future completes (the
/// request owning the range keeps its region alive and does not reuse it before `drained`).
pub(crate) async unsafe fn send_all(
    stream: &TcpStream,
    head: &[u8],
    body: RawRange,
) -> io::Result<()> {
    let parts = [
        RawRange {
            addr: head.as_ptr() as usize,
            len: head.len(),
        },
        body,
    ];
    // SAFETY: `head` is borrowed until the future completes; the body per this function's
    // contract.
    unsafe { send_vectored(stream, &parts).await }
}

/// The iovecs of `parts` from byte `done` on, as many as `iov` holds (empty parts skipped);
/// returns how many. A call that gets fewer than all is followed by another: the callers loop
/// until every byte moved.
fn iovecs_from(parts: &[RawRange], mut done: usize, iov: &mut Iovecs) -> usize {
    let mut n = 0;
    for p in parts {
        if done >= p.len {
            done -= p.len;
            continue;
        }
        iov[n].write(libc::iovec {
            iov_base: (p.addr + done) as *mut libc::c_void,
            iov_len: p.len - done,
        });
        done = 0;
        n += 1;
        if n == IOV_BATCH {
            break;
        }
    }
    n
}

/// The most iovecs one `sendmsg`/`recvmsg` is given: an array on the stack (4 KiB), so no call
/// allocates; 256 pieces of even 4 KiB are 1 MiB a call, more than a receive's low mark.
const IOV_BATCH: usize = 256;

/// Room for [`IOV_BATCH`] iovecs, left uninitialized (a small message pays nothing for the
/// room it does not use): [`iovecs_from`] writes the first `n`, and only those reach the kernel.
type Iovecs = [std::mem::MaybeUninit<libc::iovec>; IOV_BATCH];

/// Uninitialized room for [`iovecs_from`].
fn no_iovecs() -> Iovecs {
    [const { std::mem::MaybeUninit::uninit() }; IOV_BATCH]
}

/// Sends `parts` back to back with vectored `sendmsg` calls (a vectored request: header, piece
/// table, the pieces' bytes scattered over local memory), resending remainders until all is sent.
///
/// # Safety
/// Every range must stay valid for reads until the future completes (the request owning them
/// keeps their regions alive and does not reuse them before `drained`).
pub(crate) async unsafe fn send_vectored(stream: &TcpStream, parts: &[RawRange]) -> io::Result<()> {
    let fd = stream.as_raw_fd();
    let total: usize = parts.iter().map(|p| p.len).sum();
    let mut sent = 0usize;
    while sent < total {
        stream.writable().await?;
        let res = stream.try_io(Interest::WRITABLE, || {
            // Built here, not across an await: iovecs hold raw pointers (not `Send`).
            let mut iov = no_iovecs();
            let n = iovecs_from(parts, sent, &mut iov);
            // SAFETY: a zeroed msghdr is a valid empty message; we fill in the iovec array only.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov.as_mut_ptr().cast(); // the first `n` are initialized
            msg.msg_iovlen = n as _;
            // SAFETY: `fd` is the open socket of `stream`; the iovecs point into ranges the
            // caller keeps valid for reads (this function's contract).
            check(unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) })
        });
        match res {
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Receives exactly the bytes of `parts`, back to back, with vectored `recvmsg` calls (a
/// vectored READ's payload into the pieces' scattered local ranges), the socket's
/// `SO_RCVLOWAT` raised as [`recv_exact`] does. End of stream before that is `UnexpectedEof`.
///
/// # Safety
/// Every range must stay valid for writes until the future completes, and no Rust reference to
/// any of them may be alive meanwhile.
pub(crate) async unsafe fn recv_vectored(stream: &TcpStream, parts: &[RawRange]) -> io::Result<()> {
    let fd = stream.as_raw_fd();
    let total: usize = parts.iter().map(|p| p.len).sum();
    let mut marked = total > LOWAT;
    let mut mark = 1usize;
    let mut got = 0usize;
    let res = loop {
        if got >= total {
            break Ok(());
        }
        let want = (total - got).min(LOWAT);
        if marked && mark != want {
            if set_lowat(stream, want).is_ok() {
                mark = want;
            } else {
                marked = false;
            }
        }
        if let Err(e) = stream.readable().await {
            break Err(e);
        }
        let res = stream.try_io(Interest::READABLE, || {
            // Built here, not across an await: iovecs hold raw pointers (not `Send`).
            let mut iov = no_iovecs();
            let n = iovecs_from(parts, got, &mut iov);
            // SAFETY: a zeroed msghdr is a valid empty message; we fill in the iovec array only.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov.as_mut_ptr().cast(); // the first `n` are initialized
            msg.msg_iovlen = n as _;
            // SAFETY: `fd` is the open socket; the iovecs point into ranges valid for writes
            // with no Rust reference alive (this function's contract).
            check(unsafe { libc::recvmsg(fd, &mut msg, 0) })
        });
        match res {
            Ok(0) => {
                break Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "peer closed the stream with {} bytes outstanding",
                        total - got
                    ),
                ));
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => break Err(e),
        }
    };
    if mark > 1
        && let Err(e) = set_lowat(stream, 1)
    {
        return Err(io::Error::new(
            e.kind(),
            format!("cannot lower the socket's SO_RCVLOWAT from {mark} back to 1: {e}"),
        ));
    }
    res
}

/// Sets the socket's `SO_RCVLOWAT`.
fn set_lowat(stream: &TcpStream, v: usize) -> io::Result<()> {
    ferry_net::set_recv_low_mark(stream.as_fd(), v)
}

/// Receives exactly `dst.len` bytes into `dst`. End of stream before that is `UnexpectedEof`.
///
/// A payload larger than [`LOWAT`] is received with the socket's `SO_RCVLOWAT` raised to
/// [`LOWAT`] (to the rest of the payload for its tail), so the socket turns readable, and the
/// task is woken, once per [`LOWAT`] rather than for every segment that arrives; the mark is back
/// to 1 when this returns (a response or request header must wake its reader).
///
/// # Safety
/// `dst.addr..dst.addr+dst.len` must stay valid for writes until the future completes, and no Rust
/// reference to it may be alive meanwhile.
pub(crate) async unsafe fn recv_exact(stream: &TcpStream, dst: RawRange) -> io::Result<()> {
    // SAFETY: this function's contract is `recv_vectored`'s for one range.
    unsafe { recv_vectored(stream, std::slice::from_ref(&dst)).await }
}

/// Receives exactly `buf.len()` bytes into a Rust buffer (headers).
pub(crate) async fn recv_buf(stream: &TcpStream, buf: &mut [u8]) -> io::Result<()> {
    let dst = RawRange {
        addr: buf.as_mut_ptr() as usize,
        len: buf.len(),
    };
    // SAFETY: `buf` is exclusively borrowed for the whole call, so it stays valid and unaliased.
    unsafe { recv_exact(stream, dst).await }
}

/// Sends all of a Rust buffer (headers).
pub(crate) async fn send_buf(stream: &TcpStream, buf: &[u8]) -> io::Result<()> {
    // SAFETY: the body is empty, so no memory beyond the borrowed `buf` is read.
    unsafe { send_all(stream, buf, RawRange { addr: 0, len: 0 }).await }
}

/// Discards exactly `len` bytes using `scratch` (a refused WRITE's payload).
pub(crate) async fn discard(
    stream: &TcpStream,
    mut len: u64,
    scratch: &mut [u8],
) -> io::Result<()> {
    while len > 0 {
        let n = (scratch.len() as u64).min(len) as usize;
        recv_buf(stream, &mut scratch[..n]).await?;
        len -= n as u64;
    }
    Ok(())
}

/// Shuts both directions of a socket (wakes any task blocked on it).
pub(crate) fn shutdown(stream: &TcpStream) {
    let _ = socket2::SockRef::from(stream).shutdown(std::net::Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::AsyncWriteExt;

    fn rcvlowat(fd: std::os::fd::RawFd) -> usize {
        // SAFETY: the tests pass descriptors of sockets they hold open.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        ferry_net::recv_low_mark(fd).unwrap()
    }

    /// A payload larger than the low mark, arriving in small pieces with pauses, lands whole
    /// (its tail below the mark too), and the mark is back to 1 afterwards, so a 32-byte header
    /// that follows alone still wakes the reader.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn large_receives_use_the_low_mark_and_lower_it_again() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut a = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (b, _) = l.accept().await.unwrap();
        let len = 3 * LOWAT + 1234;
        let data: Vec<u8> = (0..len + 32).map(|i| (i * 7 % 251) as u8).collect();
        let send = data.clone();
        let writer = tokio::spawn(async move {
            for piece in send[..len].chunks(50_000) {
                a.write_all(piece).await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            a.write_all(&send[len..]).await.unwrap();
            a
        });
        let mut got = vec![0u8; len];
        let dst = RawRange {
            addr: got.as_mut_ptr() as usize,
            len,
        };
        // SAFETY: `got` is a local buffer, alive and unaliased for the whole call.
        unsafe { recv_exact(&b, dst) }.await.unwrap();
        assert!(got == data[..len], "payload differs");
        assert_eq!(rcvlowat(b.as_raw_fd()), 1);
        let mut head = [0u8; 32];
        tokio::time::timeout(Duration::from_secs(5), recv_buf(&b, &mut head))
            .await
            .expect("a lone header must wake the reader")
            .unwrap();
        assert_eq!(head[..], data[len..]);
        drop(writer.await.unwrap());
    }
}
