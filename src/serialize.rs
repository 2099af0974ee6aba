//! Saving and loading named tensors in the safetensors format
//! (<https://github.com/huggingface/safetensors>), e.g. a model's
//! [`ModuleExt::state_dict`](crate::nn::ModuleExt::state_dict).
//!
//! Saving reads every tensor (a barrier). Loading memory-maps the file (or
//! every shard named by a `*.safetensors.index.json`, the Hugging Face
//! layout of large checkpoints) and copies out only the tensors it needs,
//! as host-data tensors on the given device; [`load_into`] and
//! [`load_into_with`] assign them to existing tensors, so parameters keep
//! their identity (and `requires_grad`) and optimizers keep working on
//! them. Loading into tensors converts float dtypes as PyTorch's
//! `load_state_dict` copies do (f16 and bf16 checkpoints into f32
//! parameters, each value rounded once; a bf16 or f16 target keeps the
//! stored bits when the file has its dtype); [`load`] keeps every stored
//! dtype, bf16 included; [`LoadOptions`] chooses strict or
//! non-strict keys (a [`LoadReport`] names the missing and unexpected
//! ones) and renames the file's keys.

use crate::{DType, Device, ExecError, Tensor};
use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// An error while saving or loading tensors.
#[derive(Error)]
pub enum SerializeError {
    /// Reading or writing the file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid safetensors (or could not be encoded).
    #[error("{path}: safetensors: {source}")]
    Format {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// A dtype without a counterpart on the other side.
    #[error("{path}: tensor {name:?} has unsupported dtype {dtype}")]
    UnsupportedDType {
        /// The file.
        path: String,
        /// The tensor.
        name: String,
        /// The dtype, as named by its side.
        dtype: String,
    },
    /// `load_into` found no tensor of this name, or one of another type.
    #[error("{path}: tensor {name:?}: {detail}")]
    Mismatch {
        /// The file.
        path: String,
        /// The tensor.
        name: String,
        /// What differs.
        detail: String,
    },
    /// A strict load found keys that do not match: every target the file
    /// lacks and every key of the file (after renaming) that names no
    /// target, each list sorted.
    #[error(
        "{path}: the tensors do not match the model's state dict: {}; LoadOptions::non_strict() (with \
         ModuleExt::load_state_dict_with) loads what matches and reports the rest, LoadOptions::rename maps the \
         file's names to the model's",
        key_lists(.missing, .unexpected)
    )]
    Keys {
        /// The file (or the in-memory state dict).
        path: String,
        /// Targets the file does not have.
        missing: Vec<String>,
        /// Keys of the file that name no target.
        unexpected: Vec<String>,
    },
    /// A `*.safetensors.index.json` that is not a valid shard index.
    #[error("{path}: not a safetensors shard index: {detail}")]
    Index {
        /// The index file.
        path: String,
        /// What is wrong.
        detail: String,
    },
    /// Reading or creating a tensor failed.
    #[error(transparent)]
    Exec(#[from] ExecError),
}

/// `Debug` prints the message and its causes (what `?` out of `main`
/// shows); an engine error prints as it does on its own.
impl std::fmt::Debug for SerializeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SerializeError::Exec(e) => std::fmt::Debug::fmt(e, f),
            other => lazuli_executor::error::write_chain(f, other),
        }
    }
}

/// The key lists of [`SerializeError::Keys`] in words.
fn key_lists(missing: &[String], unexpected: &[String]) -> String {
    let list = |keys: &[String]| keys.iter().map(|k| format!("{k:?}")).collect::<Vec<_>>().join(", ");
    let mut parts = Vec::new();
    if !missing.is_empty() {
        parts.push(format!("{} missing (in the model, not in the file): {}", missing.len(), list(missing)));
    }
    if !unexpected.is_empty() {
        parts.push(format!("{} unexpected (in the file, not in the model): {}", unexpected.len(), list(unexpected)));
    }
    parts.join("; ")
}

/// `?` on a serialize call inside a function returning [`crate::Result`]:
/// engine errors come back as they were, file and format errors as
/// [`ExecError::External`] with this error as the source.
impl From<SerializeError> for ExecError {
    fn from(e: SerializeError) -> ExecError {
        match e {
            SerializeError::Exec(e) => e,
            other => ExecError::External { op: "serialize".into(), source: std::sync::Arc::new(other) },
        }
    }
}

