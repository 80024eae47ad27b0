//! The ONNX operator schemas: the version history, formal inputs/outputs and type parameters of
//! every ONNX operator up to opset 21 (ONNX 1.16.1, the ONNX that ONNX Runtime 1.19.2 is built
//! with), from `data/onnx-1.16-schemas.tsv` (written by `scripts/gen/gen_onnx_schemas.py` from the
//! onnx wheel; `data/README.md`). Read by the structure check (which inputs an op requires) and
//! by the GPU kernel tables (which type parameter an argument binds).

use std::collections::HashMap;
use std::sync::OnceLock;

/// ONNX operator schemas up to opset 21 (ONNX 1.16.1).
pub const SCHEMA_TABLE: &str = include_str!("../../data/onnx-1.16-schemas.tsv");

/// A formal input or output of an operator schema.
#[derive(Debug, Clone)]
pub struct Param {
    /// A type parameter (`T`) or a fixed type (`tensor(int64)`).
    pub type_str: String,
    pub optional: bool,
    pub variadic: bool,
}

#[derive(Debug, Clone)]
pub struct Schema {
    pub since: i64,
    pub inputs: Vec<Param>,
    pub outputs: Vec<Param>,
    /// Type parameters that allow exactly one type (Equal's `T1` is `bool`).
    pub fixed: Vec<(String, String)>,
    /// ONNX defines the op by a function body (ORT can inline it).
    pub function: bool,
}

impl Schema {
    /// The type parameter input `i` binds (`T`), or None for a fixed type (`tensor(int64)`).
    pub fn input_param(&self, i: usize) -> Option<String> {
        let p = self
            .inputs
            .get(i)
            .or_else(|| self.inputs.last().filter(|p| p.variadic))?;
        (!p.type_str.starts_with("tensor(")).then(|| p.type_str.clone())
    }

    /// The one type a single-type parameter allows.
    pub fn fixed_type(&self, param: &str) -> Option<&str> {
        self.fixed
            .iter()
            .find(|(p, _)| p == param)
            .map(|(_, t)| t.as_str())
    }
}

/// The schemas of every operator, by domain and op type.
pub struct Schemas {
    /// (domain, op) -> schemas by ascending version
    by_op: HashMap<(String, String), Vec<Schema>>,
}

/// `ai.onnx` for the default domain (`""` in a model).
pub fn canonical_domain(domain: &str) -> &str {
    if domain.is_empty() {
        "ai.onnx"
    } else {
        domain
    }
}

fn parse_params(s: &str) -> Vec<Param> {
    if s.is_empty() {
        return Vec::new();
    }
    s.split(',')
        .map(|p| {
            let (t, optional, variadic) = if let Some(t) = p.strip_suffix('?') {
                (t, true, false)
            } else if let Some(t) = p.strip_suffix('*') {
                (t, false, true)
            } else {
                (p, false, false)
            };
            Param {
                type_str: t.to_string(),
                optional,
                variadic,
            }
        })
        .collect()
}

/// The data rows of a generated TSV table, as `(line index, fields)`: comment (`#`) and blank
/// lines skipped, an optional header (the first row, starting with `header`) too, and every row
/// checked to have `width` fields.
pub fn tsv_rows<'a>(
    text: &'a str,
    header: &'a str,
    width: usize,
    what: &'a str,
) -> impl Iterator<Item = Result<(usize, Vec<&'a str>), String>> + 'a {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.starts_with('#') && !l.trim().is_empty())
        .enumerate()
        .filter(move |(row, (_, l))| !(*row == 0 && l.starts_with(header)))
        .map(move |(_, (no, line))| {
            let f: Vec<&str> = line.split('\t').collect();
            if f.len() == width {
                Ok((no, f))
            } else {
                Err(format!(
                    "{what} table line {}: {} fields, want {width}",
                    no + 1,
                    f.len()
                ))
            }
        })
}

impl Schemas {
    pub fn parse(schema_tsv: &str) -> Result<Schemas, String> {
        let mut by_op: HashMap<(String, String), Vec<Schema>> = HashMap::new();
        for row in tsv_rows(schema_tsv, "domain\t", 7, "schema") {
            let (no, f) = row?;
            let since = f[2]
                .parse::<i64>()
                .map_err(|_| format!("schema table line {}: version '{}'", no + 1, f[2]))?;
            by_op
                .entry((f[0].to_string(), f[1].to_string()))
                .or_default()
                .push(Schema {
                    since,
                    inputs: parse_params(f[3]),
                    outputs: parse_params(f[4]),
                    fixed: f[5]
                        .split(';')
                        .filter_map(|c| c.split_once('='))
                        .map(|(p, t)| (p.to_string(), t.to_string()))
                        .collect(),
                    function: f[6] == "y",
                });
        }
        for v in by_op.values_mut() {
            v.sort_by_key(|s| s.since);
        }
        Ok(Schemas { by_op })
    }

    /// The schema in effect for `op` at `opset` of its domain: the latest version <= opset.
    pub fn schema(&self, domain: &str, op: &str, opset: i64) -> Option<&Schema> {
        self.by_op
            .get(&(canonical_domain(domain).to_string(), op.to_string()))?
            .iter()
            .rev()
            .find(|s| s.since <= opset)
    }

    /// Whether the table knows the op at all (any version).
    pub fn knows_op(&self, domain: &str, op: &str) -> bool {
        self.by_op
            .contains_key(&(canonical_domain(domain).to_string(), op.to_string()))
    }
}

/// The embedded schema table, parsed on first use.
pub fn schemas() -> &'static Schemas {
    static SCHEMAS: OnceLock<Schemas> = OnceLock::new();
    SCHEMAS.get_or_init(|| Schemas::parse(SCHEMA_TABLE).expect("embedded schema table parses"))
}
