//! The GGUF reader: a memory-mapped file, its metadata, its tensor infos
//! and the bytes of each tensor, every size and offset checked against the
//! file before anything is allocated or indexed.
//!
//! Layout (GGUF v2 and v3, little-endian): magic `GGUF`, version, tensor
//! count and metadata count (u64), the metadata key/value pairs (typed
//! values, arrays of them, length-prefixed strings), the tensor infos
//! (name, dims innermost first, GGML type, offset into the data section),
//! then the data section at the next multiple of `general.alignment`
//! (default 32).
//!
//! A file is untrusted input. Every count and length read from it is
//! bounded by the bytes that remain before it is used: a string or array
//! longer than the rest of the file, a tensor whose bytes lie beyond it,
//! overlapping tensors, an unknown type, dims whose product overflows, are
//! each a [`GgufError`] naming the offending item, and nothing is
//! allocated at a size the file declares before that check (collections
//! grow as items parse). Big-endian files (GGUF from s390x) are refused.
//!
//! Why our own reader: the Rust GGUF crates we looked at allocate
//! `Vec::with_capacity(declared_count)` straight from the header or copy
//! tensor data into owned vectors; a reader over a memory map with these
//! checks is a few hundred lines.

use memmap2::Mmap;
use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

/// What can be wrong with a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened or mapped.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Not a GGUF file, or a version this reader does not read.
    #[error("not a GGUF file we can read: {0}")]
    Header(String),
    /// The file ends (or a declared length runs) before an item does.
    #[error("truncated GGUF: {what} at byte {at} needs {need} bytes, {left} remain")]
    Truncated {
        /// The item being read.
        what: String,
        /// Its offset.
        at: u64,
        /// Bytes it needs.
        need: u64,
        /// Bytes left in the file.
        left: u64,
    },
    /// A metadata value of an unknown type.
    #[error("metadata {key}: unknown value type {ty}")]
    ValueType {
        /// The key.
        key: String,
        /// The type id.
        ty: u32,
    },
    /// A string that is not UTF-8.
    #[error("{what}: a string that is not UTF-8")]
    Utf8 {
        /// Where.
        what: String,
    },
    /// A tensor of an unknown GGML type id.
    #[error("tensor {tensor}: unknown GGML type {ty}")]
    TensorType {
        /// The tensor.
        tensor: String,
        /// The type id.
        ty: u32,
    },
    /// A tensor whose shape or placement cannot be right.
    #[error("tensor {tensor}: {detail}")]
    Tensor {
        /// The tensor.
        tensor: String,
        /// What is wrong.
        detail: String,
    },
    /// A metadata key is missing or has another type than the model needs.
    #[error("metadata {key}: {detail}")]
    Metadata {
        /// The key.
        key: String,
        /// What is wrong.
        detail: String,
    },
}

/// A GGML tensor type: its id, name and block layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GgmlType {
    /// The id written in files.
    pub id: u32,
    /// GGML's name (`q4_K`, `f16`, ...).
    pub name: &'static str,
    /// Values per block.
    pub block_len: usize,
    /// Bytes per block.
    pub block_bytes: usize,
}

/// Every GGML type id a file may use, with its block layout (ggml.c's
/// `type_traits`). Ids 4 and 5 (the removed Q4_2 and Q4_3) and 31..=33
/// (removed Q4_0 repackings) are gone from GGML and refused.
pub const GGML_TYPES: &[GgmlType] = &[
    t(0, "f32", 1, 4),
    t(1, "f16", 1, 2),
    t(2, "q4_0", 32, 18),
    t(3, "q4_1", 32, 20),
    t(6, "q5_0", 32, 22),
    t(7, "q5_1", 32, 24),
    t(8, "q8_0", 32, 34),
    t(9, "q8_1", 32, 36),
    t(10, "q2_K", 256, 84),
    t(11, "q3_K", 256, 110),
    t(12, "q4_K", 256, 144),
    t(13, "q5_K", 256, 176),
    t(14, "q6_K", 256, 210),
    t(15, "q8_K", 256, 292),
    t(16, "iq2_xxs", 256, 66),
    t(17, "iq2_xs", 256, 74),
    t(18, "iq3_xxs", 256, 98),
    t(19, "iq1_s", 256, 50),
    t(20, "iq4_nl", 32, 18),
    t(21, "iq3_s", 256, 110),
    t(22, "iq2_s", 256, 82),
    t(23, "iq4_xs", 256, 136),
    t(24, "i8", 1, 1),
    t(25, "i16", 1, 2),
    t(26, "i32", 1, 4),
    t(27, "i64", 1, 8),
    t(28, "f64", 1, 8),
    t(29, "iq1_m", 256, 56),
    t(30, "bf16", 1, 2),
    t(34, "tq1_0", 256, 54),
    t(35, "tq2_0", 256, 66),
    t(39, "mxfp4", 32, 17),
];

