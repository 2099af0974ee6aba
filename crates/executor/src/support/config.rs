//! Configuration from the environment: one table of every `LAZULI_*`
//! variable ([`VARS`]: name, kind, default, what it does, what reads it),
//! typed parsers with one spelling of a boolean, and the report of the
//! effective configuration that `lazuli info` prints.
//!
//! Every library read of a `LAZULI_*` variable goes through this module,
//! and options types take their environment fallbacks from it in one place
//! each (`WgpuOptions`, `CpuOptions`, the executor's `DeviceSettings`).
//! A malformed value is a [`ConfigError`] naming the variable, the value
//! and what was expected, never a silent default: [`crate::Device::new`]
//! checks every library variable ([`check`]) and a device created with a
//! malformed one fails each compilation with [`crate::ExecError::Config`];
//! `WgpuBackend::new` and `CpuBackend::try_with_options` fail with
//! `BackendError::Config`.
//!
//! Parsing takes a lookup function (`&dyn Fn(&str) -> Option<String>`), so
//! it is tested without touching the process environment; [`process`] is
//! the lookup that reads it. An empty value counts as unset, except for
//! `LAZULI_CACHE_DIR`, where empty turns the disk cache off. The executor
//! is the lowest crate that reads the environment: `lazuli-ir` never does.
//!
//! Rejected alternative: a global configuration struct parsed once. The
//! options types are the single home of each setting (code may set every
//! one of them), so this module only parses and reports; each options type
//! applies the fallbacks it owns.

use std::fmt;
use std::path::PathBuf;

/// What values a variable takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A boolean: exactly `1`, `0`, `true`, `false`, `on` or `off`, in any
    /// case ([`parse_flag`]).
    Flag,
    /// A byte count: a decimal integer ([`parse_bytes`]).
    Bytes,
    /// A positive integer ([`parse_count`]).
    Count,
    /// One of the listed words, in any case ([`parse_choice`]).
    Choice(&'static [&'static str]),
    /// A directory or file path (any value).
    Path,
    /// Free text (any value).
    Text,
}

/// Who reads a variable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// The library, at run time: checked by [`check`] and reported.
    Library,
    /// The test harness only (known, so not reported as unknown).
    Test,
    /// The build script, at compile time.
    Build,
}

/// One registered variable.
#[derive(Clone, Copy, Debug)]
pub struct Var {
    /// The variable's name.
    pub name: &'static str,
    /// Its kind of value.
    pub kind: Kind,
    /// The effective value when it is unset, in words.
    pub default: &'static str,
    /// What it does, in one line.
    pub doc: &'static str,
    /// What reads it.
    pub read_by: &'static str,
    /// Library, test harness or build.
    pub scope: Scope,
}

const fn var(name: &'static str, kind: Kind, default: &'static str, doc: &'static str, read_by: &'static str) -> Var {
    Var { name, kind, default, doc, read_by, scope: Scope::Library }
}

const fn test_var(name: &'static str, kind: Kind, doc: &'static str) -> Var {
    Var { name, kind, default: "off", doc, read_by: "the test suite", scope: Scope::Test }
}

