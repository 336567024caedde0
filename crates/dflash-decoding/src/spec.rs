//! Speculative decoding: one drafter pass per step, then one target verify forward of a block
//! (single-path DFlash) or of a token tree (DDTree), accept, bonus, commit.
//!
//! Invariants (spec.md §2–3):
//! - Before a step the target cache holds exactly the committed positions `0..start`; the bonus
//!   token (last emitted) sits at `start` and enters both models only inside the step.
//! - The drafter receives the taps of exactly the newly committed tokens, in position order, and
//!   keeps only committed context; block rows are never cached.
//! - Every emitted token is the target's own choice (argmax, or a sample from the target's
//!   distribution at that node) given its committed prefix, so greedy output equals AR output and
//!   sampled output has AR's distribution. Drafts are argmax proposals only.
//! - After verification the target cache is cropped (DFlash) or compacted to the accepted path
//!   (DDTree); emission stops at the first stop token or the token budget, as AR does.
//! - Auto mode ([`generate_auto`]) times one AR step before the loop and switches to plain AR
//!   steps for the rest of the answer once the speculative steps so far emit fewer tokens per
//!   second than that ([`auto_prefers_ar`]); either way every token is the target's own, so the
//!   switch is lossless.
//! - Auto mode given an [`AutoRecord`] of earlier runs (same device, target, drafter, dtype and
//!   mode; kept by the caller) that ran speculation at under half AR's rate
//!   ([`AutoRecord::prefers_ar`]) decodes with AR steps from the first token: no drafter call, no
//!   AR timing. Any other record changes nothing (live measurement decides).

use crate::ar::{token_budget, Emitter, GenerateConfig, Generation};
use crate::sampling::{greedy_rows, Sampler};
use crate::tree::tree_from_draft_logits;
use crate::Result;
use candle_core::Tensor;
use dflash_core::AttentionMask;
use dflash_models::{DFlashDrafter, DraftCache, ForwardRequest, LogitRows, TargetModel};
use serde::Serialize;
use std::time::Instant;

/// Anything that proposes a block of `block_size() - 1` tokens after a bonus token.
pub trait BlockDrafter {
    fn block_size(&self) -> usize;
    /// Target layers whose outputs (taps) the drafter consumes.
    fn target_layers(&self) -> &[usize];
    /// Forget any previous sequence; room for `capacity` positions.
    fn reset(&mut self, capacity: usize) -> Result<()>;
    /// `new_ctx`: `[m, T·H]` taps of the tokens committed since the last call (positions
    /// `start−m..start`); `history`: every committed token (prompt + output, bonus last). Returns
    /// logits `[block_size − 1, V]` for positions `start+1 ..`.
    fn draft(
        &mut self,
        target: &dyn TargetModel,
        new_ctx: &Tensor,
        bonus: u32,
        start: usize,
        history: &[u32],
    ) -> Result<Tensor>;
}

/// The DFlash drafter with its committed-context cache (handed back to the drafter's pool when
/// the runner is reset or dropped, so the next answer replays its CUDA graphs).
pub struct DFlashRunner<'a> {
    drafter: &'a DFlashDrafter,
    cache: Option<DraftCache>,
}

impl Drop for DFlashRunner<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.cache.take() {
            self.drafter.recycle_cache(c);
        }
    }
}

impl<'a> DFlashRunner<'a> {
    pub fn new(drafter: &'a DFlashDrafter) -> Self {
        Self {
            drafter,
            cache: None,
        }
    }
}

