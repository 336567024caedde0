//! The training run: epochs over tokenised conversations packed into steps of about
//! `batch_tokens` tokens, checkpoints every N steps (z-lab drafter + optimizer moments + run
//! state, each written atomically), JSONL metrics, held-out validation (teacher-forced streak and
//! DDTree-N streak).
//!
//! Invariants: the step plan ([`plan_steps`]) is a pure function of the data lengths and the
//! config, and step `s` draws its anchors from an RNG seeded by `(seed, s)`, so a run resumed from
//! the checkpoint at step `s` computes exactly what an uninterrupted run computes; master weights
//! and optimizer moments are f32 whatever the compute dtype; the target is frozen and never saved.

use crate::data::Example;
use crate::loss::{block_labels, block_loss};
use crate::optim::{AdamW, AdamWConfig, LrSchedule};
use crate::profile::PhaseTimer;
use crate::step::{compute_drafter, sequence_taps, Sequence, TrainStep};
use crate::{Result, TrainError};
use candle_core::{DType, Var};
use candle_nn::{VarBuilder, VarMap};
use dflash_core::Grad;
use dflash_decoding::tree::{build_tree, top_k_log_probs};
use dflash_models::drafter::{init_weights_for_target, save_drafter};
use dflash_models::{DFlashConfig, DFlashDrafter, TargetModel};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainConfig {
    pub anchors: usize,
    pub gamma: f64,
    pub lr: f64,
    pub epochs: usize,
    pub max_length: usize,
    pub warmup_ratio: f64,
    pub checkpoint_every: usize,
    pub seed: u64,
    pub tree_budget: usize,
    pub adamw: AdamWConfig,
    /// Tokens per optimizer step: whole sequences are packed until they reach this (0: one each).
    #[serde(default)]
    pub batch_tokens: usize,
    /// Padded tokens per batched forward inside a step (0: `batch_tokens`, at least the longest).
    #[serde(default)]
    pub micro_batch_tokens: usize,
    /// Self-distillation: share of the target's own distribution in each row's loss (0 = off).
    #[serde(default)]
    pub distill: f64,
}

/// Every optimizer step of the run: example indices, per epoch a seeded permutation packed in
/// order into groups of about `batch_tokens` tokens (each sequence counted up to `max_length`).
pub fn plan_steps(lengths: &[usize], cfg: &TrainConfig) -> Vec<Vec<usize>> {
    let mut steps = vec![];
    for epoch in 0..cfg.epochs {
        let mut order: Vec<usize> = (0..lengths.len()).collect();
        order.shuffle(&mut ChaCha8Rng::seed_from_u64(
            cfg.seed ^ (0x5eed_0000 + epoch as u64),
        ));
        let mut group = vec![];
        let mut tokens = 0;
        for i in order {
            group.push(i);
            tokens += lengths[i].min(cfg.max_length);
            if tokens >= cfg.batch_tokens {
                steps.push(std::mem::take(&mut group));
                tokens = 0;
            }
        }
        if !group.is_empty() {
            steps.push(group);
        }
    }
    steps
}

/// One line of `log.jsonl` (also handed to the progress callback).
#[derive(Debug, Clone, Serialize)]
pub struct StepLog {
    pub step: usize,
    pub total_steps: usize,
    pub loss: f32,
    /// Argmax accuracy of block rows 1..B.
    pub accuracy: Vec<f32>,
    pub streak: f32,
    pub lr: f64,
    pub grad_norm: f64,
    pub sequences: usize,
    pub blocks: usize,
    pub tokens_per_second: f64,
    /// Drafter matmul FLOPs per second (forward + backward, LM head included) over `peak_flops`.
    pub drafter_mfu: f64,
    pub seconds: f64,
    /// Seconds per phase of the step (device-synchronised), when the run profiles.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub phases: std::collections::BTreeMap<String, f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct RunState {
    pub step: usize,
    pub total_steps: usize,
    /// The config the run was started with (absent in checkpoints older than this field): a
    /// `--resume` that asks for another learning rate, seed, packing or loss is refused, since it
    /// would silently compute something other than the run it claims to continue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<TrainConfig>,
}

/// Settings a resumed run may change without changing what it computes: the micro-batch split
/// (only the summation order of one step's gradients), how often it checkpoints, the validation
/// tree's size.
const FREE_ON_RESUME: [&str; 3] = ["micro_batch_tokens", "checkpoint_every", "tree_budget"];

