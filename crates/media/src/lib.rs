//! Media files, in-process (no ffmpeg). Out: video frames as H.264 (OpenH264, built from
//! source) in an MP4 container, and 8-bit PNG; frames are packed RGB, 8 bits a channel, row by
//! row. In: speech from WAV, FLAC or MP3 at the rate a speech encoder takes ([`read_speech`]),
//! reference images, and H.264 videos in MP4 ([`read_video_frames`]).
//!
//! ```no_run
//! # fn frames() -> Vec<Vec<u8>> { Vec::new() }
//! let file = std::fs::File::create("video.mp4").expect("create");
//! let size = tpinfer_media::FrameSize { width: 832, height: 480 };
//! let mut video = tpinfer_media::Mp4Writer::new(std::io::BufWriter::new(file), size, 16)?;
//! for rgb in frames() {
//!     video.push(&rgb)?;
//! }
//! video.finish()?;
//! # Ok::<(), tpinfer_media::MediaError>(())
//! ```

mod aac;
mod audio;
mod picture;
mod video_in;

use std::io::{Read, Seek, Write};

use openh264::encoder::{Encoder, EncoderConfig, FrameRate, FrameType, RateControlMode};
use openh264::formats::{RgbSliceU8, YUVBuffer};
use openh264::OpenH264API;

pub use audio::{decode_mono, read_speech, resample, AudioError, Speech, AUDIO_RATES, MAX_AUDIO_SECONDS};
pub use picture::{image_size, pose_pixels, read_reference_image, s2v_frame_size, ImageError};
pub use video_in::{read_video_frames, VideoFrames, VideoReadError, VideoReader};

