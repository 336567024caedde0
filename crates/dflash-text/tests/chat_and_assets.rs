//! Chat templates (the SmolLM2 ChatML template, HF extras) and [`TextAssets`] loading, including errors.

mod common;

use std::path::Path;

use dflash_text::{
    ChatMessage, ChatTemplate, GgufVocab, RenderOptions, TextAssets, TextError, TextTokenizer,
};

const SMOLLM2_RENDERED: &str = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by \
Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";

fn france() -> Vec<ChatMessage> {
    vec![ChatMessage::new("user", "What is the capital of France?")]
}

fn agp() -> RenderOptions {
    RenderOptions {
        add_generation_prompt: true,
        ..Default::default()
    }
}

#[test]
fn smollm2_chat_template_renders_exactly() {
    let Some(assets) = common::smollm2_assets("smollm2_chat_template_renders_exactly") else {
        return;
    };
    let t = assets
        .chat_template
        .as_ref()
        .expect("GGUF has a chat template");
    assert_eq!(t.render(&france(), &agp()).unwrap(), SMOLLM2_RENDERED);
    let no_prompt = t.render(&france(), &RenderOptions::default()).unwrap();
    assert_eq!(
        no_prompt,
        SMOLLM2_RENDERED.trim_end_matches("<|im_start|>assistant\n")
    );
    // A system message replaces the default one.
    let msgs = vec![
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi"),
    ];
    assert_eq!(
        t.render(&msgs, &agp()).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(assets.bos_token.as_deref(), Some("<|im_start|>"));
    assert_eq!(t.eos_token(), Some("<|im_end|>"));
    assert!(!assets.add_bos);
}

#[test]
fn raise_exception_fails_with_its_message() {
    let src = "{% if messages[0].role != 'system' %}{{ raise_exception('Conversations must start with a system \
               message, got ' + messages[0].role) }}{% endif %}ok";
    let t = ChatTemplate::new(src, None, None).unwrap();
    let e = t.render(&france(), &agp()).unwrap_err();
    assert!(matches!(e, TextError::TemplateRender(_)), "{e:?}");
    assert!(
        e.to_string()
            .contains("Conversations must start with a system message, got user"),
        "{e}"
    );
    let ok = t
        .render(&[ChatMessage::new("system", "s")], &agp())
        .unwrap();
    assert_eq!(ok, "ok");
}

#[test]
fn template_syntax_error_is_reported_at_construction() {
    let e = ChatTemplate::new("{% for m in messages %}{{ m.content }}", None, None).unwrap_err();
    assert!(matches!(e, TextError::TemplateSyntax(_)), "{e:?}");
}

#[test]
fn hf_style_template_features() {
    // Qwen3-like pieces: namespace, reversed loops, string methods, tools | tojson, enable_thinking.
    let src = r#"{%- if tools %}{{- '<tools>' }}{%- for tool in tools %}{{- '
' + (tool | tojson) }}{%- endfor %}{{- '
</tools>
' }}{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages[::-1] %}{%- if ns.last_user == -1 and m.role == 'user' %}{%- set ns.last_user = messages|length - 1 - loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
    {%- if m.content.startswith('<think>') %}{{- m.content.split('</think>')[-1].lstrip('\n') }}{%- else %}{{- m.role + ':' + m.content.strip() }}{%- endif %}
    {{- '|' }}
{%- endfor %}
{{- ns.last_user }}
{%- if add_generation_prompt %}{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"#;
    let t = ChatTemplate::new(src, None, None).unwrap();
    let msgs = vec![
        ChatMessage::new("user", "  hi  "),
        ChatMessage::new("assistant", "<think>x</think>\n\nyo"),
        ChatMessage::new("user", "q"),
    ];
    let opts = RenderOptions {
        add_generation_prompt: true,
        enable_thinking: Some(false),
        tools: Some(
            serde_json::json!([{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": "é"}}}]),
        ),
    };
    assert_eq!(
        t.render(&msgs, &opts).unwrap(),
        "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"b\": 1, \"a\": \"é\"}}}\n</tools>\n\
         user:hi|yo|user:q|2<think>\n\n</think>\n\n"
    );
    let plain = RenderOptions {
        add_generation_prompt: true,
        ..Default::default()
    };
    assert_eq!(t.render(&msgs, &plain).unwrap(), "user:hi|yo|user:q|2");
}

#[test]
fn missing_or_corrupt_tokenizer_json_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("tokenizer.json");
    let e = TextTokenizer::from_file(&missing).unwrap_err();
    assert!(matches!(e, TextError::Io { .. }), "{e:?}");
    assert!(
        e.to_string().contains(&missing.display().to_string()),
        "{e}"
    );

    std::fs::write(&missing, "{\"version\": \"1.0\", \"model\": ").unwrap();
    let e = TextTokenizer::from_file(&missing).unwrap_err();
    assert!(matches!(e, TextError::Parse { .. }), "{e:?}");
    assert!(
        e.to_string().contains(&missing.display().to_string()),
        "{e}"
    );
    assert!(e.to_string().contains("tokenizer.json"), "{e}");

    let e = TextAssets::from_hf_dir(dir.path()).unwrap_err();
    assert!(
        e.to_string().contains(&missing.display().to_string()),
        "{e}"
    );
}

#[test]
fn unsupported_gguf_model_is_refused() {
    let v = GgufVocab {
        model: "llama".into(),
        tokens: vec!["<unk>".into()],
        ..Default::default()
    };
    let e = TextTokenizer::from_gguf_vocab(&v).unwrap_err();
    assert!(matches!(e, TextError::Unsupported(_)), "{e:?}");
    assert!(e.to_string().contains("\"llama\""), "{e}");
}

fn write(dir: &Path, name: &str, content: &str) {
    std::fs::write(dir.join(name), content).unwrap();
}

#[test]
fn text_assets_from_hf_dir() {
    let Some(gguf) = common::smollm2_assets("text_assets_from_hf_dir") else {
        return;
    };
    let v = common::smollm2_vocab("text_assets_from_hf_dir").unwrap();
    let template = v.chat_template.clone().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "tokenizer.json", &gguf.tokenizer.to_json(false).unwrap());
    let config = serde_json::json!({
        "chat_template": template,
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "lstrip": false, "normalized": false, "rstrip": false,
                      "single_word": false, "special": true},
        "pad_token": null,
    });
    write(d, "tokenizer_config.json", &config.to_string());
    write(
        d,
        "generation_config.json",
        r#"{"bos_token_id": 1, "eos_token_id": [0, 2]}"#,
    );

    let a = TextAssets::from_hf_dir(d).unwrap();
    assert_eq!(a.eos_token_ids, vec![0, 2]);
    assert_eq!(a.bos_token.as_deref(), Some("<|im_start|>"));
    assert!(!a.add_bos);
    let t = a.chat_template.as_ref().unwrap();
    assert_eq!(t.eos_token(), Some("<|im_end|>"));
    let rendered = t.render(&france(), &agp()).unwrap();
    assert_eq!(rendered, SMOLLM2_RENDERED);
    // The serialised tokenizer encodes exactly like the GGUF-built one.
    for text in [rendered.as_str(), "🦀 a  12 日本語\n\n", "<|endoftext|>x"] {
        assert_eq!(
            a.tokenizer.encode(text, true).unwrap(),
            gguf.tokenizer.encode(text, true).unwrap()
        );
    }

    // chat_template.jinja wins over tokenizer_config.json; a single eos id and add_bos_token are honoured.
    write(
        d,
        "chat_template.jinja",
        "{{ bos_token }}J{{ eos_token }}\n",
    );
    let mut cfg = config.clone();
    cfg["add_bos_token"] = true.into();
    write(d, "tokenizer_config.json", &cfg.to_string());
    write(d, "generation_config.json", r#"{"eos_token_id": 2}"#);
    let a = TextAssets::from_hf_dir(d).unwrap();
    assert_eq!(a.eos_token_ids, vec![2]);
    assert!(a.add_bos);
    assert_eq!(
        a.tokenizer.encode("Hello world", true).unwrap(),
        vec![1, 19556, 905]
    );
    assert_eq!(
        a.tokenizer.encode("Hello world", false).unwrap(),
        vec![19556, 905]
    );
    let r = a
        .chat_template
        .as_ref()
        .unwrap()
        .render(&france(), &agp())
        .unwrap();
    assert_eq!(r, "<|im_start|>J<|im_end|>");

    // A list of named templates: "default" is taken. No generation_config: eos from tokenizer_config.
    std::fs::remove_file(d.join("chat_template.jinja")).unwrap();
    std::fs::remove_file(d.join("generation_config.json")).unwrap();
    let mut cfg = config.clone();
    cfg["chat_template"] = serde_json::json!([
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "D{{ messages | length }}"},
    ]);
    write(d, "tokenizer_config.json", &cfg.to_string());
    let a = TextAssets::from_hf_dir(d).unwrap();
    assert_eq!(a.eos_token_ids, vec![2]);
    let r = a
        .chat_template
        .as_ref()
        .unwrap()
        .render(&france(), &agp())
        .unwrap();
    assert_eq!(r, "D1");
}

#[test]
fn text_assets_config_errors_name_the_file() {
    // A tiny byte-level tokenizer, so this test needs no GGUF.
    let mut tokens: Vec<String> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
        .into_iter()
        .map(|c| c.to_string())
        .collect();
    tokens.sort();
    tokens.push("</s>".into());
    let mut token_types = vec![1; tokens.len()];
    *token_types.last_mut().unwrap() = 3;
    let v = GgufVocab {
        model: "gpt2".into(),
        tokens,
        token_types,
        merges: vec!["a b".into()],
        ..Default::default()
    };
    let mut v = v;
    v.tokens.push("ab".into());
    v.token_types.push(1);
    let tok = TextTokenizer::from_gguf_vocab(&v).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "tokenizer.json", &tok.to_json(true).unwrap());

    // Only tokenizer.json: no template, no eos.
    let a = TextAssets::from_hf_dir(d).unwrap();
    assert!(a.chat_template.is_none() && a.eos_token_ids.is_empty() && !a.add_bos);

    let cases = [
        ("tokenizer_config.json", "[1, 2]", "a JSON object"),
        ("tokenizer_config.json", "{\"eos_token\": 5}", "eos_token"),
        (
            "tokenizer_config.json",
            "{\"eos_token\": {\"lstrip\": true}}",
            "content",
        ),
        (
            "tokenizer_config.json",
            "{\"chat_template\": [{\"name\": \"x\", \"template\": \"y\"}]}",
            "default",
        ),
        (
            "tokenizer_config.json",
            "{\"chat_template\": \"{% if %}\"}",
            "compile",
        ),
        (
            "tokenizer_config.json",
            "{\"add_bos_token\": \"yes\"}",
            "boolean",
        ),
        (
            "tokenizer_config.json",
            "{\"add_bos_token\": true, \"bos_token\": \"<nope>\"}",
            "<nope>",
        ),
        (
            "generation_config.json",
            "{\"eos_token_id\": \"x\"}",
            "token id",
        ),
        ("generation_config.json", "not json", "JSON"),
    ];
    for (file, content, needle) in cases {
        let _ = std::fs::remove_file(d.join("tokenizer_config.json"));
        let _ = std::fs::remove_file(d.join("generation_config.json"));
        write(d, file, content);
        let e = TextAssets::from_hf_dir(d).unwrap_err().to_string();
        assert!(e.contains(needle), "{file} {content}: {e}");
        if !needle.contains("compile") {
            assert!(e.contains(file), "{file} {content}: {e}");
        }
    }

    // eos_token as an AddedToken object resolves through the vocabulary.
    let _ = std::fs::remove_file(d.join("generation_config.json"));
    write(
        d,
        "tokenizer_config.json",
        r#"{"eos_token": {"content": "</s>"}}"#,
    );
    let a = TextAssets::from_hf_dir(d).unwrap();
    assert_eq!(a.eos_token_ids, vec![tok.token_to_id("</s>").unwrap()]);
}
