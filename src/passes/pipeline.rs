//! The number-loss patch of a model in memory (find the cross-entropy → number table → patch),
//! and the checks that refuse a model it cannot patch. The patch job (`crate::jobs::patch`)
//! loads, calls these and saves.

use std::path::Path;

use crate::ce::site::{describe_sites, find_ce_sites, nested_ce_nodes, CeSite};
use crate::error::Error;
use crate::graph::patch::{apply, METADATA_KEY};
use crate::graph::GraphIndex;
use crate::onnx::{default_opset, ModelProto};
use crate::passes::rewrite::build_patch;
use crate::vocab::number_table::{NumberSet, Vocab};
use ntl_ops::builder::MIN_OPSET;
use ntl_ops::names::PREFIX;
use ntl_ops::numbers::NumberTokens;
use ntl_ops::options::{LossKind, LossOptions};

/// What the patch reads besides the graph: the request's options, without its paths.
pub struct PatchOptions<'a> {
    /// `--ce-node`: the cross-entropy to patch, by node name or loss output name.
    pub ce_node: Option<&'a str>,
    /// `--vocab-size`: the logits width where the graph leaves it symbolic.
    pub vocab_size: Option<usize>,
    pub loss: &'a LossOptions,
    /// Add a cross-entropy to a logits-only graph (`--add-loss`); it is also added, with a
    /// notice, when the graph has no cross-entropy and one logits-like output.
    pub add_loss: bool,
    /// With an added loss: the causal shift of Hugging Face causal LMs.
    pub shift: bool,
}

/// What [`patch_graph`] did, for the summary.
pub struct GraphPatched {
    pub ce_node: String,
    pub pattern: &'static str,
    pub logits_width: usize,
    pub number_tokens: usize,
    /// One-line notices for stderr (e.g. a loss added to a logits-only graph).
    pub notices: Vec<String>,
    /// One-line warnings for stderr (number tokens left out for their size).
    pub warnings: Vec<String>,
}

/// The number-loss patch of a checked model, in memory: cross-entropy forms rewritten, a loss
/// added where asked, the site chosen, the loss built and applied. The vocabulary is asked of
/// `vocab` once the logits width is known, so the graph's own errors come first.
pub fn patch_graph(
    model: &mut ModelProto,
    opts: &PatchOptions,
    vocab: impl FnOnce() -> Result<Vocab, Error>,
) -> Result<GraphPatched, Error> {
    let opset = default_opset(model).expect("checked above");
    let mut notices = Vec::new();
    // one index of the graph for every question below (indexing a graph of a million nodes
    // takes a while); rebuilt only when the graph changed: a form rewritten, a loss added
    let index = GraphIndex::new(model.graph.as_ref().expect("checked on load"));
    // hand-written and other exporters' cross-entropies become SoftmaxCrossEntropyLoss first
    let index = match crate::ce::forms::plan(&index, opset) {
        Some(rewrite) => {
            drop(index);
            rewrite.apply(model)?;
            GraphIndex::new(model.graph.as_ref().expect("checked on load"))
        }
        None => index,
    };
    if opts.add_loss && !find_ce_sites(&index).is_empty() {
        return Err(Error::Usage(
            "--add-loss is for logits-only graphs and this one already has a cross-entropy; drop --add-loss".into(),
        ));
    }
    let index = if wants_added_loss(opts, &index) {
        drop(index);
        notices.push(crate::ce::add_loss::add_loss(model, opts.shift)?);
        GraphIndex::new(model.graph.as_ref().expect("checked on load"))
    } else {
        index
    };
    let site = select_site(&index, opts.ce_node)?;
    let width = logits_width(&index, &site, opts.vocab_size)?;
    let vocab = vocab()?;
    let total_type = index
        .elem_type(&site.logits)
        .unwrap_or(ntl_ops::onnx::FLOAT);
    let (tokens, left_out) = number_tokens(&vocab, opts.loss, width, total_type)?;
    let warnings: Vec<String> = left_out.into_iter().collect();

    let others: Vec<CeSite> = find_ce_sites(&index)
        .into_iter()
        .filter(|s| s.node_index != site.node_index)
        .collect();
    let patch = build_patch(&index, opset, &site, &others, &tokens, opts.loss)?;
    apply(model, patch)?;
    Ok(GraphPatched {
        ce_node: site_label(&site),
        pattern: site.pattern.describe(),
        logits_width: width,
        number_tokens: tokens.table.len(),
        notices,
        warnings,
    })
}

