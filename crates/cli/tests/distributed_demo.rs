//! `lazuli demo --distributed` under `mpirun` (cargo feature `mpi`; Open
//! MPI installed): `cargo test --workspace --features lazuli-cli/mpi
//! --test distributed_demo`.

mod common;
use common::describe;
use serde_json::Value;
use std::process::Command;

fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0").unwrap_or(false)
}

/// `lazuli demo --distributed`: 2 ranks with half
/// the global batch each reach one rank's accuracy, and the report has the
/// all-reduce figures; only rank 0 prints.
#[test]
fn the_demo_on_two_ranks_matches_one_rank() {
    let demo = |ranks: usize| {
        let mut c = Command::new("mpirun");
        if is_root() {
            c.arg("--allow-run-as-root");
        }
        let o = c
            .args(["--oversubscribe", "-np", &ranks.to_string(), env!("CARGO_BIN_EXE_lazuli")])
            .args(["demo", "--distributed", "--epochs", "3", "--batch", "96", "--json"])
            .env("LAZULI_DEVICE", "cpu")
            .output()
            .expect("mpirun");
        assert!(o.status.success(), "{}", describe(&o));
        let text = String::from_utf8_lossy(&o.stdout).to_string();
        let lines: Vec<&str> = text.lines().filter(|l| l.starts_with('{')).collect();
        assert_eq!(lines.len(), 1, "rank 0 alone prints:\n{text}");
        serde_json::from_str::<Value>(lines[0]).expect("JSON")
    };
    let (one, two) = (demo(1), demo(2));
    assert_eq!(one["test_accuracy"], two["test_accuracy"], "{one}\n{two}");
    assert_eq!(one["train_accuracy"], two["train_accuracy"], "{one}\n{two}");
    assert!(one["test_accuracy"].as_f64().unwrap() > 0.9, "{one}");
    let d = &two["distributed"];
    assert_eq!((d["world_size"].as_u64(), d["batch_per_rank"].as_u64()), (Some(2), Some(48)), "{two}");
    // The MLP's parameters: 64x256 + 256 + 256x10 + 10 floats.
    assert_eq!(d["allreduce_bytes_per_step"].as_u64(), Some(4 * (64 * 256 + 256 + 256 * 10 + 10)), "{two}");
    assert_eq!(two["uncached_compiles_after_step_2"].as_u64(), Some(0), "{two}");
}