impl BlockDrafter for DFlashRunner<'_> {
    fn block_size(&self) -> usize {
        self.drafter.block_size()
    }
    fn target_layers(&self) -> &[usize] {
        self.drafter.target_layers()
    }
    fn reset(&mut self, capacity: usize) -> Result<()> {
        if let Some(old) = self.cache.take() {
            self.drafter.recycle_cache(old);
        }
        self.cache = Some(self.drafter.take_cache(capacity));
        Ok(())
    }
    fn draft(
        &mut self,
        target: &dyn TargetModel,
        new_ctx: &Tensor,
        bonus: u32,
        start: usize,
        _history: &[u32],
    ) -> Result<Tensor> {
        let cache = self.cache.as_mut().expect("reset before draft");
        Ok(self.drafter.draft(target, cache, new_ctx, bonus, start)?)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecMode {
    /// Verify the single drafted path.
    DFlash,
    /// Verify the best `budget`-node tree.
    DdTree { budget: usize },
}

/// Per-step measurements of a speculative run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SpecStats {
    /// τ of each step: accepted drafts + the bonus token.
    pub acceptance: Vec<usize>,
    pub draft_seconds: f64,
    pub verify_seconds: f64,
    pub tree_build_seconds: f64,
    /// Drafter prefill (first draft call over the whole prompt), excluded from `draft_seconds`.
    pub draft_prefill_seconds: f64,
    /// Auto mode's measurements and choice.
    pub auto: Option<AutoChoice>,
}

/// What auto mode measured and chose.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AutoChoice {
    /// One AR step (a one-token forward and its argmax), median of three after two warm-up
    /// steps, before the loop.
    pub ar_step_seconds: f64,
    /// Tokens per second of the speculative steps after the first (which pays the drafter's
    /// prefill), when the choice was last checked.
    pub spec_tokens_per_second: f64,
    pub ar_tokens_per_second: f64,
    /// Speculative steps behind `spec_tokens_per_second` (the first, which pays the drafter's
    /// prefill, not counted).
    pub spec_steps: usize,
    /// The step after which decoding went on with AR steps, if it did (0: from the start,
    /// decided by `remembered`).
    pub switched_to_ar_at_step: Option<usize>,
    /// The earlier runs' record that decided, when one did (then the rates above are its).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remembered: Option<AutoRecord>,
}

/// What auto mode measured in an earlier run on the same device, target, drafter, dtype and
/// mode: the rates it compared. Callers keep these between runs (the CLI in a cache file) and hand
/// the latest to [`generate_auto_remembered`].
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct AutoRecord {
    pub spec_tokens_per_second: f64,
    pub ar_tokens_per_second: f64,
    /// Speculative steps behind `spec_tokens_per_second` (the first, drafter-prefill step not
    /// counted).
    pub spec_steps: usize,
}

impl AutoRecord {
    /// The record of a finished auto run, if it measured enough to judge: at least
    /// [`AUTO_CLEAR_STEPS`] speculative steps, or a switch to AR (which may come after one step
    /// when no accepted length could pay for it). `None` for runs decided by a record (nothing
    /// new measured).
    pub fn from_choice(choice: &AutoChoice) -> Option<Self> {
        let judged = choice.spec_steps >= AUTO_CLEAR_STEPS
            || (choice.spec_steps >= 1 && choice.switched_to_ar_at_step.is_some());
        (choice.remembered.is_none()
            && judged
            && choice.spec_tokens_per_second > 0.0
            && choice.ar_tokens_per_second > 0.0)
            .then_some(Self {
                spec_tokens_per_second: choice.spec_tokens_per_second,
                ar_tokens_per_second: choice.ar_tokens_per_second,
                spec_steps: choice.spec_steps,
            })
    }

    /// Speculation ran at under half AR's rate: the clear case in which live auto mode switches
    /// within [`AUTO_CLEAR_STEPS`] steps too, so starting with AR loses nothing it would have won.
    pub fn prefers_ar(&self) -> bool {
        self.spec_steps >= 1 && self.spec_tokens_per_second < 0.5 * self.ar_tokens_per_second
    }
}

