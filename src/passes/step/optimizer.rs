//! The optimizer update in ONNX ops, with torch's semantics: `torch.optim.AdamW`,
//! `torch.optim.SGD`, and `torch.nn.utils.clip_grad_norm_` over all trained parameters.

use super::param_update::ParamUpdate;
use crate::onnx::FLOAT;
use crate::passes::grad::Ctx;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerKind {
    AdamW,
    Sgd,
}

#[derive(Debug, Clone)]
pub struct OptimizerOptions {
    pub kind: OptimizerKind,
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub momentum: f64,
    pub max_grad_norm: Option<f64>,
    /// `--update-bucket`: tensors of at most this many MiB are updated together in flat
    /// buckets of this size (`multi_tensor`); 0 updates each tensor on its own. The layout of
    /// the update, not its values.
    pub update_bucket_mib: u64,
}

impl OptimizerOptions {
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "name": match self.kind { OptimizerKind::AdamW => "adamw", OptimizerKind::Sgd => "sgd" },
            "lr": self.lr, "beta1": self.beta1, "beta2": self.beta2, "eps": self.eps,
            "weight_decay": self.weight_decay, "momentum": self.momentum,
            "max_grad_norm": self.max_grad_norm,
        })
    }

    /// The per-parameter state tensors, by suffix (`ntl/state/<param>/<suffix>`).
    pub fn slots(&self) -> &'static [&'static str] {
        match self.kind {
            OptimizerKind::AdamW => &["exp_avg", "exp_avg_sq"],
            OptimizerKind::Sgd if self.momentum != 0.0 => &["momentum_buffer"],
            OptimizerKind::Sgd => &[],
        }
    }
}

/// Emits the update of every parameter (a bucket of `--update-bucket` is one flat parameter
/// here: the step pipeline flattens and splits them); `step` is the int64 step-count input,
/// written incremented to `next_step`; `lr` the learning-rate input. Returns the clipping's
/// Σ‖g‖² tensor (with `--max-grad-norm`), which the metadata names for sharded trainers.
pub fn emit_update(
    ctx: &mut Ctx,
    opts: &OptimizerOptions,
    params: &[ParamUpdate],
    step: &str,
    next_step: &str,
    lr: &str,
) -> Option<String> {
    let one_i = ctx.b.const_i64("opt/one", &[], &[1]);
    ctx.b.node_to("Add", &[step, &one_i], &[next_step], vec![]);
    let (coef, norm_sq) = clip(ctx, opts, params).unzip();
    let grads: Vec<String> = params
        .iter()
        .map(|u| match &coef {
            Some(coef) => ctx.op("Mul", &[&u.grad, coef], "opt/clipped_grad"),
            None => u.grad.clone(),
        })
        .collect();
    match opts.kind {
        OptimizerKind::AdamW => adamw(ctx, opts, params, &grads, next_step, lr),
        OptimizerKind::Sgd => sgd(ctx, opts, params, &grads, lr),
    }
    norm_sq
}

/// `clip_grad_norm_`'s factor `min(max_norm / (‖g‖ + 1e-6), 1)`, the norm over all trained
/// parameters together, and the Σ‖g‖² tensor; None without `--max-grad-norm`.
fn clip(
    ctx: &mut Ctx,
    opts: &OptimizerOptions,
    params: &[ParamUpdate],
) -> Option<(String, String)> {
    let max_norm = opts.max_grad_norm?;
    let squares: Vec<String> = params
        .iter()
        .map(|p| {
            let sq = ctx.op("Mul", &[&p.grad, &p.grad], "opt/grad_sq");
            ctx.b.reduce_sum(&sq, &[], false, "opt/grad_sq_sum")
        })
        .collect();
    let refs: Vec<&str> = squares.iter().map(|s| s.as_str()).collect();
    let total = ctx.op("Sum", &refs, "opt/grad_norm_sq");
    let norm = ctx.op("Sqrt", &[&total], "opt/grad_norm");
    let eps = ctx.f32(1e-6);
    let denom = ctx.op("Add", &[&norm, &eps], "opt/grad_norm_eps");
    let max = ctx.f32(max_norm as f32);
    let coef = ctx.op("Div", &[&max, &denom], "opt/clip_coef");
    let one = ctx.f32(1.0);
    let coef = ctx.op("Min", &[&coef, &one], "opt/clip_coef_clamped");
    Some((coef, total))
}

