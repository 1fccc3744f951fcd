use std::path::Path;

use candle_core::DType;
use serde_json::Value;
use tpinfer_family::ConfigError;

/// The shape of a Wan DiT, in the terms of diffusers' `WanTransformer3DModel` config.
#[derive(Debug, Clone, PartialEq)]
pub struct WanConfig {
    pub num_attention_heads: usize,
    pub attention_head_dim: usize,
    pub in_channels: usize,
    pub out_channels: usize,
    pub text_dim: usize,
    pub freq_dim: usize,
    pub ffn_dim: usize,
    pub num_layers: usize,
    pub patch_size: [usize; 3],
    /// Whether cross-attention has an affine LayerNorm (`norm2`) before it.
    pub cross_attn_norm: bool,
    /// Epsilon of the layer norms and of the QK RMSNorm.
    pub eps: f64,
    /// The speech-to-video modules of Wan2.2-S2V, when the model has them.
    pub s2v: Option<S2vModules>,
}

/// Wan2.2-S2V's modules around the DiT (`wan/modules/s2v/model_s2v.py`): audio cross-attention
/// injected after some blocks, with AdaIN; a causal audio encoder; the frame-pack motion
/// encoder; a pose/condition encoder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S2vModules {
    /// The blocks followed by an audio cross-attention, ascending: injection `i` follows
    /// block `audio_inject_layers[i]`.
    pub audio_inject_layers: Vec<usize>,
    /// Width of the wav2vec features the audio encoder reads.
    pub audio_dim: usize,
    /// Audio tokens per latent frame.
    pub num_audio_token: usize,
    /// Channels of the condition (pose) latents.
    pub cond_dim: usize,
}

impl WanConfig {
    /// Reads a model directory's `config.json`: diffusers' `WanTransformer3DModel` form, or the
    /// original Wan code's (`dim`, `num_heads`, `in_dim`, …). Text-to-video only.
    pub fn from_dir(dir: &Path) -> Result<Self, ConfigError> {
        let (text, origin) = tpinfer_family::read_config(dir)?;
        Self::from_json(&text, &origin)
    }