/// Speculative steps auto mode watches before it may switch to AR for being merely slower. On the
/// H200 with SmolLM2 a window of 4 switched on prompts whose early τ dipped although DDTree was
/// faster over the whole answer (auto 0.99× AR on mt_bench where DDTree gave 1.12×,
/// docs/benchmarks.md session 10).
pub const AUTO_MIN_STEPS: usize = 16;

/// Speculative steps after which auto mode switches when they run at under half AR's rate (the
/// CPU, where a DDTree step costs ~15 AR steps).
pub const AUTO_CLEAR_STEPS: usize = 4;

/// Whether auto mode should go on with AR steps, after `counted` speculative steps (the first,
/// which pays the drafter's prefill, is not counted) that emitted `spec_tokens` in
/// `spec_seconds`, against one AR step of `ar_step_seconds`; `max_per_step` is the most tokens
/// one step can emit (the block size).
/// Switch at once when even a fully accepted step would lose, after [`AUTO_CLEAR_STEPS`] when
/// speculation runs at under half AR's rate, after [`AUTO_MIN_STEPS`] when it is slower at all.
pub fn auto_prefers_ar(
    counted: usize,
    spec_tokens: usize,
    spec_seconds: f64,
    ar_step_seconds: f64,
    max_per_step: usize,
) -> bool {
    if counted == 0 || spec_seconds <= 0.0 {
        return false;
    }
    let step = spec_seconds / counted as f64;
    let break_even_tau = step / ar_step_seconds.max(1e-12);
    let tau = spec_tokens as f64 / counted as f64;
    break_even_tau > max_per_step as f64
        || (counted >= AUTO_CLEAR_STEPS && tau < break_even_tau / 2.0)
        || (counted >= AUTO_MIN_STEPS && tau < break_even_tau)
}

/// Median seconds of three one-token AR steps at `pos` (the cache is cropped back each time),
/// after two untimed ones: on CUDA a step shape runs eagerly once and is captured as a graph on
/// its second run, and timing those would make AR look several times slower than it decodes.
fn time_ar_step(
    target: &dyn TargetModel,
    cache: &mut dflash_core::SequenceCache,
    token: u32,
    pos: usize,
) -> Result<f64> {
    let mut times = vec![];
    for run in 0..5 {
        let t = Instant::now();
        let p = [pos as u32];
        let out = target.forward(
            &ForwardRequest::causal(&[token], &p, LogitRows::Last),
            cache,
        )?;
        greedy_rows(out.logits.as_ref().expect("asked for logits"))?;
        if run >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
        cache.crop(pos);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[1])
}

impl SpecStats {
    pub fn mean_acceptance(&self) -> f64 {
        if self.acceptance.is_empty() {
            return 0.0;
        }
        self.acceptance.iter().sum::<usize>() as f64 / self.acceptance.len() as f64
    }
    /// Count of steps per τ = 1..=max.
    pub fn histogram(&self, max: usize) -> Vec<usize> {
        let mut h = vec![0; max];
        for &a in &self.acceptance {
            h[a.clamp(1, max) - 1] += 1;
        }
        h
    }
}

/// The verified rows a step accepted: the first n of a DFlash block, or a DDTree path (node
/// indices, root first).
enum Accepted {
    Prefix(usize),
    Path(Vec<u32>),
}

/// What a draft hands the verifier: DFlash's argmax ids, or DDTree's drafter logits (on the
/// device) and its node budget.
enum Draft {
    Ids(Vec<u32>),
    Logits(Tensor, usize),
}

/// Speculative decoding in `mode` for the whole answer.
pub fn generate_speculative(
    target: &dyn TargetModel,
    drafter: &mut dyn BlockDrafter,
    prompt: &[u32],
    cfg: &GenerateConfig,
    mode: SpecMode,
    on_token: &mut dyn FnMut(u32),
) -> Result<Generation> {
    generate(target, drafter, prompt, cfg, mode, AutoStart::Off, on_token)
}

