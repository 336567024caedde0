//! The endpoint over a real socket, against a scripted engine: response shapes, streaming, stop
//! strings (and the cancellation they trigger), token budgets and errors.

use dflash_serve::{
    serve, Engine, EngineError, FinishReason, GenOutcome, GenRequest, Prompt, ServerOptions,
};
use serde_json::{json, Value};
use std::net::TcpListener;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

const PIECES: [&str; 6] = ["Hello", ",", " world", "!", " STOP", " after"];

/// Each request the engine ran, with how many pieces it emitted.
type Record = Arc<Mutex<Vec<(GenRequest, usize)>>>;

/// Emits [`PIECES`] one "token" each, stopping at the budget or when cancelled (after the piece
/// it is emitting, as the decoding loops do); records what it was asked and how many it emitted.
struct Scripted {
    seen: Record,
}

impl Engine for Scripted {
    fn model_id(&self) -> &str {
        "scripted"
    }
    fn generate(
        &mut self,
        req: &GenRequest,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenOutcome, EngineError> {
        if let Prompt::Text(t) = &req.prompt {
            if t == "too long" {
                return Err(EngineError::BadRequest("prompt of 9999 tokens".into()));
            }
        }
        let mut emitted = 0;
        for p in PIECES.iter().take(req.max_tokens) {
            on_text(p);
            emitted += 1;
            if req.cancel.load(Ordering::Relaxed) {
                break;
            }
        }
        self.seen.lock().unwrap().push((req.clone(), emitted));
        Ok(GenOutcome {
            prompt_tokens: 3,
            completion_tokens: emitted,
            finish: if emitted == req.max_tokens {
                FinishReason::Length
            } else {
                FinishReason::Stop
            },
            stats: json!({"mode": "scripted"}),
        })
    }
}

/// Starts a server for `requests` connections; returns its address and the engine's record.
fn start(requests: usize) -> (String, Record) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let seen = Arc::new(Mutex::new(vec![]));
    let mut engine = Scripted { seen: seen.clone() };
    std::thread::spawn(move || {
        let opts = ServerOptions {
            stop_after: Some(requests),
            quiet: true,
            ..Default::default()
        };
        serve(&listener, &mut engine, &opts).unwrap();
    });
    (addr, seen)
}

/// Sends one request; returns the status and the body.
fn call(addr: &str, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    dflash_serve::http::call(addr, method, path, body).unwrap()
}

fn json_of(s: &str) -> Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("{e}: {s}"))
}

#[test]
fn a_chat_completion_carries_the_text_usage_and_stats() {
    let (addr, seen) = start(2);
    let body = r#"{"model":"scripted","messages":[{"role":"user","content":"hi"}],"temperature":0,"seed":5}"#;
    let (status, out) = call(&addr, "POST", "/v1/chat/completions", Some(body));
    assert_eq!(status, 200, "{out}");
    let v = json_of(&out);
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "scripted");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], PIECES.concat());
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9})
    );
    assert_eq!(v["dflash"]["mode"], "scripted");
    let (req, _) = seen.lock().unwrap()[0].clone();
    assert_eq!(
        (req.sampling.temperature, req.sampling.seed, req.max_tokens),
        (0.0, 5, 256)
    );
    let (status, out) = call(&addr, "GET", "/v1/models", None);
    assert_eq!(
        (status, json_of(&out)["data"][0]["id"].clone()),
        (200, json!("scripted"))
    );
}

#[test]
fn a_stop_string_cuts_the_text_and_cancels_the_generation() {
    let (addr, seen) = start(2);
    let body = r#"{"prompt":"x","stop":[" STOP","zzz"],"max_tokens":50}"#;
    let (status, out) = call(&addr, "POST", "/v1/completions", Some(body));
    assert_eq!(status, 200, "{out}");
    let v = json_of(&out);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "Hello, world!");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // the engine stopped right after the piece that completed the stop string
    assert_eq!(seen.lock().unwrap()[0].1, 5);
    // the budget: two tokens, finish "length"
    let (_, out) = call(
        &addr,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt":"x","max_tokens":2}"#),
    );
    let v = json_of(&out);
    assert_eq!(
        (
            v["choices"][0]["text"].clone(),
            v["choices"][0]["finish_reason"].clone()
        ),
        (json!("Hello,"), json!("length"))
    );
}

#[test]
fn a_streamed_chat_sends_deltas_a_finish_usage_and_done() {
    let (addr, _) = start(1);
    let body = r#"{"messages":[{"role":"user","content":"hi"}],"stream":true,"stop":"!","stream_options":{"include_usage":true}}"#;
    let (status, out) = call(&addr, "POST", "/v1/chat/completions", Some(body));
    assert_eq!(status, 200);
    let events: Vec<&str> = out
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").expect("every event is data"))
        .collect();
    assert_eq!(*events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| json_of(e))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "Hello, world");
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, [&json!("stop")]);
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 4);
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
}

