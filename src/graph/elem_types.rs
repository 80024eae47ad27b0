//! Element types followed forward through a graph, by one walk and two rule sets:
//! - [`ElemTypes`], the passes' rule: declared where the graph says so, set by `Cast` and the
//!   comparison/shape ops, otherwise the type of the first typed input that the op's schema binds
//!   to the output's type parameter (a `Reshape` is its data's type, never its shape's).
//!   Rules use it to write a plain `Cast` where `CastLike` would otherwise be needed (MIGraphX
//!   takes no `CastLike`).
//! - [`TypeNames`], the op schemas' rule, exact for every output and for sequences and optionals
//!   (`float`, `seq(float)`, `opt(float)`): what a kernel's type constraints are matched against
//!   (`tools::gpu_kernels`).
//!
//! The two stay apart because their answers differ where the schemas say more than "the first
//! input's type", and the passes' outputs are fixed by the first rule.

use std::hash::BuildHasher;

use crate::graph::hash::HashMap;

use crate::onnx::proto::tensor_proto::DataType;
use crate::onnx::proto::type_proto;
use crate::onnx::{attr, attr_i, GraphProto, NodeProto, TypeProto, BOOL, INT32, INT64};
use ntl_ops::schema::{canonical_domain, Param, Schema, Schemas};

const UINT8: i32 = DataType::Uint8 as i32;

/// The walk both rule sets share: each node's untyped outputs get the type `rule` gives them
/// (`rule(node, output index, types so far)`), over the node list at most `passes` times, until
/// a pass types nothing new (a node listed before its inputs' producers is typed on a later
/// pass). A type already known, declared ones included, is never replaced.
fn follow_nodes<T>(
    types: &mut HashMap<String, T>,
    nodes: &[NodeProto],
    passes: usize,
    rule: impl Fn(&NodeProto, usize, &HashMap<String, T>) -> Option<T>,
) {
    for _ in 0..passes {
        let mut changed = false;
        for node in nodes {
            for (k, out) in node.output.iter().enumerate() {
                if out.is_empty() || types.contains_key(out) {
                    continue;
                }
                if let Some(t) = rule(node, k, types) {
                    types.insert(out.clone(), t);
                    changed = true;
                }
            }
        }
        if !changed {
            break;
        }
    }
}

// what both rule sets read the same way

/// `Cast`'s target type.
fn cast_to(node: &NodeProto) -> Option<i32> {
    attr_i(node, "to").map(|t| t as i32)
}

/// The type of a `Constant`: its tensor `value`'s, or that of its `value_float(s)`,
/// `value_int(s)` or `value_string(s)` form (the dynamo exporter writes small constants so).
fn constant_value_type(node: &NodeProto) -> Option<i32> {
    if let Some(t) = attr(node, "value").and_then(|a| a.t.as_ref()) {
        return Some(t.data_type());
    }
    match node.attribute.first().map(|a| a.name()) {
        Some("value_float" | "value_floats") => Some(crate::onnx::FLOAT),
        Some("value_int" | "value_ints") => Some(INT64),
        Some("value_string" | "value_strings") => Some(DataType::String as i32),
        _ => None,
    }
}

/// `ConstantOfShape`'s type: its `value`'s, float without one.
fn constant_of_shape_type(node: &NodeProto) -> i32 {
    constant_value_type(node).unwrap_or(crate::onnx::FLOAT)
}

#[derive(Debug, Default)]
pub struct ElemTypes(HashMap<String, i32>);

impl ElemTypes {
    pub fn infer(g: &GraphProto) -> ElemTypes {
        let mut types = HashMap::default();
        for t in &g.initializer {
            types.insert(t.name().to_string(), t.data_type());
        }
        for v in g.input.iter().chain(&g.value_info).chain(&g.output) {
            if let Some((t, _)) = crate::onnx::value_info_shape(v) {
                types.insert(v.name().to_string(), t);
            }
        }
        let mut types = ElemTypes(types);
        types.follow(&g.node);
        types
    }

    /// Follows more nodes (emitted after the graph was inferred: a backward pass) forward.
    pub fn follow(&mut self, nodes: &[NodeProto]) {
        // one pass: the nodes are in order
        follow_nodes(&mut self.0, nodes, 1, |node, k, types| {
            if k == 0 {
                first_output_type(node, types)
            } else {
                type_of_bound_inputs(node, k, types)
            }
        });
    }