/// Every `LAZULI_*` variable, library ones first.
pub const VARS: &[Var] = &[
    var(
        "LAZULI_DEVICE",
        Kind::Choice(&["cpu", "wgpu"]),
        "wgpu if an adapter exists, else cpu",
        "the backend Device::default() picks",
        "lazuli (Device::default)",
    ),
    var(
        "LAZULI_KERNEL_FORMS",
        Kind::Choice(&["gpu", "software"]),
        "by adapter type",
        "the kernel-form profile of the wgpu backend",
        "lazuli-wgpu (WgpuOptions::kernel_forms)",
    ),
    var(
        "LAZULI_AUTOTUNE",
        Kind::Flag,
        "on for GPUs, off for software adapters",
        "time candidate kernel forms the first time a kernel is seen",
        "lazuli-wgpu (WgpuOptions::autotune)",
    ),
    var(
        "LAZULI_AUTOTUNE_MIN_FLOPS",
        Kind::Count,
        "2147483648 (a 1024-cubed product)",
        "least work (2 M N K) of a matmul the tuner times",
        "lazuli-wgpu (WgpuOptions::autotune_min_flops)",
    ),
    var(
        "LAZULI_CACHE_DIR",
        Kind::Path,
        "$XDG_CACHE_HOME/lazuli, else ~/.cache/lazuli",
        "where autotuning results and the compile cache persist (empty: nowhere)",
        "lazuli-wgpu (WgpuOptions::cache_dir)",
    ),
    var(
        "LAZULI_CACHE_MAX_BYTES",
        Kind::Bytes,
        "268435456 (256 MiB)",
        "bound of the persistent compile cache, in bytes on disk",
        "lazuli-wgpu (WgpuOptions::cache_max_bytes)",
    ),
    var(
        "LAZULI_POOL_BYTES",
        Kind::Bytes,
        "by adapter (256 MiB on a software adapter)",
        "most bytes of freed buffers the wgpu buffer pool keeps",
        "lazuli-wgpu (WgpuOptions::pool_max_free_bytes)",
    ),
    var(
        "LAZULI_DEVICE_MEMORY_BYTES",
        Kind::Bytes,
        "no cap but the device's",
        "most bytes of device buffers the wgpu backend holds at once",
        "lazuli-wgpu (WgpuOptions::memory_budget)",
    ),
    var(
        "LAZULI_INLINE_REDUCTIONS",
        Kind::Flag,
        "on",
        "reductions of at most 64 elements per output run as loops inside the kernel that reads them",
        "lazuli-wgpu (WgpuOptions::inline_reductions)",
    ),
    var(
        "LAZULI_MULTI_TENSOR",
        Kind::Flag,
        "on",
        "independent elementwise kernels share one multi-tensor dispatch",
        "lazuli-wgpu (WgpuOptions::multi_tensor)",
    ),
    var(
        "LAZULI_OVERLAP_SUBMIT",
        Kind::Flag,
        "on",
        "an execution returns once submitted and the one before it finished (the next is encoded meanwhile)",
        "lazuli-wgpu (WgpuOptions::overlap_submit)",
    ),
    var(
        "LAZULI_STREAM_SUBMIT",
        Kind::Flag,
        "on",
        "an execution of over 16 launches started with the GPU idle is submitted 8, 16, 32, ... launches at a time as it is encoded",
        "lazuli-wgpu (WgpuOptions::stream_submit)",
    ),
    var(
        "LAZULI_SUBGROUPS",
        Kind::Flag,
        "on where the adapter has subgroups",
        "row kernels combine lanes with subgroup operations (off: workgroup-memory trees)",
        "lazuli-wgpu (WgpuOptions::subgroups)",
    ),
    var(
        "LAZULI_GENERIC_SIZES",
        Kind::Flag,
        "on",
        "graphs that differ only in sizes share generic pipelines",
        "lazuli-wgpu (WgpuOptions::generic_sizes)",
    ),
    var(
        "LAZULI_TRUSTED_SHADERS",
        Kind::Flag,
        "on (never on wasm32)",
        "kernels proven in bounds (the tiled matmul) get shader modules without runtime checks",
        "lazuli-wgpu (WgpuOptions::trusted_shaders)",
    ),
    var(
        "LAZULI_SPECIALIZE_AFTER",
        Kind::Count,
        "32 on GPUs, never on software adapters",
        "executions of a plan generic over sizes after which its kernels are compiled static in the background",
        "lazuli-wgpu (WgpuOptions::specialize_after)",
    ),
    var(
        "LAZULI_COMPILE_THREADS",
        Kind::Count,
        "the machine's cores, at most 8",
        "threads creating the pipelines of one plan and lowering a size variant's kernels",
        "lazuli-wgpu (WgpuOptions::compile_threads)",
    ),
    var(
        "LAZULI_F16_PACKED",
        Kind::Flag,
        "off on GPUs with SHADER_F16, on for software adapters",
        "store f16 tensors packed two per u32 (1) or as array<f16> where the adapter has SHADER_F16 (0)",
        "lazuli-wgpu (WgpuOptions::f16_packed)",
    ),
    var(
        "LAZULI_COOPERATIVE_MATRIX",
        Kind::Flag,
        "on where the adapter runs them (f16 A/B, f32 C, 16x16x16, subgroups of 32)",
        "f16 products on tensor cores through cooperative matrices",
        "lazuli-wgpu (WgpuOptions::cooperative_matrix)",
    ),
    var(
        "LAZULI_WGSL_LOG_DIR",
        Kind::Path,
        "off",
        "write every generated WGSL source there (tests/naga_log.rs checks them)",
        "lazuli-wgpu (validate)",
    ),
    var(
        "LAZULI_CPU_MEMORY_BYTES",
        Kind::Bytes,
        "physical memory plus swap",
        "most bytes of live tensor storage on the CPU backend",
        "lazuli-cpu (CpuOptions::memory_budget)",
    ),
    var(
        "LAZULI_CPU_THREADS",
        Kind::Count,
        "the host's cores",
        "most threads the CPU backend's kernels (fused loops, GEMM, reductions) run on",
        "lazuli-cpu (CpuOptions::threads)",
    ),
    var(
        "LAZULI_CPU_Q8_ACTIVATIONS",
        Kind::Flag,
        "on",
        "quantized matrix-vector products round the activations to 8 bits and multiply integers, as llama.cpp (0: exact f32)",
        "lazuli-cpu (quant)",
    ),
    var(
        "LAZULI_MAX_GRAPH_NODES",
        Kind::Count,
        "4096",
        "pending nodes after which recording syncs",
        "lazuli-executor (tensor)",
    ),
    var(
        "LAZULI_WARNINGS",
        Kind::Flag,
        "on",
        "print the engine's warnings (a loop without mark_step ...) to stderr when no tracing subscriber is set",
        "lazuli-executor (warn)",
    ),
    var(
        "LAZULI_FINITE_MATH",
        Kind::Flag,
        "off",
        "rewrites exact only for finite values (x*0 -> 0)",
        "lazuli-executor (optimize)",
    ),
    var(
        "LAZULI_VALIDATE",
        Kind::Choice(&["cpu", "off"]),
        "off",
        "shadow-validate every kernel against the CPU backend",
        "lazuli-executor (DeviceSettings::validate)",
    ),
    var(
        "LAZULI_COMPILE_CACHE_SIZE",
        Kind::Count,
        "1024",
        "compiled plans a device keeps",
        "lazuli-executor (DeviceSettings::compile_cache_size)",
    ),
    var(
        "LAZULI_FORCE_FALLBACK",
        Kind::Text,
        "none",
        "comma-separated op names run on the CPU fallback",
        "lazuli-executor (DeviceSettings::force_fallback)",
    ),
    var(
        "LAZULI_COMPILE_AHEAD",
        Kind::Flag,
        "on where kernels run on a GPU",
        "compile the next size of a structure whose sizes keep one step on a thread of its own",
        "lazuli-executor (DeviceSettings::compile_ahead)",
    ),
    var(
        "LAZULI_DUMP_DIR",
        Kind::Path,
        "off",
        "write every compiled graph and plan there",
        "lazuli-executor (DeviceSettings::dump_dir)",
    ),
    var(
        "LAZULI_TRACE",
        Kind::Path,
        "off",
        "write a Chrome-trace timeline of host spans and GPU kernels there",
        "lazuli-executor (timeline)",
    ),
    var(
        "LAZULI_CONFORMANCE_DIR",
        Kind::Path,
        "../shared/conformance/onnx beside the repository",
        "the ONNX conformance cases",
        "lazuli (onnx::runner)",
    ),
    var(
        "LAZULI_DIST_TIMEOUT_SECS",
        Kind::Count,
        "300",
        "seconds a rank waits in one collective before it fails with a timeout",
        "lazuli-distributed (DistOptions::resolve)",
    ),
    var(
        "LAZULI_DIST_BUCKET_BYTES",
        Kind::Bytes,
        "26214400 (25 MiB)",
        "gradient bytes per all-reduce bucket of data-parallel training",
        "lazuli-distributed (DistOptions::resolve)",
    ),
    test_var("LAZULI_REQUIRE_ADAPTER", Kind::Flag, "wgpu tests fail instead of skipping without an adapter"),
    test_var("LAZULI_HEAVY", Kind::Flag, "run the heavy tests"),
    test_var("LAZULI_FUZZ_CASES", Kind::Count, "cases per fuzz test"),
    test_var("LAZULI_BLESS", Kind::Flag, "rewrite the golden files"),
    test_var("LAZULI_NAGA_LOG_CHECK", Kind::Flag, "check the WGSL sources logged by LAZULI_WGSL_LOG_DIR"),
    Var {
        name: "LAZULI_BUILD_ID",
        kind: Kind::Text,
        default: "a hash of the backend's sources",
        doc: "identity of the build, salting the persistent caches (set at compile time)",
        read_by: "lazuli-wgpu build.rs",
        scope: Scope::Build,
    },
];

