//! The serving side: accepts control connections (handshake) and data streams on one listener.

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::task::Poll;

use ferry_core::checksum::FileCrc;
use ferry_core::handshake::{ServerConversation, ServerStep};
use ferry_core::stream::{Action, ServerStream, Target, checksum_response};
use ferry_core::wire::{
    ControlFrame, DATA_REQUEST_LEN, DATA_RESPONSE_LEN, StreamAttach, VectoredRequest,
};
use ferry_core::{Error, HandshakeResponder, OpKind, SegmentTable};
use ferry_net::{AcceptBackoff, HandshakeGate, HandshakeSlot, HandshakeStats, tune};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tracing::{Instrument, debug, warn};

use crate::TcpConfig;
use crate::control::{read_body, read_header, write_frame};
use crate::io::{
    RawRange, discard as discard_payload, recv_buf, recv_exact, recv_vectored, send_all, send_buf,
    send_vectored,
};
use crate::pool::{AbortOnDrop, IoPool};

/// Payloads up to this size go out in one `sendmsg` with their header from a staging copy.
const SMALL: usize = 16 << 10;

/// File segments move through two buffers per stream, of at most [`READ_PIECE`] bytes: a chunk of
/// up to `MAX_CHUNK` costs no more memory than a small one, and a chunk of several pieces
/// overlaps its positioned I/O with the socket's (piece k+1 read while piece k is sent; piece k
/// written while piece k+1 is received).
///
/// READ pieces are as large as the default chunk (1 MiB): smaller ones overlapped more but cost
/// a blocking-pool hand-off each, and on loopback with a GPU segment (the fake driver, 2 cores)
/// 256 KiB pieces moved READs about 10% slower. WRITE pieces are 256 KiB: there the overlap of
/// receiving with writing paid (about 1.16x on the same bench). docs/performance.md has both.
const READ_PIECE: usize = 1 << 20;
/// See [`READ_PIECE`].
const WRITE_PIECE: usize = 256 << 10;

/// A bound listener, not serving yet.
#[derive(Debug)]
pub struct TcpServer {
    listener: TcpListener,
    addr: SocketAddr,
}

/// A running server; dropping it (or [`ServerHandle::shutdown`]) stops the listener and every
/// connection it accepted.
#[derive(Debug)]
pub struct ServerHandle {
    task: tokio::task::JoinHandle<()>,
    addr: SocketAddr,
    gate: Arc<HandshakeGate>,
}

impl ServerHandle {
    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections in their handshake now, and those closed past the cap or the deadline.
    pub fn handshakes(&self) -> HandshakeStats {
        self.gate.stats()
    }

    /// The limits those are counted against.
    pub fn handshake_limits(&self) -> ferry_net::HandshakeLimits {
        self.gate.limits()
    }

