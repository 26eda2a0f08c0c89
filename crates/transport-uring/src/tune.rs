//! What two of the configuration's switches do to a stream's thread and socket: pinning the
//! thread to a CPU ([`UringConfig::pin_loopback_streams`]) and leaving a pacing congestion
//! control ([`UringConfig::unpaced_loopback`]). Both are best effort.

#[cfg(doc)]
use crate::config::UringConfig;

/// Pins the calling thread to the `index`-th CPU (modulo their count) of those it may run on now
/// (see [`UringConfig::pin_loopback_streams`]). Best effort: a failure is logged and ignored.
pub(crate) fn pin_stream_thread(index: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the calls below only read and write this
    // local set and the calling thread's (pid 0) affinity.
    unsafe {
        let mut allowed: libc::cpu_set_t = std::mem::zeroed();
        let size = std::mem::size_of::<libc::cpu_set_t>();
        if libc::sched_getaffinity(0, size, &mut allowed) != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "sched_getaffinity");
            return;
        }
        let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &allowed))
            .collect();
        if cpus.len() < 2 {
            return;
        }
        let cpu = cpus[index % cpus.len()];
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut one);
        if libc::sched_setaffinity(0, size, &one) != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), cpu, "sched_setaffinity");
        }
    }
}

/// Switches `socket` from a congestion control that paces its sends (any BBR) to one that does
/// not (cubic, else reno; see [`UringConfig::unpaced_loopback`]): whether it did. Best effort: a
/// socket the kernel will not switch keeps its own (logged).
pub(crate) fn unpace(socket: &impl std::os::fd::AsRawFd) -> bool {
    let fd = socket.as_raw_fd();
    let mut name = [0u8; 16];
    let mut len = name.len() as libc::socklen_t;
    // SAFETY: reads at most `len` bytes of the socket's option into a local buffer.
    let got = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_CONGESTION,
            name.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if got != 0 || !name.starts_with(b"bbr") {
        return false;
    }
    for cc in [&b"cubic"[..], b"reno"] {
        // SAFETY: passes a local byte string of its own length to the socket's option.
        let set = unsafe {
            libc::setsockopt(
                fd,
                libc::IPPROTO_TCP,
                libc::TCP_CONGESTION,
                cc.as_ptr().cast(),
                cc.len() as libc::socklen_t,
            )
        };
        if set == 0 {
            return true;
        }
    }
    tracing::debug!(error = %std::io::Error::last_os_error(), "TCP_CONGESTION: the stream stays paced");
    false
}

#[cfg(test)]
mod tests {
    fn allowed() -> Vec<usize> {
        // SAFETY: a zeroed cpu_set_t is a valid empty set, filled by the kernel for this thread.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            assert_eq!(
                libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set),
                0
            );
            (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect()
        }
    }

    /// A loopback socket under BBR leaves it for a congestion control that does not pace; one
    /// under another keeps it.
    #[test]
    fn unpace_leaves_bbr_only() {
        fn congestion(s: &std::net::TcpStream) -> String {
            use std::os::fd::AsRawFd;
            let mut name = [0u8; 16];
            let mut len = name.len() as libc::socklen_t;
            // SAFETY: reads at most `len` bytes of the option into a local buffer.
            let got = unsafe {
                libc::getsockopt(
                    s.as_raw_fd(),
                    libc::IPPROTO_TCP,
                    libc::TCP_CONGESTION,
                    name.as_mut_ptr().cast(),
                    &mut len,
                )
            };
            assert_eq!(got, 0);
            String::from_utf8_lossy(&name[..len as usize])
                .trim_end_matches('\0')
                .to_owned()
        }
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let before = congestion(&s);
        let switched = super::unpace(&s);
        let after = congestion(&s);
        if before.starts_with("bbr") {
            assert!(switched, "{before} kept");
            assert!(!after.starts_with("bbr"), "{after}");
        } else {
            assert!(!switched);
            assert_eq!(after, before);
        }
    }

    #[test]
    fn a_pinned_stream_thread_runs_on_the_indexed_allowed_cpu() {
        let before = allowed();
        if before.len() < 2 {
            ferry_tests::require_or_skip(
                ferry_tests::CPUS,
                format!("this process may run on {} CPU(s)", before.len()),
            );
            return;
        }
        for index in [0, 1, before.len() + 1] {
            let after = std::thread::spawn(move || {
                super::pin_stream_thread(index);
                allowed()
            })
            .join()
            .unwrap();
            assert_eq!(after, vec![before[index % before.len()]], "index {index}");
        }
    }
}
