//! A small node emitter: every node and tensor it creates gets a unique, readable name under
//! one prefix, and ops are written in the form the model's opset expects.

use std::collections::HashSet;

use crate::onnx::{
    f32_tensor, i64_tensor, int_attr, ints_attr, AttributeProto, NodeProto, TensorProto,
};

/// The lowest default-domain opset the emitted subgraphs support (ReduceSum and Unsqueeze
/// take their axes as inputs from 13 on).
pub const MIN_OPSET: i64 = 13;

pub struct Builder {
    prefix: String,
    /// The model's default-domain opset: some ops moved attributes to inputs over time.
    opset: i64,
    taken: HashSet<String>,
    /// Per base name, the suffix to try next (names are only ever added, so the first free
    /// suffix never goes down): `fresh` stays linear when one hint is used many times.
    next_suffix: std::collections::HashMap<String, u64>,
    pub nodes: Vec<NodeProto>,
    pub initializers: Vec<TensorProto>,
}

impl Builder {
    /// `taken` holds the names already in the graph that new names could collide with: every
    /// one under `prefix/` (all [`Builder::fresh`] makes) and the exact names outside it that
    /// [`Builder::claim`] will be asked for. New names never collide with them.
    pub fn new(prefix: &str, opset: i64, taken: HashSet<String>) -> Self {
        Builder {
            prefix: prefix.to_string(),
            opset,
            taken,
            next_suffix: std::collections::HashMap::new(),
            nodes: Vec::new(),
            initializers: Vec::new(),
        }
    }

    /// A fresh name `prefix/hint`, suffixed `_2`, `_3`... if taken. Deterministic.
    pub fn fresh(&mut self, hint: &str) -> String {
        let base = format!("{}/{}", self.prefix, hint);
        let mut name = base.clone();
        let mut k = self.next_suffix.get(&base).copied().unwrap_or(2);
        while self.taken.contains(&name) {
            name = format!("{base}_{k}");
            k += 1;
        }
        self.next_suffix.insert(base, k);
        self.taken.insert(name.clone());
        name
    }

    /// The default-domain opset the nodes are written for.
    pub fn opset(&self) -> i64 {
        self.opset
    }

    /// Claims an exact name (a user-visible output such as `ce_loss`); false if it is taken.
    /// A name outside the prefix must be among the builder's `taken` names if the graph uses it.
    pub fn claim(&mut self, name: &str) -> bool {
        self.taken.insert(name.to_string())
    }

    /// Emits `op(inputs) -> outputs`; the node is named after its first output.
    pub fn node_to(
        &mut self,
        op: &str,
        inputs: &[&str],
        outputs: &[&str],
        attrs: Vec<AttributeProto>,
    ) {
        let name = self.fresh(op);
        self.nodes.push(NodeProto {
            name: Some(name),
            op_type: Some(op.to_string()),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: outputs.iter().map(|s| s.to_string()).collect(),
            attribute: attrs,
            ..Default::default()
        });
    }

    /// Emits a single-output node and returns its fresh output name `prefix/hint`.
    pub fn node(
        &mut self,
        op: &str,
        inputs: &[&str],
        hint: &str,
        attrs: Vec<AttributeProto>,
    ) -> String {
        let out = self.fresh(hint);
        self.node_to(op, inputs, &[&out], attrs);
        out
    }

    pub fn const_f32(&mut self, hint: &str, dims: &[i64], data: &[f32]) -> String {
        let name = self.fresh(hint);
        self.initializers.push(f32_tensor(&name, dims, data));
        name
    }

    pub fn const_i64(&mut self, hint: &str, dims: &[i64], data: &[i64]) -> String {
        let name = self.fresh(hint);
        self.initializers.push(i64_tensor(&name, dims, data));
        name
    }

    pub fn scalar_f32(&mut self, hint: &str, value: f32) -> String {
        self.const_f32(hint, &[], &[value])
    }

