//! The one parser for each kind of number a flag takes, with each flag's limits checked where it
//! is parsed. Every flag goes through these as a clap `value_parser`, so a bad value is refused
//! before anything starts, and clap's message names the flag
//! (`invalid value '0' for '--depth <DEPTH>': must be at least 1`).
//!
//! - Sizes: `4096`, `64KiB`, `1MiB`, `1.5GB`, `10k` (binary: k, Ki, KiB, m, Mi, MiB, g, Gi, GiB,
//!   t, Ti, TiB;
//!   decimal: KB, MB, GB, TB). More than 1 EiB, or a fraction of a byte, is refused.
//! - Durations: `10s`, `1.5s`, `500ms`, `2m`, `1h`; a bare number is seconds.
//! - Counts: whole numbers.

use std::time::Duration;

use anyhow::{Context, Result, bail};

/// The address has no port (`bench HOST`).
pub(crate) const NO_PORT_HINT: &str =
    "give HOST:PORT; `ferry serve` listens on port 7400 unless its --listen says otherwise";

/// The largest size any flag takes (1 EiB): anything above is a typo, not a buffer.
pub(crate) const MAX_SIZE: u64 = 1 << 60;
/// The largest duration any flag takes (one year).
pub(crate) const MAX_DURATION: Duration = Duration::from_secs(365 * 86_400);
/// Data streams per peer, as the transports take them.
pub(crate) const MAX_STREAMS: usize = 64;

/// A byte size, zero included.
pub(crate) fn size(s: &str) -> Result<u64> {
    let t = s.trim();
    if t.starts_with('-') {
        bail!("a size cannot be negative");
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "ki" | "kib" => 1 << 10,
        "m" | "mi" | "mib" => 1 << 20,
        "g" | "gi" | "gib" => 1 << 30,
        "t" | "ti" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        other => {
            bail!("unknown size unit {other:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)")
        }
    };
    if num.is_empty() {
        bail!("no number in {t:?} (a size is like 4096, 64KiB or 1.5GB)");
    }
    let too_large = || anyhow::anyhow!("{t} is more than 1 EiB: not a size any machine has");
    let value = if num.contains('.') {
        let f: f64 = num
            .parse()
            .with_context(|| format!("{num:?} is not a number"))?;
        let bytes = f * mult as f64;
        if bytes >= MAX_SIZE as f64 {
            return Err(too_large());
        }
        if mult == 1 && bytes.fract() != 0.0 {
            bail!("{t} is not a whole number of bytes");
        }
        bytes.round() as u64
    } else {
        let n: u64 = num
            .parse()
            .with_context(|| format!("{num:?} is not a number"))?;
        n.checked_mul(mult).ok_or_else(too_large)?
    };
    if value > MAX_SIZE {
        return Err(too_large());
    }
    Ok(value)
}

/// A byte size of at least one byte.
pub(crate) fn nonzero_size(s: &str) -> Result<u64> {
    match size(s)? {
        0 => bail!("must be at least 1 byte"),
        n => Ok(n),
    }
}

/// A chunk size: 1 byte to 64 MiB (the largest chunk the wire carries).
pub(crate) fn chunk_size(s: &str) -> Result<u64> {
    let max = ferry::core_types::wire::MAX_CHUNK;
    match nonzero_size(s)? {
        n if n > max => bail!(
            "must be at most {} MiB (the largest chunk the wire carries)",
            max >> 20
        ),
        n => Ok(n),
    }
}

/// A count of at least one.
pub(crate) fn count(s: &str) -> Result<usize> {
    let t = s.trim();
    match t.parse::<usize>() {
        Ok(0) => bail!("must be at least 1"),
        Ok(n) => Ok(n),
        Err(_) if t.starts_with('-') => bail!("must be at least 1, not negative"),
        Err(_) => bail!("must be a whole number (at least 1)"),
    }
}

/// Data streams per peer: 1 to 64.
pub(crate) fn streams(s: &str) -> Result<usize> {
    match count(s)? {
        n if n > MAX_STREAMS => bail!("must be at most {MAX_STREAMS}"),
        n => Ok(n),
    }
}

/// A duration, zero included: `10s`, `1.5s`, `500ms`, `2m`, `1h`, or a bare number of seconds.
pub(crate) fn duration(s: &str) -> Result<Duration> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == '+'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        bail!("{t:?} is not a duration (e.g. 10s, 1.5s, 500ms)");
    }
    let scale = match unit.trim() {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        other => bail!("unknown duration unit {other:?} (use ms, s, m or h, e.g. 10s or 500ms)"),
    };
    let v: f64 = num
        .parse()
        .ok()
        .filter(|v: &f64| v.is_finite())
        .with_context(|| format!("{t:?} is not a duration (e.g. 10s, 1.5s, 500ms)"))?;
    if v < 0.0 {
        bail!("a duration cannot be negative");
    }
    let secs = v * scale;
    if secs > MAX_DURATION.as_secs_f64() {
        bail!("{t} is more than a year");
    }
    Ok(Duration::from_secs_f64(secs))
}

