//! Host-side ONNX values: [`HostTensor`] (a dtype, dims and canonical
//! little-endian bytes, usually a slice of the memory-mapped model file),
//! [`Attr`] (a node attribute), and their decoding from the protobuf
//! (`TensorProto`, `AttributeProto`), external data included.
//!
//! Every size is checked before anything is allocated: a tensor's element
//! count is a checked product of its dims, its byte length must equal what
//! the stored data holds (raw bytes, typed fields or the external file's
//! range), so a file that declares a huge tensor without the data for it is
//! an error, never an allocation of the declared size.

use super::error::OnnxError;
use super::proto;
use bytes::Bytes;
use lazuli_executor::{read_scalar, scalar_bytes};
use lazuli_ir::{DType, ScalarValue, Shape, ValueType};
use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;

/// A tensor held on the host: canonical little-endian bytes (bool one
/// byte per element), usually borrowed from the memory-mapped model file.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// Element type.
    pub dtype: DType,
    /// Dimension sizes (`[]` is a scalar).
    pub dims: Vec<usize>,
    /// `numel * dtype.size_bytes()` bytes.
    pub bytes: Bytes,
}

/// A node attribute, by ONNX attribute type.
#[derive(Clone, Debug)]
pub enum Attr {
    /// INT.
    Int(i64),
    /// FLOAT.
    Float(f64),
    /// STRING.
    String(String),
    /// INTS.
    Ints(Vec<i64>),
    /// FLOATS.
    Floats(Vec<f64>),
    /// STRINGS.
    Strings(Vec<String>),
    /// TENSOR.
    Tensor(HostTensor),
    /// GRAPH (a subgraph, e.g. a branch of `If`).
    Graph(Box<proto::GraphProto>),
    /// Another kind (TENSORS, GRAPHS, SPARSE_TENSOR, TYPE_PROTO...), by name.
    Other(&'static str),
}

impl Attr {
    /// A short description of the kind, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Attr::Int(_) => "INT",
            Attr::Float(_) => "FLOAT",
            Attr::String(_) => "STRING",
            Attr::Ints(_) => "INTS",
            Attr::Floats(_) => "FLOATS",
            Attr::Strings(_) => "STRINGS",
            Attr::Tensor(_) => "TENSOR",
            Attr::Graph(_) => "GRAPH",
            Attr::Other(k) => k,
        }
    }
}

impl HostTensor {
    /// A tensor from canonical bytes; `bytes` must hold exactly the elements.
    pub fn new(dtype: DType, dims: Vec<usize>, bytes: impl Into<Bytes>) -> Result<HostTensor, String> {
        let bytes = bytes.into();
        let want = byte_len(&dims, dtype).ok_or_else(|| format!("dims {dims:?} overflow"))?;
        if bytes.len() != want {
            return Err(format!("{} bytes for {dtype} {dims:?} ({want} expected)", bytes.len()));
        }
        Ok(HostTensor { dtype, dims, bytes })
    }

    /// A tensor of `i64` values.
    pub fn from_i64s(values: &[i64], dims: Vec<usize>) -> HostTensor {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        HostTensor { dtype: DType::I64, dims, bytes: bytes.into() }
    }

    /// A tensor from one [`ScalarValue`] per element (cast to `dtype`).
    pub fn from_scalars(values: &[ScalarValue], dtype: DType, dims: Vec<usize>) -> HostTensor {
        let bytes: Vec<u8> = values.iter().flat_map(|&v| scalar_bytes(v, dtype)).collect();
        HostTensor { dtype, dims, bytes: bytes.into() }
    }

    /// The element count.
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    /// Shape and dtype as an IR value type.
    pub fn ty(&self) -> ValueType {
        ValueType::new(Shape::new(self.dims.clone()), self.dtype)
    }

    /// Element `i`.
    pub fn scalar(&self, i: usize) -> ScalarValue {
        read_scalar(&self.bytes, self.dtype, i)
    }

