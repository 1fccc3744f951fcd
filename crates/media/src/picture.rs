//! The reference image speech-to-video animates, read from PNG or JPEG and fitted as
//! Wan2.2-S2V fits it (`speech2video.py` of the wan22 wheel): the frame size chosen from the
//! image's own within an area (`get_size_less_than_area`), then torchvision's `Resize` of the
//! shorter side to the frame's shorter side (bilinear, antialiased, as PIL resamples) and
//! `CenterCrop` to the frame, zero-padding a side the image does not reach.

use std::path::{Path, PathBuf};

use image::imageops::FilterType;

/// The multiple of 64 pixels S2V pads frame sides to.
const SIDE_STEP: usize = 64;

/// Images past this many pixels a side are refused from their header.
const MAX_SIDE: u32 = 16_384;

/// Why a reference image could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("cannot read {path} as a PNG or JPEG image: {source}")]
    Read { path: PathBuf, source: image::ImageError },
    #[error("a frame of {width}x{height} cannot be made from a reference image: give sides of at least one pixel")]
    Frame { width: usize, height: usize },
}

/// The frame `(height, width)` S2V makes for a reference image of `height × width` pixels
/// within `max_area` pixels (`get_size_less_than_area`, divisor 64): the image scaled by the
/// largest of 100 steps from the full fit down that, each side padded up to a multiple of
/// 64, stays within the area; else the area's own sides at the image's aspect, in steps of 64.
pub fn s2v_frame_size(height: usize, width: usize, max_area: usize) -> (usize, usize) {
    let (h, w, area) = (height as f64, width as f64, max_area as f64);
    let (min_scale, max_scale) = match height * width <= max_area {
        true => (0.1, 1.0),
        false => {
            // The scale whose padding, at most 63 pixels a side, just fills the area.
            let d = (SIDE_STEP - 1) as f64;
            let (a, b, c) = (h * w, d * (h + w), d * d - area);
            ((-b + (b * b - 2.0 * a * c).sqrt()) / (2.0 * a), (area / (h * w)).sqrt())
        }
    };
    let padded = |n: usize| n + (SIDE_STEP - n % SIDE_STEP) % SIDE_STEP;
    for i in 0..100 {
        let scale = max_scale - (max_scale - min_scale) * i as f64 / 100.0;
        let (ph, pw) = (padded((h * scale) as usize), padded((w * scale) as usize));
        if ph * pw <= max_area {
            return (ph, pw);
        }
    }
    let aspect = w / h;
    let step = SIDE_STEP as f64;
    let fit_w = ((area * aspect).sqrt() / step).floor() * step;
    let fit_h = ((area / aspect).sqrt() / step).floor() * step;
    match fit_w as usize >= width || fit_h as usize >= height {
        true => (height / SIDE_STEP * SIDE_STEP, width / SIDE_STEP * SIDE_STEP),
        false => (fit_h as usize, fit_w as usize),
    }
}

/// The `(height, width)` of the image at `path`, from its header.
pub fn image_size(path: &Path) -> Result<(usize, usize), ImageError> {
    let read = |source| ImageError::Read {
        path: path.to_path_buf(),
        source,
    };
    let (w, h) = image::ImageReader::open(path)
        .and_then(|r| r.with_guessed_format())
        .map_err(|e| read(image::ImageError::IoError(e)))?
        .into_dimensions()
        .map_err(read)?;
    Ok((h as usize, w as usize))
}

/// The image at `path` fitted to a `height × width` frame: its shorter side resized to the
/// frame's shorter side (the other in proportion, truncated), then the frame's centre cut
/// out, black where the image does not reach. RGB planes `[3, height, width]` in [−1, 1].
pub fn read_reference_image(path: &Path, height: usize, width: usize) -> Result<Vec<f32>, ImageError> {
    if height == 0 || width == 0 {
        return Err(ImageError::Frame { width, height });
    }
    let read = |source| ImageError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut reader = image::ImageReader::open(path)
        .and_then(|r| r.with_guessed_format())
        .map_err(|e| read(image::ImageError::IoError(e)))?;
    // A decompression bomb is refused from its header.
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(MAX_SIDE);
    limits.max_image_height = Some(MAX_SIDE);
    reader.limits(limits);
    let rgb = reader.decode().map_err(read)?.to_rgb8();
    let mut planes = vec![-1.0f32; 3 * height * width];
    fit_frame(&rgb, height, width, &mut planes, 0, 1);
    Ok(planes)
}

/// The pose video's first `total` frames (`clips` of a clip's frames) fitted to `height ×
/// width` as S2V fits them (`load_pose_cond`): resized and centre-cut as the reference image
/// is, in [−1, 1], the frames past the video's end −1. `[3, total, height, width]`.
pub fn pose_pixels(video: &crate::VideoFrames, height: usize, width: usize, total: usize) -> Vec<f32> {
    let mut planes = vec![-1.0f32; 3 * total * height * width];
    for (t, frame) in video.frames.iter().take(total).enumerate() {
        let size = (video.size.width as u32, video.size.height as u32);
        if let Some(rgb) = image::RgbImage::from_raw(size.0, size.1, frame.clone()) {
            // S2V crops a tensor in [−1, 1]: where the image does not reach, 0.
            let (first, pixels) = (t * height * width, height * width);
            for c in 0..3 {
                let at = c * total * pixels + first;
                planes[at..at + pixels].fill(0.0);
            }
            fit_frame(&rgb, height, width, &mut planes, first, total);
        }
    }
    planes
}

/// `rgb` resized (its shorter side to the frame's) and centre-cut into frame `first /
/// (height · width)` of `planes` (`[3, frames, height, width]`, `frames` of them), in [−1, 1];
/// pixels the image does not reach keep their value.
fn fit_frame(rgb: &image::RgbImage, height: usize, width: usize, planes: &mut [f32], first: usize, frames: usize) {
    let (w0, h0) = rgb.dimensions();
    // torchvision's Resize(size): the shorter side to `size`, the longer in proportion.
    let short = height.min(width) as u64;
    let (w0, h0) = (w0 as u64, h0 as u64);
    // `int(size * long / short)`: the exact product, one rounded division, truncated.
    let scaled = |long: u64, short_side: u64| ((short * long) as f64 / short_side as f64) as u64;
    let (rw, rh) = match w0 <= h0 {
        true => (short, scaled(h0, w0)),
        false => (scaled(w0, h0), short),
    };
    let resized = image::imageops::resize(rgb, rw as u32, rh as u32, FilterType::Triangle);
    // torchvision's CenterCrop: zero padding split with the extra pixel after, then the
    // crop's offset rounded half to even.
    let offset = |image: u64, frame: usize| -> i64 {
        let frame = frame as u64;
        match frame > image {
            true => -(((frame - image) / 2) as i64),
            false => ((image - frame) as f64 / 2.0).round_ties_even() as i64,
        }
    };
    let (top, left) = (offset(rh, height), offset(rw, width));
    let plane = frames * height * width;
    for y in 0..height {
        let sy = y as i64 + top;
        if sy < 0 || sy >= rh as i64 {
            continue;
        }
        for x in 0..width {
            let sx = x as i64 + left;
            if sx < 0 || sx >= rw as i64 {
                continue;
            }
            let pixel = resized.get_pixel(sx as u32, sy as u32);
            for (c, &value) in pixel.0.iter().enumerate() {
                planes[c * plane + first + y * width + x] = value as f32 / 255.0 * 2.0 - 1.0;
            }
        }
    }
}
