//! Activation functions with attributes or piecewise definitions (Softplus, the ELU family,
//! LeakyRelu, PRelu, HardSigmoid, HardSwish, Gelu) and the trigonometric functions. At the kinks
//! each rule takes torch's side, so a step equals torch autograd.

use super::{g0, like, Grads};
use crate::error::Error;
use crate::onnx::{attr, NodeProto};
use crate::passes::grad::Ctx;

fn attr_f(node: &NodeProto, name: &str, default: f32) -> f32 {
    attr(node, name).map(|a| a.f()).unwrap_or(default)
}

/// `where(x > 0, g, g·d)`: the gradient of a function that is the identity for x > 0.
fn identity_above_zero(ctx: &mut Ctx, x: &str, g: &str, d: &str, hint: &str) -> String {
    let zero = ctx.f32(0.0);
    let pos = ctx.op("Greater", &[x, &zero], "grad/pos");
    let below = ctx.op("Mul", &[g, d], hint);
    ctx.b.where_(&pos, g, &below, hint)
}

pub fn activation(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?;
    let x = node.input[0].as_str();
    let y = node.output[0].as_str();
    let gx = match node.op_type() {
        "Softplus" => {
            let s = ctx.op("Sigmoid", &[x], "grad/softplus_d");
            ctx.op("Mul", &[g, &s], "grad/softplus")
        }
        // y + α below zero (α·eˣ; α at 0, as torch)
        "Elu" => {
            let alpha = ctx.f32(attr_f(node, "alpha", 1.0));
            let d = ctx.op("Add", &[y, &alpha], "grad/elu_d");
            identity_above_zero(ctx, x, g, &d, "grad/elu")
        }
        // exp(x/α) below zero
        "Celu" => {
            let alpha = ctx.f32(attr_f(node, "alpha", 1.0));
            let t = ctx.op("Div", &[x, &alpha], "grad/celu_t");
            let d = ctx.op("Exp", &[&t], "grad/celu_d");
            identity_above_zero(ctx, x, g, &d, "grad/celu")
        }
        // γ above zero, y + γα below
        "Selu" => {
            let alpha = attr_f(node, "alpha", 1.673_263_2);
            let gamma = attr_f(node, "gamma", 1.050_701);
            let zero = ctx.f32(0.0);
            let pos = ctx.op("Greater", &[x, &zero], "grad/pos");
            let ga = ctx.f32(gamma * alpha);
            let below = ctx.op("Add", &[y, &ga], "grad/selu_below");
            let gamma = ctx.f32(gamma);
            let d = ctx.b.where_(&pos, &gamma, &below, "grad/selu_d");
            ctx.op("Mul", &[g, &d], "grad/selu")
        }
        "LeakyRelu" => {
            let alpha = ctx.f32(attr_f(node, "alpha", 0.01));
            identity_above_zero(ctx, x, g, &alpha, "grad/leaky_relu")
        }
        // α inside 0 < αx + β < 1 (strict, as torch's hardsigmoid_backward)
        "HardSigmoid" => {
            let alpha = attr_f(node, "alpha", 0.2);
            let beta = attr_f(node, "beta", 0.5);
            let (a, b) = (ctx.f32(alpha), ctx.f32(beta));
            let ax = ctx.op("Mul", &[x, &a], "grad/hardsigmoid_ax");
            let t = ctx.op("Add", &[&ax, &b], "grad/hardsigmoid_t");
            let (zero, one) = (ctx.f32(0.0), ctx.f32(1.0));
            let above = ctx.op("Greater", &[&t, &zero], "grad/hardsigmoid_above");
            let below = ctx.op("Less", &[&t, &one], "grad/hardsigmoid_below");
            let inside = ctx.op("And", &[&above, &below], "grad/hardsigmoid_inside");
            let ga = ctx.op("Mul", &[g, &a], "grad/hardsigmoid_ga");
            ctx.b.where_(&inside, &ga, &zero, "grad/hardsigmoid")
        }
        // torch: 0 for x < −3, x/3 + ½ for x ≤ 3, 1 above
        "HardSwish" => {
            let (three, m_three) = (ctx.f32(3.0), ctx.f32(-3.0));
            let (zero, one, half) = (ctx.f32(0.0), ctx.f32(1.0), ctx.f32(0.5));
            let t = ctx.op("Div", &[x, &three], "grad/hardswish_t");
            let mid = ctx.op("Add", &[&t, &half], "grad/hardswish_mid");
            let low = ctx.op("Less", &[x, &m_three], "grad/hardswish_low");
            let high = ctx.op("Greater", &[x, &three], "grad/hardswish_high");
            let d = ctx.b.where_(&high, &one, &mid, "grad/hardswish_d");
            let d = ctx.b.where_(&low, &zero, &d, "grad/hardswish_d");
            ctx.op("Mul", &[g, &d], "grad/hardswish")
        }
        // opset 20: Φ(x) + x·φ(x), or the derivative of the tanh approximation
        "Gelu" => {
            let d = if crate::onnx::attr_s(node, "approximate").as_deref() == Some("tanh") {
                gelu_tanh_derivative(ctx, x)
            } else {
                gelu_derivative(ctx, x)
            };
            ctx.op("Mul", &[g, &d], "grad/gelu")
        }
        "Sin" => {
            let c = ctx.op("Cos", &[x], "grad/sin_d");
            ctx.op("Mul", &[g, &c], "grad/sin")
        }
        "Cos" => {
            let s = ctx.op("Sin", &[x], "grad/cos_d");
            let t = ctx.op("Mul", &[g, &s], "grad/cos_t");
            ctx.op("Neg", &[&t], "grad/cos")
        }
        // 1/(1 + x²)
        "Atan" => {
            let one = ctx.f32(1.0);
            let x2 = ctx.op("Mul", &[x, x], "grad/atan_x2");
            let d = ctx.op("Add", &[&x2, &one], "grad/atan_d");
            ctx.op("Div", &[g, &d], "grad/atan")
        }
        op => unreachable!("activation rule registered for {op}"),
    };
    like(ctx, gx, x)
}

