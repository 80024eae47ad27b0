//! Step graphs (`ntl-patch step`): the runtime trains. Three steps on the validation batch,
//! each step's state outputs fed back as the next step's state inputs; every loss of every
//! step and the state after the last step are compared with the other runtime (tract against
//! ONNX Runtime and the reverse) running the same steps.

use std::path::Path;

use crate::error::Error;
use crate::onnx::ModelProto;
use crate::tools::validate::report::{Against, Check};
use crate::tools::validate::tensor::HostTensor;
use crate::tools::validate::{ort_run, tract_run, Runtime, ValidateRequest};

use crate::passes::contract::{StepMetadata, STEP_METADATA_KEY};

const STEPS: usize = 3;
/// Tolerance of the whole state's norm-relative difference (see `check`).
const STATE_RTOL: f64 = 1e-3;

/// The losses of each step, then the final state.
struct Trained {
    losses: Vec<Vec<HostTensor>>,
    state: Vec<HostTensor>,
}

pub fn check(
    req: &ValidateRequest,
    copy: &ModelProto,
    dir: &Path,
    data: &[HostTensor],
) -> Result<(Vec<Check>, String), Error> {
    let (model, state) = stateful(copy)?;
    let run = |runtime: Runtime| train(runtime, &model, dir, data, &state);
    let mine = run(req.runtime)?;
    let other = match req.runtime {
        Runtime::Tract => Runtime::Ort,
        Runtime::Ort => Runtime::Tract,
    };
    let theirs = match run(other) {
        Ok(t) => t,
        Err(e) => {
            return Ok((
                vec![],
                format!(
                    "step graph: {STEPS} training steps ran in {}; not compared with {}: {}",
                    req.runtime.name(),
                    other.name(),
                    e.one_line()
                ),
            ))
        }
    };
    let against = Against::OtherRuntime(other.name());
    // --precision fp16|bf16: tract rounds every half result, onnxruntime's CPU provider computes
    // most half nodes in float32: the two differ by the half type's rounding
    let half = super::half_precision_rtol(half_type(copy));
    let rtol = half.map_or(req.rtol, |(h, _)| h.max(req.rtol));
    let mut checks = Vec::new();
    for (k, (a, b)) in mine.losses.iter().zip(&theirs.losses).enumerate() {
        for (x, y) in a.iter().zip(b) {
            checks.push(Check::compare(
                &format!("step {} {}", k + 1, x.name),
                against,
                &x.to_f64(),
                &y.to_f64(),
                rtol,
                req.atol,
            ));
        }
    }
    // The state as a whole, norm-relative: where a true gradient is exactly zero (an attention
    // key bias), float32 round-off is all there is, and AdamW turns it into ±lr steps whose
    // sign differs between any two runtimes; the losses above are insensitive to those.
    let flat = |ts: &[HostTensor]| -> Vec<f64> { ts.iter().flat_map(|t| t.to_f64()).collect() };
    checks.push(Check::compare_norm(
        &format!(
            "state after {STEPS} steps ({} tensors, norm)",
            mine.state.len()
        ),
        against,
        &flat(&mine.state),
        &flat(&theirs.state),
        rtol.max(STATE_RTOL),
    ));
    let precision = match half {
        Some((h, ty)) => format!(
            "; a {ty} step graph: runtimes compared within {h:.1e} relative (onnxruntime's CPU provider computes most {ty} nodes in float32)"
        ),
        None => String::new(),
    };
    Ok((
        checks,
        format!(
            "step graph: {STEPS} training steps on the validation batch in {} and in {}, state fed back between steps{precision}",
            req.runtime.name(),
            other.name()
        ),
    ))
}

/// The half type a `--precision fp16|bf16` step graph computes in (its `ntl_step` metadata).
pub fn half_type(model: &ModelProto) -> Option<i32> {
    let meta = StepMetadata::of(model)?.ok()?;
    let precision = match meta.precision.as_str() {
        "fp16" => crate::passes::step::Precision::Fp16,
        "bf16" => crate::passes::step::Precision::Bf16,
        _ => return None,
    };
    precision.half_type()
}

/// A state tensor: its input name, its output name, its initial value.
type StateSlot = (String, String, HostTensor);

/// The model with its state inputs made feedable (their initializers removed), and the
/// initial state.
fn stateful(copy: &ModelProto) -> Result<(ModelProto, Vec<StateSlot>), Error> {
    let meta = StepMetadata::of(copy)
        .ok_or_else(|| Error::Validation(format!("no '{STEP_METADATA_KEY}' metadata")))?
        .map_err(|e| {
            Error::Validation(format!("unreadable '{STEP_METADATA_KEY}' metadata: {e}"))
        })?;
    let pairs = meta.state;
    let mut model = copy.clone();
    let graph = model.graph.as_mut().expect("checked on load");
    let mut state = Vec::new();
    for (input, output) in pairs {
        let at = graph
            .initializer
            .iter()
            .position(|t| t.name() == input)
            .ok_or_else(|| {
                Error::Validation(format!("state input '{input}' has no initial value"))
            })?;
        let init = graph.initializer.remove(at);
        let value = HostTensor::from_proto(&init).map_err(|e| {
            Error::Validation(format!("cannot read the initial value of '{input}': {e}"))
        })?;
        state.push((input, output, value));
    }
    Ok((model, state))
}

fn train(
    runtime: Runtime,
    model: &ModelProto,
    dir: &Path,
    data: &[HostTensor],
    initial: &[StateSlot],
) -> Result<Trained, Error> {
    let graph = model.graph.as_ref().expect("checked on load");
    let mut state: Vec<HostTensor> = initial.iter().map(|(_, _, t)| t.clone()).collect();
    let mut losses = Vec::new();
    for _ in 0..STEPS {
        // Inputs in graph order: the data inputs, then the state.
        let feeds: Vec<HostTensor> = graph
            .input
            .iter()
            .filter_map(|i| {
                data.iter()
                    .chain(&state)
                    .find(|t| t.name == i.name())
                    .cloned()
            })
            .collect();
        let outputs = match runtime {
            Runtime::Tract => tract_run::run(model, dir, &feeds)?,
            Runtime::Ort => ort_run::run(model, dir, &feeds)?,
        };
        let get = |name: &str| -> Result<HostTensor, Error> {
            outputs
                .iter()
                .find(|t| t.name == name)
                .cloned()
                .ok_or_else(|| Error::Validation(format!("the step graph gave no '{name}'")))
        };
        losses.push(outputs.iter().take(3).cloned().collect());
        state = initial
            .iter()
            .map(|(input, output, _)| {
                get(output).map(|mut t| {
                    t.name = input.clone();
                    t
                })
            })
            .collect::<Result<_, _>>()?;
    }
    let state = state
        .into_iter()
        .zip(initial)
        .map(|(mut t, (_, output, _))| {
            t.name = output.clone();
            t
        })
        .collect();
    Ok(Trained { losses, state })
}
