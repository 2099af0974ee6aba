//! Typed conformance cases: the JSON files of `shared/conformance/onnx`
//! (one file per ONNX operator, one case per single-node ONNX test) parsed
//! into [`OpFile`], [`Case`], [`TensorData`] and [`Attr`].
//!
//! [`Case::to_model`] turns a case into a one-node model, so that the
//! suite runs through [`super::Model`] like any model: inputs the
//! operator reads on the host (shapes, axes, bounds: [`super::host_slots`])
//! become initializers, as exporters write them, the others graph inputs.
//!
//! Values are kept exactly: floats as `f64` (an `f32` or `f16` value is
//! exact in `f64`, and `serde_json`'s `float_roundtrip` feature makes the
//! `f64` data exact too), integers as `i64` / `u64`, booleans as `bool`;
//! the strings `"nan"`, `"inf"` and `"-inf"` become the special floats.

use super::data::{encode_attr, encode_tensor, Attr, HostTensor};
use super::map::host_slots;
use super::proto;
use lazuli_executor::scalar_bytes;
use lazuli_ir::{DType, ScalarValue, Shape, ValueType};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// One file: every case of one ONNX operator.
#[derive(Clone, Debug)]
pub struct OpFile {
    /// The ONNX operator type, e.g. `"Add"`.
    pub op: String,
    /// Where the cases come from.
    pub source: String,
    /// The cases, in file order.
    pub cases: Vec<Case>,
}

/// One single-node ONNX test.
#[derive(Clone, Debug)]
pub struct Case {
    /// The ONNX test's name, e.g. `test_add_bcast`.
    pub name: String,
    /// The default-domain opset the model imports.
    pub opset: i64,
    /// The node's attributes as stored (absent ones take their default).
    pub attrs: BTreeMap<String, Attr>,
    /// Inputs in ONNX slot order; `None` where an optional input is omitted.
    pub inputs: Vec<Option<TensorData>>,
    /// Expected outputs in slot order; `None` where an output is not checked.
    pub outputs: Vec<Option<TensorData>>,
}

/// A tensor value stored in a case.
#[derive(Clone, Debug)]
pub struct TensorData {
    /// The ONNX value name (informational).
    pub name: Option<String>,
    /// Element type.
    pub dtype: DType,
    /// Dimension sizes (`[]` is a scalar).
    pub shape: Vec<usize>,
    /// The elements in row-major order, one [`ScalarValue`] each (`Float`
    /// for float dtypes, `Int` / `UInt` for signed / unsigned, `Bool`).
    pub data: Vec<ScalarValue>,
}

/// A conformance file that cannot be read or does not follow the format.
#[derive(Debug, Error)]
pub enum CaseError {
    /// The file or folder could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid JSON.
    #[error("{path}: {source}")]
    Json {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// The JSON does not follow the case format.
    #[error("{path}: {detail}")]
    Format {
        /// The path.
        path: PathBuf,
        /// What is wrong, naming the case and field.
        detail: String,
    },
}

impl Case {
    /// The case as a one-node model of operator `op`: `x{i}` inputs, `y{i}`
    /// outputs (one per checked output; slots past them unnamed).
    pub fn to_model(&self, op: &str) -> proto::ModelProto {
        let hosted = host_slots(op, self.opset);
        let mut graph = proto::GraphProto { name: Some(self.name.clone()), ..Default::default() };
        let mut inputs = vec![];
        for (i, d) in self.inputs.iter().enumerate() {
            let Some(d) = d else {
                inputs.push(String::new());
                continue;
            };
            let name = format!("x{i}");
            if hosted.contains(&i) {
                graph.initializer.push(encode_tensor(&name, &d.to_host()));
            } else {
                graph.input.push(value_info(&name, d));
            }
            inputs.push(name);
        }
        while inputs.last().is_some_and(String::is_empty) {
            inputs.pop();
        }
        let outputs: Vec<String> = (0..self.outputs.len()).map(|i| format!("y{i}")).collect();
        for (i, d) in self.outputs.iter().enumerate() {
            if let Some(d) = d {
                graph.output.push(value_info(&format!("y{i}"), d));
            }
        }
        graph.node.push(proto::NodeProto {
            name: Some(self.name.clone()),
            op_type: Some(op.to_string()),
            input: inputs,
            output: outputs,
            attribute: self.attrs.iter().map(|(k, a)| encode_attr(k, a)).collect(),
            ..Default::default()
        });
        proto::ModelProto {
            ir_version: Some(8),
            opset_import: vec![proto::OperatorSetIdProto { domain: Some(String::new()), version: Some(self.opset) }],
            graph: Some(graph),
            ..Default::default()
        }
    }

