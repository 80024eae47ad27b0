//! Builds the patch for one cross-entropy site: the trainable CE node, the number loss, and
//! the new total under the original loss name.

use crate::ce_site::CeSite;
use crate::error::Error;
use crate::graph::GraphIndex;
use crate::number_table::NumberTable;
use crate::onnx::{scalar_value_info, FLOAT};
use crate::ops::{ce, ntl, Builder, FlatInputs, LossOptions};
use crate::patch::{Patch, METADATA_KEY};

/// Names of the outputs every patched graph adds.
pub const CE_OUTPUT: &str = "ce_loss";
pub const NUMBER_OUTPUT: &str = "number_loss";
/// Prefix of every node and tensor ntl-patch creates.
pub const PREFIX: &str = "ntl";

/// `others` are the graph's other cross-entropies: they are rewritten into trainable
/// `SoftmaxCrossEntropyLoss` nodes too (both outputs declared), their values unchanged.
pub fn build_patch(
    index: &GraphIndex,
    site: &CeSite,
    others: &[CeSite],
    table: &NumberTable,
    opts: &LossOptions,
) -> Result<Patch, Error> {
    if !matches!(site.reduction.as_str(), "mean" | "sum") {
        return Err(Error::UnsupportedReduction(site.reduction.clone()));
    }
    let mut b = Builder::new(PREFIX, index.taken_names());
    for name in [CE_OUTPUT, NUMBER_OUTPUT] {
        if !b.claim(name) {
            return Err(Error::OutputNameTaken(name.into()));
        }
    }

    let ce_node = ce::cross_entropy_node(&mut b, site, CE_OUTPUT);
    let flat = ce::flatten_inputs(&mut b, index, site, table.width())?;
    let number = ntl::build(&mut b, &flat, table, opts);
    b.node_to("Identity", &[&number], &[NUMBER_OUTPUT], vec![]);

    // total = CE + λ·number_loss, in the CE's own element type, under the original loss name.
    let weight = b.scalar_f32("weight", opts.weight as f32);
    let mut weighted = b.binary("Mul", NUMBER_OUTPUT, &weight, "weighted_number_loss");
    let loss_type = index.elem_type(&site.logits).unwrap_or(FLOAT);
    if loss_type != FLOAT {
        weighted = b.cast(&weighted, loss_type, "weighted_number_loss_cast");
    }
    b.node_to("Add", &[CE_OUTPUT, &weighted], &[&site.loss_output], vec![]);

    let mut nodes = vec![ce_node];
    nodes.append(&mut b.nodes);
    let mut replacements = vec![(site.node_index, nodes)];
    for other in others {
        let node = ce::cross_entropy_node(&mut b, other, &other.loss_output);
        replacements.push((other.node_index, vec![node]));
    }
    Ok(Patch {
        replacements,
        initializers: b.initializers,
        outputs: vec![
            scalar_value_info(CE_OUTPUT, loss_type),
            scalar_value_info(NUMBER_OUTPUT, FLOAT),
        ],
        metadata: vec![(METADATA_KEY.into(), metadata(site, &flat, table, opts))],
    })
}

/// What `validate` needs to check a patched graph on its own: the options and the tensors the
/// number loss reads. serde_json sorts keys, so the text is deterministic.
fn metadata(site: &CeSite, flat: &FlatInputs, table: &NumberTable, opts: &LossOptions) -> String {
    let mut v = opts.to_json();
    let extra = serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "ce_node": site.node_name,
        "pattern": site.pattern.describe(),
        "reduction": site.reduction,
        "ignore_index": site.ignore_index,
        "flat_logits": flat.logits,
        "flat_labels": flat.labels,
        "vocab_width": table.width(),
    });
    for (k, x) in extra.as_object().expect("object") {
        v[k] = x.clone();
    }
    v.to_string()
}
