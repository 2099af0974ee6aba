//! The `lazuli` binary as a process: `lazuli info`'s configuration report
//! and its errors (a malformed `LAZULI_*` value names the variable), no
//! Wayland noise on a headless machine, and the persistent compile cache
//! across two processes.

use lazuli_executor::config;
use std::process::{Command, Output};

mod common;
use common::wgpu_adapter;

/// Runs `lazuli info` with the `LAZULI_*` variables of this process
/// removed and `vars` set.
fn lazuli_info(vars: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lazuli"));
    cmd.arg("info");
    for name in config::process_names() {
        cmd.env_remove(name);
    }
    // No disk cache: the test must not write outside the target folder.
    cmd.env("LAZULI_CACHE_DIR", "");
    cmd.envs(vars.iter().copied());
    cmd.output().expect("running the lazuli binary")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn a_malformed_flag_fails_the_cli_naming_the_variable() {
    let out = lazuli_info(&[("LAZULI_AUTOTUNE", "maybe"), ("LAZULI_DEVICE", "cpu")]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(!out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stderr.contains("LAZULI_AUTOTUNE=\"maybe\" is not valid: expected 1, 0, true, false, on or off"),
        "stderr:\n{stderr}"
    );
}

#[test]
fn a_malformed_byte_count_fails_the_cli_naming_the_variable() {
    let out = lazuli_info(&[("LAZULI_POOL_BYTES", "lots")]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(!out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stderr.contains("LAZULI_POOL_BYTES=\"lots\" is not valid: expected a byte count"), "stderr:\n{stderr}");
    assert!(stdout.contains("error: configuration: LAZULI_POOL_BYTES"), "the report shows it too:\n{stdout}");
}

#[test]
fn info_prints_each_variable_with_its_source_and_unknown_names() {
    let out = lazuli_info(&[("LAZULI_DEVICE", "cpu"), ("LAZULI_FINITE_MATH", "on"), ("LAZULI_AUTOTUN", "1")]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let row = |name: &str| {
        stdout
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name}:\n{stdout}"))
    };
    assert!(row("LAZULI_DEVICE").ends_with("= cpu [environment]"), "{stdout}");
    assert!(row("LAZULI_FINITE_MATH").ends_with("= on [environment]"), "{stdout}");
    assert!(row("LAZULI_COMPILE_CACHE_SIZE").ends_with("= 1024 [default]"), "{stdout}");
    assert!(row("LAZULI_CACHE_DIR").ends_with("[environment]"), "{stdout}");
    assert!(row("LAZULI_CPU_MEMORY_BYTES").ends_with("[default]"), "{stdout}");
    let library = config::VARS.iter().filter(|v| v.scope == config::Scope::Library);
    for v in library {
        row(v.name);
    }
    assert!(stdout.contains("unknown variable LAZULI_AUTOTUN (did you mean LAZULI_AUTOTUNE?)"), "{stdout}");
    assert!(stderr.contains("unknown configuration variable LAZULI_AUTOTUN"), "warned at device creation:\n{stderr}");
}

/// Library use prints nothing about Wayland on a headless machine: with
/// XDG_RUNTIME_DIR unset, opening the wgpu device used to print libwayland's
/// "error: XDG_RUNTIME_DIR is invalid or not set" twice per instance.
#[test]
fn opening_wgpu_without_xdg_runtime_dir_prints_nothing_about_it() {
    if !wgpu_adapter() {
        return;
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lazuli"))
        .arg("info")
        // The adapter even where it is a software one (lavapipe): opening
        // it is what this checks.
        .env("LAZULI_DEVICE", "wgpu")
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("WAYLAND_DISPLAY")
        .env_remove("WAYLAND_SOCKET")
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("default device: wgpu"), "{stdout}");
    assert!(!stderr.contains("XDG_RUNTIME_DIR"), "{stderr}");
    let bad =
        std::process::Command::new(env!("CARGO_BIN_EXE_lazuli")).args(["demo", "--model", "rnn"]).output().unwrap();
    assert!(!bad.status.success());
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(stderr.contains("'rnn'") && stderr.contains("[possible values: mlp, cnn]"), "{stderr}");
}

#[test]
fn a_second_process_on_the_same_cache_validates_nothing() {
    if !wgpu_adapter() {
        return;
    }
    let d = std::env::temp_dir().join(format!("lazuli-disk-cache-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    let run = || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_lazuli"))
            .args(["demo", "--fused", "--device", "wgpu"])
            .env("LAZULI_CACHE_DIR", &d)
            .output()
            .expect("the lazuli binary runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let counted = |text: &str, name: &str| text.lines().any(|l| l.split_whitespace().next() == Some(name));
    let first = run();
    assert!(counted(&first, "NagaValidations"), "the first process validates:\n{first}");
    assert!(counted(&first, "DiskCacheWrite"), "the first process writes:\n{first}");
    let second = run();
    assert!(!counted(&second, "NagaValidations"), "the second process validated again:\n{second}");
    assert!(counted(&second, "DiskCacheHit"), "the second process had no hits:\n{second}");
    assert!(!counted(&second, "DiskCacheBad"));
    let _ = std::fs::remove_dir_all(&d);
}