/// What `now` changes against the config a checkpoint was started with, as
/// `--flag: checkpoint X, now Y` lines (`adamw.beta2: …` for settings without a flag; empty: the
/// resume computes the same run).
pub fn resume_conflicts(saved: &TrainConfig, now: &TrainConfig) -> Vec<String> {
    fn flat(c: &TrainConfig) -> BTreeMap<String, serde_json::Value> {
        let mut out = BTreeMap::new();
        let v = serde_json::to_value(c).expect("config serialises");
        for (k, v) in v.as_object().expect("config is an object") {
            match v.as_object() {
                Some(inner) => {
                    for (ik, iv) in inner {
                        // adamw.lr mirrors lr
                        if ik != "lr" {
                            out.insert(format!("{k}.{ik}"), iv.clone());
                        }
                    }
                }
                None => {
                    out.insert(k.clone(), v.clone());
                }
            }
        }
        out
    }
    let (a, b) = (flat(saved), flat(now));
    a.iter()
        .filter(|(k, _)| !FREE_ON_RESUME.contains(&k.as_str()))
        .filter(|(k, v)| b.get(*k) != Some(*v))
        .map(|(k, v)| {
            let now = b.get(k).map_or("unset".to_string(), |x| x.to_string());
            // top-level settings are `dflash train` flags; nested ones (adamw.*) have none
            let name = if k.contains('.') {
                k.clone()
            } else {
                format!("--{}", k.replace('_', "-"))
            };
            format!("{name}: checkpoint {v}, now {now}")
        })
        .collect()
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct Validation {
    /// Teacher-forced expected τ: 1 + mean leading run of correct block rows.
    pub streak: f32,
    /// Same with the DDTree of `tree_budget` nodes walked along the true continuation.
    pub ddtree_streak: f32,
    /// τ of decoding replayed on each answer (a block at every answer position, walked as
    /// decoding walks: `crate::replay`): what `dflash eval` measures on this text. The streaks
    /// above average over all positions and run higher, because decoding's blocks start right
    /// after a rejection.
    pub replayed_tau: f32,
    /// The same with DDTree's `tree_budget` nodes.
    pub replayed_ddtree_tau: f32,
    pub loss: f32,
    pub blocks: usize,
}

pub struct Trainer<'a> {
    target: &'a dyn TargetModel,
    pub draft_cfg: DFlashConfig,
    pub cfg: TrainConfig,
    varmap: VarMap,
    pub drafter: DFlashDrafter,
    opt: AdamW,
    pub state: RunState,
    dir: PathBuf,
    compute_dtype: DType,
    /// Peak FLOP/s of the device, for MFU (0: not reported).
    pub peak_flops: f64,
    /// Stop (after a checkpoint) once a call to [`Trainer::run`] has run this long.
    pub time_limit: Option<std::time::Duration>,
    /// Time each phase of a step (synchronising the device between phases, which costs a
    /// little speed) and log it as `phases`.
    pub profile: bool,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> TrainError + '_ {
    move |e| TrainError::Io {
        path: path.display().to_string(),
        source: e,
    }
}

impl<'a> Trainer<'a> {
    /// A new run in `dir` starting from `initial` weights (default: [`init_weights_for_target`]),
    /// or — when `resume` and a checkpoint exists — the run continued from it (`initial` unused).
    #[allow(clippy::too_many_arguments)]
    pub fn open(
        target: &'a dyn TargetModel,
        draft_cfg: DFlashConfig,
        cfg: TrainConfig,
        dir: &Path,
        total_steps: usize,
        resume: bool,
        compute_dtype: DType,
        initial: Option<BTreeMap<String, candle_core::Tensor>>,
    ) -> Result<Self> {
        let ckpt = dir.join("checkpoint");
        let state_path = ckpt.join("state.json");
        let (weights, state) = if resume && state_path.is_file() {
            let mut state: RunState = serde_json::from_str(
                &std::fs::read_to_string(&state_path).map_err(io(&state_path))?,
            )
            .map_err(|e| TrainError::InvalidInput(format!("{}: {e}", state_path.display())))?;
            if let Some(saved) = &state.config {
                let conflicts = resume_conflicts(saved, &cfg);
                if !conflicts.is_empty() {
                    return Err(TrainError::InvalidInput(format!(
                        "--resume: {} was started with other settings ({}); pass the same \
                         flags to continue it, or a new --out to start another run",
                        dir.display(),
                        conflicts.join("; ")
                    )));
                }
            }
            // a checkpoint from before `config` was recorded adopts this run's flags
            state.config.get_or_insert_with(|| cfg.clone());
            let files = dflash_models::weights::safetensors_files(&ckpt)?;
            let mut w = BTreeMap::new();
            for f in files {
                w.extend(candle_core::safetensors::load(&f, &target.info().device)?);
            }
            (w, state)
        } else {
            (
                match initial {
                    Some(w) => w,
                    None => init_weights_for_target(&draft_cfg, target, cfg.seed)?,
                },
                RunState {
                    step: 0,
                    total_steps,
                    config: Some(cfg.clone()),
                },
            )
        };
        let dev = target.info().device.clone();
        let varmap = VarMap::new();
        {
            let mut data = varmap.data().lock().expect("fresh varmap");
            for (k, v) in weights {
                data.insert(
                    k,
                    Var::from_tensor(&v.to_device(&dev)?.to_dtype(DType::F32)?)?,
                );
            }
        }
        let mut drafter = DFlashDrafter::new(
            &draft_cfg,
            VarBuilder::from_varmap(&varmap, DType::F32, &dev),
        )?;
        drafter.bind_target(target)?;
        if !drafter.plain_logits() {
            // the loss multiplies the LM head in chunks itself (step.rs), without the drafter's
            // output multiplier or soft cap: training would optimise other logits than decoding
            return Err(TrainError::InvalidInput(
                "the drafter's config sets output_multiplier or final_logit_softcapping, which \
                 training does not apply yet (decoding and eval do); remove them to train"
                    .into(),
            ));
        }
        let params: HashMap<String, Var> = varmap.data().lock().expect("varmap").clone();
        let mut opt = AdamW::new(params, cfg.adamw)?;
        if state.step > 0 {
            opt.load(&ckpt.join("optimizer.safetensors"), state.step)?;
        }
        Ok(Self {
            target,
            draft_cfg,
            cfg,
            varmap,
            drafter,
            opt,
            state,
            dir: dir.to_path_buf(),
            compute_dtype,
            peak_flops: 0.0,
            time_limit: None,
            profile: false,
        })
    }