/// The registered variable `name`, if any.
pub fn lookup_var(name: &str) -> Option<&'static Var> {
    VARS.iter().find(|v| v.name == name)
}

/// A malformed configuration value.
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
#[error("configuration: {variable}={value:?} is not valid: expected {expected}")]
pub struct ConfigError {
    /// The variable.
    pub variable: String,
    /// Its value.
    pub value: String,
    /// What it takes, in words.
    pub expected: String,
}

impl std::fmt::Debug for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        crate::error::write_chain(f, self)
    }
}

impl ConfigError {
    fn new(variable: &str, value: &str, expected: impl Into<String>) -> ConfigError {
        ConfigError { variable: variable.to_string(), value: value.to_string(), expected: expected.into() }
    }
}

/// The one spelling of a boolean: `1`, `0`, `true`, `false`, `on` or
/// `off`, in any case, surrounding spaces ignored.
pub fn parse_flag(variable: &str, raw: &str) -> Result<bool, ConfigError> {
    match raw.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" => Ok(true),
        "0" | "false" | "off" => Ok(false),
        _ => Err(ConfigError::new(variable, raw, "1, 0, true, false, on or off")),
    }
}

/// A byte count: a decimal integer, surrounding spaces ignored (no unit
/// suffix).
pub fn parse_bytes(variable: &str, raw: &str) -> Result<u64, ConfigError> {
    raw.trim().parse::<u64>().map_err(|_| ConfigError::new(variable, raw, "a byte count (a decimal integer)"))
}