/// `--add-loss`, or a graph without any cross-entropy whose outputs include exactly one
/// logits-like tensor.
fn wants_added_loss(opts: &PatchOptions, index: &GraphIndex) -> bool {
    opts.add_loss
        || find_ce_sites(index).is_empty()
            && nested_ce_nodes(index).is_empty()
            && crate::ce::add_loss::logits_output(index.graph).is_ok()
}

/// Refuses an ONNX Runtime training graph (`training_model.onnx`: the backward is already in
/// it, so a loss added to its forward would get no gradient).
pub fn refuse_training_graph(model: &ModelProto) -> Result<(), Error> {
    let graph = model.graph.as_ref().expect("loaded models have a graph");
    let grad_node = graph.node.iter().find(|n| {
        n.domain() == "com.microsoft" && n.op_type().ends_with("Grad")
            || n.op_type() == "SoftmaxCrossEntropyLossGrad"
    });
    match grad_node {
        Some(n) => Err(Error::TrainingGraph {
            op: n.op_type().to_string(),
        }),
        None => Ok(()),
    }
}

/// The token ids the chosen loss reads. Per-sequence losses work on the digits "0".."9"
/// (ntloss forces digit level for its number-level loss, NTIL uses exactly those ids).
/// `total_type` is the element type of the loss the graph reports (the logits' type): number
/// values too large for the loss in it are left out (`ntl_ops::losses::ntl::value_limit`), and
/// the warning that says so comes back beside the tokens.
pub fn number_tokens(
    vocab: &Vocab,
    opts: &LossOptions,
    width: usize,
    total_type: i32,
) -> Result<(NumberTokens, Option<String>), Error> {
    if opts.kind == LossKind::Smmd {
        let table = vocab.number_table(opts.numbers(), width)?;
        if table.len() > ntl_ops::losses::smmd::MAX_TOKENS {
            return Err(Error::Usage(format!(
                "SMMD would read {} integer tokens (0..{}), more than the {} its [N, N] kernel matrix is built for; lower --max-value",
                table.len(),
                opts.smmd.max_value,
                ntl_ops::losses::smmd::MAX_TOKENS
            )));
        }
        let tokens = NumberTokens {
            table,
            digits: None,
            dot: None,
        };
        return Ok((tokens, None));
    }
    if !opts.kind.is_sequence_level() {
        let limit = ntl_ops::losses::ntl::value_limit(opts.kind, opts.weight, total_type);
        let (table, left_out) = vocab.number_table_within(opts.number_set, width, limit)?;
        let tokens = NumberTokens {
            table,
            digits: None,
            dot: None,
        };
        return Ok((tokens, left_out_warning(&left_out)));
    }
    let digits = vocab.digit_ids(width)?;
    let dot = if opts.float_level {
        Some(vocab.id_of(".").ok_or(Error::NoDotToken)?)
    } else if opts.kind == LossKind::Del {
        // DEL joins decimals where the tokenizer has a "."; without one, numbers are digit runs
        vocab
            .id_of(".")
            .filter(|&id| id >= 0 && (id as usize) < width)
    } else {
        None
    };
    let tokens = NumberTokens {
        table: vocab.number_table(NumberSet::DigitLevel, width)?,
        digits: Some(digits),
        dot,
    };
    Ok((tokens, None))
}

/// The warning for number tokens left out of the table for their size, if any.
fn left_out_warning(left_out: &[(String, f64)]) -> Option<String> {
    let examples: Vec<String> = left_out
        .iter()
        .take(3)
        .map(|(token, value)| {
            let chars = token.chars().count();
            if chars > 24 {
                let head: String = token.chars().take(12).collect();
                format!("{head:?}… ({chars} characters) = {value:e}")
            } else {
                format!("{token:?} = {value:e}")
            }
        })
        .collect();
    (!left_out.is_empty()).then(|| {
        format!(
            "{} token(s) that parse as numbers are left out of the number set (e.g. {}): the number loss holds values in float32 and their size would make it inf or NaN; they count as non-number tokens",
            left_out.len(),
            examples.join(", ")
        )
    })
}

pub fn site_label(site: &CeSite) -> String {
    if site.node_name.is_empty() {
        format!("<unnamed, output '{}'>", site.loss_output)
    } else {
        site.node_name.clone()
    }
}