fn adamw(
    ctx: &mut Ctx,
    opts: &OptimizerOptions,
    params: &[ParamUpdate],
    grads: &[String],
    next_step: &str,
    lr: &str,
) {
    let (b1, b2) = (opts.beta1 as f32, opts.beta2 as f32);
    let t = ctx.b.cast(next_step, FLOAT, "opt/t");
    let b1c = ctx.f32(b1);
    let b2c = ctx.f32(b2);
    let one = ctx.f32(1.0);
    let p1 = ctx.op("Pow", &[&b1c, &t], "opt/beta1_t");
    let p2 = ctx.op("Pow", &[&b2c, &t], "opt/beta2_t");
    let bc1 = ctx.op("Sub", &[&one, &p1], "opt/bias_correction1");
    let bc2 = ctx.op("Sub", &[&one, &p2], "opt/bias_correction2");
    let step_size = ctx.op("Div", &[lr, &bc1], "opt/step_size");
    let bc2_sqrt = ctx.op("Sqrt", &[&bc2], "opt/bias_correction2_sqrt");
    let decay = (opts.weight_decay != 0.0).then(|| {
        let wd = ctx.f32(opts.weight_decay as f32);
        let lr_wd = ctx.op("Mul", &[lr, &wd], "opt/lr_wd");
        ctx.op("Sub", &[&one, &lr_wd], "opt/decay")
    });
    let one_m_b1 = ctx.f32(1.0 - b1);
    let one_m_b2 = ctx.f32(1.0 - b2);
    let eps = ctx.f32(opts.eps as f32);
    for (p, g) in params.iter().zip(grads) {
        let (m, v) = (&p.slots[0], &p.slots[1]);
        let mut gate = GradGate::new(p, g);
        // torch: p.mul_(1 − lr·wd); m.lerp_(g, 1 − β1); v.mul_(β2).addcmul_(g, g, 1 − β2).
        // Written so each parameter-sized temporary dies before the next is made (the order
        // runs them as written): g's last reader before v·β2, p·(1 − lr·wd) last of all.
        let gm = ctx.op("Sub", &[g, m], "opt/m_diff");
        let gm = ctx.op("Mul", &[&gm, &one_m_b1], "opt/m_step");
        ctx.b.node_to("Add", &[m, &gm], &[&p.next_slots[0]], vec![]);
        let gv = ctx.op("Mul", &[g, &one_m_b2], "opt/v_grad_scaled");
        let gv = ctx.op("Mul", &[&gv, g], "opt/v_grad");
        let b2g = gate.pass(ctx, &b2c, "opt/beta2_gated");
        let v1 = ctx.op("Mul", &[v, &b2g], "opt/v_decay");
        ctx.b
            .node_to("Add", &[&v1, &gv], &[&p.next_slots[1]], vec![]);
        // p ← p·(1 − lr·wd) − lr/bc1 · m / (√v/√bc2 + eps)
        let sv = ctx.op("Sqrt", &[&p.next_slots[1]], "opt/v_sqrt");
        let sv = ctx.op("Div", &[&sv, &bc2_sqrt], "opt/v_hat_sqrt");
        let denom = ctx.op("Add", &[&sv, &eps], "opt/denom");
        let ratio = ctx.op("Div", &[&p.next_slots[0], &denom], "opt/ratio");
        let delta = ctx.op("Mul", &[&ratio, &step_size], "opt/delta");
        let decayed = match &decay {
            Some(d) => {
                let d = gate.pass(ctx, d, "opt/decay_gated");
                ctx.op("Mul", &[&p.param, &d], "opt/decayed")
            }
            None => p.param.clone(),
        };
        ctx.b
            .node_to("Sub", &[&decayed, &delta], &[&p.next_param], vec![]);
    }
}

/// A condition computed from one element of a parameter's gradient, through which the
/// update's scalars pass unchanged (`Where(c, x, x)` is `x` whatever `c`). The products that
/// read only state (`v·β2`, `p·(1 − lr·wd)`, `buf·μ`) would otherwise be ready before the
/// forward runs: an order that runs ready nodes early (onnxruntime's PRIORITY_BASED, by node
/// index) then computes them in the forward and keeps each, the size of its parameter,
/// until the update — three times the trained parameters' bytes at the peak.
struct GradGate<'p> {
    param: &'p ParamUpdate,
    grad: &'p str,
    /// The condition, made on first use (an update that passes nothing through makes none).
    cond: Option<String>,
}

impl<'p> GradGate<'p> {
    fn new(param: &'p ParamUpdate, grad: &'p str) -> Self {
        GradGate {
            param,
            grad,
            cond: None,
        }
    }

    /// `x` (a scalar), available only once the gradient is.
    fn pass(&mut self, ctx: &mut Ctx, x: &str, hint: &str) -> String {
        let dims = &self.param.dims;
        if dims.contains(&0) {
            // nothing to wait for: an empty parameter's products are empty
            return x.to_string();
        }
        let cond = self.cond.get_or_insert_with(|| {
            let first = if dims.is_empty() {
                self.grad.to_string()
            } else {
                let zeros = ctx.i64s(&vec![0; dims.len()]);
                let ones = ctx.i64s(&vec![1; dims.len()]);
                ctx.op("Slice", &[self.grad, &zeros, &ones], "opt/grad_first")
            };
            // any comparison does (`Where` takes x either way): Less is the same op from opset 13
            // on, with a kernel on every GPU provider (MIGraphX has no IsNaN, ROCm no Equal-19)
            ctx.op("Less", &[&first, &first], "opt/grad_gate")
        });
        let cond = cond.clone();
        ctx.op("Where", &[&cond, x, x], hint)
    }
}

fn sgd(ctx: &mut Ctx, opts: &OptimizerOptions, params: &[ParamUpdate], grads: &[String], lr: &str) {
    let wd = ctx.f32(opts.weight_decay as f32);
    let mu = ctx.f32(opts.momentum as f32);
    for (p, g) in params.iter().zip(grads) {
        let mut gate = GradGate::new(p, g);
        // g ← g + wd·p (L2, torch's SGD); buf ← μ·buf + g; p ← p − lr·buf
        let g = if opts.weight_decay != 0.0 {
            let wd = gate.pass(ctx, &wd, "opt/l2_gated");
            let d = ctx.op("Mul", &[&p.param, &wd], "opt/l2");
            ctx.op("Add", &[g, &d], "opt/grad_l2")
        } else {
            g.clone()
        };
        let dir = if opts.momentum != 0.0 {
            let mu = gate.pass(ctx, &mu, "opt/momentum_gated");
            let kept = ctx.op("Mul", &[&p.slots[0], &mu], "opt/momentum_kept");
            ctx.b
                .node_to("Add", &[&kept, &g], &[&p.next_slots[0]], vec![]);
            p.next_slots[0].clone()
        } else {
            g
        };
        let delta = ctx.op("Mul", &[&dir, lr], "opt/delta");
        ctx.b
            .node_to("Sub", &[&p.param, &delta], &[&p.next_param], vec![]);
    }
}
