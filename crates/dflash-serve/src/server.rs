//! The accept loop and the routes: each connection is read, answered and closed before the next
//! is taken (batch-1 engines), so requests are served in arrival order.
//!
//! Invariants: a streamed response's head is written only once the engine has produced text or
//! finished, so a request the engine refuses (a prompt longer than the context) still gets its
//! 4xx status; a client that goes away mid-stream cancels its generation; every request is
//! logged as one line on stderr unless [`ServerOptions::quiet`].

use crate::http::{self, Request};
use crate::openai::{self, ApiError, Endpoint, Envelope};
use crate::stop::StopFilter;
use crate::{Engine, EngineError, FinishReason, GenRequest, ServeError};
use serde_json::{json, Value};
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How the server behaves.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// `max_tokens` of requests that name none.
    pub default_max_tokens: usize,
    /// The largest request body accepted (bytes).
    pub max_body: usize,
    /// How long a client may take to send its request, or to take a write of the answer.
    pub read_timeout: Duration,
    /// Return after this many connections (tests and scripts); `None`: serve forever.
    pub stop_after: Option<usize>,
    /// No per-request log lines.
    pub quiet: bool,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            default_max_tokens: 256,
            max_body: 16 << 20,
            read_timeout: Duration::from_secs(30),
            stop_after: None,
            quiet: false,
        }
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Serves `engine` on `listener` until [`ServerOptions::stop_after`] connections were handled
/// (forever without it).
pub fn serve(
    listener: &TcpListener,
    engine: &mut dyn Engine,
    opts: &ServerOptions,
) -> Result<(), ServeError> {
    let mut served = 0usize;
    for conn in listener.incoming() {
        let mut stream = match conn {
            Ok(s) => s,
            // a connection that failed before it was accepted is the client's problem
            Err(_) => continue,
        };
        served += 1;
        let _ = stream.set_read_timeout(Some(opts.read_timeout));
        // a client that stops reading fails the write (and cancels its stream) instead of
        // holding the server
        let _ = stream.set_write_timeout(Some(opts.read_timeout));
        let _ = stream.set_nodelay(true);
        handle(&mut stream, engine, opts, served as u64);
        if opts.stop_after.is_some_and(|n| served >= n) {
            break;
        }
    }
    Ok(())
}

fn send_json(stream: &mut TcpStream, status: u16, v: &Value) {
    let _ = http::write_response(stream, status, "application/json", v.to_string().as_bytes());
}

fn send_error(stream: &mut TcpStream, e: &ApiError) {
    send_json(stream, e.status, &e.body());
}

fn handle(stream: &mut TcpStream, engine: &mut dyn Engine, opts: &ServerOptions, n: u64) {
    let req = match http::read_request(stream, opts.max_body) {
        Ok(Some(r)) => r,
        Ok(None) => return,
        Err(e) => {
            send_error(
                stream,
                &ApiError {
                    status: e.status,
                    message: e.message,
                    param: None,
                },
            );
            return;
        }
    };
    let t0 = Instant::now();
    let endpoint = match req.path.as_str() {
        "/v1/chat/completions" => Some(Endpoint::Chat),
        "/v1/completions" => Some(Endpoint::Completions),
        _ => None,
    };
    let (status, note) = match (req.method.as_str(), req.path.as_str(), endpoint) {
        ("GET", "/health", _) => {
            send_json(stream, 200, &json!({"status": "ok"}));
            (200, String::new())
        }
        ("GET", "/v1/models", _) => {
            let models = json!({"object": "list", "data": [{"id": engine.model_id(),
                "object": "model", "created": now_secs(), "owned_by": "dflash"}]});
            send_json(stream, 200, &models);
            (200, String::new())
        }
        ("POST", _, Some(ep)) => complete(stream, engine, opts, &req, ep, n),
        (_, "/health" | "/v1/models", _) | (_, _, Some(_)) => {
            let e = ApiError {
                status: 405,
                message: format!("{} is not allowed on {}", req.method, req.path),
                param: None,
            };
            send_error(stream, &e);
            (405, e.message)
        }
        _ => {
            let e = ApiError {
                status: 404,
                message: format!("no route {}", req.path),
                param: None,
            };
            send_error(stream, &e);
            (404, e.message)
        }
    };
    if !opts.quiet {
        eprintln!(
            "[dflash serve] {} {} {status} {:.3}s{}{note}",
            req.method,
            req.path,
            t0.elapsed().as_secs_f64(),
            if note.is_empty() { "" } else { ": " }
        );
    }
}

