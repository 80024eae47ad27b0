//! Generates the ONNX protobuf types from the vendored `proto/onnx.proto` with pure-Rust tools
//! (protox parses, prost-build emits), so no system `protoc` is needed.
fn main() {
    println!("cargo:rerun-if-changed=proto/onnx.proto");
    let descriptors = protox::compile(["proto/onnx.proto"], ["proto"]).expect("parse onnx.proto");
    prost_build::Config::new()
        .bytes(["."])
        .compile_fds(descriptors)
        .expect("generate ONNX types");
}
