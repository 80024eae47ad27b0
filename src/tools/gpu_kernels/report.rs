//! The report of one model for one provider: nodes grouped by op, version, types and outcome,
//! the verdict, and the text and JSON `inspect --target` prints.

use std::collections::{BTreeMap, BTreeSet};

use super::matching::{Missing, Placement};
use super::target::Target;

/// What happens to one group of nodes: same op, version, types and outcome.
#[derive(Debug, Clone)]
pub struct OpGroup {
    pub domain: String,
    pub op: String,
    pub version: Option<i64>,
    /// Type parameter -> type (`?` when unknown).
    pub types: BTreeMap<String, String>,
    pub placement: Placement,
    pub nodes: Vec<String>,
    /// How many of `nodes` ntl-patch added.
    pub ntl_nodes: usize,
}

impl OpGroup {
    pub(super) fn signature(&self) -> String {
        let version = self.version.map_or("?".into(), |v| v.to_string());
        let types: Vec<String> = self.types.iter().map(|(p, t)| format!("{p}={t}")).collect();
        if types.is_empty() {
            format!("{} v{version}", self.op_label())
        } else {
            format!("{} v{version} [{}]", self.op_label(), types.join(", "))
        }
    }

    pub(super) fn op_label(&self) -> String {
        let label = if self.domain == "ai.onnx" {
            self.op.clone()
        } else {
            format!("{}:{}", self.domain, self.op)
        };
        // op types and domains come from the model: one line, no terminal controls
        crate::text::escape(&label).into_owned()
    }
}

/// The readiness of one model for one GPU provider.
#[derive(Debug, Clone)]
pub struct GpuReport {
    pub target: Target,
    pub opsets: BTreeMap<String, i64>,
    pub nodes: usize,
    pub ntl_nodes: usize,
    pub groups: Vec<OpGroup>,
    /// Nodes with a kernel that ORT's GetCpuPreferredNodes would likely still put on the CPU.
    pub cpu_preferred: Vec<String>,
    /// Nodes inside subgraphs (If/Loop/Scan bodies), not checked.
    pub nested_nodes: usize,
    pub notes: Vec<String>,
}

impl GpuReport {
    pub fn fallbacks(&self) -> impl Iterator<Item = &OpGroup> {
        self.groups
            .iter()
            .filter(|g| matches!(g.placement, Placement::Fallback { .. }))
    }

    pub fn unknown(&self) -> impl Iterator<Item = &OpGroup> {
        self.groups
            .iter()
            .filter(|g| matches!(g.placement, Placement::Unknown(_)))
    }

    /// Every checked node has a kernel on the target.
    pub fn all_on_gpu(&self) -> bool {
        self.fallbacks().next().is_none() && self.unknown().next().is_none()
    }

    pub fn verdict(&self) -> String {
        let t = self.target.name();
        let fallbacks: usize = self.fallbacks().map(|g| g.nodes.len()).sum();
        let unknown: usize = self.unknown().map(|g| g.nodes.len()).sum();
        let mgx = self.target == Target::Migraphx;
        if self.all_on_gpu() && mgx {
            "the migraphx provider takes every node".to_string()
        } else if self.all_on_gpu() {
            format!("all ops have {t} kernels")
        } else if fallbacks > 0 {
            let ops: BTreeSet<String> = self.fallbacks().map(OpGroup::op_label).collect();
            format!(
                "{fallbacks} node(s) would fall back to CPU: {} {}",
                if mgx {
                    "the migraphx provider does not take".to_string()
                } else {
                    format!("no {t} kernel for")
                },
                ops.into_iter().collect::<Vec<_>>().join(", ")
            )
        } else {
            format!("{unknown} node(s) could not be checked (see below); every other op has a {t} kernel")
        }
    }

