//! S2V's reference image against the wan22 wheel's own preparation
//! (`scripts/reference/reference_s2v_image.py`): the frame size its `get_size_less_than_area`
//! picks, over many image sizes and areas, exactly; and a PNG and a JPEG fitted to a frame
//! that crops and one that pads, against torchvision's Resize and CenterCrop on PIL's pixels.

use std::path::{Path, PathBuf};

use tpinfer_media::{read_reference_image, s2v_frame_size, ImageError};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/s2v-image")
        .join(name)
}

#[test]
fn the_frame_size_is_the_wheels_for_every_image_and_area() {
    let text = std::fs::read_to_string(data("sizes.json")).expect("sizes");
    let sizes: Vec<[usize; 5]> = serde_json::from_str(&text).expect("parse");
    assert!(sizes.len() > 100);
    for [h, w, area, ph, pw] in sizes {
        assert_eq!(s2v_frame_size(h, w, area), (ph, pw), "{h}x{w} within {area}");
    }
}

/// PNG pixels differ from PIL's by its 8-bit rounding between the two resampling passes (at
/// most 1 step of 255 here, 0.12 on average); JPEG also by the decoders' IDCTs (3, 0.45).
#[test]
fn the_image_is_resized_and_cropped_as_torchvision_does() {
    let bytes = std::fs::read(data("pixels.safetensors")).expect("pixels");
    let expected = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    for (file, key, worst_steps, mean_steps) in [("face.png", "png", 1.0, 0.15), ("face.jpg", "jpeg", 3.0, 0.5)] {
        for (h, w) in [(48, 64), (64, 48)] {
            let want = expected.tensor(&format!("{key}_{h}x{w}")).expect("case");
            let want: Vec<f32> = want
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let got = read_reference_image(&data(file), h, w).expect("read");
            assert_eq!(got.len(), want.len());
            // In 8-bit steps: [−1, 1] spans 255 of them.
            let steps: Vec<f64> = got
                .iter()
                .zip(&want)
                .map(|(a, b)| ((a - b).abs() * 127.5) as f64)
                .collect();
            let worst = steps.iter().cloned().fold(0.0, f64::max);
            let mean = steps.iter().sum::<f64>() / steps.len() as f64;
            assert!(
                worst <= worst_steps + 1e-3 && mean <= mean_steps,
                "{file} {h}x{w}: worst {worst:.2}, mean {mean:.3} steps"
            );
            // 61 x 97 resized to 48 x 76: a 64-row frame gets 8 black rows above and below.
            if h == 64 {
                let row_is_black = |y: usize| (0..3).all(|c| got[(c * h + y) * w..][..w].iter().all(|&v| v == -1.0));
                assert!((0..8).chain(56..64).all(row_is_black), "{file}: padding");
                assert!(!row_is_black(8) && !row_is_black(55), "{file}: image rows");
            }
        }
    }
}

#[test]
fn what_is_not_an_image_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let text = dir.path().join("face.png");
    std::fs::write(&text, "not an image").expect("write");
    let missing = dir.path().join("missing.png");
    let truncated = dir.path().join("truncated.png");
    let png = std::fs::read(data("face.png")).expect("png");
    std::fs::write(&truncated, &png[..png.len() / 2]).expect("write");
    for path in [&text, &missing, &truncated] {
        let err = read_reference_image(path, 64, 48).expect_err("not an image");
        assert!(matches!(err, ImageError::Read { .. }), "{err:?}");
        assert!(err.to_string().contains(&path.display().to_string()), "{err}");
    }
    let err = read_reference_image(&data("face.png"), 0, 48).expect_err("empty frame");
    assert!(err.to_string().contains("0"), "{err}");
}