    /// Parses either config form; `origin` names it in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let v: Value = tpinfer_family::parse_config(text, origin, "a WanTransformer3DModel config")?;
        let field = |detail: String| ConfigError::Field {
            path: origin.to_string(),
            detail,
        };
        // A field that is there must be a positive integer: a wrong type never falls back to
        // the default.
        let int = |keys: &[&str], default: Option<usize>| -> Result<usize, ConfigError> {
            match keys.iter().find_map(|k| v.get(*k).map(|value| (*k, value))) {
                Some((key, value)) => match value.as_u64() {
                    Some(n) if n > 0 => Ok(n as usize),
                    _ => Err(field(format!("`{key}` is {value}; it must be a positive integer"))),
                },
                None => default.ok_or_else(|| field(format!("missing `{}`", keys[0]))),
            }
        };
        for key in ["image_dim", "added_kv_proj_dim"] {
            if v.get(key).is_some_and(|x| !x.is_null()) {
                return Err(field(format!(
                    "`{key}` is set: image-to-video Wan models are not supported yet"
                )));
            }
        }
        let speech = match v.get("model_type").and_then(Value::as_str) {
            None | Some("t2v") => false,
            Some("s2v") => true,
            Some(kind) => {
                return Err(field(format!(
                    "model_type `{kind}`: tpinfer runs text-to-video (t2v) and speech-to-video (s2v) Wan models"
                )))
            }
        };
        let patch_size = match v.get("patch_size") {
            None => [1, 2, 2],
            Some(p) => {
                let dims: Option<Vec<usize>> = p.as_array().filter(|dims| dims.len() == 3).and_then(|dims| {
                    dims.iter()
                        .map(|d| d.as_u64().filter(|&n| n > 0).map(|n| n as usize))
                        .collect()
                });
                match dims.as_deref() {
                    Some(&[t, h, w]) => [t, h, w],
                    _ => {
                        return Err(field(format!(
                            "`patch_size` is {p}; it must be three positive integers, e.g. [1, 2, 2]"
                        )))
                    }
                }
            }
        };
        let heads = int(&["num_attention_heads", "num_heads"], None)?;
        let head_dim = match v.get("dim").and_then(Value::as_u64) {
            Some(dim) => dim as usize / heads.max(1),
            None => int(&["attention_head_dim"], None)?,
        };
        // Neither may be 0; their product, before the bounds below, could wrap.
        if head_dim % 2 != 0 || heads == 0 || head_dim == 0 {
            return Err(field(format!("head dim {head_dim} must be even and positive")));
        }
        let config = Self {
            num_attention_heads: heads,
            attention_head_dim: head_dim,
            in_channels: int(&["in_channels", "in_dim"], Some(16))?,
            out_channels: int(&["out_channels", "out_dim"], Some(16))?,
            text_dim: int(&["text_dim"], Some(4096))?,
            freq_dim: int(&["freq_dim"], Some(256))?,
            ffn_dim: int(&["ffn_dim"], None)?,
            num_layers: int(&["num_layers"], None)?,
            patch_size,
            cross_attn_norm: match v.get("cross_attn_norm") {
                None => true,
                Some(b) => b
                    .as_bool()
                    .ok_or_else(|| field(format!("`cross_attn_norm` is {b}; it must be true or false")))?,
            },
            eps: match v.get("eps") {
                None => 1e-6,
                Some(e) => e
                    .as_f64()
                    .filter(|e| e.is_finite() && *e > 0.0)
                    .ok_or_else(|| field(format!("`eps` is {e}; it must be a positive number")))?,
            },
            s2v: None,
        };
        let config = match speech {
            true => Self {
                s2v: Some(s2v_modules(&v, config.num_layers, &field, &int)?),
                ..config
            },
            false => config,
        };
        // Bounds no published model comes near, so that no loop runs a billion blocks and no
        // product the plan takes wraps.
        let [pt, ph, pw] = config.patch_size;
        for (key, value, limit) in [
            ("num_attention_heads", config.num_attention_heads, 1024),
            ("attention_head_dim", config.attention_head_dim, 1024),
            ("num_layers", config.num_layers, 1024),
            ("ffn_dim", config.ffn_dim, 1 << 20),
            ("text_dim", config.text_dim, 1 << 16),
            ("freq_dim", config.freq_dim, 1 << 16),
            ("in_channels", config.in_channels, 1024),
            ("out_channels", config.out_channels, 1024),
            ("patch_size", pt.max(ph).max(pw), 64),
        ] {
            if value > limit {
                return Err(field(format!("`{key}` is {value}, above the {limit} tpinfer takes")));
            }
        }
        Ok(config)
    }

    /// Wan2.1-T2V-1.3B as published.
    pub fn wan21_t2v_1_3b() -> Self {
        Self::t2v(12, 8960, 30)
    }

    /// Wan2.1-T2V-14B (and each expert of Wan2.2-T2V-A14B) as published.
    pub fn wan21_t2v_14b() -> Self {
        Self::t2v(40, 13824, 40)
    }

    /// Wan2.2-S2V-14B: the 14B DiT with the speech-to-video modules of its published config
    /// (`wan/configs/wan_s2v_14B.py`: audio injected after 12 blocks, AdaIN, frame pack).
    pub fn wan22_s2v_14b() -> Self {
        Self {
            s2v: Some(S2vModules {
                audio_inject_layers: vec![0, 4, 8, 12, 16, 20, 24, 27, 30, 33, 36, 39],
                audio_dim: 1024,
                num_audio_token: 4,
                cond_dim: 16,
            }),
            ..Self::wan21_t2v_14b()
        }
    }

    fn t2v(heads: usize, ffn_dim: usize, layers: usize) -> Self {
        Self {
            num_attention_heads: heads,
            attention_head_dim: 128,
            in_channels: 16,
            out_channels: 16,
            text_dim: 4096,
            freq_dim: 256,
            ffn_dim,
            num_layers: layers,
            patch_size: [1, 2, 2],
            cross_attn_norm: true,
            eps: 1e-6,
            s2v: None,
        }
    }

    /// The residual stream's dtype when the products run in `compute`: f32 for S2V, whose
    /// reference (the wan22 wheel, under autocast) adds its gated residuals as f32 products, so
    /// its stream is f32 from the first block on; `compute` otherwise, as diffusers' Wan keeps
    /// it. The norms read the stream and write `compute` for the products.
    pub fn stream_dtype(&self, compute: DType) -> DType {
        match self.s2v {
            Some(_) => DType::F32,
            None => compute,
        }
    }

    /// The model width: heads × head dim.
    pub fn hidden_size(&self) -> usize {
        self.num_attention_heads * self.attention_head_dim
    }

    /// The latent frames the DiT denoises for a clip of `frames` frames: 4k + 1 frames make
    /// k + 1 (the VAE compresses time 4×, the first frame alone). S2V's clips (4k frames)
    /// follow its motion frames: `(frames + 3 + 73) / 4` latent frames less the 19 of the
    /// motion frames (`speech2video.py`'s `lat_target_frames`).
    pub fn latent_frames(&self, frames: usize) -> usize {
        match self.s2v {
            Some(_) => (frames + 3 + S2V_MOTION_FRAMES) / 4 - S2V_MOTION_FRAMES.div_ceil(4),
            None => frames.saturating_sub(1) / 4 + 1,
        }
    }

    /// The number of video tokens for `frames` frames of `width` × `height` pixels: the
    /// [`Self::latent_frames`], 8× smaller in space, in patches of 1 × 2 × 2 latents.
    pub fn video_tokens(&self, frames: usize, width: usize, height: usize) -> usize {
        let [pt, ph, pw] = self.patch_size;
        self.latent_frames(frames).div_ceil(pt) * (height / 8).div_ceil(ph) * (width / 8).div_ceil(pw)
    }

    /// The tokens of one forward's sequence: the video's, and S2V's after them: one frame of
    /// the reference image, and the motion frames packed at three scales (the last latent
    /// frame in 1 × 2 × 2 patches, the 2 before it in 2 × 4 × 4, the 16 before those in
    /// 4 × 8 × 8: `FramePackMotioner`).
    pub fn sequence_tokens(&self, frames: usize, width: usize, height: usize) -> usize {
        let video = self.video_tokens(frames, width, height);
        let (h, w) = (height / 8, width / 8);
        match self.s2v {
            Some(_) => {
                let [_, ph, pw] = self.patch_size;
                let reference = h.div_ceil(ph) * w.div_ceil(pw);
                let [near, middle, far] = S2V_FRAME_PACK;
                let motion = near * (h / 2) * (w / 2) + middle / 2 * (h / 4) * (w / 4) + far / 4 * (h / 8) * (w / 8);
                video + reference + motion
            }
            None => video,
        }
    }

    /// The number of latent values of one video: channels × latent frames × latent pixels.
    pub fn latent_elements(&self, frames: usize, width: usize, height: usize) -> usize {
        self.in_channels * self.latent_frames(frames) * (height / 8) * (width / 8)
    }

    /// The latent values S2V conditions each clip on: the reference image's one latent frame
    /// and the motion frames' 19; none without S2V.
    pub fn condition_latent_elements(&self, width: usize, height: usize) -> usize {
        match self.s2v {
            Some(_) => self.in_channels * (1 + S2V_MOTION_FRAMES.div_ceil(4)) * (height / 8) * (width / 8),
            None => 0,
        }
    }
}

