//! Probing the kernel's io_uring support (`IORING_REGISTER_PROBE`).

use io_uring::{IoUring, Probe, opcode};
use std::fmt;

/// One opcode the project uses, and whether this kernel supports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpcodeSupport {
    /// The opcode's name as the kernel headers spell it (without `IORING_OP_`).
    pub name: &'static str,
    /// Whether the transport cannot work without it.
    pub required: bool,
    /// Whether this kernel supports it.
    pub supported: bool,
}

/// What the kernel's io_uring can do, or why it cannot be used at all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UringProbe {
    /// A ring could be created and probed.
    Available {
        /// Every opcode the project uses, in a fixed order.
        opcodes: Vec<OpcodeSupport>,
    },
    /// No ring could be created (kernel without io_uring, seccomp, `io_uring_disabled` sysctl…).
    Unavailable {
        /// The OS error, as text.
        reason: String,
    },
}

/// The opcodes Ferry uses: (name, opcode, required by the network/file data plane).
const OPCODES: &[(&str, u8, bool)] = &[
    ("SEND", opcode::Send::CODE, true),
    ("RECV", opcode::Recv::CODE, true),
    ("READ", opcode::Read::CODE, true),
    ("WRITE", opcode::Write::CODE, true),
    ("READ_FIXED", opcode::ReadFixed::CODE, false),
    ("WRITE_FIXED", opcode::WriteFixed::CODE, false),
    ("SEND_ZC", opcode::SendZc::CODE, false),
    ("ASYNC_CANCEL", opcode::AsyncCancel::CODE, true),
    ("LINK_TIMEOUT", opcode::LinkTimeout::CODE, false),
    ("SPLICE", opcode::Splice::CODE, false),
];

impl UringProbe {
    /// Whether every required opcode is supported.
    pub fn usable(&self) -> bool {
        match self {
            UringProbe::Available { opcodes } => opcodes.iter().all(|o| o.supported || !o.required),
            UringProbe::Unavailable { .. } => false,
        }
    }

    /// Whether the named opcode is supported.
    pub fn supports(&self, name: &str) -> bool {
        match self {
            UringProbe::Available { opcodes } => {
                opcodes.iter().any(|o| o.name == name && o.supported)
            }
            UringProbe::Unavailable { .. } => false,
        }
    }

    /// Why io_uring cannot carry the data plane, if it cannot.
    pub fn unusable_reason(&self) -> Option<String> {
        match self {
            UringProbe::Unavailable { reason } => Some(format!("io_uring unavailable: {reason}")),
            UringProbe::Available { opcodes } => {
                let missing: Vec<&str> = opcodes
                    .iter()
                    .filter(|o| o.required && !o.supported)
                    .map(|o| o.name)
                    .collect();
                (!missing.is_empty())
                    .then(|| format!("kernel lacks io_uring opcode(s) {}", missing.join(", ")))
            }
        }
    }
}

impl fmt::Display for UringProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UringProbe::Unavailable { reason } => write!(f, "unavailable: {reason}"),
            UringProbe::Available { opcodes } => {
                let mut first = true;
                for o in opcodes {
                    if !first {
                        f.write_str(" ")?;
                    }
                    first = false;
                    write!(f, "{}{}", o.name, if o.supported { "" } else { "(no)" })?;
                }
                Ok(())
            }
        }
    }
}

/// Creates a small ring and asks the kernel which opcodes it supports.
pub fn probe_kernel() -> UringProbe {
    let ring = match IoUring::new(2) {
        Ok(r) => r,
        Err(e) => {
            return UringProbe::Unavailable {
                reason: format!("io_uring_setup: {e}"),
            };
        }
    };
    let mut probe = Probe::new();
    if let Err(e) = ring.submitter().register_probe(&mut probe) {
        return UringProbe::Unavailable {
            reason: format!("IORING_REGISTER_PROBE: {e}"),
        };
    }
    UringProbe::Available {
        opcodes: OPCODES
            .iter()
            .map(|&(name, code, required)| OpcodeSupport {
                name,
                required,
                supported: probe.is_supported(code),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_required_opcode_makes_it_unusable_with_reason() {
        let p = UringProbe::Available {
            opcodes: vec![
                OpcodeSupport {
                    name: "SEND",
                    required: true,
                    supported: false,
                },
                OpcodeSupport {
                    name: "SEND_ZC",
                    required: false,
                    supported: false,
                },
            ],
        };
        assert!(!p.usable());
        assert_eq!(
            p.unusable_reason().as_deref(),
            Some("kernel lacks io_uring opcode(s) SEND")
        );
        assert!(!p.supports("SEND_ZC"));
    }

    #[test]
    fn live_kernel_probe_is_consistent() {
        let p = probe_kernel();
        match &p {
            UringProbe::Unavailable { reason } => {
                ferry_tests::require_or_skip(
                    ferry_tests::URING,
                    format!("io_uring unavailable on this kernel: {reason}"),
                );
                assert!(!p.usable());
            }
            UringProbe::Available { opcodes } => {
                assert_eq!(opcodes.len(), OPCODES.len());
                // NOP-level sanity: every kernel with PROBE support (5.6+) has READ and WRITE.
                assert!(p.supports("READ") && p.supports("WRITE"), "{p}");
                assert_eq!(p.usable(), p.unusable_reason().is_none());
            }
        }
    }
}