    /// Records a tensor's type (a constant emitted after the graph was inferred).
    pub fn set(&mut self, tensor: &str, elem_type: i32) {
        self.0.insert(tensor.to_string(), elem_type);
    }

    pub fn get(&self, tensor: &str) -> Option<i32> {
        self.0.get(tensor).copied().filter(|&t| t != 0)
    }
}

/// The passes' rule for a node's first output.
fn first_output_type(node: &NodeProto, types: &HashMap<String, i32>) -> Option<i32> {
    let input_type = |i: usize| node.input.get(i).and_then(|i| types.get(i).copied());
    match node.op_type() {
        "Cast" => cast_to(node),
        "CastLike" => input_type(1),
        "Shape" | "Size" | "NonZero" | "ArgMax" | "ArgMin" => Some(INT64),
        "Equal" | "Less" | "Greater" | "LessOrEqual" | "GreaterOrEqual" | "Not" | "And" | "Or"
        | "Xor" | "IsNaN" | "IsInf" => Some(BOOL),
        "Constant" => constant_value_type(node),
        "Where" => input_type(1),
        // ops whose output type is not their first input's
        "OneHot" => input_type(2),
        "DequantizeLinear" => input_type(1),
        "QuantizeLinear" => Some(input_type(2).unwrap_or(UINT8)),
        "MatMulInteger" | "ConvInteger" => Some(INT32),
        "ConstantOfShape" => Some(constant_of_shape_type(node)),
        _ => type_of_bound_inputs(node, 0, types),
    }
}

/// Output `k`'s type as the first typed input bound to its type parameter: `Unsqueeze(x, axes)`
/// is `x`'s type or unknown, never the int64 of `axes` (a `Split`'s second output is untyped
/// to a walk that types first outputs only, and then its `Unsqueeze` was typed int64). The
/// op's latest schema: the type parameters of these ops have only grown. An op without a
/// schema (another domain): its first typed input, for the first output only.
fn type_of_bound_inputs(node: &NodeProto, k: usize, types: &HashMap<String, i32>) -> Option<i32> {
    let typed = |i: &String| (!i.is_empty()).then(|| types.get(i).copied()).flatten();
    let Some(schema) = ntl_ops::schema::schemas().schema(node.domain(), node.op_type(), i64::MAX)
    else {
        return (k == 0)
            .then(|| node.input.iter().find_map(typed))
            .flatten();
    };
    let param = output_param(schema, k)?;
    inputs_bound_to(schema, node, &param.type_str).find_map(|i| typed(&node.input[i]))
}

/// Output `k`'s formal parameter (a variadic last output stands for the rest).
fn output_param(schema: &Schema, k: usize) -> Option<&Param> {
    schema
        .outputs
        .get(k)
        .or_else(|| schema.outputs.last().filter(|p| p.variadic))
}

/// The positions of `node`'s inputs that `schema` binds to the type parameter `param`.
fn inputs_bound_to<'a>(
    schema: &'a Schema,
    node: &NodeProto,
    param: &'a str,
) -> impl Iterator<Item = usize> + 'a {
    (0..node.input.len()).filter(move |&i| schema.input_param(i).as_deref() == Some(param))
}

/// The ONNX name of a tensor element type (`float`, `int64`, ...).
pub fn elem_type_name(dt: i32) -> Option<&'static str> {
    let t = DataType::try_from(dt).ok()?;
    Some(match t {
        DataType::Float => "float",
        DataType::Uint8 => "uint8",
        DataType::Int8 => "int8",
        DataType::Uint16 => "uint16",
        DataType::Int16 => "int16",
        DataType::Int32 => "int32",
        DataType::Int64 => "int64",
        DataType::String => "string",
        DataType::Bool => "bool",
        DataType::Float16 => "float16",
        DataType::Double => "double",
        DataType::Uint32 => "uint32",
        DataType::Uint64 => "uint64",
        DataType::Complex64 => "complex64",
        DataType::Complex128 => "complex128",
        DataType::Bfloat16 => "bfloat16",
        DataType::Float8e4m3fn => "float8e4m3fn",
        DataType::Float8e4m3fnuz => "float8e4m3fnuz",
        DataType::Float8e5m2 => "float8e5m2",
        DataType::Float8e5m2fnuz => "float8e5m2fnuz",
        DataType::Uint4 => "uint4",
        DataType::Int4 => "int4",
        _ => return None,
    })
}

