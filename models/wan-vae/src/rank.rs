use candle_core::{DType, Device, Tensor};
use tpinfer_kernels::conv_path;
use tpinfer_layers::Result;
use tpinfer_weights::{ShardLoader, WeightStore};

use crate::decoder::Decoder;
use crate::memory::{DecodeDevice, DecodeMemory, DecodeShape, Tiling};
use crate::{WanVaeConfig, WanVaeShard};

/// One rank's VAE decoder, and the band of rows it decodes.
pub struct WanVaeRank {
    decoder: Decoder,
    config: WanVaeConfig,
    shard: WanVaeShard,
    dtype: DType,
    device: Device,
    bytes_loaded: usize,
}

impl WanVaeRank {
    /// Loads the decoder's weights from `store` onto `device`, in `dtype`. The store must
    /// have been checked against [`WanVaeShard::weight_decls`].
    pub fn load(
        config: &WanVaeConfig,
        store: &dyn WeightStore,
        shard: WanVaeShard,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let decls = shard.weight_decls(config);
        let mut w = ShardLoader::new(store, &decls, dtype, device);
        let decoder = Decoder::load(config, &mut w)?;
        Ok(Self {
            decoder,
            config: config.clone(),
            shard,
            dtype,
            device: device.clone(),
            bytes_loaded: w.bytes_read(),
        })
    }

    pub fn bytes_loaded(&self) -> usize {
        self.bytes_loaded
    }

    /// Decodes normalised latents `[z, latent frames, h, w]` (the DiT's) to this rank's band
    /// of every frame's rows: `[frames, channels, band rows, w · 8]` in [−1, 1], f32 on the
    /// CPU, with the band's first row. `tiling` bounds the temporaries (`None`: the memory
    /// plan's for this rank and size); `on_chunk` hears each tile's latent frames done.
    pub fn decode(
        &self,
        latents: &Tensor,
        tiling: Option<Tiling>,
        on_chunk: &mut dyn FnMut(usize, usize),
    ) -> Result<(Tensor, usize)> {
        let (_, frames, h, w) = latents.dims4()?;
        let factor = self.config.spatial_factor();
        let band = self
            .shard
            .band(&self.config, h * factor)
            .map_err(tpinfer_layers::Error::Shard)?;
        let tiling = tiling.unwrap_or_else(|| {
            let device = DecodeDevice {
                dtype: self.dtype,
                cuda: self.device.is_cuda(),
                conv: conv_path(&self.device),
            };
            let video = DecodeShape {
                latent_frames: frames,
                height: h * factor,
                width: w * factor,
            };
            DecodeMemory::new(&self.config, device, video, band).tiling
        });
        let pixels = self
            .decoder
            .decode(latents, band, tiling, self.dtype, &self.device, on_chunk)?;
        Ok((pixels, band.start))
    }
}
