/// How two GPUs are connected, as `nvidia-smi topo -m` labels it.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// A label this parser does not know, kept as printed.
    Other(String),
}

impl Link {
    fn parse(label: &str) -> Self {
        match label {
            "X" => Self::Same,
            "PIX" => Self::PcieSwitch,
            "PXB" => Self::PcieSwitches,
            "PHB" => Self::HostBridge,
            "NODE" => Self::NumaNode,
            "SYS" => Self::AcrossSockets,
            other => match other.strip_prefix("NV").and_then(|n| n.parse().ok()) {
                Some(n) => Self::NvLink(n),
                None => Self::Other(other.to_string()),
            },
        }
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
            Self::Other(label) => label.clone(),
        }
    }
}

/// `text` without ANSI escape sequences (nvidia-smi underlines the header on some systems).
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // ESC [ … final byte in @..~
            for c in chars.by_ref() {
                if ('@'..='~').contains(&c) && c != '[' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The GPU-to-GPU block of `nvidia-smi topo -m`: row `i`, column `j` is how GPU i reaches GPU j.
pub fn parse_topology(text: &str) -> Option<Vec<Vec<Link>>> {
    let text = strip_ansi(text);
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
        let row: Vec<Link> = words.take(gpus).map(Link::parse).collect();
        if row.len() != gpus {
            return None;
        }
        matrix.push(row);
    }
    (matrix.len() == gpus && gpus > 0).then_some(matrix)
}
