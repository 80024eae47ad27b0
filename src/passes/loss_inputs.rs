//! The views of the graph's logits and labels a number loss reads: logits flattened to
//! `[M, V]` float32 and labels to `[M]` int64, the positions the graph's masks drop, and the
//! `[B, T]` grouping of the per-sequence losses — read from the graph, emitted through the
//! op library's builder.

use ntl_ops::losses::{FlatInputs, SeqInputs};
use ntl_ops::onnx::{int_attr, BOOL, FLOAT, INT64};
use ntl_ops::Builder;

use crate::ce::reported::{Keep, PositionMask};
use crate::ce::site::CeSite;
use crate::error::Error;
use crate::graph::{static_rank, GraphIndex};

/// Emits the flattened float32 logits `[M, V]` and int64 labels `[M]` of a site.
pub fn flatten_inputs(
    b: &mut Builder,
    index: &GraphIndex,
    site: &CeSite,
    width: usize,
    peel: bool,
) -> Result<FlatInputs, Error> {
    let class_last = peel && site.logits_class_last;
    let logits = if class_last {
        site.logits.clone()
    } else {
        site.scores.clone()
    };
    let logits = rows(b, index, site, &logits, class_last, width)?;
    let mut labels = site.labels.clone();
    if static_rank(index, &labels) != Some(1) {
        labels = b.reshape(&labels, &[-1], "labels_1d");
    }
    if index.elem_type(&site.labels).is_some_and(|t| t != INT64) {
        labels = b.cast(&labels, INT64, "labels_i64");
    }
    Ok(FlatInputs {
        logits,
        labels,
        ignore_index: site.ignore_index,
    })
}

/// `tensor` (the site's scores, or a tensor laid out like them; or with `class_last` its
/// `[.., V]` logits) as float32 rows `[M, V]`.
fn rows(
    b: &mut Builder,
    index: &GraphIndex,
    site: &CeSite,
    tensor: &str,
    class_last: bool,
    width: usize,
) -> Result<String, Error> {
    let v = width as i64;
    let rank = static_rank(index, &site.scores);
    let mut logits = tensor.to_string();
    if !class_last {
        match rank {
            Some(2) => {}
            Some(r) if r > 2 => {
                // [N, V, d1, ..] -> [N, d1, .., V]
                let mut perm = vec![0];
                perm.extend(2..r as i64);
                perm.push(1);
                logits = b.transpose(&logits, &perm, "logits_class_last");
            }
            _ => {
                return Err(Error::UnknownRank {
                    tensor: site.scores.clone(),
                })
            }
        }
    }
    if class_last || rank != Some(2) {
        logits = b.reshape(&logits, &[-1, v], "logits_2d");
    }
    match index.elem_type(&site.logits) {
        Some(FLOAT) | None => {}
        Some(_) => logits = b.cast(&logits, FLOAT, "logits_f32"),
    }
    Ok(logits)
}

/// Where the cross-entropy reads log-probabilities (`LogSoftmax`, then layout ops, then the
/// loss: the `LogSoftmax + NegativeLogLikelihoodLoss` form), the LogSoftmax's input laid out
/// like the scores, as float32 rows `[M, V]`: the logits themselves, for a number loss that is
/// not invariant to a shift of a row (DEL's BCE reads the raw logits). None where the scores
/// are not log-probabilities.
pub fn raw_logit_rows(
    b: &mut Builder,
    index: &GraphIndex,
    site: &CeSite,
    width: usize,
) -> Result<Option<String>, Error> {
    let mut layout = Vec::new();
    let mut tensor = site.scores.clone();
    let raw = loop {
        let Some((i, node)) = index.producer(&tensor) else {
            return Ok(None);
        };
        match node.op_type() {
            "LogSoftmax" => break node.input.first().cloned(),
            "Reshape" | "Transpose" | "Identity" | "Squeeze" | "Unsqueeze" | "Flatten"
                if layout.len() < 8 =>
            {
                layout.push(i);
                tensor = node.input.first().cloned().unwrap_or_default();
            }
            _ => return Ok(None),
        }
    };
    let Some(mut moved) = raw.filter(|x| !x.is_empty()) else {
        return Ok(None);
    };
    // the same layout ops, replayed on the logits
    for &n in layout.iter().rev() {
        let mut node = index.graph.node[n].clone();
        node.input[0] = moved;
        moved = b.fresh("raw_logits_moved");
        node.output = vec![moved.clone()];
        node.name = Some(b.fresh("raw_logits_layout"));
        b.nodes.push(node);
    }
    rows(b, index, site, &moved, false, width).map(Some)
}