    /// Every element as a [`ScalarValue`].
    pub fn scalars(&self) -> Vec<ScalarValue> {
        (0..self.numel()).map(|i| self.scalar(i)).collect()
    }

    /// The elements as `i64` (floats truncate), for shape-like inputs.
    pub fn to_i64s(&self) -> Vec<i64> {
        (0..self.numel()).map(|i| self.scalar(i).as_i64()).collect()
    }

    /// The elements as `f64`.
    pub fn to_f64s(&self) -> Vec<f64> {
        (0..self.numel()).map(|i| self.scalar(i).as_f64()).collect()
    }

    /// The same values with 64-bit integers narrowed to 32 bits (for
    /// devices without 64-bit integers); `None` where a value does not fit.
    pub fn narrowed(&self) -> Option<HostTensor> {
        let to = match self.dtype {
            DType::I64 => DType::I32,
            DType::U64 => DType::U32,
            _ => return Some(self.clone()),
        };
        let mut out = Vec::with_capacity(self.numel() * 4);
        for i in 0..self.numel() {
            let v = self.scalar(i);
            let fits = match v {
                ScalarValue::Int(x) => i32::try_from(x).is_ok(),
                ScalarValue::UInt(x) => u32::try_from(x).is_ok(),
                _ => true,
            };
            if !fits {
                return None;
            }
            out.extend(scalar_bytes(v, to));
        }
        Some(HostTensor { dtype: to, dims: self.dims.clone(), bytes: out.into() })
    }
}

/// `numel * size` of `dims`, `None` on overflow.
pub fn byte_len(dims: &[usize], dtype: DType) -> Option<usize> {
    dims.iter().try_fold(dtype.size_bytes(), |acc, &d| acc.checked_mul(d))
}

/// The Lazuli dtype of an ONNX `TensorProto.DataType` code, or why not.
pub fn dtype_of_code(code: i32) -> Result<DType, String> {
    use proto::tensor_proto::DataType as T;
    let t = T::try_from(code).map_err(|_| format!("unknown ONNX dtype code {code}"))?;
    Ok(match t {
        T::Float => DType::F32,
        T::Uint8 => DType::U8,
        T::Int8 => DType::I8,
        T::Uint16 => DType::U16,
        T::Int16 => DType::I16,
        T::Int32 => DType::I32,
        T::Int64 => DType::I64,
        T::Bool => DType::Bool,
        T::Float16 => DType::F16,
        T::Double => DType::F64,
        T::Uint32 => DType::U32,
        T::Uint64 => DType::U64,
        T::Bfloat16 => DType::BF16,
        T::Undefined => return Err("undefined dtype".into()),
        T::String => return Err("string tensors are outside a numeric tensor engine".into()),
        T::Complex64 | T::Complex128 => return Err("complex dtypes are not Lazuli dtypes".into()),
        _ => return Err(format!("{} is not a Lazuli dtype", t.as_str_name())),
    })
}

/// The ONNX code of a Lazuli dtype.
pub fn code_of_dtype(dtype: DType) -> i32 {
    use proto::tensor_proto::DataType as T;
    (match dtype {
        DType::F32 => T::Float,
        DType::U8 => T::Uint8,
        DType::I8 => T::Int8,
        DType::U16 => T::Uint16,
        DType::I16 => T::Int16,
        DType::I32 => T::Int32,
        DType::I64 => T::Int64,
        DType::Bool => T::Bool,
        DType::F16 => T::Float16,
        DType::F64 => T::Double,
        DType::U32 => T::Uint32,
        DType::U64 => T::Uint64,
        DType::BF16 => T::Bfloat16,
    }) as i32
}

/// Where external data files are looked up: the model's folder, with the
/// files mapped once each.
pub struct ExternalFiles {
    dir: Option<PathBuf>,
    maps: Mutex<HashMap<PathBuf, Bytes>>,
}