const fn t(id: u32, name: &'static str, block_len: usize, block_bytes: usize) -> GgmlType {
    GgmlType { id, name, block_len, block_bytes }
}

impl GgmlType {
    /// The type of id `id`, if GGML has one.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GGML_TYPES.iter().copied().find(|t| t.id == id)
    }

    /// The engine's format for this type, where it runs quantized
    /// (`None` for f32, which is a plain tensor, and for types the engine
    /// does not decode).
    pub fn quant_format(&self) -> Option<lazuli_ir::QuantFormat> {
        use lazuli_ir::QuantFormat as Q;
        Some(match self.id {
            1 => Q::F16,
            2 => Q::Q4_0,
            6 => Q::Q5_0,
            8 => Q::Q8_0,
            12 => Q::Q4K,
            14 => Q::Q6K,
            30 => Q::BF16,
            _ => return None,
        })
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Any unsigned integer type (u8 .. u64).
    U64(u64),
    /// Any signed integer type (i8 .. i64).
    I64(i64),
    /// f32 or f64.
    F64(f64),
    /// A bool.
    Bool(bool),
    /// A UTF-8 string.
    Str(String),
    /// An array of values (of one type in the file).
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(v) => Some(v),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => None,
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor's description.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Its name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dims as GGML orders them: innermost (contiguous) first.
    pub ggml_dims: Vec<usize>,
    /// Its type.
    pub ty: GgmlType,
    /// Offset of its bytes from the start of the file (checked in range).
    pub start: usize,
    /// Its size in bytes.
    pub bytes: usize,
}

impl TensorInfo {
    /// Dims in row-major order (outermost first), as tensors use them.
    pub fn dims(&self) -> Vec<usize> {
        self.ggml_dims.iter().rev().copied().collect()
    }

    /// Elements.
    pub fn numel(&self) -> usize {
        self.ggml_dims.iter().product()
    }
}