    /// A scalar of a float element type (float32 for any other type), rounded to it.
    pub fn scalar_typed(&mut self, hint: &str, value: f64, elem_type: i32) -> String {
        use crate::onnx::proto::tensor_proto::DataType;
        let raw: Vec<u8> = match DataType::try_from(elem_type) {
            Ok(DataType::Double) => value.to_le_bytes().to_vec(),
            Ok(DataType::Float16) => half::f16::from_f64(value).to_le_bytes().to_vec(),
            Ok(DataType::Bfloat16) => half::bf16::from_f64(value).to_le_bytes().to_vec(),
            _ => return self.scalar_f32(hint, value as f32),
        };
        let name = self.fresh(hint);
        self.initializers.push(TensorProto {
            name: Some(name.clone()),
            data_type: Some(elem_type),
            raw_data: Some(raw.into()),
            ..Default::default()
        });
        name
    }

    // ---- op helpers (opset >= 13 forms) ----

    pub fn binary(&mut self, op: &str, a: &str, b: &str, hint: &str) -> String {
        self.node(op, &[a, b], hint, vec![])
    }

    pub fn unary(&mut self, op: &str, x: &str, hint: &str) -> String {
        self.node(op, &[x], hint, vec![])
    }

    /// ReduceSum over `axes` (all axes when empty).
    pub fn reduce_sum(&mut self, x: &str, axes: &[i64], keepdims: bool, hint: &str) -> String {
        let attrs = vec![int_attr("keepdims", keepdims as i64)];
        if axes.is_empty() {
            return self.node("ReduceSum", &[x], hint, attrs);
        }
        let axes = self.const_i64(&format!("{hint}_axes"), &[axes.len() as i64], axes);
        self.node("ReduceSum", &[x, &axes], hint, attrs)
    }

    /// ReduceMax / ReduceMean over `axes` (all when empty): axes became an input in opset 18.
    pub fn reduce(
        &mut self,
        op: &str,
        x: &str,
        axes: &[i64],
        keepdims: bool,
        hint: &str,
    ) -> String {
        let mut attrs = vec![int_attr("keepdims", keepdims as i64)];
        if axes.is_empty() {
            return self.node(op, &[x], hint, attrs);
        }
        if self.opset < 18 {
            attrs.push(ints_attr("axes", axes));
            return self.node(op, &[x], hint, attrs);
        }
        let axes = self.const_i64(&format!("{hint}_axes"), &[axes.len() as i64], axes);
        self.node(op, &[x, &axes], hint, attrs)
    }

    pub fn squeeze(&mut self, x: &str, axes: &[i64], hint: &str) -> String {
        let axes = self.const_i64(&format!("{hint}_axes"), &[axes.len() as i64], axes);
        self.node("Squeeze", &[x, &axes], hint, vec![])
    }

    pub fn concat(&mut self, xs: &[&str], axis: i64, hint: &str) -> String {
        self.node("Concat", xs, hint, vec![int_attr("axis", axis)])
    }

    /// `x[..., start:end]` along `axis`, with `end` a constant.
    pub fn slice(&mut self, x: &str, start: i64, end: i64, axis: i64, hint: &str) -> String {
        let s = self.const_i64(&format!("{hint}_start"), &[1], &[start]);
        let e = self.const_i64(&format!("{hint}_end"), &[1], &[end]);
        let a = self.const_i64(&format!("{hint}_axis"), &[1], &[axis]);
        self.node("Slice", &[x, &s, &e, &a], hint, vec![])
    }

    pub fn unsqueeze(&mut self, x: &str, axes: &[i64], hint: &str) -> String {
        let axes = self.const_i64(&format!("{hint}_axes"), &[axes.len() as i64], axes);
        self.node("Unsqueeze", &[x, &axes], hint, vec![])
    }

    pub fn reshape(&mut self, x: &str, shape: &[i64], hint: &str) -> String {
        let shape = self.const_i64(&format!("{hint}_shape"), &[shape.len() as i64], shape);
        self.node("Reshape", &[x, &shape], hint, vec![])
    }

    pub fn cast(&mut self, x: &str, to: i32, hint: &str) -> String {
        self.node("Cast", &[x], hint, vec![int_attr("to", to as i64)])
    }

    pub fn gather(&mut self, x: &str, indices: &str, axis: i64, hint: &str) -> String {
        self.node("Gather", &[x, indices], hint, vec![int_attr("axis", axis)])
    }

