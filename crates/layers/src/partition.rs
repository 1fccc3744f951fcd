use std::ops::Range;

use tpinfer_kernels::QueryGroups;

use crate::{Error, Result};

/// Splits `0..n` into `parts` contiguous ranges as evenly as possible, the longer ones first:
/// 32 over 5 is 7, 7, 6, 6, 6.
pub fn split_evenly(n: usize, parts: usize) -> Vec<Range<usize>> {
    let (base, extra) = (n / parts, n % parts);
    let mut start = 0;
    (0..parts)
        .map(|p| {
            let len = base + usize::from(p < extra);
            let range = start..start + len;
            start += len;
            range
        })
        .collect()
}

/// Like [`split_evenly`], but every boundary falls on a multiple of the largest alignment in
/// 64, 32, …, 1 that divides `n` and still gives each part at least one unit: GEMM tiles stay
/// whole. 13,824 FFN columns over 5 ranks: 2,816 and 4 × 2,752.
pub fn split_aligned(n: usize, parts: usize) -> Vec<Range<usize>> {
    let align = [64, 32, 16, 8, 4, 2, 1]
        .into_iter()
        .find(|&a| n.is_multiple_of(a) && n / a >= parts)
        .unwrap_or(1);
    split_evenly(n / align, parts)
        .into_iter()
        .map(|r| r.start * align..r.end * align)
        .collect()
}

/// `0..n` split into `parts` for values stored in blocks of `block` along the split (GGML
/// quant blocks of a row-parallel weight's inner dimension): every boundary falls on a whole
/// block, the blocks spread as evenly as they go. Blocks of 1 split like [`split_aligned`].
/// Fails, naming the widths that work, when there are fewer blocks than parts.
pub fn split_blocks(n: usize, parts: usize, block: usize) -> Result<Vec<Range<usize>>> {
    if block <= 1 {
        return Ok(split_aligned(n, parts));
    }
    let blocks = n / block;
    if !n.is_multiple_of(block) || blocks < parts {
        return Err(Error::Shard(format!(
            "{n} values stored in quant blocks of {block} make {blocks} whole blocks, which split over at most \
             {blocks} ranks: use --tp {blocks} or less, or --dequantize"
        )));
    }
    Ok(split_evenly(blocks, parts)
        .into_iter()
        .map(|r| r.start * block..r.end * block)
        .collect())
}

/// A rank's shard of attention heads.
///
/// Q heads are split evenly. The rank holds exactly the KV heads its Q heads read, so a KV
/// head is replicated on every rank whose Q heads use it: when TP exceeds the KV head count,
/// or when a GQA group straddles two ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadShard {
    pub q_heads: Range<usize>,
    pub kv_heads: Range<usize>,
    /// For each local Q head, the index of its KV head among the local KV heads.
    pub kv_of_q: Vec<u32>,
    /// Q heads per KV head in the whole model.
    pub group: usize,
}

impl HeadShard {
    /// The shard of `rank` when `n_heads` Q heads sharing `n_kv_heads` KV heads are spread
    /// over `world` ranks.
    pub fn new(n_heads: usize, n_kv_heads: usize, world: usize, rank: usize) -> Result<Self> {
        Self::in_units(n_heads, n_kv_heads, world, rank, 1)
    }

    /// [`Self::new`] with Q heads kept together in runs of `unit` (a power of two): what a
    /// row-parallel output projection in quant blocks spanning several heads needs, so that
    /// each rank's input columns are whole blocks.
    pub fn in_units(n_heads: usize, n_kv_heads: usize, world: usize, rank: usize, unit: usize) -> Result<Self> {
        if world == 0 || world > n_heads {
            return Err(Error::Shard(format!(
                "TP width {world} must be between 1 and the {n_heads} attention heads: use --tp {n_heads} or less"
            )));
        }
        let units = n_heads / unit.max(1);
        if unit > 1 && (!n_heads.is_multiple_of(unit) || world > units) {
            return Err(Error::Shard(format!(
                "the attention output's quant blocks span {unit} heads, so its {n_heads} heads split over at most \
                 {units} ranks: use --tp {units} or less, or --dequantize"
            )));
        }
        if n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(Error::Shard(format!(
                "{n_heads} attention heads are not a multiple of {n_kv_heads} KV heads"
            )));
        }
        let group = n_heads / n_kv_heads;
        let unit = unit.max(1);
        let runs = split_evenly(n_heads / unit, world)[rank].clone();
        let q_heads = runs.start * unit..runs.end * unit;
        let kv_heads = q_heads.start / group..(q_heads.end - 1) / group + 1;
        let kv_of_q = q_heads.clone().map(|h| (h / group - kv_heads.start) as u32).collect();
        Ok(Self {
            q_heads,
            kv_heads,
            kv_of_q,
            group,
        })
    }

    /// Local Q head `h` reads local KV head `(h + offset) / group`: the offset is where the
    /// rank's first Q head falls in its group.
    pub fn query_groups(&self) -> QueryGroups {
        QueryGroups {
            group: self.group,
            offset: self.q_heads.start - self.kv_heads.start * self.group,
        }
    }

    /// Whether local Q head `i` reads local KV head `i / g` for one group size `g`: then the
    /// KV heads can be repeated rather than gathered.
    pub fn uniform_group(&self) -> Option<usize> {
        let g = self.q_heads.len() / self.kv_heads.len();
        let uniform = self.q_heads.len().is_multiple_of(self.kv_heads.len())
            && self.kv_of_q.iter().enumerate().all(|(i, &k)| k as usize == i / g);
        uniform.then_some(g)
    }
}
