//! With the `cuda` feature, compiles each kernel source to PTX with nvcc (found through
//! `NVCC`, `CUDA_HOME`/`CUDA_PATH`, or `PATH`) for `CUDA_COMPUTE_CAP` (default 80; mma.sync,
//! ldmatrix and cp.async need sm_80 or newer). The driver JIT-compiles the PTX for the GPU.
//! For compute capability 90 (H100/H200) it also compiles the Hopper attention kernel for
//! sm_90a (wgmma exists only there) and sets the `tpinfer_sm90` cfg.
//! `TPINFER_PTX_CHECK_CAPS` (e.g. "89") also compiles every kernel for those compute
//! capabilities into `OUT_DIR/check-sm<cap>/`, unused by the crate: `scripts/build/build-cuda.sh
//! check` assembles them, so that one build checks the PTX of several GPUs.
//! With the `timeline` feature every kernel is compiled with TPINFER_TIMELINE (cuda/chain.cuh).
use std::env;
use std::path::PathBuf;
use std::process::Command;

const SOURCES: [&str; 6] = [
    "flash_attention",
    "rowwise",
    "rotary",
    "gemv",
    "argmax",
    "peer_all_reduce",
];
/// The decode attention kernels, one module per GQA group size (DECODE_GROUP in
/// cuda/decode_attention.cu): the driver JIT-compiles a whole module at its first use, and a
/// model needs only one of them.
const DECODE_GROUPS: [usize; 4] = [1, 2, 4, 8];

fn main() {
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=TPINFER_PTX_CHECK_CAPS");
    println!("cargo::rerun-if-env-changed=NVCC");
    println!("cargo::rustc-check-cfg=cfg(tpinfer_sm90)");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap_or_else(|_| fail("OUT_DIR is not set")));
    let cap = env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let nvcc = nvcc();
    println!("cargo::rerun-if-changed=cuda/convert.cuh");
    println!("cargo::rerun-if-changed=cuda/tile.cuh");
    println!("cargo::rerun-if-changed=cuda/chain.cuh");
    println!("cargo::rerun-if-changed=cuda/rotate.cuh");
    if compile_all(&nvcc, &out_dir, &cap) {
        println!("cargo::rustc-cfg=tpinfer_sm90");
    }
    let checks = env::var("TPINFER_PTX_CHECK_CAPS").unwrap_or_default();
    for check in checks.split_whitespace() {
        let dir = out_dir.join(format!("check-sm{check}"));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| fail(&format!("cannot create {}: {e}", dir.display())));
        compile_all(&nvcc, &dir, check);
    }
}

/// Compiles every kernel for compute capability `cap` into `dir`; whether that includes the
/// Hopper (sm_90a) attention kernel.
fn compile_all(nvcc: &PathBuf, dir: &std::path::Path, cap: &str) -> bool {
    let cap = cap.trim().trim_start_matches("sm_").trim_end_matches('a');
    let arch = format!("compute_{cap}");
    for name in SOURCES {
        compile(nvcc, dir, name, name, &arch, &[]);
    }
    for group in DECODE_GROUPS {
        let define = format!("-DDECODE_GROUP={group}");
        compile(
            nvcc,
            dir,
            "decode_attention",
            &format!("decode_attention_g{group}"),
            &arch,
            &[&define],
        );
    }
    let hopper = cap == "90";
    if hopper {
        let name = "flash_attention_sm90";
        compile(nvcc, dir, name, name, "compute_90a", &[]);
    }
    hopper
}

/// Compiles cuda/{source}.cu, with the `defines` given, to {out}.ptx.
fn compile(nvcc: &PathBuf, out_dir: &std::path::Path, source: &str, out: &str, arch: &str, defines: &[&str]) {
    let source = format!("cuda/{source}.cu");
    println!("cargo::rerun-if-changed={source}");
    let ptx = out_dir.join(format!("{out}.ptx"));
    let timeline = env::var_os("CARGO_FEATURE_TIMELINE").map(|_| "-DTPINFER_TIMELINE");
    let status = Command::new(nvcc)
        .args(["--ptx", "-O3", "-std=c++17", &format!("-arch={arch}")])
        .args(defines)
        .args(timeline)
        .arg("-o")
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
