//! `lazuli run MODEL.onnx`: the command's logic as a library function, so
//! any command-line front end parses into [`RunArgs`] and calls [`run`].
//!
//! Inputs come from `.npy` files (`--input NAME=FILE.npy`, read with
//! `npyz`) or are random with their declared shapes, symbolic dims taken
//! from `--dim NAME=SIZE`. The model runs `--repeat N` times (default 5);
//! the report gives each output's name, shape, dtype and statistics, the
//! first run's time (compile included), the median of the runs, kernels
//! per run, fallback ops and compiles. `--save DIR` writes the outputs as
//! `DIR/NAME.npy`; `--json` prints one JSON object; `--check` only loads
//! the model and lists what Lazuli cannot run (non-zero exit if anything).

use super::error::OnnxError;
use super::graph::{Dim, ValueInfo};
use super::model::Model;
use crate::{Device, DeviceExt, DeviceKind, Tensor};
use lazuli_executor::{metrics, platform::Instant, HostRng};
use lazuli_ir::{DType, ScalarValue};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// What `lazuli run --help` prints.
pub const USAGE: &str = "lazuli run MODEL.onnx [--input NAME=FILE.npy ...] [--dim NAME=SIZE ...]
           [--device cpu|wgpu] [--repeat N] [--save DIR] [--json] [--check]
    run an ONNX model: inputs from .npy files or random with their declared shapes (symbolic
    dims from --dim; random floats in [0, 1), integers in [0, 10), booleans fair); prints each
    output's shape, dtype and statistics, the first run's time (compile included), the median
    of --repeat runs (default 5), kernels per run and fallback ops. --save DIR writes each
    output as DIR/NAME.npy (characters outside [A-Za-z0-9_.-] of NAME replaced by _); --json
    prints one JSON object; --check only loads the model and lists every unsupported node
    (exit status 1 when there is one)";

/// The parsed arguments of `lazuli run`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunArgs {
    /// The model file.
    pub model: PathBuf,
    /// `--input NAME=FILE.npy`.
    pub inputs: Vec<(String, PathBuf)>,
    /// `--dim NAME=SIZE`.
    pub dims: Vec<(String, usize)>,
    /// `--device` (default: `Device::default()`).
    pub device: Option<DeviceKind>,
    /// `--repeat N` (at least 1).
    pub repeat: usize,
    /// `--save DIR`.
    pub save: Option<PathBuf>,
    /// `--json`.
    pub json: bool,
    /// `--check`.
    pub check: bool,
}

impl RunArgs {
    /// Parses the arguments after `run`.
    pub fn parse(args: &[String]) -> Result<RunArgs, String> {
        let mut out = RunArgs { repeat: 5, ..Default::default() };
        let mut model = None;
        let mut it = args.iter();
        let pair = |flag: &str, v: Option<&String>| -> Result<(String, String), String> {
            let v = v.ok_or_else(|| format!("{flag} needs NAME=VALUE"))?;
            let (k, x) = v.split_once('=').ok_or_else(|| format!("{flag} needs NAME=VALUE, got {v:?}"))?;
            Ok((k.to_string(), x.to_string()))
        };
        while let Some(a) = it.next() {
            match a.as_str() {
                "--input" => {
                    let (k, v) = pair("--input", it.next())?;
                    out.inputs.push((k, PathBuf::from(v)));
                }
                "--dim" => {
                    let (k, v) = pair("--dim", it.next())?;
                    let n = v.parse().map_err(|_| format!("--dim {k}={v}: not a size"))?;
                    out.dims.push((k, n));
                }
                "--device" => {
                    out.device = Some(match it.next().map(String::as_str) {
                        Some("cpu") => DeviceKind::Cpu,
                        Some("wgpu") => DeviceKind::Wgpu,
                        other => return Err(format!("--device takes cpu or wgpu, got {other:?}")),
                    })
                }
                "--repeat" => {
                    let v = it.next().ok_or("--repeat needs a count")?;
                    out.repeat = v.parse().ok().filter(|&n| n > 0).ok_or(format!("--repeat {v:?}: not a count"))?;
                }
                "--save" => out.save = Some(PathBuf::from(it.next().ok_or("--save needs a folder")?)),
                "--json" => out.json = true,
                "--check" => out.check = true,
                s if s.starts_with("--") => return Err(format!("unknown option {s:?}")),
                s if model.is_none() => model = Some(PathBuf::from(s)),
                s => return Err(format!("unexpected argument {s:?} (the model is {:?})", model.unwrap_or_default())),
            }
        }
        out.model = model.ok_or("the model file is missing")?;
        Ok(out)
    }
}