    /// The graph inputs of [`Case::to_model`]'s model with their values.
    pub fn model_inputs(&self, op: &str) -> Vec<(String, &TensorData)> {
        let hosted = host_slots(op, self.opset);
        self.inputs
            .iter()
            .enumerate()
            .filter_map(|(i, d)| d.as_ref().filter(|_| !hosted.contains(&i)).map(|d| (format!("x{i}"), d)))
            .collect()
    }
}

fn value_info(name: &str, d: &TensorData) -> proto::ValueInfoProto {
    use proto::tensor_shape_proto::{dimension, Dimension};
    let dims =
        d.shape.iter().map(|&n| Dimension { value: Some(dimension::Value::DimValue(n as i64)), ..Default::default() });
    proto::ValueInfoProto {
        name: Some(name.to_string()),
        r#type: Some(proto::TypeProto {
            value: Some(proto::type_proto::Value::TensorType(proto::type_proto::Tensor {
                elem_type: Some(super::data::code_of_dtype(d.dtype)),
                shape: Some(proto::TensorShapeProto { dim: dims.collect() }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

impl TensorData {
    /// Shape and dtype as an IR value type.
    pub fn ty(&self) -> ValueType {
        ValueType::new(Shape::new(self.shape.clone()), self.dtype)
    }

    /// The canonical little-endian bytes of the data (what
    /// [`crate::Tensor::from_bytes`] takes).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.data.len() * self.dtype.size_bytes());
        for &v in &self.data {
            out.extend(scalar_bytes(v, self.dtype));
        }
        out
    }

    /// The elements as `i64` (floats truncate), for shape-like inputs.
    pub fn to_i64s(&self) -> Vec<i64> {
        self.data.iter().map(|v| v.as_i64()).collect()
    }

    /// The same tensor as a [`HostTensor`].
    pub fn to_host(&self) -> HostTensor {
        HostTensor { dtype: self.dtype, dims: self.shape.clone(), bytes: self.to_bytes().into() }
    }

    /// The elements as `f64`.
    pub fn to_f64s(&self) -> Vec<f64> {
        self.data.iter().map(|v| v.as_f64()).collect()
    }
}

/// Reads every `*.json` file of `dir`, sorted by file name.
pub fn load_dir(dir: &Path) -> Result<Vec<OpFile>, CaseError> {
    let io = |source| CaseError::Io { path: dir.to_path_buf(), source };
    let mut paths: Vec<PathBuf> =
        std::fs::read_dir(dir).map_err(io)?.map(|e| e.map(|e| e.path())).collect::<Result<_, _>>().map_err(io)?;
    paths.retain(|p| p.extension().is_some_and(|e| e == "json"));
    paths.sort();
    paths.iter().map(|p| load_file(p)).collect()
}

/// Reads one conformance file.
pub fn load_file(path: &Path) -> Result<OpFile, CaseError> {
    let text = std::fs::read_to_string(path).map_err(|source| CaseError::Io { path: path.to_path_buf(), source })?;
    parse_file(&text).map_err(|e| match e {
        ParseError::Json(source) => CaseError::Json { path: path.to_path_buf(), source },
        ParseError::Format(detail) => CaseError::Format { path: path.to_path_buf(), detail },
    })
}

enum ParseError {
    Json(serde_json::Error),
    Format(String),
}

fn fmt_err(detail: impl Into<String>) -> ParseError {
    ParseError::Format(detail.into())
}

fn parse_file(text: &str) -> Result<OpFile, ParseError> {
    let v: Value = serde_json::from_str(text).map_err(ParseError::Json)?;
    let op = v.get("op").and_then(Value::as_str).ok_or_else(|| fmt_err("missing string field `op`"))?.to_string();
    let source = v.get("source").and_then(Value::as_str).unwrap_or_default().to_string();
    let cases = v
        .get("cases")
        .and_then(Value::as_array)
        .ok_or_else(|| fmt_err("missing array field `cases`"))?
        .iter()
        .enumerate()
        .map(|(i, c)| parse_case(c).map_err(|e| prefix(e, &format!("case {i}"))))
        .collect::<Result<_, _>>()?;
    Ok(OpFile { op, source, cases })
}

fn prefix(e: ParseError, what: &str) -> ParseError {
    match e {
        ParseError::Format(d) => ParseError::Format(format!("{what}: {d}")),
        other => other,
    }
}

fn parse_case(v: &Value) -> Result<Case, ParseError> {
    let name = v.get("name").and_then(Value::as_str).ok_or_else(|| fmt_err("missing `name`"))?.to_string();
    let inner = || -> Result<Case, ParseError> {
        let opset = v.get("opset").and_then(Value::as_i64).ok_or_else(|| fmt_err("missing integer `opset`"))?;
        let mut attrs = BTreeMap::new();
        if let Some(obj) = v.get("attrs") {
            let obj = obj.as_object().ok_or_else(|| fmt_err("`attrs` is not an object"))?;
            for (k, a) in obj {
                attrs.insert(k.clone(), parse_attr(a).map_err(|e| prefix(e, &format!("attribute {k:?}")))?);
            }
        }
        let tensors = |field: &str| -> Result<Vec<Option<TensorData>>, ParseError> {
            v.get(field)
                .and_then(Value::as_array)
                .ok_or_else(|| fmt_err(format!("missing array `{field}`")))?
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    if t.is_null() {
                        Ok(None)
                    } else {
                        parse_tensor(t).map(Some).map_err(|e| prefix(e, &format!("{field}[{i}]")))
                    }
                })
                .collect()
        };
        Ok(Case { name: name.clone(), opset, attrs, inputs: tensors("inputs")?, outputs: tensors("outputs")? })
    };
    inner().map_err(|e| prefix(e, &name))
}

fn parse_attr(v: &Value) -> Result<Attr, ParseError> {
    Ok(match v {
        Value::Number(n) => match n.as_i64() {
            Some(i) if !n.is_f64() => Attr::Int(i),
            _ => Attr::Float(n.as_f64().ok_or_else(|| fmt_err("number out of range"))?),
        },
        Value::String(s) => Attr::String(s.clone()),
        Value::Array(items) => {
            if items.iter().all(Value::is_string) && !items.is_empty() {
                Attr::Strings(items.iter().map(|s| s.as_str().unwrap_or_default().to_string()).collect())
            } else if items.iter().all(|x| x.as_i64().is_some() && !x.is_f64()) {
                Attr::Ints(items.iter().filter_map(Value::as_i64).collect())
            } else {
                Attr::Floats(
                    items
                        .iter()
                        .map(|x| float_value(x).ok_or_else(|| fmt_err(format!("bad list element {x}"))))
                        .collect::<Result<_, _>>()?,
                )
            }
        }
        Value::Object(_) => Attr::Tensor(parse_tensor(v)?.to_host()),
        other => return Err(fmt_err(format!("unexpected attribute value {other}"))),
    })
}

fn float_value(x: &Value) -> Option<f64> {
    match x {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => match s.as_str() {
            "nan" => Some(f64::NAN),
            "inf" => Some(f64::INFINITY),
            "-inf" => Some(f64::NEG_INFINITY),
            _ => None,
        },
        _ => None,
    }
}

fn parse_tensor(v: &Value) -> Result<TensorData, ParseError> {
    let name = v.get("name").and_then(Value::as_str).map(str::to_string);
    let dtype_name = v.get("dtype").and_then(Value::as_str).ok_or_else(|| fmt_err("missing `dtype`"))?;
    let dtype = DType::from_name(dtype_name).ok_or_else(|| fmt_err(format!("unknown dtype {dtype_name:?}")))?;
    let shape = v
        .get("shape")
        .and_then(Value::as_array)
        .ok_or_else(|| fmt_err("missing `shape`"))?
        .iter()
        .map(|d| d.as_u64().map(|d| d as usize).ok_or_else(|| fmt_err(format!("bad dimension {d}"))))
        .collect::<Result<Vec<_>, _>>()?;
    let raw = v.get("data").and_then(Value::as_array).ok_or_else(|| fmt_err("missing `data`"))?;
    let numel: usize = shape.iter().product();
    if raw.len() != numel {
        return Err(fmt_err(format!("{} values for shape {shape:?} ({numel} elements)", raw.len())));
    }
    let bad = |x: &Value| fmt_err(format!("value {x} is not a {dtype}"));
    let data = raw
        .iter()
        .map(|x| match dtype {
            DType::Bool => x.as_bool().map(ScalarValue::Bool).ok_or_else(|| bad(x)),
            d if d.is_float() => float_value(x).map(ScalarValue::Float).ok_or_else(|| bad(x)),
            d if d.is_unsigned_int() => x.as_u64().map(ScalarValue::UInt).ok_or_else(|| bad(x)),
            _ => x.as_i64().map(ScalarValue::Int).ok_or_else(|| bad(x)),
        })
        .collect::<Result<_, _>>()?;
    Ok(TensorData { name, dtype, shape, data })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specials_nulls_and_attrs() {
        let text = r#"{"op": "Clip", "source": "s", "cases": [
          {"name": "t", "opset": 13, "attrs": {"alpha": 0.5, "axis": -1, "mode": "edge", "perm": [1, 0],
            "value": {"dtype": "i32", "shape": [1], "data": [7]}},
           "inputs": [{"name": "x", "dtype": "f32", "shape": [3], "data": ["nan", "-inf", -0.0]}, null,
                      {"name": "m", "dtype": "u8", "shape": [], "data": [255]}],
           "outputs": [{"name": "y", "dtype": "bool", "shape": [0], "data": []}]}]}"#;
        let Ok(f) = parse_file(text) else { panic!("parse failed") };
        let c = &f.cases[0];
        assert!(matches!(c.attrs["alpha"], Attr::Float(a) if a == 0.5));
        assert!(matches!(c.attrs["axis"], Attr::Int(-1)));
        assert!(matches!(&c.attrs["perm"], Attr::Ints(p) if p == &[1, 0]));
        assert!(matches!(&c.attrs["value"], Attr::Tensor(t) if t.dtype == DType::I32 && t.to_i64s() == [7]));
        let x = c.inputs[0].as_ref().unwrap().to_f64s();
        assert!(x[0].is_nan() && x[1] == f64::NEG_INFINITY && x[2].is_sign_negative());
        assert!(c.inputs[1].is_none());
        assert_eq!(c.inputs[2].as_ref().unwrap().to_bytes(), vec![255]);
        assert_eq!(c.outputs[0].as_ref().unwrap().shape, vec![0]);
    }

    #[test]
    fn wrong_length_is_a_format_error() {
        let text = r#"{"op": "Abs", "cases": [{"name": "t", "opset": 13, "attrs": {},
            "inputs": [{"dtype": "f32", "shape": [2], "data": [1.0]}], "outputs": []}]}"#;
        match parse_file(text) {
            Err(ParseError::Format(d)) => assert!(d.contains("t") && d.contains("inputs[0]"), "{d}"),
            _ => panic!("expected a format error"),
        }
    }
}
