//! H.264 video in MP4 read back to frames, as S2V reads its pose video: written here by the
//! crate's own writer at 32 frames a second, read at 16 (every other frame), then fitted to
//! the DiT's frames.
#![allow(clippy::expect_used)] // test helpers: a failed expectation is a failed test

use tpinfer_media::{pose_pixels, read_video_frames, FrameSize, Mp4Writer, VideoReadError};

/// A still gradient with a white square whose left edge is at `2 + 2t`: the frame's index
/// is where the square is.
fn frame(size: FrameSize, t: usize) -> Vec<u8> {
    (0..size.height)
        .flat_map(|y| (0..size.width).map(move |x| (x, y)))
        .flat_map(
            |(x, y)| match (2 + 2 * t..10 + 2 * t).contains(&x) && (16..32).contains(&y) {
                true => [255, 255, 255],
                false => [(x * 2) as u8, (y * 3) as u8, 60],
            },
        )
        .collect()
}

/// The left edge of the square in a decoded frame: the first column whose middle row is
/// nearly white.
fn square_at(size: FrameSize, rgb: &[u8]) -> usize {
    let row = 24 * size.width * 3;
    (0..size.width)
        .find(|&x| rgb[row + 3 * x..row + 3 * x + 3].iter().all(|&v| v > 200))
        .expect("a square")
}

fn psnr(a: &[u8], b: &[u8]) -> f64 {
    let mse = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
        .sum::<f64>()
        / a.len() as f64;
    10.0 * (255.0f64.powi(2) / mse.max(1e-9)).log10()
}

#[test]
fn a_pose_video_reads_back_at_sixteen_frames_a_second() {
    let size = FrameSize { width: 64, height: 48 };
    let frames: Vec<Vec<u8>> = (0..20).map(|t| frame(size, t)).collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pose.mp4");
    let file = std::fs::File::create(&path).expect("create");
    let mut video = Mp4Writer::new(std::io::BufWriter::new(file), size, 32).expect("writer");
    for rgb in &frames {
        video.push(rgb).expect("frame");
    }
    video.finish().expect("finish");
    // The header alone says how many frames a read at 16 fps keeps: every other of 20. Read
    // three at a time, they are the frames of one read.
    let mut reader = tpinfer_media::VideoReader::open(&path, 16).expect("header");
    assert_eq!(reader.frames(), 10);
    let mut chunks = Vec::new();
    loop {
        let chunk = reader.next_frames(3).expect("three frames");
        assert_eq!(chunk.size, size);
        if chunk.frames.is_empty() {
            break;
        }
        chunks.extend(chunk.frames);
    }
    assert_eq!(chunks, read_video_frames(&path, 16, 100).expect("all").frames);
    let read = read_video_frames(&path, 16, 8).expect("read");
    assert_eq!(read.size, size);
    assert_eq!(read.frames.len(), 8, "8 frames asked for");
    for (i, got) in read.frames.iter().enumerate() {
        // Every other frame of 32 fps: frames 0, 2, 4, ...
        assert_eq!(square_at(size, got), 2 + 2 * (2 * i), "frame {i} is frame {}", 2 * i);
        let db = psnr(got, &frames[2 * i]);
        assert!(db > 30.0, "frame {i}: PSNR {db:.1} dB against frame {}", 2 * i);
    }
    // The video's 10 frames at 16 fps, then -1 to the 16 asked for, fitted to 32 x 32: the
    // shorter side to 32, the centre cut.
    let all = read_video_frames(&path, 16, 100).expect("read all");
    assert_eq!(all.frames.len(), 10);
    let pixels = pose_pixels(&all, 32, 32, 16);
    assert_eq!(pixels.len(), 3 * 16 * 32 * 32);
    let frame_of = |c: usize, t: usize| &pixels[(c * 16 + t) * 32 * 32..(c * 16 + t + 1) * 32 * 32];
    assert!(frame_of(0, 9).iter().any(|&v| v > -0.9), "frame 9 is the video's");
    assert!(
        (0..3).all(|c| frame_of(c, 10).iter().all(|&v| v == -1.0)),
        "frame 10 is padding"
    );
    assert!(pixels.iter().all(|v| (-1.0..=1.0).contains(v)));
}

