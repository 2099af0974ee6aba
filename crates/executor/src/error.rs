//! Executor errors ([`ExecError`]): IR errors at record time, backend errors
//! raised at barriers, and misuse of the API (wrong dtype read, mixed devices).
//!
//! An error always names the computation it is about: a backend failure
//! carries the graph hash and the sync point that submitted it; reading a
//! value whose computation failed is [`ExecError::Failed`] around that
//! failure; a computation that needs an earlier failed value is
//! [`ExecError::Poisoned`], which says so in those words. An error made
//! when an op was recorded names the user's call that recorded it
//! (`#[track_caller]` runs through the ops), and the common mistakes end
//! with the fix (the dtype to read, the move between devices).
//!
//! How an error prints, wherever a user sees it: `Display` is the whole
//! message on one line, each level of the chain once, joined by `": "`;
//! `Debug` (what `?` out of `main` prints) is the same chain as `anyhow`
//! prints it, the first level then a numbered `Caused by:` list. Since
//! `Display` already holds the causes, `Error::source` returns none (the
//! Rust API guidelines' rule: a cause is either in the message or the
//! source, never both, or a chain printer shows it twice); the causes
//! stay reachable as the variants' fields. [`write_chain`] gives the other
//! error types of the workspace the same `Debug`.

use crate::BackendError;
use lazuli_ir::{DType, IrError, Shape};
use std::fmt;
use std::panic::Location;

/// An error returned by the executor. Errors raised inside an asynchronous
/// execution are stored and returned by the next barrier on that device.
#[derive(Clone)]
pub enum ExecError {
    /// A bad shape, axis or dtype found when an op was recorded, with the
    /// call that recorded it (the user's line: the op methods are
    /// `#[track_caller]`).
    Ir {
        /// What is wrong, naming the op, shapes and dtypes.
        source: IrError,
        /// The call that recorded the op.
        location: &'static Location<'static>,
    },
    /// A backend failed while compiling or running a graph.
    Backend {
        /// What the executor was doing (e.g. "executing graph 1a2b.. (3 kernels), synced by to_vec at src/main.rs:10").
        context: String,
        /// The backend's error.
        source: BackendError,
    },
    /// A value was read with the wrong element type.
    ReadDType {
        /// The reading call (and where it is).
        op: String,
        /// The tensor's dtype.
        actual: DType,
        /// The requested dtype.
        expected: DType,
        /// The tensor's shape.
        shape: Shape,
    },
    /// Host data does not fit the requested shape.
    DataLength {
        /// The creating call (and where it is).
        op: String,
        /// Values given.
        len: usize,
        /// Shape requested.
        shape: Shape,
        /// Its element count.
        numel: usize,
    },
    /// Operands live on different devices.
    DeviceMismatch {
        /// The op (and where it was recorded).
        op: String,
        /// First device.
        a: String,
        /// Second device.
        b: String,
    },
    /// A value was read whose own computation failed; `cause` is that
    /// failure, naming the graph and the sync point that computed it.
    Failed {
        /// The reading call.
        op: String,
        /// The failure of the computation that was to produce the value.
        cause: Box<ExecError>,
    },
    /// A computation depends on a value whose computation failed earlier:
    /// it was not run. `cause` is the earlier failure, naming its own graph
    /// and sync point.
    Poisoned {
        /// The syncing or reading call (or the execution) of the dependent
        /// computation.
        op: String,
        /// The earlier failure.
        cause: Box<ExecError>,
    },
    /// Shadow validation (`LAZULI_VALIDATE=cpu`, [`crate::Device::set_validate`])
    /// found a kernel whose outputs disagree with the CPU reference backend.
    Validation {
        /// The first disagreeing kernel (or segment, for backends that do
        /// not list their kernels).
        kernel: String,
        /// Where and by how much, the kernel's IR nodes with their source
        /// locations, and its generated source.
        report: String,
    },
    /// A malformed `LAZULI_*` configuration value (see [`crate::config`]):
    /// a device created with one fails every compilation with it.
    Config(crate::config::ConfigError),
    /// A failure outside the engine met by a library helper built on it
    /// (reading or writing a file, a malformed file), kept with its cause.
    External {
        /// The helper (e.g. "serialize").
        op: String,
        /// The cause.
        source: std::sync::Arc<dyn std::error::Error + Send + Sync>,
    },
    /// A misuse of the API that is not a shape or dtype problem.
    Invalid {
        /// The call (and, where the library knows it, where it is).
        op: String,
        /// What is wrong.
        detail: String,
    },
}

