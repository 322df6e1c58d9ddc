//! Generates the gRPC code for `proto/bench.proto` with the protoc that the
//! `protoc-bin-vendored` crate ships (no system protoc needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    tonic_build::compile_protos("proto/bench.proto")?;
    println!("cargo:rerun-if-changed=proto/bench.proto");
    Ok(())
}
