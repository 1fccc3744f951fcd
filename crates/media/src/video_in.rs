//! H.264 video in MP4 read back to frames (OpenH264's decoder on the track's samples): S2V's
//! pose videos, sampled at the video's rate as S2V's `read_last_n_frames` samples them.

use std::path::{Path, PathBuf};

use crate::FrameSize;

/// Why a video could not be read.
#[derive(Debug, thiserror::Error)]
pub enum VideoReadError {
    #[error("cannot read {path} as an MP4 video: {detail}; give an H.264 video in an MP4 file")]
    Read { path: PathBuf, detail: String },
    #[error("{path} holds no H.264 video track; give an H.264 video in an MP4 file")]
    NoVideo { path: PathBuf },
    #[error("{path}: decoding its H.264 video: {detail}")]
    Decode { path: PathBuf, detail: String },
}

/// Frames of a video, packed RGB, 8 bits a channel.
#[derive(Debug, Clone)]
pub struct VideoFrames {
    pub size: FrameSize,
    pub frames: Vec<Vec<u8>>,
}

/// The sides a video may have: past this, a file is refused before its frames are decoded.
const MAX_SIDE: usize = 8_192;

/// The first `count` frames of the video at `path` at `fps` frames a second: every
/// `round(rate / fps)`-th frame of its own (at least every frame), as S2V reads its pose video
/// (`read_last_n_frames(..., reverse=True)`, which starts at its first frame). Fewer where the
/// video ends first.
pub fn read_video_frames(path: &Path, fps: usize, count: usize) -> Result<VideoFrames, VideoReadError> {
    let read = |detail: String| VideoReadError::Read {
        path: path.to_path_buf(),
        detail,
    };
    let file = std::fs::File::open(path).map_err(|e| read(e.to_string()))?;
    let size = file.metadata().map_err(|e| read(e.to_string()))?.len();
    let mut reader =
        mp4::Mp4Reader::read_header(std::io::BufReader::new(file), size).map_err(|e| read(e.to_string()))?;
    let (id, track) = reader
        .tracks()
        .iter()
        .find(|(_, t)| t.media_type().is_ok_and(|m| m == mp4::MediaType::H264))
        .map(|(&id, t)| (id, t))
        .ok_or_else(|| VideoReadError::NoVideo {
            path: path.to_path_buf(),
        })?;
    let frame = FrameSize {
        width: track.width() as usize,
        height: track.height() as usize,
    };
    if frame.width == 0 || frame.height == 0 || frame.width > MAX_SIDE || frame.height > MAX_SIDE {
        return Err(read(format!(
            "its frames are {}x{}; tpinfer reads sides of 1 to {MAX_SIDE} pixels",
            frame.width, frame.height
        )));
    }
    let samples = track.sample_count();
    let rate = track.frame_rate();
    let every = match rate.is_finite() && rate > 0.0 {
        true => ((rate / fps.max(1) as f64).round() as usize).max(1),
        false => 1,
    };
    // Annex B: the parameter sets, then each sample's length-prefixed units with start codes.
    let start = [0u8, 0, 0, 1];
    let mut stream = Vec::new();
    for set in [track.sequence_parameter_set(), track.picture_parameter_set()] {
        let set = set.map_err(|e| read(e.to_string()))?;
        stream.extend(start.iter().chain(set));
    }
    let decode = |detail: String| VideoReadError::Decode {
        path: path.to_path_buf(),
        detail,
    };
    // No flush after each sample: a stream with B-frames (libx264's default) holds pictures
    // back to put them in display order, and a forced flush broke their references.
    let config = openh264::decoder::DecoderConfig::new().flush_after_decode(openh264::decoder::Flush::NoFlush);
    let mut decoder = openh264::decoder::Decoder::with_api_config(openh264::OpenH264API::from_source(), config)
        .map_err(|e| decode(e.to_string()))?;
    let mut kept = Kept {
        frames: Vec::new(),
        decoded: 0,
        every,
        count,
        size: frame,
    };
    for sample_id in 1..=samples {
        if kept.frames.len() >= count {
            break;
        }
        let sample = reader
            .read_sample(id, sample_id)
            .map_err(|e| read(e.to_string()))?
            .ok_or_else(|| read(format!("sample {sample_id} of {samples} is missing")))?;
        let mut units = &sample.bytes[..];
        while units.len() >= 4 {
            let n = u32::from_be_bytes([units[0], units[1], units[2], units[3]]) as usize;
            let unit = units
                .get(4..4 + n)
                .ok_or_else(|| read(format!("sample {sample_id} has a unit past its end")))?;
            stream.extend(start.iter().chain(unit));
            units = &units[4 + n..];
        }
        if let Some(yuv) = decoder.decode(&stream).map_err(|e| decode(e.to_string()))? {
            kept.push(&yuv);
        }
        stream.clear();
    }
    // The pictures still held for reordering, in display order.
    for yuv in decoder.flush_remaining().map_err(|e| decode(e.to_string()))? {
        kept.push(&yuv);
    }
    Ok(VideoFrames {
        size: frame,
        frames: kept.frames,
    })
}

/// The frames kept of those decoded, in display order: every `every`-th, up to `count`.
struct Kept {
    frames: Vec<Vec<u8>>,
    decoded: usize,
    every: usize,
    count: usize,
    size: FrameSize,
}

impl Kept {
    /// Every picture decodes (the next ones refer to it); every `every`-th is kept.
    fn push(&mut self, yuv: &openh264::decoder::DecodedYUV) {
        if self.decoded.is_multiple_of(self.every) && self.frames.len() < self.count {
            let mut rgb = vec![0; self.size.width * self.size.height * 3];
            yuv.write_rgb8(&mut rgb);
            self.frames.push(rgb);
        }
        self.decoded += 1;
    }
}
