//! S2V's resampling of the encoder's states to video frames (`wan/modules/s2v/audio_encoder.py`
//! of the wan22 wheel): linear interpolation from 50 to 30 states a second, then one state per
//! video frame at the video's rate, in whole clips, the frames past the audio's end zero.

use candle_core::{DType, Device, Tensor};
use tpinfer_layers::{Error, Result};

/// The rate of the audio the encoder takes, in samples a second.
pub const SAMPLE_RATE: u32 = 16_000;

/// The encoder's states a second: 16 kHz audio over its convolutions' 320-sample hop.
pub const STATES_PER_SECOND: usize = 50;

/// The rate S2V first interpolates the states to (its `AudioEncoder.video_rate`).
const INTERPOLATED_PER_SECOND: usize = 30;

/// The fewest encoder states that make a video frame: [`per_video_frame`] keeps ⌊T · 30 / 50⌋
/// interpolated states of T.
pub const STATES_FOR_A_FRAME: usize = STATES_PER_SECOND.div_ceil(INTERPOLATED_PER_SECOND);

/// The audio features of every video frame of a whole number of clips.
#[derive(Debug, Clone)]
pub struct VideoFrameFeatures {
    /// `[clips · clip_frames, layers + 1, hidden]`, f32 on the CPU: frame `f` of clip `c` is
    /// row `c · clip_frames + f`.
    pub features: Tensor,
    /// The clips the audio fills: the last may end in silence (zero rows).
    pub clips: usize,
}

/// The per-video-frame features of the hidden states `states` `[layers + 1, frames, hidden]`
/// (50 a second) for a video of `fps` frames a second cut into clips of `clip_frames`, as
/// S2V's `get_audio_embed_bucket_fps` gives them with `m = 0` (each frame takes the one
/// interpolated state nearest its time).
pub fn per_video_frame(states: &Tensor, fps: usize, clip_frames: usize) -> Result<VideoFrameFeatures> {
    let (layers, frames, width) = states.dims3()?;
    if fps == 0 || clip_frames == 0 {
        return Err(Error::Shard(format!(
            "audio features: {fps} frames a second in clips of {clip_frames}; both must be at least 1"
        )));
    }
    // `linear_interpolation`: int(T / 50 · 30) states, the ends aligned.
    let interpolated = (frames as f64 / STATES_PER_SECOND as f64 * INTERPOLATED_PER_SECOND as f64) as usize;
    if interpolated == 0 {
        return Err(Error::Shard(format!(
            "audio features: {frames} encoder states ({:.0} ms) make no video frame; give at least {} ms of audio",
            1000.0 * frames as f64 / STATES_PER_SECOND as f64,
            1000 / INTERPOLATED_PER_SECOND
        )));
    }
    let values: Vec<f32> = states
        .to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1()?;
    let row = |l: usize, t: usize| &values[(l * frames + t) * width..(l * frames + t + 1) * width];
    // `F.interpolate(mode='linear', align_corners=True)`: PyTorch's f32 source positions.
    let scale = match interpolated {
        1 => 0.0,
        n => (frames - 1) as f32 / (n - 1) as f32,
    };
    let interpolate = |l: usize, j: usize, out: &mut [f32]| {
        let source = scale * j as f32;
        let i0 = (source as usize).min(frames - 1);
        let i1 = if i0 + 1 < frames { i0 + 1 } else { i0 };
        let w1 = source - i0 as f32;
        for ((o, &a), &b) in out.iter_mut().zip(row(l, i0)).zip(row(l, i1)) {
            *o = (1.0 - w1) * a + w1 * b;
        }
    };
    // `get_audio_embed_bucket_fps`: whole clips, each frame's time at the interpolated rate
    // rounded half to even (numpy's `round`), past the audio zero.
    let per_frame = INTERPOLATED_PER_SECOND as f64 / fps as f64;
    let clips = (interpolated as f64 / (clip_frames as f64 * per_frame)) as usize + 1;
    let total = clips * clip_frames;
    let step = (total as f64 / fps as f64) / total as f64;
    let mut features = vec![0f32; total * layers * width];
    for (f, frame) in features.chunks_exact_mut(layers * width).enumerate() {
        let source = (f as f64 * step * INTERPOLATED_PER_SECOND as f64).round_ties_even() as usize;
        if source < interpolated {
            for (l, out) in frame.chunks_exact_mut(width).enumerate() {
                interpolate(l, source, out);
            }
        }
    }
    Ok(VideoFrameFeatures {
        features: Tensor::from_vec(features, (total, layers, width), &Device::Cpu)?,
        clips,
    })
}