fn to_st(d: DType) -> Dtype {
    match d {
        DType::Bool => Dtype::BOOL,
        DType::I8 => Dtype::I8,
        DType::I16 => Dtype::I16,
        DType::I32 => Dtype::I32,
        DType::I64 => Dtype::I64,
        DType::U8 => Dtype::U8,
        DType::U16 => Dtype::U16,
        DType::U32 => Dtype::U32,
        DType::U64 => Dtype::U64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
    }
}

fn from_st(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::BOOL => DType::Bool,
        Dtype::I8 => DType::I8,
        Dtype::I16 => DType::I16,
        Dtype::I32 => DType::I32,
        Dtype::I64 => DType::I64,
        Dtype::U8 => DType::U8,
        Dtype::U16 => DType::U16,
        Dtype::U32 => DType::U32,
        Dtype::U64 => DType::U64,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        _ => return None,
    })
}

/// Writes `tensors` (name, tensor) to `path` as safetensors (a barrier).
pub fn save(path: impl AsRef<Path>, tensors: &[(String, Tensor)]) -> Result<(), SerializeError> {
    let path = path.as_ref();
    let p = path.display().to_string();
    let data = encode(&p, tensors)?;
    std::fs::write(path, data).map_err(|source| SerializeError::Io { path: p, source })
}

/// `tensors` as the bytes of one safetensors file (reading every tensor:
/// a barrier), a name listed twice (tied weights) once; `p` names the
/// destination in errors.
fn encode(p: &str, tensors: &[(String, Tensor)]) -> Result<Vec<u8>, SerializeError> {
    let mut seen = std::collections::HashSet::new();
    let bytes: Vec<(String, DType, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .filter(|(n, _)| seen.insert(n.as_str()))
        .map(|(n, t)| Ok((n.clone(), t.dtype(), t.dims().to_vec(), t.to_bytes()?)))
        .collect::<Result<_, ExecError>>()?;
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(n, d, s, b)| {
            TensorView::new(to_st(*d), s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|source| SerializeError::Format { path: p.to_string(), source })
        })
        .collect::<Result<_, _>>()?;
    safetensors::serialize(views, None).map_err(|source| SerializeError::Format { path: p.to_string(), source })
}

/// [`load_into_with`] from tensors in memory instead of a file (another
/// model's [`ModuleExt::state_dict`](crate::nn::ModuleExt::state_dict),
/// on any device): each source tensor is read (a barrier) and assigned to
/// its target as a file's would be, converted to the target's dtype and
/// placed on the target's device. What
/// [`ModuleExt::load_state_dict_from`](crate::nn::ModuleExt::load_state_dict_from)
/// does.
pub fn load_tensors_into_with(
    source: &[(String, Tensor)],
    targets: &[(String, Tensor)],
    options: &LoadOptions<'_>,
) -> Result<LoadReport, SerializeError> {
    const LABEL: &str = "the state dict in memory";
    let archive = Archive::from_bytes(LABEL, encode(LABEL, source)?)?;
    load_archive(&archive, targets, options)
}

/// Reads every tensor of the safetensors file at `path` (or of every
/// shard of a `*.safetensors.index.json`) onto `device`, in the file's
/// dtypes: f16 and bf16 stay f16 and bf16, bit for bit (a dtype Lazuli
/// lacks, such as f8, is [`SerializeError::UnsupportedDType`]).
/// [`load_into`] instead converts to each target's dtype.
pub fn load(path: impl AsRef<Path>, device: &Device) -> Result<HashMap<String, Tensor>, SerializeError> {
    let archive = Archive::open(path.as_ref())?;
    let mut out = HashMap::new();
    for name in archive.names() {
        let t = archive.tensor(&name, device)?;
        out.insert(name, t);
    }
    Ok(out)
}