/// A memory-mapped GGUF file: metadata and tensor infos parsed and
/// checked; tensor bytes borrowed from the map.
pub struct GgufFile {
    map: Contents,
    /// The file, for reading tensors without touching the map (see
    /// [`GgufFile::read`]); `None` for bytes held in memory.
    file: Option<File>,
    /// The GGUF version (2 or 3).
    pub version: u32,
    /// Metadata by key.
    pub metadata: BTreeMap<String, Value>,
    /// Tensors in file order.
    pub tensors: Vec<TensorInfo>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps and parses `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let io = |source| GgufError::Io { path: path.to_path_buf(), source };
        let file = File::open(path).map_err(io)?;
        let mut f = GgufFile::parse(map(&file).map_err(io)?)?;
        f.file = Some(file);
        Ok(f)
    }

    /// Parses a file's bytes held in memory (tests, fuzzing, files
    /// fetched rather than opened).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        GgufFile::parse(Contents::Owned(bytes))
    }

    /// Parses a file's contents.
    fn parse(map: Contents) -> Result<GgufFile, GgufError> {
        let (version, metadata, tensors) = {
            let mut r = Reader { data: &map, at: 0 };
            let magic = r.bytes(4, "magic")?;
            if magic != b"GGUF" {
                return Err(GgufError::Header(format!("magic {magic:02x?}, expected \"GGUF\"")));
            }
            let version = r.u32("version")?;
            if version == 0 || version > 0xFFFF {
                return Err(GgufError::Header(format!(
                    "version {version:#x} (a big-endian file, or not GGUF); this reader reads little-endian v2 and v3"
                )));
            }
            if !(2..=3).contains(&version) {
                return Err(GgufError::Header(format!("version {version}; this reader reads v2 and v3")));
            }
            let n_tensors = r.u64("tensor count")?;
            let n_kv = r.u64("metadata count")?;
            let mut metadata = BTreeMap::new();
            for i in 0..n_kv {
                let key = r.string(&format!("metadata key {i}"))?;
                let ty = r.u32(&format!("type of {key}"))?;
                let value = r.value(ty, &key, 0)?;
                metadata.insert(key, value);
            }
            let alignment = match metadata.get("general.alignment") {
                None => 32,
                Some(v) => match v.as_u64() {
                    Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a as usize,
                    _ => {
                        return Err(GgufError::Metadata {
                            key: "general.alignment".into(),
                            detail: format!("{v:?} is not a power of two up to 2^20"),
                        })
                    }
                },
            };
            let mut infos = Vec::new();
            for i in 0..n_tensors {
                let name = r.string(&format!("tensor {i} name"))?;
                let n_dims = r.u32(&format!("tensor {name} rank"))?;
                if n_dims > 8 {
                    return Err(GgufError::Tensor { tensor: name, detail: format!("rank {n_dims} (at most 8)") });
                }
                let mut dims = Vec::new();
                for d in 0..n_dims {
                    let v = r.u64(&format!("tensor {name} dim {d}"))?;
                    dims.push(usize::try_from(v).map_err(|_| GgufError::Tensor {
                        tensor: name.clone(),
                        detail: format!("dim {d} of {v} does not fit this machine"),
                    })?);
                }
                let ty_id = r.u32(&format!("tensor {name} type"))?;
                let ty = GgmlType::from_id(ty_id).ok_or(GgufError::TensorType { tensor: name.clone(), ty: ty_id })?;
                let offset = r.u64(&format!("tensor {name} offset"))?;
                infos.push((name, dims, ty, offset));
            }
            let data_start = r.at.div_ceil(alignment) * alignment;
            let mut tensors = Vec::new();
            for (name, ggml_dims, ty, offset) in infos {
                let bad = |detail: String| GgufError::Tensor { tensor: name.clone(), detail };
                let numel = ggml_dims
                    .iter()
                    .try_fold(1usize, |a, &d| a.checked_mul(d))
                    .ok_or_else(|| bad(format!("dims {ggml_dims:?} overflow")))?;
                let row = ggml_dims.first().copied().unwrap_or(1);
                if !row.is_multiple_of(ty.block_len) {
                    return Err(bad(format!("rows of {row} values are not whole {ty} blocks of {}", ty.block_len)));
                }
                let bytes = (numel / ty.block_len)
                    .checked_mul(ty.block_bytes)
                    .ok_or_else(|| bad(format!("{numel} {ty} values overflow")))?;
                if !offset.is_multiple_of(alignment as u64) {
                    return Err(bad(format!("offset {offset} is not a multiple of the alignment {alignment}")));
                }
                let start = usize::try_from(offset)
                    .ok()
                    .and_then(|o| o.checked_add(data_start))
                    .ok_or_else(|| bad(format!("offset {offset} overflows")))?;
                let end = start.checked_add(bytes).ok_or_else(|| bad(format!("offset {offset} overflows")))?;
                if end > map.len() {
                    return Err(bad(format!(
                        "its {bytes} bytes at {start}..{end} lie beyond the end of the file ({} bytes)",
                        map.len()
                    )));
                }
                tensors.push(TensorInfo { name, ggml_dims, ty, start, bytes });
            }
            // No two tensors may share bytes.
            let mut spans: Vec<(usize, usize, &str)> =
                tensors.iter().filter(|t| t.bytes > 0).map(|t| (t.start, t.start + t.bytes, t.name.as_str())).collect();
            spans.sort();
            for w in spans.windows(2) {
                if w[1].0 < w[0].1 {
                    return Err(GgufError::Tensor {
                        tensor: w[1].2.to_string(),
                        detail: format!("its bytes overlap those of {}", w[0].2),
                    });
                }
            }
            let mut seen = std::collections::BTreeSet::new();
            for t in &tensors {
                if !seen.insert(t.name.as_str()) {
                    return Err(GgufError::Tensor { tensor: t.name.clone(), detail: "named twice".into() });
                }
            }
            (version, metadata, tensors)
        };
        Ok(GgufFile { map, file: None, version, metadata, tensors })
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The bytes of `info` (checked in range when the file was parsed).
    pub fn data(&self, info: &TensorInfo) -> &[u8] {
        &self.map[info.start..info.start + info.bytes]
    }

    /// A copy of the bytes of `info`, read from the file with positional
    /// reads rather than through the map: the loader copies every weight
    /// once, and pages touched through the map would stay counted in the
    /// process's resident memory until the map goes (doubling the peak).
    pub fn read(&self, info: &TensorInfo) -> std::io::Result<Vec<u8>> {
        let Some(file) = &self.file else { return Ok(self.data(info).to_vec()) };
        let mut buf = Vec::new();
        buf.try_reserve_exact(info.bytes).map_err(|e| std::io::Error::new(std::io::ErrorKind::OutOfMemory, e))?;
        buf.resize(info.bytes, 0);
        read_at(file, &mut buf, info.start as u64)?;
        Ok(buf)
    }

    /// The size of the mapped file in bytes.
    pub fn file_bytes(&self) -> usize {
        self.map.len()
    }

    /// Metadata value `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// Metadata string `key`, required.
    pub fn str(&self, key: &str) -> Result<&str, GgufError> {
        self.get(key).and_then(Value::as_str).ok_or_else(|| missing(key, "a string"))
    }