/// `float`, `seq(float)`, `opt(float)` for a declared value type.
pub fn type_proto_name(t: &TypeProto) -> Option<String> {
    match t.value.as_ref()? {
        type_proto::Value::TensorType(t) => elem_type_name(t.elem_type()).map(str::to_string),
        type_proto::Value::SequenceType(s) => Some(format!(
            "seq({})",
            type_proto_name(s.elem_type.as_deref()?)?
        )),
        type_proto::Value::OptionalType(o) => Some(format!(
            "opt({})",
            type_proto_name(o.elem_type.as_deref()?)?
        )),
        _ => None,
    }
}

/// Value types by name, for every output, as the op schemas imply them.
#[derive(Debug, Default, Clone)]
pub struct TypeNames(HashMap<String, String>);

impl TypeNames {
    /// Declared types (inputs, outputs, value_info, initializers) and, forward through the
    /// nodes, the ones the op schemas imply: an output typed `T` has the type of the first input
    /// typed `T`; `Cast` and friends read their attributes. `opsets`: the model's opset per
    /// canonical domain.
    pub fn infer<S: BuildHasher>(
        graph: &GraphProto,
        opsets: &std::collections::HashMap<String, i64, S>,
        schemas: &Schemas,
    ) -> TypeNames {
        TypeNames::default().inner(graph, opsets, schemas)
    }

    /// A subgraph's types (an `If`, `Loop` or `Scan` body), which sees the tensors of `self`,
    /// its enclosing graph's.
    pub fn inner<S: BuildHasher>(
        &self,
        graph: &GraphProto,
        opsets: &std::collections::HashMap<String, i64, S>,
        schemas: &Schemas,
    ) -> TypeNames {
        let mut types = self.0.clone();
        for vi in graph
            .input
            .iter()
            .chain(&graph.output)
            .chain(&graph.value_info)
        {
            if let Some(t) = vi.r#type.as_ref().and_then(type_proto_name) {
                types.insert(vi.name().to_string(), t);
            }
        }
        for init in &graph.initializer {
            if let Some(t) = elem_type_name(init.data_type()) {
                types.insert(init.name().to_string(), t.to_string());
            }
        }
        // nodes are topologically sorted in a valid model; a few passes cover any that are not
        follow_nodes(&mut types, &graph.node, 4, |node, k, types| {
            let opset = opsets
                .get(canonical_domain(node.domain()))
                .copied()
                .unwrap_or(0);
            schema_output_type(node, k, opset, types, schemas)
        });
        TypeNames(types)
    }

    pub fn get(&self, tensor: &str) -> Option<&str> {
        self.0.get(tensor).map(String::as_str)
    }
}

/// The type name of the attribute `name` (`dtype`, `to`).
fn dtype_attr(node: &NodeProto, name: &str) -> Option<String> {
    attr_i(node, name)
        .and_then(|d| elem_type_name(d as i32))
        .map(str::to_string)
}

/// The schemas' rule for output `k` of `node`.
fn schema_output_type(
    node: &NodeProto,
    k: usize,
    opset: i64,
    types: &HashMap<String, String>,
    schemas: &Schemas,
) -> Option<String> {
    let input_type = |i: usize| {
        node.input
            .get(i)
            .filter(|s| !s.is_empty())
            .and_then(|n| types.get(n))
            .cloned()
    };
    if canonical_domain(node.domain()) == "ai.onnx" {
        if let Some(t) = attribute_typed(node, &input_type) {
            return t;
        }
    }
    let schema = schemas.schema(node.domain(), node.op_type(), opset)?;
    let param = output_param(schema, k)?;
    if let Some(inner) = param
        .type_str
        .strip_prefix("tensor(")
        .and_then(|s| s.strip_suffix(')'))
    {
        return Some(inner.to_string());
    }
    if let Some(t) = schema.fixed_type(&param.type_str) {
        return Some(t.to_string());
    }
    // the first present input bound to the same type parameter
    inputs_bound_to(schema, node, &param.type_str).find_map(input_type)
}

