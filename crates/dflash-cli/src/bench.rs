//! `dflash bench attention`: the fused block attention against the composite on one device, at
//! a training micro-batch's shapes. Prints (and writes with `--out`) JSON: the largest
//! difference of the output and of each input gradient relative to the composite's largest
//! value, and the median forward and forward+backward seconds of both paths.
//!
//! `causal-attention` and `cross-entropy` do the same for the target's attention and the training
//! loss; `decode` (in `bench_decode`) times a decoding step's parts at a model's shapes.
//!
//! Invariants: both paths get the same inputs and the same output weights; times are taken
//! between device synchronisations after one warm-up round (which pays NVRTC and PTX loading).

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use clap::{Args, Subcommand};
use dflash_core::block_attention::{block_attention, HIDDEN};
use dflash_core::flash_block::flash_block_attention;
use std::time::Instant;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Fused vs composite block attention: parity and time, forward and backward.
    Attention(AttentionArgs),
    /// Fused vs composite weighted cross-entropy over a chunk of LM-head logits.
    CrossEntropy(CrossEntropyArgs),
    /// Fused vs composite causal attention (the target's forward, no gradient).
    CausalAttention(CausalArgs),
    /// One decoding step's parts (AR step, verifies, draft, tree build, sampling) at a model's
    /// shapes with random weights, against the memory-bandwidth floor.
    Decode(crate::bench_decode::DecodeArgs),
}

#[derive(Args, Debug)]
pub struct CausalArgs {
    /// Sequences in the batch.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    #[arg(long, default_value_t = 9)]
    heads: usize,
    #[arg(long, default_value_t = 3)]
    kv_heads: usize,
    /// Query rows per sequence.
    #[arg(long, default_value_t = 1024)]
    queries: usize,
    /// Cached rows before the queries.
    #[arg(long, default_value_t = 0)]
    past: usize,
    /// Left padding: sequence i hides its first min(i·P, past + queries − 1) keys, as batched
    /// regen does (a padding query sees only its own key).
    #[arg(long, default_value_t = 0)]
    left_pad: usize,
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// f32 or bf16.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Args, Debug)]
pub struct CrossEntropyArgs {
    /// Rows of logits (one training loss chunk).
    #[arg(long, default_value_t = 5461)]
    rows: usize,
    /// Vocabulary size.
    #[arg(long, default_value_t = 49152)]
    vocab: usize,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Args, Debug)]
pub struct AttentionArgs {
    /// Sequences in the micro-batch.
    #[arg(long, default_value_t = 9)]
    batch: usize,
    /// Query heads.
    #[arg(long, default_value_t = 9)]
    heads: usize,
    /// Key/value heads.
    #[arg(long, default_value_t = 3)]
    kv_heads: usize,
    /// Blocks per sequence.
    #[arg(long, default_value_t = 128)]
    blocks: usize,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Context rows per sequence.
    #[arg(long, default_value_t = 512)]
    context: usize,
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// f32 or bf16.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    #[command(flatten)]
    run: RunArgs,
}

/// What every bench takes: the device, how many timed rounds, where to write the JSON.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// Timed rounds (after one warm-up).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Also write the JSON here.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Attention(a) => attention(a),
        BenchCommand::CrossEntropy(a) => cross_entropy(a),
        BenchCommand::CausalAttention(a) => causal_attention(a),
        BenchCommand::Decode(a) => crate::bench_decode::run(a),
    }
}

/// Median seconds of `rounds` runs of `f` between synchronisations, after one warm-up run.
fn timed(dev: &Device, rounds: usize, f: &dyn Fn() -> Result<()>) -> Result<f64> {
    Ok(timings(dev, 1, rounds, &mut || f())?.median)
}

/// Seconds of the timed runs of one op.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    pub median: f64,
    pub min: f64,
    /// The 90th percentile (nearest rank).
    pub p90: f64,
}

/// Runs `f` `warmup` times untimed, then `rounds` (≥ 1) times, each between device
/// synchronisations, and summarises the timed runs.
pub(crate) fn timings(
    dev: &Device,
    warmup: usize,
    rounds: usize,
    f: &mut dyn FnMut() -> Result<()>,
) -> Result<Timing> {
    if rounds == 0 {
        anyhow::bail!("timings: no timed rounds");
    }
    for _ in 0..warmup {
        f()?;
    }
    dev.synchronize()?;
    let mut v = vec![];
    for _ in 0..rounds {
        let t0 = Instant::now();
        f()?;
        dev.synchronize()?;
        v.push(t0.elapsed().as_secs_f64());
    }
    Ok(Timing::of(v))
}