impl ExternalFiles {
    /// External data relative to `dir` (`None`: a model from bytes, which
    /// may hold no external data).
    pub fn new(dir: Option<PathBuf>) -> ExternalFiles {
        ExternalFiles { dir, maps: Mutex::new(HashMap::new()) }
    }

    /// The bytes `[offset, offset + len)` of `location`, checked: the path
    /// must stay inside the model's folder and the range inside the file.
    fn read(
        &self,
        tensor: &str,
        location: &str,
        offset: u64,
        len: Option<u64>,
        want: usize,
    ) -> Result<Bytes, OnnxError> {
        let bad = |detail: String| OnnxError::Tensor { tensor: tensor.to_string(), detail };
        let Some(dir) = &self.dir else {
            return Err(bad(format!("external data {location:?} needs the model's folder (load from a path)")));
        };
        let rel = Path::new(location);
        if rel.as_os_str().is_empty()
            || rel.components().any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
        {
            return Err(bad(format!("external data path {location:?} leaves the model's folder")));
        }
        let path = dir.join(rel);
        // A symbolic link could still point outside: compare canonical paths.
        let canon = path.canonicalize().map_err(|e| bad(format!("external data {}: {e}", path.display())))?;
        let canon_dir = dir.canonicalize().map_err(|e| bad(format!("model folder {}: {e}", dir.display())))?;
        if !canon.starts_with(&canon_dir) {
            return Err(bad(format!("external data path {location:?} leaves the model's folder")));
        }
        let file = {
            let mut maps = self.maps.lock().unwrap_or_else(|e| e.into_inner());
            match maps.get(&canon) {
                Some(b) => b.clone(),
                None => {
                    let b = map_file(&canon).map_err(|e| bad(format!("external data {}: {e}", canon.display())))?;
                    maps.insert(canon.clone(), b.clone());
                    b
                }
            }
        };
        let len = len.unwrap_or((file.len() as u64).saturating_sub(offset));
        let end = offset.checked_add(len).filter(|&e| e <= file.len() as u64).ok_or_else(|| {
            bad(format!("external data range {offset}+{len} is past the end of {location:?} ({} bytes)", file.len()))
        })?;
        if len != want as u64 {
            return Err(bad(format!("external data holds {len} bytes, the tensor needs {want}")));
        }
        Ok(file.slice(offset as usize..end as usize))
    }
}

/// A file's bytes, memory-mapped (read where it cannot be mapped).
// Mapping a file is `unsafe` because another process could change it
// while it is mapped; a model rewritten while it is loaded is outside what
// this API promises, as for `serialize` and every mmap-based loader. The
// map is read only.
#[allow(unsafe_code)]
pub fn map_file(path: &Path) -> std::io::Result<Bytes> {
    let file = std::fs::File::open(path)?;
    if file.metadata()?.len() == 0 {
        return Ok(Bytes::new());
    }
    // SAFETY: a read-only map of a file we opened; see the comment above.
    match unsafe { memmap2::Mmap::map(&file) } {
        Ok(m) => Ok(Bytes::from_owner(m)),
        Err(_) => std::fs::read(path).map(Bytes::from),
    }
}

