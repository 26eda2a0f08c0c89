//! NIC filters: the `NCCL_IB_HCA` syntax, and the explicit selectors of docs/architecture.md §3.
//!
//! # `NCCL_IB_HCA` syntax
//!
//! A comma-separated list of `name` or `name:port` entries. A leading `^` turns the list into
//! an exclusion list; a leading `=` (after the `^`, if both: `^=`) makes names match exactly,
//! otherwise an entry matches every device whose name starts with it (`mlx5` matches `mlx5_0`).
//! `name:port` restricts the entry to that port. Entries are trimmed of surrounding whitespace.
//! An empty (or all-whitespace) string is no filter. Anything else is a
//! [`TopologyError::ParseFilter`] that quotes the offending token.

use std::fmt;

use crate::error::TopologyError;

/// One entry of an [`HcaFilter`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HcaEntry {
    /// The device name, or name prefix.
    pub name: String,
    /// The port the entry is restricted to, if any.
    pub port: Option<u32>,
}

/// A parsed `NCCL_IB_HCA` filter.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HcaFilter {
    /// `^`: the entries say what to exclude rather than what to keep.
    pub exclude: bool,
    /// `=`: names match exactly rather than by prefix.
    pub exact: bool,
    /// The entries; empty means no filter.
    pub entries: Vec<HcaEntry>,
}

fn valid_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')
}

impl HcaFilter {
    /// Parses `NCCL_IB_HCA` syntax (see the module docs).
    pub fn parse(input: &str) -> Result<HcaFilter, TopologyError> {
        let err = |token: &str, reason: &str| TopologyError::ParseFilter {
            input: input.to_owned(),
            token: token.to_owned(),
            reason: reason.to_owned(),
        };
        let mut rest = input.trim();
        if rest.is_empty() {
            return Ok(HcaFilter::default());
        }
        let mut filter = HcaFilter::default();
        if let Some(r) = rest.strip_prefix('^') {
            filter.exclude = true;
            rest = r;
        }
        if let Some(r) = rest.strip_prefix('=') {
            filter.exact = true;
            rest = r;
        }
        if rest.trim().is_empty() {
            return Err(err(input.trim(), "no device names after the prefix"));
        }
        for raw in rest.split(',') {
            let token = raw.trim();
            if token.is_empty() {
                return Err(err(raw, "empty entry"));
            }
            let (name, port) = match token.split_once(':') {
                Some((name, port)) => {
                    let port = port
                        .parse::<u32>()
                        .ok()
                        .filter(|p| *p > 0 && port.bytes().all(|b| b.is_ascii_digit()))
                        .ok_or_else(|| err(token, "port must be a positive decimal number"))?;
                    (name, Some(port))
                }
                None => (token, None),
            };
            if name.is_empty() {
                return Err(err(token, "empty device name"));
            }
            if !name.chars().all(valid_name_char) {
                return Err(err(
                    token,
                    "device names may hold only letters, digits, '_', '-' and '.'",
                ));
            }
            filter.entries.push(HcaEntry {
                name: name.to_owned(),
                port,
            });
        }
        Ok(filter)
    }

    /// Whether the filter restricts nothing.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn name_matches(&self, entry: &HcaEntry, device: &str) -> bool {
        if self.exact {
            entry.name == device
        } else {
            device.starts_with(&entry.name)
        }
    }

    /// Whether any port of `device` may be used.
    pub fn allows_device(&self, device: &str) -> bool {
        if self.is_empty() {
            return true;
        }
        let mut matching = self.entries.iter().filter(|e| self.name_matches(e, device));
        if self.exclude {
            // Excluding only some ports leaves the device itself in.
            !matching.any(|e| e.port.is_none())
        } else {
            matching.next().is_some()
        }
    }

    /// Whether `port` of `device` may be used.
    pub fn allows_port(&self, device: &str, port: u32) -> bool {
        if self.is_empty() {
            return true;
        }
        let mut matching = self.entries.iter().filter(|e| self.name_matches(e, device));
        if self.exclude {
            !matching.any(|e| e.port.is_none_or(|p| p == port))
        } else {
            matching.any(|e| e.port.is_none_or(|p| p == port))
        }
    }
}

impl fmt::Display for HcaFilter {
    /// Writes the canonical form, which [`HcaFilter::parse`] reads back to an equal filter
    /// (for a nonempty filter).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.exclude {
            f.write_str("^")?;
        }
        if self.exact {
            f.write_str("=")?;
        }
        for (i, e) in self.entries.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(&e.name)?;
            if let Some(p) = e.port {
                write!(f, ":{p}")?;
            }
        }
        Ok(())
    }
}

