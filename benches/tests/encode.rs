//! `tpinfer-bench encode` on CPU ranks: the states it writes at each width are the unsharded
//! reference's, read back as the GPU check's `compare` reads them.

use std::process::Command;

use candle_core::{Device, Tensor};
use tpinfer_tests::{tensor_rel_error, TinyUmt5};

#[test]
fn encode_writes_each_widths_states() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tiny = TinyUmt5::default();
    tiny.write(dir.path());
    let ids: Vec<i64> = (0..12).map(|i| (i * 29 + 3) % 96).collect();
    let ids_path = dir.path().join("ids.st");
    Tensor::new(ids.as_slice(), &Device::Cpu)
        .and_then(|t| t.save_safetensors("ids", &ids_path))
        .expect("ids");
    let out = dir.path().join("t");
    let run = Command::new(env!("CARGO_BIN_EXE_tpinfer-bench"))
        .args(["encode", "--tp", "1,4", "--repeats", "1", "--model"])
        .arg(dir.path())
        .arg("--ids")
        .arg(&ids_path)
        .arg("--out")
        .arg(&out)
        .output()
        .expect("run tpinfer-bench");
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let table = String::from_utf8_lossy(&run.stdout);
    assert!(table.contains("| 4 | 12 | F32 |"), "{table}");
    let reference = tiny.reference(&ids.iter().map(|&i| i as u32).collect::<Vec<_>>());
    for tp in [1, 4] {
        let path = dir.path().join(format!("t_tp{tp}.safetensors"));
        let states = candle_core::safetensors::load(&path, &Device::Cpu).expect("states");
        let rel = tensor_rel_error(&states["states"], &reference);
        assert!(rel < 1e-5, "TP {tp}: {rel:e}");
    }
}