impl Timing {
    /// Median, min and p90 of `v` (non-empty).
    pub(crate) fn of(mut v: Vec<f64>) -> Timing {
        v.sort_by(|a, b| a.total_cmp(b));
        let p90 = v[(v.len() * 9).div_ceil(10).max(1) - 1];
        Timing {
            median: v[v.len() / 2],
            min: v[0],
            p90,
        }
    }
}

pub(crate) fn write_report(
    report: &serde_json::Value,
    out: Option<&std::path::Path>,
) -> Result<()> {
    let text = serde_json::to_string_pretty(report)?;
    println!("{text}");
    if let Some(p) = out {
        crate::defaults::write_atomic(p, text.as_bytes())?;
    }
    Ok(())
}

fn cross_entropy(a: CrossEntropyArgs) -> Result<()> {
    use candle_core::D;
    let dev = dflash_core::parse_device(&a.run.device)?;
    if a.run.rounds == 0 || a.rows == 0 || a.vocab == 0 {
        anyhow::bail!("--rounds, --rows and --vocab must be positive");
    }
    let x = Var::from_tensor(
        &(Tensor::randn(0f32, 1.0, (a.rows, a.vocab), &Device::Cpu)? * 3.0)?.to_device(&dev)?,
    )?;
    let labels: Vec<u32> = (0..a.rows).map(|i| ((i * 7919) % a.vocab) as u32).collect();
    let weights: Vec<f32> = (0..a.rows)
        .map(|i| (-((i % 15) as f32) / 7.0).exp())
        .collect();
    let fused = || -> Result<(Tensor, Tensor, Tensor)> {
        let out =
            dflash_core::cross_entropy::weighted_cross_entropy(x.as_tensor(), &labels, &weights)?;
        let loss = out.narrow(1, 0, 1)?.sum_all()?;
        let g = loss
            .backward()?
            .get(x.as_tensor())
            .context("gradient")?
            .clone();
        Ok((
            loss,
            g,
            out.narrow(1, 2, 1)?.squeeze(1)?.to_dtype(DType::U32)?,
        ))
    };
    let composite = || -> Result<(Tensor, Tensor, Tensor)> {
        let xt = x.as_tensor();
        let max = xt.max_keepdim(D::Minus1)?.detach();
        let lse = (xt
            .broadcast_sub(&max)?
            .exp()?
            .sum_keepdim(D::Minus1)?
            .log()?
            + max)?;
        let logp = xt.broadcast_sub(&lse)?;
        let idx = Tensor::from_slice(&labels, (a.rows, 1), &dev)?;
        let w = Tensor::from_slice(&weights, a.rows, &dev)?;
        let loss = (logp.gather(&idx, 1)?.squeeze(1)? * w)?.sum_all()?.neg()?;
        let g = loss
            .backward()?
            .get(x.as_tensor())
            .context("gradient")?
            .clone();
        Ok((loss, g, x.as_tensor().argmax(D::Minus1)?))
    };
    let (lf, gf, af) = fused()?;
    let (lc, gc, ac) = composite()?;
    let (lf, lc) = (lf.to_scalar::<f32>()?, lc.to_scalar::<f32>()?);
    let gsize = gc.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-30);
    let gdiff = (&gf - &gc)?.abs()?.max_all()?.to_scalar::<f32>()? / gsize;
    let (af, ac): (Vec<u32>, Vec<u32>) = (af.to_vec1()?, ac.to_vec1()?);
    let argmax_differs = af.iter().zip(&ac).filter(|(x, y)| x != y).count();
    let tc = timed(&dev, a.run.rounds, &|| composite().map(|_| ()))?;
    let tf = timed(&dev, a.run.rounds, &|| fused().map(|_| ()))?;
    let report = serde_json::json!({
        "device": a.run.device, "rows": a.rows, "vocab": a.vocab,
        "loss": {"composite": lc, "fused": lf, "relative_difference": (lf - lc).abs() / lc.abs().max(1e-30)},
        "gradient_max_relative_difference": gdiff, "argmax_rows_differing": argmax_differs,
        "seconds": {"composite_forward_backward": tc, "fused_forward_backward": tf},
        "speedup": tc / tf,
    });
    write_report(&report, a.run.out.as_deref())
}