/// A streamed answer: its head goes out with the first event.
struct EventStream<'a> {
    stream: &'a mut TcpStream,
    head_written: bool,
    broken: bool,
}

impl EventStream<'_> {
    fn send(&mut self, data: &str) {
        if self.broken {
            return;
        }
        let ok = (self.head_written || http::write_event_stream_head(self.stream).is_ok())
            && http::write_event(self.stream, data).is_ok();
        self.head_written = true;
        self.broken = !ok;
    }
}

fn complete(
    stream: &mut TcpStream,
    engine: &mut dyn Engine,
    opts: &ServerOptions,
    req: &Request,
    endpoint: Endpoint,
    n: u64,
) -> (u16, String) {
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
        ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let parsed = match openai::parse(
        endpoint,
        &req.body,
        engine.model_id(),
        opts.default_max_tokens,
        seed,
    ) {
        Ok(p) => p,
        Err(e) => {
            send_error(stream, &e);
            return (e.status, e.message);
        }
    };
    let env = Envelope {
        id: format!(
            "{}-{n}-{seed:x}",
            match endpoint {
                Endpoint::Chat => "chatcmpl",
                Endpoint::Completions => "cmpl",
            }
        ),
        created: now_secs(),
        model: engine.model_id().to_string(),
        endpoint,
    };
    let gen = GenRequest {
        prompt: parsed.prompt.clone(),
        max_tokens: parsed.max_tokens,
        sampling: parsed.sampling,
        cancel: Arc::new(AtomicBool::new(false)),
    };
    let mut filter = StopFilter::new(parsed.stop.clone());
    let cancel = gen.cancel.clone();
    let result;
    let mut text = String::new();
    let mut events = EventStream {
        stream,
        head_written: false,
        broken: false,
    };
    if parsed.stream {
        let mut first = true;
        let mut on_text = |piece: &str| {
            let out = filter.push(piece);
            if !out.is_empty() {
                let chunk = env.chunk(Some(&out), first, None);
                first = false;
                events.send(&chunk.to_string());
            }
            if filter.stopped() || events.broken {
                cancel.store(true, Ordering::Relaxed);
            }
        };
        result = engine.generate(&gen, &mut on_text);
        if let Ok(outcome) = &result {
            let rest = filter.finish();
            if !rest.is_empty() || first {
                events.send(&env.chunk(Some(&rest), first, None).to_string());
            }
            let finish = if filter.stopped() {
                FinishReason::Stop
            } else {
                outcome.finish
            };
            events.send(&env.chunk(None, false, Some(finish)).to_string());
            if parsed.include_usage {
                let u = env.usage_chunk(
                    outcome.prompt_tokens,
                    outcome.completion_tokens,
                    &outcome.stats,
                );
                events.send(&u.to_string());
            }
            events.send("[DONE]");
        }
    } else {
        let mut on_text = |piece: &str| {
            text.push_str(&filter.push(piece));
            if filter.stopped() {
                cancel.store(true, Ordering::Relaxed);
            }
        };
        result = engine.generate(&gen, &mut on_text);
    }
    match result {
        Ok(outcome) => {
            let note = format!(
                "{} prompt + {} tokens{}",
                outcome.prompt_tokens,
                outcome.completion_tokens,
                if events.broken { ", client gone" } else { "" }
            );
            if !parsed.stream {
                text.push_str(&filter.finish());
                let finish = if filter.stopped() {
                    FinishReason::Stop
                } else {
                    outcome.finish
                };
                let body = env.response(
                    &text,
                    finish,
                    outcome.prompt_tokens,
                    outcome.completion_tokens,
                    &outcome.stats,
                );
                send_json(events.stream, 200, &body);
            }
            (200, note)
        }
        Err(e) => {
            let status = match e {
                EngineError::BadRequest(_) => 400,
                EngineError::Internal(_) => 500,
            };
            let err = ApiError {
                status,
                message: e.to_string(),
                param: None,
            };
            if events.head_written {
                // the status went out with the first event: the error travels as one
                events.send(&err.body().to_string());
                events.send("[DONE]");
            } else {
                send_error(events.stream, &err);
            }
            let _ = events.stream.flush();
            (status, err.message)
        }
    }
}
