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