/// Loads `path` and assigns each of `targets` (name, tensor) the stored
/// tensor of that name, which must exist with the same shape (a float
/// tensor of another float dtype is converted). The targets keep their
/// identity and gradient settings. Tensors in the file that no target
/// names are ignored (see [`load_state_dict`] and [`load_into_with`]).
pub fn load_into(path: impl AsRef<Path>, targets: &[(String, Tensor)]) -> Result<(), SerializeError> {
    let archive = Archive::open(path.as_ref())?;
    load_checked(&archive, targets, &LoadOptions::strict(), Keys { missing: false, unexpected: true }).map(|_| ())
}

/// [`load_into`] that also refuses a file holding tensors no target names
/// (a checkpoint of another model): what
/// [`ModuleExt::load_state_dict`](crate::nn::ModuleExt::load_state_dict) does.
pub fn load_state_dict(path: impl AsRef<Path>, targets: &[(String, Tensor)]) -> Result<(), SerializeError> {
    load_into_with(path, targets, &LoadOptions::strict()).map(|_| ())
}

/// Loads `path` into `targets` as `options` say: keys renamed first, then
/// matched to the targets' names; with [`LoadOptions::strict`] every
/// target must be found and every (renamed) key used, otherwise the
/// [`LoadReport`] lists what was not. Each found tensor must have its
/// target's shape; float dtypes convert. Everything is checked before
/// anything is assigned, so a failed load leaves the targets as they were.
pub fn load_into_with(
    path: impl AsRef<Path>,
    targets: &[(String, Tensor)],
    options: &LoadOptions<'_>,
) -> Result<LoadReport, SerializeError> {
    load_archive(&Archive::open(path.as_ref())?, targets, options)
}

/// How [`load_into_with`] matches a file's keys to a model's tensors.
pub struct LoadOptions<'a> {
    /// Every target must be in the file and every key of the file (after
    /// renaming, and not dropped by it) must name a target. PyTorch's
    /// `strict` (default true).
    pub strict: bool,
    rename: Option<Rename<'a>>,
}

/// A key renaming: the model's name for a key of the file, or `None` to
/// drop the key.
type Rename<'a> = Box<dyn Fn(&str) -> Option<String> + 'a>;

impl std::fmt::Debug for LoadOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions").field("strict", &self.strict).field("rename", &self.rename.is_some()).finish()
    }
}

impl Default for LoadOptions<'_> {
    fn default() -> Self {
        LoadOptions::strict()
    }
}

impl<'a> LoadOptions<'a> {
    /// Strict keys, no renaming.
    pub fn strict() -> LoadOptions<'a> {
        LoadOptions { strict: true, rename: None }
    }

    /// Non-strict keys (PyTorch's `strict=False`): targets not in the file
    /// keep their values and are reported as missing, keys naming no
    /// target are reported as unexpected.
    pub fn non_strict() -> LoadOptions<'a> {
        LoadOptions { strict: false, rename: None }
    }

    /// Renames every key of the file before matching: `rename(key)` gives
    /// the model's name for it, or `None` to drop the key (it is then
    /// neither loaded nor unexpected).
    pub fn rename(mut self, rename: impl Fn(&str) -> Option<String> + 'a) -> LoadOptions<'a> {
        self.rename = Some(Box::new(rename));
        self
    }

    /// Renames keys by a map from the file's names to the model's; keys
    /// not in the map keep their names.
    pub fn rename_map(self, map: HashMap<String, String>) -> LoadOptions<'a> {
        self.rename(move |k| Some(map.get(k).cloned().unwrap_or_else(|| k.to_string())))
    }

    pub(crate) fn renamed(&self, key: &str) -> Option<String> {
        match &self.rename {
            Some(f) => f(key),
            None => Some(key.to_string()),
        }
    }
}

/// What a non-strict load did not match, by PyTorch's names: targets
/// that were not in the file (they keep their values) and keys of the
/// file (after renaming) that named no target, both sorted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Targets the file did not have.
    pub missing_keys: Vec<String>,
    /// Keys of the file that named no target.
    pub unexpected_keys: Vec<String>,
}

/// Which unmatched keys a load accepts.
#[derive(Clone, Copy)]
struct Keys {
    missing: bool,
    unexpected: bool,
}

impl Keys {
    const ALL: Keys = Keys { missing: true, unexpected: true };
}