/// For the default-domain ops whose output type an attribute (or the type of a "like" input)
/// sets rather than a type parameter: `Some(the type, if it can be told)`; `None` for the others.
fn attribute_typed(
    node: &NodeProto,
    input_type: &dyn Fn(usize) -> Option<String>,
) -> Option<Option<String>> {
    let name = |t: i32| elem_type_name(t).map(str::to_string);
    Some(match node.op_type() {
        "Cast" => cast_to(node).and_then(name),
        "CastLike" => input_type(1),
        "RandomUniformLike" | "RandomNormalLike" | "EyeLike" => {
            dtype_attr(node, "dtype").or_else(|| input_type(0))
        }
        "RandomUniform" | "RandomNormal" => dtype_attr(node, "dtype").or(Some("float".into())),
        "Multinomial" => dtype_attr(node, "dtype").or(Some("int32".into())),
        "Constant" => {
            if let Some(t) = constant_value_type(node) {
                return Some(name(t));
            }
            let scalar_forms = [
                ("value_float", "float"),
                ("value_floats", "float"),
                ("value_int", "int64"),
                ("value_ints", "int64"),
                ("value_string", "string"),
                ("value_strings", "string"),
            ];
            scalar_forms
                .into_iter()
                .find(|(attribute, _)| attr(node, attribute).is_some())
                .map(|(_, t)| t.to_string())
        }
        "ConstantOfShape" => Some(
            elem_type_name(constant_of_shape_type(node))
                .unwrap_or("float")
                .to_string(),
        ),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::onnx::{int_attr, scalar_value_info, FLOAT};

    fn node(op: &str, inputs: &[&str], outputs: &[&str]) -> NodeProto {
        NodeProto {
            op_type: Some(op.into()),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: outputs.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn the_two_rule_sets_differ_where_the_schemas_say_more() {
        // TopK's second output is int64 by its schema; the passes' rule types only outputs
        // whose type an input binds. The Neg is listed before the node that makes its input:
        // the schemas' walk types it on its second pass, the passes' one-pass walk (nodes in
        // order) not at all. Cast's type is its attribute's in both.
        let mut cast = node("Cast", &["x_abs"], &["y"]);
        cast.attribute.push(int_attr("to", INT32 as i64));
        let graph = GraphProto {
            input: vec![scalar_value_info("x", FLOAT), scalar_value_info("k", INT64)],
            node: vec![
                node("Neg", &["x_abs"], &["z"]),
                node("Abs", &["x"], &["x_abs"]),
                node("TopK", &["x", "k"], &["values", "indices"]),
                cast,
            ],
            ..Default::default()
        };
        let opsets: std::collections::HashMap<String, i64> = [("ai.onnx".to_string(), 17)].into();
        let names = TypeNames::infer(&graph, &opsets, ntl_ops::schema::schemas());
        assert_eq!(names.get("values"), Some("float"));
        assert_eq!(names.get("indices"), Some("int64"));
        assert_eq!(names.get("y"), Some("int32"));
        assert_eq!(names.get("z"), Some("float"));
        let types = ElemTypes::infer(&graph);
        assert_eq!(types.get("values"), Some(FLOAT));
        assert_eq!(types.get("indices"), None);
        assert_eq!(types.get("y"), Some(INT32));
        assert_eq!(types.get("z"), None);
    }

    #[test]
    fn a_shape_or_index_input_never_types_a_data_output() {
        // The data of each op is the second output of a Split, typed by its schema (the input's
        // float); the Unsqueeze of an untyped tensor stays untyped, not the int64 of its axes
        // (CodeGen's rotary sin, whose Cast then had an int64 gradient).
        let mut split = node("Split", &["x", "parts"], &["a", "b"]);
        split.attribute.push(int_attr("axis", 0));
        let graph = GraphProto {
            input: vec![
                scalar_value_info("x", FLOAT),
                scalar_value_info("axes", INT64),
                scalar_value_info("parts", INT64),
            ],
            node: vec![
                split,
                node("Unsqueeze", &["b", "axes"], &["b1"]),
                node("Unsqueeze", &["unknown", "axes"], &["u"]),
                node("Reshape", &["unknown", "axes"], &["r"]),
                node("Gather", &["unknown", "axes"], &["g"]),
                node("Add", &["unknown", "x"], &["sum"]),
            ],
            ..Default::default()
        };
        let types = ElemTypes::infer(&graph);
        assert_eq!(types.get("b"), Some(FLOAT));
        assert_eq!(types.get("b1"), Some(FLOAT));
        for data in ["u", "r", "g"] {
            assert_eq!(types.get(data), None, "{data}");
        }
        // both of Add's inputs bind its output's type
        assert_eq!(types.get("sum"), Some(FLOAT));
    }
}
