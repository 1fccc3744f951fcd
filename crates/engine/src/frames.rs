//! The decode stage of a video pipeline: the Wan VAE on the ranks, each decoding a band of
//! every frame's rows, the bands joined into the video. [`VaeEngine`] runs it alone
//! (`tpinfer decode`); a [`crate::VideoEngine`] on a pipeline directory runs it after the DiT.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use tpinfer_family::Family;
use tpinfer_plan::{Placement, Plan, ShardedModel};
use tpinfer_runtime::{Launch, ModelHandle, RankGroup, RuntimeError, Topology};
use tpinfer_wan_vae::{WanVaeModel, WanVaeRank};

use crate::error::finite;
use crate::video::VideoShape;
use crate::{EngineBuilder, EngineError};

/// The VAE on the ranks.
pub(crate) struct FrameDecoder {
    vae: ModelHandle<WanVaeRank>,
    shape: VideoShape,
    latent_shape: [usize; 4],
}

/// Decoded frames: `[frames, 3, height, width]` in [−1, 1], f32 on the CPU.
pub type Frames = Tensor;

impl FrameDecoder {
    /// Adds `vae` to the ranks `launch` starts, planned to decode `shape` (and any video of
    /// fewer frames), for latents of `z` channels (the DiT's).
    pub fn add(
        launch: &mut Launch,
        vae: WanVaeModel,
        shape: VideoShape,
        z: usize,
        dtype: DType,
    ) -> Result<Self, EngineError> {
        let c = vae.config();
        if c.z_dim != z {
            return Err(EngineError::InvalidRequest(format!(
                "{}: the VAE's z_dim {} is not the DiT's {z} latent channels",
                vae.name(),
                c.z_dim
            )));
        }
        let (time, space) = (c.temporal_factor(), c.spatial_factor());
        let latent_shape = [
            z,
            (shape.frames - 1) / time + 1,
            shape.height / space,
            shape.width / space,
        ];
        let placement = Placement::Dit {
            frames: shape.frames,
            width: shape.width,
            height: shape.height,
            cfg: true,
        };
        Ok(Self {
            vae: launch.add(Arc::new(vae), dtype, placement)?,
            shape,
            latent_shape,
        })
    }

    /// Decodes `latents` (the DiT's, normalised) on every rank; `on_progress` hears rank 0's
    /// tiles and frames done, out of how many.
    pub fn decode(
        &self,
        group: &RankGroup,
        latents: &Tensor,
        on_progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Frames, EngineError> {
        let [z, most, h, w] = self.latent_shape;
        match latents.dims() {
            &[c, f, lh, lw] if c == z && (1..=most).contains(&f) && lh == h && lw == w => {}
            dims => {
                return Err(EngineError::InvalidRequest(format!(
                    "latents {dims:?} are not the [{z}, 1 to {most}, {h}, {w}] that up to {} frames at {}x{} take",
                    self.shape.frames, self.shape.width, self.shape.height
                )))
            }
        }
        match finite(latents) {
            Ok(true) => {}
            Ok(false) => {
                return Err(EngineError::InvalidRequest(
                    "the latents hold NaN or infinite values".into(),
                ))
            }
            Err(e) => return Err(RuntimeError::of_rank(0, e.into()).into()),
        }
        let (progress_tx, progress) = mpsc::channel();
        let (vae, latents) = (self.vae, latents.clone());
        let pending = group.submit(move |rank| -> Result<(usize, Tensor), EngineError> {
            let r = rank.env.rank;
            let progress = progress_tx.clone();
            let mut report = |done, total| {
                if r == 0 {
                    let _ = progress.send((done, total));
                }
            };
            let (pixels, first_row) = rank
                .models
                .get_mut(&vae)?
                .decode(&latents, None, &mut report)
                .map_err(|e| RuntimeError::of_rank(r, e))?;
            Ok((first_row, pixels))
        });
        for (done, total) in progress.iter() {
            on_progress(done, total);
        }
        let mut bands = pending.wait()?;
        bands.sort_by_key(|(first_row, _)| *first_row);
        let bands: Vec<Tensor> = bands.into_iter().map(|(_, pixels)| pixels).collect();
        let tensor_err = |e: candle_core::Error| EngineError::from(RuntimeError::of_rank(0, e.into()));
        let frames = Tensor::cat(&bands, 2).map_err(tensor_err)?;
        // NaN would turn into black pixels without a word; the clamp keeps infinities in range.
        match finite(&frames).map_err(tensor_err)? {
            true => Ok(frames),
            false => Err(EngineError::NonFinite {
                what: "frames",
                stage: "the VAE's decode".into(),
            }),
        }
    }

    pub fn plan<'a>(&self, group: &'a RankGroup) -> &'a Plan {
        &group.plans()[self.vae.index()]
    }
}