/// Decodes a `TensorProto` (raw bytes, typed fields or external data).
pub fn decode_tensor(t: &proto::TensorProto, files: &ExternalFiles) -> Result<HostTensor, OnnxError> {
    let name = t.name.clone().unwrap_or_default();
    let bad = |detail: String| OnnxError::Tensor { tensor: name.clone(), detail };
    if t.segment.is_some() {
        return Err(bad("segmented tensors are not supported".into()));
    }
    let dtype = dtype_of_code(t.data_type.unwrap_or(0)).map_err(&bad)?;
    let dims = t
        .dims
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| bad(format!("negative dimension {d} in {:?}", t.dims))))
        .collect::<Result<Vec<_>, _>>()?;
    let want = byte_len(&dims, dtype).ok_or_else(|| bad(format!("dims {:?} overflow", t.dims)))?;
    let numel = dims.iter().product::<usize>();
    let external = t.data_location == Some(proto::tensor_proto::DataLocation::External as i32);
    if external {
        let mut location = None;
        let (mut offset, mut length) = (0u64, None);
        for kv in &t.external_data {
            let v = kv.value.as_deref().unwrap_or_default();
            let num = || v.parse::<u64>().map_err(|_| bad(format!("external data {:?} = {v:?}", kv.key)));
            match kv.key.as_deref().unwrap_or_default() {
                "location" => location = Some(v.to_string()),
                "offset" => offset = num()?,
                "length" => length = Some(num()?),
                _ => {}
            }
        }
        let location = location.ok_or_else(|| bad("external data without a location".into()))?;
        let bytes = files.read(&name, &location, offset, length, want)?;
        return Ok(HostTensor { dtype, dims, bytes });
    }
    if let Some(raw) = &t.raw_data {
        if raw.len() != want {
            return Err(bad(format!("raw data holds {} bytes, {dtype} {dims:?} needs {want}", raw.len())));
        }
        return Ok(HostTensor { dtype, dims, bytes: raw.clone() });
    }
    // Typed fields: the count is checked before anything is allocated, so
    // the allocation is bounded by what the file holds.
    let count_ok = |n: usize, field: &str| {
        if n == numel {
            Ok(())
        } else {
            Err(bad(format!("{n} values in {field} for {dtype} {dims:?} ({numel} elements)")))
        }
    };
    let mut out = Vec::with_capacity(0);
    match dtype {
        DType::F32 => {
            count_ok(t.float_data.len(), "float_data")?;
            out.reserve(want);
            t.float_data.iter().for_each(|v| out.extend(v.to_le_bytes()));
        }
        DType::F64 => {
            count_ok(t.double_data.len(), "double_data")?;
            out.reserve(want);
            t.double_data.iter().for_each(|v| out.extend(v.to_le_bytes()));
        }
        DType::I64 => {
            count_ok(t.int64_data.len(), "int64_data")?;
            out.reserve(want);
            t.int64_data.iter().for_each(|v| out.extend(v.to_le_bytes()));
        }
        DType::U32 | DType::U64 => {
            count_ok(t.uint64_data.len(), "uint64_data")?;
            out.reserve(want);
            for &v in &t.uint64_data {
                out.extend(scalar_bytes(ScalarValue::UInt(v), dtype));
            }
        }
        DType::F16 | DType::BF16 => {
            // The bit patterns, one per int32.
            count_ok(t.int32_data.len(), "int32_data")?;
            out.reserve(want);
            t.int32_data.iter().for_each(|&v| out.extend((v as u16).to_le_bytes()));
        }
        _ => {
            count_ok(t.int32_data.len(), "int32_data")?;
            out.reserve(want);
            for &v in &t.int32_data {
                let s = if dtype.is_unsigned_int() {
                    ScalarValue::UInt(v as u32 as u64)
                } else {
                    ScalarValue::Int(v as i64)
                };
                out.extend(scalar_bytes(if dtype == DType::Bool { ScalarValue::Bool(v != 0) } else { s }, dtype));
            }
        }
    }
    Ok(HostTensor { dtype, dims, bytes: out.into() })
}

/// Reads a serialized `TensorProto` file (the `input_0.pb` /
/// `output_0.pb` of ONNX test data sets): its name and value.
pub fn load_tensor_file(path: &std::path::Path) -> Result<(String, HostTensor), OnnxError> {
    use prost::Message;
    let bytes = map_file(path).map_err(|source| OnnxError::Io { path: path.display().to_string(), source })?;
    let t = proto::TensorProto::decode(bytes)?;
    let dir = path.parent().map(Path::to_path_buf);
    Ok((t.name.clone().unwrap_or_default(), decode_tensor(&t, &ExternalFiles::new(dir))?))
}

