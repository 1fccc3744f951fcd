//! Mono speech as AAC-LC (Fraunhofer's FDK encoder, built from source by `fdk-aac-sys`) for an
//! MP4's audio track, in sync with its video: the encoder's output starts its delay late, so
//! the track is encoded from that many samples into the speech, and the decoded sound lines
//! up with the first frame sample for sample (its first few milliseconds become the codec's
//! silence). Each AAC frame holds 1024 samples; the track ends with the video.

use fdk_aac::enc::{AudioObjectType, BitRate, ChannelMode, Encoder, EncoderParams, Transport};

use crate::MediaError;

/// Samples per AAC-LC frame.
pub const AAC_FRAME: usize = 1024;

/// Speech needs no more: 48 kbit/s mono is transparent for it at 16 kHz.
const BIT_RATE: u32 = 48_000;

/// The sampling rates an AAC stream can declare, by index (ISO 14496-3).
const RATES: [u32; 13] = [
    96_000, 88_200, 64_000, 48_000, 44_100, 32_000, 24_000, 22_050, 16_000, 12_000, 11_025, 8_000, 7_350,
];

/// An encoded track: its frames and what the container declares of it.
pub(crate) struct AacTrack {
    pub frames: Vec<Vec<u8>>,
    pub config: mp4::AacConfig,
}

/// The index of `rate` among AAC's sampling rates.
pub(crate) fn rate_index(rate: u32) -> Result<u8, MediaError> {
    RATES
        .iter()
        .position(|&r| r == rate)
        .map(|i| i as u8)
        .ok_or(MediaError::AudioRate(rate))
}

/// `samples` at `rate` encoded as the `frames` AAC frames that cover `duration` samples.
pub(crate) fn encode(samples: &[f32], rate: u32, duration: usize) -> Result<AacTrack, MediaError> {
    let index = rate_index(rate)?;
    let encoder_error = |e: fdk_aac::enc::EncoderError| MediaError::Audio(e.to_string());
    let encoder = Encoder::new(EncoderParams {
        bit_rate: BitRate::Cbr(BIT_RATE),
        sample_rate: rate,
        transport: Transport::Raw,
        channels: ChannelMode::Mono,
        audio_object_type: AudioObjectType::Mpeg4LowComplexity,
    })
    .map_err(encoder_error)?;
    let delay = encoder.info().map_err(encoder_error)?.nDelay as usize;
    let wanted = duration.div_ceil(AAC_FRAME);
    // The speech from `delay` samples in, then silence: what the encoder hears.
    let heard = |i: usize| -> i16 {
        let s = samples.get(i + delay).copied().unwrap_or(0.0);
        (s.clamp(-1.0, 1.0) * 32767.0).round() as i16
    };
    let mut frames = Vec::with_capacity(wanted);
    let mut output = vec![0u8; 8192];
    let mut fed = 0;
    // Each call takes a frame of input and may give a frame out; the encoder's look-ahead
    // means some calls give none. A bound keeps a misbehaving encoder from spinning.
    let most_calls = wanted + delay / AAC_FRAME + 16;
    for _ in 0..most_calls {
        if frames.len() == wanted {
            break;
        }
        let input: Vec<i16> = (fed..fed + AAC_FRAME).map(heard).collect();
        let info = encoder.encode(&input, &mut output).map_err(encoder_error)?;
        fed += info.input_consumed;
        if info.output_size > 0 {
            frames.push(output[..info.output_size].to_vec());
        }
    }
    if frames.len() != wanted {
        return Err(MediaError::Audio(format!(
            "the AAC encoder gave {} of {wanted} frames",
            frames.len()
        )));
    }
    let config = mp4::AacConfig {
        bitrate: BIT_RATE,
        profile: mp4::AudioObjectType::AacLowComplexity,
        freq_index: mp4::SampleFreqIndex::try_from(index)?,
        chan_conf: mp4::ChannelConfig::Mono,
    };
    Ok(AacTrack { frames, config })
}
