//! Runs the validation copy with tract (embedded, pure Rust). tract has no
//! `SoftmaxCrossEntropyLoss`, so the copy it gets carries the primitive-op CE instead.

use std::path::Path;

use prost::Message;
use tract_onnx::prelude::*;

use crate::error::Error;
use crate::onnx::ModelProto;
use crate::tools::validate::tensor::{Data, HostTensor};

/// Runs `model` on `inputs` (in the order of the graph's non-initializer inputs) and returns
/// every graph output under its name. `model_dir` resolves external data.
pub fn run(
    model: &ModelProto,
    model_dir: &Path,
    inputs: &[HostTensor],
) -> Result<Vec<HostTensor>, Error> {
    // tract may panic on graphs it does not expect: report that as tract failing
    crate::error::catch_panic(|| run_tract(model, model_dir, inputs))
        .unwrap_or_else(|why| Err(fail(&format!("tract panicked: {}", one_line(&why)))))
}

fn run_tract(
    model: &ModelProto,
    model_dir: &Path,
    inputs: &[HostTensor],
) -> Result<Vec<HostTensor>, Error> {
    // value_info names symbolic dims (B, T) that cannot unify with the concrete input facts
    // set below; tract infers every intermediate shape anyway.
    let onnx = tract_onnx::onnx().with_ignore_value_info(true);
    check_ops(model, &onnx)?;
    // Our protobuf types and tract's are generated from the same schema: convert by bytes.
    let proto = tract_onnx::pb::ModelProto::decode(model.encode_to_vec().as_slice())
        .map_err(|e| fail(&format!("re-reading the graph: {e}")))?;
    let dir = model_dir.to_string_lossy().into_owned();
    let parsed = onnx
        .parse(&proto, Some(&dir))
        .map_err(|e| fail(&one_line(&e)))?;
    if !parsed.unresolved_inputs.is_empty() {
        return Err(fail(&format!(
            "undefined tensors {:?}",
            parsed.unresolved_inputs
        )));
    }
    let mut graph = parsed.model;
    let mut feeds = TVec::new();
    for (ix, t) in inputs.iter().enumerate() {
        let tensor = to_tract(t).map_err(|e| fail(&one_line(&e)))?;
        graph
            .set_input_fact(
                ix,
                InferenceFact::dt_shape(tensor.datum_type(), tensor.shape()),
            )
            .map_err(|e| fail(&one_line(&e)))?;
        feeds.push(tensor.into_tvalue());
    }
    let plan = graph
        .into_optimized()
        .and_then(|m| m.into_runnable())
        .map_err(|e| fail(&one_line(&e)))?;
    let results = plan.run(feeds).map_err(|e| fail(&one_line(&e)))?;
    let names = model
        .graph
        .as_ref()
        .expect("checked on load")
        .output
        .iter()
        .map(|o| o.name());
    names
        .zip(results.iter())
        .map(|(name, v)| from_tract(name, v).map_err(|e| fail(&one_line(&e))))
        .collect()
}

fn fail(why: &str) -> Error {
    Error::Validation(format!(
        "tract could not run the graph ({why}); try --runtime ort"
    ))
}

/// tract turns unknown ops into placeholders that fail late with a long message; name the op
/// up front instead.
fn check_ops(model: &ModelProto, onnx: &tract_onnx::Onnx) -> Result<(), Error> {
    let graph = model.graph.as_ref().expect("checked on load");
    for node in &graph.node {
        let foreign = !matches!(node.domain(), "" | "ai.onnx");
        if foreign || !onnx.op_register.0.contains_key(node.op_type()) {
            let op = if foreign {
                format!("{}.{}", node.domain(), node.op_type())
            } else {
                node.op_type().to_string()
            };
            return Err(Error::Validation(format!(
                "tract cannot run op '{op}' (node '{}'); validate with --runtime ort",
                node.name()
            )));
        }
    }
    Ok(())
}

/// tract errors are anyhow chains: `{:#}` joins the causes on one line (no backtrace).
fn one_line(e: &impl std::fmt::Display) -> String {
    let text = format!("{e:#}").replace('\n', " ");
    match text.char_indices().nth(400) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

fn to_tract(t: &HostTensor) -> TractResult<Tensor> {
    let s = &t.shape;
    match &t.data {
        Data::F32(v) => Tensor::from_shape(s, v),
        Data::F64(v) => Tensor::from_shape(s, v),
        Data::I64(v) => Tensor::from_shape(s, v),
        Data::I32(v) => Tensor::from_shape(s, v),
        Data::Bool(v) => Tensor::from_shape(s, v),
    }
}

fn from_tract(name: &str, t: &Tensor) -> TractResult<HostTensor> {
    fn slice<T: Datum + Clone>(t: &Tensor) -> TractResult<Vec<T>> {
        Ok(t.try_as_plain_ram()?.as_slice::<T>()?.to_vec())
    }
    let data = match t.datum_type() {
        DatumType::F32 => Data::F32(slice(t)?),
        DatumType::F64 => Data::F64(slice(t)?),
        DatumType::I64 => Data::I64(slice(t)?),
        DatumType::I32 => Data::I32(slice(t)?),
        DatumType::Bool => Data::Bool(slice(t)?),
        // other integers (and tract's symbolic-dimension type, which shape-derived int64
        // tensors such as HF's shifted labels come back as) stay integers
        dt if dt.is_integer() || dt == DatumType::TDim => {
            Data::I64(slice(t.cast_to::<i64>()?.as_ref())?)
        }
        // anything else (f16) is widened for comparison
        _ => Data::F64(slice(t.cast_to::<f64>()?.as_ref())?),
    };
    Ok(HostTensor {
        name: name.to_string(),
        shape: t.shape().to_vec(),
        data,
    })
}
