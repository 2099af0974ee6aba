//! The command line: [`Cli`] and its [`Command`]s on `clap` (derive), and
//! [`main`]. Each command's options and behaviour are its module's in
//! `crate::commands`; this file only names the commands and dispatches.

use crate::commands;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::process::ExitCode;

/// What `lazuli --help` says after the commands.
const AFTER_HELP: &str = "\
Environment: LAZULI_DEVICE, WGPU_BACKEND, WGPU_ADAPTER_NAME, LAZULI_KERNEL_FORMS, LAZULI_AUTOTUNE, \
LAZULI_CACHE_DIR, LAZULI_CACHE_MAX_BYTES, LAZULI_POOL_BYTES, LAZULI_DUMP_DIR, RUST_LOG and the other \
LAZULI_* variables: `lazuli info` prints each with its value and where it came from.

Compile cache: validated kernels and the driver's pipeline cache persist in LAZULI_CACHE_DIR (default \
$XDG_CACHE_HOME/lazuli or ~/.cache/lazuli; empty turns it off), bounded by LAZULI_CACHE_MAX_BYTES \
(default 256 MiB, least recently used entries go first); delete the directory to clear it.";

/// Lazuli, a lazy tensor engine on wgpu: its demo, ONNX models,
/// benchmarks, ONNX conformance, generation, trace reports and dumps.
#[derive(Debug, Parser)]
#[command(name = "lazuli", version, after_help = AFTER_HELP, propagate_version = true)]
pub struct Cli {
    /// The command to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The commands, in the order `lazuli --help` lists them.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List the wgpu adapters, the device Device::default() picks and the
    /// effective configuration (each variable's value and source).
    Info,
    /// Train on the 8x8 digits dataset (an MLP or a LeNet-style CNN), or
    /// with --fused run the small fused elementwise example.
    Demo(commands::demo::Args),
    /// Show the IR, graph hash, DOT and generated kernels of the fused
    /// example's graph.
    Dump(commands::dump::Args),
    /// Run the ONNX conformance cases and print the per-op table.
    Conformance(commands::conformance::Args),
    /// Run an ONNX model on a device: outputs' statistics, run times,
    /// kernels and fallback ops (--check lists unsupported nodes).
    Run(commands::run::Args),
    /// Run the benchmark workloads and their baselines; print a table.
    Bench(commands::bench::Args),
    /// Generate text with a language model (--model FILE: GGUF or a
    /// Hugging Face folder); without --model, the small GPT demo (a
    /// growing context beside a fixed window).
    Generate(commands::generate::Args),
    /// Summarize the steady state of a LAZULI_TRACE file.
    Trace(commands::trace::Args),
    /// Print a shell completion script (bash, zsh, fish, elvish,
    /// powershell).
    Completions(commands::completions::Args),
}

impl Command {
    /// Runs the command; the error is what `lazuli` prints before exiting
    /// with status 1.
    pub fn run(self) -> Result<(), String> {
        match self {
            Command::Info => commands::info::run(),
            Command::Demo(a) => commands::demo::run(a),
            Command::Dump(a) => commands::dump::run(a),
            Command::Conformance(a) => commands::conformance::run(a),
            Command::Run(a) => commands::run::run(a),
            Command::Bench(a) => commands::bench::run(a),
            Command::Generate(a) => commands::generate::run(a),
            Command::Trace(a) => commands::trace::run(a),
            Command::Completions(a) => commands::completions::run(a, Cli::clap_command()),
        }
    }
}

impl Cli {
    /// The clap command with every option of every command allowed more
    /// than once, the last one winning (`--size small --size full` is a
    /// full-size run), as scripts that append options expect.
    pub fn clap_command() -> clap::Command {
        fn override_self(c: clap::Command) -> clap::Command {
            c.args_override_self(true).mut_subcommands(override_self)
        }
        override_self(Cli::command())
    }

    /// Parses `args` (the first is the program name).
    pub fn try_parse_args<I, T>(args: I) -> Result<Cli, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let mut command = Cli::clap_command();
        let matches = command.try_get_matches_from_mut(args)?;
        Cli::from_arg_matches(&matches).map_err(|e| e.format(&mut command))
    }
}

/// The `lazuli` binary: parses the command line (a usage error or
/// `--help` exits through clap), sets up logging on stderr (`RUST_LOG`,
/// default `warn`) and runs the command.
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse_args(std::env::args_os()) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    init_tracing();
    match cli.command.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lazuli: {e}");
            ExitCode::FAILURE
        }
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// clap's own consistency checks over every command and option.
    #[test]
    fn the_command_line_is_consistent() {
        Cli::clap_command().debug_assert();
    }

    /// Every command has its own `--help`, and `lazuli --help` names them
    /// all.
    #[test]
    fn every_command_has_help() {
        let mut top = Cli::clap_command();
        let help = top.render_long_help().to_string();
        let names: Vec<String> = Cli::clap_command().get_subcommands().map(|c| c.get_name().to_string()).collect();
        assert_eq!(names, ["info", "demo", "dump", "conformance", "run", "bench", "generate", "trace", "completions"]);
        for name in &names {
            assert!(help.contains(&format!("  {name}")), "{name} missing from:\n{help}");
            let e = Cli::try_parse_args(["lazuli", name, "--help"]).unwrap_err();
            assert_eq!(e.kind(), clap::error::ErrorKind::DisplayHelp, "{name}");
            assert!(e.to_string().contains(&format!("Usage: lazuli {name}")), "{name}: {e}");
        }
    }

    /// Each shell's script names every command and the options of one
    /// (fish writes `-l scale`, the others `--scale`).
    #[test]
    fn completion_scripts_name_the_commands_and_their_options() {
        use clap_complete::Shell;
        for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
            let script = commands::completions::script(shell, &mut Cli::clap_command());
            for word in ["bench", "demo", "conformance", "generate", "trace", "completions", "scale", "epochs"] {
                assert!(script.contains(word), "{shell}: {word} missing");
            }
        }
    }
}
