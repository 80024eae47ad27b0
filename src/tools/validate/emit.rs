//! A minimal node emitter for the validation copy, kept apart from `ntl_ops::Builder` so
//! the graph validate runs does not depend on the code it checks. Names live under
//! `ntl_validate/` and avoid every name already in the graph.

use std::collections::HashSet;

use crate::onnx::{AttributeProto, NodeProto, TensorProto};

/// The prefix of every name the emitter makes.
pub const PREFIX: &str = "ntl_validate";

pub struct Emitter {
    taken: HashSet<String>,
    pub nodes: Vec<NodeProto>,
    pub initializers: Vec<TensorProto>,
}

impl Emitter {
    pub fn new(taken: HashSet<String>) -> Self {
        Emitter {
            taken,
            nodes: Vec::new(),
            initializers: Vec::new(),
        }
    }

    pub fn fresh(&mut self, hint: &str) -> String {
        let base = format!("{PREFIX}/{hint}");
        let mut name = base.clone();
        let mut k = 2;
        while self.taken.contains(&name) {
            name = format!("{base}_{k}");
            k += 1;
        }
        self.taken.insert(name.clone());
        name
    }

    /// `op(inputs)` with one output named `out` (or a fresh name from `hint`); returns it.
    pub fn node(
        &mut self,
        op: &str,
        inputs: &[&str],
        attrs: Vec<AttributeProto>,
        out: Out,
    ) -> String {
        let output = match out {
            Out::Named(n) => n.to_string(),
            Out::Fresh(hint) => self.fresh(hint),
        };
        let name = self.fresh(&format!("{op}_node"));
        self.nodes.push(NodeProto {
            name: Some(name),
            op_type: Some(op.into()),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: vec![output.clone()],
            attribute: attrs,
            ..Default::default()
        });
        output
    }

    /// A constant initializer; `make(name)` builds the tensor under a fresh name.
    pub fn constant(&mut self, hint: &str, make: impl FnOnce(&str) -> TensorProto) -> String {
        let name = self.fresh(hint);
        self.initializers.push(make(&name));
        name
    }
}

pub enum Out<'a> {
    Named(&'a str),
    Fresh(&'a str),
}
