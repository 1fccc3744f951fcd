//! Speech in: WAV written here byte by byte, FLAC and MP3 written by libsndfile
//! (`scripts/reference/audio_fixtures.py`), each decoded, mixed to mono and resampled to
//! 16 kHz, against the tone it holds; and files that are not audio, refused by name.

use std::f64::consts::PI;
use std::path::{Path, PathBuf};

use tpinfer_media::{decode_mono, read_speech, resample, AudioError};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

/// `amplitude · sin(2π f t)` at `rate` Hz, `n` samples.
fn tone(amplitude: f64, f: f64, rate: u32, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (amplitude * (2.0 * PI * f * i as f64 / rate as f64).sin()) as f32)
        .collect()
}

/// A RIFF WAVE file of interleaved `frames`: 16-bit PCM (format 1) or 32-bit float (3).
fn wav(channels: u16, rate: u32, float: bool, frames: &[Vec<f32>]) -> Vec<u8> {
    let bits: u16 = if float { 32 } else { 16 };
    let block = channels * bits / 8;
    let mut samples = Vec::new();
    for frame in frames {
        for &s in frame {
            match float {
                true => samples.extend_from_slice(&s.to_le_bytes()),
                false => samples.extend_from_slice(&((s * 32767.0).round() as i16).to_le_bytes()),
            }
        }
    }
    let mut out = Vec::new();
    out.extend_from_slice(b"RIFF");
    out.extend_from_slice(&(36 + samples.len() as u32).to_le_bytes());
    out.extend_from_slice(b"WAVEfmt ");
    out.extend_from_slice(&16u32.to_le_bytes());
    out.extend_from_slice(&(if float { 3u16 } else { 1 }).to_le_bytes());
    out.extend_from_slice(&channels.to_le_bytes());
    out.extend_from_slice(&rate.to_le_bytes());
    out.extend_from_slice(&(rate * block as u32).to_le_bytes());
    out.extend_from_slice(&block.to_le_bytes());
    out.extend_from_slice(&bits.to_le_bytes());
    out.extend_from_slice(b"data");
    out.extend_from_slice(&(samples.len() as u32).to_le_bytes());
    out.extend_from_slice(&samples);
    out
}

/// ‖a − b‖ / ‖b‖ over the samples both cover, leaving `edge` at each end, where a resampler's
/// filter sees the zeros outside the signal.
fn interior_rel(a: &[f32], b: &[f32], edge: usize) -> f64 {
    let n = a.len().min(b.len());
    let (mut diff, mut norm) = (0.0, 0.0);
    for i in edge..n - edge {
        diff += (a[i] as f64 - b[i] as f64).powi(2);
        norm += (b[i] as f64).powi(2);
    }
    (diff / norm).sqrt()
}

fn rms(x: &[f32]) -> f64 {
    (x.iter().map(|&s| (s as f64).powi(2)).sum::<f64>() / x.len() as f64).sqrt()
}

#[test]
fn a_stereo_wav_at_44100_hz_is_mixed_to_mono_and_resampled_to_16_khz() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("speech.wav");
    let (left, right) = (tone(0.6, 440.0, 44_100, 44_100), tone(0.2, 440.0, 44_100, 44_100));
    let frames: Vec<Vec<f32>> = left.iter().zip(&right).map(|(&l, &r)| vec![l, r]).collect();
    std::fs::write(&path, wav(2, 44_100, false, &frames)).expect("write");

    let speech = read_speech(&path, 16_000).expect("read");
    assert_eq!(speech.sample_rate, 16_000);
    // librosa's length: ⌈44,100 · 16,000 / 44,100⌉.
    assert_eq!(speech.samples.len(), 16_000);
    let expected = tone(0.4, 440.0, 16_000, 16_000);
    let rel = interior_rel(&speech.samples, &expected, 64);
    assert!(rel < 5e-4, "resampled tone against the 16 kHz tone: {rel:e}");
}

#[test]
fn a_float_wav_at_the_target_rate_comes_back_as_written() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("speech.wav");
    let samples = tone(0.5, 300.0, 16_000, 4_000);
    let frames: Vec<Vec<f32>> = samples.iter().map(|&s| vec![s]).collect();
    std::fs::write(&path, wav(1, 16_000, true, &frames)).expect("write");
    let speech = read_speech(&path, 16_000).expect("read");
    assert_eq!(speech.samples, samples);
}