impl ExecError {
    /// A record-time error of `source` at `location`, or at the entered
    /// [`crate::CallSite`] if there is one (the user's call into a library
    /// routine that recorded the op).
    pub fn ir(source: IrError, location: &'static Location<'static>) -> ExecError {
        ExecError::Ir { source, location: crate::CallSite::current().unwrap_or(location) }
    }

    /// The levels of the error chain, outermost first, each saying only
    /// its own part: what `Display` joins and `Debug` lists.
    pub fn chain(&self) -> Vec<String> {
        let mut levels = Vec::new();
        self.push_levels(&mut levels);
        levels
    }

    fn push_levels(&self, levels: &mut Vec<String>) {
        match self {
            ExecError::Ir { source, location } => levels.push(format!("{source} (at {})", short(location))),
            ExecError::Backend { context, source } => {
                levels.push(context.clone());
                levels.push(source.to_string());
            }
            ExecError::ReadDType { op, actual, expected, shape } => levels.push(format!(
                "{op}: tensor has dtype {actual} and shape {shape}, cannot read it as {expected}; read it as \
                 {actual} (to_vec::<{}>(), item::<{}>()), or cast it first (.cast(DType::{})?)",
                rust_type(*actual),
                rust_type(*actual),
                dtype_variant(*expected),
            )),
            ExecError::DataLength { op, len, shape, numel } => {
                levels.push(format!("{op}: {len} values cannot fill shape {shape} ({numel} elements)"))
            }
            ExecError::DeviceMismatch { op, a, b } => levels.push(format!(
                "{op}: operands live on different devices ({a} and {b}); move one with .to_device(&device)? \
                 (a model: ModuleExt::to_device)"
            )),
            ExecError::Failed { op, cause } => {
                levels.push(format!("{op}: computing the value failed"));
                cause.push_levels(levels);
            }
            ExecError::Poisoned { op, cause } => {
                levels.push(format!("{op}: depends on a value whose computation failed earlier"));
                cause.push_levels(levels);
            }
            ExecError::Validation { kernel, report } => {
                levels.push(format!("shadow validation: kernel {kernel} disagrees with the CPU reference\n{report}"))
            }
            ExecError::Config(e) => levels.push(e.to_string()),
            ExecError::External { op, source } => {
                levels.push(op.clone());
                push_sources(levels, source.as_ref());
            }
            ExecError::Invalid { op, detail } => levels.push(format!("{op}: {detail}")),
        }
    }
}

/// `file:line` of a location (the column adds nothing a reader needs).
fn short(location: &Location<'_>) -> String {
    format!("{}:{}", location.file(), location.line())
}

/// The Rust element type a dtype is read as.
fn rust_type(dtype: DType) -> &'static str {
    match dtype {
        DType::F16 => "half::f16",
        DType::BF16 => "half::bf16",
        other => other.name(),
    }
}

/// The `DType` variant's name (`F32`, `I64`).
fn dtype_variant(dtype: DType) -> String {
    format!("{dtype:?}")
}