/// All the ways a user narrows which NICs, ports and GIDs are used.
///
/// Precedence (docs/architecture.md §3), applied to every NIC:
/// 1. `device_mask` (bit *i* = topology NIC id *i*; ids of 64 and above are outside any mask);
/// 2. the `hca` filter ([`HcaFilter`]), per device and per port;
/// 3. a nonempty `whitelist` keeps only the NICs it names, and the `blacklist` is then ignored;
///    otherwise the `blacklist` drops the NICs it names;
/// 4. `device_pin` keeps only the named NIC: it intersects everything above, so a pinned NIC the
///    whitelist leaves out is an error, not a fallback.
///
/// Pins are strict: a pinned device that is missing or unusable, a pinned port that is absent or
/// not ACTIVE, or a pinned GID index that is unset, is an error.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Selector {
    /// An `NCCL_IB_HCA`-style filter.
    pub hca: Option<HcaFilter>,
    /// Exact device names to keep (empty: no whitelist).
    pub whitelist: Vec<String>,
    /// Exact device names to drop (ignored when the whitelist is nonempty).
    pub blacklist: Vec<String>,
    /// The one device to use.
    pub device_pin: Option<String>,
    /// The one port to use on the pinned device (needs `device_pin`).
    pub port_pin: Option<u32>,
    /// The GID index to use on the pinned port (needs `device_pin`).
    pub gid_pin: Option<u32>,
    /// Topology NIC ids to keep, as a bit mask.
    pub device_mask: Option<u64>,
}

impl Selector {
    /// A selector with only an `NCCL_IB_HCA` filter, parsed from `hca`.
    pub fn from_hca(hca: &str) -> Result<Selector, TopologyError> {
        let filter = HcaFilter::parse(hca)?;
        Ok(Selector {
            hca: (!filter.is_empty()).then_some(filter),
            ..Selector::default()
        })
    }

    /// Why the NIC with this id and name is filtered out, or `None` when it is kept.
    pub fn device_exclusion(&self, id: usize, name: &str) -> Option<String> {
        if let Some(mask) = self.device_mask {
            let kept = u32::try_from(id)
                .ok()
                .and_then(|i| 1u64.checked_shl(i))
                .is_some_and(|bit| mask & bit != 0);
            if !kept {
                return Some(format!("NIC id {id} is not in device_mask {mask:#x}"));
            }
        }
        if let Some(hca) = &self.hca
            && !hca.allows_device(name)
        {
            return Some(format!("excluded by HCA filter \"{hca}\""));
        }
        if !self.whitelist.is_empty() {
            if !self.whitelist.iter().any(|w| w == name) {
                return Some(format!("not in whitelist [{}]", self.whitelist.join(",")));
            }
        } else if self.blacklist.iter().any(|b| b == name) {
            return Some("in blacklist".to_owned());
        }
        if let Some(pin) = &self.device_pin
            && pin != name
        {
            return Some(format!("not the pinned device {pin}"));
        }
        None
    }

    /// Parts of this selector that have no effect, in words (logged when a topology is built):
    /// a blacklist beside a nonempty whitelist, and mask bits a NIC id cannot reach.
    pub fn ignored_settings(&self, nic_count: usize) -> Vec<String> {
        let mut v = Vec::new();
        if !self.whitelist.is_empty() && !self.blacklist.is_empty() {
            v.push(format!(
                "blacklist [{}] is ignored: a nonempty whitelist [{}] takes precedence",
                self.blacklist.join(","),
                self.whitelist.join(",")
            ));
        }
        if self.device_mask.is_some() && nic_count > 64 {
            v.push(format!(
                "device_mask covers NIC ids 0 to 63 only: the {} NICs with higher ids are \
                 always excluded while a mask is set",
                nic_count - 64
            ));
        }
        v
    }