#[test]
fn resampling_keeps_the_length_librosa_gives_and_the_signal_aligned() {
    for (from, to, n) in [(48_000, 16_000, 4_801), (8_000, 16_000, 999), (22_050, 16_000, 10_000)] {
        let x = tone(0.5, 200.0, from, n);
        let y = resample(&x, from, to).expect("resample");
        assert_eq!(y.len(), (n as u64 * to as u64).div_ceil(from as u64) as usize);
        let rel = interior_rel(&y, &tone(0.5, 200.0, to, y.len()), 64);
        assert!(rel < 5e-4, "{from} → {to} Hz: {rel:e}");
    }
}

#[test]
fn a_flac_file_from_libsndfile_decodes_to_its_mono_tone() {
    let decoded = decode_mono(&data("tone-stereo-22050.flac")).expect("decode");
    assert_eq!(decoded.sample_rate, 22_050);
    assert_eq!(decoded.samples.len(), 11_025);
    // 16-bit samples of 0.6 and 0.2 of the tone, averaged.
    let rel = interior_rel(&decoded.samples, &tone(0.4, 440.0, 22_050, 11_025), 0);
    assert!(rel < 1e-4, "FLAC against its tone: {rel:e}");
    let speech = read_speech(&data("tone-stereo-22050.flac"), 16_000).expect("read");
    assert_eq!(speech.samples.len(), 8_000);
}

/// An MP3 encoder pads the stream at both ends (here LAME's 1,105 samples before and 875
/// after, which its header records); libsndfile, which librosa reads through, trims both, and
/// so does tpinfer: the second of tone comes back as 44,100 samples in step with the tone
/// written (untrimmed, it lagged by 25 ms, and so did the video's speech features).
#[test]
fn an_mp3_file_from_libsndfile_decodes_to_its_tone() {
    let decoded = decode_mono(&data("tone-mono-44100.mp3")).expect("decode");
    assert_eq!(decoded.samples.len(), 44_100, "the encoder's delay and padding trimmed");
    let written = tone(0.4, 440.0, 44_100, 44_100);
    let rel = interior_rel(&decoded.samples, &written, 2_048);
    assert!(rel < 2e-2, "MP3 against its tone: {rel:e}");
    let late = interior_rel(&decoded.samples[1..], &written, 2_048);
    assert!(late > 5.0 * rel, "a sample late: {late:e}, in step: {rel:e}");
    let speech = read_speech(&data("tone-mono-44100.mp3"), 16_000).expect("read");
    assert_eq!(speech.samples.len(), 16_000);
    let middle = &speech.samples[4_000..12_000];
    let loudness = rms(middle);
    assert!((loudness / (0.4 / 2f64.sqrt()) - 1.0).abs() < 0.05, "RMS {loudness}");
    // 440 Hz crosses zero 880 times a second: 440 times in the middle half second.
    let crossings = middle.windows(2).filter(|w| (w[0] < 0.0) != (w[1] < 0.0)).count();
    assert!((438..=442).contains(&crossings), "{crossings} zero crossings");
}