/// One or more memory-mapped safetensors files: a single file, or the
/// shards of a `*.safetensors.index.json`, with each tensor's file.
pub(crate) struct Archive {
    /// What was opened (the file or the index), for errors.
    path: String,
    /// Each file, its header parsed once.
    files: Vec<Shard>,
    /// Each tensor's file (an index into `files`), by name.
    tensors: BTreeMap<String, usize>,
}

/// One safetensors file of an [`Archive`].
struct Shard {
    path: String,
    contents: Contents,
    /// Where the tensor data starts (after the length and the header).
    data_start: usize,
    metadata: Metadata,
}

impl Shard {
    fn open(path: &Path) -> Result<Shard, SerializeError> {
        Shard::of(path.display().to_string(), map_file(path)?)
    }

    fn of(p: String, contents: Contents) -> Result<Shard, SerializeError> {
        let (n, metadata) = SafeTensors::read_metadata(&contents)
            .map_err(|source| SerializeError::Format { path: p.clone(), source })?;
        Ok(Shard { path: p, contents, data_start: 8 + n, metadata })
    }
}

/// A stored tensor: its dtype, shape and bytes (borrowed from the file).
struct Stored<'a> {
    dtype: Dtype,
    shape: &'a [usize],
    data: &'a [u8],
}

/// A file's bytes: memory-mapped where the platform allows, else read.
enum Contents {
    Mapped(memmap2::Mmap),
    Read(Vec<u8>),
}

impl std::ops::Deref for Contents {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Contents::Mapped(m) => m,
            Contents::Read(v) => v,
        }
    }
}

/// Maps `path` into memory (an empty file, which cannot be mapped, is read).
// Mapping a file is `unsafe` because another process could change the
// file while it is mapped; a checkpoint being rewritten while it loads
// is outside what this API promises (as with every mmap-based loader,
// e.g. safetensors' own Python `safe_open`). The map is read only.
#[allow(unsafe_code)]
fn map_file(path: &Path) -> Result<Contents, SerializeError> {
    let p = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|source| SerializeError::Io { path: p.clone(), source })?;
    let len = file.metadata().map_err(|source| SerializeError::Io { path: p.clone(), source })?.len();
    if len == 0 {
        return Ok(Contents::Read(Vec::new()));
    }
    // SAFETY: read-only map of a file we opened; see the comment above.
    match unsafe { memmap2::Mmap::map(&file) } {
        Ok(m) => Ok(Contents::Mapped(m)),
        Err(_) => std::fs::read(path).map(Contents::Read).map_err(|source| SerializeError::Io { path: p, source }),
    }
}

impl Archive {
    /// Opens a safetensors file, or the shards of an index (a path ending
    /// in `.json`: `{"weight_map": {"name": "shard file", ...}}`, shard
    /// paths relative to the index's folder).
    pub(crate) fn open(path: &Path) -> Result<Archive, SerializeError> {
        let p = path.display().to_string();
        if path.extension().is_some_and(|e| e == "json") {
            return Archive::open_index(path);
        }
        let shard = Shard::open(path)?;
        let tensors = shard.metadata.tensors().into_keys().map(|n| (n, 0)).collect();
        Ok(Archive { path: p, files: vec![shard], tensors })
    }

    /// The bytes of one safetensors file held in memory, named `label`.
    fn from_bytes(label: &str, bytes: Vec<u8>) -> Result<Archive, SerializeError> {
        let shard = Shard::of(label.to_string(), Contents::Read(bytes))?;
        let tensors = shard.metadata.tensors().into_keys().map(|n| (n, 0)).collect();
        Ok(Archive { path: label.to_string(), files: vec![shard], tensors })
    }

