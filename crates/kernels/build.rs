//! With the `cuda` feature, compiles each kernel source to PTX with nvcc (found through
//! `NVCC`, `CUDA_HOME`/`CUDA_PATH`, or `PATH`) for `CUDA_COMPUTE_CAP` (default 80; mma.sync,
//! ldmatrix and cp.async need sm_80 or newer). The driver JIT-compiles the PTX for the GPU.
//! For compute capability 90 (H100/H200) it also compiles the Hopper attention kernel for
//! sm_90a (wgmma exists only there) and sets the `tpinfer_sm90` cfg.
use std::env;
use std::path::PathBuf;
use std::process::Command;

const SOURCES: [&str; 7] = [
    "flash_attention",
    "rowwise",
    "rotary",
    "gemv",
    "decode_attention",
    "argmax",
    "peer_all_reduce",
];

fn main() {
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=NVCC");
    println!("cargo::rustc-check-cfg=cfg(tpinfer_sm90)");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap_or_else(|_| fail("OUT_DIR is not set")));
    let cap = env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let cap = cap.trim().trim_start_matches("sm_").trim_end_matches('a');
    let nvcc = nvcc();
    println!("cargo::rerun-if-changed=cuda/convert.cuh");
    println!("cargo::rerun-if-changed=cuda/tile.cuh");
    println!("cargo::rerun-if-changed=cuda/chain.cuh");
    for name in SOURCES {
        compile(&nvcc, &out_dir, name, &format!("compute_{cap}"));
    }
    if cap == "90" {
        compile(&nvcc, &out_dir, "flash_attention_sm90", "compute_90a");
        println!("cargo::rustc-cfg=tpinfer_sm90");
    }
}

fn compile(nvcc: &PathBuf, out_dir: &std::path::Path, name: &str, arch: &str) {
    let source = format!("cuda/{name}.cu");
    println!("cargo::rerun-if-changed={source}");
    let ptx = out_dir.join(format!("{name}.ptx"));
    let status = Command::new(nvcc)
        .args(["--ptx", "-O3", "-std=c++17", &format!("-arch={arch}"), "-o"])
        .arg(&ptx)
        .arg(&source)
        .status()
        .unwrap_or_else(|e| fail(&format!("cannot run {}: {e}; set NVCC or CUDA_HOME", nvcc.display())));
    if !status.success() {
        fail(&format!("nvcc failed on {source} ({status})"));
    }
}

fn nvcc() -> PathBuf {
    if let Some(path) = env::var_os("NVCC") {
        return path.into();
    }
    for home in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(dir) = env::var_os(home) {
            let path = PathBuf::from(dir).join("bin/nvcc");
            if path.exists() {
                return path;
            }
        }
    }
    "nvcc".into()
}

fn fail(message: &str) -> ! {
    eprintln!("tpinfer-kernels: {message}");
    std::process::exit(1)
}