/// The flat labels with every position a mask drops set to -100 (no number token), for the
/// number loss: it skips what the cross-entropy skips. `labels` itself where nothing is masked.
///
/// A mask applies to the per-position loss after layout ops (Paddle: Unsqueeze, Transpose,
/// Squeeze); where they transpose, the same ops replayed on the position indices `0..M` (laid
/// out like the cross-entropy's output `per_position`) say which position each mask element
/// belongs to. Reshapes alone keep the order: the flattened mask is already position-ordered.
pub fn masked_labels(
    b: &mut Builder,
    index: &GraphIndex,
    per_position: &str,
    labels: &str,
    masks: &[PositionMask],
) -> String {
    let mut kept: Option<String> = None;
    for m in masks {
        let keep = match m.keep {
            Keep::NonZero => {
                let w = b.cast(&m.tensor, FLOAT, "mask_f32");
                let zero = b.scalar_f32("mask_zero", 0.0);
                let dropped = b.binary("Equal", &w, &zero, "mask_dropped");
                b.unary("Not", &dropped, "mask_kept")
            }
            Keep::True => b.cast(&m.tensor, BOOL, "mask_kept"),
            Keep::False => {
                let c = b.cast(&m.tensor, BOOL, "mask_dropped");
                b.unary("Not", &c, "mask_kept")
            }
        };
        // the mask broadcasts to the per-position loss it multiplies
        let shape = b.node("Shape", &[&m.applied_to], "mask_shape", vec![]);
        let full = b.node("Expand", &[&keep, &shape], "mask_full", vec![]);
        let mut flat = b.reshape(&full, &[-1], "mask_flat");
        // reshapes keep the row-major order of the positions; only a transpose moves them
        let moves = m
            .layout
            .iter()
            .any(|&n| index.graph.node[n].op_type() == "Transpose");
        if moves {
            flat = back_to_positions(b, index, per_position, &m.layout, &flat);
        }
        kept = Some(match kept {
            Some(k) => b.binary("And", &k, &flat, "mask_all"),
            None => flat,
        });
    }
    match kept {
        Some(k) => {
            let ignore = b.const_i64("masked_label", &[], &[-100]);
            b.where_(&k, labels, &ignore, "number_labels")
        }
        None => labels.to_string(),
    }
}

/// `flat_keep` (bool, in the layout after `layout`) scattered back to the positions of
/// `per_position`, flattened.
fn back_to_positions(
    b: &mut Builder,
    index: &GraphIndex,
    per_position: &str,
    layout: &[usize],
    flat_keep: &str,
) -> String {
    // the position ids 0..M laid out like the loss, from its shape alone (no Size, Range or
    // ConstantOfShape of a computed count: MIGraphX takes shapes only from Shape outputs)
    let shape = b.node("Shape", &[per_position], "mask_loss_shape", vec![]);
    let one = b.const_i64("mask_one_i", &[], &[1]);
    let ones = b.node("Expand", &[&one, &shape], "mask_ones", vec![]);
    let ones = b.reshape(&ones, &[-1], "mask_ones_flat");
    let axis = b.const_i64("mask_axis", &[], &[0]);
    let counted = b.node("CumSum", &[&ones, &axis], "mask_counted", vec![]);
    let ids = b.binary("Sub", &counted, &one, "mask_position_ids");
    let mut moved = b.node("Reshape", &[&ids, &shape], "mask_ids_laid_out", vec![]);
    for &n in layout {
        let mut node = index.graph.node[n].clone();
        node.input[0] = moved;
        moved = b.fresh("mask_ids_moved");
        node.output = vec![moved.clone()];
        node.name = Some(b.fresh("mask_layout"));
        b.nodes.push(node);
    }
    let where_ = b.reshape(&moved, &[-1], "mask_ids_flat");
    let keep_f = b.cast(flat_keep, FLOAT, "mask_keep_f");
    // as many zeros as positions: the mask covers every one of them, in another order
    let zero = b.scalar_f32("mask_zero_f", 0.0);
    let zeros = b.binary("Mul", &keep_f, &zero, "mask_zeros");
    let back = b.node(
        "ScatterElements",
        &[&zeros, &where_, &keep_f],
        "mask_at_positions",
        vec![int_attr("axis", 0)],
    );
    b.cast(&back, BOOL, "mask_kept_positions")
}

/// Regroups the flat inputs by sequence for the per-sequence losses: finds the labels tensor
/// of rank >= 2 the CE labels were flattened from (`[B, T]`) and reads B from its shape at
/// run time, so symbolic batch and sequence dims work.
pub fn sequence_inputs(
    b: &mut Builder,
    index: &GraphIndex,
    site: &CeSite,
    flat: &FlatInputs,
) -> Result<SeqInputs, Error> {
    let grouped = sequence_labels(index, &site.labels).ok_or_else(|| Error::NoSequenceShape {
        labels: site.labels.clone(),
    })?;
    let shape = b.node("Shape", &[&grouped], "labels_seq_shape", vec![]);
    let batch = b.slice(&shape, 0, 1, 0, "batch_size");
    let minus_one = b.const_i64("seq_minus_one", &[1], &[-1]);
    let bt = b.concat(&[&batch, &minus_one], 0, "labels_bt_shape");
    let labels = b.node("Reshape", &[&flat.labels, &bt], "labels_bt", vec![]);
    Ok(SeqInputs {
        logits: flat.logits.clone(),
        labels,
        batch,
    })
}

/// The labels as they were before flattening: walk back through layout ops to a tensor of
/// known rank >= 2.
fn sequence_labels(index: &GraphIndex, labels: &str) -> Option<String> {
    let mut tensor = labels.to_string();
    for _ in 0..16 {
        let rank = static_rank(index, &tensor);
        if rank.is_some_and(|r| r >= 2) {
            return Some(tensor);
        }
        let (_, node) = index.producer(&tensor)?;
        if !matches!(
            node.op_type(),
            "Reshape" | "Flatten" | "Identity" | "Cast" | "Squeeze"
        ) {
            return None;
        }
        tensor = node.input.first()?.clone();
    }
    None
}
