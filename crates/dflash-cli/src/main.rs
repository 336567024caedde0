//! `dflash`: train, evaluate, diagnose and run DFlash speculative decoding from one binary.
//!
//! Invariants: bad input (flags, files, prompts) exits with code 2 and a one-line message; internal
//! failures exit 1 (so does a `diagnose` check that FAILs, after its table, with no "error:" line);
//! machine-readable output goes to stdout as JSON, human summaries to stderr.

mod auto_memory;
mod bench;
mod bench_commit;
mod bench_decode;
mod bench_prompts;
mod bench_shapes;
mod defaults;
mod diagnose;
mod diagnose_format;
mod diagnose_run;
mod draft;
mod engine;
mod eval;
mod exit;
mod generate;
mod progress;
mod regen;
mod serve;
mod train;
mod train_record;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "dflash",
    version,
    about = "Speculative decoding with DFlash block-diffusion drafters"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a target model (optionally with a drafter).
    Generate(generate::GenerateArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions,
    /// /v1/completions, /v1/models; streaming), decoding as `generate` does.
    Serve(serve::ServeArgs),
    /// Drafter checkpoints.
    #[command(subcommand)]
    Draft(draft::DraftCommand),
    /// Acceptance length, speed-up and losslessness on benchmark prompts.
    Eval(eval::EvalArgs),
    /// Find a train/eval mismatch of a drafter by measurement (conventions, target, taps).
    Diagnose(diagnose::DiagnoseArgs),
    /// Train a drafter on regenerated data.
    Train(train::TrainArgs),
    /// Draw a training run's curves (log.jsonl) as a PNG.
    Plot(train::PlotArgs),
    /// Training data.
    #[command(subcommand)]
    Data(regen::DataCommand),
    /// Kernel benchmarks with parity checks.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Draft(cmd) => draft::run(cmd),
        Command::Train(a) => train::train(a),
        Command::Plot(a) => train::plot(a),
        Command::Eval(a) => eval::run(a),
        Command::Diagnose(a) => diagnose::run(a),
        Command::Data(cmd) => regen::run(cmd),
        Command::Bench(cmd) => bench::run(cmd),
    };
    if let Err(e) = result {
        if e.downcast_ref::<exit::Reported>().is_none() {
            eprintln!("error: {e:#}");
        }
        std::process::exit(exit::code(&e));
    }
}