    /// Why `port` of the NIC `name` is filtered out, or `None` when it is kept.
    pub fn port_exclusion(&self, name: &str, port: u32) -> Option<String> {
        if let Some(hca) = &self.hca
            && !hca.allows_port(name, port)
        {
            return Some(format!("excluded by HCA filter \"{hca}\""));
        }
        if let Some(p) = self.port_pin
            && p != port
        {
            return Some(format!("not the pinned port {p}"));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, port: Option<u32>) -> HcaEntry {
        HcaEntry {
            name: name.into(),
            port,
        }
    }

    #[test]
    fn parses_nccl_forms() {
        let f = HcaFilter::parse("mlx5_0:1,mlx5_1").unwrap();
        assert!(!f.exclude && !f.exact);
        assert_eq!(
            f.entries,
            vec![entry("mlx5_0", Some(1)), entry("mlx5_1", None)]
        );
        let f = HcaFilter::parse("^=mlx5_3").unwrap();
        assert!(f.exclude && f.exact);
        let f = HcaFilter::parse("=mlx5_0").unwrap();
        assert!(!f.exclude && f.exact);
        assert!(HcaFilter::parse("   ").unwrap().is_empty());
        let f = HcaFilter::parse(" mlx5_0 , mlx5_1:2 ").unwrap();
        assert_eq!(f.to_string(), "mlx5_0,mlx5_1:2");
    }

    #[test]
    fn malformed_filters_quote_the_token() {
        for (input, token) in [
            ("mlx5_0,,mlx5_1", ""),
            ("mlx5_0:x", "mlx5_0:x"),
            ("mlx5_0:0", "mlx5_0:0"),
            ("mlx5_0:", "mlx5_0:"),
            (":1", ":1"),
            ("mlx5 0", "mlx5 0"),
            ("=^mlx5_0", "^mlx5_0"),
            ("a:1:2", "a:1:2"),
            ("^", "^"),
            ("^=", "^="),
            ("mlx5_0:+1", "mlx5_0:+1"),
        ] {
            match HcaFilter::parse(input) {
                Err(TopologyError::ParseFilter { token: t, .. }) => {
                    assert_eq!(t, token, "input {input:?}")
                }
                other => panic!("{input:?} gave {other:?}"),
            }
        }
        let msg = HcaFilter::parse("mlx5_0:x").unwrap_err().to_string();
        assert!(msg.contains("\"mlx5_0:x\""), "{msg}");
    }

    #[test]
    fn prefix_exact_and_ports() {
        let f = HcaFilter::parse("mlx5").unwrap();
        assert!(f.allows_device("mlx5_10") && !f.allows_device("mlx4_0"));
        let f = HcaFilter::parse("=mlx5").unwrap();
        assert!(!f.allows_device("mlx5_0") && f.allows_device("mlx5"));
        let f = HcaFilter::parse("mlx5_0:1").unwrap();
        assert!(f.allows_device("mlx5_0") && f.allows_port("mlx5_0", 1));
        assert!(!f.allows_port("mlx5_0", 2));
        let f = HcaFilter::parse("^mlx5_0:1").unwrap();
        assert!(f.allows_device("mlx5_0") && !f.allows_port("mlx5_0", 1));
        assert!(f.allows_port("mlx5_0", 2));
        let f = HcaFilter::parse("^=mlx5_1").unwrap();
        assert!(!f.allows_device("mlx5_1") && f.allows_device("mlx5_10"));
        let f = HcaFilter::parse("^mlx5_1").unwrap();
        assert!(!f.allows_device("mlx5_10"));
    }

    #[test]
    fn ignored_settings_are_named() {
        let s = Selector {
            whitelist: vec!["a".into()],
            blacklist: vec!["b".into()],
            device_mask: Some(1),
            ..Selector::default()
        };
        let w = s.ignored_settings(70);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].contains("blacklist [b] is ignored"), "{w:?}");
        assert!(w[1].contains("6 NICs with higher ids"), "{w:?}");
        assert!(s.ignored_settings(3).len() == 1);
        assert!(Selector::default().ignored_settings(100).is_empty());
    }

    #[test]
    fn whitelist_beats_blacklist_and_intersects_pin() {
        let s = Selector {
            whitelist: vec!["a".into(), "b".into()],
            blacklist: vec!["a".into()],
            ..Selector::default()
        };
        assert_eq!(s.device_exclusion(0, "a"), None);
        assert!(s.device_exclusion(2, "c").unwrap().contains("whitelist"));
        let s = Selector {
            device_pin: Some("c".into()),
            ..s
        };
        assert!(s.device_exclusion(2, "c").unwrap().contains("whitelist"));
        assert!(s.device_exclusion(0, "a").unwrap().contains("pinned"));
        let s = Selector {
            blacklist: vec!["a".into()],
            ..Selector::default()
        };
        assert_eq!(s.device_exclusion(0, "a").as_deref(), Some("in blacklist"));
        let s = Selector {
            device_mask: Some(0b101),
            ..Selector::default()
        };
        assert_eq!(s.device_exclusion(2, "x"), None);
        assert!(
            s.device_exclusion(1, "x")
                .unwrap()
                .contains("device_mask 0x5")
        );
        assert!(s.device_exclusion(70, "x").is_some());
    }
}
