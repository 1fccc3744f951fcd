//! The decoder's layers as shapes: what it loads, and what the memory plan walks.

use crate::blocks::{Head, ResBlock, Upsample};
use crate::rows::Rows;
use crate::WanVaeConfig;

/// One layer of the decoder's path (the up blocks, then the output layers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PathStep {
    /// A residual block from `inp` to `out` channels.
    Res { inp: usize, out: usize },
    /// An upsampling of `c` channels to `c / 2`, doubling time when `temporal`.
    Up { c: usize, temporal: bool },
    /// The output layers: `c` channels to the pixels' `out`.
    Out { c: usize, out: usize },
}

impl PathStep {
    /// The rows of this step's input that writing `out` reads.
    pub fn input_rows(&self, out: Rows) -> Rows {
        match self {
            Self::Res { .. } => ResBlock::input_rows(out),
            Self::Up { .. } => Upsample::input_rows(out),
            Self::Out { .. } => Head::input_rows(out),
        }
    }
}

/// The decoder's widths and layers.
pub(crate) struct Layout {
    pub z: usize,
    /// The middle block's width.
    pub middle: usize,
    pub path: Vec<PathStep>,
}

impl Layout {
    pub fn of(c: &WanVaeConfig) -> Self {
        let widths = c.widths();
        let temporal = c.temporal_upsample();
        let levels = c.dim_mult.len();
        let mut path = Vec::new();
        for i in 0..levels {
            // Every up block but the first takes the half width its predecessor's upsampling
            // leaves.
            let mut inp = if i == 0 { widths[0] } else { widths[i] / 2 };
            let out = widths[i + 1];
            for _ in 0..=c.num_res_blocks {
                path.push(PathStep::Res { inp, out });
                inp = out;
            }
            if i + 1 < levels {
                path.push(PathStep::Up {
                    c: out,
                    temporal: temporal[i],
                });
            }
        }
        path.push(PathStep::Out {
            c: widths[levels],
            out: c.out_channels,
        });
        Self {
            z: c.z_dim,
            middle: widths[0],
            path,
        }
    }

    /// The first step after the last temporal upsampling: from there on a frame's layers read
    /// the frames before it only through their causal caches, so its frames can run through
    /// them a few at a time.
    pub fn full_rate_start(&self) -> usize {
        self.path
            .iter()
            .rposition(|s| matches!(s, PathStep::Up { temporal: true, .. }))
            .map_or(0, |i| i + 1)
    }

    /// The rows of the middle's output (at latent resolution) that decoding `out` reads, and
    /// each path step's output rows, in order.
    pub fn windows(&self, out: Rows) -> (Rows, Vec<Rows>) {
        let mut outs = vec![out; self.path.len()];
        let mut rows = out;
        for (step, step_out) in self.path.iter().zip(outs.iter_mut()).rev() {
            *step_out = rows;
            rows = step.input_rows(rows);
        }
        (rows, outs)
    }
}
