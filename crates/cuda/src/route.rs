//! The GPUDirect RDMA registration route: how a NIC gets at GPU memory.
//!
//! - dma-buf: `cuMemGetHandleForAddressRange` exports the range as a dma-buf fd, then
//!   `ibv_reg_dmabuf_mr` registers it. Needs the CUDA export symbol, the device's dma-buf
//!   support, and the optional verbs symbol.
//! - peermem: `ibv_reg_mr` on the device address, which a peer-memory client (`nvidia_peermem` or
//!   MLNX_OFED `nv_peer_mem`) resolves. Needs one of [`PEERMEM_VERSION_PATHS`](crate::PEERMEM_VERSION_PATHS).
//! - off: no direct route; device memory moves through pinned host buffers (staging).
//!
//! [`choose`] decides before anything is registered. `auto` prefers dma-buf (no kernel module
//! to trust), then peermem, then off, and says why. An explicit choice that cannot work is an
//! error that names what is missing; nothing falls back silently.

use std::fmt;
use std::str::FromStr;

/// The user's setting, `gpu_direct_registration`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GpuDirectSetting {
    /// Pick the best route available, before registering.
    #[default]
    Auto,
    /// dma-buf only.
    Dmabuf,
    /// peermem only.
    Peermem,
    /// No direct route: staging through host memory.
    Off,
}

impl GpuDirectSetting {
    /// Every setting (for tests and help texts).
    pub const ALL: [GpuDirectSetting; 4] = [Self::Auto, Self::Dmabuf, Self::Peermem, Self::Off];

    /// The name users type.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Dmabuf => "dmabuf",
            Self::Peermem => "peermem",
            Self::Off => "off",
        }
    }
}

impl fmt::Display for GpuDirectSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for GpuDirectSetting {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|v| v.name() == s)
            .ok_or_else(|| {
                format!("gpu_direct_registration is auto, dmabuf, peermem or off, not {s:?}")
            })
    }
}

/// The route a registration takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuRoute {
    /// `cuMemGetHandleForAddressRange` + `ibv_reg_dmabuf_mr`.
    Dmabuf,
    /// `ibv_reg_mr` on the device address.
    Peermem,
    /// No direct route (the NIC never sees device memory; staging moves it).
    Off,
}

impl fmt::Display for GpuRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GpuRoute::Dmabuf => "dmabuf",
            GpuRoute::Peermem => "peermem",
            GpuRoute::Off => "off",
        })
    }
}

/// What the machine offers for each route (the facts [`choose`] decides from).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RouteFacts {
    /// `cuMemGetHandleForAddressRange` is exported by the driver.
    pub cuda_dmabuf_export: bool,
    /// The device reports dma-buf support.
    pub device_dmabuf: bool,
    /// `ibv_reg_dmabuf_mr` is exported by libibverbs.
    pub ibv_reg_dmabuf_mr: bool,
    /// The peer-memory version file found, if any.
    pub peermem_version_file: Option<String>,
}

impl RouteFacts {
    fn dmabuf_missing(&self) -> Vec<&'static str> {
        let mut m = Vec::new();
        if !self.cuda_dmabuf_export {
            m.push("the CUDA export cuMemGetHandleForAddressRange (driver 11.7+)");
        }
        if !self.device_dmabuf {
            m.push("dma-buf support on the device (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)");
        }
        if !self.ibv_reg_dmabuf_mr {
            m.push("ibv_reg_dmabuf_mr in libibverbs.so.1 (rdma-core 34+)");
        }
        m
    }
}

/// The decision, with its reason (recorded on the registration and shown by `describe()`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RouteChoice {
    /// The route.
    pub route: GpuRoute,
    /// Why, in words.
    pub why: String,
}

/// An explicit setting that cannot work here.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("gpu_direct_registration = {setting} cannot work here: missing {}; choose another \
         route, or `off` to stage through host memory", missing.join(", "))]
pub struct RouteError {
    /// The setting.
    pub setting: GpuDirectSetting,
    /// What is missing.
    pub missing: Vec<String>,
}

