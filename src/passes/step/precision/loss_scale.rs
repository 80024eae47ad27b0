//! Dynamic loss scaling for fp16 step graphs, with `torch.amp.GradScaler`'s semantics, in ONNX
//! ops:
//! - the backward is seeded with the scale (the loss times the scale), so small gradients stay
//!   above float16's underflow; the reported losses are the unscaled forward values;
//! - a step whose (scaled) gradients hold an inf or NaN anywhere is skipped: parameters,
//!   optimizer moments and the step count keep their values (`Where` on each next state), and
//!   the scale is multiplied by the backoff factor (0.5), the growth tracker reset;
//! - otherwise the gradients are multiplied by 1/scale before clipping and the optimizer, and
//!   after `growth_interval` clean steps in a row the scale is multiplied by the growth factor
//!   (2) — unless that overflows float32, as `torch._amp_update_scale_` does.

use crate::onnx::{BOOL, FLOAT, INT64};
use crate::passes::contract;
use crate::passes::grad::Ctx;

use crate::passes::step::optimizer::{emit_update, OptimizerOptions};
use crate::passes::step::param_update::ParamUpdate;

pub const SCALE_STATE: &str = "ntl/state/loss_scale";
pub const TRACKER_STATE: &str = "ntl/state/growth_tracker";
pub const SKIP_OUTPUT: &str = "ntl/skipped";

#[derive(Debug, Clone)]
pub struct LossScaleOptions {
    pub init_scale: f64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: i64,
}