/// A duration longer than zero.
pub(crate) fn positive_duration(s: &str) -> Result<Duration> {
    match duration(s)? {
        d if d.is_zero() => bail!("must be longer than zero"),
        d => Ok(d),
    }
}

/// `--io-threads`, as `EngineBuilder::io_threads` takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct IoThreads(pub(crate) Option<usize>);

/// `--io-threads`: `auto` (one per core), `caller` (none), or a count.
pub(crate) fn io_threads(s: &str) -> Result<IoThreads> {
    Ok(IoThreads(match s {
        "auto" => Some(0),
        "caller" => None,
        n => Some(count(n).context("takes auto, caller or a count of at least 1")?),
    }))
}

/// `--dead-peer-after`, as `EngineBuilder::dead_peer_after` takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DeadPeer(pub(crate) Option<Duration>);

/// `--dead-peer-after`: a duration from 1 s to 1 day, or `off` (the kernel's defaults).
pub(crate) fn dead_peer(s: &str) -> Result<DeadPeer> {
    if s == "off" {
        return Ok(DeadPeer(None));
    }
    let d = duration(s).context("takes a duration (e.g. 30s) or off")?;
    if d < Duration::from_secs(1) || d > Duration::from_secs(86_400) {
        bail!("takes 1s to 86400s (a day), or off");
    }
    Ok(DeadPeer(Some(d)))
}

/// `--socket-buffer`: `auto` (kernel autotuning) or a size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SocketBuffer(pub(crate) Option<usize>);

/// `--socket-buffer`: `auto` or a size of at least 4 KiB and at most 1 GiB.
pub(crate) fn socket_buffer(s: &str) -> Result<SocketBuffer> {
    if s == "auto" {
        return Ok(SocketBuffer(None));
    }
    let n = size(s).context("takes auto or a size")?;
    if !(4096..=1 << 30).contains(&n) {
        bail!("takes auto or 4KiB to 1GiB");
    }
    Ok(SocketBuffer(Some(n as usize)))
}

/// A listen address: `HOST:PORT`, the host a name (`localhost`) or an IP, the first address it
/// resolves to.
pub(crate) fn listen_addr(s: &str) -> Result<std::net::SocketAddr> {
    use std::net::ToSocketAddrs;
    if let Ok(a) = s.parse() {
        return Ok(a);
    }
    let t = s.trim();
    if let Ok(port) = t.strip_prefix(':').unwrap_or(t).parse::<u16>() {
        bail!(
            "{t:?} is a port without a host: give HOST:PORT, 127.0.0.1:{port} (this host only) \
             or 0.0.0.0:{port} (every interface)"
        );
    }
    if !has_port(s) {
        bail!("no port: give HOST:PORT (e.g. 0.0.0.0:7400, or localhost:0 for any free port)");
    }
    s.to_socket_addrs()
        .with_context(|| format!("cannot resolve {s:?}"))?
        .next()
        .with_context(|| format!("{s:?} resolves to no address"))
}

/// `--metrics`: HOST:PORT as [`listen_addr`] takes it, or a bare port (`9400`, `:9400`), which
/// means this host only (127.0.0.1): metrics are for a local scraper unless a host says
/// otherwise.
pub(crate) fn metrics_addr(s: &str) -> Result<std::net::SocketAddr> {
    let t = s.trim();
    match t.strip_prefix(':').unwrap_or(t).parse::<u16>() {
        Ok(port) => Ok(std::net::SocketAddr::from(([127, 0, 0, 1], port))),
        Err(_) => listen_addr(s),
    }
}

/// A peer's address: HOST:PORT (the host a name or an IP), resolved when connecting.
pub(crate) fn peer_addr(s: &str) -> Result<String> {
    if !has_port(s) {
        bail!("no port: {NO_PORT_HINT}");
    }
    Ok(s.to_owned())
}

/// Whether `addr` ends in `:PORT` (an IPv6 literal needs brackets: `[::1]:7400`).
pub(crate) fn has_port(addr: &str) -> bool {
    addr.rsplit_once(':').is_some_and(|(host, port)| {
        !port.is_empty()
            && port.bytes().all(|b| b.is_ascii_digit())
            && (!host.contains(':') || host.ends_with(']'))
    })
}