    fn schedule(&self) -> LrSchedule {
        let total = self.state.total_steps;
        LrSchedule {
            peak: self.cfg.lr,
            warmup: ((total as f64 * self.cfg.warmup_ratio) as usize).max(1),
            total,
        }
    }

    /// The master weights by checkpoint name, in `dtype` (f32: the masters themselves).
    fn weights(&self, dtype: DType) -> Result<BTreeMap<String, candle_core::Tensor>> {
        self.varmap
            .data()
            .lock()
            .expect("varmap")
            .iter()
            .map(|(k, v)| Ok((k.clone(), v.as_tensor().to_dtype(dtype)?)))
            .collect()
    }

    /// Writes the checkpoint (drafter, optimizer, state) atomically-per-file, state last.
    pub fn checkpoint(&self) -> Result<()> {
        let ckpt = self.dir.join("checkpoint");
        save_drafter(&ckpt, &self.draft_cfg, &self.weights(DType::F32)?, 16 << 20)?;
        self.opt.save(&ckpt.join("optimizer.safetensors"))?;
        let p = ckpt.join("state.json");
        let state = serde_json::to_string(&self.state).expect("state serialises");
        dflash_core::fs::write_atomic(&p, state.as_bytes()).map_err(io(&p))?;
        let log = self.dir.join("log.jsonl");
        if log.is_file() {
            crate::curves::write_curves(
                &log,
                &self.dir.join("curves.png"),
                &format!("DFlash drafter training ({})", self.dir.display()),
            )?;
        }
        Ok(())
    }

    /// Writes the current drafter (z-lab format, shards ≤ 16 MiB) in `dtype` to `dir`: the
    /// deliverable of a run (z-lab's released drafters are bf16).
    pub fn export(&self, dir: &Path, dtype: DType) -> Result<()> {
        let weights = self.weights(dtype)?;
        let mut cfg = self.draft_cfg.clone();
        cfg.dtype = Some(
            match dtype {
                DType::BF16 => "bfloat16",
                DType::F16 => "float16",
                _ => "float32",
            }
            .into(),
        );
        save_drafter(dir, &cfg, &weights, 16 << 20)?;
        Ok(())
    }

    /// Matmul FLOPs of the drafter for `rows` block rows, forward and backward: 6 per parameter
    /// per row for the drafter's own weights, 4 per LM-head weight (no weight gradient), plus the
    /// fc projection over `ctx_rows` context rows.
    fn drafter_flops(&self, rows: usize, ctx_rows: usize) -> f64 {
        let c = &self.draft_cfg;
        let h = c.hidden_size as f64;
        let (nh, nkv, hd) = (
            c.num_attention_heads as f64,
            c.num_key_value_heads as f64,
            c.head_dim as f64,
        );
        let per_layer = h * hd * (2.0 * nh + 2.0 * nkv) + 3.0 * h * c.intermediate_size as f64;
        let layers = c.num_hidden_layers as f64;
        let fc = c.target_layer_ids().len() as f64 * h * h;
        let block =
            6.0 * rows as f64 * layers * per_layer + 4.0 * rows as f64 * h * c.vocab_size as f64;
        // context rows go through fc and each layer's k/v projections
        let ctx = 6.0 * ctx_rows as f64 * (fc + layers * h * hd * 2.0 * nkv);
        block + ctx
    }

