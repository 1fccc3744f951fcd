//! Mono speech as AAC-LC (Fraunhofer's FDK encoder, built from source by `fdk-aac-sys`) for an
//! MP4's audio track, in sync with its video: the encoder's output starts its delay late, so
//! the track is encoded from that many samples into the speech, and the decoded sound lines
//! up with the first frame sample for sample (its first few milliseconds become the codec's
//! silence). Each AAC frame holds 1024 samples; the track ends with the video.

use std::io::{Read, Seek, SeekFrom, Write};

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

/// The SL descriptor as an MP4 file must hold it (ISO 14496-14): one byte, `predefined` 2.
const SL_CONFIG_MP4: [u8; 3] = [0x06, 0x01, 0x02];
/// As the mp4 crate writes it: a length of 0, then a `predefined` of 0 (custom) that the
/// length leaves out, which strict readers (symphonia's) refuse.
const SL_CONFIG_WRITTEN: [u8; 3] = [0x06, 0x00, 0x00];

/// The container index is read back whole: a generated video's is far smaller.
const MAX_INDEX_BYTES: u64 = 64 << 20;

/// Corrects the finished file's audio descriptor, written as [`SL_CONFIG_WRITTEN`], to
/// [`SL_CONFIG_MP4`] in place (the ES descriptor's length already counts its three bytes):
/// finds the top-level `moov` box, the `esds` box in it, and in that the SL descriptor after
/// the ES descriptor's decoder configuration.
pub(crate) fn mark_sl_config_mp4<W: Read + Write + Seek>(file: &mut W) -> Result<(), MediaError> {
    let fail = |what: &str| MediaError::AudioDescriptor(what.to_string());
    let end = file.seek(SeekFrom::End(0))?;
    // The top-level boxes, to the index.
    let mut at = 0u64;
    let (moov_at, moov_len) = loop {
        if at + 8 > end {
            return Err(fail("no `moov` box"));
        }
        file.seek(SeekFrom::Start(at))?;
        let mut header = [0u8; 16];
        file.read_exact(&mut header[..8])?;
        let size = match u32::from_be_bytes([header[0], header[1], header[2], header[3]]) {
            0 => end - at,
            1 => {
                file.read_exact(&mut header[8..])?;
                u64::from_be_bytes([
                    header[8], header[9], header[10], header[11], header[12], header[13], header[14], header[15],
                ])
            }
            n => u64::from(n),
        };
        if size < 8 || at + size > end {
            return Err(fail("a box runs past the end of the file"));
        }
        if &header[4..8] == b"moov" {
            break (at, size);
        }
        at += size;
    };
    if moov_len > MAX_INDEX_BYTES {
        return Err(fail("the `moov` box is larger than 64 MiB"));
    }
    let mut moov = vec![0u8; moov_len as usize];
    file.seek(SeekFrom::Start(moov_at))?;
    file.read_exact(&mut moov)?;
    let esds = moov
        .windows(4)
        .position(|w| w == b"esds")
        .ok_or_else(|| fail("no `esds` box"))?;
    // After the fourcc, the version and flags; then the descriptors, each a tag and a length
    // of one to four 7-bit bytes.
    let mut p = esds + 8;
    descriptor(&moov, &mut p, 0x03)?;
    // The ES descriptor's id and flags; the mp4 crate sets no optional field.
    if moov.get(p + 2) != Some(&0) {
        return Err(fail("an ES descriptor with optional fields"));
    }
    p += 3;
    let config = descriptor(&moov, &mut p, 0x04)?;
    p += config;
    match moov.get(p..p + 3) {
        Some(sl) if sl == SL_CONFIG_MP4 => Ok(()),
        Some(sl) if sl == SL_CONFIG_WRITTEN => {
            file.seek(SeekFrom::Start(moov_at + p as u64))?;
            file.write_all(&SL_CONFIG_MP4)?;
            file.seek(SeekFrom::End(0))?;
            Ok(())
        }
        _ => Err(fail("the SL descriptor is neither as written nor as MP4 wants it")),
    }
}

/// The length of the descriptor tagged `tag` at `*p` in `bytes` (a tag, then a length of one
/// to four 7-bit bytes), `*p` moved past its header.
fn descriptor(bytes: &[u8], p: &mut usize, tag: u8) -> Result<usize, MediaError> {
    let fail = |what: String| MediaError::AudioDescriptor(what);
    if bytes.get(*p) != Some(&tag) {
        return Err(fail(format!("descriptor 0x{tag:02x} not where expected")));
    }
    *p += 1;
    let mut len = 0usize;
    for _ in 0..4 {
        let b = *bytes
            .get(*p)
            .ok_or_else(|| fail("a descriptor's length runs past the box".into()))?;
        *p += 1;
        len = (len << 7) | usize::from(b & 0x7f);
        if b & 0x80 == 0 {
            break;
        }
    }
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Files that are not what the writer made are refused, naming what is missing, and
    /// left as they were.
    #[test]
    fn a_file_without_the_descriptor_is_refused_untouched() {
        let free = |size: u32| [&size.to_be_bytes()[..], b"free", &vec![0u8; size as usize - 8]].concat();
        for (bytes, named) in [
            (free(16), "no `moov` box"),
            (
                [&free(16)[..], &40u32.to_be_bytes(), b"moov"].concat(),
                "runs past the end",
            ),
            ([&16u32.to_be_bytes()[..], b"moov", &[0u8; 8]].concat(), "no `esds` box"),
        ] {
            let mut file = std::io::Cursor::new(bytes.clone());
            let err = mark_sl_config_mp4(&mut file).expect_err(named).to_string();
            assert!(err.contains(named), "{err}");
            assert_eq!(file.into_inner(), bytes);
        }
    }
}