impl Default for LossScaleOptions {
    /// torch.amp.GradScaler's defaults.
    fn default() -> Self {
        LossScaleOptions {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

impl LossScaleOptions {
    /// The metadata's `loss_scale`.
    pub fn to_meta(&self) -> contract::LossScale {
        contract::LossScale {
            init_scale: self.init_scale,
            growth_factor: self.growth_factor,
            backoff_factor: self.backoff_factor,
            growth_interval: self.growth_interval,
        }
    }

    /// GradScaler's own checks: growth > 1, backoff in (0, 1), and values float32 holds.
    #[allow(clippy::neg_cmp_op_on_partial_ord)] // NaN must fail the checks too
    pub fn check(&self) -> Result<(), String> {
        let f32_ok = |v: f64| v.is_finite() && (v as f32).is_finite() && (v as f32) > 0.0;
        if !(self.init_scale > 0.0 && f32_ok(self.init_scale)) {
            return Err("--init-scale must be a finite number > 0 that float32 can hold (GradScaler's default: 65536)".into());
        }
        if !(self.growth_factor > 1.0 && f32_ok(self.growth_factor)) {
            return Err(
                "--growth-factor must be a finite number > 1 (GradScaler's default: 2)".into(),
            );
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0 && f32_ok(self.backoff_factor))
        {
            return Err("--backoff-factor must be in (0, 1) (GradScaler's default: 0.5)".into());
        }
        if self.growth_interval < 1 {
            return Err(
                "--growth-interval must be an integer >= 1 (GradScaler's default: 2000)".into(),
            );
        }
        Ok(())
    }
}

/// The scaler's state tensors: inputs and the names their next values go to.
pub struct ScaleState {
    pub scale: String,
    pub tracker: String,
    pub next_scale: String,
    pub next_tracker: String,
    /// The bool output, true when the step was skipped.
    pub skipped: String,
}

/// The optimizer update of `params` on gradients scaled by `state.scale`: unscaled, checked
/// for inf/NaN, applied only when all are finite; then the scale and its tracker updated.
/// Returns the tensors the metadata names: the clipping's Σ‖g‖² (with `--max-grad-norm`) and
/// the inf/NaN flag.
pub fn emit_scaled_update(
    ctx: &mut Ctx,
    opts: &OptimizerOptions,
    scaling: &LossScaleOptions,
    params: &[ParamUpdate],
    step: (&str, &str),
    lr: &str,
    state: &ScaleState,
) -> (Option<String>, String) {
    let found = found_inf(ctx, params);
    // 1/scale in float32, as GradScaler's inv_scale; exact for the powers of two it holds
    let inv = ctx.op("Reciprocal", &[&state.scale], "amp/inv_scale");
    let tentative: Vec<ParamUpdate> = params
        .iter()
        .map(|p| ParamUpdate {
            param: p.param.clone(),
            dims: p.dims.clone(),
            grad: ctx.op("Mul", &[&p.grad, &inv], "amp/unscaled_grad"),
            slots: p.slots.clone(),
            next_param: ctx.b.fresh("amp/tentative"),
            next_slots: p
                .slots
                .iter()
                .map(|_| ctx.b.fresh("amp/tentative"))
                .collect(),
        })
        .collect();
    let (step_in, step_out) = step;
    let tentative_step = ctx.b.fresh("amp/tentative_step");
    let norm_sq = emit_update(ctx, opts, &tentative, step_in, &tentative_step, lr);
    // a skipped step keeps every state tensor
    let keep = |ctx: &mut Ctx, old: &str, new: &str, out: &str| {
        ctx.b.node_to("Where", &[&found, old, new], &[out], vec![]);
    };
    for (p, t) in params.iter().zip(&tentative) {
        keep(ctx, &p.param, &t.next_param, &p.next_param);
        for ((old, new), out) in p.slots.iter().zip(&t.next_slots).zip(&p.next_slots) {
            keep(ctx, old, new, out);
        }
    }
    keep(ctx, step_in, &tentative_step, step_out);
    update_scale(ctx, scaling, &found, state);
    ctx.b
        .node_to("Identity", &[&found], &[&state.skipped], vec![]);
    (norm_sq, found)
}

/// True (bool scalar) when any gradient holds an inf or NaN: the sum of every |g| is then inf
/// or NaN (a finite sum of float32 gradients cannot reach float32's range in practice: the
/// scaled float16 values are at most 65504 each).
fn found_inf(ctx: &mut Ctx, params: &[ParamUpdate]) -> String {
    let sums: Vec<String> = params
        .iter()
        .map(|p| {
            ctx.b.node(
                "ReduceL1",
                &[&p.grad],
                "amp/grad_abs_sum",
                vec![crate::onnx::int_attr("keepdims", 0)],
            )
        })
        .collect();
    let refs: Vec<&str> = sums.iter().map(String::as_str).collect();
    let total = if refs.len() == 1 {
        refs[0].to_string()
    } else {
        ctx.op("Sum", &refs, "amp/grad_abs_total")
    };
    let inf = ctx.op("IsInf", &[&total], "amp/total_is_inf");
    let nan = ctx.op("IsNaN", &[&total], "amp/total_is_nan");
    ctx.op("Or", &[&inf, &nan], "amp/found_inf")
}

/// `torch._amp_update_scale_`: skipped → scale·backoff, tracker 0; else tracker + 1, and at
/// the interval scale·growth (kept if that is not finite) and tracker 0.
fn update_scale(ctx: &mut Ctx, o: &LossScaleOptions, found: &str, s: &ScaleState) {
    let one = ctx.b.const_i64("amp/one", &[], &[1]);
    let zero = ctx.b.const_i64("amp/zero", &[], &[0]);
    let interval = ctx
        .b
        .const_i64("amp/growth_interval", &[], &[o.growth_interval]);
    let growth = ctx.f32(o.growth_factor as f32);
    let backoff = ctx.f32(o.backoff_factor as f32);
    let clean = ctx.op("Add", &[&s.tracker, &one], "amp/clean_steps");
    let at_interval = ctx.b.equal(&clean, &interval, "amp/at_interval");
    let grown = ctx.op("Mul", &[&s.scale, &growth], "amp/grown_scale");
    let grown_inf = ctx.op("IsInf", &[&grown], "amp/grown_is_inf");
    let grown_ok = ctx.op("Not", &[&grown_inf], "amp/grown_finite");
    let grow = ctx.op("And", &[&at_interval, &grown_ok], "amp/grow");
    let kept_or_grown = ctx.b.where_(&grow, &grown, &s.scale, "amp/scale_if_clean");
    let tracker_clean = ctx
        .b
        .where_(&at_interval, &zero, &clean, "amp/tracker_if_clean");
    let backed_off = ctx.op("Mul", &[&s.scale, &backoff], "amp/backed_off_scale");
    ctx.b.node_to(
        "Where",
        &[found, &backed_off, &kept_or_grown],
        &[&s.next_scale],
        vec![],
    );
    ctx.b.node_to(
        "Where",
        &[found, &zero, &tracker_clean],
        &[&s.next_tracker],
        vec![],
    );
}

/// The types of the scaler's state and output, for the graph's signature.
pub const SCALE_TYPE: i32 = FLOAT;
pub const TRACKER_TYPE: i32 = INT64;
pub const SKIP_TYPE: i32 = BOOL;