/// Decodes an attribute (tensors through [`decode_tensor`]).
pub fn decode_attr(a: &proto::AttributeProto, files: &ExternalFiles) -> Result<Attr, OnnxError> {
    use proto::attribute_proto::AttributeType as T;
    let text = |b: &Bytes| String::from_utf8_lossy(b).into_owned();
    let ty = a.r#type.and_then(|t| T::try_from(t).ok()).unwrap_or(T::Undefined);
    Ok(match ty {
        T::Int => Attr::Int(a.i.unwrap_or(0)),
        T::Float => Attr::Float(a.f.unwrap_or(0.0) as f64),
        T::String => Attr::String(a.s.as_ref().map(text).unwrap_or_default()),
        T::Ints => Attr::Ints(a.ints.clone()),
        T::Floats => Attr::Floats(a.floats.iter().map(|&f| f as f64).collect()),
        T::Strings => Attr::Strings(a.strings.iter().map(text).collect()),
        T::Tensor => match &a.t {
            Some(t) => Attr::Tensor(decode_tensor(t, files)?),
            None => Attr::Other("TENSOR without a value"),
        },
        T::Graph => match &a.g {
            Some(g) => Attr::Graph(Box::new(g.clone())),
            None => Attr::Other("GRAPH without a value"),
        },
        // IR < 2 files have no type field: infer it from the field in use.
        T::Undefined => {
            if let Some(i) = a.i {
                Attr::Int(i)
            } else if let Some(f) = a.f {
                Attr::Float(f as f64)
            } else if let Some(s) = &a.s {
                Attr::String(text(s))
            } else if let Some(t) = &a.t {
                Attr::Tensor(decode_tensor(t, files)?)
            } else if !a.ints.is_empty() {
                Attr::Ints(a.ints.clone())
            } else if !a.floats.is_empty() {
                Attr::Floats(a.floats.iter().map(|&f| f as f64).collect())
            } else if !a.strings.is_empty() {
                Attr::Strings(a.strings.iter().map(text).collect())
            } else {
                Attr::Ints(vec![])
            }
        }
        T::Tensors => Attr::Other("TENSORS"),
        T::Graphs => Attr::Other("GRAPHS"),
        T::SparseTensor => Attr::Other("SPARSE_TENSOR"),
        T::SparseTensors => Attr::Other("SPARSE_TENSORS"),
        T::TypeProto => Attr::Other("TYPE_PROTO"),
        T::TypeProtos => Attr::Other("TYPE_PROTOS"),
    })
}

/// A `TensorProto` holding `t` as raw data (for models built in memory).
pub fn encode_tensor(name: &str, t: &HostTensor) -> proto::TensorProto {
    proto::TensorProto {
        name: Some(name.to_string()),
        dims: t.dims.iter().map(|&d| d as i64).collect(),
        data_type: Some(code_of_dtype(t.dtype)),
        raw_data: Some(t.bytes.clone()),
        ..Default::default()
    }
}