#[test]
fn bad_requests_get_openai_errors_with_their_status() {
    let (addr, _) = start(6);
    let cases = [
        (
            "POST",
            "/v1/completions",
            Some(r#"{"prompt":"too long"}"#),
            400,
        ),
        ("POST", "/v1/chat/completions", Some("{not json"), 400),
        (
            "POST",
            "/v1/chat/completions",
            Some(r#"{"model":"gpt-4","messages":[{"role":"user","content":"x"}]}"#),
            404,
        ),
        ("GET", "/v1/chat/completions", None, 405),
        ("POST", "/v2/anything", Some("{}"), 404),
        ("GET", "/health", None, 200),
    ];
    for (method, path, body, want) in cases {
        let (status, out) = call(&addr, method, path, body);
        assert_eq!(status, want, "{method} {path}: {out}");
        let v = json_of(&out);
        if want != 200 {
            assert!(
                v["error"]["message"]
                    .as_str()
                    .is_some_and(|m| !m.is_empty()),
                "{out}"
            );
            assert!(v["error"]["type"].is_string(), "{out}");
        }
    }
}

/// Blocks each generation until the test releases it, so requests pile up behind it.
struct Gated {
    gate: std::sync::mpsc::Receiver<()>,
}

impl Engine for Gated {
    fn model_id(&self) -> &str {
        "gated"
    }
    fn generate(
        &mut self,
        _req: &GenRequest,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenOutcome, EngineError> {
        self.gate
            .recv()
            .map_err(|e| EngineError::Internal(e.to_string()))?;
        on_text("done");
        Ok(GenOutcome {
            prompt_tokens: 1,
            completion_tokens: 1,
            finish: FinishReason::Stop,
            stats: json!({}),
        })
    }
}

#[test]
fn health_answers_while_the_engine_works_and_a_full_queue_is_a_503() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (release, gate) = std::sync::mpsc::channel();
    let server = std::thread::spawn(move || {
        let opts = ServerOptions {
            stop_after: Some(4),
            max_queue: 1,
            quiet: true,
            ..Default::default()
        };
        serve(&listener, &mut Gated { gate }, &opts).unwrap();
    });
    let body = r#"{"prompt":"x"}"#;
    let spawn_call = |path: &'static str, body: Option<&'static str>| {
        let (addr, (tx, rx)) = (addr.clone(), std::sync::mpsc::channel());
        let method = if body.is_some() { "POST" } else { "GET" };
        std::thread::spawn(move || tx.send(call(&addr, method, path, body)).unwrap());
        rx
    };
    let wait = std::time::Duration::from_secs(20);
    // the first completion holds the engine; the second waits in the queue
    let first = spawn_call("/v1/completions", Some(body));
    std::thread::sleep(std::time::Duration::from_millis(300));
    let second = spawn_call("/v1/completions", Some(body));
    std::thread::sleep(std::time::Duration::from_millis(300));
    let (status, out) = spawn_call("/health", None)
        .recv_timeout(wait)
        .expect("health while busy");
    assert_eq!(
        (status, json_of(&out)["requests_pending"].clone()),
        (200, json!(2)),
        "{out}"
    );
    // a third finds the queue full
    let (status, out) = spawn_call("/v1/completions", Some(body))
        .recv_timeout(wait)
        .unwrap();
    assert_eq!(status, 503, "{out}");
    assert!(json_of(&out)["error"]["message"]
        .as_str()
        .unwrap()
        .contains("busy"));
    release.send(()).unwrap();
    release.send(()).unwrap();
    for rx in [first, second] {
        let (status, out) = rx.recv_timeout(wait).unwrap();
        assert_eq!(
            (status, json_of(&out)["choices"][0]["text"].clone()),
            (200, json!("done"))
        );
    }
    server.join().unwrap();
}

#[test]
fn an_api_key_guards_the_v1_routes_but_not_health() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let seen = Arc::new(Mutex::new(vec![]));
    let mut engine = Scripted { seen };
    let server = std::thread::spawn(move || {
        let opts = ServerOptions {
            stop_after: Some(4),
            api_key: Some("s3cret".into()),
            quiet: true,
            ..Default::default()
        };
        serve(&listener, &mut engine, &opts).unwrap();
    });
    let (status, out) = call(&addr, "GET", "/v1/models", None);
    assert_eq!(status, 401, "{out}");
    assert_eq!(json_of(&out)["error"]["type"], "authentication_error");
    assert_eq!(call(&addr, "GET", "/health", None).0, 200);
    let with = |key: &str| {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        use std::io::{Read, Write};
        write!(
            s,
            "GET /v1/models HTTP/1.1\r\nAuthorization: Bearer {key}\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out.split(' ').nth(1).unwrap().to_string()
    };
    assert_eq!(with("wrong"), "401");
    assert_eq!(with("s3cret"), "200");
    server.join().unwrap();
}
