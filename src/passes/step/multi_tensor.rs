//! The optimizer update over flat buckets (`--update-bucket MIB`), as torch's multi-tensor
//! (`foreach`) AdamW and SGD do it: the trained tensors of at most MIB MiB, in graph order,
//! are flattened and concatenated into buckets of at most MIB MiB; each bucket is updated as
//! one tensor and split back into the tensors' next values.
//!
//! Why: the update is about fifteen elementwise ops a tensor, and on a GPU each op is a kernel
//! launch. A model's many small tensors (norms, biases, LoRA's adapters) make that part of the
//! step launch-bound: thousands of launches doing little each. A bucket launches each op once.
//! The price is the copies into and out of the bucket, so tensors above the bucket size are
//! updated on their own as before, and the bucket bounds the extra memory (a few buckets' worth
//! alive at once). Elementwise ops compute each element of a concatenation as they compute it
//! on its own tensor, so the values are the per-tensor update's, bit for bit — except the
//! clipping's Σ‖g‖², which sums a bucket at once (float32 rounding apart).

use ntl_ops::onnx::int_attr;

use super::param_update::ParamUpdate;
use crate::passes::grad::Ctx;

/// Runs of consecutive parameters (indices into `params`) updated as one flat tensor: tensors
/// of at most `bucket_bytes` (float32), greedily packed up to `bucket_bytes` a bucket. Runs of
/// one tensor are left out (they are updated on their own anyway), and so are empty tensors.
pub fn plan(params: &[ParamUpdate], bucket_bytes: u64) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    if bucket_bytes == 0 {
        return runs;
    }
    let (mut start, mut bytes) = (0, 0u64);
    for (i, p) in params.iter().enumerate() {
        let size = numel(&p.dims) * 4; // float32
        let fits = size > 0 && size <= bucket_bytes;
        if !fits || bytes + size > bucket_bytes {
            if i - start > 1 {
                runs.push(start..i);
            }
            (start, bytes) = if fits { (i, 0) } else { (i + 1, 0) };
        }
        if fits {
            bytes += size;
        }
    }
    if params.len() - start > 1 {
        runs.push(start..params.len());
    }
    runs
}

/// A bucket as `unflatten` splits it back: its members (indices into the parameters), its
/// flat update's index among `flatten`'s updates, and the shape constants it splits by (the
/// members' sizes; each member's dims, none for a 1-D member), made once for all its outputs.
pub struct Bucket {
    members: std::ops::Range<usize>,
    at: usize,
    sizes: String,
    dims: Vec<Option<String>>,
}

/// The updates to emit: each run of `runs` as one flat `ParamUpdate` (its parameter, gradient
/// and state the members' concatenation, its next values fresh names), every other parameter
/// as given; and the buckets to split back. The state's concatenations wait for the bucket's
/// gradient (they read an empty slice of it): otherwise an order that runs ready nodes early
/// copies the state into buckets during the forward and keeps the copies until the update.
pub fn flatten(
    ctx: &mut Ctx,
    params: &[ParamUpdate],
    runs: &[std::ops::Range<usize>],
) -> (Vec<ParamUpdate>, Vec<Bucket>) {
    let mut updates = Vec::new();
    let mut buckets = Vec::new();
    let mut next = 0;
    for run in runs {
        updates.extend_from_slice(&params[next..run.start]);
        let members = &params[run.clone()];
        let sizes: Vec<i64> = members.iter().map(|p| numel(&p.dims) as i64).collect();
        let flat_shape = ctx.i64s(&[-1]);
        let grad = concat(
            ctx,
            members.iter().map(|p| (&p.grad, &p.dims)),
            &flat_shape,
            None,
            "opt/bucket_grad",
        );
        let after_grad = ctx.b.slice(&grad, 0, 0, 0, "opt/bucket_gate");
        let gated = Some(after_grad.as_str());
        let param = concat(
            ctx,
            members.iter().map(|p| (&p.param, &p.dims)),
            &flat_shape,
            gated,
            "opt/bucket_param",
        );
        let slots = (0..members[0].slots.len())
            .map(|k| {
                let xs = members.iter().map(|p| (&p.slots[k], &p.dims));
                concat(ctx, xs, &flat_shape, gated, "opt/bucket_state")
            })
            .collect();
        buckets.push(Bucket {
            members: run.clone(),
            at: updates.len(),
            sizes: ctx.i64s(&sizes),
            dims: members
                .iter()
                .map(|p| (p.dims.len() != 1).then(|| ctx.i64s(&p.dims)))
                .collect(),
        });
        updates.push(ParamUpdate {
            param,
            dims: vec![sizes.iter().sum()],
            grad,
            next_param: ctx.b.fresh("opt/bucket_next"),
            next_slots: members[0]
                .slots
                .iter()
                .map(|_| ctx.b.fresh("opt/bucket_next"))
                .collect(),
            slots,
        });
        next = run.end;
    }
    updates.extend_from_slice(&params[next..]);
    (updates, buckets)
}