    fn open_index(path: &Path) -> Result<Archive, SerializeError> {
        let p = path.display().to_string();
        let bad = |detail: String| SerializeError::Index { path: p.clone(), detail };
        let text = std::fs::read_to_string(path).map_err(|source| SerializeError::Io { path: p.clone(), source })?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let map =
            json.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| bad("no \"weight_map\" object".into()))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let mut shards: Vec<String> = Vec::new();
        let mut tensors = BTreeMap::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| bad(format!("tensor {name:?}: the shard is not a string")))?;
            if Path::new(file).components().any(|c| !matches!(c, std::path::Component::Normal(_))) {
                return Err(bad(format!("tensor {name:?}: shard {file:?} is not a plain file name beside the index")));
            }
            let i = match shards.iter().position(|s| s == file) {
                Some(i) => i,
                None => {
                    shards.push(file.to_string());
                    shards.len() - 1
                }
            };
            tensors.insert(name.clone(), i);
        }
        let mut files = Vec::with_capacity(shards.len());
        for shard in &shards {
            let sp: PathBuf = dir.join(shard);
            files.push(Shard::open(&sp)?);
        }
        let archive = Archive { path: p, files, tensors };
        // Every tensor the index names must be in its shard.
        for name in archive.tensors.keys() {
            archive.view(name)?;
        }
        Ok(archive)
    }

    /// Every tensor name, sorted.
    pub(crate) fn names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    /// The file holding `name` (the archive's path if none does).
    fn file_of(&self, name: &str) -> String {
        self.tensors.get(name).map_or_else(|| self.path.clone(), |&i| self.files[i].path.clone())
    }

    /// The stored tensor `name`.
    fn view(&self, name: &str) -> Result<Stored<'_>, SerializeError> {
        let missing = |path: &str| SerializeError::Mismatch {
            path: path.to_string(),
            name: name.to_string(),
            detail: "not in the file".into(),
        };
        let &i = self.tensors.get(name).ok_or_else(|| missing(&self.path))?;
        let shard = &self.files[i];
        let info = shard.metadata.info(name).ok_or_else(|| missing(&shard.path))?;
        // `read_metadata` validated the offsets against the file's length.
        let (start, end) = info.data_offsets;
        let data = &shard.contents[shard.data_start + start..shard.data_start + end];
        Ok(Stored { dtype: info.dtype, shape: &info.shape, data })
    }

    /// The stored tensor `name` as its dtype, shape and bytes borrowed
    /// from the file (an error for a dtype Lazuli lacks).
    pub(crate) fn raw(&self, name: &str) -> Result<(DType, Vec<usize>, &[u8]), SerializeError> {
        let view = self.view(name)?;
        let dtype = from_st(view.dtype).ok_or_else(|| SerializeError::UnsupportedDType {
            path: self.file_of(name),
            name: name.to_string(),
            dtype: format!("{:?}", view.dtype),
        })?;
        Ok((dtype, view.shape.to_vec(), view.data))
    }

    /// Bytes of every file of the archive.
    pub(crate) fn stored_bytes(&self) -> usize {
        self.files.iter().map(|f| f.contents.len()).sum()
    }

    /// The stored tensor `name` on `device` in its stored dtype (an error
    /// for a dtype Lazuli lacks).
    pub(crate) fn tensor(&self, name: &str, device: &Device) -> Result<Tensor, SerializeError> {
        let (dtype, shape, data) = self.raw(name)?;
        Ok(Tensor::from_bytes(data.to_vec(), crate::ir::ValueType::new(shape, dtype), device)?)
    }

    /// The tensors whose names start with `prefix`, by the rest of their
    /// names, on `device` in their stored dtypes.
    pub(crate) fn with_prefix(&self, prefix: &str, device: &Device) -> Result<HashMap<String, Tensor>, SerializeError> {
        let mut out = HashMap::new();
        for name in self.tensors.keys() {
            if let Some(rest) = name.strip_prefix(prefix) {
                out.insert(rest.to_string(), self.tensor(name, device)?);
            }
        }
        Ok(out)
    }

    /// The path opened, for errors.
    pub(crate) fn path(&self) -> &str {
        &self.path
    }
}

/// [`load_into_with`] from an opened archive.
pub(crate) fn load_archive(
    archive: &Archive,
    targets: &[(String, Tensor)],
    options: &LoadOptions<'_>,
) -> Result<LoadReport, SerializeError> {
    let keys = if options.strict { Keys { missing: false, unexpected: false } } else { Keys::ALL };
    load_checked(archive, targets, options, keys)
}

