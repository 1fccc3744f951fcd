use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::{ChatTemplate, TokenizerError};

/// Llama 3's pre-tokenizer split (llama.cpp's `llama-bpe`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's (llama.cpp's `qwen2`): Llama 3's, but digits one at a time.
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF token types (llama.cpp's `llama_token_type`).
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;

fn err(detail: impl Into<String>) -> TokenizerError {
    TokenizerError::Gguf(detail.into())
}

fn strings<'a>(metadata: &'a HashMap<String, Value>, key: &str) -> Result<Vec<&'a str>, TokenizerError> {
    metadata
        .get(key)
        .ok_or_else(|| err(format!("missing `{key}`")))?
        .to_vec()
        .map_err(|e| err(format!("`{key}`: {e}")))?
        .iter()
        .map(|v| {
            v.to_string()
                .map(String::as_str)
                .map_err(|e| err(format!("`{key}`: {e}")))
        })
        .collect()
}

/// Builds a byte-level BPE tokenizer (GGUF `tokenizer.ggml.model = gpt2`) from the vocabulary,
/// merges and token types in the metadata, with the pre-tokenizer that `tokenizer.ggml.pre`
/// names; and its chat template and BOS and EOS tokens.
pub(crate) fn tokenizer_from_gguf(metadata: &HashMap<String, Value>) -> Result<crate::Tokenizer, TokenizerError> {
    let model = metadata
        .get("tokenizer.ggml.model")
        .and_then(|v| v.to_string().ok())
        .ok_or_else(|| err("missing `tokenizer.ggml.model`"))?;
    if model != "gpt2" {
        return Err(err(format!(
            "tokenizer model `{model}` is not supported (only byte-level BPE, `gpt2`); use the model's tokenizer.json"
        )));
    }
    let tokens = strings(metadata, "tokenizer.ggml.tokens")?;
    let merges = strings(metadata, "tokenizer.ggml.merges")?;
    let types: Vec<i32> = match metadata.get("tokenizer.ggml.token_type") {
        Some(v) => v
            .to_vec()
            .map_err(|e| err(e.to_string()))?
            .iter()
            .map(|t| t.to_i32().map_err(|e| err(e.to_string())))
            .collect::<Result<_, _>>()?,
        None => vec![1; tokens.len()],
    };
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    let merges: Vec<(String, String)> = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| err(format!("merge `{m}` is not two tokens")))
        })
        .collect::<Result<_, _>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| err(e.to_string()))?;
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    let pre = metadata
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.to_string().ok())
        .map(String::as_str)
        .unwrap_or("gpt2");
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
    // Qwen2's tokenizer.json composes the text (NFC) before it splits it.
    if pre == "qwen2" {
        tokenizer
            .with_normalizer(Some(NFC))
            .map_err(|e| err(format!("the NFC normalizer: {e}")))?;
    }
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    let special: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(_, &t)| t == CONTROL || t == USER_DEFINED)
        .map(|(t, _)| AddedToken::from(t.to_string(), true))
        .collect();
    tokenizer
        .add_special_tokens(special)
        .map_err(|e| err(format!("the special tokens: {e}")))?;

    let token_of = |key: &str| {
        metadata
            .get(key)
            .and_then(|v| v.to_u32().ok())
            .and_then(|id| tokens.get(id as usize))
            .map(|t| t.to_string())
    };
    let bos = token_of("tokenizer.ggml.bos_token_id");
    let add_bos = metadata
        .get("tokenizer.ggml.add_bos_token")
        .and_then(|v| v.to_bool().ok())
        .unwrap_or(false);
    if let (true, Some(bos)) = (add_bos, &bos) {
        let bos_id = tokens.iter().position(|t| t == bos).unwrap_or_default() as u32;
        let processor = TemplateProcessing::builder()
            .try_single(format!("{bos} $A"))
            .and_then(|b| b.try_pair(format!("{bos} $A {bos} $B")))
            .map_err(|e| err(e.to_string()))?
            .special_tokens(vec![(bos.clone(), bos_id)])
            .build()
            .map_err(|e| err(e.to_string()))?;
        tokenizer.with_post_processor(Some(processor));
    }
    let bos_eos = (
        bos.unwrap_or_default(),
        token_of("tokenizer.ggml.eos_token_id").unwrap_or_default(),
    );
    let chat_template = metadata
        .get("tokenizer.chat_template")
        .and_then(|v| v.to_string().ok())
        .map(|source| ChatTemplate::new(source.clone(), &bos_eos.0, &bos_eos.1));
    Ok(crate::Tokenizer {
        inner: tokenizer,
        chat_template,
        bos_eos,
    })
}

fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper, TokenizerError> {
    Ok(match pre {
        "llama-bpe" | "llama3" | "qwen2" => {
            let pattern = if pre == "qwen2" { QWEN2_SPLIT } else { LLAMA3_SPLIT };
            let split = Split::new(
                SplitPattern::Regex(pattern.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| err(e.to_string()))?;
            Sequence::new(vec![split.into(), ByteLevel::new(false, true, false).into()]).into()
        }
        // SmolLM's tokenizer.json: single digits, then GPT-2's byte-level split.
        "smollm" => Sequence::new(vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()]).into(),
        _ => ByteLevel::new(false, true, true).into(),
    })
}