/// Refuses a model ntl-patch already patched (its metadata mark or its node names).
pub fn refuse_patched(model: &ModelProto, path: &Path) -> Result<(), Error> {
    let evidence = if model.metadata_props.iter().any(|p| p.key() == METADATA_KEY) {
        Some(format!("metadata '{METADATA_KEY}'"))
    } else {
        let prefix = format!("{PREFIX}/");
        model
            .graph
            .iter()
            .flat_map(|g| g.node.iter())
            .find(|n| n.name().starts_with(&prefix))
            .map(|n| format!("node '{}'", n.name()))
    };
    match evidence {
        Some(evidence) => Err(Error::AlreadyPatched {
            path: path.to_path_buf(),
            evidence,
        }),
        None => Ok(()),
    }
}

pub fn check_opset(model: &ModelProto) -> Result<(), Error> {
    match default_opset(model) {
        None => Err(Error::NoOpset),
        Some(v) if v < MIN_OPSET => Err(Error::OpsetTooOld {
            found: v,
            min: MIN_OPSET,
        }),
        Some(_) => Ok(()),
    }
}

/// The one cross-entropy to patch: the only one, or the one `--ce-node` names (by node name
/// or loss output name).
pub fn select_site(index: &GraphIndex, wanted: Option<&str>) -> Result<CeSite, Error> {
    if let Some(why) = crate::ce::site::malformed_ce_node(index) {
        return Err(Error::MalformedGraph(why));
    }
    let mut sites = find_ce_sites(index);
    if let Some(wanted) = wanted {
        let found = describe_sites(&sites);
        return sites
            .into_iter()
            .find(|s| s.node_name == wanted || s.loss_output == wanted)
            .ok_or_else(|| Error::CeNodeNotFound {
                wanted: wanted.into(),
                found: if found.is_empty() {
                    "none".into()
                } else {
                    found
                },
            });
    }
    match sites.len() {
        0 => {
            let nested = nested_ce_nodes(index);
            Err(Error::NoCrossEntropy {
                nested: if nested.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; found only inside subgraphs, which are not patched: {}",
                        nested.join(", ")
                    )
                },
            })
        }
        1 => Ok(sites.remove(0)),
        n => Err(Error::SeveralCrossEntropies {
            count: n,
            found: describe_sites(&sites),
        }),
    }
}

/// The logits width V: from the graph, checked against `--vocab-size`, or `--vocab-size` alone
/// where the graph leaves it symbolic.
pub fn logits_width(
    index: &GraphIndex,
    site: &CeSite,
    given: Option<usize>,
) -> Result<usize, Error> {
    check_logits_type(index, site)?;
    let found = if site.logits_class_last {
        index.static_last_dim(&site.logits)
    } else {
        index.static_dim(&site.scores, 1, 0)
    };
    // Reshapes to run-time shapes (`logits.reshape(-1, logits.shape[-1])`): the proven shape.
    let found = found.or_else(|| {
        let shapes = crate::graph::shapes::Shapes::infer(index);
        let (tensor, axis) = if site.logits_class_last {
            (&site.logits, None)
        } else {
            (&site.scores, Some(1))
        };
        let dims = shapes.get(tensor)?;
        let dim = match axis {
            Some(a) => dims.get(a)?,
            None => dims.last()?,
        };
        match dim {
            crate::graph::shapes::Dim::Known(v) if *v > 0 => Some(*v),
            _ => None,
        }
    });
    let found = found
        .map(|f| {
            crate::vocab::check_width(
                f,
                "the logits width the graph declares",
                "re-export the model with its real vocabulary size",
            )
        })
        .transpose()?;
    let given = given
        .map(|g| {
            crate::vocab::check_width(
                i64::try_from(g).unwrap_or(i64::MAX),
                "--vocab-size",
                "pass the logits width of the model",
            )
        })
        .transpose()?;
    match (found, given) {
        (Some(f), Some(g)) if f != g => Err(Error::WidthMismatch { given: g, found: f }),
        (Some(f), _) => Ok(f),
        (None, Some(g)) => Ok(g),
        (None, None) => Err(Error::UnknownWidth {
            tensor: site.scores.clone(),
        }),
    }
}

/// The number loss reads the logits as probabilities: refuse integer (or other non-float)
/// logits where the graph declares their type.
fn check_logits_type(index: &GraphIndex, site: &CeSite) -> Result<(), Error> {
    use crate::onnx::proto::tensor_proto::DataType;
    let float = [
        DataType::Float,
        DataType::Float16,
        DataType::Double,
        DataType::Bfloat16,
    ];
    for tensor in [&site.logits, &site.scores] {
        if let Some(t) = index.elem_type(tensor) {
            if !float.iter().any(|f| *f as i32 == t) {
                return Err(Error::NonFloatLogits {
                    tensor: tensor.clone(),
                    elem_type: t,
                });
            }
        }
    }
    Ok(())
}
