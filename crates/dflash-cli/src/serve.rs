//! `dflash serve`: the loaded engine behind the OpenAI-compatible endpoint of `dflash-serve`.
//!
//! Invariants: each request decodes exactly as `dflash generate` would with the same flags and
//! sampling (the same [`crate::engine::Engine::decode`]); a prompt the model cannot take (longer
//! than its context, no chat template) is the client's error (400), anything else a 500.

use crate::engine::{Engine, EngineArgs, Mode};
use anyhow::{Context, Result};
use clap::Args;
use dflash_decoding::{DecodeError, GenerateConfig, SamplingConfig, StopReason};
use dflash_serve::{EngineError, FinishReason, GenOutcome, GenRequest, Prompt, ServerOptions};
use dflash_text::{ChatMessage, StreamDecoder};
use serde_json::json;
use std::net::TcpListener;

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Address to listen on (0.0.0.0 for every interface).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the address is printed on stderr).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model name clients send and `/v1/models` lists (default: the target's file or
    /// directory name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// `max_tokens` of requests that name none.
    #[arg(long, default_value_t = 256)]
    default_max_tokens: usize,
    /// Require `Authorization: Bearer <KEY>` on every /v1/ route (default: $DFLASH_API_KEY;
    /// none: open).
    #[arg(long, env = "DFLASH_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Completions that may wait while one decodes; one more gets a 503 (server busy).
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Return after this many connections (scripts and tests).
    #[arg(long, hide = true)]
    stop_after: Option<usize>,
}

struct Served {
    engine: Engine,
    model_id: String,
}

fn finish_reason(r: StopReason) -> FinishReason {
    match r {
        StopReason::Eos | StopReason::Cancelled => FinishReason::Stop,
        StopReason::MaxTokens | StopReason::ContextLength => FinishReason::Length,
    }
}

fn engine_error(e: anyhow::Error) -> EngineError {
    let bad = e.chain().any(|c| {
        c.downcast_ref::<DecodeError>()
            .is_some_and(|d| d.is_bad_input())
            || c.downcast_ref::<crate::exit::UsageError>().is_some()
    });
    if bad {
        EngineError::BadRequest(format!("{e:#}"))
    } else {
        EngineError::Internal(format!("{e:#}"))
    }
}

impl Served {
    fn run(&self, req: &GenRequest, on_text: &mut dyn FnMut(&str)) -> Result<GenOutcome> {
        // a prompt that cannot be rendered (roles the template refuses, no template) is the
        // request's fault
        let prompt = self
            .prompt(req)
            .map_err(|e| crate::exit::UsageError(format!("{e:#}")))?;
        self.decode(req, &prompt, on_text)
    }

    /// The request's prompt as ids.
    fn prompt(&self, req: &GenRequest) -> Result<Vec<u32>> {
        Ok(match &req.prompt {
            Prompt::Chat {
                messages,
                enable_thinking,
            } => {
                let msgs: Vec<ChatMessage> = messages
                    .iter()
                    .map(|m| ChatMessage::new(&m.role, m.content.clone()))
                    .collect();
                self.engine.chat_prompt(&msgs, *enable_thinking)?
            }
            Prompt::Text(t) => self.engine.raw_prompt(t)?,
        })
    }

    fn decode(
        &self,
        req: &GenRequest,
        prompt: &[u32],
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenOutcome> {
        let cfg = GenerateConfig {
            cancel: Some(req.cancel.clone()),
            max_new_tokens: req.max_tokens,
            stop_tokens: self.engine.target.eos_token_ids.clone(),
            sampling: SamplingConfig {
                temperature: req.sampling.temperature,
                top_p: req.sampling.top_p,
                top_k: req.sampling.top_k,
                seed: req.sampling.seed,
            },
        };
        let text = self.engine.text()?;
        let mut stream = StreamDecoder::new(&text.tokenizer, true);
        let mut on_token = |id: u32| {
            if let Ok(Some(piece)) = stream.push(id) {
                on_text(&piece);
            }
        };
        let g = self.engine.decode(prompt, &cfg, false, &mut on_token)?;
        if let Ok(Some(rest)) = stream.finish() {
            on_text(&rest);
        }
        let spec = g.spec.as_ref();
        let n = g.tokens.len();
        let mode = match (self.engine.args.mode, spec.and_then(|s| s.auto.as_ref())) {
            (Mode::Auto, None) if self.engine.drafter.is_none() => "ar".to_string(),
            (Mode::Auto, Some(a)) if a.switched_to_ar_at_step == Some(0) => "ar".to_string(),
            (Mode::Auto, Some(a)) if a.switched_to_ar_at_step.is_some() => "ddtree then ar".into(),
            (Mode::Auto, _) => "ddtree".to_string(),
            (m, _) => format!("{m:?}").to_lowercase(),
        };
        Ok(GenOutcome {
            prompt_tokens: g.prompt_tokens,
            completion_tokens: n,
            finish: finish_reason(g.stop_reason),
            stats: json!({
                "mode": mode,
                "steps": g.steps,
                "prefill_seconds": g.prefill_seconds,
                "decode_seconds": g.decode_seconds,
                "tokens_per_second": if g.decode_seconds > 0.0 {
                    n.saturating_sub(1) as f64 / g.decode_seconds
                } else {
                    0.0
                },
                "acceptance_length_mean": spec
                    .filter(|s| !s.acceptance.is_empty())
                    .map(|s| s.mean_acceptance()),
                "stop_reason": g.stop_reason,
            }),
        })
    }
}

impl dflash_serve::Engine for Served {
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn generate(
        &mut self,
        req: &GenRequest,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenOutcome, EngineError> {
        self.run(req, on_text).map_err(engine_error)
    }
}

pub fn run(args: ServeArgs) -> Result<()> {
    if args.default_max_tokens == 0 {
        return Err(
            crate::exit::UsageError("--default-max-tokens must be at least 1".into()).into(),
        );
    }
    let engine = Engine::load(&args.engine)?;
    let model_id = args.served_model_name.clone().unwrap_or_else(|| {
        let p = &engine.target_path;
        let name = if p.is_dir() {
            p.file_name()
        } else {
            p.file_stem()
        };
        name.map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "dflash".into())
    });
    let listener = TcpListener::bind((args.host.as_str(), args.port))
        .with_context(|| format!("listening on {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    eprintln!(
        "[dflash serve] {model_id} (mode {}, {} {}, drafter {}{}) on http://{addr}/v1",
        format!("{:?}", args.engine.mode).to_lowercase(),
        args.engine.device,
        engine.dtype_name(),
        if engine.drafter.is_some() {
            "loaded"
        } else {
            "none"
        },
        if args.api_key.as_deref().is_some_and(|k| !k.is_empty()) {
            ", API key required"
        } else {
            ""
        },
    );
    let opts = ServerOptions {
        default_max_tokens: args.default_max_tokens,
        stop_after: args.stop_after,
        max_queue: args.max_queue.max(1),
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        ..Default::default()
    };
    let mut served = Served { engine, model_id };
    dflash_serve::serve(&listener, &mut served, &opts)?;
    Ok(())
}