/// What [`run`] produced: the text to print and whether the command
/// succeeded.
#[derive(Clone, Debug)]
pub struct RunOutcome {
    /// The report (text or one JSON object).
    pub text: String,
    /// False for `--check` with unsupported nodes.
    pub ok: bool,
}

/// Runs the command.
pub fn run(args: &RunArgs) -> Result<RunOutcome, String> {
    let err = |e: OnnxError| e.to_string();
    if args.check {
        return Ok(match Model::load(&args.model) {
            Ok(m) => RunOutcome {
                text: format!(
                    "{}: every node is supported ({} nodes, opset {})",
                    args.model.display(),
                    m.node_count(),
                    m.opset()
                ),
                ok: true,
            },
            Err(OnnxError::Unsupported(list)) => {
                let mut s = format!("{}: {} unsupported node(s)\n", args.model.display(), list.len());
                for u in &list {
                    let _ = writeln!(s, "  {u}");
                }
                RunOutcome { text: s.trim_end().to_string(), ok: false }
            }
            Err(e) => return Err(err(e)),
        });
    }
    let device = match args.device {
        Some(k) => Device::of_kind(k).map_err(|e| e.to_string())?,
        None => Device::default(),
    };
    let uncached0 = metrics::counter("UncachedCompile");
    let variants0 = metrics::counter("SizeVariantCompile");
    let t_load = Instant::now();
    let model = Model::load(&args.model).map_err(err)?;
    let load_ms = ms(t_load.elapsed());
    let declared = model.inputs();
    let inputs = make_inputs(&declared, args, &device)?;
    let named: Vec<(&str, &Tensor)> = inputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut times = Vec::with_capacity(args.repeat);
    let mut kernels = 0;
    let mut fallback_first = 0;
    let mut outputs = None;
    for i in 0..args.repeat {
        let k0 = metrics::counter("KernelLaunches");
        let f0 = metrics::counter("FallbackOps");
        let t = Instant::now();
        let outs = model.run_on(&device, &named).map_err(err)?;
        crate::sync(&outs.tensors()).map_err(|e| e.to_string())?;
        device.wait().map_err(|e| e.to_string())?;
        times.push(ms(t.elapsed()));
        kernels = metrics::counter("KernelLaunches") - k0;
        if i == 0 {
            fallback_first = metrics::counter("FallbackOps") - f0;
        }
        outputs = Some(outs);
    }
    let outputs = outputs.ok_or("no run")?;
    let first = times[0];
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    let uncached = metrics::counter("UncachedCompile") - uncached0;
    let variants = metrics::counter("SizeVariantCompile") - variants0;
    let mut rows = vec![];
    for (name, t) in outputs.iter() {
        let stats = Stats::of(t).map_err(|e| format!("reading output {name:?}: {e}"))?;
        if let Some(dir) = &args.save {
            save_npy(dir, name, t)?;
        }
        rows.push((name.to_string(), t.dims().to_vec(), t.dtype(), stats));
    }
    let text = if args.json {
        let outs: serde_json::Map<String, serde_json::Value> = rows
            .iter()
            .map(|(n, dims, dt, s)| {
                (
                    n.clone(),
                    serde_json::json!({"shape": dims, "dtype": dt.to_string(), "min": s.min, "max": s.max,
                        "mean": s.mean, "std": s.std, "nan": s.nan}),
                )
            })
            .collect();
        serde_json::json!({
            "model": args.model.display().to_string(),
            "device": device.name(),
            "load_ms": load_ms,
            "first_run_ms": first,
            "median_ms": median,
            "runs": times.len(),
            "kernels": kernels,
            "fallback_ops": fallback_first,
            "uncached_compiles": uncached,
            "size_variant_compiles": variants,
            "outputs": outs,
        })
        .to_string()
    } else {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "model: {} (opset {}, {} nodes{}), loaded in {load_ms:.1} ms",
            args.model.display(),
            model.opset(),
            model.node_count(),
            if model.producer().is_empty() { String::new() } else { format!(", from {}", model.producer()) }
        );
        let _ = writeln!(s, "device: {}", device.name());
        for (info, (_, t)) in declared.iter().zip(&inputs) {
            let from = args.inputs.iter().find(|(n, _)| *n == info.name).map(|(_, p)| p.display().to_string());
            let _ = writeln!(
                s,
                "input {}: {}{:?} ({})",
                info.name,
                t.dtype(),
                t.dims(),
                from.unwrap_or_else(|| "random".into())
            );
        }
        for (n, dims, dt, st) in &rows {
            let _ = writeln!(
                s,
                "output {n}: {dt}{dims:?}  min {:.6} max {:.6} mean {:.6} std {:.6}{}",
                st.min,
                st.max,
                st.mean,
                st.std,
                if st.nan > 0 { format!(" ({} NaN)", st.nan) } else { String::new() }
            );
        }
        let _ = writeln!(s, "first run: {first:.2} ms (compile included)");
        let _ = writeln!(s, "median of {} runs: {median:.2} ms", times.len());
        let _ = writeln!(s, "kernels per run: {kernels}");
        let _ = writeln!(s, "fallback ops: {fallback_first}");
        let _ = write!(s, "compiles: {uncached} new structures, {variants} size variants");
        s
    };
    Ok(RunOutcome { text, ok: true })
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Summary statistics of an output (over its values as `f64`).
struct Stats {
    min: f64,
    max: f64,
    mean: f64,
    std: f64,
    nan: usize,
}