/// An `AttributeProto` holding `a` (for models built in memory).
pub fn encode_attr(name: &str, a: &Attr) -> proto::AttributeProto {
    use proto::attribute_proto::AttributeType as T;
    let mut p = proto::AttributeProto { name: Some(name.to_string()), ..Default::default() };
    let ty = match a {
        Attr::Int(v) => {
            p.i = Some(*v);
            T::Int
        }
        Attr::Float(v) => {
            p.f = Some(*v as f32);
            T::Float
        }
        Attr::String(s) => {
            p.s = Some(Bytes::from(s.clone().into_bytes()));
            T::String
        }
        Attr::Ints(v) => {
            p.ints = v.clone();
            T::Ints
        }
        Attr::Floats(v) => {
            p.floats = v.iter().map(|&f| f as f32).collect();
            T::Floats
        }
        Attr::Strings(v) => {
            p.strings = v.iter().map(|s| Bytes::from(s.clone().into_bytes())).collect();
            T::Strings
        }
        Attr::Tensor(t) => {
            p.t = Some(encode_tensor("", t));
            T::Tensor
        }
        Attr::Graph(g) => {
            p.g = Some((**g).clone());
            T::Graph
        }
        Attr::Other(_) => T::Undefined,
    };
    p.r#type = Some(ty as i32);
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declared_sizes_are_checked_before_allocation() {
        let files = ExternalFiles::new(None);
        let t = proto::TensorProto {
            name: Some("w".into()),
            dims: vec![1 << 40, 1 << 40],
            data_type: Some(1),
            ..Default::default()
        };
        let e = decode_tensor(&t, &files).unwrap_err().to_string();
        assert!(e.contains("w") && e.contains("overflow"), "{e}");
        let t = proto::TensorProto { dims: vec![1 << 30], data_type: Some(1), float_data: vec![1.0], ..t };
        let e = decode_tensor(&t, &files).unwrap_err().to_string();
        assert!(e.contains("1 values in float_data"), "{e}");
        let t = proto::TensorProto { float_data: vec![], raw_data: Some(Bytes::from_static(&[0; 8])), ..t };
        assert!(decode_tensor(&t, &files).unwrap_err().to_string().contains("raw data holds 8 bytes"));
    }

    #[test]
    fn typed_fields_decode_to_canonical_bytes() {
        let files = ExternalFiles::new(None);
        let t =
            proto::TensorProto { dims: vec![3], data_type: Some(9), int32_data: vec![1, 0, 5], ..Default::default() };
        let h = decode_tensor(&t, &files).unwrap();
        assert_eq!(h.scalars(), vec![ScalarValue::Bool(true), ScalarValue::Bool(false), ScalarValue::Bool(true)]);
        let t = proto::TensorProto {
            dims: vec![2],
            data_type: Some(7),
            int64_data: vec![-3, 1 << 40],
            ..Default::default()
        };
        let h = decode_tensor(&t, &files).unwrap();
        assert_eq!(h.to_i64s(), vec![-3, 1 << 40]);
        assert!(h.narrowed().is_none());
        let small = HostTensor::from_i64s(&[-3, 7], vec![2]).narrowed().unwrap();
        assert_eq!((small.dtype, small.to_i64s()), (DType::I32, vec![-3, 7]));
    }

    #[test]
    fn external_paths_stay_in_the_model_folder() {
        let dir = std::env::temp_dir().join(format!("lazuli-onnx-ext-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("w.bin"), [0u8; 16]).unwrap();
        let files = ExternalFiles::new(Some(dir.clone()));
        let ext = |loc: &str, off: &str, len: &str| proto::TensorProto {
            name: Some("w".into()),
            dims: vec![2],
            data_type: Some(1),
            data_location: Some(1),
            external_data: [("location", loc), ("offset", off), ("length", len)]
                .iter()
                .map(|(k, v)| proto::StringStringEntryProto { key: Some(k.to_string()), value: Some(v.to_string()) })
                .collect(),
            ..Default::default()
        };
        assert_eq!(decode_tensor(&ext("w.bin", "8", "8"), &files).unwrap().bytes.len(), 8);
        for (loc, off, len, want) in [
            ("../w.bin", "0", "8", "leaves the model's folder"),
            ("/etc/passwd", "0", "8", "leaves the model's folder"),
            ("w.bin", "12", "8", "past the end"),
            ("w.bin", "18446744073709551615", "8", "past the end"),
            ("w.bin", "0", "16", "the tensor needs 8"),
        ] {
            let e = decode_tensor(&ext(loc, off, len), &files).unwrap_err().to_string();
            assert!(e.contains(want), "{loc} {off} {len}: {e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
