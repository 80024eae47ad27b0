//! The number losses, one module per loss (a new loss gets a module here and one arm in
//! [`number_loss`]), each emitting its forward nodes through a [`Builder`] from the logits and
//! labels the cross-entropy reads.

pub mod del;
pub mod dist2;
pub mod ntil;
pub mod ntl;
pub mod number_level;
pub mod runs;
pub mod smmd;

use crate::numbers::NumberTokens;
use crate::options::{LossKind, LossOptions};
use crate::Builder;

/// The tensors a number loss reads: logits flattened to `[M, V]` float32 and labels `[M]` int64.
#[derive(Debug, Clone)]
pub struct FlatInputs {
    pub logits: String,
    pub labels: String,
    pub ignore_index: Option<i64>,
}

/// Sequence-grouped inputs of the per-sequence losses.
pub struct SeqInputs {
    /// Float32 logits `[M, V]`, M = B·T.
    pub logits: String,
    /// Int64 labels `[B, T]`.
    pub labels: String,
    /// Int64 `[1]`: B, read at run time from the graph's labels.
    pub batch: String,
}

/// Emits the number loss `opts.kind` names and returns its scalar (float32). `seq` is the
/// sequence grouping, required by the per-sequence losses ([`LossKind::is_sequence_level`]).
pub fn number_loss(
    b: &mut Builder,
    flat: &FlatInputs,
    seq: Option<&SeqInputs>,
    tokens: &NumberTokens,
    opts: &LossOptions,
) -> String {
    let seq = || seq.expect("per-sequence losses get the sequence grouping");
    match opts.kind {
        LossKind::Wasserstein | LossKind::Mse | LossKind::L1 | LossKind::Huber => {
            ntl::build(b, flat, &tokens.table, opts)
        }
        LossKind::Ntil | LossKind::Emd => ntil::build(b, seq(), tokens, opts),
        LossKind::NumberLevel => number_level::build(b, seq(), tokens, opts),
        LossKind::Dist2 => dist2::build(b, seq(), tokens, opts),
        LossKind::Del => del::build(b, seq(), tokens),
        LossKind::Smmd => smmd::build(b, flat, &tokens.table, &opts.smmd),
    }
}

/// The flat inputs with labels equal to a non-negative ignore index set to -100 (no token), for
/// the losses that skip the ignore index like the cross-entropy even where it is a token id
/// (their references drop -100 labels before they look: DIST2, DEL, SMMD). Unchanged where the
/// ignore index is negative (never a token id) or absent.
pub fn drop_ignored(b: &mut Builder, flat: &FlatInputs) -> FlatInputs {
    let Some(ignore) = flat.ignore_index.filter(|&i| i >= 0) else {
        return flat.clone();
    };
    let ignore = b.const_i64("ignored_label", &[], &[ignore]);
    let ignored = b.equal(&flat.labels, &ignore, "label_is_ignored");
    let none = b.const_i64("no_label", &[], &[-100]);
    FlatInputs {
        labels: b.where_(&ignored, &none, &flat.labels, "labels_kept"),
        ..flat.clone()
    }
}
