//! H.264 video in MP4 read back to frames (OpenH264's decoder on the track's samples): S2V's
//! pose videos, sampled at the video's rate as S2V's `read_last_n_frames` samples them.

use std::io::{Read, Seek, SeekFrom};
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

/// What a video's header says: its frames' size (the display size, which a stream of
/// non-square pixels decodes to another) and how many frames [`read_video_frames`] keeps of
/// it at the rate asked for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VideoInfo {
    pub size: FrameSize,
    pub frames: usize,
}

/// [`VideoInfo`] of the video at `path` read at `fps` frames a second, from its header alone:
/// to size what reading it takes before its frames are decoded.
pub fn video_info(path: &Path, fps: usize) -> Result<VideoInfo, VideoReadError> {
    let track = VideoTrack::open(path, fps)?;
    Ok(VideoInfo {
        size: track.size,
        frames: track.samples.len().div_ceil(track.every),
    })
}

/// An MP4 file's H.264 track, its header read.
struct VideoTrack {
    file: std::fs::File,
    file_len: u64,
    size: FrameSize,
    config: AvcConfig,
    /// Each sample's bytes in the file, in decoding order.
    samples: Vec<(u64, u64)>,
    /// Every `every`-th frame is kept.
    every: usize,
}

impl VideoTrack {
    fn open(path: &Path, fps: usize) -> Result<Self, VideoReadError> {
        let read = |detail: String| VideoReadError::Read {
            path: path.to_path_buf(),
            detail,
        };
        let mut file = std::fs::File::open(path).map_err(|e| read(e.to_string()))?;
        let file_len = file.metadata().map_err(|e| read(e.to_string()))?.len();
        let context = mp4parse::read_mp4(&mut std::io::BufReader::new(&mut file)).map_err(|e| read(e.to_string()))?;
        let (track, entry, config) = context
            .tracks
            .iter()
            .filter(|t| t.track_type == mp4parse::TrackType::Video)
            .find_map(|t| match t.stsd.as_ref()?.descriptions.first()? {
                mp4parse::SampleEntry::Video(v) if v.codec_type == mp4parse::CodecType::H264 => {
                    match &v.codec_specific {
                        mp4parse::VideoCodecSpecific::AVCConfig(config) => Some((t, v, config)),
                        _ => None,
                    }
                }
                _ => None,
            })
            .ok_or_else(|| VideoReadError::NoVideo {
                path: path.to_path_buf(),
            })?;
        let size = FrameSize {
            width: entry.width as usize,
            height: entry.height as usize,
        };
        if size.width == 0 || size.height == 0 || size.width > MAX_SIDE || size.height > MAX_SIDE {
            return Err(read(format!(
                "its frames are {}x{}; tpinfer reads sides of 1 to {MAX_SIDE} pixels",
                size.width, size.height
            )));
        }
        let config = AvcConfig::parse(config).map_err(|detail| read(format!("its avcC box: {detail}")))?;
        let samples = mp4parse::unstable::create_sample_table(track, 0.into())
            .ok_or_else(|| read("its video track's sample table is incomplete".into()))?;
        let every = match frame_rate(track, samples.len()) {
            rate if rate > 0.0 => ((rate / fps.max(1) as f64).round() as usize).max(1),
            _ => 1,
        };
        Ok(Self {
            file,
            file_len,
            size,
            config,
            samples: samples.iter().map(|s| (s.start_offset.0, s.end_offset.0)).collect(),
            every,
        })
    }
}

/// The first `count` frames of the video at `path` at `fps` frames a second: every
/// `round(rate / fps)`-th frame of its own (at least every frame), as S2V reads its pose video
/// (`read_last_n_frames(..., reverse=True)`, which starts at its first frame). Fewer where the
/// video ends first.
pub fn read_video_frames(path: &Path, fps: usize, count: usize) -> Result<VideoFrames, VideoReadError> {
    let read = |detail: String| VideoReadError::Read {
        path: path.to_path_buf(),
        detail,
    };
    let VideoTrack {
        mut file,
        file_len,
        size: frame,
        config,
        samples,
        every,
    } = VideoTrack::open(path, fps)?;
    // Annex B: the parameter sets, then each sample's length-prefixed units with start codes.
    let start = [0u8, 0, 0, 1];
    let mut stream = Vec::new();
    for set in &config.parameter_sets {
        stream.extend(start.iter().chain(set));
    }
    let decode = |detail: String| VideoReadError::Decode {
        path: path.to_path_buf(),
        detail,
    };
    // No flush after each sample: a stream with B-frames (libx264's default) holds pictures
    // back to put them in display order, and a forced flush broke their references.
    let decoder_config = openh264::decoder::DecoderConfig::new().flush_after_decode(openh264::decoder::Flush::NoFlush);
    let mut decoder = openh264::decoder::Decoder::with_api_config(openh264::OpenH264API::from_source(), decoder_config)
        .map_err(|e| decode(e.to_string()))?;
    let mut kept = Kept {
        frames: Vec::new(),
        decoded: 0,
        every,
        count,
        size: None,
    };
    let mut sample = Vec::new();
    for (i, &(begin, end)) in samples.iter().enumerate() {
        if kept.frames.len() >= count {
            break;
        }
        if begin > end || end > file_len {
            return Err(read(format!(
                "sample {i} of {} lies at bytes {begin}..{end}, past the file's {file_len}",
                samples.len()
            )));
        }
        sample.resize((end - begin) as usize, 0);
        file.seek(SeekFrom::Start(begin))
            .and_then(|_| file.read_exact(&mut sample))
            .map_err(|e| read(format!("sample {i}: {e}")))?;
        let mut units = &sample[..];
        while !units.is_empty() {
            let n = config
                .unit_length(units)
                .ok_or_else(|| read(format!("sample {i} has a unit past its end")))?;
            let unit = units
                .get(config.length_size..config.length_size + n)
                .ok_or_else(|| read(format!("sample {i} has a unit past its end")))?;
            stream.extend(start.iter().chain(unit));
            units = &units[config.length_size + n..];
        }
        if let Some(yuv) = decoder.decode(&stream).map_err(|e| decode(e.to_string()))? {
            kept.push(&yuv).map_err(decode)?;
        }
        stream.clear();
    }
    // The pictures still held for reordering, in display order.
    for yuv in decoder.flush_remaining().map_err(|e| decode(e.to_string()))? {
        kept.push(&yuv).map_err(decode)?;
    }
    Ok(VideoFrames {
        size: kept.size.unwrap_or(frame),
        frames: kept.frames,
    })
}

