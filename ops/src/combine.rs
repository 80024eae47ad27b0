//! How the number loss joins the loss the graph reports.

use crate::names::{CE_OUTPUT, NUMBER_OUTPUT};
use crate::onnx::{int_attr, FLOAT};
use crate::options::{Combine, LossOptions};
use crate::Builder;

/// Writes the total under the original loss name `total`, in the CE's element type
/// `loss_type`, from the `ce_loss` and `number_loss` tensors:
/// `add`: `CE + λ·L`; `scaled`: `CE + stopgrad(CE / (L + 1e-10))·λ·L` (the NTIL reference).
///
/// The scaled form's stop-gradient is `Clip(0, r, r)`: its value is r, and ORT's gradient
/// builder treats Clip's min and max as stop-gradient edges (`STOP_GRADIENT_EDGES`), so no
/// gradient reaches r. This is ORT behaviour, not ONNX semantics; the ORT Training tests
/// compare the resulting gradient with the reference's `.detach()`.
pub fn total(b: &mut Builder, opts: &LossOptions, loss_type: i32, total: &str) {
    let weight = b.scalar_f32("weight", opts.weight as f32);
    let mut ce = CE_OUTPUT.to_string();
    if loss_type != FLOAT {
        ce = b.cast(&ce, FLOAT, "ce_loss_f32");
    }
    let weighted = match opts.combine {
        Combine::Add => b.binary("Mul", NUMBER_OUTPUT, &weight, "weighted_number_loss"),
        Combine::Scaled => {
            let eps = b.scalar_f32("scale_eps", 1e-10);
            let denom = b.binary("Add", NUMBER_OUTPUT, &eps, "number_loss_eps");
            let ratio = b.binary("Div", &ce, &denom, "ce_over_number");
            let zero = b.scalar_f32("scale_zero", 0.0);
            let frozen = b.node(
                "Clip",
                &[&zero, &ratio, &ratio],
                "ce_over_number_frozen",
                vec![],
            );
            let scale = b.binary("Mul", &frozen, &weight, "number_scale");
            b.binary("Mul", &scale, NUMBER_OUTPUT, "scaled_number_loss")
        }
    };
    let sum = b.binary("Add", &weighted, &ce, "total_f32");
    if loss_type != FLOAT {
        b.node_to(
            "Cast",
            &[&sum],
            &[total],
            vec![int_attr("to", loss_type as i64)],
        );
    } else {
        b.node_to("Identity", &[&sum], &[total], vec![]);
    }
}