impl Stats {
    fn of(t: &Tensor) -> Result<Stats, crate::ExecError> {
        let vals: Vec<f64> = t.to_scalars()?.iter().map(|v| v.as_f64()).collect();
        let nan = vals.iter().filter(|v| v.is_nan()).count();
        let finite: Vec<f64> = vals.into_iter().filter(|v| !v.is_nan()).collect();
        let n = finite.len().max(1) as f64;
        let mean = finite.iter().sum::<f64>() / n;
        let var = finite.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        Ok(Stats {
            min: finite.iter().copied().fold(f64::INFINITY, f64::min),
            max: finite.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            mean,
            std: var.sqrt(),
            nan,
        })
    }
}

/// The run's inputs in declaration order: from `--input` files, else random.
fn make_inputs(declared: &[ValueInfo], args: &RunArgs, device: &Device) -> Result<Vec<(String, Tensor)>, String> {
    for (name, _) in &args.inputs {
        if !declared.iter().any(|i| &i.name == name) {
            let names: Vec<&str> = declared.iter().map(|i| i.name.as_str()).collect();
            return Err(format!("--input {name}: the model has no such input (its inputs: {names:?})"));
        }
    }
    let dims: BTreeMap<&str, usize> = args.dims.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    let mut rng = HostRng::new(46);
    let mut out = vec![];
    for info in declared {
        if let Some((_, path)) = args.inputs.iter().find(|(n, _)| *n == info.name) {
            out.push((info.name.clone(), read_npy(path, device)?));
            continue;
        }
        let dtype = info.dtype.ok_or_else(|| format!("input {} has no Lazuli dtype", info.name))?;
        let shape: Vec<usize> = match &info.dims {
            None => return Err(format!("input {} declares no shape: give it with --input", info.name)),
            Some(ds) => ds
                .iter()
                .enumerate()
                .map(|(i, d)| match d {
                    Dim::Fixed(n) => Ok(*n),
                    Dim::Symbolic(s) => dims.get(s.as_str()).copied().ok_or_else(|| {
                        format!("dim {s} of input {} is symbolic: give it with --dim {s}=SIZE", info.name)
                    }),
                    Dim::Unknown => Err(format!(
                        "dim {i} of input {} is not declared: give the input with --input {}=FILE.npy",
                        info.name, info.name
                    )),
                })
                .collect::<Result<_, _>>()?,
        };
        let n: usize = shape.iter().product();
        let vals: Vec<ScalarValue> = (0..n)
            .map(|_| {
                let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                match dtype {
                    d if d.is_float() => ScalarValue::Float(u),
                    DType::Bool => ScalarValue::Bool(u < 0.5),
                    d if d.is_unsigned_int() => ScalarValue::UInt((u * 10.0) as u64),
                    _ => ScalarValue::Int((u * 10.0) as i64),
                }
            })
            .collect();
        let bytes: Vec<u8> = vals.iter().flat_map(|&v| lazuli_executor::scalar_bytes(v, dtype)).collect();
        let t = Tensor::from_bytes(bytes, lazuli_ir::ValueType::new(lazuli_ir::Shape::new(shape), dtype), device)
            .map_err(|e| e.to_string())?;
        out.push((info.name.clone(), t));
    }
    Ok(out)
}