/// A file that stops before the samples its header declares (a copy or download cut off) is
/// refused, naming both lengths, not read as shorter speech; a WAV written to a pipe, whose
/// header declares the largest data chunk there is because its writer could not go back to
/// fill in the length (ffmpeg's `-f wav -`), is read to its end.
#[test]
fn a_file_cut_short_is_refused_and_a_streamed_wav_is_read_whole() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mono: Vec<Vec<f32>> = tone(0.5, 300.0, 16_000, 16_000).into_iter().map(|s| vec![s]).collect();
    let whole = wav(1, 16_000, false, &mono);
    let cut = dir.path().join("cut.wav");
    std::fs::write(&cut, &whole[..44 + 2 * 6_000]).expect("write");
    let err = decode_mono(&cut).expect_err("cut short");
    assert!(
        matches!(
            err,
            AudioError::Truncated {
                declared: 16_000,
                held: 6_000,
                ..
            }
        ),
        "{err}"
    );
    let message = err.to_string();
    assert!(
        message.contains("cut.wav") && message.contains("1.00 s") && message.contains("0.38 s"),
        "{message}"
    );

    let mut flac = std::fs::read(data("tone-stereo-22050.flac")).expect("read");
    flac.truncate(flac.len() / 2);
    let half = dir.path().join("half.flac");
    std::fs::write(&half, &flac).expect("write");
    let err = decode_mono(&half).expect_err("half a FLAC");
    assert!(err.to_string().contains("half.flac"), "{err}");

    let stereo: Vec<Vec<f32>> = tone(0.5, 300.0, 22_050, 11_025)
        .into_iter()
        .map(|s| vec![s, -0.5 * s])
        .collect();
    for (name, bytes, frames) in [
        ("streamed-mono.wav", wav(1, 16_000, false, &mono), 16_000),
        ("streamed-stereo-float.wav", wav(2, 22_050, true, &stereo), 11_025),
    ] {
        let mut bytes = bytes;
        // The RIFF and data chunks' sizes: bytes 4..8 and 40..44.
        bytes[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        bytes[40..44].copy_from_slice(&u32::MAX.to_le_bytes());
        let path = dir.path().join(name);
        std::fs::write(&path, &bytes).expect("write");
        let decoded = decode_mono(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(decoded.samples.len(), frames, "{name}");
    }
}

#[test]
fn what_is_not_speech_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("missing.wav");
    let err = read_speech(&missing, 16_000).expect_err("missing");
    assert!(
        matches!(err, AudioError::Open { .. }) && err.to_string().contains("missing.wav"),
        "{err}"
    );

    let text = dir.path().join("notes.wav");
    std::fs::write(&text, "these are not samples").expect("write");
    let err = read_speech(&text, 16_000).expect_err("text");
    assert!(
        err.to_string().contains("notes.wav") && err.to_string().contains("WAV, FLAC or MP3"),
        "{err}"
    );

    let empty = dir.path().join("empty.wav");
    std::fs::write(&empty, wav(1, 16_000, false, &[])).expect("write");
    let err = read_speech(&empty, 16_000).expect_err("no samples");
    assert!(
        matches!(err, AudioError::Empty { .. }) && err.to_string().contains("empty.wav"),
        "{err}"
    );

    // A WAV cut off in its header.
    let cut = dir.path().join("cut.wav");
    let whole = wav(
        1,
        16_000,
        false,
        &tone(0.5, 300.0, 16_000, 100)
            .into_iter()
            .map(|s| vec![s])
            .collect::<Vec<_>>(),
    );
    std::fs::write(&cut, &whole[..30]).expect("write");
    let err = read_speech(&cut, 16_000).expect_err("cut");
    assert!(err.to_string().contains("cut.wav"), "{err}");

    // A FLAC whose frames are overwritten after its header.
    let mut flac = std::fs::read(data("tone-stereo-22050.flac")).expect("read");
    let len = flac.len();
    flac[len / 3..].iter_mut().for_each(|b| *b = 0x5a);
    let garbled = dir.path().join("garbled.flac");
    std::fs::write(&garbled, &flac).expect("write");
    match read_speech(&garbled, 16_000) {
        Err(err) => assert!(err.to_string().contains("garbled.flac"), "{err}"),
        // A decoder may also stop at the first bad frame with what came before it.
        Ok(speech) => assert!(speech.seconds() < 0.5),
    }
}

/// A header whose sample rate is corrupt (here 2,365,603,456 Hz, one flipped byte of a 16 kHz
/// WAV) is refused from the header: before, it sized the resampler's FFT from that rate, and
/// the read took minutes and gigabytes.
#[test]
fn an_absurd_sample_rate_is_refused_from_the_header() {
    let dir = tempfile::tempdir().expect("tempdir");
    let samples: Vec<Vec<f32>> = tone(0.5, 300.0, 16_000, 1_600).into_iter().map(|s| vec![s]).collect();
    let mut bytes = wav(1, 16_000, false, &samples);
    // The fmt chunk's rate is bytes 24..28.
    assert_eq!(&bytes[24..28], &16_000u32.to_le_bytes());
    bytes[27] = 0x8d;
    let path = dir.path().join("rate.wav");
    std::fs::write(&path, &bytes).expect("write");
    let started = std::time::Instant::now();
    let err = read_speech(&path, 16_000).expect_err("absurd rate");
    assert!(
        matches!(
            err,
            AudioError::SampleRate {
                rate: 2_365_603_456,
                ..
            }
        ) && err.to_string().contains("rate.wav"),
        "{err}"
    );
    assert!(started.elapsed().as_secs() < 5, "refused from the header");
    assert!(tpinfer_media::resample(&[0.0; 8], 2_365_603_456, 16_000).is_err());
}
