//! H.264 video in MP4 read back to frames (OpenH264's decoder on the track's samples): S2V's
//! pose videos, sampled at the video's rate as S2V's `read_last_n_frames` samples them.

use std::collections::VecDeque;
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

/// The first `count` frames of the video at `path` at `fps` frames a second (see
/// [`VideoReader`]). Fewer where the video ends first.
pub fn read_video_frames(path: &Path, fps: usize, count: usize) -> Result<VideoFrames, VideoReadError> {
    VideoReader::open(path, fps)?.next_frames(count)
}

/// An H.264 video in MP4 read a few frames at a time at `fps` frames a second: every
/// `round(rate / fps)`-th frame of its own (at least every frame), from its first, as S2V reads
/// its pose video (`read_last_n_frames(..., reverse=True)`). Only what the frames handed out
/// need is decoded and held, so a long video is read clip by clip in a clip's memory.
pub struct VideoReader {
    path: PathBuf,
    track: VideoTrack,
    decoder: openh264::decoder::Decoder,
    /// The next sample to decode.
    next: usize,
    /// Pictures decoded so far, kept or not: every `every`-th is kept.
    decoded: usize,
    /// Kept pictures not handed out yet, in display order.
    pending: VecDeque<Vec<u8>>,
    /// The pictures' size, from the first: the stream's own, which the track header's need not
    /// be (it gives the display size, which differs for non-square pixels).
    size: Option<FrameSize>,
    /// The pictures held for reordering were flushed: nothing more comes.
    done: bool,
}

impl VideoReader {
    /// Opens the video at `path` and reads its header: a file that is not an H.264 video in
    /// MP4, or one of absurd size, is refused here, before any frame is decoded.
    pub fn open(path: &Path, fps: usize) -> Result<Self, VideoReadError> {
        let track = VideoTrack::open(path, fps)?;
        // No flush after each sample: a stream with B-frames (libx264's default) holds
        // pictures back to put them in display order, and a forced flush broke their
        // references.
        let config = openh264::decoder::DecoderConfig::new().flush_after_decode(openh264::decoder::Flush::NoFlush);
        let decoder = openh264::decoder::Decoder::with_api_config(openh264::OpenH264API::from_source(), config)
            .map_err(|e| VideoReadError::Decode {
                path: path.to_path_buf(),
                detail: e.to_string(),
            })?;
        Ok(Self {
            path: path.to_path_buf(),
            track,
            decoder,
            next: 0,
            decoded: 0,
            pending: VecDeque::new(),
            size: None,
            done: false,
        })
    }

    /// How many frames the whole video gives at the rate it was opened for, from its header.
    pub fn frames(&self) -> usize {
        self.track.samples.len().div_ceil(self.track.every)
    }

    /// The next `count` frames, fewer where the video ends first (none past its end).
    pub fn next_frames(&mut self, count: usize) -> Result<VideoFrames, VideoReadError> {
        while self.pending.len() < count && !self.done {
            self.decode_next()?;
        }
        let n = count.min(self.pending.len());
        Ok(VideoFrames {
            size: self.size.unwrap_or(self.track.size),
            frames: self.pending.drain(..n).collect(),
        })
    }

    /// Decodes the next sample, or at the end flushes the pictures held for reordering.
    fn decode_next(&mut self) -> Result<(), VideoReadError> {
        let read = |detail: String| VideoReadError::Read {
            path: self.path.clone(),
            detail,
        };
        let decode = |detail: String| VideoReadError::Decode {
            path: self.path.clone(),
            detail,
        };
        let track = &mut self.track;
        let Some(&(begin, end)) = track.samples.get(self.next) else {
            // The pictures still held for reordering, in display order.
            let held = self.decoder.flush_remaining().map_err(|e| decode(e.to_string()))?;
            for yuv in held {
                keep(&yuv, &mut self.size, &mut self.decoded, track.every, &mut self.pending).map_err(decode)?;
            }
            self.done = true;
            return Ok(());
        };
        let (i, samples) = (self.next, track.samples.len());
        if begin > end || end > track.file_len {
            return Err(read(format!(
                "sample {i} of {samples} lies at bytes {begin}..{end}, past the file's {}",
                track.file_len
            )));
        }
        let mut sample = vec![0; (end - begin) as usize];
        track
            .file
            .seek(SeekFrom::Start(begin))
            .and_then(|_| track.file.read_exact(&mut sample))
            .map_err(|e| read(format!("sample {i}: {e}")))?;
        // Annex B: the parameter sets before the first sample, then each sample's
        // length-prefixed units with start codes.
        let start = [0u8, 0, 0, 1];
        let mut stream = Vec::new();
        if i == 0 {
            for set in &track.config.parameter_sets {
                stream.extend(start.iter().chain(set));
            }
        }
        let config = &track.config;
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
        self.next += 1;
        if let Some(yuv) = self.decoder.decode(&stream).map_err(|e| decode(e.to_string()))? {
            keep(&yuv, &mut self.size, &mut self.decoded, track.every, &mut self.pending).map_err(decode)?;
        }
        Ok(())
    }
}

/// Counts a decoded picture and keeps every `every`-th (every picture decodes: the next ones
/// refer to it). A stream whose pictures change size is refused.
fn keep(
    yuv: &openh264::decoder::DecodedYUV,
    size: &mut Option<FrameSize>,
    decoded: &mut usize,
    every: usize,
    pending: &mut VecDeque<Vec<u8>>,
) -> Result<(), String> {
    use openh264::formats::YUVSource;
    let (width, height) = yuv.dimensions();
    let first = *size.get_or_insert(FrameSize { width, height });
    if first != (FrameSize { width, height }) {
        return Err(format!(
            "picture {decoded} is {width}x{height} where the first was {}x{}; give a video of one frame size",
            first.width, first.height
        ));
    }
    if decoded.is_multiple_of(every) {
        let mut rgb = vec![0; width * height * 3];
        yuv.write_rgb8(&mut rgb);
        pending.push_back(rgb);
    }
    *decoded += 1;
    Ok(())
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