/// Decides the route for `setting` from `facts`, before any registration.
pub fn choose(setting: GpuDirectSetting, facts: &RouteFacts) -> Result<RouteChoice, RouteError> {
    let dmabuf_missing = facts.dmabuf_missing();
    let peermem = facts.peermem_version_file.as_deref();
    let dmabuf_ok = || RouteChoice {
        route: GpuRoute::Dmabuf,
        why: "dma-buf: CUDA export, device support and ibv_reg_dmabuf_mr present".into(),
    };
    let peermem_ok = |p: &str| RouteChoice {
        route: GpuRoute::Peermem,
        why: format!("peermem: {p} exists"),
    };
    match setting {
        GpuDirectSetting::Off => Ok(RouteChoice {
            route: GpuRoute::Off,
            why: "gpu_direct_registration = off".into(),
        }),
        GpuDirectSetting::Dmabuf if dmabuf_missing.is_empty() => Ok(dmabuf_ok()),
        GpuDirectSetting::Dmabuf => Err(RouteError {
            setting,
            missing: dmabuf_missing.into_iter().map(String::from).collect(),
        }),
        GpuDirectSetting::Peermem => match peermem {
            Some(p) => Ok(peermem_ok(p)),
            None => Err(RouteError {
                setting,
                missing: vec![format!(
                    "a peer-memory version file (one of /sys/{}; a module directory alone is \
                     not enough)",
                    crate::PEERMEM_VERSION_PATHS.join(", /sys/")
                )],
            }),
        },
        GpuDirectSetting::Auto => Ok(if dmabuf_missing.is_empty() {
            let mut c = dmabuf_ok();
            c.why = format!("auto chose {}", c.why);
            c
        } else if let Some(p) = peermem {
            let mut c = peermem_ok(p);
            c.why = format!(
                "auto chose {} (dma-buf lacks {})",
                c.why,
                dmabuf_missing.join(", ")
            );
            c
        } else {
            RouteChoice {
                route: GpuRoute::Off,
                why: format!(
                    "auto found no direct route (dma-buf lacks {}; no peer-memory version file): \
                     device memory is staged through host memory",
                    dmabuf_missing.join(", ")
                ),
            }
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every combination of availability (CUDA export, device support, verbs symbol, peermem)
    /// against every setting.
    #[test]
    fn every_combination_of_facts_and_setting() {
        for bits in 0u8..16 {
            let facts = RouteFacts {
                cuda_dmabuf_export: bits & 1 != 0,
                device_dmabuf: bits & 2 != 0,
                ibv_reg_dmabuf_mr: bits & 4 != 0,
                peermem_version_file: (bits & 8 != 0)
                    .then(|| "/sys/module/nvidia_peermem/version".to_owned()),
            };
            let dmabuf = bits & 7 == 7;
            let peermem = bits & 8 != 0;
            for setting in GpuDirectSetting::ALL {
                let got = choose(setting, &facts);
                let expected = match setting {
                    GpuDirectSetting::Off => Some(GpuRoute::Off),
                    GpuDirectSetting::Dmabuf => dmabuf.then_some(GpuRoute::Dmabuf),
                    GpuDirectSetting::Peermem => peermem.then_some(GpuRoute::Peermem),
                    GpuDirectSetting::Auto => Some(if dmabuf {
                        GpuRoute::Dmabuf
                    } else if peermem {
                        GpuRoute::Peermem
                    } else {
                        GpuRoute::Off
                    }),
                };
                match (got, expected) {
                    (Ok(c), Some(r)) => {
                        assert_eq!(c.route, r, "{setting} with {facts:?}");
                        assert!(!c.why.is_empty());
                        if setting == GpuDirectSetting::Auto {
                            assert!(c.why.starts_with("auto"), "{}", c.why);
                        }
                    }
                    (Err(e), None) => {
                        assert_eq!(e.setting, setting);
                        assert!(!e.missing.is_empty());
                        // An explicit choice never falls back: the error names what is missing.
                        let text = e.to_string();
                        assert!(text.contains(setting.name()), "{text}");
                        if setting == GpuDirectSetting::Dmabuf {
                            if !facts.cuda_dmabuf_export {
                                assert!(text.contains("cuMemGetHandleForAddressRange"), "{text}");
                            }
                            if !facts.ibv_reg_dmabuf_mr {
                                assert!(text.contains("ibv_reg_dmabuf_mr"), "{text}");
                            }
                            if !facts.device_dmabuf {
                                assert!(text.contains("DMA_BUF_SUPPORTED"), "{text}");
                            }
                        } else {
                            assert!(text.contains("nvidia_peermem/version"), "{text}");
                            assert!(text.contains("nv_mem/version"), "{text}");
                        }
                    }
                    (got, expected) => {
                        panic!("{setting} with {facts:?}: got {got:?}, expected {expected:?}")
                    }
                }
            }
        }
    }

    #[test]
    fn settings_parse() {
        for s in GpuDirectSetting::ALL {
            assert_eq!(s.name().parse::<GpuDirectSetting>(), Ok(s));
        }
        assert!("dma-buf".parse::<GpuDirectSetting>().is_err());
    }
}