/// Reads a `.npy` file (little-endian numeric dtypes, C order).
pub fn read_npy(path: &Path, device: &Device) -> Result<Tensor, String> {
    let bad = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let file = std::fs::File::open(path).map_err(|e| bad(&e))?;
    let npy = npyz::NpyFile::new(std::io::BufReader::new(file)).map_err(|e| bad(&e))?;
    if npy.order() != npyz::Order::C {
        return Err(bad(&"Fortran-order arrays are not supported"));
    }
    let shape: Vec<usize> = npy.shape().iter().map(|&d| d as usize).collect();
    let descr = match npy.dtype() {
        npyz::DType::Plain(t) => t.to_string(),
        other => return Err(bad(&format!("dtype {} is not a plain numeric dtype", other.descr()))),
    };
    macro_rules! load {
        ($t:ty) => {
            Tensor::from_slice(&npy.into_vec::<$t>().map_err(|e| bad(&e))?, shape, device).map_err(|e| bad(&e))
        };
    }
    match descr.as_str() {
        "<f4" => load!(f32),
        "<f8" => load!(f64),
        "<i8" => load!(i64),
        "<i4" => load!(i32),
        "<i2" => load!(i16),
        "|i1" => load!(i8),
        "|u1" => load!(u8),
        "<u2" => load!(u16),
        "<u4" => load!(u32),
        "<u8" => load!(u64),
        "|b1" => load!(bool),
        other => Err(bad(&format!("dtype {other} is not supported (little-endian numbers and bools are)"))),
    }
}

/// `NAME` with every character outside `[A-Za-z0-9_.-]` replaced by `_`.
pub fn file_name(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || "_.-".contains(c) { c } else { '_' }).collect()
}

/// Writes `t` as `dir/NAME.npy`.
pub fn save_npy(dir: &Path, name: &str, t: &Tensor) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join(format!("{}.npy", file_name(name)));
    let bad = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let shape: Vec<u64> = t.dims().iter().map(|&d| d as u64).collect();
    // numpy has no bf16: 16-bit floats are written as f32 (exact).
    let t = match t.dtype() {
        DType::F16 | DType::BF16 => t.cast(DType::F32).map_err(|e| bad(&e))?,
        _ => t.clone(),
    };
    let file = std::io::BufWriter::new(std::fs::File::create(&path).map_err(|e| bad(&e))?);
    macro_rules! save {
        ($t:ty) => {{
            use npyz::WriterBuilder;
            let data = t.to_vec::<$t>().map_err(|e| bad(&e))?;
            let mut w = npyz::WriteOptions::<$t>::new()
                .default_dtype()
                .shape(&shape)
                .writer(file)
                .begin_nd()
                .map_err(|e| bad(&e))?;
            w.extend(data).map_err(|e| bad(&e))?;
            w.finish().map_err(|e| bad(&e))
        }};
    }
    match t.dtype() {
        DType::F32 => save!(f32),
        DType::F64 => save!(f64),
        DType::I64 => save!(i64),
        DType::I32 => save!(i32),
        DType::I16 => save!(i16),
        DType::I8 => save!(i8),
        DType::U8 => save!(u8),
        DType::U16 => save!(u16),
        DType::U32 => save!(u32),
        DType::U64 => save!(u64),
        DType::Bool => save!(bool),
        DType::F16 | DType::BF16 => unreachable!("16-bit floats were cast to f32 above"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn parses_every_flag() {
        let a = RunArgs::parse(&args(
            "m.onnx --input ids=a.npy --dim batch=2 --dim seq=7 --device cpu --repeat 3 --save out --json",
        ))
        .unwrap();
        assert_eq!(a.model, PathBuf::from("m.onnx"));
        assert_eq!(a.inputs, vec![("ids".to_string(), PathBuf::from("a.npy"))]);
        assert_eq!(a.dims, vec![("batch".to_string(), 2), ("seq".to_string(), 7)]);
        assert_eq!((a.device, a.repeat, a.json, a.check), (Some(DeviceKind::Cpu), 3, true, false));
        assert_eq!(a.save, Some(PathBuf::from("out")));
        assert!(RunArgs::parse(&args("m.onnx --dim batch")).is_err());
        assert!(RunArgs::parse(&args("m.onnx --repeat 0")).is_err());
        assert!(RunArgs::parse(&args("--json")).is_err());
        assert!(RunArgs::parse(&args("m.onnx --frobnicate")).is_err());
    }

    #[test]
    fn output_names_become_file_names() {
        assert_eq!(file_name("gpu_0/softmax:1 x"), "gpu_0_softmax_1_x");
        assert_eq!(file_name("a.b-c_d"), "a.b-c_d");
    }
}
