//! A tiny Wan text-to-video pipeline in diffusers' layout: `model_index.json`, a Unigram
//! `tokenizer/` that appends `</s>` (as umT5's does), `text_encoder/` (a tiny umT5 whose width
//! is the DiT's text width), `transformer/` (a tiny Wan DiT) and `vae/` (a tiny Wan VAE).

use std::path::{Path, PathBuf};

use serde_json::json;

use crate::{TinyUmt5, TinyWan, TinyWanVae};

/// `</s>`: the id umT5's tokenizer appends.
pub const END_OF_TEXT: u32 = 1;

/// The pipeline's parts.
#[derive(Debug, Clone)]
pub struct TinyWanPipeline {
    pub encoder: TinyUmt5,
    pub dit: TinyWan,
    /// Written as `vae/` when there is one.
    pub vae: Option<TinyWanVae>,
}

impl Default for TinyWanPipeline {
    fn default() -> Self {
        let dit = TinyWan::default();
        let encoder = TinyUmt5 {
            d_model: dit.text_dim,
            d_kv: 4,
            ..TinyUmt5::default()
        };
        let vae = TinyWanVae {
            z_dim: dit.channels,
            ..TinyWanVae::default()
        };
        Self {
            encoder,
            dit,
            vae: Some(vae),
        }
    }
}

impl TinyWanPipeline {
    /// Writes the pipeline into `dir`; returns `dir`.
    pub fn write(&self, dir: &Path) -> PathBuf {
        std::fs::create_dir_all(dir.join("text_encoder")).expect("create text_encoder");
        std::fs::create_dir_all(dir.join("tokenizer")).expect("create tokenizer");
        let index = json!({
            "_class_name": "WanPipeline",
            "_diffusers_version": "0.35.0",
            "scheduler": ["diffusers", "UniPCMultistepScheduler"],
            "text_encoder": ["transformers", "UMT5EncoderModel"],
            "tokenizer": ["transformers", "T5TokenizerFast"],
            "transformer": ["diffusers", "WanTransformer3DModel"],
            "vae": ["diffusers", "AutoencoderKLWan"]
        });
        std::fs::write(dir.join("model_index.json"), index.to_string()).expect("model_index.json");
        self.encoder.write(&dir.join("text_encoder"));
        self.dit.write(&dir.join("transformer"));
        if let Some(vae) = &self.vae {
            vae.write(&dir.join("vae"));
        }
        write_unigram_tokenizer(&dir.join("tokenizer"), self.encoder.vocab);
        dir.to_path_buf()
    }
}

/// A Unigram tokenizer over `▁` and the letters, alone and after `▁`, with T5's `<pad>`,
/// `</s>`, `<unk>` first and a post-processor appending `</s>`; at most `vocab` pieces.
fn write_unigram_tokenizer(dir: &Path, vocab: usize) {
    use tokenizers::models::unigram::Unigram;
    use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
    use tokenizers::processors::template::TemplateProcessing;
    use tokenizers::AddedToken;

    let mut pieces: Vec<(String, f64)> = ["<pad>", "</s>", "<unk>"]
        .iter()
        .map(|p| (p.to_string(), 0.0))
        .collect();
    pieces.push(("▁".into(), -2.0));
    for c in 'a'..='z' {
        pieces.push((c.to_string(), -3.0));
        pieces.push((format!("▁{c}"), -2.5));
    }
    assert!(
        pieces.len() <= vocab,
        "{} pieces for a vocabulary of {vocab}",
        pieces.len()
    );
    let model = Unigram::from(pieces, Some(2), false).expect("unigram");
    let mut tokenizer = tokenizers::Tokenizer::new(model);
    tokenizer.with_pre_tokenizer(Some(Metaspace::new('▁', PrependScheme::Always, true)));
    tokenizer
        .add_special_tokens([
            AddedToken::from("<pad>", true),
            AddedToken::from("</s>", true),
            AddedToken::from("<unk>", true),
        ])
        .expect("special tokens");
    let processor = TemplateProcessing::builder()
        .try_single("$A </s>")
        .expect("template")
        .special_tokens(vec![("</s>".to_string(), END_OF_TEXT)])
        .build()
        .expect("processor");
    tokenizer.with_post_processor(Some(processor));
    tokenizer
        .save(dir.join("tokenizer.json"), false)
        .expect("save tokenizer");
}