    /// Trains until `total_steps` along `plan` (from [`plan_steps`]), logging to `dir/log.jsonl`.
    /// Returns false when it stopped early at [`Trainer::time_limit`] (checkpointed; `--resume`
    /// continues the same plan).
    pub fn run(
        &mut self,
        data: &[Example],
        plan: &[Vec<usize>],
        progress: &mut dyn FnMut(&StepLog),
    ) -> Result<bool> {
        let started = Instant::now();
        if data.is_empty() {
            return Err(TrainError::InvalidInput("no training examples".into()));
        }
        if plan.len() != self.state.total_steps {
            return Err(TrainError::InvalidInput(format!(
                "the step plan has {} steps but the run was opened for {} (data or flags changed \
                 since the checkpoint?)",
                plan.len(),
                self.state.total_steps
            )));
        }
        std::fs::create_dir_all(&self.dir).map_err(io(&self.dir))?;
        let log_path = self.dir.join("log.jsonl");
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(io(&log_path))?;
        let ts = TrainStep {
            anchors_per_sequence: self.cfg.anchors,
            gamma: self.cfg.gamma,
            schedule: self.schedule(),
            micro_batch_tokens: match self.cfg.micro_batch_tokens {
                0 => self.cfg.batch_tokens,
                m => m,
            },
            distill: self.cfg.distill,
            // the layout the drafter's config declares, which its validation and decoding use
            convention: self.draft_cfg.block_convention(),
        };
        let masks: Vec<Vec<bool>> = data.iter().map(|e| e.mask()).collect();
        while self.state.step < self.state.total_steps {
            let s = self.state.step;
            let group: Vec<Sequence> = plan[s]
                .iter()
                .map(|&i| {
                    let len = data[i].tokens.len().min(self.cfg.max_length);
                    Sequence {
                        tokens: &data[i].tokens[..len],
                        loss_mask: &masks[i][..len],
                    }
                })
                .collect();
            let t0 = Instant::now();
            let mut rng = ChaCha8Rng::seed_from_u64(
                self.cfg
                    .seed
                    .wrapping_mul(0x9E37_79B9)
                    .wrapping_add(s as u64),
            );
            let lr = ts.schedule.at(s);
            let mut timer =
                PhaseTimer::new(self.profile.then(|| self.target.info().device.clone()))?;
            let drafter = if self.compute_dtype == DType::F32 {
                None
            } else {
                Some(compute_drafter(
                    &self.draft_cfg,
                    &self.varmap,
                    self.compute_dtype,
                    self.target,
                )?)
            };
            timer.mark("cast_weights")?;
            let r = ts.run(
                self.target,
                drafter.as_ref().unwrap_or(&self.drafter),
                &mut self.opt,
                &group,
                &mut rng,
                &mut timer,
            )?;
            self.state.step += 1;
            let secs = t0.elapsed().as_secs_f64();
            let flops = self.drafter_flops(r.blocks * self.draft_cfg.block_size, r.tokens);
            let entry = StepLog {
                step: self.state.step,
                total_steps: self.state.total_steps,
                loss: r.loss.loss,
                accuracy: r.loss.accuracy,
                streak: r.loss.streak,
                lr,
                grad_norm: r.grad_norm,
                sequences: group.len(),
                blocks: r.blocks,
                tokens_per_second: r.tokens as f64 / secs,
                drafter_mfu: if self.peak_flops > 0.0 {
                    flops / secs / self.peak_flops
                } else {
                    0.0
                },
                seconds: secs,
                phases: r.phases.into_iter().collect(),
            };
            writeln!(
                log,
                "{}",
                serde_json::to_string(&entry).expect("log serialises")
            )
            .map_err(io(&log_path))?;
            progress(&entry);
            if self.cfg.checkpoint_every > 0
                && self.state.step.is_multiple_of(self.cfg.checkpoint_every)
            {
                self.checkpoint()?;
            }
            if self.time_limit.is_some_and(|l| started.elapsed() >= l)
                && self.state.step < self.state.total_steps
            {
                self.checkpoint()?;
                return Ok(false);
            }
        }
        self.checkpoint()?;
        Ok(true)
    }

