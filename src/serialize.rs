//! Saving and loading named tensors in the safetensors format
//! (<https://github.com/huggingface/safetensors>), e.g. a model's
//! [`ModuleExt::named_parameters`](crate::nn::ModuleExt::named_parameters).
//!
//! Saving reads every tensor (a barrier). Loading creates host-data tensors
//! on the given device; [`load_into`] assigns them to existing tensors, so
//! parameters keep their identity (and `requires_grad`) and optimizers keep
//! working on them.

use crate::{DType, Device, ExecError, Tensor};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use std::collections::HashMap;
use std::path::Path;
use thiserror::Error;

/// An error while saving or loading tensors.
#[derive(Debug, Error)]
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
    /// Reading or creating a tensor failed.
    #[error(transparent)]
    Exec(#[from] ExecError),
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
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        _ => return None,
    })
}

/// Writes `tensors` (name, tensor) to `path` as safetensors (a barrier).
pub fn save(path: impl AsRef<Path>, tensors: &[(String, Tensor)]) -> Result<(), SerializeError> {
    let path = path.as_ref();
    let p = path.display().to_string();
    let bytes: Vec<(String, DType, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), t.dtype(), t.dims().to_vec(), t.to_bytes()?)))
        .collect::<Result<_, ExecError>>()?;
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(n, d, s, b)| {
            TensorView::new(to_st(*d), s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|source| SerializeError::Format { path: p.clone(), source })
        })
        .collect::<Result<_, _>>()?;
    let data =
        safetensors::serialize(views, None).map_err(|source| SerializeError::Format { path: p.clone(), source })?;
    std::fs::write(path, data).map_err(|source| SerializeError::Io { path: p, source })
}

/// Reads every tensor of the safetensors file at `path` onto `device`.
pub fn load(path: impl AsRef<Path>, device: &Device) -> Result<HashMap<String, Tensor>, SerializeError> {
    let path = path.as_ref();
    let p = path.display().to_string();
    let data = std::fs::read(path).map_err(|source| SerializeError::Io { path: p.clone(), source })?;
    let st = SafeTensors::deserialize(&data).map_err(|source| SerializeError::Format { path: p.clone(), source })?;
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        let dtype = from_st(view.dtype()).ok_or_else(|| SerializeError::UnsupportedDType {
            path: p.clone(),
            name: name.clone(),
            dtype: format!("{:?}", view.dtype()),
        })?;
        let ty = crate::ir::ValueType::new(view.shape().to_vec(), dtype);
        out.insert(name, Tensor::from_bytes(view.data().to_vec(), ty, device)?);
    }
    Ok(out)
}

/// Loads `path` and assigns each of `targets` (name, tensor) the stored
/// tensor of that name, which must exist with the same shape and dtype.
/// The targets keep their identity and gradient settings. Tensors in the
/// file that no target names are ignored (see [`load_state_dict`]).
pub fn load_into(path: impl AsRef<Path>, targets: &[(String, Tensor)]) -> Result<(), SerializeError> {
    load_checked(path.as_ref(), targets, false)
}

/// [`load_into`] that also refuses a file holding tensors no target names
/// (a checkpoint of another model): what
/// [`ModuleExt::load_state_dict`](crate::nn::ModuleExt::load_state_dict) does.
pub fn load_state_dict(path: impl AsRef<Path>, targets: &[(String, Tensor)]) -> Result<(), SerializeError> {
    load_checked(path.as_ref(), targets, true)
}

/// Checks every target against the file before assigning any, so a
/// failed load leaves the targets as they were.
fn load_checked(path: &Path, targets: &[(String, Tensor)], strict: bool) -> Result<(), SerializeError> {
    let Some((_, first)) = targets.first() else { return Ok(()) };
    let mut stored = load(path, first.device())?;
    let mismatch = |name: &str, detail: String| SerializeError::Mismatch {
        path: path.display().to_string(),
        name: name.to_string(),
        detail,
    };
    let mut found = Vec::with_capacity(targets.len());
    for (name, t) in targets {
        let s = stored.remove(name).ok_or_else(|| mismatch(name, "not in the file".into()))?;
        if s.ty() != t.ty() {
            let detail = format!("stored as {}{}, expected {}{}", s.dtype(), s.shape(), t.dtype(), t.shape());
            return Err(mismatch(name, detail));
        }
        found.push(s);
    }
    if strict && !stored.is_empty() {
        let mut extra: Vec<&String> = stored.keys().collect();
        extra.sort();
        let detail = format!("in the file but not in the model ({} such tensor(s): {extra:?})", extra.len());
        return Err(mismatch(extra[0], detail));
    }
    for ((_, t), s) in targets.iter().zip(found) {
        let s = if t.device().same(s.device()) {
            s
        } else {
            Tensor::from_bytes(s.to_bytes()?, s.ty().clone(), t.device())?
        };
        t.assign(&s)?;
    }
    Ok(())
}