/// A config field read as a positive integer: the first of its names present, else the
/// default, else an error naming it.
type PositiveField<'a> = dyn Fn(&[&str], Option<usize>) -> Result<usize, ConfigError> + 'a;

/// S2V's modules from the original config of `WanModel_S2V` (`wan_s2v_14B.py`): the forms of
/// them the published model uses, the others refused by name.
fn s2v_modules(
    v: &Value,
    layers: usize,
    field: &dyn Fn(String) -> ConfigError,
    int: &PositiveField,
) -> Result<S2vModules, ConfigError> {
    for (key, wanted, what) in [
        ("enable_adain", true, "AdaIN of the audio injections"),
        ("enable_framepack", true, "the frame-pack motion encoder"),
        (
            "enable_motioner",
            false,
            "the frame-pack motion encoder, not the transformer motioner",
        ),
        ("zero_timestep", true, "timestep 0 for the reference and motion tokens"),
        (
            "add_last_motion",
            true,
            "the nearest motion frames packed at full and half resolution",
        ),
    ] {
        match v.get(key).and_then(Value::as_bool) {
            Some(b) if b == wanted => {}
            found => {
                return Err(field(format!(
                    "`{key}` is {}: tpinfer runs S2V with {what} (`{key}`: {wanted}), as Wan2.2-S2V-14B has it",
                    found.map_or("missing".to_string(), |b| b.to_string())
                )))
            }
        }
    }
    let mode = v.get("adain_mode").and_then(Value::as_str).unwrap_or("attn_norm");
    if mode != "attn_norm" {
        return Err(field(format!(
            "`adain_mode` is `{mode}`: tpinfer runs S2V's `attn_norm` AdaIN"
        )));
    }
    let motion = int(&["motion_frames"], Some(S2V_MOTION_FRAMES))?;
    if motion != S2V_MOTION_FRAMES {
        return Err(field(format!(
            "`motion_frames` is {motion}: tpinfer runs S2V with its {S2V_MOTION_FRAMES} motion frames"
        )));
    }
    let list = v
        .get("audio_inject_layers")
        .and_then(Value::as_array)
        .ok_or_else(|| field("missing `audio_inject_layers` (the blocks an audio cross-attention follows)".into()))?;
    let inject: Vec<usize> = list
        .iter()
        .map(|n| n.as_u64().map(|n| n as usize).filter(|&n| n < layers))
        .collect::<Option<_>>()
        .filter(|l: &Vec<usize>| !l.is_empty() && l.windows(2).all(|w| w[0] < w[1]))
        .ok_or_else(|| {
            field(format!(
                "`audio_inject_layers` is {}; it must list block indices below `num_layers` {layers}, ascending",
                Value::Array(list.clone())
            ))
        })?;
    // `AudioInjector_WAN` finds its blocks by name, and block b answers to index a wherever
    // b's digits start with a's (`transformer_blocks.1` is in `transformer_blocks.12`): such a
    // list makes injectors it does not name.
    let ambiguous = inject.iter().find_map(|&a| {
        (0..layers)
            .find(|&b| b != a && b.to_string().starts_with(&a.to_string()))
            .map(|b| (a, b))
    });
    if let Some((a, b)) = ambiguous {
        return Err(field(format!(
            "`audio_inject_layers` lists block {a}, which the wan22 code also finds in block {b} by name: \
             tpinfer runs lists whose blocks it finds once each, as Wan2.2-S2V-14B's"
        )));
    }
    let modules = S2vModules {
        audio_inject_layers: inject,
        audio_dim: int(&["audio_dim"], None)?,
        num_audio_token: int(&["num_audio_token"], Some(4))?,
        cond_dim: int(&["cond_dim"], None)?,
    };
    for (key, value, limit) in [
        ("audio_dim", modules.audio_dim, 1 << 16),
        ("num_audio_token", modules.num_audio_token, 64),
        ("cond_dim", modules.cond_dim, 1024),
    ] {
        if value > limit {
            return Err(field(format!("`{key}` is {value}, above the {limit} tpinfer takes")));
        }
    }
    Ok(modules)
}

