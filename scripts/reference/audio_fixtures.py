"""Writes the compressed audio fixtures of crates/media/tests/audio.rs with libsndfile
(python-soundfile): a FLAC and an MP3 of known tones, so that the tests decode files a real
encoder made. Run from the repository root: python scripts/reference/audio_fixtures.py"""
import numpy as np
import soundfile as sf

OUT = "crates/media/tests/data"

# Stereo FLAC at 22,050 Hz, 16-bit: 0.6 and 0.2 of one 440 Hz sine, whose mono mix is 0.4 of it.
rate = 22050
t = np.arange(int(0.5 * rate)) / rate
tone = np.sin(2 * np.pi * 440 * t)
sf.write(f"{OUT}/tone-stereo-22050.flac", np.stack([0.6 * tone, 0.2 * tone], axis=1), rate,
         subtype="PCM_16")

# Mono MP3 at 44,100 Hz: 0.4 of a 440 Hz sine for one second.
rate = 44100
t = np.arange(rate) / rate
sf.write(f"{OUT}/tone-mono-44100.mp3", 0.4 * np.sin(2 * np.pi * 440 * t), rate,
         format="MP3", subtype="MPEG_LAYER_III")
