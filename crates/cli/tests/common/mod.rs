//! Helpers of the CLI's integration tests: whether a wgpu adapter exists
//! (CI's `LAZULI_REQUIRE_ADAPTER=1` makes a missing one a failure), and
//! how a finished process is described in a failure message.
#![allow(dead_code)] // Each test binary uses a different subset.

use std::process::Output;

/// Whether a wgpu adapter exists; without one, `LAZULI_REQUIRE_ADAPTER=1`
/// (CI) fails the test instead of letting it skip.
pub fn wgpu_adapter() -> bool {
    match lazuli_wgpu::WgpuBackend::new(Default::default()) {
        Ok(_) => true,
        Err(e) => {
            assert_ne!(std::env::var("LAZULI_REQUIRE_ADAPTER").as_deref(), Ok("1"), "no wgpu adapter: {e}");
            eprintln!("skipping: no wgpu adapter ({e})");
            false
        }
    }
}

/// A process's status, stdout and stderr.
pub fn describe(o: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