fn causal_attention(a: CausalArgs) -> Result<()> {
    let dev = dflash_core::parse_device(&a.run.device)?;
    let dtype = dflash_core::parse_dtype(&a.dtype)?;
    if a.run.rounds == 0 || a.queries == 0 || a.kv_heads == 0 || !a.heads.is_multiple_of(a.kv_heads)
    {
        anyhow::bail!("--rounds and --queries must be positive, --kv-heads must divide --heads");
    }
    let (b, t, s) = (a.batch, a.queries, a.past + a.queries);
    let rand = |shape: (usize, usize, usize, usize)| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1.0, shape, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(&dev)?)
    };
    let q = rand((b, a.heads, t, a.head_dim))?;
    let k = rand((b, a.kv_heads, s, a.head_dim))?;
    let v = rand((b, a.kv_heads, s, a.head_dim))?;
    let first: Vec<u32> = (0..b).map(|i| (i * a.left_pad).min(s - 1) as u32).collect();
    let mask = if a.left_pad == 0 {
        dflash_core::AttentionMask::Causal.build(t, s, &dev)?
    } else {
        // the batched decoder's per-sequence mask: causal, keys before `first` hidden except a
        // row's own key
        let mut m = vec![f32::NEG_INFINITY; b * t * s];
        for (bi, &f) in first.iter().enumerate() {
            for i in 0..t {
                let own = a.past + i;
                for j in 0..=own {
                    if j >= f as usize || j == own {
                        m[(bi * t + i) * s + j] = 0.0;
                    }
                }
            }
        }
        Some(Tensor::from_vec(m, (b, t, s), &Device::Cpu)?.to_device(&dev)?)
    };
    let scale = 1.0 / (a.head_dim as f64).sqrt();
    let composite = || -> Result<Tensor> {
        Ok(dflash_core::attention(
            &q,
            &k,
            &v,
            mask.as_ref(),
            scale,
            dflash_core::Grad::Off,
        )?)
    };
    let fused = || -> Result<Tensor> {
        dflash_core::flash_block::flash_causal_attention(&q, &k, &v, &first, scale)?
            .context("these shapes are outside the fused kernel's limits")
    };
    let (c, f) = (
        composite()?.to_dtype(DType::F32)?,
        fused()?.to_dtype(DType::F32)?,
    );
    let size = c.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-30);
    let diff = (&c - &f)?.abs()?.max_all()?.to_scalar::<f32>()? / size;
    let tc = timed(&dev, a.run.rounds, &|| composite().map(|_| ()))?;
    let tf = timed(&dev, a.run.rounds, &|| fused().map(|_| ()))?;
    let report = serde_json::json!({
        "device": a.run.device, "dtype": a.dtype,
        "shape": {"batch": b, "heads": a.heads, "kv_heads": a.kv_heads, "queries": t,
                  "past": a.past, "left_pad": a.left_pad, "head_dim": a.head_dim},
        "max_relative_difference": diff,
        // visible (query, key) pairs × 2·d multiply-adds, per second of the fused kernel
        "fused_tflops": (b * a.heads) as f64 * (t as f64 * a.past as f64 + (t * (t + 1) / 2) as f64)
            * 4.0 * a.head_dim as f64 / tf / 1e12,
        "seconds": {"composite": tc, "fused": tf}, "speedup": tc / tf,
    });
    write_report(&report, a.run.out.as_deref())
}