/// Frames a second of the track: its samples over its duration in whole milliseconds,
/// truncated to a whole rate, as the mp4 crate's reader gave it when pose videos were checked
/// against the wheel's (within 1/255). 0 where the duration is unknown or zero.
fn frame_rate(track: &mp4parse::Track, samples: usize) -> f64 {
    let (Some(duration), Some(timescale)) = (&track.duration, &track.timescale) else {
        return 0.0;
    };
    let millis = match timescale.0 {
        0 => None,
        scale => duration.0.checked_mul(1_000_000).map(|us| us / scale / 1000),
    };
    match millis {
        Some(ms) if ms > 0 => (samples as u64).saturating_mul(1000).checked_div(ms).unwrap_or(0) as f64,
        _ => 0.0,
    }
}

/// An avcC box (ISO 14496-15): the parameter sets and the size of each unit's length prefix.
struct AvcConfig {
    parameter_sets: Vec<Vec<u8>>,
    length_size: usize,
}

impl AvcConfig {
    fn parse(bytes: &[u8]) -> Result<Self, String> {
        let short = || "it ends early".to_string();
        let header = bytes.get(..6).ok_or_else(short)?;
        let length_size = (header[4] & 3) as usize + 1;
        if length_size == 3 {
            return Err("it declares 3-byte unit lengths, which H.264 does not have".into());
        }
        let mut at = 5;
        let mut parameter_sets = Vec::new();
        // Sequence parameter sets (a 5-bit count), then picture parameter sets (8 bits).
        for mask in [0x1f, 0xff] {
            let n = (*bytes.get(at).ok_or_else(short)? & mask) as usize;
            at += 1;
            for _ in 0..n {
                let len = bytes.get(at..at + 2).ok_or_else(short)?;
                let len = u16::from_be_bytes([len[0], len[1]]) as usize;
                parameter_sets.push(bytes.get(at + 2..at + 2 + len).ok_or_else(short)?.to_vec());
                at += 2 + len;
            }
        }
        Ok(Self {
            parameter_sets,
            length_size,
        })
    }

    /// The length of the unit that `units` begins with, from its big-endian prefix.
    fn unit_length(&self, units: &[u8]) -> Option<usize> {
        let prefix = units.get(..self.length_size)?;
        Some(prefix.iter().fold(0usize, |n, &b| n << 8 | b as usize))
    }
}

/// The frames kept of those decoded, in display order: every `every`-th, up to `count`.
struct Kept {
    frames: Vec<Vec<u8>>,
    decoded: usize,
    every: usize,
    count: usize,
    /// The pictures' size, from the first: the stream's own, which the track header's need
    /// not be (it gives the display size, which differs for non-square pixels).
    size: Option<FrameSize>,
}

impl Kept {
    /// Every picture decodes (the next ones refer to it); every `every`-th is kept. A stream
    /// whose pictures change size is refused.
    fn push(&mut self, yuv: &openh264::decoder::DecodedYUV) -> Result<(), String> {
        use openh264::formats::YUVSource;
        let (width, height) = yuv.dimensions();
        let size = *self.size.get_or_insert(FrameSize { width, height });
        if size != (FrameSize { width, height }) {
            return Err(format!(
                "picture {} is {width}x{height} where the first was {}x{}; give a video of one frame size",
                self.decoded, size.width, size.height
            ));
        }
        if self.decoded.is_multiple_of(self.every) && self.frames.len() < self.count {
            let mut rgb = vec![0; width * height * 3];
            yuv.write_rgb8(&mut rgb);
            self.frames.push(rgb);
        }
        self.decoded += 1;
        Ok(())
    }
}