    pub fn to_text(&self) -> String {
        let t = self.target.name();
        let what = if self.target == Target::Migraphx {
            "supported-op list and op checks"
        } else {
            "kernels"
        };
        let mut out = format!(
            "{t}: {}\n  checked against the {} {what} of {} {} ({}); {} node(s), {} added by ntl-patch\n",
            self.verdict(),
            self.target.provider(),
            self.target.package(),
            self.target.ort_version(),
            self.target.table_file(),
            self.nodes,
            self.ntl_nodes
        );
        let fallbacks: Vec<&OpGroup> = self.fallbacks().collect();
        if !fallbacks.is_empty() {
            out.push_str("  CPU fallbacks:\n");
            for g in &fallbacks {
                let Placement::Fallback { why, cpu } = &g.placement else {
                    unreachable!()
                };
                out.push_str(&format!(
                    "    {}: {}{}; {} node(s), {} added by ntl-patch: {}\n",
                    g.signature(),
                    why.describe(self.target, &g.op, g.version),
                    if *cpu {
                        ""
                    } else {
                        " (and the CPU provider has none either: ORT cannot run it)"
                    },
                    g.nodes.len(),
                    g.ntl_nodes,
                    node_list(&g.nodes)
                ));
            }
        }
        let unknown: Vec<&OpGroup> = self.unknown().collect();
        if !unknown.is_empty() {
            out.push_str("  not checked:\n");
            for g in &unknown {
                let Placement::Unknown(why) = &g.placement else {
                    unreachable!()
                };
                out.push_str(&format!(
                    "    {}: {why}; {} node(s): {}\n",
                    g.op_label(),
                    g.nodes.len(),
                    node_list(&g.nodes)
                ));
            }
        }
        let on_gpu: Vec<&OpGroup> = self
            .groups
            .iter()
            .filter(|g| matches!(g.placement, Placement::Gpu { .. }))
            .collect();
        if !on_gpu.is_empty() {
            if self.target == Target::Migraphx {
                out.push_str("  taken by migraphx (compiled by MIGraphX, any op version):\n");
            } else {
                out.push_str(&format!("  {t} kernels:\n"));
            }
            for g in on_gpu {
                let Placement::Gpu { kernel, unchecked } = &g.placement else {
                    unreachable!()
                };
                let mut extra = String::new();
                if !unchecked.is_empty() {
                    let params: Vec<&str> = unchecked
                        .iter()
                        .map(|p| {
                            if p == "?" {
                                "all parameters (unresolved in the table)"
                            } else {
                                p.as_str()
                            }
                        })
                        .collect();
                    extra.push_str(&format!("; types of {} not checked", params.join(", ")));
                }
                if let Some(c) = &kernel.condition {
                    extra.push_str(&format!("; registered only if {c}"));
                }
                let kernel = if self.target == Target::Migraphx {
                    "taken".to_string()
                } else {
                    format!("kernel {}", kernel.range())
                };
                out.push_str(&format!(
                    "    {}: {kernel}{extra}; {} node(s) ({} ntl-patch)\n",
                    g.signature(),
                    g.nodes.len(),
                    g.ntl_nodes
                ));
            }
        }
        let inlined: Vec<&OpGroup> = self
            .groups
            .iter()
            .filter(|g| matches!(g.placement, Placement::Inlined))
            .collect();
        for g in inlined {
            out.push_str(&format!(
                "  inlined by ORT (a function with no kernel on any provider; its body ops are placed instead): {}; {} node(s): {}\n",
                g.signature(),
                g.nodes.len(),
                node_list(&g.nodes)
            ));
        }
        if !self.cpu_preferred.is_empty() {
            out.push_str(&format!(
                "  likely on CPU by ORT's choice (GetCpuPreferredNodes: shape arithmetic fed from CPU memory; has a {t} kernel, not a fallback): {}\n",
                node_list(&self.cpu_preferred)
            ));
        }
        for n in &self.notes {
            out.push_str(&format!("  note: {n}\n"));
        }
        out
    }

    pub fn to_json(&self) -> serde_json::Value {
        let group = |g: &OpGroup| {
            let mut v = serde_json::json!({
                "domain": g.domain,
                "op": g.op,
                "version": g.version,
                "types": g.types,
                "nodes": g.nodes,
                "ntl_nodes": g.ntl_nodes,
            });
            match &g.placement {
                Placement::Gpu { kernel, unchecked } => {
                    v["kernel"] = serde_json::json!({
                        "since": kernel.since,
                        "end": kernel.end,
                        "class_type": kernel.class_type,
                        "condition": kernel.condition,
                        "source": kernel.source,
                    });
                    v["types_not_checked"] = serde_json::json!(unchecked);
                }
                Placement::Fallback { why, cpu } => {
                    v["cpu_kernel"] = (*cpu).into();
                    v["reason"] = why.kind().into();
                    v["detail"] = why.describe(self.target, &g.op, g.version).into();
                    if let Missing::Type {
                        param,
                        actual,
                        accepted,
                    } = why
                    {
                        v["param"] = param.clone().into();
                        v["actual"] = actual.clone().into();
                        v["accepted"] = serde_json::json!(accepted);
                    }
                    if let Missing::Version { registered } = why {
                        v["registered_versions"] = serde_json::json!(registered);
                    }
                }
                Placement::Unknown(why) => v["reason"] = why.clone().into(),
                Placement::Inlined => v["inlined"] = true.into(),
                Placement::Folded => {}
            }
            v
        };
        serde_json::json!({
            "target": self.target.name(),
            "provider": self.target.provider(),
            "onnxruntime": self.target.ort_version(),
            "package": self.target.package(),
            "table": self.target.table_file(),
            "all_ops_on_gpu": self.all_on_gpu(),
            "summary": self.verdict(),
            "nodes": self.nodes,
            "ntl_nodes": self.ntl_nodes,
            "opsets": self.opsets,
            "fallbacks": self.fallbacks().map(group).collect::<Vec<_>>(),
            "not_checked": self.unknown().map(group).collect::<Vec<_>>(),
            "gpu": self.groups.iter().filter(|g| matches!(g.placement, Placement::Gpu { .. })).map(group).collect::<Vec<_>>(),
            "inlined": self.groups.iter().filter(|g| matches!(g.placement, Placement::Inlined)).map(group).collect::<Vec<_>>(),
            "cpu_preferred": self.cpu_preferred,
            "nested_nodes_not_checked": self.nested_nodes,
            "notes": self.notes,
        })
    }
}

fn node_list(nodes: &[String]) -> String {
    const SHOWN: usize = 6;
    let mut s = nodes
        .iter()
        .take(SHOWN)
        .map(|n| crate::text::escape(n).into_owned())
        .collect::<Vec<_>>()
        .join(", ");
    if nodes.len() > SHOWN {
        s.push_str(&format!(", ... ({} more)", nodes.len() - SHOWN));
    }
    s
}
