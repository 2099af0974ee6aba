//! The `lazuli` binary: everything is in the `lazuli_cli` library
//! (`src/lib.rs` says how the crate is laid out and how to add a command).

fn main() -> std::process::ExitCode {
    lazuli_cli::main()
}
