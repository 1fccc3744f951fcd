//! Speech in: a WAV, FLAC or MP3 file decoded (symphonia), mixed down to mono and resampled
//! (rubato's FFT resampler) to the rate a speech encoder takes, as `librosa.load(path,
//! sr=rate)` gives it to S2V's wav2vec2.

use std::fs::File;
use std::path::Path;

use rubato::{FftFixedInOut, Resampler};
use symphonia::core::audio::SampleBuffer;
use symphonia::core::codecs::{
    CodecParameters, DecoderOptions, CODEC_TYPE_MP1, CODEC_TYPE_MP2, CODEC_TYPE_MP3, CODEC_TYPE_NULL,
    CODEC_TYPE_PCM_F32BE, CODEC_TYPE_PCM_F32LE, CODEC_TYPE_PCM_F64BE, CODEC_TYPE_PCM_F64LE,
};
use symphonia::core::errors::Error as SymphoniaError;
use symphonia::core::formats::FormatOptions;
use symphonia::core::io::MediaSourceStream;
use symphonia::core::meta::MetadataOptions;
use symphonia::core::probe::Hint;

/// The longest audio tpinfer decodes: an hour, so that a wrong file (or a header that lies)
/// cannot fill memory before anything is checked.
pub const MAX_AUDIO_SECONDS: u64 = 3600;

/// The sample rates tpinfer decodes: telephone speech to the fastest studio rates. A header
/// past them is corrupt, and would size the resampler's FFT from a bogus rate.
pub const AUDIO_RATES: std::ops::RangeInclusive<u32> = 1_000..=768_000;

/// Why an audio file could not be read. Every message names the file.
#[derive(Debug, thiserror::Error)]
pub enum AudioError {
    #[error("cannot open {path}: {source}")]
    Open {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not audio tpinfer can read ({detail}); give a WAV, FLAC or MP3 file")]
    Format { path: String, detail: String },
    #[error("{path} has no audio track; give a WAV, FLAC or MP3 file with one")]
    NoTrack { path: String },
    #[error("{path}: the audio track does not say its sample rate")]
    NoSampleRate { path: String },
    #[error(
        "{path} says its sample rate is {rate} Hz; tpinfer reads {} to {} Hz, so the file is \
         corrupt or not speech",
        AUDIO_RATES.start(),
        AUDIO_RATES.end()
    )]
    SampleRate { path: String, rate: u32 },
    #[error("{path} is corrupt: {detail}")]
    Corrupt { path: String, detail: String },
    #[error(
        "{path} is cut short: its header declares {declared} samples ({:.2} s), the file holds {held} ({:.2} s); \
         give the whole file",
        *declared as f64 / *rate as f64,
        *held as f64 / *rate as f64
    )]
    Truncated {
        path: String,
        declared: u64,
        held: u64,
        rate: u32,
    },
    #[error("{path} holds no samples: it is silent for zero seconds")]
    Empty { path: String },
    #[error("{path} is longer than {MAX_AUDIO_SECONDS} s; cut it into parts of an hour or less")]
    TooLong { path: String },
    #[error("resampling {path} from {from} Hz to {to} Hz: {detail}")]
    Resample {
        path: String,
        from: u32,
        to: u32,
        detail: String,
    },
}

/// Mono audio: samples in [-1, 1] at `sample_rate` Hz.
#[derive(Debug, Clone, PartialEq)]
pub struct Speech {
    pub samples: Vec<f32>,
    pub sample_rate: u32,
}

impl Speech {
    /// Its length in seconds.
    pub fn seconds(&self) -> f64 {
        self.samples.len() as f64 / self.sample_rate as f64
    }
}

