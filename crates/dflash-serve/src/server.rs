//! The accept loop and the routes: one thread accepts and reads connections and answers what
//! needs no engine; completions queue for the engine on the caller's thread (batch-1 engines),
//! served in arrival order, one connection each.
//!
//! Invariants: a streamed response's head is written only once the engine has produced text or
//! finished, so a request the engine refuses (a prompt longer than the context) still gets its
//! 4xx status; a client that goes away mid-stream cancels its generation; every request is
//! logged as one line on stderr unless [`ServerOptions::quiet`].

use crate::http;
use crate::openai::{self, ApiError, Endpoint, Envelope, Parsed};
use crate::stop::StopFilter;
use crate::{Engine, EngineError, FinishReason, GenRequest, ServeError};
use serde_json::{json, Value};
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
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
    /// Completions that may wait for the engine; one more is answered 503.
    pub max_queue: usize,
    /// When set, every `/v1/` route wants `Authorization: Bearer <key>` (401 otherwise);
    /// `/health` stays open.
    pub api_key: Option<String>,
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
            max_queue: 64,
            api_key: None,
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

/// Serves `engine` on `listener` until [`ServerOptions::stop_after`] connections were taken
/// (forever without it): a thread accepts and reads connections, answers `/health`,
/// `/v1/models` and refusals at once, and queues completions (at most
/// [`ServerOptions::max_queue`]; a 503 beyond) for the engine, which runs on the calling thread.
pub fn serve(
    listener: &TcpListener,
    engine: &mut dyn Engine,
    opts: &ServerOptions,
) -> Result<(), ServeError> {
    let model_id = engine.model_id().to_string();
    let (jobs, queue) = mpsc::sync_channel::<Job>(opts.max_queue);
    let pending = AtomicUsize::new(0);
    std::thread::scope(|s| {
        s.spawn(|| accept(listener, jobs, &model_id, opts, &pending));
        for mut job in queue {
            let (status, note) = complete(engine, &mut job);
            pending.fetch_sub(1, Ordering::Relaxed);
            log(opts, &job.line, status, job.t0, &note);
        }
    });
    Ok(())
}

/// A completion waiting for the engine.
struct Job {
    stream: TcpStream,
    endpoint: Endpoint,
    parsed: Parsed,
    /// The request's number and seed (its id).
    n: u64,
    seed: u64,
    model: String,
    t0: Instant,
    /// `METHOD /path`, for the log.
    line: String,
}

fn log(opts: &ServerOptions, line: &str, status: u16, t0: Instant, note: &str) {
    if !opts.quiet {
        eprintln!(
            "[dflash serve] {line} {status} {:.3}s{}{note}",
            t0.elapsed().as_secs_f64(),
            if note.is_empty() { "" } else { ": " }
        );
    }
}

fn accept(
    listener: &TcpListener,
    jobs: mpsc::SyncSender<Job>,
    model_id: &str,
    opts: &ServerOptions,
    pending: &AtomicUsize,
) {
    let mut taken = 0u64;
    for conn in listener.incoming() {
        let Ok(mut stream) = conn else {
            // a connection that failed before it was accepted is the client's problem
            continue;
        };
        taken += 1;
        let _ = stream.set_read_timeout(Some(opts.read_timeout));
        // a client that stops reading fails the write (and cancels its stream) instead of
        // holding the server
        let _ = stream.set_write_timeout(Some(opts.read_timeout));
        let _ = stream.set_nodelay(true);
        if let Some(job) = route(&mut stream, model_id, opts, pending, taken) {
            let line = job.line.clone();
            let t0 = job.t0;
            pending.fetch_add(1, Ordering::Relaxed);
            match jobs.try_send(job) {
                Ok(()) => {}
                Err(mpsc::TrySendError::Full(mut job)) => {
                    pending.fetch_sub(1, Ordering::Relaxed);
                    let e = ApiError {
                        status: 503,
                        message: format!(
                            "server busy: {} requests queued; retry later",
                            opts.max_queue
                        ),
                        param: None,
                    };
                    send_error(&mut job.stream, &e);
                    log(opts, &line, 503, t0, &e.message);
                }
                Err(mpsc::TrySendError::Disconnected(_)) => break,
            }
        }
        if opts.stop_after.is_some_and(|n| taken >= n as u64) {
            break;
        }
    }
}

fn send_json(stream: &mut TcpStream, status: u16, v: &Value) {
    let _ = http::write_response(stream, status, "application/json", v.to_string().as_bytes());
}

fn send_error(stream: &mut TcpStream, e: &ApiError) {
    send_json(stream, e.status, &e.body());
}

/// Answers what needs no engine; returns the completion to queue, if the request is one.
fn route(
    stream: &mut TcpStream,
    model_id: &str,
    opts: &ServerOptions,
    pending: &AtomicUsize,
    n: u64,
) -> Option<Job> {
    let req = match http::read_request(stream, opts.max_body) {
        Ok(Some(r)) => r,
        Ok(None) => return None,
        Err(e) => {
            send_error(
                stream,
                &ApiError {
                    status: e.status,
                    message: e.message,
                    param: None,
                },
            );
            return None;
        }
    };
    let t0 = Instant::now();
    let line = format!("{} {}", req.method, req.path);
    if let Some(key) = opts.api_key.as_deref() {
        let given = req
            .header("authorization")
            .and_then(|a| a.strip_prefix("Bearer "));
        if req.path.starts_with("/v1/") && given != Some(key) {
            let e = ApiError {
                status: 401,
                message: "missing or wrong API key (Authorization: Bearer …)".into(),
                param: None,
            };
            send_error(stream, &e);
            log(opts, &line, 401, t0, &e.message);
            return None;
        }
    }
    let endpoint = match req.path.as_str() {
        "/v1/chat/completions" => Some(Endpoint::Chat),
        "/v1/completions" => Some(Endpoint::Completions),
        _ => None,
    };
    let (status, note) = match (req.method.as_str(), req.path.as_str(), endpoint) {
        ("GET", "/health", _) => {
            let queued = pending.load(Ordering::Relaxed);
            send_json(
                stream,
                200,
                &json!({"status": "ok", "requests_pending": queued}),
            );
            (200, String::new())
        }
        ("GET", "/v1/models", _) => {
            let models = json!({"object": "list", "data": [{"id": model_id,
                "object": "model", "created": now_secs(), "owned_by": "dflash"}]});
            send_json(stream, 200, &models);
            (200, String::new())
        }
        ("POST", _, Some(endpoint)) => {
            let seed = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
                ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            match openai::parse(endpoint, &req.body, model_id, opts.default_max_tokens, seed) {
                Ok(parsed) => {
                    return Some(Job {
                        stream: stream.try_clone().ok()?,
                        endpoint,
                        parsed,
                        n,
                        seed,
                        model: model_id.to_string(),
                        t0,
                        line,
                    })
                }
                Err(e) => {
                    send_error(stream, &e);
                    (e.status, e.message)
                }
            }
        }
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
    log(opts, &line, status, t0, &note);
    None
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

fn complete(engine: &mut dyn Engine, job: &mut Job) -> (u16, String) {
    let (parsed, endpoint, n, seed) = (&job.parsed, job.endpoint, job.n, job.seed);
    let stream = &mut job.stream;
    let env = Envelope {
        id: format!(
            "{}-{n}-{seed:x}",
            match endpoint {
                Endpoint::Chat => "chatcmpl",
                Endpoint::Completions => "cmpl",
            }
        ),
        created: now_secs(),
        model: job.model.clone(),
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