/// The video frames before each S2V clip that condition it (`motion_frames` of
/// `wan_s2v_14B.py`): the last ones of the clip before, or zeros before the first.
pub const S2V_MOTION_FRAMES: usize = 73;

/// The negative prompt Wan2.2-S2V guides away from when none is given (its config's
/// `sample_neg_prompt`, `wan/configs/wan_s2v_14B.py`): blurred, worst quality, blurry
/// details, violent emotion, fast shaking hands, subtitles, ugly, mutilated, extra fingers,
/// badly drawn hands or face, deformed, disfigured, malformed or fused limbs, a still picture,
/// a cluttered background, three legs, crowds behind, walking backwards.
pub const S2V_NEGATIVE_PROMPT: &str = "画面模糊，最差质量，画面模糊，细节模糊不清，情绪激动剧烈，手快速抖动，字幕，丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走";

/// The latent motion frames S2V's frame packer reads at each scale, nearest first
/// (`zip_frame_buckets`).
const S2V_FRAME_PACK: [usize; 3] = [1, 2, 16];

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> Result<WanConfig, ConfigError> {
        let text = format!(
            r#"{{"num_attention_heads": 12, "attention_head_dim": 128, "ffn_dim": 8960, "num_layers": 30{extra}}}"#
        );
        WanConfig::from_json(&text, "config.json")
    }

    /// Each used to panic (a zero patch divided by zero; a string in it indexed past the
    /// end) or to fall back to a default silently (issue #31).
    #[test]
    fn malformed_fields_are_refused_by_name() {
        assert!(config("").is_ok());
        for (extra, named) in [
            (r#", "patch_size": [0, 2, 2]"#, "`patch_size` is [0,2,2]"),
            (r#", "patch_size": [1, 2, "2"]"#, "`patch_size`"),
            (r#", "patch_size": [1, 2]"#, "three positive integers"),
            (r#", "in_channels": "16""#, "`in_channels` is \"16\""),
            (r#", "text_dim": 0"#, "`text_dim` is 0"),
            (r#", "cross_attn_norm": "yes""#, "`cross_attn_norm`"),
            (r#", "eps": -1"#, "`eps` is -1"),
            (
                r#", "num_layers": 1000000000"#,
                "`num_layers` is 1000000000, above the 1024",
            ),
            // Their product wrapped (a panic in debug builds), found by tests/tests/fuzz.rs.
            (
                r#", "num_attention_heads": 8589934592, "attention_head_dim": 8589934592"#,
                "`num_attention_heads` is 8589934592, above the 1024",
            ),
        ] {
            let err = config(extra).expect_err(extra).to_string();
            assert!(err.contains(named) && err.contains("config.json"), "{extra}: {err}");
        }
    }

    /// The published S2V-14B list passes; one whose index is a prefix of another block's
    /// number is refused by name, as are a transformer motioner and a dropped last motion.
    #[test]
    fn s2v_lists_the_wan22_code_reads_otherwise_are_refused() {
        let s2v = |layers: usize, inject: &str, extra: &str| {
            WanConfig::from_json(
                &format!(
                    r#"{{"model_type": "s2v", "dim": 64, "ffn_dim": 96, "num_heads": 4, "num_layers": {layers},
                    "audio_dim": 32, "cond_dim": 16, "audio_inject_layers": {inject}, "enable_adain": true,
                    "enable_framepack": true, "enable_motioner": false, "zero_timestep": true,
                    "add_last_motion": true{extra}}}"#
                ),
                "config.json",
            )
        };
        let official = "[0, 4, 8, 12, 16, 20, 24, 27, 30, 33, 36, 39]";
        assert!(s2v(40, official, "").is_ok());
        assert!(s2v(11, "[0, 2]", "").is_ok());
        for (layers, inject, extra, named) in [
            (
                11,
                "[1, 4]",
                "",
                "lists block 1, which the wan22 code also finds in block 10",
            ),
            (40, "[2, 3]", "", "block 2, which the wan22 code also finds in block 20"),
            (
                40,
                official,
                r#", "add_last_motion": false"#,
                "`add_last_motion` is false",
            ),
            (
                40,
                official,
                r#", "enable_motioner": true"#,
                "`enable_motioner` is true",
            ),
        ] {
            let err = s2v(layers, inject, extra).expect_err(inject).to_string();
            assert!(err.contains(named), "{inject} {extra}: {err}");
        }
    }

    /// S2V-14B at 832 × 480, an 80-frame clip: 20 latent frames of 30 × 52 patches; the
    /// reference, one more such frame; the motion frames packed into 30 × 52 + 15 × 26 +
    /// 4 × 7 × 13 tokens (the wheel's Conv3d strides floor 60 / 8 and 104 / 8).
    #[test]
    fn an_s2v_clip_is_its_video_the_reference_and_the_packed_motion() {
        let s2v = WanConfig::wan22_s2v_14b();
        assert_eq!(s2v.latent_frames(80), 20);
        assert_eq!(s2v.video_tokens(80, 832, 480), 20 * 1560);
        assert_eq!(s2v.sequence_tokens(80, 832, 480), 20 * 1560 + 1560 + 1560 + 390 + 364);
        assert_eq!(s2v.condition_latent_elements(832, 480), 16 * 20 * 60 * 104);
        let t2v = WanConfig::wan21_t2v_14b();
        assert_eq!(t2v.sequence_tokens(81, 832, 480), 21 * 1560);
        assert_eq!(t2v.condition_latent_elements(832, 480), 0);
    }
}
