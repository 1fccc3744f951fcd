//! Generated tokens' log-probabilities in OpenAI's two shapes: a chat's `logprobs.content`
//! (one object per token, its alternatives inside) and a completion's parallel arrays
//! (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

use serde_json::{json, Value};
use tpinfer_engine::{TokenLogprobs, Tokenizer};

/// One token as the answer names it.
struct Token {
    text: String,
    logprob: f32,
}

impl Token {
    fn new(tokenizer: &Tokenizer, id: u32, logprob: f32) -> Self {
        Self {
            text: tokenizer.decode(&[id]).unwrap_or_default(),
            logprob,
        }
    }

    /// A chat entry's fields: `bytes` is the token's UTF-8, or null for a piece of a
    /// character (which decodes alone to U+FFFD).
    fn chat(&self) -> serde_json::Map<String, Value> {
        let bytes = match self.text.contains('\u{FFFD}') {
            true => Value::Null,
            false => json!(self.text.as_bytes()),
        };
        let mut fields = serde_json::Map::new();
        fields.insert("token".into(), json!(self.text));
        fields.insert("logprob".into(), json!(self.logprob));
        fields.insert("bytes".into(), bytes);
        fields
    }
}

struct Entry {
    token: Token,
    top: Vec<Token>,
}

/// The entries of tokens generated since the last answer took them.
pub(crate) struct LogprobsOut {
    chat: bool,
    pending: Vec<Entry>,
    /// Characters of the token texts before the pending ones (a completion's `text_offset`).
    offset: usize,
}

impl LogprobsOut {
    pub(crate) fn new(chat: bool) -> Self {
        Self {
            chat,
            pending: Vec::new(),
            offset: 0,
        }
    }

    pub(crate) fn push(&mut self, tokenizer: &Tokenizer, id: u32, logprobs: &TokenLogprobs) {
        self.pending.push(Entry {
            token: Token::new(tokenizer, id, logprobs.logprob),
            top: logprobs
                .top
                .iter()
                .map(|&(id, lp)| Token::new(tokenizer, id, lp))
                .collect(),
        });
    }

    /// The pending entries in the endpoint's shape, taken.
    pub(crate) fn take(&mut self) -> Value {
        let entries = std::mem::take(&mut self.pending);
        if self.chat {
            let content: Vec<Value> = entries
                .iter()
                .map(|e| {
                    let mut fields = e.token.chat();
                    let top: Vec<Value> = e.top.iter().map(|t| Value::Object(t.chat())).collect();
                    fields.insert("top_logprobs".into(), json!(top));
                    Value::Object(fields)
                })
                .collect();
            return json!({ "content": content });
        }
        let mut offsets = Vec::with_capacity(entries.len());
        for e in &entries {
            offsets.push(self.offset);
            self.offset += e.token.text.chars().count();
        }
        // Alternatives keyed by their text: two tokens that read alike keep the likelier.
        let top: Vec<Value> = entries
            .iter()
            .map(|e| {
                let mut map = serde_json::Map::new();
                for t in e.top.iter().rev() {
                    map.insert(t.text.clone(), json!(t.logprob));
                }
                Value::Object(map)
            })
            .collect();
        json!({
            "tokens": entries.iter().map(|e| e.token.text.as_str()).collect::<Vec<_>>(),
            "token_logprobs": entries.iter().map(|e| e.token.logprob).collect::<Vec<_>>(),
            "top_logprobs": top,
            "text_offset": offsets,
        })
    }
}
