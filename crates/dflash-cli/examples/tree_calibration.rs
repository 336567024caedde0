//! Lab (session 38): does DDTree's tree accept more when the drafter's log-probabilities are
//! rescaled before the best-first expansion — a temperature T (`z/T − lse(z/T)`) and a bonus β
//! per depth? Replays greedy AR answers (f32, CPU) with the training-mode forward's drafts, as
//! `eval --replay` does, and walks trees built from the rescaled scores along them; prints the
//! walk τ per (set, budget, T, β). Measured: T = 1, β = 0 (what decoding uses) is best within
//! ±0.5 % on held-out and benchmark prompts (docs/benchmarks.md, session 38).
//!
//! cargo run --release -p dflash-cli --example tree_calibration -- TARGET DRAFTER SPEC...
//! where SPEC is `name=file.jsonl:kind:offset:count` (kind gsm8k|humaneval|turns; the first
//! user turn of each row, prompts over 1,500 tokens skipped), 256 new tokens a prompt.
use anyhow::{Context, Result};
use candle_core::{DType, Device, D};
use dflash_core::decode_ops::top_k_row;
use dflash_core::Grad;
use dflash_decoding::ar::generate_ar;
use dflash_decoding::tree::build_tree;
use dflash_decoding::{GenerateConfig, SamplingConfig};
use dflash_models::{load_drafter, load_target};
use dflash_text::{ChatMessage, RenderOptions};
use dflash_train::step::sequence_taps;
use std::io::Write;

const TOP: usize = 64;
const TEMPS: [f32; 9] = [0.5, 0.7, 0.85, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0];

/// One anchor's draft rows: top-TOP raw logits (descending) with ids, and lse at each T.
struct Row {
    top: Vec<(f32, u32)>,
    lse: [f32; TEMPS.len()],
}

struct Prompt {
    set: String,
    /// rows[anchor - start][depth]
    rows: Vec<Vec<Row>>,
    /// the sequence after the prompt (the AR answer)
    answer: Vec<u32>,
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 3 {
        anyhow::bail!(
            "usage: tree_calibration TARGET DRAFTER name=file.jsonl:kind:offset:count..."
        );
    }
    let (target_path, drafter_path) = (&args[0], &args[1]);
    let device = Device::Cpu;
    let target = load_target(target_path.as_ref(), &device, DType::F32)?;
    let mut drafter = load_drafter(drafter_path.as_ref(), &device, DType::F32)?;
    drafter.bind_target(target.model.as_ref())?;
    let text = target.text.as_ref().context("tokenizer")?;
    let tpl = text.chat_template.as_ref().context("template")?;
    let opts = RenderOptions {
        add_generation_prompt: true,
        enable_thinking: Some(false),
        tools: None,
    };
    let cfg = GenerateConfig {
        cancel: None,
        max_new_tokens: 256,
        stop_tokens: target.eos_token_ids.clone(),
        sampling: SamplingConfig::greedy(),
    };
    let conv = drafter.block_convention();
    let mut prompts: Vec<Prompt> = vec![];
    for spec in &args[2..] {
        let (name, rest) = spec.split_once('=').context("name=")?;
        let parts: Vec<&str> = rest.split(':').collect();
        anyhow::ensure!(parts.len() == 4, "{spec}: want name=file:kind:offset:count");
        let (file, kind) = (parts[0], parts[1]);
        let (offset, count): (usize, usize) = (parts[2].parse()?, parts[3].parse()?);
        let raw = std::fs::read_to_string(file).with_context(|| format!("reading {file}"))?;
        for line in raw.lines().skip(offset).take(count) {
            let v: serde_json::Value = serde_json::from_str(line)?;
            let user = match kind {
                "gsm8k" => format!(
                    "{}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
                    v["question"].as_str().context("no question")?
                ),
                "humaneval" => format!(
                    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```",
                    v["prompt"].as_str().context("no prompt")?
                ),
                _ => v["turns"][0].as_str().context("no turns")?.to_string(),
            };
            let prompt = text.tokenizer.encode(
                &tpl.render(&[ChatMessage::new("user", user)], &opts)?,
                false,
            )?;
            if prompt.len() > 1500 {
                continue;
            }
            let g = generate_ar(target.model.as_ref(), &prompt, &cfg, &mut |_| {})?;
            let mut seq = prompt.clone();
            seq.extend(&g.tokens);
            let start = prompt.len();
            let anchors: Vec<u32> = (start as u32..seq.len() as u32 - 1).collect();
            let taps = sequence_taps(target.model.as_ref(), &seq, drafter.target_layers())?;
            let mut rows = vec![];
            for group in anchors.chunks(32) {
                let logits = drafter.forward_train_with(
                    target.model.as_ref(),
                    &taps,
                    &seq,
                    group,
                    Grad::Off,
                    &conv,
                )?;
                let (n, b, v) = logits.dims3()?;
                let drafts = logits.narrow(1, 1, b - 1)?.to_dtype(DType::F32)?;
                let flat = drafts.reshape((n * (b - 1), v))?;
                let mut lses = vec![];
                for &t in &TEMPS {
                    let s = (&flat / t as f64)?;
                    let m = s.max_keepdim(D::Minus1)?;
                    let l = (s.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()? + m)?;
                    lses.push(l.flatten_all()?.to_vec1::<f32>()?);
                }
                let host = flat.to_vec2::<f32>()?;
                for i in 0..n {
                    let mut block = vec![];
                    for d in 0..b - 1 {
                        let top = top_k_row(&host[i * (b - 1) + d], TOP);
                        let mut lse = [0f32; TEMPS.len()];
                        for (k, l) in lses.iter().enumerate() {
                            lse[k] = l[i * (b - 1) + d];
                        }
                        block.push(Row { top, lse });
                    }
                    rows.push(block);
                }
            }
            eprintln!("{name}: prompt {} answer {}", prompt.len(), g.tokens.len());
            prompts.push(Prompt {
                set: name.to_string(),
                rows,
                answer: g.tokens,
            });
        }
    }
    let sets: Vec<String> = {
        let mut s: Vec<String> = prompts.iter().map(|p| p.set.clone()).collect();
        s.dedup();
        s
    };
    let betas = [-0.5f32, -0.25, 0.0, 0.25, 0.5, 1.0];
    let mut out = std::io::stdout().lock();
    writeln!(out, "set budget T beta tau")?;
    for budget in [16usize, 64, 256] {
        for (ti, &t) in TEMPS.iter().enumerate() {
            for &beta in &betas {
                for set in &sets {
                    let (mut acc, mut steps) = (0usize, 0usize);
                    for p in prompts.iter().filter(|p| &p.set == set) {
                        // walk: anchor index a (relative to the answer's start)
                        let end = p.answer.len();
                        let mut a = 0usize;
                        while a + 1 < end {
                            let top: Vec<Vec<(f32, u32)>> = p.rows[a]
                                .iter()
                                .map(|r| {
                                    r.top
                                        .iter()
                                        .map(|&(z, id)| (z / t - r.lse[ti] + beta, id))
                                        .collect()
                                })
                                .collect();
                            let tree = build_tree(p.answer[a], &top, budget);
                            let accepted = tree.accepted_depth(&p.answer[a + 1..]).min(end - 1 - a);
                            acc += accepted + 1;
                            steps += 1;
                            a += accepted + 1;
                        }
                    }
                    writeln!(
                        out,
                        "{set} {budget} {t} {beta} {:.4}",
                        acc as f64 / steps.max(1) as f64
                    )?;
                }
            }
        }
    }
    Ok(())
}
