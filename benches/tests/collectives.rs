//! `tpinfer-bench collectives` on CPU rank threads: every size is checked and timed, the
//! uneven and empty row splits included.

use std::process::Command;

#[test]
fn collectives_check_and_time_every_size() {
    let run = Command::new(env!("CARGO_BIN_EXE_tpinfer-bench"))
        .args([
            "collectives",
            "--tp",
            "3",
            "--width",
            "16",
            "--rows",
            "1,5,64",
            "--calls",
            "2",
        ])
        .output()
        .expect("run tpinfer-bench");
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let table = String::from_utf8_lossy(&run.stdout);
    for rows in [1, 5, 64] {
        let row = table
            .lines()
            .find(|l| l.starts_with(&format!("| {rows} |")))
            .unwrap_or_else(|| panic!("no row for {rows} rows in\n{table}"));
        let ms: Vec<f64> = row
            .split('|')
            .skip(3)
            .filter_map(|cell| cell.split_whitespace().next()?.parse().ok())
            .collect();
        assert_eq!(ms.len(), 3, "{row}");
        assert!(ms.iter().all(|&t| t > 0.0 && t < 1e4), "{row}");
    }
}
