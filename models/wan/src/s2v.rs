//! What Wan2.2-S2V adds to the DiT's input (`WanModel_S2V.forward` of the wan22 wheel): the
//! pose latents through the condition encoder, added to the video tokens; the reference
//! image's latent frame, patched like the video; the motion latents of the clip before,
//! frame-packed at three scales (`FramePackMotioner`); a learned embedding marking each
//! token video, reference or motion; and RoPE positions that put the reference at time 30
//! and the motion frames at negative times. None of it depends on the timestep, so a clip
//! prepares it once for all its steps.

use candle_core::{DType, Tensor};
use tpinfer_layers::{Error, Result};
use tpinfer_weights::ShardLoader;

use crate::model::{patches, rope_grid, PatchLinear, PositionGrid};
use crate::s2v_audio::{AudioEmbedding, S2vAudio};
use crate::{S2vModules, WanConfig, S2V_MOTION_FRAMES};

/// The latent frames the frame packer reads at each scale, nearest first: the last frame
/// patched as the video is, the two before at half the resolution, the sixteen before
/// those at a quarter, four frames to a patch.
const FRAME_PACK: [(usize, [usize; 3]); 3] = [(1, [1, 2, 2]), (2, [2, 4, 4]), (16, [4, 8, 8])];

/// The time position of the reference image's tokens (`ref_grid_sizes`).
const REFERENCE_TIME: i64 = 30;

/// One clip's conditioning, as the S2V pipeline hands it to each step.
#[derive(Debug, Clone)]
pub struct S2vCondition {
    /// The reference image's latent, `[channels, 1, height, width]`.
    pub reference: Tensor,
    /// The motion frames' latents `[channels, 19, height, width]`, the last clip's; `None`
    /// for the first clip, which S2V runs with them dropped.
    pub motion: Option<Tensor>,
    /// The pose latents `[cond channels, latent frames, height, width]` (zeros without a
    /// pose video).
    pub pose: Tensor,
    /// The clip's audio through the causal encoder ([`crate::WanRank::encode_s2v_audio`]).
    pub audio: AudioEmbedding,
}

/// A clip's conditioning embedded for the DiT: what every step of the clip reuses.
#[derive(Clone)]
pub struct S2vClip {
    /// The video's grid of patches `(frames, height, width)`.
    pub(crate) grid: (usize, usize, usize),
    /// The pose latents' patches, `[video tokens, cond channels · 4]`: small, and embedded
    /// by each step for its rows only, so that no stream-sized tensor outlives a step.
    pub(crate) pose: Tensor,
    /// The reference and motion tokens, marked, `[condition tokens, dim]`.
    pub(crate) condition: Tensor,
    /// RoPE for the whole sequence, `[tokens, 2, head_dim / 2]` f32.
    pub(crate) rope: Tensor,
    /// Timestep 0's modulation rows, `[6, dim]` f32: the reference and motion tokens'.
    pub(crate) zero_time: Tensor,
    pub(crate) audio: AudioEmbedding,
}

impl S2vClip {
    /// The same clip with other audio (silence, for the unconditional pass): its tokens and
    /// tables shared, not copied.
    pub fn with_audio(&self, audio: AudioEmbedding) -> Self {
        Self { audio, ..self.clone() }
    }
}

/// numpy's `linspace(start, stop, n).astype(int)`, as S2V's `rope_precompute` samples the
/// positions of a coarser grid: `start + i · (stop − start) / (n − 1)`, the last exactly
/// `stop`, truncated toward zero.
fn linspace_trunc(start: i64, stop: i64, n: usize) -> Vec<i64> {
    if n <= 1 {
        return vec![start; n];
    }
    let step = (stop - start) as f64 / (n - 1) as f64;
    (0..n)
        .map(|i| match i + 1 == n {
            true => stop,
            false => (i as f64 * step + start as f64) as i64,
        })
        .collect()
}

/// S2V's modules around the DiT, as loaded on each rank: all replicated but the audio
/// injections' heads.
pub(crate) struct S2vEmbedders {
    pub(crate) audio: S2vAudio,
    /// The condition encoder, its bias holding the video tokens' mark too.
    pub(crate) cond_encoder: PatchLinear,
    /// The frame packer's three scales, nearest first.
    packers: Vec<PatchLinear>,
    /// `[3, dim]`: the marks of video, reference and motion tokens.
    marks: Tensor,
    /// The injection after each block, if any: `inject_after[block]`.
    pub(crate) inject_after: Vec<Option<usize>>,
}

