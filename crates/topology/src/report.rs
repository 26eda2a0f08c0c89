//! Rendering a [`Topology`] as a table or as JSON.

use std::fmt::Write as _;

use crate::error::TopologyError;
use crate::topology::Topology;

impl Topology {
    /// The JSON view: one pretty-printed object with `nics`, `gpus`, `assignment` and the rest
    /// of [`Topology`]'s fields.
    pub fn to_json(&self) -> Result<String, TopologyError> {
        serde_json::to_string_pretty(self).map_err(|source| TopologyError::RenderJson { source })
    }

    /// The human view: the GPU x NIC matrix of distance classes, the NIC list with usability and
    /// reasons, and the assignment.
    pub fn render_table(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail; the results are ignored for that reason.
        if let Some(why) = &self.verbs_unavailable {
            let _ = writeln!(out, "verbs unavailable: {why}");
        }
        let _ = writeln!(
            out,
            "{} PCI devices, NUMA nodes {:?}, {} GPUs, {} RDMA NICs ({} usable)",
            self.pci_devices,
            self.numa_nodes,
            self.gpus.len(),
            self.nics.len(),
            self.usable_nics().count()
        );
        if !self.gpus.is_empty() && !self.nics.is_empty() {
            let _ = writeln!(out, "\nGPU x NIC distance (* = NIC usable):");
            let width = self
                .nics
                .iter()
                .map(|n| n.name.len() + 1)
                .max()
                .unwrap_or(0)
                .max(6);
            let mut header = format!("{:<8}", "");
            for nic in &self.nics {
                let _ = write!(header, " {:<width$}", nic.name);
            }
            let _ = writeln!(out, "{}", header.trim_end());
            for gpu in &self.gpus {
                let mut row = format!("{:<8}", format!("GPU{}", gpu.id));
                for nic in &self.nics {
                    let cell = match gpu.nics.iter().find(|n| n.id == nic.id) {
                        Some(n) => format!("{}{}", n.class, if nic.usable { "*" } else { "" }),
                        None => "-".to_owned(),
                    };
                    let _ = write!(row, " {cell:<width$}");
                }
                let _ = writeln!(out, "{}", row.trim_end());
            }
        }
        if !self.gpus.is_empty() {
            let _ = writeln!(out, "\nGPUs:");
            for gpu in &self.gpus {
                let _ = writeln!(
                    out,
                    "  GPU{:<3} {}  numa {}",
                    gpu.id,
                    gpu.pci,
                    opt(gpu.numa_node)
                );
            }
        }
        let _ = writeln!(out, "\nNICs:");
        if self.nics.is_empty() {
            let _ = writeln!(out, "  (no RDMA device in sysfs)");
        }
        for nic in &self.nics {
            let pci = nic.pci.map(|p| p.to_string()).unwrap_or_else(|| "-".into());
            let _ = writeln!(
                out,
                "  {:<3} {:<12} {:<13} numa {:<3} {}",
                nic.id,
                nic.name,
                pci,
                opt(nic.numa_node),
                match &nic.reason {
                    None => "usable".to_owned(),
                    Some(r) => format!("NOT USABLE: {r}"),
                }
            );
            for p in &nic.ports {
                let gid = p
                    .gid_index
                    .and_then(|i| p.gids.iter().find(|g| g.index == i))
                    .map(|g| format!(" gid {} {} ({})", g.index, g.gid, g.gid_type.as_str()))
                    .unwrap_or_default();
                let _ = writeln!(
                    out,
                    "      port {} {} {} netdev {} mtu {}{}{}",
                    p.port,
                    p.state,
                    p.link_layer,
                    p.netdev.as_deref().unwrap_or("-"),
                    opt(p.mtu),
                    gid,
                    p.reason
                        .as_deref()
                        .map(|r| format!(" [not usable: {r}]"))
                        .unwrap_or_default()
                );
            }
        }
        for name in &self.verbs_only {
            let _ = writeln!(out, "  {name}: returned by verbs but absent from sysfs");
        }
        if !self.assignment.is_empty() {
            let _ = writeln!(out, "\nAssignment:");
            for a in &self.assignment {
                let pci = self
                    .gpus
                    .get(a.gpu)
                    .map(|g| g.pci.to_string())
                    .unwrap_or_default();
                let nics = if a.nics.is_empty() {
                    "(no usable NIC)".to_owned()
                } else {
                    a.nics.join(", ")
                };
                let class = a.class.map(|c| format!(" ({c})")).unwrap_or_default();
                let _ = writeln!(out, "  GPU{} {pci} -> {nics}{class}", a.gpu);
            }
        }
        out
    }
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map(|x| x.to_string()).unwrap_or_else(|| "?".into())
}