/// d/dx x·Φ(x) = Φ(x) + x·φ(x), with Φ(x) = ½(1 + erf(x/√2)) and φ(x) = exp(−x²/2)/√(2π).
fn gelu_derivative(ctx: &mut Ctx, x: &str) -> String {
    let (half, one) = (ctx.f32(0.5), ctx.f32(1.0));
    let inv_sqrt2 = ctx.f32(std::f32::consts::FRAC_1_SQRT_2);
    let t = ctx.op("Mul", &[x, &inv_sqrt2], "grad/gelu_t");
    let e = ctx.op("Erf", &[&t], "grad/gelu_erf");
    let e1 = ctx.op("Add", &[&e, &one], "grad/gelu_erf1");
    let cdf = ctx.op("Mul", &[&e1, &half], "grad/gelu_cdf");
    let x2 = ctx.op("Mul", &[x, x], "grad/gelu_x2");
    let m_half = ctx.f32(-0.5);
    let ex = ctx.op("Mul", &[&x2, &m_half], "grad/gelu_ex");
    let ex = ctx.op("Exp", &[&ex], "grad/gelu_exp");
    let inv_sqrt_2pi = ctx.f32(0.398_942_3);
    let pdf = ctx.op("Mul", &[&ex, &inv_sqrt_2pi], "grad/gelu_pdf");
    let xpdf = ctx.op("Mul", &[x, &pdf], "grad/gelu_xpdf");
    ctx.op("Add", &[&cdf, &xpdf], "grad/gelu_d")
}

/// The tanh approximation y = ½x(1 + tanh u), u = √(2/π)(x + 0.044715x³):
/// dy/dx = ½(1 + tanh u) + ½x(1 − tanh² u)·√(2/π)(1 + 3·0.044715x²).
fn gelu_tanh_derivative(ctx: &mut Ctx, x: &str) -> String {
    let (half, one) = (ctx.f32(0.5), ctx.f32(1.0));
    let (k, c) = (ctx.f32(0.797_884_6), ctx.f32(0.044_715));
    let c3 = ctx.f32(3.0 * 0.044_715);
    let x2 = ctx.op("Mul", &[x, x], "grad/gelu_x2");
    let x3 = ctx.op("Mul", &[&x2, x], "grad/gelu_x3");
    let cx3 = ctx.op("Mul", &[&x3, &c], "grad/gelu_cx3");
    let inner = ctx.op("Add", &[x, &cx3], "grad/gelu_inner");
    let u = ctx.op("Mul", &[&inner, &k], "grad/gelu_u");
    let t = ctx.op("Tanh", &[&u], "grad/gelu_tanh");
    let t1 = ctx.op("Add", &[&t, &one], "grad/gelu_t1");
    let left = ctx.op("Mul", &[&t1, &half], "grad/gelu_left");
    let t2 = ctx.op("Mul", &[&t, &t], "grad/gelu_t2");
    let sech2 = ctx.op("Sub", &[&one, &t2], "grad/gelu_sech2");
    let c3x2 = ctx.op("Mul", &[&x2, &c3], "grad/gelu_c3x2");
    let du = ctx.op("Add", &[&c3x2, &one], "grad/gelu_du");
    let du = ctx.op("Mul", &[&du, &k], "grad/gelu_du_k");
    let hx = ctx.op("Mul", &[x, &half], "grad/gelu_hx");
    let right = ctx.op("Mul", &[&hx, &sech2], "grad/gelu_right");
    let right = ctx.op("Mul", &[&right, &du], "grad/gelu_right_du");
    ctx.op("Add", &[&left, &right], "grad/gelu_d")
}

/// PRelu(x, slope): x above zero, slope·x below (torch's side at 0: the slope). The slope's
/// gradient `x·g` below zero is summed down to the slope's broadcast shape.
pub fn prelu(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    wants: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?;
    let (x, slope) = (node.input[0].as_str(), node.input[1].as_str());
    let y = node.output[0].as_str();
    let zero = ctx.f32(0.0);
    let pos = ctx.op("Greater", &[x, &zero], "grad/pos");
    let mut out = vec![None, None];
    if wants[0] {
        let below = ctx.op("Mul", &[g, slope], "grad/prelu_below");
        let gx = ctx.b.where_(&pos, g, &below, "grad/prelu");
        out[0] = like(ctx, gx, x)?.pop().flatten();
    }
    if wants[1] {
        let xg = ctx.op("Mul", &[x, g], "grad/prelu_xg");
        let full = ctx.b.where_(&pos, &zero, &xg, "grad/prelu_slope_full");
        out[1] = Some(ctx.unbroadcast_to(&full, slope, y));
    }
    Ok(out)
}