#[test]
fn what_is_not_a_video_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("notes.mp4");
    std::fs::write(&path, "not a video").expect("write");
    let err = read_video_frames(&path, 16, 8).expect_err("text");
    assert!(matches!(err, VideoReadError::Read { .. }), "{err}");
    assert!(err.to_string().contains("notes.mp4"), "{err}");
    let err = read_video_frames(&dir.path().join("absent.mp4"), 16, 8).expect_err("missing");
    assert!(err.to_string().contains("absent.mp4"), "{err}");
}

/// The track header's size is the display size; the pictures are the stream's own. A header
/// that says 80 wide over a 64-wide stream (as non-square pixels do) reads at the stream's
/// size: before, the frame buffer was sized from the header and the decoder's copy panicked.
#[test]
fn the_pictures_size_is_the_streams_not_the_headers() {
    let size = FrameSize { width: 64, height: 48 };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("wide.mp4");
    let mut video = Mp4Writer::new(std::io::Cursor::new(Vec::new()), size, 16).expect("writer");
    for t in 0..4 {
        video.push(&frame(size, t)).expect("frame");
    }
    let mut bytes = video.finish().expect("finish").into_inner();
    // The avc1 sample entry (in stsd; ftyp names avc1 as a brand first): its fourcc, 6
    // reserved bytes, the data reference index, 16 bytes pre-defined, then width and height
    // (u16, big-endian).
    let stsd = bytes.windows(4).position(|w| w == b"stsd").expect("stsd");
    let at = stsd + bytes[stsd..].windows(4).position(|w| w == b"avc1").expect("avc1") + 4 + 6 + 2 + 16;
    assert_eq!(&bytes[at..at + 4], &[0, 64, 0, 48]);
    bytes[at + 1] = 80;
    std::fs::write(&path, &bytes).expect("write");
    let read = read_video_frames(&path, 16, 8).expect("read");
    assert_eq!(read.size, size, "the stream's size");
    assert_eq!(read.frames.len(), 4);
    assert!(read.frames.iter().all(|f| f.len() == 64 * 48 * 3));
    assert_eq!(square_at(size, &read.frames[3]), 2 + 2 * 3);
}

/// A box of size 0 inside the track (here the video media header, renamed to a type no reader
/// knows) is an error, not a loop: the mp4 crate's reader seeked back to its start forever.
#[test]
fn a_box_of_size_zero_is_refused_not_looped_over() {
    let size = FrameSize { width: 64, height: 48 };
    let mut video = Mp4Writer::new(std::io::Cursor::new(Vec::new()), size, 16).expect("writer");
    for t in 0..4 {
        video.push(&frame(size, t)).expect("frame");
    }
    let mut bytes = video.finish().expect("finish").into_inner();
    let vmhd = bytes.windows(4).position(|w| w == b"vmhd").expect("vmhd") - 4;
    bytes[vmhd..vmhd + 8].copy_from_slice(b"\0\0\0\0zzzz");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("zero.mp4");
    std::fs::write(&path, &bytes).expect("write");
    let (done, finished) = std::sync::mpsc::channel();
    let reader = path.clone();
    std::thread::spawn(move || done.send(read_video_frames(&reader, 16, 8).map(|v| v.frames.len())));
    let result = finished
        .recv_timeout(std::time::Duration::from_secs(20))
        .expect("the read ends");
    let err = result.expect_err("a box of size 0 in a track");
    assert!(err.to_string().contains("zero.mp4"), "{err}");
}

/// libx264's default stream (B-frames stored out of display order) read a few frames at a
/// time gives the frames of one read: pictures held for reordering carry over between reads.
#[test]
fn a_video_with_b_frames_reads_the_same_in_chunks() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/s2v-pipeline/inputs/pose.mp4");
    let whole = read_video_frames(&path, 16, 1000).expect("whole");
    assert!(whole.frames.len() >= 32, "{} frames", whole.frames.len());
    let mut reader = tpinfer_media::VideoReader::open(&path, 16).expect("open");
    assert_eq!(reader.frames(), whole.frames.len());
    let mut chunks = Vec::new();
    for _ in 0..whole.frames.len().div_ceil(5) + 1 {
        chunks.extend(reader.next_frames(5).expect("five").frames);
    }
    assert_eq!(chunks.len(), whole.frames.len());
    assert!(chunks == whole.frames, "the same frames in the same order");
}
