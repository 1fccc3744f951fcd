//! With the `cuda` feature, compiles each kernel source with nvcc (found through `NVCC`,
//! `CUDA_HOME`/`CUDA_PATH`, or `PATH`) into a fatbin: machine code (SASS) for compute
//! capability `CUDA_COMPUTE_CAP` (default 80; mma.sync, ldmatrix and cp.async need sm_80 or
//! newer) and for each of `TPINFER_CUDA_SASS` (default "89 90": the RTX 4090 and the
//! H100/H200), so that those GPUs load the kernels without compiling them; and PTX for
//! `CUDA_COMPUTE_CAP`, which the driver compiles at first use on any other (newer) GPU.
//! When 90 is among them it also compiles the Hopper attention kernel for sm_90a (wgmma exists
//! only there) and sets the `tpinfer_sm90` cfg; with 89 among them, the `tpinfer_sm89` cfg (the
//! FP8 mma.sync attention kernel runs from that SASS alone). `TPINFER_CUDA_TARGETS` tells the crate what
//! was built, for its error when a GPU has no code.
//! With the `timeline` feature every kernel is compiled with TPINFER_TIMELINE (cuda/chain.cuh).
use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const SOURCES: [&str; 11] = [
    "attention_fp8",
    "flash_attention",
    "fp8",
    "paged",
    "rowwise",
    "rotary",
    "gemv",
    "argmax",
    "peer_all_reduce",
    "sample",
    "hold",
];
/// The decode attention kernels, one module per GQA group size (DECODE_GROUP in
/// cuda/decode_attention.cu): a model loads only the one it needs.
const DECODE_GROUPS: [usize; 4] = [1, 2, 4, 8];

fn main() {
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=TPINFER_CUDA_SASS");
    println!("cargo::rerun-if-env-changed=NVCC");
    println!("cargo::rustc-check-cfg=cfg(tpinfer_sm90)");
    println!("cargo::rustc-check-cfg=cfg(tpinfer_sm89)");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap_or_else(|_| fail("OUT_DIR is not set")));
    let ptx_cap = cap(&env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into()));
    let mut sass = vec![ptx_cap.clone()];
    for c in env::var("TPINFER_CUDA_SASS")
        .unwrap_or_else(|_| "89 90".into())
        .split_whitespace()
    {
        let c = cap(c);
        if !sass.contains(&c) {
            sass.push(c);
        }
    }
    let mut gencode: Vec<String> = sass.iter().map(|c| format!("arch=compute_{c},code=sm_{c}")).collect();
    gencode.push(format!("arch=compute_{ptx_cap},code=compute_{ptx_cap}"));
    println!(
        "cargo::rustc-env=TPINFER_CUDA_TARGETS=SASS for {}, PTX for compute_{ptx_cap}",
        sass.iter().map(|c| format!("sm_{c}")).collect::<Vec<_>>().join(", ")
    );
    let nvcc = nvcc();
    println!("cargo::rerun-if-changed=cuda/best.cuh");
    println!("cargo::rerun-if-changed=cuda/convert.cuh");
    println!("cargo::rerun-if-changed=cuda/tile.cuh");
    println!("cargo::rerun-if-changed=cuda/fp8_attention.cuh");
    println!("cargo::rerun-if-changed=cuda/chain.cuh");
    println!("cargo::rerun-if-changed=cuda/rotate.cuh");
    for name in SOURCES {
        compile(&nvcc, &out_dir, name, name, &gencode, &[]);
    }
    for group in DECODE_GROUPS {
        let define = format!("-DDECODE_GROUP={group}");
        let out = format!("decode_attention_g{group}");
        compile(&nvcc, &out_dir, "decode_attention", &out, &gencode, &[&define]);
    }
    if sass.iter().any(|c| c == "89") {
        println!("cargo::rustc-cfg=tpinfer_sm89");
    }
    if sass.iter().any(|c| c == "90") {
        let name = "flash_attention_sm90";
        compile(
            &nvcc,
            &out_dir,
            name,
            name,
            &["arch=compute_90a,code=sm_90a".into()],
            &[],
        );
        println!("cargo::rustc-cfg=tpinfer_sm90");
    }
}

/// A compute capability as nvcc spells it: "90" from "90", "sm_90" or "9.0".
fn cap(text: &str) -> String {
    let c = text
        .trim()
        .trim_start_matches("sm_")
        .trim_start_matches("compute_")
        .replace('.', "");
    if c.is_empty() || !c.chars().all(|ch| ch.is_ascii_digit()) {
        fail(&format!(
            "\"{text}\" is not a compute capability (CUDA_COMPUTE_CAP, TPINFER_CUDA_SASS): write 89 or 90"
        ));
    }
    c
}

/// Compiles cuda/{source}.cu, with the `defines` given, to {out}.fatbin for each of `gencode`.
fn compile(nvcc: &Path, out_dir: &Path, source: &str, out: &str, gencode: &[String], defines: &[&str]) {
    let source = format!("cuda/{source}.cu");
    println!("cargo::rerun-if-changed={source}");
    let fatbin = out_dir.join(format!("{out}.fatbin"));
    let timeline = env::var_os("CARGO_FEATURE_TIMELINE").map(|_| "-DTPINFER_TIMELINE");
    let status = Command::new(nvcc)
        .args(["--fatbin", "-O3", "-std=c++17", "--threads", "0"])
        .args(gencode.iter().flat_map(|g| ["-gencode", g]))
        .args(defines)
        .args(timeline)
        .arg("-o")
        .arg(&fatbin)
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
