//! The training run: epochs over tokenised conversations, one sequence per optimizer step,
//! checkpoints every N steps (z-lab drafter + optimizer moments + run state, each written
//! atomically), JSONL metrics, held-out validation (teacher-forced streak and DDTree-N streak).
//!
//! Invariants: step `s` draws its anchors from an RNG seeded by `(seed, s)` and visits the
//! example chosen by the epoch's seeded permutation, so a run resumed from the checkpoint at step
//! `s` computes exactly what an uninterrupted run computes; the target is frozen and never saved.

use crate::data::Example;
use crate::loss::{block_labels, block_loss};
use crate::optim::{AdamW, AdamWConfig, LrSchedule};
use crate::step::{sequence_taps, TrainStep};
use crate::{Result, TrainError};
use candle_core::{DType, Var};
use candle_nn::{VarBuilder, VarMap};
use dflash_core::Grad;
use dflash_decoding::tree::{build_tree, top_k_log_probs};
use dflash_models::drafter::{random_weights, save_drafter};
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
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct RunState {
    pub step: usize,
    pub total_steps: usize,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct Validation {
    /// Teacher-forced expected τ: 1 + mean leading run of correct block rows.
    pub streak: f32,
    /// Same with the DDTree of `tree_budget` nodes walked along the true continuation.
    pub ddtree_streak: f32,
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
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> TrainError + '_ {
    move |e| TrainError::Io {
        path: path.display().to_string(),
        source: e,
    }
}

impl<'a> Trainer<'a> {
    /// A new run in `dir`, or — when `resume` and a checkpoint exists — the run continued from it.
    pub fn open(
        target: &'a dyn TargetModel,
        draft_cfg: DFlashConfig,
        cfg: TrainConfig,
        dir: &Path,
        total_steps: usize,
        resume: bool,
    ) -> Result<Self> {
        let ckpt = dir.join("checkpoint");
        let state_path = ckpt.join("state.json");
        let (weights, state) = if resume && state_path.is_file() {
            let state: RunState = serde_json::from_str(
                &std::fs::read_to_string(&state_path).map_err(io(&state_path))?,
            )
            .map_err(|e| TrainError::InvalidInput(format!("{}: {e}", state_path.display())))?;
            let files = dflash_models::weights::safetensors_files(&ckpt)?;
            let mut w = BTreeMap::new();
            for f in files {
                w.extend(candle_core::safetensors::load(&f, &target.info().device)?);
            }
            (w, state)
        } else {
            (
                random_weights(&draft_cfg, cfg.seed)?,
                RunState {
                    step: 0,
                    total_steps,
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
        let drafter = DFlashDrafter::new(
            &draft_cfg,
            VarBuilder::from_varmap(&varmap, DType::F32, &dev),
        )?;
        drafter.check_target(target)?;
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

    /// Which example step `s` trains on.
    fn example_for(&self, s: usize, n: usize) -> usize {
        let epoch = s / n;
        let mut order: Vec<usize> = (0..n).collect();
        order.shuffle(&mut ChaCha8Rng::seed_from_u64(
            self.cfg.seed ^ (0x5eed_0000 + epoch as u64),
        ));
        order[s % n]
    }

    /// Writes the checkpoint (drafter, optimizer, state) atomically-per-file, state last.
    pub fn checkpoint(&self) -> Result<()> {
        let ckpt = self.dir.join("checkpoint");
        let weights: BTreeMap<String, candle_core::Tensor> = self
            .varmap
            .data()
            .lock()
            .expect("varmap")
            .iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
            .collect();
        save_drafter(&ckpt, &self.draft_cfg, &weights, 16 << 20)?;
        self.opt.save(&ckpt.join("optimizer.safetensors"))?;
        let p = ckpt.join("state.json");
        let tmp = p.with_extension("tmp");
        std::fs::write(
            &tmp,
            serde_json::to_string(&self.state).expect("state serialises"),
        )
        .map_err(io(&tmp))?;
        std::fs::rename(&tmp, &p).map_err(io(&p))
    }

    /// Trains until `total_steps`, logging to `dir/log.jsonl`; `progress(step, total, loss)`.
    pub fn run(
        &mut self,
        data: &[Example],
        progress: &mut dyn FnMut(usize, usize, f32),
    ) -> Result<()> {
        if data.is_empty() {
            return Err(TrainError::InvalidInput("no training examples".into()));
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
        };
        while self.state.step < self.state.total_steps {
            let s = self.state.step;
            let ex = &data[self.example_for(s, data.len())];
            let len = ex.tokens.len().min(self.cfg.max_length);
            let (tokens, mask) = (&ex.tokens[..len], &ex.mask()[..len]);
            let t0 = Instant::now();
            let mut rng = ChaCha8Rng::seed_from_u64(
                self.cfg
                    .seed
                    .wrapping_mul(0x9E37_79B9)
                    .wrapping_add(s as u64),
            );
            let lr = ts.schedule.at(s);
            let (report, grad_norm) = ts.run(
                self.target,
                &self.drafter,
                &mut self.opt,
                tokens,
                mask,
                &mut rng,
            )?;
            self.state.step += 1;
            let secs = t0.elapsed().as_secs_f64();
            let line = serde_json::json!({
                "step": self.state.step, "epoch": s / data.len(), "loss": report.loss, "accuracy": report.accuracy,
                "streak": report.streak, "lr": lr, "grad_norm": grad_norm, "tokens_per_second": len as f64 / secs,
            });
            writeln!(log, "{line}").map_err(io(&log_path))?;
            progress(self.state.step, self.state.total_steps, report.loss);
            if self.cfg.checkpoint_every > 0
                && self.state.step.is_multiple_of(self.cfg.checkpoint_every)
            {
                self.checkpoint()?;
            }
        }
        self.checkpoint()
    }

    /// Held-out streaks with a fixed set of anchors per example.
    pub fn validate(&self, data: &[Example]) -> Result<Validation> {
        let bs = self.drafter.block_size();
        let mut v = Validation::default();
        let (mut streak, mut tree_streak, mut loss) = (0f64, 0f64, 0f64);
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
                let (mut cur, mut depth) = (0usize, 0usize);
                while let Some(&c) = tokens
                    .get(a as usize + depth + 1)
                    .and_then(|t| tree.children[cur].get(t))
                {
                    cur = c;
                    depth += 1;
                }
                tree_streak += 1.0 + depth as f64;
            }
            v.blocks += nb;
        }
        if v.blocks > 0 {
            let n = v.blocks as f64;
            v.streak = (streak / n) as f32;
            v.ddtree_streak = (tree_streak / n) as f32;
            v.loss = (loss / n) as f32;
        }
        Ok(v)
    }
}