/// Why a video or image could not be written.
#[derive(Debug, thiserror::Error)]
pub enum MediaError {
    #[error("H.264 needs an even width and height; {width}x{height} is not")]
    OddSize { width: usize, height: usize },
    #[error("a frame of {found} bytes is not {width}x{height} RGB ({expected} bytes)")]
    FrameSize {
        found: usize,
        expected: usize,
        width: usize,
        height: usize,
    },
    #[error("{width}x{height} at {fps} fps is outside what the MP4 writer takes (sides up to 65,535 pixels, 1 to 1,000 fps)")]
    Limits { width: usize, height: usize, fps: u32 },
    #[error("the H.264 encoder: {0}")]
    Encoder(String),
    #[error("the encoder's first frame has no {0}: it cannot start an MP4 track")]
    NoParameterSet(&'static str),
    #[error("the MP4 writer: {0}")]
    Mp4(#[from] mp4::Error),
    #[error("the PNG writer: {0}")]
    Png(#[from] png::EncodingError),
    #[error("an AAC audio track cannot be {0} Hz: AAC takes 8,000 to 96,000 Hz at its standard rates (16,000, 44,100, 48,000, …)")]
    AudioRate(u32),
    #[error("the AAC encoder: {0}")]
    Audio(String),
    #[error("the finished MP4's audio descriptor: {0}")]
    AudioDescriptor(String),
    #[error("reading back the finished MP4: {0}")]
    Io(#[from] std::io::Error),
}

/// A frame's size in pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameSize {
    pub width: usize,
    pub height: usize,
}

impl FrameSize {
    fn rgb_bytes(&self) -> usize {
        self.width * self.height * 3
    }

    fn check(&self, rgb: &[u8]) -> Result<(), MediaError> {
        match rgb.len() == self.rgb_bytes() {
            true => Ok(()),
            false => Err(MediaError::FrameSize {
                found: rgb.len(),
                expected: self.rgb_bytes(),
                width: self.width,
                height: self.height,
            }),
        }
    }
}

/// H.264 NAL unit types the container treats apart.
const NAL_SPS: u8 = 7;
const NAL_PPS: u8 = 8;

/// The track's clock ticks this many times a frame, at any frame rate: its durations are
/// exact.
const TICKS_PER_FRAME: u32 = 1000;

/// Mono samples and their rate, and how the finished file's audio descriptor is corrected.
struct Audio<W> {
    samples: Vec<f32>,
    rate: u32,
    correct: fn(&mut W) -> Result<(), MediaError>,
}

/// An MP4 file with one H.264 video track, written frame by frame, and optionally a mono AAC
/// audio track played from its first frame.
pub struct Mp4Writer<W: Write + Seek> {
    encoder: Encoder,
    size: FrameSize,
    fps: u32,
    /// The container, once the first frame has given the parameter sets it starts with.
    mp4: Option<mp4::Mp4Writer<W>>,
    writer: Option<W>,
    frames: u64,
    /// The audio track to write when the video ends.
    audio: Option<Audio<W>>,
}

impl<W: Write + Seek> Mp4Writer<W> {
    /// A writer of `size` frames at `fps` into `writer`.
    pub fn new(writer: W, size: FrameSize, fps: u32) -> Result<Self, MediaError> {
        let FrameSize { width, height } = size;
        if width == 0 || height == 0 || width % 2 == 1 || height % 2 == 1 {
            return Err(MediaError::OddSize { width, height });
        }
        if width > 65_535 || height > 65_535 || fps == 0 || fps > 1000 {
            return Err(MediaError::Limits { width, height, fps });
        }
        // Constant quality without rate control (OpenH264's quantiser 26 on every frame): a
        // generated video is short, every frame of it was paid for, and none may be skipped
        // to meet a bitrate.
        let config = EncoderConfig::new()
            .max_frame_rate(FrameRate::from_hz(fps as f32))
            .rate_control_mode(RateControlMode::Off)
            .skip_frames(false);
        let encoder = Encoder::with_api_config(OpenH264API::from_source(), config)
            .map_err(|e| MediaError::Encoder(e.to_string()))?;
        Ok(Self {
            encoder,
            size,
            fps,
            mp4: None,
            writer: Some(writer),
            frames: 0,
            audio: None,
        })
    }

    /// Encodes one frame of packed RGB and writes it.
    pub fn push(&mut self, rgb: &[u8]) -> Result<(), MediaError> {
        self.size.check(rgb)?;
        let yuv = YUVBuffer::from_rgb_source(RgbSliceU8::new(rgb, (self.size.width, self.size.height)));
        let stream = self
            .encoder
            .encode(&yuv)
            .map_err(|e| MediaError::Encoder(e.to_string()))?;
        let sync = matches!(stream.frame_type(), FrameType::IDR);
        let (mut sps, mut pps, mut sample) = (None, None, Vec::new());
        for l in 0..stream.num_layers() {
            let Some(layer) = stream.layer(l) else { continue };
            for n in 0..layer.nal_count() {
                let Some(nal) = layer.nal_unit(n).map(without_start_code) else {
                    continue;
                };
                match nal.first().map(|b| b & 0x1f) {
                    Some(NAL_SPS) => sps = Some(nal.to_vec()),
                    Some(NAL_PPS) => pps = Some(nal.to_vec()),
                    Some(_) => {
                        // MP4 stores each NAL unit behind its 4-byte length.
                        sample.extend_from_slice(&(nal.len() as u32).to_be_bytes());
                        sample.extend_from_slice(nal);
                    }
                    None => {}
                }
            }
        }
        if sample.is_empty() {
            // A skipped frame would shorten the video and shift every frame after it.
            return Err(MediaError::Encoder(format!("frame {} came out empty", self.frames)));
        }
        if self.mp4.is_none() {
            self.start(
                sps.ok_or(MediaError::NoParameterSet("SPS"))?,
                pps.ok_or(MediaError::NoParameterSet("PPS"))?,
            )?;
        }
        let sample = mp4::Mp4Sample {
            start_time: self.frames * u64::from(TICKS_PER_FRAME),
            duration: TICKS_PER_FRAME,
            rendering_offset: 0,
            is_sync: sync,
            bytes: bytes::Bytes::from(sample),
        };
        if let Some(mp4) = &mut self.mp4 {
            mp4.write_sample(1, &sample)?;
        }
        self.frames += 1;
        Ok(())
    }

    fn start(&mut self, sps: Vec<u8>, pps: Vec<u8>) -> Result<(), MediaError> {
        let Some(writer) = self.writer.take() else {
            return Ok(());
        };
        let config = mp4::Mp4Config {
            major_brand: "isom".parse()?,
            minor_version: 512,
            compatible_brands: vec!["isom".parse()?, "iso2".parse()?, "avc1".parse()?, "mp41".parse()?],
            timescale: 1000,
        };
        let mut mp4 = mp4::Mp4Writer::write_start(writer, &config)?;
        mp4.add_track(&mp4::TrackConfig {
            track_type: mp4::TrackType::Video,
            timescale: self.fps * TICKS_PER_FRAME,
            language: "und".to_string(),
            media_conf: mp4::MediaConfig::AvcConfig(mp4::AvcConfig {
                width: self.size.width as u16,
                height: self.size.height as u16,
                seq_param_set: sps,
                pic_param_set: pps,
            }),
        })?;
        self.mp4 = Some(mp4);
        Ok(())
    }

    /// Writes the audio track, if any, and the container's index, and returns the writer. A
    /// video of no frames is an error: it would be a file no player opens.
    pub fn finish(self) -> Result<W, MediaError> {
        let Some(mut mp4) = self.mp4 else {
            return Err(MediaError::NoParameterSet("frame at all"));
        };
        if let Some(Audio { samples, rate, .. }) = &self.audio {
            // The video's duration in audio samples.
            let duration = (self.frames * u64::from(*rate)).div_ceil(u64::from(self.fps)) as usize;
            let track = aac::encode(samples, *rate, duration)?;
            mp4.add_track(&mp4::TrackConfig {
                track_type: mp4::TrackType::Audio,
                timescale: *rate,
                language: "und".to_string(),
                media_conf: mp4::MediaConfig::AacConfig(track.config),
            })?;
            for (i, frame) in track.frames.into_iter().enumerate() {
                let sample = mp4::Mp4Sample {
                    start_time: (i * aac::AAC_FRAME) as u64,
                    duration: aac::AAC_FRAME as u32,
                    rendering_offset: 0,
                    is_sync: true,
                    bytes: bytes::Bytes::from(frame),
                };
                mp4.write_sample(2, &sample)?;
            }
        }
        mp4.write_end()?;
        let mut writer = mp4.into_writer();
        if let Some(audio) = &self.audio {
            (audio.correct)(&mut writer)?;
        }
        Ok(writer)
    }
}

impl<W: Read + Write + Seek> Mp4Writer<W> {
    /// Gives the video a mono audio track of `samples` at `sample_rate` Hz (one of AAC's
    /// rates), from its first frame to its last: longer audio is cut there, shorter ends in
    /// silence. Encoded as AAC-LC when the video is finished, which then reads back one field
    /// of the file to correct it (so the writer must read as well as write: a `File`).
    pub fn set_audio(&mut self, samples: Vec<f32>, sample_rate: u32) -> Result<(), MediaError> {
        aac::rate_index(sample_rate)?;
        self.audio = Some(Audio {
            samples,
            rate: sample_rate,
            correct: aac::mark_sl_config_mp4::<W>,
        });
        Ok(())
    }
}

/// A NAL unit without the Annex B start code (`00 00 01` or `00 00 00 01`) the encoder puts
/// before it.
fn without_start_code(nal: &[u8]) -> &[u8] {
    match nal {
        [0, 0, 0, 1, rest @ ..] | [0, 0, 1, rest @ ..] => rest,
        _ => nal,
    }
}

/// Writes one frame of packed RGB as an 8-bit PNG.
pub fn write_png(writer: impl Write, size: FrameSize, rgb: &[u8]) -> Result<(), MediaError> {
    size.check(rgb)?;
    let mut encoder = png::Encoder::new(writer, size.width as u32, size.height as u32);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut png = encoder.write_header()?;
    png.write_image_data(rgb)?;
    png.finish()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Smooth waves moving across the frame: frames that differ, so the encoder writes
    /// P-frames too.
    fn frame(size: FrameSize, t: usize) -> Vec<u8> {
        let mut rgb = Vec::with_capacity(size.rgb_bytes());
        for y in 0..size.height {
            for x in 0..size.width {
                let (x, y, t) = (x as f32, y as f32, t as f32);
                let wave = |a: f32| (127.5 + 100.0 * a.sin()) as u8;
                rgb.extend([wave(x / 9.0 + t / 3.0), wave(y / 7.0), wave((x + y) / 13.0 - t / 4.0)]);
            }
        }
        rgb
    }

    #[test]
    fn an_mp4_holds_every_frame_at_the_rate() {
        let size = FrameSize { width: 64, height: 48 };
        let mut video = Mp4Writer::new(std::io::Cursor::new(Vec::new()), size, 16).expect("writer");
        for t in 0..9 {
            video.push(&frame(size, t)).expect("frame");
        }
        let bytes = video.finish().expect("finish").into_inner();
        let len = bytes.len() as u64;
        let reader = mp4::Mp4Reader::read_header(std::io::Cursor::new(bytes), len).expect("an MP4");
        let track = reader.tracks().get(&1).expect("track 1");
        assert_eq!((track.width(), track.height()), (64, 48));
        assert_eq!(track.sample_count(), 9);
        assert_eq!(track.duration().as_micros(), 9 * 62_500);
        assert!(track.sequence_parameter_set().is_ok_and(|sps| !sps.is_empty()));
    }

    /// The samples decoded again (OpenH264's decoder, from the parameter sets and the
    /// length-prefixed units turned back into a stream) are the frames, within the
    /// quantiser's loss.
    #[test]
    fn the_video_decodes_to_its_frames() {
        let size = FrameSize { width: 96, height: 64 };
        let frames: Vec<Vec<u8>> = (0..5).map(|t| frame(size, t)).collect();
        let mut video = Mp4Writer::new(std::io::Cursor::new(Vec::new()), size, 16).expect("writer");
        for rgb in &frames {
            video.push(rgb).expect("frame");
        }
        let bytes = video.finish().expect("finish").into_inner();
        let len = bytes.len() as u64;
        let mut reader = mp4::Mp4Reader::read_header(std::io::Cursor::new(bytes), len).expect("an MP4");
        let track = reader.tracks().get(&1).expect("track 1");
        let start = [0u8, 0, 0, 1];
        let mut stream = Vec::new();
        for set in [
            track.sequence_parameter_set().expect("sps"),
            track.picture_parameter_set().expect("pps"),
        ] {
            stream.extend(start.iter().chain(set));
        }
        let mut decoder = openh264::decoder::Decoder::new().expect("decoder");
        let mut decoded = Vec::new();
        for id in 1..=5 {
            let sample = reader.read_sample(1, id).expect("read").expect("sample");
            let mut units = &sample.bytes[..];
            while units.len() > 4 {
                let n = u32::from_be_bytes([units[0], units[1], units[2], units[3]]) as usize;
                stream.extend(start.iter().chain(&units[4..4 + n]));
                units = &units[4 + n..];
            }
            if let Some(yuv) = decoder.decode(&stream).expect("decode") {
                let mut rgb = vec![0; size.rgb_bytes()];
                yuv.write_rgb8(&mut rgb);
                decoded.push(rgb);
            }
            stream.clear();
        }
        assert_eq!(decoded.len(), frames.len());
        for (t, (ours, theirs)) in decoded.iter().zip(&frames).enumerate() {
            let mse = ours
                .iter()
                .zip(theirs)
                .map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2))
                .sum::<f64>()
                / ours.len() as f64;
            let psnr = 10.0 * (255.0f64.powi(2) / mse.max(1e-9)).log10();
            assert!(psnr > 30.0, "frame {t}: PSNR {psnr:.1} dB");
        }
    }

    #[test]
    fn bad_frames_are_refused() {
        let size = FrameSize { width: 63, height: 48 };
        assert!(matches!(
            Mp4Writer::new(std::io::Cursor::new(Vec::new()), size, 16),
            Err(MediaError::OddSize { .. })
        ));
        let size = FrameSize { width: 64, height: 48 };
        let mut video = Mp4Writer::new(std::io::Cursor::new(Vec::new()), size, 16).expect("writer");
        assert!(matches!(video.push(&[0; 10]), Err(MediaError::FrameSize { .. })));
        assert!(video.finish().is_err(), "a video of no frames");
        assert!(write_png(std::io::sink(), size, &[0; 3]).is_err());
    }

    /// Speech muxed beside the frames: a sweep starting at 0.5 s in 3 s of audio beside 2 s of
    /// video. Read back by symphonia (an MP4 reader and AAC decoder independent of the writer
    /// and the encoder, and strict about the audio descriptor), the AAC track ends with the
    /// video, carries the sweep within the codec's loss, and lines up with the input sample
    /// for sample: the lag that matches the decoded sound best to the input is 0 (the
    /// encoder's own 2,048 samples of delay, left in, would put it at 2,048).
    #[test]
    fn speech_is_muxed_as_aac_in_sync_with_the_frames() {
        use symphonia::core::audio::SampleBuffer;
        use symphonia::core::codecs::{DecoderOptions, CODEC_TYPE_AAC};
        use symphonia::core::formats::FormatOptions;
        use symphonia::core::io::MediaSourceStream;
        use symphonia::core::meta::MetadataOptions;
        use symphonia::core::probe::Hint;

        let (size, fps, frames, rate) = (FrameSize { width: 64, height: 48 }, 16, 32, 16_000usize);
        // A sweep from 200 Hz up, from 0.5 s: no period, so only the true alignment matches.
        let speech: Vec<f32> = (0..3 * rate)
            .map(|i| {
                let t = i as f64 / rate as f64 - 0.5;
                match t >= 0.0 {
                    true => (0.5 * (2.0 * std::f64::consts::PI * (200.0 * t + 300.0 * t * t)).sin()) as f32,
                    false => 0.0,
                }
            })
            .collect();
        let mut video = Mp4Writer::new(std::io::Cursor::new(Vec::new()), size, fps).expect("writer");
        video.set_audio(speech.clone(), rate as u32).expect("audio");
        for t in 0..frames {
            video.push(&frame(size, t)).expect("frame");
        }
        let bytes = video.finish().expect("finish").into_inner();
        let source = MediaSourceStream::new(Box::new(std::io::Cursor::new(bytes)), Default::default());
        let probed = symphonia::default::get_probe()
            .format(
                &Hint::new(),
                source,
                &FormatOptions::default(),
                &MetadataOptions::default(),
            )
            .expect("an MP4 symphonia reads");
        let mut format = probed.format;
        assert_eq!(format.tracks().len(), 2);
        let track = format
            .tracks()
            .iter()
            .find(|t| t.codec_params.codec == CODEC_TYPE_AAC)
            .expect("an AAC track");
        assert_eq!(track.codec_params.sample_rate, Some(rate as u32));
        // 2 s of video: 32,000 samples, in whole frames of 1,024.
        let wanted = (2 * rate).div_ceil(aac::AAC_FRAME) * aac::AAC_FRAME;
        assert_eq!(track.codec_params.n_frames, Some(wanted as u64));
        let id = track.id;
        let mut decoder = symphonia::default::get_codecs()
            .make(&track.codec_params, &DecoderOptions::default())
            .expect("decoder");
        let mut decoded = Vec::new();
        while let Ok(packet) = format.next_packet() {
            if packet.track_id() != id {
                continue;
            }
            let pcm = decoder.decode(&packet).expect("decode");
            let mut samples = SampleBuffer::<f32>::new(pcm.capacity() as u64, *pcm.spec());
            samples.copy_interleaved_ref(pcm);
            decoded.extend_from_slice(samples.samples());
        }
        assert_eq!(decoded.len(), wanted);
        // Over the sweep, away from its onset, the decoded sound is the input's.
        let (from, to) = (rate, 2 * rate);
        let error: f32 = (from..to).map(|i| (decoded[i] - speech[i]).powi(2)).sum::<f32>().sqrt();
        let norm: f32 = (from..to).map(|i| speech[i].powi(2)).sum::<f32>().sqrt();
        assert!(error / norm < 0.1, "decoded sweep off by {}", error / norm);
        // The onset pins the alignment: the lag that matches best is none.
        let matched = |lag: i64| -> f32 {
            (rate / 4..rate)
                .map(|i| decoded.get((i as i64 + lag) as usize).map_or(0.0, |d| d * speech[i]))
                .sum()
        };
        let best = (-2500..=2500)
            .max_by(|&a, &b| matched(a).total_cmp(&matched(b)))
            .expect("lags");
        assert_eq!(best, 0, "the audio is {best} samples off the video");
    }

    #[test]
    fn audio_at_a_rate_aac_cannot_declare_is_refused() {
        let size = FrameSize { width: 64, height: 48 };
        let mut video = Mp4Writer::new(std::io::Cursor::new(Vec::new()), size, 16).expect("writer");
        let err = video.set_audio(vec![0.0; 100], 22_000).expect_err("22 kHz");
        assert!(err.to_string().contains("22000 Hz"), "{err}");
    }
}