/// `error` and its sources, each level once: a source whose text the level
/// above already holds (a `Display` that includes its cause) adds nothing.
fn push_sources(levels: &mut Vec<String>, error: &(dyn std::error::Error + 'static)) {
    let mut next = Some(error);
    while let Some(e) = next {
        let text = e.to_string();
        if !levels.last().is_some_and(|above| above.contains(&text)) {
            levels.push(text);
        }
        next = e.source();
    }
}

/// Writes `levels` as `anyhow` prints a chain: the first, then `Caused by:`
/// and the others numbered, continuation lines indented.
fn write_levels(f: &mut fmt::Formatter<'_>, levels: &[String]) -> fmt::Result {
    let Some((first, rest)) = levels.split_first() else { return Ok(()) };
    f.write_str(first)?;
    if rest.is_empty() {
        return Ok(());
    }
    f.write_str("\n\nCaused by:")?;
    for (i, level) in rest.iter().enumerate() {
        for (j, line) in level.lines().enumerate() {
            if j == 0 {
                write!(f, "\n{i:>5}: {line}")?;
            } else {
                write!(f, "\n       {line}")?;
            }
        }
    }
    Ok(())
}

/// `Debug` for an error type as `anyhow` prints it: its `Display`, then
/// each source not already in the text above it, under `Caused by:`.
/// Every error type of the workspace formats `Debug` this way, so `?` out
/// of `main` prints the message, never the derived struct.
pub fn write_chain(f: &mut fmt::Formatter<'_>, error: &(dyn std::error::Error + 'static)) -> fmt::Result {
    let mut levels = Vec::new();
    push_sources(&mut levels, error);
    write_levels(f, &levels)
}

impl fmt::Display for ExecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.chain().join(": "))
    }
}

impl fmt::Debug for ExecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_levels(f, &self.chain())
    }
}

/// No `source`: the message holds every cause (see the module docs).
impl std::error::Error for ExecError {}

impl From<IrError> for ExecError {
    /// An IR error at the caller's location (through `?`, the line of the
    /// `?` or of the `#[track_caller]` function's caller).
    #[track_caller]
    fn from(source: IrError) -> ExecError {
        ExecError::ir(source, Location::caller())
    }
}

impl From<crate::config::ConfigError> for ExecError {
    fn from(e: crate::config::ConfigError) -> ExecError {
        ExecError::Config(e)
    }
}

/// Result alias of the executor.
pub type Result<T, E = ExecError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_lists_each_level_once() {
        let inner = ExecError::Backend {
            context: "executing graph 00ab (3 nodes, 1 kernels), synced by to_vec at src/main.rs:9".into(),
            source: BackendError::Execution("boom".into()),
        };
        let e = ExecError::Failed { op: "to_vec at src/main.rs:9".into(), cause: Box::new(inner) };
        assert_eq!(
            e.to_string(),
            "to_vec at src/main.rs:9: computing the value failed: executing graph 00ab (3 nodes, 1 kernels), \
             synced by to_vec at src/main.rs:9: execution failed: boom"
        );
        let debug = format!("{e:?}");
        assert_eq!(
            debug,
            "to_vec at src/main.rs:9: computing the value failed\n\nCaused by:\n    0: executing graph 00ab (3 \
             nodes, 1 kernels), synced by to_vec at src/main.rs:9\n    1: execution failed: boom"
        );
        assert_eq!(debug.matches("boom").count(), 1);
        assert!(std::error::Error::source(&e).is_none(), "the causes are in the message");
    }

    #[test]
    fn a_source_repeated_in_its_parent_prints_once() {
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl fmt::Display for Outer {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "reading model.safetensors: {}", self.0)
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = ExecError::External {
            op: "load_state_dict".into(),
            source: std::sync::Arc::new(Outer(std::io::Error::other("no such file"))),
        };
        assert_eq!(e.to_string(), "load_state_dict: reading model.safetensors: no such file");
        assert_eq!(format!("{e:?}").matches("no such file").count(), 1, "{e:?}");
    }

    #[test]
    fn wrong_read_type_says_what_to_read() {
        let e = ExecError::ReadDType {
            op: "to_vec at src/main.rs:3".into(),
            actual: DType::I32,
            expected: DType::I64,
            shape: Shape::from([4]),
        };
        let text = e.to_string();
        assert!(text.contains("to_vec::<i32>()") && text.contains(".cast(DType::I64)"), "{text}");
    }
}