fn attention(a: AttentionArgs) -> Result<()> {
    let dev = dflash_core::parse_device(&a.run.device)?;
    let dtype = dflash_core::parse_dtype(&a.dtype)?;
    if a.run.rounds == 0
        || a.kv_heads == 0
        || !a.heads.is_multiple_of(a.kv_heads)
        || a.block_size == 0
    {
        anyhow::bail!("--rounds, --kv-heads and --block-size must be positive and divide --heads");
    }
    let (b, h, kv, n, bs, s, d) = (
        a.batch,
        a.heads,
        a.kv_heads,
        a.blocks,
        a.block_size,
        a.context,
        a.head_dim,
    );
    let rows = n * bs;
    let rand = |shape: (usize, usize, usize, usize)| -> Result<Var> {
        let t = Tensor::randn(0f32, 1.0, shape, &Device::Cpu)?.to_dtype(dtype)?;
        Ok(Var::from_tensor(&t.to_device(&dev)?)?)
    };
    let inputs = [
        rand((b, h, rows, d))?,
        rand((b, kv, s, d))?,
        rand((b, kv, s, d))?,
        rand((b, kv, rows, d))?,
        rand((b, kv, rows, d))?,
    ];
    let t: Vec<&Tensor> = inputs.iter().map(|v| v.as_tensor()).collect();
    // anchors spread over the context, as random anchors in a sequence of `s` rows
    let visible: Vec<u32> = (0..b * n)
        .map(|i| ((i * 7919 + 13) % (s + 1)) as u32)
        .collect();
    let mut mask = vec![HIDDEN; b * n * s];
    for (blk, &v) in visible.iter().enumerate() {
        mask[blk * s..blk * s + v as usize].fill(0.0);
    }
    let mask = Tensor::from_vec(mask, (b, n, 1, s), &dev)?;
    let w = Tensor::randn(0f32, 1.0, (b, rows, h * d), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(&dev)?;
    let scale = 1.0 / (d as f64).sqrt();
    let forward = |fused: bool| -> Result<Tensor> {
        if fused {
            flash_block_attention(t[0], t[1], t[2], t[3], t[4], &visible, bs, scale)?
                .context("these shapes are outside the fused kernels' limits")
        } else {
            Ok(block_attention(
                t[0],
                t[1],
                t[2],
                t[3],
                t[4],
                Some(&mask),
                None,
                bs,
                scale,
            )?)
        }
    };
    let with_grads = |fused: bool| -> Result<Vec<Tensor>> {
        let o = forward(fused)?;
        let g = (&o * &w)?.to_dtype(DType::F32)?.sum_all()?.backward()?;
        let mut out = vec![o];
        for x in &t {
            out.push(g.get(x).context("missing gradient")?.clone());
        }
        Ok(out)
    };
    let time = |f: &dyn Fn() -> Result<()>| timed(&dev, a.run.rounds, f);
    let composite = with_grads(false)?;
    let fused = with_grads(true)?;
    let names = ["output", "d_q", "d_ctx_k", "d_ctx_v", "d_blk_k", "d_blk_v"];
    let mut parity = serde_json::Map::new();
    let mut worst = 0f32;
    for ((name, c), f) in names.iter().zip(&composite).zip(&fused) {
        let c = c.to_dtype(DType::F32)?;
        let f = f.to_dtype(DType::F32)?;
        let size = c.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-30);
        let diff = (&c - &f)?.abs()?.max_all()?.to_scalar::<f32>()? / size;
        worst = worst.max(diff);
        parity.insert(name.to_string(), serde_json::json!(diff));
    }
    let fwd_c = time(&|| forward(false).map(|_| ()))?;
    let fwd_f = time(&|| forward(true).map(|_| ()))?;
    let all_c = time(&|| with_grads(false).map(|_| ()))?;
    let all_f = time(&|| with_grads(true).map(|_| ()))?;
    // useful work of the fused forward: every visible (row, key) pair costs 2·d multiply-adds
    // (q·k and p·v); the composite also computes the hidden context pairs
    let pairs: f64 = visible
        .iter()
        .map(|&v| (h * bs) as f64 * (v as f64 + bs as f64))
        .sum();
    let fwd_flops = 4.0 * pairs * d as f64;
    let report = serde_json::json!({
        "device": a.run.device, "dtype": a.dtype,
        "shape": {"batch": b, "heads": h, "kv_heads": kv, "blocks": n, "block_size": bs,
                  "context": s, "head_dim": d},
        "fused_forward_tflops": fwd_flops / fwd_f / 1e12,
        "max_relative_difference": parity, "worst": worst,
        "seconds": {"composite_forward": fwd_c, "fused_forward": fwd_f,
                    "composite_forward_backward": all_c, "fused_forward_backward": all_f},
        "speedup": {"forward": fwd_c / fwd_f, "forward_backward": all_c / all_f},
    });
    write_report(&report, a.run.out.as_deref())
}
