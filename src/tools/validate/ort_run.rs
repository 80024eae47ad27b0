//! Runs the validation copy with ONNX Runtime (the `ort` crate, library loaded at run time).
//! ORT has `SoftmaxCrossEntropyLoss`, so the copy runs with the patched CE node unchanged.

use std::path::Path;
use std::sync::OnceLock;

use ort::session::{Session, SessionInputValue};
use ort::value::{DynValue, Tensor, TensorElementType, ValueType};
use prost::Message;

use crate::error::Error;
use crate::onnx::ModelProto;
use crate::tools::validate::ort_lib;
use crate::tools::validate::tensor::{Data, HostTensor};

/// One environment per process: ort can load one library, once.
static ENVIRONMENT: OnceLock<Result<ort::environment::Environment, String>> = OnceLock::new();

fn environment() -> Result<&'static ort::environment::Environment, Error> {
    let lib = ort_lib::find_library()?;
    let env = ENVIRONMENT.get_or_init(|| {
        ort::init_from(&lib)
            .map_err(|e| format!("cannot load ONNX Runtime from '{}': {e}", lib.display()))?
            .with_name("ntl-patch-validate")
            .build()
            .map_err(|e| format!("cannot start ONNX Runtime: {e}"))
    });
    env.as_ref()
        .map_err(|e| Error::Validation(format!("{e}; {}", ort_lib::HOW_TO_INSTALL)))
}

pub fn run(
    model: &ModelProto,
    model_dir: &Path,
    inputs: &[HostTensor],
) -> Result<Vec<HostTensor>, Error> {
    let env = environment()?;
    let fail = |why: String| {
        Error::Validation(format!(
            "ONNX Runtime could not run the graph: {}",
            why.replace('\n', " ")
        ))
    };
    let bytes = model.encode_to_vec();
    let mut session = Session::builder(env)
        .map_err(|e| fail(e.to_string()))?
        // the model comes from memory: tell ORT where its external data files live
        .with_config_entry(
            "session.model_external_initializers_file_folder_path",
            model_dir.to_string_lossy(),
        )
        .map_err(|e| fail(e.to_string()))?
        .commit_from_memory(&bytes)
        .map_err(|e| fail(e.to_string()))?;

    let mut feeds: Vec<(String, SessionInputValue)> = Vec::new();
    for t in inputs {
        feeds.push((t.name.clone(), to_ort(t).map_err(|e| fail(e.to_string()))?));
    }
    let outputs = session.run(feeds).map_err(|e| fail(e.to_string()))?;
    let graph = model.graph.as_ref().expect("checked on load");
    graph
        .output
        .iter()
        .map(|o| {
            let v = outputs
                .get(o.name())
                .ok_or_else(|| fail(format!("no output '{}'", o.name())))?;
            from_ort(o.name(), v).map_err(|e| fail(e.to_string()))
        })
        .collect()
}

fn to_ort(t: &HostTensor) -> ort::Result<SessionInputValue<'static>> {
    let shape: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
    Ok(match &t.data {
        Data::F32(v) => Tensor::from_array((shape, v.clone()))?.into(),
        Data::F64(v) => Tensor::from_array((shape, v.clone()))?.into(),
        Data::I64(v) => Tensor::from_array((shape, v.clone()))?.into(),
        Data::I32(v) => Tensor::from_array((shape, v.clone()))?.into(),
        Data::Bool(v) => Tensor::from_array((shape, v.clone()))?.into(),
    })
}

fn from_ort(name: &str, v: &DynValue) -> ort::Result<HostTensor> {
    let ValueType::Tensor { ty, .. } = v.dtype() else {
        return Err(ort::Error::new(format!("output '{name}' is not a tensor")));
    };
    let (shape, data) = match ty {
        TensorElementType::Float32 => {
            let (s, d) = v.try_extract_tensor::<f32>()?;
            (s.to_vec(), Data::F32(d.to_vec()))
        }
        TensorElementType::Float64 => {
            let (s, d) = v.try_extract_tensor::<f64>()?;
            (s.to_vec(), Data::F64(d.to_vec()))
        }
        // half-precision outputs widen exactly to float32
        TensorElementType::Float16 => {
            let (s, d) = v.try_extract_tensor::<half::f16>()?;
            (
                s.to_vec(),
                Data::F32(d.iter().map(|x| x.to_f32()).collect()),
            )
        }
        TensorElementType::Bfloat16 => {
            let (s, d) = v.try_extract_tensor::<half::bf16>()?;
            (
                s.to_vec(),
                Data::F32(d.iter().map(|x| x.to_f32()).collect()),
            )
        }
        TensorElementType::Int64 => {
            let (s, d) = v.try_extract_tensor::<i64>()?;
            (s.to_vec(), Data::I64(d.to_vec()))
        }
        TensorElementType::Int32 => {
            let (s, d) = v.try_extract_tensor::<i32>()?;
            (s.to_vec(), Data::I32(d.to_vec()))
        }
        TensorElementType::Bool => {
            let (s, d) = v.try_extract_tensor::<bool>()?;
            (s.to_vec(), Data::Bool(d.to_vec()))
        }
        other => {
            return Err(ort::Error::new(format!(
                "output '{name}' has element type {other:?}, which validate does not read"
            )))
        }
    };
    Ok(HostTensor {
        name: name.to_string(),
        shape: shape.iter().map(|&d| d.max(0) as usize).collect(),
        data,
    })
}