impl S2vEmbedders {
    pub(crate) fn load(
        w: &mut ShardLoader,
        c: &WanConfig,
        s2v: &S2vModules,
        comm: &std::sync::Arc<dyn tpinfer_comm::Communicator>,
    ) -> Result<Self> {
        let mut inject_after = vec![None; c.num_layers];
        for (i, &block) in s2v.audio_inject_layers.iter().enumerate() {
            if let Some(slot) = inject_after.get_mut(block) {
                *slot = Some(i);
            }
        }
        let names = ["proj", "proj_2x", "proj_4x"];
        let marks = w.take("trainable_cond_mask.weight")?;
        Ok(Self {
            audio: S2vAudio::load(w, s2v, comm)?,
            cond_encoder: PatchLinear::load(w, "cond_encoder", c.patch_size)?.with_bias_plus(&marks.get(0)?)?,
            packers: FRAME_PACK
                .iter()
                .zip(names)
                .map(|(&(_, kernel), name)| PatchLinear::load(w, &format!("frame_packer.{name}"), kernel))
                .collect::<Result<_>>()?,
            marks,
            inject_after,
        })
    }

    /// Embeds a clip's conditioning for latents of `grid` patches (`latent_shape`
    /// `[channels, frames, height, width]`).
    pub(crate) fn prepare(
        &self,
        c: &WanConfig,
        patch: &PatchLinear,
        latent_shape: &[usize],
        condition: &S2vCondition,
        zero_time: Tensor,
        dtype: DType,
    ) -> Result<S2vClip> {
        let device = condition.reference.device().clone();
        let [_, frames, height, width] = latent_shape else {
            return Err(shape_error(
                "latents",
                latent_shape,
                "[channels, frames, height, width]",
            ));
        };
        let check_shape = |name: &str, t: &Tensor, channels: usize, wanted_frames: usize| -> Result<()> {
            let ok = t.dims() == [channels, wanted_frames, *height, *width];
            match ok {
                true => Ok(()),
                false => Err(shape_error(
                    name,
                    t.dims(),
                    &format!("[{channels}, {wanted_frames}, {height}, {width}]"),
                )),
            }
        };
        let s2v = c.s2v.as_ref().ok_or_else(|| Error::Shard("not an S2V model".into()))?;
        // The frame packer's coarsest scale patches 8 × 8 latents.
        let [_, coarsest_h, coarsest_w] = FRAME_PACK[FRAME_PACK.len() - 1].1;
        if *height < coarsest_h || *width < coarsest_w {
            return Err(shape_error(
                "latents",
                latent_shape,
                &format!("at least {coarsest_h} × {coarsest_w} latents (S2V's frame packer)"),
            ));
        }
        check_shape("the reference latent", &condition.reference, c.in_channels, 1)?;
        check_shape("the pose latents", &condition.pose, s2v.cond_dim, *frames)?;
        let latent_motion = S2V_MOTION_FRAMES.div_ceil(4);
        if let Some(motion) = &condition.motion {
            check_shape("the motion latents", motion, c.in_channels, latent_motion)?;
        }
        let marks = self.marks.to_dtype(dtype)?;
        let mark = |t: Tensor, i: usize| -> Result<Tensor> { Ok(t.broadcast_add(&marks.get(i)?)?) };
        let (grid, pose) = patches(&condition.pose, c.patch_size, dtype)?;
        let (reference, ref_grid) = patch.forward(&condition.reference, dtype)?;
        let mut condition_tokens = vec![mark(reference, 1)?];
        let mut positions = vec![
            PositionGrid::counting(grid),
            PositionGrid {
                times: vec![REFERENCE_TIME],
                ..PositionGrid::counting(ref_grid)
            },
        ];
        if let Some(motion) = &condition.motion {
            // The packer's scales, nearest first, each read from the frames before the
            // nearer ones': the last 1, the 2 before it, the 16 before those.
            let mut end = latent_motion;
            for (packer, &(count, _)) in self.packers.iter().zip(&FRAME_PACK) {
                let (tokens, (pf, ph, pw)) = packer.forward(&motion.narrow(1, end - count, count)?, dtype)?;
                end -= count;
                condition_tokens.push(mark(tokens, 2)?);
                // `rope_precompute`'s grid for this scale: its patches at times counted back
                // from the clip (−1; −3; −19, −14, −9, −4), their rows and columns sampled
                // from the video's grid of patches.
                let first = (latent_motion - end) as i64;
                positions.push(PositionGrid {
                    times: linspace_trunc(first, first - count as i64 + 1, pf)
                        .into_iter()
                        .map(|t| -t)
                        .collect(),
                    rows: linspace_trunc(0, (height / 2) as i64 - 1, ph),
                    cols: linspace_trunc(0, (width / 2) as i64 - 1, pw),
                });
            }
        }
        let condition_tokens = Tensor::cat(&condition_tokens, 0)?;
        let rope = Tensor::cat(
            &positions
                .iter()
                .map(|g| rope_grid(c.attention_head_dim, g, &device))
                .collect::<Result<Vec<_>>>()?,
            0,
        )?;
        Ok(S2vClip {
            grid,
            pose,
            condition: condition_tokens,
            rope,
            zero_time,
            audio: condition.audio.clone(),
        })
    }
}

fn shape_error(name: &str, found: &[usize], wanted: &str) -> Error {
    Error::Shard(format!("S2V: {name} are {found:?}; the clip needs {wanted}"))
}