    pub fn softmax(&mut self, x: &str, axis: i64, hint: &str) -> String {
        self.node("Softmax", &[x], hint, vec![int_attr("axis", axis)])
    }

    pub fn transpose(&mut self, x: &str, perm: &[i64], hint: &str) -> String {
        self.node("Transpose", &[x], hint, vec![ints_attr("perm", perm)])
    }

    /// `a == b` for numbers. Equal gained a version at opset 19 (string inputs) for which ORT
    /// 1.19's CUDA and ROCm providers register no kernel, so from 19 on it is written as
    /// `Not(Or(Less, Greater))`, whose versions they do serve (exact for non-NaN inputs).
    pub fn equal(&mut self, a: &str, b: &str, hint: &str) -> String {
        if self.opset < 19 {
            return self.binary("Equal", a, b, hint);
        }
        let lt = self.binary("Less", a, b, &format!("{hint}_lt"));
        let gt = self.binary("Greater", a, b, &format!("{hint}_gt"));
        let ne = self.binary("Or", &lt, &gt, &format!("{hint}_ne"));
        self.unary("Not", &ne, hint)
    }

    /// Index of the largest value along the last axis (the first one on ties), as int64 with
    /// that axis removed. TopK rather than ArgMax: ORT 1.19's GPU providers register ArgMax only
    /// up to version 11.
    pub fn argmax_last(&mut self, x: &str, hint: &str) -> String {
        let (_, index) = self.top1(x, hint);
        self.squeeze(&index, &[-1], hint)
    }

    /// `TopK(x, 1)` along the last axis: (values, indices), that axis kept with size 1.
    pub fn top1(&mut self, x: &str, hint: &str) -> (String, String) {
        let k = self.const_i64(&format!("{hint}_k"), &[1], &[1]);
        let values = self.fresh(&format!("{hint}_top"));
        let index = self.fresh(&format!("{hint}_index"));
        self.node_to(
            "TopK",
            &[x, &k],
            &[&values, &index],
            vec![
                int_attr("axis", -1),
                int_attr("largest", 1),
                int_attr("sorted", 1),
            ],
        );
        (values, index)
    }

    pub fn where_(&mut self, cond: &str, a: &str, b: &str, hint: &str) -> String {
        self.node("Where", &[cond, a, b], hint, vec![])
    }

    /// `t` unchanged, as a tensor no runtime can compute before the activation `x`: a
    /// `Reshape` of `t` to its own shape (onnxruntime's is a view, no copy), the shape read
    /// through `Where(c, s, s)` with `c` taken from `x`'s first element. Runtimes order nodes
    /// by their inputs, and `Where` on a value known only at run time survives their
    /// optimisers, where a `CastLike(t, x)` becomes a `Cast(t)` that reads `t` alone and may
    /// run at the start of the step (onnxruntime's PRIORITY_BASED order runs it there). `x`
    /// must have an element. Constants as `Constant` nodes: the caller takes only nodes.
    pub fn after(&mut self, t: &str, x: &str, hint: &str) -> String {
        let constant = |b: &mut Builder, name: &str, data: &[i64]| {
            let out = b.fresh(name);
            let value = i64_tensor(&out, &[1], data);
            b.node_to(
                "Constant",
                &[],
                &[&out],
                vec![crate::onnx::tensor_attr("value", value)],
            );
            out
        };
        let minus_one = constant(self, &format!("{hint}_flat_shape"), &[-1]);
        let flat = self.node("Reshape", &[x, &minus_one], &format!("{hint}_flat"), vec![]);
        let zero = constant(self, &format!("{hint}_first_index"), &[0]);
        let first = self.gather(&flat, &zero, 0, &format!("{hint}_first"));
        let cond = self.cast(&first, crate::onnx::BOOL, &format!("{hint}_cond"));
        let shape = self.node("Shape", &[t], &format!("{hint}_shape"), vec![]);
        let shape = self.where_(&cond, &shape, &shape, &format!("{hint}_shape_after"));
        self.node("Reshape", &[t, &shape], hint, vec![])
    }
}
