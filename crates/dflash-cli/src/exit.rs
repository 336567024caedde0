//! Maps an error chain to the process exit code: 2 when any error in the chain is the user's input.

use dflash_core::CoreError;
use dflash_decoding::DecodeError;
use dflash_diagnose::DiagnoseError;
use dflash_models::ModelError;
use dflash_text::TextError;
use dflash_train::TrainError;

/// A problem with the command line or its inputs.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// An outcome the command already reported (e.g. `diagnose`'s table with a FAIL): exit with this
/// code and print nothing more.
#[derive(Debug, thiserror::Error)]
#[error("exit code {0}")]
pub struct Reported(pub i32);

pub fn code(e: &anyhow::Error) -> i32 {
    if let Some(r) = e.downcast_ref::<Reported>() {
        return r.0;
    }
    for cause in e.chain() {
        let bad = if cause.downcast_ref::<UsageError>().is_some() {
            true
        } else if let Some(m) = cause.downcast_ref::<ModelError>() {
            m.is_bad_input()
        } else if let Some(d) = cause.downcast_ref::<DecodeError>() {
            d.is_bad_input()
        } else if let Some(t) = cause.downcast_ref::<TrainError>() {
            matches!(t, TrainError::InvalidInput(_))
        } else if let Some(d) = cause.downcast_ref::<DiagnoseError>() {
            d.is_bad_input()
        } else if let Some(c) = cause.downcast_ref::<CoreError>() {
            matches!(c, CoreError::InvalidInput(_))
        } else {
            cause.downcast_ref::<TextError>().is_some()
        };
        if bad {
            return 2;
        }
    }
    1
}