    /// Metadata integer `key`, required.
    pub fn usize(&self, key: &str) -> Result<usize, GgufError> {
        self.get(key)
            .and_then(Value::as_u64)
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| missing(key, "a non-negative integer"))
    }

    /// Metadata number `key`, if present.
    pub fn f64_or(&self, key: &str, default: f64) -> Result<f64, GgufError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| missing(key, "a number")),
        }
    }
}

/// A file's bytes: mapped, or owned.
enum Contents {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Contents {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Contents::Mapped(m) => m,
            Contents::Owned(v) => v,
        }
    }
}

/// Maps `file` read-only (an empty file, which cannot be mapped, is empty
/// bytes).
// Mapping is `unsafe` because another process could change the file
// while it is mapped; a model rewritten while it loads is outside what
// this API promises (as for `serialize`'s safetensors maps and every
// mmap-based loader: llama.cpp, safetensors' `safe_open`).
#[allow(unsafe_code)]
fn map(file: &File) -> std::io::Result<Contents> {
    if file.metadata()?.len() == 0 {
        return Ok(Contents::Owned(Vec::new()));
    }
    // SAFETY: a read-only map of a file we opened; see the comment above.
    Ok(Contents::Mapped(unsafe { Mmap::map(file) }?))
}

/// Fills `buf` from `file` at `offset`.
#[cfg(unix)]
fn read_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
}

/// Fills `buf` from `file` at `offset`.
#[cfg(not(unix))]
fn read_at(mut file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    file.seek(SeekFrom::Start(offset))?;
    file.read_exact(buf)
}

fn missing(key: &str, what: &str) -> GgufError {
    GgufError::Metadata { key: key.into(), detail: format!("missing or not {what}") }
}

/// Bounds-checked little-endian reads over the file.
struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

/// Arrays nest at most this deep (GGUF writers nest one level).
const MAX_NESTING: u32 = 4;

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        let left = (self.data.len() - self.at) as u64;
        if n > left {
            return Err(GgufError::Truncated { what: what.to_string(), at: self.at as u64, need: n, left });
        }
        let s = &self.data[self.at..self.at + n as usize];
        self.at += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        Ok(self.bytes(N as u64, what)?.try_into().expect("N bytes taken"))
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.u64(what)?;
        let b = self.bytes(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| GgufError::Utf8 { what: what.to_string() })
    }

    /// A value of type `ty` of metadata `key`.
    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U64(u64::from(self.array::<1>(key)?[0])),
            1 => Value::I64(i64::from(self.array::<1>(key)?[0] as i8)),
            2 => Value::U64(u64::from(u16::from_le_bytes(self.array(key)?))),
            3 => Value::I64(i64::from(i16::from_le_bytes(self.array(key)?))),
            4 => Value::U64(u64::from(self.u32(key)?)),
            5 => Value::I64(i64::from(i32::from_le_bytes(self.array(key)?))),
            6 => Value::F64(f64::from(f32::from_le_bytes(self.array(key)?))),
            7 => Value::Bool(self.array::<1>(key)?[0] != 0),
            8 => Value::Str(self.string(key)?),
            9 => {
                if depth >= MAX_NESTING {
                    return Err(GgufError::Metadata { key: key.into(), detail: "arrays nested too deep".into() });
                }
                let item = self.u32(key)?;
                let n = self.u64(key)?;
                // Every item takes at least one byte: a count beyond the
                // bytes left is a truncated file, found before any item
                // is read or anything is reserved.
                let left = (self.data.len() - self.at) as u64;
                let min = match item {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    _ => return Err(GgufError::ValueType { key: key.into(), ty: item }),
                };
                if n.checked_mul(min).is_none_or(|b| b > left) {
                    return Err(GgufError::Truncated {
                        what: format!("array {key} of {n} items"),
                        at: self.at as u64,
                        need: n.saturating_mul(min),
                        left,
                    });
                }
                let mut items = Vec::new();
                for _ in 0..n {
                    items.push(self.value(item, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(i64::from_le_bytes(self.array(key)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(key)?)),
            _ => return Err(GgufError::ValueType { key: key.into(), ty }),
        })
    }
}