    /// Stops serving: the listener closes and every accepted connection is dropped.
    pub fn shutdown(&self) {
        self.task.abort();
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TcpServer {
    /// Binds `addr` (port 0: any) as every Ferry server listens ([`ferry_net::listen`]:
    /// `SO_REUSEADDR`, so that a restarted process can take the same port again). Must be
    /// called inside a tokio runtime.
    pub fn bind(addr: SocketAddr) -> Result<Self, Error> {
        let (listener, bound) = ferry_net::listen(addr)?;
        let listener =
            TcpListener::from_std(listener).map_err(|e| Error::io("bind", addr.to_string(), e))?;
        Ok(Self {
            listener,
            addr: bound,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Starts serving `table` with the identity and policy of `responder`. A connection's
    /// handshake must be over within `config.handshake.timeout` of its accept, and at most
    /// `config.handshake.max_pending` are in one at a time (one accepted past that is closed
    /// at once); both are counted in [`ServerHandle::handshakes`].
    pub fn serve(
        self,
        table: Arc<dyn SegmentTable>,
        responder: Arc<dyn HandshakeResponder>,
        config: TcpConfig,
    ) -> ServerHandle {
        let addr = self.addr;
        let listener = self.listener;
        let pool = Arc::new(IoPool::new(config.io_threads, "ferry-tcp-serve"));
        let gate = HandshakeGate::new(config.handshake);
        let gate_kept = gate.clone();
        let task = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            let mut backoff = AcceptBackoff::new();
            loop {
                while conns.try_join_next().is_some() {}
                match listener.accept().await {
                    Ok((stream, from)) => {
                        backoff.accepted();
                        // Past the cap, the oldest pending connection of the busiest source
                        // makes room: a flood that arrived first cannot keep a peer out.
                        let Some(slot) = gate.admit_evicting(stream.as_fd(), from.ip()) else {
                            debug!(%from, "too many connections in their handshake; closed at once");
                            drop(stream);
                            continue;
                        };
                        let gate = gate.clone();
                        let table = table.clone();
                        let responder = responder.clone();
                        let config = config.clone();
                        let pool = pool.clone();
                        conns.spawn(async move {
                            let conn = Conn {
                                table,
                                responder,
                                config,
                                slot,
                                gate,
                            };
                            if let Err(e) = serve_conn(stream, from, conn, &pool).await {
                                debug!(%from, error = %e, "connection ended");
                            }
                        });
                    }
                    Err(e) => {
                        // Out of descriptors, say: wait instead of spinning on the same error.
                        let wait = backoff.failed();
                        warn!(%addr, error = %e, ?wait, "accept failed");
                        tokio::time::sleep(wait).await;
                    }
                }
            }
        });
        ServerHandle {
            task,
            addr,
            gate: gate_kept,
        }
    }
}

/// What a connection is served with, and its place among the pending handshakes.
struct Conn {
    table: Arc<dyn SegmentTable>,
    responder: Arc<dyn HandshakeResponder>,
    config: TcpConfig,
    slot: HandshakeSlot,
    gate: Arc<HandshakeGate>,
}

/// The end of a connection's handshake: answered (and closed), or a data stream to serve.
enum Handshake {
    Done,
    Stream(StreamAttach, ServerStream),
}

/// Runs the control conversation until it closes or a data stream is accepted; each frame's
/// header is checked ([`ServerConversation::on_header`]) before its body is read.
async fn converse(stream: &TcpStream, from: SocketAddr, conn: &Conn) -> Result<Handshake, Error> {
    let mut talk = ServerConversation::new(conn.responder.clone(), conn.table.clone(), from);
    loop {
        let header = read_header(stream, from).await?;
        let step = match talk.on_header(&header) {
            Some(step) => step,
            None => talk.on_frame(read_body(stream, from, &header).await?),
        };
        match step {
            ServerStep::Reply(f) => write_frame(stream, from, &f).await?,
            ServerStep::Read => {}
            ServerStep::Close(f) => {
                write_frame(stream, from, &f).await?;
                return Ok(Handshake::Done);
            }
            ServerStep::Fail(e) => return Err(e),
            ServerStep::Stream { attach, stream } => {
                return Ok(Handshake::Stream(attach, stream));
            }
            _ => {
                return Err(Error::Malformed {
                    peer: from.to_string(),
                    source: ferry_core::wire::WireError::Unexpected {
                        found: "a step this server does not know",
                        expected: "hello or stream-attach",
                    },
                });
            }
        }
    }
}

async fn serve_conn(
    stream: TcpStream,
    from: SocketAddr,
    conn: Conn,
    pool: &IoPool,
) -> Result<(), Error> {
    let config = &conn.config;
    tune(&stream, config.socket_buffer, config.dead_peer_after);
    let limit = config.handshake.timeout;
    let talk = async {
        let step = converse(&stream, from, &conn).await?;
        if let Handshake::Stream(..) = step {
            write_frame(&stream, from, &ControlFrame::StreamAccept).await?;
        }
        Ok::<_, Error>(step)
    };
    let step = match tokio::time::timeout(limit, talk).await {
        Ok(step) => step?,
        Err(_) => {
            conn.gate.note_timeout();
            debug!(%from, ?limit, "handshake not over by its deadline; closing");
            return Err(Error::Timeout {
                what: "a peer's handshake",
                after: limit,
            });
        }
    };
    // The handshake is over: its place among the pending ones is free.
    drop(conn.slot);
    match step {
        Handshake::Done => Ok(()),
        Handshake::Stream(attach, proto) => {
            let span = tracing::debug_span!("serve stream", %from, stream = attach.stream_index);
            // The stream moves to an I/O thread for good; this task only waits for it (and
            // aborts it when the server stops).
            let std_stream = stream
                .into_std()
                .map_err(|e| crate::control::lost(from, "moving a data stream", e))?;
            let task = pool
                .spawn(
                    async move {
                        let stream = TcpStream::from_std(std_stream)?;
                        serve_data(&stream, from, proto).await
                    }
                    .instrument(span),
                )
                .map_err(|e| crate::control::lost(from, "starting an I/O thread", e))?;
            let mut task = AbortOnDrop(task);
            match (&mut task.0).await {
                Ok(res) => res.map_err(|e| crate::control::lost(from, "serving data", e)),
                Err(e) => Err(crate::control::lost(
                    from,
                    "serving data",
                    std::io::Error::other(e.to_string()),
                )),
            }
        }
    }
}

/// Whether a stream goes on after a request.
enum Flow {
    Next,
    Close,
}

/// Serves chunks on one data stream until the client closes it, as the stream protocol
/// ([`ServerStream`]) decides: every request is checked (token, access, bounds) before any byte
/// of the segment is touched; a refused WRITE's payload is read into a scratch buffer and
/// dropped; a malformed header is answered and closes the stream. This server holds no response
/// back. While the stream is idle (no request waiting on its socket) it holds no file staging:
/// its file buffers go back to the I/O thread's spares ([`Stages::release`]).
async fn serve_data(
    stream: &TcpStream,
    from: SocketAddr,
    mut proto: ServerStream,
) -> std::io::Result<()> {
    let mut head = [0u8; DATA_REQUEST_LEN];
    let mut stages = Stages::default();
    loop {
        let got = {
            // A header not all there at the first try: the stream is idle until it comes.
            let mut recv = std::pin::pin!(recv_buf(stream, &mut head));
            match poll_once(recv.as_mut()).await {
                Poll::Ready(got) => got,
                Poll::Pending => {
                    stages.release();
                    recv.await
                }
            }
        };
        match got {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let action = proto.on_request(&head);
        if let Flow::Close = serve_action(stream, from, &mut proto, action, &mut stages).await? {
            return Ok(());
        }
    }
}

/// Polls `f` once.
async fn poll_once<F: std::future::Future>(mut f: std::pin::Pin<&mut F>) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(f.as_mut().poll(cx))).await
}

/// Performs one request's action: moves its bytes and sends its response.
async fn serve_action(
    stream: &TcpStream,
    from: SocketAddr,
    proto: &mut ServerStream,
    action: Action,
    stages: &mut Stages,
) -> std::io::Result<Flow> {
    match action {
        Action::WriteMemory {
            lease,
            at,
            len,
            seq,
            ..
        } => {
            // SAFETY: the stream protocol checked `at..at+len` against the region, which the
            // lease keeps alive until the chunk is done; no Rust reference into it exists (raw
            // recv).
            unsafe { recv_exact(stream, raw(&lease, at, len)).await? };
            send_buf(stream, &proto.answer_write(seq)).await?;
        }
        Action::ReadMemory {
            lease,
            at,
            len,
            response,
        } => {
            if len <= SMALL {
                let stage = stages.small();
                stage[..DATA_RESPONSE_LEN].copy_from_slice(&response);
                let body = &mut stage[DATA_RESPONSE_LEN..DATA_RESPONSE_LEN + len];
                lease
                    .region
                    .read_at(at, body)
                    .map_err(|e| std::io::Error::other(e.to_string()))?;
                send_buf(stream, &stage[..DATA_RESPONSE_LEN + len]).await?;
            } else {
                // SAFETY: the stream protocol checked the range against the region, which the
                // lease keeps alive for the send; it is only read, through raw pointers.
                unsafe { send_all(stream, &response, raw(&lease, at, len)).await? };
            }
        }
        Action::ReadFile {
            file,
            at,
            len,
            response,
        } => {
            // Positioned reads block: off this stream's I/O thread, pipelined through the
            // stream's two file buffers. A file that shrank under the READ closes the stream.
            send_file(stream, &response[..], &file, at, len, &mut stages.file).await?;
        }
        Action::WriteFile {
            file,
            at,
            len,
            response,
        } => {
            recv_file(stream, &file, at, len, &mut stages.file).await?;
            send_buf(stream, &response).await?;
        }
        Action::Refuse {
            kind,
            token,
            status,
            discard,
            response,
        } => {
            debug!(%from, %token, %kind, %status, "refused chunk");
            if discard > 0 {
                discard_payload(stream, discard, stages.scratch()).await?;
            }
            send_buf(stream, &response).await?;
        }
        Action::ChecksumMemory {
            lease,
            mut sum,
            seq,
        } => {
            // A piece at a time: the I/O thread serves its other streams in between.
            let crc = loop {
                match sum.step() {
                    Some(crc) => break crc,
                    None => tokio::task::yield_now().await,
                }
            };
            drop(lease);
            send_buf(stream, &checksum_response(seq, crc)).await?;
        }
        Action::ChecksumFile { file, at, len, seq } => {
            let crc = checksum_file(FileCrc::new(file, at, len)).await?;
            send_buf(stream, &checksum_response(seq, crc)).await?;
        }
        Action::Close { error, response } => {
            // The payload length cannot be trusted: answer and close the stream.
            warn!(%from, %error, "malformed data request; closing stream");
            send_buf(stream, &response).await?;
            return Ok(Flow::Close);
        }
        Action::Table { req } => return serve_table(stream, from, proto, &req, stages).await,
        Action::Vectored { .. } => {
            warn!(%from, "a vectored action without its table; closing stream");
            return Ok(Flow::Close);
        }
    }
    Ok(Flow::Next)
}

/// Reads a vectored request's piece table, then moves the pieces the stream protocol accepts
/// and sends the response.
async fn serve_table(
    stream: &TcpStream,
    from: SocketAddr,
    proto: &mut ServerStream,
    req: &VectoredRequest,
    stages: &mut Stages,
) -> std::io::Result<Flow> {
    let mut bytes = std::mem::take(&mut stages.table);
    bytes.resize(req.table_len(), 0);
    recv_buf(stream, &mut bytes).await?;
    let action = proto.on_table(req, &bytes);
    stages.table = bytes;
    match action {
        Action::Vectored {
            kind,
            targets,
            discard,
            response,
        } => {
            if kind == OpKind::Write {
                receive_pieces(stream, &targets, &mut stages.file).await?;
                if discard > 0 {
                    discard_payload(stream, discard, stages.scratch()).await?;
                }
                send_buf(stream, &response).await?;
            } else {
                send_pieces(stream, &response, &targets, &mut stages.file).await?;
            }
            Ok(Flow::Next)
        }
        Action::Close { error, response } => {
            warn!(%from, %error, "malformed piece table; closing stream");
            send_buf(stream, &response).await?;
            Ok(Flow::Close)
        }
        other => {
            warn!(%from, ?other, "unexpected answer to a piece table; closing stream");
            Ok(Flow::Close)
        }
    }
}

/// The CRC-32C of a file range, one piece ([`FileCrc::step`], one positioned read) per trip to
/// the blocking pool: between pieces no blocking thread is held, so other streams' file I/O
/// queued behind it runs (on a bounded pool the checksum takes turns with it).
async fn checksum_file(mut sum: FileCrc) -> std::io::Result<u32> {
    loop {
        let (back, step) = tokio::task::spawn_blocking(move || {
            let step = sum.step();
            (sum, step)
        })
        .await
        .map_err(std::io::Error::other)?;
        if let Some(crc) = step? {
            return Ok(crc);
        }
        sum = back;
    }
}

/// The memory range of a checked target as a raw range.
fn raw(lease: &ferry_core::SegmentLease, at: u64, len: usize) -> RawRange {
    RawRange {
        addr: lease.region.as_ptr() as usize + at as usize,
        len,
    }
}

/// Receives a vectored WRITE's accepted pieces, in order: runs of memory targets with one
/// vectored receive, file targets through `file_stage` and positioned writes off the I/O thread.
async fn receive_pieces(
    stream: &TcpStream,
    targets: &[Target],
    file_stage: &mut FileStage,
) -> std::io::Result<()> {
    let mut parts: Vec<RawRange> = Vec::with_capacity(targets.len());
    for t in targets {
        match t {
            Target::Memory { lease, at, len } => parts.push(raw(lease, *at, *len)),
            Target::File { file, at, len } => {
                // SAFETY: the stream protocol checked every memory range against its region,
                // which the targets' leases keep alive; no Rust reference into them exists.
                unsafe { recv_vectored(stream, &parts).await? };
                parts.clear();
                recv_file(stream, file, *at, *len, file_stage).await?;
            }
        }
    }
    // SAFETY: as above.
    unsafe { recv_vectored(stream, &parts).await }
}

/// Sends a vectored READ's response and its accepted pieces, in order: runs of memory targets
/// with one vectored send (the response in front of the first), file targets through
/// `file_stage` and positioned reads off the I/O thread.
async fn send_pieces(
    stream: &TcpStream,
    response: &[u8; DATA_RESPONSE_LEN],
    targets: &[Target],
    file_stage: &mut FileStage,
) -> std::io::Result<()> {
    let mut parts: Vec<RawRange> = Vec::with_capacity(targets.len() + 1);
    parts.push(RawRange {
        addr: response.as_ptr() as usize,
        len: response.len(),
    });
    for t in targets {
        match t {
            Target::Memory { lease, at, len } => parts.push(raw(lease, *at, *len)),
            Target::File { file, at, len } => {
                // SAFETY: the response lives across the call; the memory ranges were checked
                // against their regions, which the leases keep alive; they are only read.
                unsafe { send_vectored(stream, &parts).await? };
                parts.clear();
                send_file(stream, &[], file, *at, *len, file_stage).await?;
            }
        }
    }
    // SAFETY: as above.
    unsafe { send_vectored(stream, &parts).await }
}

/// A stream's staging: the small-READ buffer, the scratch for refused payloads, the piece-table
/// buffer and the two file buffers. Each is taken on first use; [`release`](Self::release) gives
/// up all but the small-READ buffer (16 KiB, kept so that a loop of small READs allocates
/// nothing) while the stream is idle.
#[derive(Debug, Default)]
struct Stages {
    small: Vec<u8>,
    scratch: Vec<u8>,
    table: Vec<u8>,
    file: FileStage,
}

impl Stages {
    /// The small-READ buffer: a response header and up to [`SMALL`] bytes.
    fn small(&mut self) -> &mut [u8] {
        if self.small.is_empty() {
            self.small = vec![0u8; DATA_RESPONSE_LEN + SMALL];
        }
        &mut self.small
    }

    /// The scratch a refused WRITE's payload is read into.
    fn scratch(&mut self) -> &mut [u8] {
        if self.scratch.is_empty() {
            self.scratch = vec![0u8; SCRATCH];
        }
        &mut self.scratch
    }

    /// Whether any buffer [`release`](Self::release) gives up is held.
    fn holds_any(&self) -> bool {
        self.scratch.capacity() > 0 || self.table.capacity() > 0 || self.file.holds_any()
    }

    /// Frees the scratch and table buffers and hands the file buffers to the thread's spares.
    fn release(&mut self) {
        if !self.holds_any() {
            return;
        }
        self.scratch = Vec::new();
        self.table = Vec::new();
        self.file.release();
    }
}

/// Bytes of the scratch a refused WRITE's payload is read into.
const SCRATCH: usize = 64 << 10;

/// File buffers kept per thread for the streams served there, taken when a stream's file op
/// needs one and given back when that stream goes idle; beyond this many, given-back buffers
/// are freed. So memory held for file staging is bounded by the streams moving file bytes at
/// once, not by the streams attached.
const SPARE_FILE_BUFFERS: usize = 4;

thread_local! {
    static SPARE: std::cell::RefCell<Vec<Vec<u8>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A stream's two buffers for file pieces (taken from the thread's spares, or made, on a file
/// op's first piece; handed back when the stream goes idle).
#[derive(Debug, Default)]
struct FileStage {
    spare: [Vec<u8>; 2],
}

impl FileStage {
    fn take(&mut self, n: usize) -> Vec<u8> {
        let mut b = match self.spare.iter_mut().find(|b| b.capacity() > 0) {
            Some(b) => std::mem::take(b),
            None => SPARE
                .with_borrow_mut(Vec::pop)
                .unwrap_or_else(|| Vec::with_capacity(READ_PIECE.max(WRITE_PIECE))),
        };
        b.resize(n, 0);
        b
    }

    fn give(&mut self, b: Vec<u8>) {
        if let Some(slot) = self.spare.iter_mut().find(|s| s.capacity() == 0) {
            *slot = b;
        }
    }

    fn holds_any(&self) -> bool {
        self.spare.iter().any(|b| b.capacity() > 0)
    }

    /// Hands both buffers to the thread's spares (those past [`SPARE_FILE_BUFFERS`] are freed).
    fn release(&mut self) {
        SPARE.with_borrow_mut(|spare| {
            for b in &mut self.spare {
                let b = std::mem::take(b);
                if b.capacity() > 0 && spare.len() < SPARE_FILE_BUFFERS {
                    spare.push(b);
                }
            }
        });
    }
}

type Piece = tokio::task::JoinHandle<(Vec<u8>, std::io::Result<()>)>;

/// Sends `head` then `len` bytes of `file` at `at`, in pieces of at most [`READ_PIECE`]: each
/// read runs off the I/O thread while the piece before it is sent. A failed read (a file that
/// shrank) is an error that closes the stream.
async fn send_file(
    stream: &TcpStream,
    head: &[u8],
    file: &Arc<dyn ferry_core::FileSource>,
    at: u64,
    len: usize,
    stage: &mut FileStage,
) -> std::io::Result<()> {
    let read = |stage: &mut FileStage, done: usize| -> Piece {
        let mut buf = stage.take(READ_PIECE.min(len - done));
        let f = file.clone();
        let from = at + done as u64;
        tokio::task::spawn_blocking(move || {
            let r = f.read_exact_at(from, &mut buf);
            (buf, r)
        })
    };
    if len == 0 {
        return send_buf(stream, head).await;
    }
    let mut head = head;
    let mut next = Some(read(stage, 0));
    let mut done = 0usize;
    while let Some(piece) = next.take() {
        let (buf, r) = piece.await.map_err(std::io::Error::other)?;
        r?;
        done += buf.len();
        if done < len {
            next = Some(read(stage, done));
        }
        let body = RawRange {
            addr: buf.as_ptr() as usize,
            len: buf.len(),
        };
        // SAFETY: `buf` is owned here and lives until after the call; it is only read.
        unsafe { send_all(stream, head, body).await? };
        head = &[];
        stage.give(buf);
    }
    Ok(())
}

/// Receives `len` bytes into `file` at `at`, in pieces of at most [`WRITE_PIECE`]: each positioned
/// write runs off the I/O thread while the next piece is received; returns once every write
/// finished (so the acknowledgment that follows is true).
async fn recv_file(
    stream: &TcpStream,
    file: &Arc<dyn ferry_core::FileSource>,
    at: u64,
    len: usize,
    stage: &mut FileStage,
) -> std::io::Result<()> {
    let mut writing: Option<Piece> = None;
    let mut done = 0usize;
    while done < len {
        let mut buf = stage.take(WRITE_PIECE.min(len - done));
        let received = recv_buf(stream, &mut buf).await;
        if let Some(w) = writing.take() {
            let (b, r) = w.await.map_err(std::io::Error::other)?;
            stage.give(b);
            r?;
        }
        received?;
        let f = file.clone();
        let to = at + done as u64;
        done += buf.len();
        writing = Some(tokio::task::spawn_blocking(move || {
            let r = f.write_all_at(to, &buf);
            (buf, r)
        }));
    }
    if let Some(w) = writing {
        let (b, r) = w.await.map_err(std::io::Error::other)?;
        stage.give(b);
        r?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::wire::DataRequest;
    use ferry_core::{FileSource, RemoteStatus, SegmentDesc, SegmentLease, SegmentToken};

    const FILE: SegmentToken = SegmentToken(9);

    /// A file of `len` bytes of 7s, in memory.
    #[derive(Debug)]
    struct Sevens(u64);

    impl FileSource for Sevens {
        fn check(&self, _: OpKind, offset: u64, len: u64) -> Result<u64, RemoteStatus> {
            match offset.checked_add(len) {
                Some(end) if end <= self.0 => Ok(offset),
                _ => Err(RemoteStatus::OutOfBounds),
            }
        }
        fn read_exact_at(&self, _: u64, buf: &mut [u8]) -> std::io::Result<()> {
            buf.fill(7);
            Ok(())
        }
        fn write_all_at(&self, _: u64, _: &[u8]) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Publishes one file, [`FILE`].
    #[derive(Debug)]
    struct OneFile(Arc<Sevens>);

    impl SegmentTable for OneFile {
        fn resolve(&self, _: SegmentToken) -> Option<SegmentLease> {
            None
        }
        fn published(&self) -> Vec<SegmentDesc> {
            Vec::new()
        }
        fn file(&self, token: SegmentToken) -> Option<Arc<dyn FileSource>> {
            (token == FILE).then(|| self.0.clone() as Arc<dyn FileSource>)
        }
    }

    fn spares() -> usize {
        SPARE.with_borrow(Vec::len)
    }

    /// A stream that served file READs and then waits for its next request holds no file staging:
    /// its two file buffers went back to the thread's spares (where the next file op, of any
    /// stream on the thread, takes them again), and the spares stay bounded however many
    /// streams give buffers back.
    #[tokio::test(flavor = "current_thread")]
    async fn an_idle_stream_gives_its_file_staging_back() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (served, from) = listener.accept().await.unwrap();
        let proto = ServerStream::new(Arc::new(OneFile(Arc::new(Sevens(4 << 20)))));
        // On this thread (a current-thread runtime): its spares are the test's to see.
        let server = tokio::spawn(async move { serve_data(&served, from, proto).await });
        assert_eq!(spares(), 0);
        for seq in 0..2u32 {
            let len = 3 << 20;
            let mut head = [0u8; DATA_REQUEST_LEN];
            DataRequest {
                kind: OpKind::Read,
                seq,
                token: FILE,
                offset: 0,
                len,
                ack_slack: 0,
            }
            .encode(&mut head);
            send_buf(&client, &head).await.unwrap();
            let mut back = vec![0u8; DATA_RESPONSE_LEN + len as usize];
            recv_buf(&client, &mut back).await.unwrap();
            assert!(back[DATA_RESPONSE_LEN..].iter().all(|b| *b == 7));
            // The event: the server is back waiting for a request, its buffers given back.
            let mut turns = 0;
            while spares() < 2 {
                turns += 1;
                assert!(turns < 1000, "the idle stream kept its file buffers");
                tokio::task::yield_now().await;
            }
            assert_eq!(
                spares(),
                2,
                "the next READ took them again, and gave them back"
            );
        }
        // Past the bound, given-back buffers are freed.
        for _ in 0..3 {
            let mut stage = FileStage::default();
            let a = stage.take(READ_PIECE);
            let b = Vec::with_capacity(READ_PIECE);
            stage.give(a);
            stage.give(b);
            stage.release();
        }
        assert_eq!(spares(), SPARE_FILE_BUFFERS);
        drop(client);
        server.await.unwrap().unwrap();
    }
}
