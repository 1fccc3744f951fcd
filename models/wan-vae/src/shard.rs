use tpinfer_weights::WeightDecl;

use crate::decoder::weight_decls;
use crate::rows::{split_rows, Rows};
use crate::WanVaeConfig;

/// What one rank of a `world`-wide group decodes: a band of every frame's rows, in whole
/// latent rows, with every weight (the decoder is small; its activations are not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WanVaeShard {
    pub rank: usize,
    pub world: usize,
}

impl WanVaeShard {
    pub fn new(world: usize, rank: usize) -> Result<Self, String> {
        match world > 0 && rank < world {
            true => Ok(Self { rank, world }),
            false => Err(format!("rank {rank} of {world}: the VAE needs 1 or more ranks")),
        }
    }

    /// This rank's rows of a frame `height` pixels tall: an even share of its latent rows.
    /// Fails, naming the limit, when there are fewer latent rows than ranks.
    pub fn band(&self, c: &WanVaeConfig, height: usize) -> Result<Rows, String> {
        let factor = c.spatial_factor();
        split_rows(height, factor, self.world)
            .map(|bands| bands[self.rank])
            .map_err(|detail| format!("the VAE splits frames by latent rows over the ranks: {detail}"))
    }

    /// Every tensor this rank reads: all of the decoder's, whole.
    pub fn weight_decls(&self, c: &WanVaeConfig) -> Vec<WeightDecl> {
        weight_decls(c)
    }
}