/// This machine's memory (`MemTotal` of /proc/meminfo), where it can be read.
pub(crate) fn memory_total() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(size("4096").unwrap(), 4096);
        assert_eq!(size("0").unwrap(), 0);
        assert_eq!(size("64KiB").unwrap(), 64 << 10);
        assert_eq!(size("1MiB").unwrap(), 1 << 20);
        assert_eq!(size("8GiB").unwrap(), 8 << 30);
        assert_eq!(size("1GB").unwrap(), 1_000_000_000);
        assert_eq!(size("1.1GB").unwrap(), 1_100_000_000);
        assert_eq!(size("1.5k").unwrap(), 1536);
        // Kubernetes' and `numfmt`'s spelling too.
        assert_eq!(size("5Mi").unwrap(), 5 << 20);
        assert_eq!(size("5M").unwrap(), size("5Mi").unwrap());
        assert_eq!(size("2Gi").unwrap(), 2 << 30);
        for (bad, why) in [
            ("12 parsecs", "unknown size unit"),
            ("MiB", "no number"),
            ("99999999999999GiB", "more than 1 EiB"),
            ("1e30", "unknown size unit"),
            ("9999999999999999999999.5", "more than 1 EiB"),
            ("1.5", "whole number of bytes"),
            ("-1", "negative"),
            ("1.2.3k", "not a number"),
        ] {
            let e = size(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
        assert!(nonzero_size("0").is_err());
        assert!(chunk_size("65MiB").is_err());
        assert_eq!(chunk_size("64MiB").unwrap(), 64 << 20);
    }

    #[test]
    fn durations() {
        assert_eq!(duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(duration("2.5").unwrap(), Duration::from_millis(2500));
        assert_eq!(duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(duration("0").unwrap(), Duration::ZERO);
        for bad in ["-1s", "soon", "NaN", "inf", "", "10 parsecs", "2y", "1e12"] {
            assert!(duration(bad).is_err(), "{bad}");
        }
        assert!(positive_duration("0s").is_err());
    }

    #[test]
    fn dead_peer_limits() {
        assert_eq!(
            dead_peer("30s").unwrap(),
            DeadPeer(Some(Duration::from_secs(30)))
        );
        assert_eq!(
            dead_peer("2.5").unwrap(),
            DeadPeer(Some(Duration::from_millis(2500)))
        );
        assert_eq!(dead_peer("off").unwrap(), DeadPeer(None));
        for bad in ["0", "0.5s", "-3", "1e9", "NaN", "soon", ""] {
            assert!(dead_peer(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn counts() {
        assert_eq!(count("3").unwrap(), 3);
        for bad in ["0", "-1", "x", "1.5", ""] {
            assert!(count(bad).is_err(), "{bad}");
        }
        assert!(streams("65").is_err());
        assert_eq!(streams("64").unwrap(), 64);
    }

    #[test]
    fn io_thread_choices() {
        assert_eq!(io_threads("auto").unwrap(), IoThreads(Some(0)));
        assert_eq!(io_threads("caller").unwrap(), IoThreads(None));
        assert_eq!(io_threads("3").unwrap(), IoThreads(Some(3)));
        assert!(io_threads("0").is_err());
        assert!(io_threads("many").is_err());
    }

    #[test]
    fn listen_addresses() {
        assert_eq!(listen_addr("0.0.0.0:7400").unwrap().port(), 7400);
        assert!(listen_addr("localhost:0").unwrap().ip().is_loopback());
        let e = listen_addr("localhost").unwrap_err().to_string();
        assert!(e.contains("no port"), "{e}");
        // A bare port is named as one, with the two addresses it may have meant.
        for bare in ["9400", ":9400"] {
            let e = listen_addr(bare).unwrap_err().to_string();
            assert!(
                e.contains("a port without a host") && e.contains("127.0.0.1:9400"),
                "{e}"
            );
        }
        assert!(has_port("[::1]:7400") && !has_port("::1") && !has_port("host:"));
        // `--metrics 9400` is this host's port 9400.
        for bare in ["9400", ":9400"] {
            assert_eq!(metrics_addr(bare).unwrap().to_string(), "127.0.0.1:9400");
        }
        assert_eq!(metrics_addr("0.0.0.0:9400").unwrap().port(), 9400);
        assert!(metrics_addr("localhost").is_err());
    }

    #[test]
    fn socket_buffers() {
        assert_eq!(socket_buffer("auto").unwrap(), SocketBuffer(None));
        assert_eq!(socket_buffer("4MiB").unwrap(), SocketBuffer(Some(4 << 20)));
        assert!(socket_buffer("0").is_err());
        assert!(socket_buffer("2GiB").is_err());
    }
}
