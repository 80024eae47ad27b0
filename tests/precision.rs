//! `step --precision`: the ops kept in float32 for want of a GPU kernel in the half type
//! (`precision::NO_GPU_FLOAT16` / `NO_GPU_BFLOAT16`), derived here from the kernel tables for
//! every ONNX operator (not only those the fixtures use) and checked equal, so the precision
//! pass never puts a node in float16/bfloat16 where `inspect --target cuda|rocm` would send it
//! to the CPU, and keeps nothing in float32 that a GPU could run in half.

use std::collections::BTreeSet;

use ntl_ops::schema::{tsv_rows, SCHEMA_TABLE};
use ntl_patch::passes::step::precision::{
    no_gpu_kernel, BFLOAT16, FLOAT16, FLOAT32_OPS, NO_GPU_BFLOAT16, NO_GPU_FLOAT16,
};
use ntl_patch::tools::gpu_kernels::{tables_for, Target};

/// Default-domain ops that have a float32 kernel but no `half` one on CUDA or ROCm at some opset
/// 13–21 (the kernel's constraint on the type parameter of the op's first output).
fn missing_half_kernels(half: &str) -> BTreeSet<String> {
    let ops: BTreeSet<String> = tsv_rows(SCHEMA_TABLE, "domain\t", 7, "schema")
        .map(|r| r.expect("schema rows"))
        .filter(|(_, f)| f[0] == "ai.onnx")
        .map(|(_, f)| f[1].to_string())
        .collect();
    let mut missing = BTreeSet::new();
    for op in ops {
        for target in [Target::Cuda, Target::Rocm] {
            let t = tables_for(target);
            for opset in 13..=21 {
                let Some(schema) = t.schema("ai.onnx", &op, opset) else {
                    continue;
                };
                let Some(out) = schema.outputs.first() else {
                    continue;
                };
                let kernels: Vec<_> = t
                    .kernels(target.ep(), "ai.onnx", &op)
                    .iter()
                    .filter(|k| k.serves_version(schema.since))
                    .collect();
                let accepts = |ty: &str| {
                    kernels.iter().any(|k| {
                        let c = k.constraints.iter().find(|(p, _)| *p == out.type_str);
                        c.is_none_or(|(_, a)| a.as_ref().is_none_or(|a| a.iter().any(|x| x == ty)))
                    })
                };
                if accepts("float") && !accepts(half) {
                    missing.insert(op.clone());
                }
            }
        }
    }
    missing
}

#[test]
fn ops_without_a_gpu_half_kernel_compute_in_float32() {
    for (half, name, listed) in [
        (FLOAT16, "float16", NO_GPU_FLOAT16),
        (BFLOAT16, "bfloat16", NO_GPU_BFLOAT16),
    ] {
        // the float32 ops never compute in half: listing them changes nothing
        let want: BTreeSet<String> = missing_half_kernels(name)
            .into_iter()
            .filter(|op| !FLOAT32_OPS.contains(&op.as_str()))
            .collect();
        let got: BTreeSet<String> = listed.iter().map(|s| s.to_string()).collect();
        assert_eq!(got, want, "{name}: the list differs from the kernel tables");
        assert!(want.iter().all(|op| no_gpu_kernel(op, half)));
    }
}