/// A positive integer, surrounding spaces ignored.
pub fn parse_count(variable: &str, raw: &str) -> Result<usize, ConfigError> {
    match raw.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(ConfigError::new(variable, raw, "a positive integer")),
    }
}

/// One of `choices` (in any case, surrounding spaces ignored), as spelled
/// in `choices`.
pub fn parse_choice(variable: &str, raw: &str, choices: &[&'static str]) -> Result<&'static str, ConfigError> {
    let value = raw.trim();
    choices
        .iter()
        .find(|c| c.eq_ignore_ascii_case(value))
        .copied()
        .ok_or_else(|| ConfigError::new(variable, raw, format!("one of {}", choices.join(", "))))
}

/// The lookup of the process environment: the value of `name`, `None`
/// when unset (a value that is not Unicode is taken lossily, so that it
/// fails to parse rather than counting as unset).
pub fn process(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
}

/// A lookup function: the value of a variable, `None` when unset.
pub type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The set value of `name` from `lookup`; empty counts as unset.
fn raw(lookup: Lookup<'_>, name: &str) -> Option<String> {
    debug_assert!(lookup_var(name).is_some(), "{name} is not in config::VARS");
    lookup(name).filter(|v| !v.trim().is_empty())
}

/// Flag `name` from `lookup` (`None`: unset).
pub fn flag(lookup: Lookup<'_>, name: &str) -> Result<Option<bool>, ConfigError> {
    raw(lookup, name).map(|v| parse_flag(name, &v)).transpose()
}

/// Byte count `name` from `lookup` (`None`: unset).
pub fn bytes(lookup: Lookup<'_>, name: &str) -> Result<Option<u64>, ConfigError> {
    raw(lookup, name).map(|v| parse_bytes(name, &v)).transpose()
}

/// Positive count `name` from `lookup` (`None`: unset).
pub fn count(lookup: Lookup<'_>, name: &str) -> Result<Option<usize>, ConfigError> {
    raw(lookup, name).map(|v| parse_count(name, &v)).transpose()
}

/// Choice `name` from `lookup`, as spelled in its table entry (`None`:
/// unset).
pub fn choice(lookup: Lookup<'_>, name: &str) -> Result<Option<&'static str>, ConfigError> {
    let Some(Var { kind: Kind::Choice(choices), .. }) = lookup_var(name) else {
        debug_assert!(false, "{name} is not a choice variable");
        return Ok(None);
    };
    raw(lookup, name).map(|v| parse_choice(name, &v, choices)).transpose()
}

/// Path `name` from `lookup` (`None`: unset or empty).
pub fn path(lookup: Lookup<'_>, name: &str) -> Option<PathBuf> {
    raw(lookup, name).map(PathBuf::from)
}

/// The variables whose empty value means "off" rather than unset.
const EMPTY_MEANS_OFF: &[&str] = &["LAZULI_CACHE_DIR"];

/// Directory `name` from `lookup` where an empty value means "none":
/// `None` when unset, `Some(None)` when empty, else the path.
pub fn dir_or_off(lookup: Lookup<'_>, name: &str) -> Option<Option<PathBuf>> {
    debug_assert!(EMPTY_MEANS_OFF.contains(&name), "{name} is not a variable whose empty value means off");
    lookup(name).map(|v| (!v.is_empty()).then(|| PathBuf::from(v)))
}

/// Text `name` from `lookup` (`None`: unset or empty).
pub fn text(lookup: Lookup<'_>, name: &str) -> Option<String> {
    raw(lookup, name)
}

/// Checks every library variable set in `lookup` against its kind; the
/// first malformed one is the error.
pub fn check(lookup: Lookup<'_>) -> Result<(), ConfigError> {
    VARS.iter().filter(|v| v.scope == Scope::Library).try_for_each(|v| check_var(lookup, v))
}

fn check_var(lookup: Lookup<'_>, v: &Var) -> Result<(), ConfigError> {
    match v.kind {
        Kind::Flag => flag(lookup, v.name).map(drop),
        Kind::Bytes => bytes(lookup, v.name).map(drop),
        Kind::Count => count(lookup, v.name).map(drop),
        Kind::Choice(_) => choice(lookup, v.name).map(drop),
        Kind::Path | Kind::Text => Ok(()),
    }
}

/// The `LAZULI_*` names among `names` that are not registered, each with
/// the closest registered name when one is near (a likely typo).
pub fn unknown(names: impl IntoIterator<Item = String>) -> Vec<(String, Option<&'static str>)> {
    let mut out: Vec<_> = names
        .into_iter()
        .filter(|n| n.starts_with("LAZULI_") && lookup_var(n).is_none())
        .map(|n| {
            let near = VARS.iter().map(|v| (distance(&n, v.name), v.name)).min().filter(|(d, _)| *d <= 3);
            (n, near.map(|(_, name)| name))
        })
        .collect();
    out.sort();
    out
}

/// The `LAZULI_*` names set in the process environment.
pub fn process_names() -> Vec<String> {
    crate::platform::env_names().into_iter().filter(|k| k.starts_with("LAZULI_")).collect()
}

/// Warns (once per process) about every unknown `LAZULI_*` variable in the
/// process environment.
pub(crate) fn warn_unknown_once() {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        for (name, near) in unknown(process_names()) {
            match near {
                Some(near) => tracing::warn!("unknown configuration variable {name} (did you mean {near}?)"),
                None => tracing::warn!("unknown configuration variable {name}"),
            }
        }
    });
}

/// Edit distance between two names (Levenshtein, on bytes).
fn distance(a: &str, b: &str) -> usize {
    let b = b.as_bytes();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.bytes().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let next = (diag + usize::from(ca != cb)).min(row[j] + 1).min(row[j + 1] + 1);
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// Where an effective value came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The documented default (the variable is unset and code left the
    /// option unset).
    Default,
    /// The environment variable.
    Environment,
    /// A program's options (code wins over the environment).
    Code,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Source::Default => "default",
            Source::Environment => "environment",
            Source::Code => "code",
        })
    }
}