    /// Held-out streaks with a fixed set of anchors per example.
    pub fn validate(&self, data: &[Example]) -> Result<Validation> {
        let bs = self.drafter.block_size();
        let mut v = Validation::default();
        let (mut streak, mut tree_streak, mut loss) = (0f64, 0f64, 0f64);
        // Σ τ and steps of the replayed DFlash and DDTree walks
        let (mut replay, mut replay_steps) = (0usize, 0usize);
        let (mut replay_tree, mut replay_tree_steps) = (0usize, 0usize);
        for (i, ex) in data.iter().enumerate() {
            let len = ex.tokens.len().min(self.cfg.max_length);
            let (tokens, mask) = (&ex.tokens[..len], &ex.mask()[..len]);
            let mut rng = ChaCha8Rng::seed_from_u64(7_000_000 + i as u64);
            let anchors = crate::anchors::sample_anchors(mask, self.cfg.anchors, &mut rng);
            if anchors.is_empty() {
                continue;
            }
            let taps = sequence_taps(self.target, tokens, self.drafter.target_layers())?;
            let logits =
                self.drafter
                    .forward_train(self.target, &taps, tokens, &anchors, Grad::Off)?;
            let labels = block_labels(tokens, mask, &anchors, bs, self.cfg.gamma);
            let (_, r) = block_loss(&logits, &labels)?;
            let nb = anchors.len();
            streak += r.streak as f64 * nb as f64;
            loss += r.loss as f64 * nb as f64;
            let rows: Vec<Vec<Vec<f32>>> =
                logits.to_device(&candle_core::Device::Cpu)?.to_vec3()?;
            for (b, &a) in anchors.iter().enumerate() {
                let top = top_k_log_probs(&rows[b][1..], self.cfg.tree_budget.max(1));
                let tree = build_tree(tokens[a as usize], &top, self.cfg.tree_budget);
                tree_streak += 1.0 + tree.accepted_depth(&tokens[a as usize + 1..]) as f64;
            }
            v.blocks += nb;
            // the answer starts at the first supervised token (decoding's first token comes from
            // the prefill) and runs to the end of the (truncated) sequence
            if let Some(start) = mask.iter().position(|&m| m) {
                let all: Vec<u32> = (start as u32..len as u32 - 1).collect();
                let budgets = [self.cfg.tree_budget.max(1)];
                let acc = crate::replay::anchor_acceptance(
                    self.target,
                    &self.drafter,
                    &taps,
                    tokens,
                    &all,
                    &budgets,
                    32,
                )?;
                let single = crate::replay::replay_steps(&acc, None, start, len);
                let tree = crate::replay::replay_steps(&acc, Some(0), start, len);
                replay += single.iter().sum::<usize>();
                replay_steps += single.len();
                replay_tree += tree.iter().sum::<usize>();
                replay_tree_steps += tree.len();
            }
        }
        if v.blocks > 0 {
            let n = v.blocks as f64;
            v.streak = (streak / n) as f32;
            v.ddtree_streak = (tree_streak / n) as f32;
            v.loss = (loss / n) as f32;
        }
        v.replayed_tau = replay as f32 / replay_steps.max(1) as f32;
        v.replayed_ddtree_tau = replay_tree as f32 / replay_tree_steps.max(1) as f32;
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> TrainConfig {
        TrainConfig {
            anchors: 128,
            gamma: 7.0,
            lr: 3e-4,
            epochs: 40,
            max_length: 3072,
            warmup_ratio: 0.04,
            checkpoint_every: 500,
            seed: 1,
            tree_budget: 64,
            adamw: AdamWConfig {
                lr: 3e-4,
                ..Default::default()
            },
            batch_tokens: 16384,
            micro_batch_tokens: 4096,
            distill: 0.0,
        }
    }

    #[test]
    fn resume_conflicts_name_what_changes_the_run_and_ignore_what_does_not() {
        let saved = config();
        assert!(resume_conflicts(&saved, &saved).is_empty());
        let mut free = config();
        free.micro_batch_tokens = 2048;
        free.checkpoint_every = 10;
        free.tree_budget = 128;
        assert!(
            resume_conflicts(&saved, &free).is_empty(),
            "these do not change the run"
        );
        let mut changed = config();
        changed.lr = 6e-4;
        changed.adamw.lr = 6e-4;
        changed.seed = 2;
        changed.adamw.beta2 = 0.99;
        let c = resume_conflicts(&saved, &changed);
        assert_eq!(
            c,
            [
                "adamw.beta2: checkpoint 0.95, now 0.99",
                "--lr: checkpoint 0.0003, now 0.0006",
                "--seed: checkpoint 1, now 2",
            ],
            "{c:?}"
        );
    }
}