/// Speculative decoding in `mode` while it is faster than AR on this device, measured as it
/// runs; AR steps after that (see the module invariants).
pub fn generate_auto(
    target: &dyn TargetModel,
    drafter: &mut dyn BlockDrafter,
    prompt: &[u32],
    cfg: &GenerateConfig,
    mode: SpecMode,
    on_token: &mut dyn FnMut(u32),
) -> Result<Generation> {
    generate_auto_remembered(target, drafter, prompt, cfg, mode, None, on_token)
}

/// [`generate_auto`] that first consults `record`, the latest [`AutoRecord`] of earlier runs
/// with this device, target, drafter, dtype and mode: when it [prefers AR](AutoRecord::prefers_ar)
/// every token comes from AR steps (no drafter call, no timing); otherwise as [`generate_auto`].
pub fn generate_auto_remembered(
    target: &dyn TargetModel,
    drafter: &mut dyn BlockDrafter,
    prompt: &[u32],
    cfg: &GenerateConfig,
    mode: SpecMode,
    record: Option<&AutoRecord>,
    on_token: &mut dyn FnMut(u32),
) -> Result<Generation> {
    let start = match record {
        Some(r) if r.prefers_ar() => AutoStart::Remembered(r.clone()),
        _ => AutoStart::Live,
    };
    generate(target, drafter, prompt, cfg, mode, start, on_token)
}

/// How a run chooses between speculation and AR steps.
enum AutoStart {
    /// Speculation throughout (an explicit mode).
    Off,
    /// Auto mode measuring as it goes.
    Live,
    /// Auto mode starting with AR on an earlier run's record.
    Remembered(AutoRecord),
}