/// Where a model path's VAE is: a pipeline directory's `vae/`, or a VAE directory itself.
pub(crate) fn vae_dir(model: &Path) -> Result<PathBuf, EngineError> {
    let dir = match crate::WanPipelineDir::detect(model) {
        true => crate::WanPipelineDir::open(model)?.vae.ok_or_else(|| {
            EngineError::InvalidRequest(format!(
                "{}: the pipeline has no `vae/` folder to decode with",
                model.display()
            ))
        })?,
        false => model.to_path_buf(),
    };
    match WanVaeModel::detect(&dir) {
        true => Ok(dir),
        false => Err(EngineError::InvalidRequest(format!(
            "{} holds no Wan VAE (config.json of an AutoencoderKLWan): give a pipeline directory or its vae/",
            dir.display()
        ))),
    }
}

/// The Wan VAE alone on its ranks: re-decoding saved latents without the DiT.
pub struct VaeEngine {
    group: RankGroup,
    decoder: FrameDecoder,
}

impl VaeEngine {
    /// Opens the VAE of `b`'s model (a pipeline directory or its `vae/`), plans every rank
    /// to decode `shape` (refusing over budget) and loads the ranks.
    pub fn start(b: EngineBuilder, shape: VideoShape) -> Result<Self, EngineError> {
        let dir = vae_dir(&b.model)?;
        let z = WanVaeModel::open(&dir)
            .map_err(|e| RuntimeError::Model(e.to_string()))?
            .config()
            .z_dim;
        let topology = Topology::new(b.tp, &b.device)?;
        let dtype = b.dtype.unwrap_or(match topology.is_cpu() {
            true => DType::F32,
            false => DType::BF16,
        });
        let mut launch = Launch::new(topology, b.group.clone());
        let vae = WanVaeModel::open(&dir).map_err(|e| RuntimeError::Model(e.to_string()))?;
        let decoder = FrameDecoder::add(&mut launch, vae, shape, z, dtype)?;
        Ok(Self {
            group: launch.start()?,
            decoder,
        })
    }

    /// The video that latents of `latent_frames` × `h` × `w` decode to with the VAE of
    /// `model` (a pipeline directory or its `vae/`).
    pub fn video_shape(model: &Path, latent_frames: usize, h: usize, w: usize) -> Result<VideoShape, EngineError> {
        let dir = vae_dir(model)?;
        let vae = WanVaeModel::open(&dir).map_err(|e| RuntimeError::Model(e.to_string()))?;
        let c = vae.config();
        let space = c.spatial_factor();
        let (width, height) = (w.checked_mul(space), h.checked_mul(space));
        match (latent_frames, width, height) {
            (1.., Some(width), Some(height)) if h > 0 && w > 0 => Ok(VideoShape {
                frames: c.frames(latent_frames),
                width,
                height,
            }),
            _ => Err(EngineError::InvalidRequest(format!(
                "latents of {latent_frames} frames of {h} × {w} decode to no video"
            ))),
        }
    }

    /// Decodes normalised latents `[z, latent frames, h, w]`, as a DiT leaves them, to the
    /// video: `[frames, 3, height, width]` in [−1, 1], f32 on the CPU. `on_progress` hears
    /// rank 0's tiles and latent frames done, out of how many.
    pub fn decode(&self, latents: &Tensor, mut on_progress: impl FnMut(usize, usize)) -> Result<Frames, EngineError> {
        self.decoder.decode(&self.group, latents, &mut on_progress)
    }

    pub fn plan(&self) -> &Plan {
        self.decoder.plan(&self.group)
    }

    /// Each rank's device memory now, with its peak since the start; `None` for CPU ranks.
    pub fn device_memory(&self) -> Vec<Option<crate::DeviceMemory>> {
        self.group.device_memory()
    }
}