/// Decodes the audio file at `path` (WAV, FLAC or MP3; the contents decide, not the
/// extension), averages its channels, and resamples it to `sample_rate` Hz.
pub fn read_speech(path: &Path, sample_rate: u32) -> Result<Speech, AudioError> {
    let decoded = decode_mono(path)?;
    let samples =
        resample(&decoded.samples, decoded.sample_rate, sample_rate).map_err(|detail| AudioError::Resample {
            path: path.display().to_string(),
            from: decoded.sample_rate,
            to: sample_rate,
            detail,
        })?;
    Ok(Speech { samples, sample_rate })
}

/// The file's audio at its own rate, its channels averaged.
pub fn decode_mono(path: &Path) -> Result<Speech, AudioError> {
    let name = || path.display().to_string();
    let file = File::open(path).map_err(|source| AudioError::Open { path: name(), source })?;
    let stream = MediaSourceStream::new(Box::new(file), Default::default());
    let mut hint = Hint::new();
    if let Some(ext) = path.extension().and_then(|e| e.to_str()) {
        hint.with_extension(ext);
    }
    // An MP3 encoder pads the stream at both ends (LAME's header says by how much);
    // libsndfile, under librosa.load, trims both, and so must the samples the frames follow.
    let gapless = FormatOptions {
        enable_gapless: true,
        ..Default::default()
    };
    let probed = symphonia::default::get_probe()
        .format(&hint, stream, &gapless, &MetadataOptions::default())
        .map_err(|e| AudioError::Format {
            path: name(),
            detail: e.to_string(),
        })?;
    let mut format = probed.format;
    let track = format
        .tracks()
        .iter()
        .find(|t| t.codec_params.codec != CODEC_TYPE_NULL)
        .ok_or_else(|| AudioError::NoTrack { path: name() })?;
    let (track_id, params) = (track.id, track.codec_params.clone());
    let rate = params
        .sample_rate
        .filter(|&r| r > 0)
        .ok_or_else(|| AudioError::NoSampleRate { path: name() })?;
    if !AUDIO_RATES.contains(&rate) {
        return Err(AudioError::SampleRate { path: name(), rate });
    }
    let limit = MAX_AUDIO_SECONDS * rate as u64;
    let declared = declared_frames(&params);
    if declared.is_some_and(|n| n > limit) {
        return Err(AudioError::TooLong { path: name() });
    }
    let mut decoder = symphonia::default::get_codecs()
        .make(&params, &DecoderOptions::default())
        .map_err(|e| AudioError::Format {
            path: name(),
            detail: e.to_string(),
        })?;
    let corrupt = |e: SymphoniaError| AudioError::Corrupt {
        path: name(),
        detail: e.to_string(),
    };
    let mut samples = Vec::new();
    let mut buffer: Option<SampleBuffer<f32>> = None;
    loop {
        let packet = match format.next_packet() {
            Ok(p) => p,
            // The end of the stream.
            Err(SymphoniaError::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(corrupt(e)),
        };
        if packet.track_id() != track_id {
            continue;
        }
        let audio = decoder.decode(&packet).map_err(corrupt)?;
        let spec = *audio.spec();
        let channels = spec.channels.count().max(1);
        let frames = audio.capacity();
        let buf = match &mut buffer {
            Some(b) if b.capacity() >= frames * channels => b,
            _ => buffer.insert(SampleBuffer::new(frames as u64, spec)),
        };
        buf.copy_interleaved_ref(audio);
        samples.extend(
            buf.samples()
                .chunks_exact(channels)
                .map(|frame| frame.iter().sum::<f32>() / channels as f32),
        );
        if samples.len() as u64 > limit {
            return Err(AudioError::TooLong { path: name() });
        }
    }
    if samples.is_empty() {
        return Err(AudioError::Empty { path: name() });
    }
    if let Some(declared) = declared.filter(|&n| exact_length(&params) && (samples.len() as u64) < n) {
        return Err(AudioError::Truncated {
            path: name(),
            declared,
            held: samples.len() as u64,
            rate,
        });
    }
    Ok(Speech {
        samples,
        sample_rate: rate,
    })
}

/// The frames (samples of every channel) `params` says the track holds, where it says: not a
/// WAV written to a pipe, whose data chunk declares the most bytes one can hold (0xFFFFFFFF:
/// its writer, ffmpeg for one, could not go back to fill in the length).
fn declared_frames(params: &CodecParameters) -> Option<u64> {
    let sample_bytes = match params.codec {
        CODEC_TYPE_PCM_F64LE | CODEC_TYPE_PCM_F64BE => 8,
        CODEC_TYPE_PCM_F32LE | CODEC_TYPE_PCM_F32BE => 4,
        _ => params.bits_per_coded_sample.map_or(1, |b| u64::from(b).div_ceil(8)),
    };
    let frame_bytes = params.channels.map_or(1, |c| c.count() as u64) * sample_bytes;
    // The placeholder's frame count is the only one within a frame of a chunk's 4 GiB.
    params
        .n_frames
        .filter(|&n| is_mpeg(params) || n.saturating_add(1).saturating_mul(frame_bytes) <= u64::from(u32::MAX))
}

/// Whether `params`' declared length is a count, not an estimate: a WAV's data chunk and a
/// FLAC's STREAMINFO count their samples, where an MP3 without a Xing header is estimated
/// from its bitrate.
fn exact_length(params: &CodecParameters) -> bool {
    !is_mpeg(params)
}

fn is_mpeg(params: &CodecParameters) -> bool {
    matches!(params.codec, CODEC_TYPE_MP1 | CODEC_TYPE_MP2 | CODEC_TYPE_MP3)
}

/// `samples` at `from` Hz resampled to `to` Hz: ⌈n · to / from⌉ samples, as librosa returns,
/// aligned with the input (the resampler's delay trimmed off).
pub fn resample(samples: &[f32], from: u32, to: u32) -> Result<Vec<f32>, String> {
    if from == to {
        return Ok(samples.to_vec());
    }
    if let Some(rate) = [from, to].into_iter().find(|r| !AUDIO_RATES.contains(r)) {
        return Err(format!(
            "{rate} Hz is not a rate tpinfer resamples ({} to {} Hz)",
            AUDIO_RATES.start(),
            AUDIO_RATES.end()
        ));
    }
    let target = (samples.len() as u64 * to as u64).div_ceil(from as u64) as usize;
    // The FFT resampler's filter is centred on input sample ⌊n/2⌋ of its n-sample chunk, and
    // it reports a delay of half its output chunk: the two agree only when n is even (else
    // the output leads by half an input sample). Its chunks are whole multiples of
    // `from / gcd`; an even number of them, about 1,024 samples, makes n even.
    let (from, to) = (from as usize, to as usize);
    let unit = from / gcd(from, to);
    let chunk = 2 * 1024usize.div_ceil(2 * unit) * unit;
    let mut resampler = FftFixedInOut::<f32>::new(from, to, chunk, 1).map_err(|e| e.to_string())?;
    let delay = resampler.output_delay();
    let mut out = Vec::with_capacity(target + delay + resampler.output_frames_max());
    let mut rest = samples;
    while out.len() < delay + target {
        let need = resampler.input_frames_next();
        let chunk = match rest.len() >= need {
            true => {
                let (chunk, tail) = rest.split_at(need);
                rest = tail;
                resampler.process(&[chunk], None)
            }
            // The last part, zero-padded.
            false if !rest.is_empty() => {
                let tail = std::mem::take(&mut rest);
                resampler.process_partial(Some(&[tail]), None)
            }
            // Zeros until the delayed samples are out.
            false => resampler.process_partial(None::<&[&[f32]]>, None),
        }
        .map_err(|e| e.to_string())?;
        out.extend_from_slice(chunk.first().map(Vec::as_slice).unwrap_or_default());
    }
    Ok(out[delay..delay + target].to_vec())
}

fn gcd(a: usize, b: usize) -> usize {
    match b {
        0 => a,
        _ => gcd(b, a % b),
    }
}