fn generate(
    target: &dyn TargetModel,
    drafter: &mut dyn BlockDrafter,
    prompt: &[u32],
    cfg: &GenerateConfig,
    mode: SpecMode,
    auto: AutoStart,
    on_token: &mut dyn FnMut(u32),
) -> Result<Generation> {
    let context = target.info().max_position_embeddings;
    let (budget, context_bound) = token_budget(prompt.len(), cfg.max_new_tokens, context)?;
    let bs = drafter.block_size();
    let verify_rows = match mode {
        SpecMode::DFlash => bs,
        SpecMode::DdTree { budget } => budget + 1,
    };
    let capacity = prompt.len() + budget + verify_rows;
    let mut sampler = Sampler::new(cfg.sampling.clone())?;
    let mut cache = target.take_cache(capacity)?;
    drafter.reset(capacity)?;
    let taps: Vec<usize> = drafter.target_layers().to_vec();
    let mut stats = SpecStats::default();

    let t0 = Instant::now();
    let positions: Vec<u32> = (0..prompt.len() as u32).collect();
    let req = ForwardRequest {
        tokens: prompt,
        positions: &positions,
        mask: AttentionMask::Causal,
        taps: &taps,
        logits: LogitRows::Last,
    };
    let out = target.forward(&req, &mut cache)?;
    let first = sampler.sample_rows(out.logits.as_ref().expect("asked for logits"))?[0];
    let mut new_ctx = out.concat_taps()?;
    let prefill_seconds = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let mut history: Vec<u32> = prompt.to_vec();
    let mut emit = Emitter::new(budget, context_bound, cfg);
    let mut stop = if budget == 0 {
        Some(crate::StopReason::MaxTokens)
    } else {
        emit.push(first, on_token)
    };
    history.push(first);
    let mut steps: usize = 0;
    let mut use_ar = false;
    match auto {
        // (nothing to time when the first token already ended the answer)
        AutoStart::Live if stop.is_none() => {
            let ar = time_ar_step(target, &mut cache, first, prompt.len())?;
            stats.auto = Some(AutoChoice {
                ar_step_seconds: ar,
                ar_tokens_per_second: 1.0 / ar.max(1e-12),
                ..Default::default()
            });
        }
        AutoStart::Remembered(record) => {
            use_ar = true;
            stats.auto = Some(AutoChoice {
                ar_step_seconds: 1.0 / record.ar_tokens_per_second.max(1e-12),
                ar_tokens_per_second: record.ar_tokens_per_second,
                spec_tokens_per_second: record.spec_tokens_per_second,
                spec_steps: 0,
                switched_to_ar_at_step: Some(0),
                remembered: Some(record),
            });
        }
        AutoStart::Off | AutoStart::Live => {}
    }
    let (mut spec_tokens, mut spec_seconds) = (0usize, 0f64);
    while stop.is_none() {
        let start = history.len() - 1;
        let bonus = history[start];
        if use_ar {
            let p = [start as u32];
            let out = target.forward(
                &ForwardRequest::causal(&[bonus], &p, LogitRows::Last),
                &mut cache,
            )?;
            let y = sampler.sample_rows(out.logits.as_ref().expect("asked for logits"))?[0];
            steps += 1;
            history.push(y);
            stop = emit.push(y, on_token);
            continue;
        }
        let step_start = Instant::now();
        let td = Instant::now();
        let draft_logits = drafter.draft(target, &new_ctx, bonus, start, &history)?;
        // DFlash proposes each row's argmax (only ids cross to the host); DDTree needs the rows
        let draft = match mode {
            SpecMode::DFlash => Draft::Ids(greedy_rows(&draft_logits)?),
            SpecMode::DdTree { budget: nodes } => Draft::Logits(draft_logits, nodes),
        };
        let dt = td.elapsed().as_secs_f64();
        if steps == 0 {
            stats.draft_prefill_seconds = dt;
        } else {
            stats.draft_seconds += dt;
        }
        let tv = Instant::now();
        let (accepted_path, emitted, taps_out) = match &draft {
            Draft::Ids(ids) => {
                let mut block = vec![bonus];
                block.extend_from_slice(ids);
                let pos: Vec<u32> = (start as u32..(start + block.len()) as u32).collect();
                let req = ForwardRequest {
                    tokens: &block,
                    positions: &pos,
                    mask: AttentionMask::Causal,
                    taps: &taps,
                    logits: LogitRows::All,
                };
                let out = target.forward(&req, &mut cache)?;
                let y = sampler.sample_rows(out.logits.as_ref().expect("asked for logits"))?;
                let mut a = 0;
                while a + 1 < block.len() && block[a + 1] == y[a] {
                    a += 1;
                }
                cache.crop(start + a + 1);
                let mut emitted = block[1..=a].to_vec();
                emitted.push(y[a]);
                // the accepted rows are the block's first a + 1: a view, no gather
                (Accepted::Prefix(a + 1), emitted, out.concat_taps()?)
            }
            Draft::Logits(draft_logits, nodes) => {
                let tb = Instant::now();
                let tree = tree_from_draft_logits(draft_logits, bonus, *nodes)?;
                stats.tree_build_seconds += tb.elapsed().as_secs_f64();
                let pos = tree.positions(start);
                let out = target.forward(&tree.verify_request(&pos, &taps), &mut cache)?;
                let y = sampler.sample_rows(out.logits.as_ref().expect("asked for logits"))?;
                let mut cur = 0;
                let mut path = vec![0u32];
                let mut emitted = vec![];
                while let Some(&child) = tree.children[cur].get(&y[cur]) {
                    emitted.push(tree.tokens[child]);
                    path.push(child as u32);
                    cur = child;
                }
                emitted.push(y[cur]);
                cache.keep_rows(start, &path)?;
                (Accepted::Path(path), emitted, out.concat_taps()?)
            }
        };
        stats.verify_seconds += tv.elapsed().as_secs_f64();
        steps += 1;
        stats.acceptance.push(emitted.len());
        for &tok in &emitted {
            history.push(tok);
            stop = emit.push(tok, on_token);
            if stop.is_some() {
                break;
            }
        }
        if stop.is_none() {
            new_ctx = match accepted_path {
                Accepted::Prefix(n) => taps_out.narrow(0, 0, n)?,
                Accepted::Path(path) => {
                    let idx = Tensor::from_slice(&path, path.len(), cache.device())?;
                    taps_out.index_select(&idx, 0)?
                }
            };
        }
        if steps > 1 {
            spec_tokens += stats.acceptance.last().copied().unwrap_or(0);
            spec_seconds += step_start.elapsed().as_secs_f64();
        }
        if let Some(choice) = stats.auto.as_mut().filter(|c| c.remembered.is_none()) {
            choice.spec_tokens_per_second = spec_tokens as f64 / spec_seconds.max(1e-12);
            let counted = steps.saturating_sub(1);
            choice.spec_steps = counted;
            let ar = choice.ar_step_seconds;
            if stop.is_none() && auto_prefers_ar(counted, spec_tokens, spec_seconds, ar, bs) {
                choice.switched_to_ar_at_step = Some(steps);
                use_ar = true;
            }
        }
    }
    let (tokens, stop_reason) = emit.finish(stop.expect("loop ends on a stop"));
    target.recycle_cache(cache);
    Ok(Generation {
        tokens,
        stop_reason,
        prompt_tokens: prompt.len(),
        prefill_seconds,
        decode_seconds: t1.elapsed().as_secs_f64(),
        steps,
        spec: Some(stats),
        margins: vec![],
    })
}

