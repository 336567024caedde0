//! Progress bars for long work: drawn on a TTY, silent otherwise (logs then carry the progress).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;

/// A bar over `total` units; hidden when stderr is not a terminal.
pub fn bar(total: u64, unit: &str) -> ProgressBar {
    let pb = ProgressBar::new(total);
    if !std::io::stderr().is_terminal() {
        pb.set_draw_target(ProgressDrawTarget::hidden());
    }
    pb.set_style(
        ProgressStyle::with_template(&format!(
            "{{elapsed_precise}} [{{bar:30}}] {{pos}}/{{len}} {unit} (eta {{eta}}) {{msg}}"
        ))
        .expect("valid template")
        .progress_chars("=> "),
    );
    pb
}