/// Matches the archive's tensors to `targets` by `options`, checks every
/// match and unmatched key against `accept`, converts dtypes, and only
/// then assigns every found tensor.
fn load_checked(
    archive: &Archive,
    targets: &[(String, Tensor)],
    options: &LoadOptions<'_>,
    accept: Keys,
) -> Result<LoadReport, SerializeError> {
    let mismatch = |file: String, name: &str, detail: String| SerializeError::Mismatch {
        path: file,
        name: name.to_string(),
        detail,
    };
    // The file's keys by the model's names.
    let mut by_target: HashMap<String, String> = HashMap::new();
    for key in archive.names() {
        let Some(to) = options.renamed(&key) else { continue };
        if let Some(other) = by_target.insert(to.clone(), key.clone()) {
            let detail = format!("keys {other:?} and {key:?} of the file are both renamed to it");
            return Err(mismatch(archive.path().to_string(), &to, detail));
        }
    }
    let mut report = LoadReport::default();
    let mut found = Vec::with_capacity(targets.len());
    let mut used = std::collections::HashSet::new();
    for (name, t) in targets {
        // `get`, not `remove`: a state dict may list one tensor under two
        // names (tied weights), and each name loads.
        let Some(key) = by_target.get(name).cloned() else {
            report.missing_keys.push(name.clone());
            continue;
        };
        let view = archive.view(&key)?;
        let file = archive.file_of(&key);
        let label = if &key == name { name.clone() } else { format!("{name} (stored as {key:?})") };
        if view.shape != t.dims() {
            let detail = format!("stored as {:?}{:?}, expected {}{}", view.dtype, view.shape, t.dtype(), t.shape());
            return Err(mismatch(file, &label, detail));
        }
        let bytes = convert(view.data, view.dtype, t.dtype()).ok_or_else(|| {
            let detail = format!(
                "stored as {:?}{:?}, expected {}{} (only float dtypes convert)",
                view.dtype,
                view.shape,
                t.dtype(),
                t.shape()
            );
            mismatch(file, &label, detail)
        })?;
        found.push((t, bytes));
        used.insert(name.as_str());
    }
    let mut extra: Vec<String> = by_target.into_keys().filter(|k| !used.contains(k.as_str())).collect();
    extra.sort();
    report.missing_keys.sort();
    report.missing_keys.dedup();
    let refused_missing = if accept.missing { Vec::new() } else { report.missing_keys.clone() };
    let refused_extra = if accept.unexpected { Vec::new() } else { extra.clone() };
    if !refused_missing.is_empty() || !refused_extra.is_empty() {
        return Err(SerializeError::Keys {
            path: archive.path().to_string(),
            missing: refused_missing,
            unexpected: refused_extra,
        });
    }
    report.unexpected_keys = extra;
    let stored = found
        .into_iter()
        .map(|(t, bytes)| Ok((t, Tensor::from_bytes(bytes, t.ty().clone(), t.device())?)))
        .collect::<Result<Vec<_>, ExecError>>()?;
    for (t, s) in stored {
        t.assign(&s)?;
    }
    Ok(report)
}

/// `data` (stored as `from`) as the canonical bytes of `to`: the same
/// bytes when the dtypes agree, each value rounded once to `to` when both
/// are float dtypes (f16, bf16, f32, f64), else `None`.
fn convert(data: &[u8], from: Dtype, to: DType) -> Option<Vec<u8>> {
    if from_st(from) == Some(to) {
        return Some(data.to_vec());
    }
    let read: fn(&[u8]) -> f64 = match from {
        Dtype::F16 => |b| half::f16::from_le_bytes([b[0], b[1]]).to_f64(),
        Dtype::BF16 => |b| half::bf16::from_le_bytes([b[0], b[1]]).to_f64(),
        Dtype::F32 => |b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        Dtype::F64 => |b| f64::from_le_bytes(b.try_into().expect("8 bytes")),
        _ => return None,
    };
    let size = from.bitsize() / 8;
    let values = data.chunks_exact(size).map(read);
    // Every f16, bf16 and f32 value is exact in f64, so the one rounding
    // is the final cast.
    Some(match to {
        DType::F16 => values.flat_map(|v| lazuli_ir::f16_from_f64(v).to_le_bytes()).collect(),
        DType::BF16 => values.flat_map(|v| lazuli_ir::bf16_from_f64(v).to_le_bytes()).collect(),
        DType::F32 => values.flat_map(|v| (v as f32).to_le_bytes()).collect(),
        DType::F64 => values.flat_map(|v| v.to_le_bytes()).collect(),
        _ => return None,
    })
}
