//! The gradient rules, one module per op family, and the one table that maps an op type to
//! its rule. A new op's rule goes into the family module and one line here.

mod activations;
mod attention;
mod elementwise;
mod fused;
mod linalg;
mod nn;
mod reduce;
mod shape;

pub use nn::nan_filled;

use super::Ctx;
use crate::error::Error;
use crate::onnx::NodeProto;

/// `vjp(ctx, node, gy, wants) -> gx`: `gy[k]` is the gradient of output k (None where no
/// gradient reaches it); `gx[i]` is Some for every input i with `wants[i]`, unless the rule
/// handed that input's gradient over as a sparse contribution (`Ctx::scatter_into`).
pub type Vjp = fn(&mut Ctx, &NodeProto, &[Option<String>], &[bool]) -> Result<Grads, Error>;
pub type Grads = Vec<Option<String>>;

pub struct Rule {
    /// Input positions a gradient flows through (ONNX Runtime's stop edges otherwise).
    pub inputs: fn(&NodeProto) -> Vec<usize>,
    pub vjp: Vjp,
}

/// The gradient of a node's first output. The engine calls a rule when any output has one;
/// where only a secondary output does (e.g. a Dropout mask cast to float), there is no rule.
fn g0<'a>(node: &NodeProto, gy: &'a [Option<String>]) -> Result<&'a str, Error> {
    gy.first().and_then(|g| g.as_deref()).ok_or_else(|| {
        Error::Usage(format!(
            "{} node '{}': a gradient reaches only a secondary output, which the step graph does not differentiate",
            node.op_type(),
            node.name()
        ))
    })
}

/// An internal node's rule (the fused head's, blockwise attention's): a node of another domain
/// that only shares its op type is an inconsistency, not ntl-patch's node.
fn internal(node: &NodeProto, domain: &str, what: &str) -> Result<(), Error> {
    if node.domain() == domain {
        return Ok(());
    }
    Err(Error::Inconsistent(format!(
        "node '{}' of domain '{}' is named like ntl-patch's {what}",
        node.name(),
        node.domain()
    )))
}

/// Records that `out` has the rank of `like` and returns it as the input's gradient.
fn like(ctx: &mut Ctx, out: String, like: &str) -> Result<Grads, Error> {
    Ok(vec![Some(ranked_like(ctx, out, like))])
}

/// Records that `out` has the rank of `like` (one of several inputs' gradients).
fn ranked_like(ctx: &mut Ctx, out: String, like: &str) -> String {
    if let Some(r) = ctx.ranks.get(like) {
        ctx.ranks.set(&out, r);
    }
    out
}

fn first(_: &NodeProto) -> Vec<usize> {
    vec![0]
}

fn first_two(_: &NodeProto) -> Vec<usize> {
    vec![0, 1]
}

fn all(node: &NodeProto) -> Vec<usize> {
    (0..node.input.len()).collect()
}

/// The rule for an op type, if ntl-patch has one.
pub fn rule(op: &str) -> Option<Rule> {
    use elementwise as e;
    let r = |inputs: fn(&NodeProto) -> Vec<usize>, vjp: Vjp| Some(Rule { inputs, vjp });
    match op {
        "Add" | "Sub" | "Mul" | "Div" | "Pow" => r(first_two, e::binary),
        "Max" | "Min" => r(first_two, e::max_min),
        "Sum" => r(all, e::sum),
        "Neg" | "Exp" | "Log" | "Sqrt" | "Tanh" | "Sigmoid" | "Erf" | "Relu" | "Abs"
        | "Reciprocal" | "Identity" => r(first, e::unary),
        "Softplus" | "Elu" | "Celu" | "Selu" | "LeakyRelu" | "HardSigmoid" | "HardSwish"
        | "Gelu" | "Sin" | "Cos" | "Atan" => r(first, activations::activation),
        "PRelu" => r(first_two, activations::prelu),
        "Cast" | "CastLike" => r(e::cast_inputs, e::cast),
        "Where" => r(|_| vec![1, 2], e::where_),
        "Clip" => r(first, e::clip),
        "Dropout" => r(first, e::dropout),
        "MatMul" => r(first_two, linalg::matmul),
        "Gemm" => r(all, linalg::gemm),
        "Einsum" => r(all, linalg::einsum),
        "Softmax" | "LogSoftmax" => r(first, nn::softmax),
        "LayerNormalization" => r(all, nn::layer_norm),
        "SoftmaxCrossEntropyLoss" | "NegativeLogLikelihoodLoss" => r(first, nn::cross_entropy),
        "ReduceSum" | "ReduceMean" | "ReduceSumSquare" | "ReduceL1" | "ReduceL2"
        | "ReduceLogSumExp" | "ReduceMax" | "ReduceMin" => r(first, reduce::reduce),
        "CumSum" => r(first, reduce::cumsum),
        "TopK" => r(first, reduce::top_k),
        "GlobalAveragePool" => r(first, reduce::global_average_pool),
        "Reshape" | "Squeeze" | "Unsqueeze" | "Flatten" => r(first, shape::reshape),
        "Transpose" => r(first, shape::transpose),
        "Tile" => r(first, shape::tile),
        "Expand" => r(first, shape::expand),
        "Slice" => r(first, shape::slice),
        "Concat" => r(all, shape::concat),
        "Split" => r(first, shape::split),
        "Gather" | "GatherElements" => r(first, shape::gather),
        "GatherND" => r(first, shape::gather_nd),
        "ScatterElements" | "ScatterND" => r(|_| vec![0, 2], shape::scatter),
        "Pad" => r(first, shape::pad),
        crate::passes::fused_head::node::FORWARD => r(fused::inputs, fused::fused_head),
        crate::passes::attention::node::FORWARD => r(attention::inputs, attention::attention),
        "Attention" => r(attention::onnx_inputs, attention::onnx_attention),
        _ => None,
    }
}

/// Ops whose outputs carry no gradient (integer, boolean, piecewise constant or random).
pub fn non_differentiable(op: &str) -> bool {
    matches!(
        op,
        "Shape"
            | "Size"
            | "Range"
            | "NonZero"
            | "ConstantOfShape"
            | "Constant"
            | "Equal"
            | "Less"
            | "LessOrEqual"
            | "Greater"
            | "GreaterOrEqual"
            | "And"
            | "Or"
            | "Xor"
            | "Not"
            | "ArgMax"
            | "ArgMin"
            | "OneHot"
            | "Sign"
            | "Floor"
            | "Ceil"
            | "Round"
            | "IsNaN"
            | "IsInf"
            | "RandomUniform"
            | "RandomUniformLike"
            | "RandomNormal"
            | "RandomNormalLike"
            | "EyeLike"
            | "BitShift"
            | "Mod"
            | "Unique"
    )
}