impl Source {
    /// `Code` when code set the option, else `Environment` when the
    /// variable gave it, else `Default`.
    pub fn of(code: bool, environment: bool) -> Source {
        match (code, environment) {
            (true, _) => Source::Code,
            (false, true) => Source::Environment,
            (false, false) => Source::Default,
        }
    }
}

/// One effective setting: a variable, the value in effect and its source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting {
    /// The variable that configures it.
    pub variable: &'static str,
    /// The value in effect, in words.
    pub value: String,
    /// Where it came from.
    pub source: Source,
}

impl Setting {
    /// A setting of `variable`.
    pub fn new(variable: &'static str, value: impl fmt::Display, source: Source) -> Setting {
        debug_assert!(lookup_var(variable).is_some(), "{variable} is not in config::VARS");
        Setting { variable, value: value.to_string(), source }
    }
}

/// The effective configuration: one row per library variable (and per
/// test or build variable that is set), the malformed values and the
/// unknown names. Built by [`report`] from the environment and refined by
/// the effective values a device and its backends report
/// ([`Report::apply`]); `lazuli info` prints it.
#[derive(Clone, Debug)]
pub struct Report {
    /// Every row, in table order.
    pub settings: Vec<Setting>,
    /// Malformed values.
    pub errors: Vec<ConfigError>,
    /// Unknown `LAZULI_*` names, each with a near registered name.
    pub unknown: Vec<(String, Option<&'static str>)>,
}

/// The configuration as the environment alone gives it: for each library
/// variable its value and `Environment` when set, else its default in
/// words and `Default`; `names` are the `LAZULI_*` names set (for the
/// unknown ones).
pub fn report(lookup: Lookup<'_>, names: impl IntoIterator<Item = String>) -> Report {
    let mut settings = Vec::new();
    let mut errors = Vec::new();
    for v in VARS {
        let set = match raw(lookup, v.name) {
            None if EMPTY_MEANS_OFF.contains(&v.name) && lookup(v.name).is_some() => Some("off (empty)".to_string()),
            set => set,
        };
        if v.scope != Scope::Library && set.is_none() {
            continue;
        }
        if let Err(e) = check_var(lookup, v) {
            errors.push(e);
        }
        settings.push(match set {
            Some(value) => Setting { variable: v.name, value, source: Source::Environment },
            None => Setting { variable: v.name, value: v.default.to_string(), source: Source::Default },
        });
    }
    Report { settings, errors, unknown: unknown(names) }
}

impl Report {
    /// Replaces the rows of the given settings' variables with these
    /// effective values.
    pub fn apply(&mut self, settings: impl IntoIterator<Item = Setting>) {
        for s in settings {
            match self.settings.iter_mut().find(|r| r.variable == s.variable) {
                Some(row) => *row = s,
                None => self.settings.push(s),
            }
        }
    }