/// Splits each bucket's next values back into its members' next parameter and state outputs.
/// `updates` and `buckets` are `flatten`'s.
pub fn unflatten(
    ctx: &mut Ctx,
    params: &[ParamUpdate],
    updates: &[ParamUpdate],
    buckets: &[Bucket],
) {
    for bucket in buckets {
        let flat = &updates[bucket.at];
        split(ctx, &flat.next_param, params, bucket, |p| &p.next_param);
        for k in 0..flat.next_slots.len() {
            split(ctx, &flat.next_slots[k], params, bucket, |p| {
                &p.next_slots[k]
            });
        }
    }
}

/// `Concat` of the tensors (with their dims) flattened (`flat_shape`: `[-1]`; a 1-D tensor is
/// read as it is), after `gate` (an empty tensor) where given.
fn concat<'a>(
    ctx: &mut Ctx,
    xs: impl Iterator<Item = (&'a String, &'a Vec<i64>)>,
    flat_shape: &str,
    gate: Option<&str>,
    hint: &str,
) -> String {
    let mut parts: Vec<String> = gate.map(str::to_string).into_iter().collect();
    for (x, dims) in xs {
        parts.push(match dims.len() {
            1 => x.clone(),
            _ => ctx.op("Reshape", &[x, flat_shape], "opt/flat"),
        });
    }
    let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
    ctx.b.concat(&refs, 0, hint)
}

/// `flat` split into the bucket's members, each reshaped to its dims into `out(member)`. A
/// 1-D member's piece is its output itself: no Reshape, so a runtime writes it straight into
/// the output's memory (a Reshape into an output bound by the caller copies).
fn split(
    ctx: &mut Ctx,
    flat: &str,
    params: &[ParamUpdate],
    bucket: &Bucket,
    out: impl Fn(&ParamUpdate) -> &String,
) {
    let members = &params[bucket.members.clone()];
    let pieces: Vec<String> = members
        .iter()
        .zip(&bucket.dims)
        .map(|(p, dims)| match dims {
            None => out(p).clone(),
            Some(_) => ctx.b.fresh("opt/unflat"),
        })
        .collect();
    let piece_refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
    // `split` is an input (opset 13 on: the step graph's opsets, as the patch's)
    ctx.b.node_to(
        "Split",
        &[flat, &bucket.sizes],
        &piece_refs,
        vec![int_attr("axis", 0)],
    );
    for ((p, piece), dims) in members.iter().zip(&pieces).zip(&bucket.dims) {
        if let Some(dims) = dims {
            ctx.b.node_to("Reshape", &[piece, dims], &[out(p)], vec![]);
        }
    }
}

fn numel(dims: &[i64]) -> u64 {
    dims.iter().map(|&d| d.max(0) as u64).product()
}

#[cfg(test)]
mod tests {
    use super::plan;
    use crate::passes::step::param_update::ParamUpdate;

    fn params(elements: &[i64]) -> Vec<ParamUpdate> {
        elements
            .iter()
            .map(|&n| ParamUpdate {
                param: String::new(),
                dims: vec![n],
                grad: String::new(),
                slots: vec![],
                next_param: String::new(),
                next_slots: vec![],
            })
            .collect()
    }

    #[test]
    fn small_tensors_pack_in_order_up_to_the_bucket() {
        // 100 bytes a bucket: 25 floats
        let p = params(&[10, 10, 10, 5, 20, 1]);
        assert_eq!(plan(&p, 100), vec![0..2, 2..4, 4..6]);
    }

    #[test]
    fn big_empty_and_lonely_tensors_update_alone() {
        // 26 floats is over 100 bytes; an empty tensor has nothing to launch; a run of one stays
        let p = params(&[10, 26, 10, 10, 0, 10, 26, 3]);
        assert_eq!(plan(&p, 100), vec![2..4]);
    }

    #[test]
    fn no_bucket_size_plans_nothing() {
        assert!(plan(&params(&[1, 1, 1]), 0).is_empty());
    }
}
