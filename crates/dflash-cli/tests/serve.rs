//! `dflash serve` end to end on SmolLM2 with the shipped drafter: a greedy chat completion
//! (DDTree verification) and its streamed twin carry exactly `generate --mode ar`'s text; a prompt
//! longer than the context is a 400; a port already taken is a clear error.

mod common;
use common::{dflash, run, smollm2};
use std::io::{BufRead, BufReader};
use std::process::Stdio;

const PROMPT: &str = "Name three colours.";
const TOKENS: usize = 24;

fn post(addr: &str, path: &str, body: &str) -> (u16, String) {
    dflash_serve::http::call(addr, "POST", path, Some(body)).unwrap()
}

#[test]
fn served_greedy_answers_equal_generate_ar() {
    let Some(gguf) = smollm2() else { return };
    let (code, out, err) = run(dflash()
        .args(["generate", "--mode", "ar", "--json", "--prompt", PROMPT])
        .args(["--max-new-tokens", &TOKENS.to_string(), "--target"])
        .arg(&gguf));
    assert_eq!(code, 0, "{err}");
    let want = serde_json::from_str::<serde_json::Value>(&out).unwrap()["text"]
        .as_str()
        .unwrap()
        .to_string();
    let mut child = dflash()
        .args([
            "serve",
            "--mode",
            "ddtree",
            "--port",
            "0",
            "--stop-after",
            "3",
            "--target",
        ])
        .arg(&gguf)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let addr = first
        .split("http://")
        .nth(1)
        .and_then(|a| a.strip_suffix("/v1"))
        .unwrap_or_else(|| panic!("no address in {first:?}"))
        .to_string();
    let body = format!(
        r#"{{"messages":[{{"role":"user","content":"{PROMPT}"}}],"temperature":0,"max_tokens":{TOKENS}}}"#
    );
    let (status, out) = post(&addr, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v["choices"][0]["message"]["content"],
        want.as_str(),
        "{out}"
    );
    assert_eq!(v["dflash"]["mode"], "ddtree");
    assert!(v["dflash"]["acceptance_length_mean"].as_f64().unwrap() >= 1.0);
    // the same, streamed
    let streamed = body.replace("\"temperature\"", "\"stream\":true,\"temperature\"");
    let (status, out) = post(&addr, "/v1/chat/completions", &streamed);
    assert_eq!(status, 200, "{out}");
    let text: String = out
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
        .filter_map(|e| {
            let c: serde_json::Value = serde_json::from_str(e).unwrap();
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(text, want);
    // a prompt past the context (8192 positions) is the client's error
    let long = format!(r#"{{"prompt":"{}","max_tokens":4}}"#, "word ".repeat(9000));
    let (status, out) = post(&addr, "/v1/completions", &long);
    assert_eq!(status, 400, "{out}");
    assert!(out.contains("does not fit the context"), "{out}");
    assert!(child.wait().unwrap().success());
    // the port is now free again, but one held by another listener is refused clearly
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port().to_string();
    let (code, _, err) = run(dflash()
        .args(["serve", "--mode", "ar", "--port", &port, "--target"])
        .arg(&gguf));
    assert_ne!(code, 0);
    assert!(err.contains("listening on 127.0.0.1"), "{err}");
}