#[cfg(test)]
mod tests {
    use super::{auto_prefers_ar, AutoChoice, AutoRecord};

    #[test]
    fn a_record_is_kept_only_when_it_judged_and_prefers_ar_only_when_clearly_slower() {
        let live = |spec_steps, switched| AutoChoice {
            ar_step_seconds: 0.025,
            spec_tokens_per_second: 14.0,
            ar_tokens_per_second: 40.0,
            spec_steps,
            switched_to_ar_at_step: switched,
            remembered: None,
        };
        assert_eq!(
            AutoRecord::from_choice(&live(2, None)),
            None,
            "too few steps"
        );
        let r = AutoRecord::from_choice(&live(4, Some(5))).unwrap();
        assert!(r.prefers_ar(), "14 tok/s < half of 40");
        assert!(
            AutoRecord::from_choice(&live(1, Some(2))).is_some(),
            "switched at once"
        );
        let close = AutoRecord {
            spec_tokens_per_second: 25.0,
            ..r.clone()
        };
        assert!(
            !close.prefers_ar(),
            "slower but not clearly: live auto decides"
        );
        let remembered = AutoChoice {
            remembered: Some(r),
            ..live(0, Some(0))
        };
        assert_eq!(
            AutoRecord::from_choice(&remembered),
            None,
            "nothing new measured"
        );
    }

    #[test]
    fn auto_switches_fast_when_speculation_is_far_slower_and_late_when_it_is_close() {
        // 2 CPU cores, SmolLM2: a DDTree step 0.5 s, an AR step 32 ms, τ 2.2 (break-even τ 15.6)
        assert!(!auto_prefers_ar(1, 2, 0.5, 0.032, 16));
        assert!(auto_prefers_ar(4, 9, 2.0, 0.032, 16));
        // no accepted length could pay for the step: switch after the first counted step
        assert!(auto_prefers_ar(1, 16, 1.0, 0.05, 16));
        // H200-like: a 12 ms step against a 4.4 ms AR step (break-even τ 2.7)
        assert!(!auto_prefers_ar(40, 124, 0.48, 0.0044, 16)); // τ 3.1: faster, never switch
        assert!(!auto_prefers_ar(15, 37, 0.18, 0.0044, 16)); // τ 2.5: slower, still watching
        assert!(auto_prefers_ar(16, 40, 0.192, 0.0044, 16)); // τ 2.5 over 16 steps: switch
        assert!(!auto_prefers_ar(0, 0, 0.0, 0.0044, 16));
    }
}
