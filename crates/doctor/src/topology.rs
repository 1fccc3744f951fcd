/// How two GPUs are connected, as `nvidia-smi topo -m` labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// NVLink with this many links.
    NvLink(u32),
    /// Through at most one PCIe switch (`PIX`).
    PcieSwitch,
    /// Through several PCIe switches, not the host bridge (`PXB`).
    PcieSwitches,
    /// Through a PCIe host bridge (`PHB`).
    HostBridge,
    /// Through the interconnect between host bridges of one NUMA node (`NODE`).
    NumaNode,
    /// Across sockets (`SYS`).
    AcrossSockets,
    /// The GPU itself.
    Same,
}

impl Link {
    fn parse(label: &str) -> Option<Self> {
        Some(match label {
            "X" => Self::Same,
            "PIX" => Self::PcieSwitch,
            "PXB" => Self::PcieSwitches,
            "PHB" => Self::HostBridge,
            "NODE" => Self::NumaNode,
            "SYS" => Self::AcrossSockets,
            nv => Self::NvLink(nv.strip_prefix("NV")?.parse().ok()?),
        })
    }

    pub fn describe(&self) -> String {
        match self {
            Self::NvLink(n) => format!("NVLink ×{n}"),
            Self::PcieSwitch => "PCIe, one switch".into(),
            Self::PcieSwitches => "PCIe, several switches".into(),
            Self::HostBridge => "PCIe through the host bridge".into(),
            Self::NumaNode => "PCIe across host bridges of one NUMA node".into(),
            Self::AcrossSockets => "across CPU sockets".into(),
            Self::Same => "same GPU".into(),
        }
    }
}

/// The GPU-to-GPU block of `nvidia-smi topo -m`: row `i`, column `j` is how GPU i reaches GPU j.
pub fn parse_topology(text: &str) -> Option<Vec<Vec<Link>>> {
    let mut lines = text.lines().map(|l| l.trim_end()).filter(|l| !l.trim().is_empty());
    // The header names the columns: GPU0 GPU1 … then NICs, CPU Affinity, …
    let header = lines.find(|l| l.split_whitespace().next().is_some_and(|w| w.starts_with("GPU")))?;
    let gpus = header.split_whitespace().take_while(|w| w.starts_with("GPU")).count();
    let mut matrix = Vec::with_capacity(gpus);
    for line in lines {
        let mut words = line.split_whitespace();
        let name = words.next()?;
        if !name.starts_with("GPU") {
            break;
        }
        let row = words.take(gpus).map(Link::parse).collect::<Option<Vec<_>>>()?;
        if row.len() != gpus {
            return None;
        }
        matrix.push(row);
    }
    (matrix.len() == gpus && gpus > 0).then_some(matrix)
}