    /// The first malformed value, if any.
    pub fn check(&self) -> Result<(), ConfigError> {
        self.errors.first().cloned().map_or(Ok(()), Err)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "configuration (variable = value [source]):")?;
        let width = self.settings.iter().map(|s| s.variable.len()).max().unwrap_or(0);
        for s in &self.settings {
            writeln!(f, "  {:width$} = {} [{}]", s.variable, s.value, s.source)?;
        }
        for e in &self.errors {
            writeln!(f, "  error: {e}")?;
        }
        for (name, near) in &self.unknown {
            match near {
                Some(near) => writeln!(f, "  unknown variable {name} (did you mean {near}?)")?,
                None => writeln!(f, "  unknown variable {name}")?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn a_flag_has_one_spelling() {
        for on in ["1", "true", "TRUE", "On", " on "] {
            assert_eq!(parse_flag("LAZULI_X", on), Ok(true), "{on:?}");
        }
        for off in ["0", "false", "False", "OFF"] {
            assert_eq!(parse_flag("LAZULI_X", off), Ok(false), "{off:?}");
        }
        for bad in ["yes", "no", "2", "maybe", "enabled", "t"] {
            let e = parse_flag("LAZULI_AUTOTUNE", bad).unwrap_err();
            assert_eq!((e.variable.as_str(), e.value.as_str()), ("LAZULI_AUTOTUNE", bad));
            assert!(e.to_string().contains("LAZULI_AUTOTUNE") && e.to_string().contains("on or off"), "{e}");
        }
    }

    #[test]
    fn byte_counts_are_decimal_integers() {
        assert_eq!(parse_bytes("X", "1073741824"), Ok(1 << 30));
        assert_eq!(parse_bytes("X", " 0 "), Ok(0));
        assert!(parse_bytes("X", "8GiB").is_err());
        assert!(parse_bytes("X", "-1").is_err());
        assert!(parse_bytes("X", "").is_err());
        let e = parse_bytes("LAZULI_POOL_BYTES", "lots").unwrap_err();
        assert_eq!(
            e.to_string(),
            "configuration: LAZULI_POOL_BYTES=\"lots\" is not valid: expected a byte count (a decimal integer)"
        );
    }

    #[test]
    fn counts_are_positive() {
        assert_eq!(parse_count("X", "8"), Ok(8));
        assert!(parse_count("X", "0").is_err());
        assert!(parse_count("X", "-3").is_err());
        assert!(parse_count("X", "1.5").is_err());
    }

    #[test]
    fn choices_ignore_case_and_name_the_alternatives() {
        assert_eq!(parse_choice("X", "GPU", &["gpu", "software"]), Ok("gpu"));
        let e = parse_choice("LAZULI_KERNEL_FORMS", "fast", &["gpu", "software"]).unwrap_err();
        assert_eq!(e.expected, "one of gpu, software");
    }

    #[test]
    fn lookups_parse_by_kind_and_empty_is_unset() {
        let e = env(&[
            ("LAZULI_AUTOTUNE", "off"),
            ("LAZULI_POOL_BYTES", "4096"),
            ("LAZULI_COMPILE_THREADS", ""),
            ("LAZULI_KERNEL_FORMS", "software"),
            ("LAZULI_DUMP_DIR", "/tmp/d"),
            ("LAZULI_FORCE_FALLBACK", "matmul,sum"),
        ]);
        assert_eq!(flag(&e, "LAZULI_AUTOTUNE"), Ok(Some(false)));
        assert_eq!(flag(&e, "LAZULI_MULTI_TENSOR"), Ok(None));
        assert_eq!(bytes(&e, "LAZULI_POOL_BYTES"), Ok(Some(4096)));
        assert_eq!(count(&e, "LAZULI_COMPILE_THREADS"), Ok(None));
        assert_eq!(choice(&e, "LAZULI_KERNEL_FORMS"), Ok(Some("software")));
        assert_eq!(path(&e, "LAZULI_DUMP_DIR"), Some(PathBuf::from("/tmp/d")));
        assert_eq!(text(&e, "LAZULI_FORCE_FALLBACK").as_deref(), Some("matmul,sum"));
        assert_eq!(check(&e), Ok(()));
        assert_eq!(dir_or_off(&e, "LAZULI_CACHE_DIR"), None);
        let off = env(&[("LAZULI_CACHE_DIR", "")]);
        assert_eq!(dir_or_off(&off, "LAZULI_CACHE_DIR"), Some(None));
        let on = env(&[("LAZULI_CACHE_DIR", "/c")]);
        assert_eq!(dir_or_off(&on, "LAZULI_CACHE_DIR"), Some(Some(PathBuf::from("/c"))));
    }

    #[test]
    fn check_names_the_first_malformed_library_variable() {
        let e = env(&[("LAZULI_AUTOTUNE", "maybe"), ("LAZULI_HEAVY", "sure")]);
        let err = check(&e).unwrap_err();
        assert_eq!(err.variable, "LAZULI_AUTOTUNE");
        assert_eq!(err.value, "maybe");
        let ok = env(&[("LAZULI_HEAVY", "sure")]);
        assert_eq!(check(&ok), Ok(()), "test-harness variables are the harness's business");
    }

    #[test]
    fn unknown_names_get_a_near_registered_one() {
        let names = ["LAZULI_AUTOTUN", "LAZULI_POOL_BYTES", "LAZULI_ZZZZZZZZZZZZ", "PATH"].map(String::from);
        assert_eq!(
            unknown(names),
            vec![("LAZULI_AUTOTUN".to_string(), Some("LAZULI_AUTOTUNE")), ("LAZULI_ZZZZZZZZZZZZ".to_string(), None)]
        );
    }

    #[test]
    fn the_report_lists_sources_errors_and_unknown_names() {
        let e = env(&[("LAZULI_POOL_BYTES", "lots"), ("LAZULI_FINITE_MATH", "1"), ("LAZULI_BLESS", "1")]);
        let mut r = report(&e, ["LAZULI_POOL_BYTES", "LAZULI_AUTOTUN"].map(String::from));
        r.apply([Setting::new("LAZULI_AUTOTUNE", "on", Source::Code)]);
        let text = r.to_string();
        assert!(text.contains("LAZULI_FINITE_MATH") && text.contains("= 1 [environment]"), "{text}");
        assert!(text.contains("LAZULI_AUTOTUNE") && text.contains("= on [code]"), "{text}");
        assert!(text.contains("LAZULI_MULTI_TENSOR") && text.contains("= on [default]"), "{text}");
        assert!(text.contains("LAZULI_BLESS"), "a set test variable is listed: {text}");
        let off = report(&env(&[("LAZULI_CACHE_DIR", "")]), []);
        let row = off.settings.iter().find(|s| s.variable == "LAZULI_CACHE_DIR").unwrap();
        assert_eq!((row.value.as_str(), row.source), ("off (empty)", Source::Environment));
        assert!(!text.contains("LAZULI_HEAVY"), "an unset test variable is not: {text}");
        assert!(text.contains("error: configuration: LAZULI_POOL_BYTES=\"lots\""), "{text}");
        assert!(text.contains("unknown variable LAZULI_AUTOTUN (did you mean LAZULI_AUTOTUNE?)"), "{text}");
        assert_eq!(r.check().unwrap_err().variable, "LAZULI_POOL_BYTES");
    }

    #[test]
    fn every_registered_name_is_unique_and_prefixed() {
        let mut names: Vec<_> = VARS.iter().map(|v| v.name).collect();
        assert!(names.iter().all(|n| n.starts_with("LAZULI_")));
        names.sort();
        names.dedup();
        assert_eq!(names.len(), VARS.len());
    }
}
