//! [`Model`]: an ONNX model loaded once and run on any device.
//!
//! Loading decodes the protobuf (the file memory-mapped: initializers stay
//! in the map until a device needs them), checks the graph
//! ([`super::graph`]) and lists every node Lazuli cannot run in one
//! [`OnnxError::Unsupported`]. A run records the whole model as one lazy
//! graph on the inputs' device and returns its outputs as lazy tensors:
//! reading them is the one sync.
//!
//! What a run does not redo:
//! - Constants (initializers, and everything computed from them only:
//!   `Constant` nodes, weights transposed or folded with a batch norm) are
//!   evaluated once per device, on the first run, and kept as device
//!   tensors (small ones also on the host, where shape arithmetic reads
//!   them). Initializers are uploaded once.
//! - Shape arithmetic (`Shape`, `Gather` on shapes, `Concat`, arithmetic
//!   feeding `Reshape`/`Expand`/`Slice`...) is evaluated on the host for
//!   the run's input shapes, once per distinct set of input shapes, never
//!   on the device.
//! - The device graph of a run at shapes seen before is a compile-cache
//!   hit; at a new value of a symbolic dim it is a size variant of the
//!   same structure (the executor's `SizeVariantCompile`).

use super::data::{map_file, ExternalFiles, HostTensor};
use super::error::{OnnxError, Unsupported};
use super::graph::{opsets, Class, Dim, Graph, ValueInfo};
use super::map::{self, lower, MapError, NodeCtx, Slot, Value};
use super::proto;
use crate::{Device, DeviceExt, Tensor};
use lazuli_executor::BackendKind;
use lazuli_ir::DType;
use prost::Message;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// Host folding: a constant or shape value of at most this many elements
/// is computed on the host; a larger one (a mask, a broadcast constant)
/// is recorded on the device like data.
const HOST_FOLD_LIMIT: usize = 1 << 16;

/// How ONNX `int64` values are computed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Int64Mode {
    /// As `i32` on devices without 64-bit integers (wgpu: WGSL has no
    /// `i64`, which would otherwise run on the CPU fallback), as `i64`
    /// elsewhere.
    #[default]
    Auto,
    /// Always as `i64` (on wgpu through the CPU fallback, counted).
    Keep,
    /// Always as `i32`; a value outside its range is an error.
    Narrow,
}

/// Settings of a [`Model`].
#[derive(Clone, Debug, Default)]
pub struct ModelOptions {
    /// How `int64` values are computed.
    pub int64: Int64Mode,
}

/// A loaded ONNX model.
pub struct Model {
    graph: Graph,
    producer: String,
    options: ModelOptions,
    /// Nodes the outputs need (the others are never recorded).
    live: Vec<bool>,
    /// Graph inputs some node reads as a shape, axes or bounds: their
    /// values are read on the host at every run (and are part of the
    /// signature the folded shapes are kept under).
    host_inputs: Vec<bool>,
    devices: Mutex<Vec<DeviceState>>,
}

/// What a model keeps per device it ran on.
struct DeviceState {
    device: Device,
    /// Constant values on this device (host and/or tensor), made once.
    consts: HashMap<usize, Known>,
    /// Host-folded shape values per input signature.
    shapes: HashMap<Signature, HashMap<usize, Known>>,
}

/// A value known before a run: on the host, on the device, or both.
#[derive(Clone, Default)]
struct Known {
    host: Option<HostTensor>,
    tensor: Option<Tensor>,
}

impl Known {
    fn slot(&self) -> Slot {
        let s = Slot { host: self.host.clone(), tensor: Default::default() };
        if let Some(t) = &self.tensor {
            let _ = s.tensor.set(t.clone());
        }
        s
    }
}

/// The input dims and dtypes of a run, and the values of the inputs read
/// on the host.
type Signature = Vec<(Vec<usize>, DType, Option<Vec<u8>>)>;

/// The outputs of a run, by name, in the model's output order.
#[derive(Clone, Debug)]
pub struct Outputs {
    values: Vec<(String, Tensor)>,
}

impl Outputs {
    /// The output called `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.values.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    /// `(name, tensor)` in the model's output order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.values.iter().map(|(n, t)| (n.as_str(), t))
    }

    /// The tensors in the model's output order.
    pub fn tensors(&self) -> Vec<&Tensor> {
        self.values.iter().map(|(_, t)| t).collect()
    }

    /// The number of outputs.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// True when the model has no outputs.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }
}

/// The CPU device shape arithmetic is folded on.
fn host_device() -> &'static Device {
    static HOST: OnceLock<Device> = OnceLock::new();
    HOST.get_or_init(Device::cpu)
}

impl Model {
    /// Loads a model file; external data is read from its folder.
    pub fn load(path: impl AsRef<Path>) -> Result<Model, OnnxError> {
        Model::load_with(path, ModelOptions::default())
    }

    /// [`Model::load`] with settings.
    pub fn load_with(path: impl AsRef<Path>, options: ModelOptions) -> Result<Model, OnnxError> {
        let path = path.as_ref();
        let bytes = map_file(path).map_err(|source| OnnxError::Io { path: path.display().to_string(), source })?;
        let dir = path.parent().map(|p| if p.as_os_str().is_empty() { PathBuf::from(".") } else { p.to_path_buf() });
        Model::decode(bytes, dir, options)
    }

    /// A model from the bytes of a file (it may hold no external data).
    pub fn from_bytes(bytes: impl Into<bytes::Bytes>) -> Result<Model, OnnxError> {
        Model::decode(bytes.into(), None, ModelOptions::default())
    }

    fn decode(bytes: bytes::Bytes, dir: Option<PathBuf>, options: ModelOptions) -> Result<Model, OnnxError> {
        let proto = proto::ModelProto::decode(bytes)?;
        Model::from_proto_in(&proto, dir, options)
    }

    /// A model from a decoded (or built) `ModelProto`.
    pub fn from_proto(proto: &proto::ModelProto, options: ModelOptions) -> Result<Model, OnnxError> {
        Model::from_proto_in(proto, None, options)
    }

    fn from_proto_in(
        proto: &proto::ModelProto,
        dir: Option<PathBuf>,
        options: ModelOptions,
    ) -> Result<Model, OnnxError> {
        let Some(g) = &proto.graph else { return Err(OnnxError::Invalid("the model has no graph".into())) };
        let (opset, domains) = opsets(proto);
        let files = ExternalFiles::new(dir);
        let graph = Graph::build(g, opset, &files)?;
        let problems = unsupported_nodes(&graph, &domains);
        if !problems.is_empty() {
            return Err(OnnxError::Unsupported(problems));
        }
        let producer = format!(
            "{} {}",
            proto.producer_name.clone().unwrap_or_default(),
            proto.producer_version.clone().unwrap_or_default()
        )
        .trim()
        .to_string();
        let live = live_nodes(&graph);
        let host_inputs = host_read_inputs(&graph);
        Ok(Model { graph, producer, options, live, host_inputs, devices: Mutex::new(vec![]) })
    }

    /// The graph inputs a run takes (initializers excluded).
    pub fn inputs(&self) -> Vec<ValueInfo> {
        self.graph.inputs.iter().map(|(_, i)| i.clone()).collect()
    }

    /// The graph outputs a run returns.
    pub fn outputs(&self) -> Vec<ValueInfo> {
        self.graph.outputs.iter().map(|(_, i)| i.clone()).collect()
    }

    /// The default domain's opset the model imports.
    pub fn opset(&self) -> i64 {
        self.graph.opset
    }

    /// The producer's name and version, as the file states them.
    pub fn producer(&self) -> &str {
        &self.producer
    }

    /// The number of nodes after load-time rewrites (`Constant` nodes
    /// become initializers, batch norms fold into convolutions).
    pub fn node_count(&self) -> usize {
        self.graph.nodes.len()
    }

    /// Operator types and how many nodes of each, sorted by name.
    pub fn op_counts(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for n in &self.graph.nodes {
            *m.entry(n.op.clone()).or_insert(0) += 1;
        }
        m
    }

    /// Runs the model on the inputs' device: every declared input by name.
    /// Returns the outputs as lazy tensors (the run is one graph: reading
    /// an output syncs it).
    pub fn run(&self, inputs: &[(&str, &Tensor)]) -> Result<Outputs, OnnxError> {
        let Some((_, first)) = inputs.first() else {
            return Err(OnnxError::Input {
                name: String::new(),
                detail: "no inputs given: use `run_on` to pick the device of a model without inputs".into(),
            });
        };
        self.run_on(first.device(), inputs)
    }

    /// [`Model::run`] on `device` (inputs on another device are an error).
    pub fn run_on(&self, device: &Device, inputs: &[(&str, &Tensor)]) -> Result<Outputs, OnnxError> {
        let narrow = match self.options.int64 {
            Int64Mode::Auto => device.kind() == BackendKind::Wgpu,
            Int64Mode::Keep => false,
            Int64Mode::Narrow => true,
        };
        let given = self.bind_inputs(device, inputs)?;
        let mut signature: Signature = Vec::with_capacity(given.len());
        for (id, t) in &given {
            let value = if self.host_inputs[*id] { Some(t.to_bytes()?) } else { None };
            signature.push((t.dims().to_vec(), t.dtype(), value));
        }
        let mut devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        let idx = match devices.iter().position(|d| d.device.same(device)) {
            Some(i) => i,
            None => {
                let consts = self.fold_constants(device, narrow)?;
                devices.push(DeviceState { device: device.clone(), consts, shapes: HashMap::new() });
                devices.len() - 1
            }
        };
        let state = &mut devices[idx];
        let mut env: Vec<Option<Slot>> = (0..self.graph.names.len()).map(|_| None).collect();
        for (&id, k) in &state.consts {
            env[id] = Some(k.slot());
        }
        let cached_shapes = state.shapes.get(&signature);
        if let Some(shapes) = cached_shapes {
            for (&id, k) in shapes {
                env[id] = Some(k.slot());
            }
        }
        let fresh_signature = cached_shapes.is_none();
        for (((id, info), t), sig) in self.graph.inputs.iter().zip(&given).zip(&signature) {
            let slot = if let Some(bytes) = &sig.2 {
                let h = HostTensor::new(t.1.dtype(), t.1.dims().to_vec(), bytes.clone())
                    .map_err(|d| OnnxError::Input { name: info.name.clone(), detail: d })?;
                Slot { host: Some(h), tensor: Default::default() }
            } else if narrow && matches!(t.1.dtype(), DType::I64 | DType::U64) {
                // Read on the host (a tensor from host data costs no
                // device work) and narrowed when the first node uploads it.
                let h = HostTensor::new(t.1.dtype(), t.1.dims().to_vec(), t.1.to_bytes()?)
                    .map_err(|d| OnnxError::Input { name: info.name.clone(), detail: d })?;
                Slot { host: Some(h), tensor: Default::default() }
            } else {
                Slot::tensor(t.1.clone())
            };
            env[*id] = Some(slot);
        }
        let mut folded: HashMap<usize, Known> = HashMap::new();
        for (i, node) in self.graph.nodes.iter().enumerate() {
            if !self.live[i] || node.outputs.iter().flatten().all(|&o| env[o].is_some()) {
                continue;
            }
            let class = node.outputs.iter().flatten().map(|&o| self.graph.class[o]).max().unwrap_or(Class::Data);
            let outs = self.eval_any(node, &mut env, device, narrow, class != Class::Data)?;
            for (slot, value) in node.outputs.iter().zip(outs) {
                let Some(o) = *slot else { continue };
                let s = match value {
                    Value::Host(h) => Slot::host(h),
                    Value::Tensor(t) => Slot::tensor(t),
                };
                if class == Class::Shape && s.host.is_some() && fresh_signature {
                    folded.insert(o, Known { host: s.host.clone(), tensor: None });
                }
                env[o] = Some(s);
            }
        }
        let mut values = Vec::with_capacity(self.graph.outputs.len());
        for (id, info) in &self.graph.outputs {
            let Some(slot) = env[*id].as_ref() else {
                return Err(OnnxError::Invalid(format!("output {:?} was not computed", info.name)));
            };
            let t = match (slot.tensor.get(), &slot.host) {
                (Some(t), _) => t.clone(),
                (None, Some(h)) => Tensor::from_bytes(h.bytes.to_vec(), h.ty(), device)?,
                (None, None) => return Err(OnnxError::Invalid(format!("output {:?} has no value", info.name))),
            };
            values.push((info.name.clone(), t));
        }
        if fresh_signature {
            // Keep the uploads of folded shape values too: the next run at
            // these shapes binds the same buffers.
            for (id, k) in folded.iter_mut() {
                k.tensor = env[*id].as_ref().and_then(|s| s.tensor.get().cloned());
            }
            state.shapes.insert(signature, folded);
        }
        Ok(Outputs { values })
    }

    /// Checks the given inputs against the declared ones; returns them in
    /// declaration order.
    fn bind_inputs<'t>(
        &self,
        device: &Device,
        inputs: &[(&str, &'t Tensor)],
    ) -> Result<Vec<(usize, &'t Tensor)>, OnnxError> {
        let bad = |name: &str, detail: String| OnnxError::Input { name: name.to_string(), detail };
        for (name, t) in inputs {
            if !self.graph.inputs.iter().any(|(_, i)| i.name == *name) {
                let known: Vec<&str> = self.graph.inputs.iter().map(|(_, i)| i.name.as_str()).collect();
                return Err(bad(name, format!("the model has no such input (its inputs: {known:?})")));
            }
            if !t.device().same(device) {
                return Err(bad(name, format!("on device {}, the run is on {}", t.device().name(), device.name())));
            }
        }
        let mut symbols: HashMap<&str, usize> = HashMap::new();
        let mut out = Vec::with_capacity(self.graph.inputs.len());
        for (id, info) in &self.graph.inputs {
            let Some((_, t)) = inputs.iter().find(|(n, _)| *n == info.name) else {
                return Err(bad(&info.name, format!("missing (declared as {info})")));
            };
            if let Some(d) = info.dtype {
                if d != t.dtype() {
                    return Err(bad(&info.name, format!("dtype {} where the model declares {d}", t.dtype())));
                }
            }
            if let Some(dims) = &info.dims {
                if dims.len() != t.rank() {
                    return Err(bad(&info.name, format!("shape {} where the model declares {info}", t.shape())));
                }
                for (d, &n) in dims.iter().zip(t.dims()) {
                    match d {
                        Dim::Fixed(f) if *f != n => {
                            return Err(bad(&info.name, format!("shape {} where the model declares {info}", t.shape())))
                        }
                        Dim::Symbolic(s) => {
                            if let Some(&prev) = symbols.get(s.as_str()) {
                                if prev != n {
                                    return Err(bad(
                                        &info.name,
                                        format!("dim {s} is {n} here and {prev} in an earlier input"),
                                    ));
                                }
                            }
                            symbols.insert(s, n);
                        }
                        _ => {}
                    }
                }
            }
            out.push((*id, *t));
        }
        Ok(out)
    }

    /// [`Model::eval`], or for an `If` the branch its condition (known on
    /// the host: the load refuses one computed from tensor data) picks,
    /// evaluated into `env`: the branch is resolved when the run is planned.
    fn eval_any(
        &self,
        node: &super::graph::Node,
        env: &mut Vec<Option<Slot>>,
        device: &Device,
        narrow: bool,
        foldable: bool,
    ) -> Result<Vec<Value>, OnnxError> {
        if node.branches.is_empty() {
            return self.eval(node, env, device, narrow, foldable);
        }
        let cond = node.inputs.first().copied().flatten().and_then(|c| env[c].as_ref()).and_then(|s| s.host.as_ref());
        let Some(cond) = cond.filter(|c| c.numel() == 1) else {
            return Err(self.node_error(node, "the condition is not a single value known on the host".into()));
        };
        let branch = &node.branches[if cond.scalar(0).as_bool() { 0 } else { 1 }];
        for inner in &branch.nodes {
            if inner.outputs.iter().flatten().all(|&o| env[o].is_some()) {
                continue;
            }
            let class = inner.outputs.iter().flatten().map(|&o| self.graph.class[o]).max().unwrap_or(Class::Data);
            let outs = self.eval_any(inner, env, device, narrow, foldable && class != Class::Data)?;
            for (slot, value) in inner.outputs.iter().zip(outs) {
                if let Some(o) = *slot {
                    env[o] = Some(match value {
                        Value::Host(h) => Slot::host(h),
                        Value::Tensor(t) => Slot::tensor(t),
                    });
                }
            }
        }
        branch
            .outputs
            .iter()
            .map(|&o| match env[o].as_ref() {
                Some(Slot { host: Some(h), .. }) => Ok(Value::Host(h.clone())),
                Some(s) => match s.tensor.get() {
                    Some(t) => Ok(Value::Tensor(t.clone())),
                    None => Err(self.node_error(node, format!("branch output {:?} has no value", self.graph.names[o]))),
                },
                None => Err(self.node_error(node, format!("branch output {:?} has no value", self.graph.names[o]))),
            })
            .collect()
    }

    /// Lowers one node. Foldable nodes (constants, shape arithmetic) whose
    /// inputs are all on the host are evaluated on the host device when
    /// their result is small; everything else is recorded on `device`.
    fn eval(
        &self,
        node: &super::graph::Node,
        env: &[Option<Slot>],
        device: &Device,
        narrow: bool,
        foldable: bool,
    ) -> Result<Vec<Value>, OnnxError> {
        let slots: Vec<Option<&Slot>> = node.inputs.iter().map(|i| i.and_then(|v| env[v].as_ref())).collect();
        if let Some(missing) = node.inputs.iter().zip(&slots).find(|(i, s)| i.is_some() && s.is_none()) {
            let name = missing.0.map(|v| self.graph.names[v].clone()).unwrap_or_default();
            return Err(self.node_error(node, format!("input {name:?} has no value")));
        }
        let all_host = slots.iter().flatten().all(|s| s.host.is_some());
        if foldable && all_host {
            // Host copies of the inputs: the host device gets its own uploads.
            let host_slots: Vec<Option<Slot>> =
                slots.iter().map(|s| s.map(|s| Slot { host: s.host.clone(), tensor: Default::default() })).collect();
            let refs: Vec<Option<&Slot>> = host_slots.iter().map(Option::as_ref).collect();
            let host = host_device();
            let outs =
                lower(&node_ctx(node, self.graph.opset, host, &refs, false)).map_err(|e| self.map_error(node, e))?;
            let small = outs.iter().all(|v| match v {
                Value::Host(_) => true,
                Value::Tensor(t) => t.numel() <= HOST_FOLD_LIMIT,
            });
            if small {
                let tensors: Vec<&Tensor> =
                    outs.iter().filter_map(|v| if let Value::Tensor(t) = v { Some(t) } else { None }).collect();
                crate::sync(&tensors)?;
                return outs
                    .into_iter()
                    .map(|v| match v {
                        Value::Host(h) => Ok(Value::Host(h)),
                        Value::Tensor(t) => {
                            let h = HostTensor::new(t.dtype(), t.dims().to_vec(), t.to_bytes()?)
                                .map_err(|d| self.node_error(node, d))?;
                            Ok(Value::Host(h))
                        }
                    })
                    .collect();
            }
        }
        lower(&node_ctx(node, self.graph.opset, device, &slots, narrow)).map_err(|e| self.map_error(node, e))
    }

    /// Evaluates every constant value the outputs need on `device` once:
    /// small ones on the host, the rest as device tensors, synced together.
    fn fold_constants(&self, device: &Device, narrow: bool) -> Result<HashMap<usize, Known>, OnnxError> {
        let mut env: Vec<Option<Slot>> = (0..self.graph.names.len()).map(|_| None).collect();
        for (&id, t) in &self.graph.consts {
            env[id] = Some(Slot::host(t.clone()));
        }
        for (i, node) in self.graph.nodes.iter().enumerate() {
            let is_const = node.outputs.iter().flatten().all(|&o| self.graph.class[o] == Class::Const);
            if !self.live[i] || !is_const {
                continue;
            }
            let outs = self.eval_any(node, &mut env, device, narrow, true)?;
            for (slot, value) in node.outputs.iter().zip(outs) {
                if let Some(o) = *slot {
                    env[o] = Some(match value {
                        Value::Host(h) => Slot::host(h),
                        Value::Tensor(t) => Slot::tensor(t),
                    });
                }
            }
        }
        // Constant tensors on the device become device data now, so every
        // run reads them as parameters (one structure from the first run on).
        let pending: Vec<Tensor> = env.iter().flatten().filter_map(|s| s.tensor.get().cloned()).collect();
        let refs: Vec<&Tensor> = pending.iter().collect();
        crate::sync(&refs)?;
        let mut out = HashMap::new();
        for (id, slot) in env.into_iter().enumerate() {
            if let Some(s) = slot {
                out.insert(id, Known { host: s.host, tensor: s.tensor.into_inner() });
            }
        }
        Ok(out)
    }

    fn node_error(&self, node: &super::graph::Node, detail: String) -> OnnxError {
        OnnxError::Node { node: node.name.clone(), op: node.op.clone(), detail }
    }

    fn map_error(&self, node: &super::graph::Node, e: MapError) -> OnnxError {
        match e {
            MapError::Exec(e) => self.node_error(node, e.to_string()),
            other => self.node_error(node, other.to_string()),
        }
    }
}

fn node_ctx<'a>(
    node: &'a super::graph::Node,
    opset: i64,
    dev: &'a Device,
    inputs: &'a [Option<&'a Slot>],
    narrow: bool,
) -> NodeCtx<'a> {
    NodeCtx { op: &node.op, opset, attrs: &node.attrs, inputs, n_out: node.outputs.len(), dev, narrow }
}

/// Nodes some output depends on.
fn live_nodes(g: &Graph) -> Vec<bool> {
    let mut needed = vec![false; g.names.len()];
    for (id, _) in &g.outputs {
        needed[*id] = true;
    }
    let mut live = vec![false; g.nodes.len()];
    for (i, node) in g.nodes.iter().enumerate().rev() {
        if node.outputs.iter().flatten().any(|&o| needed[o]) {
            live[i] = true;
            for &v in node.inputs.iter().flatten() {
                needed[v] = true;
            }
        }
    }
    live
}

/// Per value: a graph input that some node reads in a host slot.
fn host_read_inputs(g: &Graph) -> Vec<bool> {
    let mut read = vec![false; g.names.len()];
    for node in &g.nodes {
        for &slot in map::host_slots(&node.op, g.opset) {
            if let Some(Some(v)) = node.inputs.get(slot) {
                if g.inputs.iter().any(|(id, _)| id == v) {
                    read[*v] = true;
                }
            }
        }
    }
    read
}

/// Every node Lazuli cannot run, with the reason.
fn unsupported_nodes(g: &Graph, domains: &BTreeMap<String, i64>) -> Vec<Unsupported> {
    let mut out = vec![];
    check_nodes(g, &g.nodes, domains, &mut out);
    for (_, info) in &g.inputs {
        if info.dtype.is_none() {
            out.push(Unsupported {
                node: format!("input {}", info.name),
                domain: String::new(),
                op: "graph input".into(),
                opset: g.opset,
                reason: "not a tensor of a Lazuli dtype".into(),
            });
        }
    }
    out
}

fn check_nodes(g: &Graph, nodes: &[super::graph::Node], domains: &BTreeMap<String, i64>, out: &mut Vec<Unsupported>) {
    for node in nodes {
        for b in &node.branches {
            check_nodes(g, &b.nodes, domains, out);
        }
        let opset = domains.get(&node.domain).copied().unwrap_or(0);
        let mut reasons = vec![];
        if !node.domain.is_empty() {
            reasons.push(format!("the domain {:?} is not supported (only the default ONNX domain is)", node.domain));
        } else if let Some(why) = map::check(&node.op, opset, &node.attrs, node.inputs.len(), node.outputs.len()) {
            reasons.push(why);
        } else if node.op == "If" && node.inputs.first().copied().flatten().is_some_and(|c| g.class[c] == Class::Data) {
            reasons.push(
                "the condition is computed from tensor data (an If is resolved when the run is planned, from \
                 constants and input shapes)"
                    .into(),
            );
        } else {
            for &slot in map::host_slots(&node.op, opset) {
                if let Some(Some(v)) = node.inputs.get(slot) {
                    // A graph input itself is read on the host at each run.
                    if g.class[*v] == Class::Data && !g.inputs.iter().any(|(id, _)| id == v) {
                        reasons.push(format!(
                            "input {slot} ({:?}) is computed from tensor data, but Lazuli needs its value when it \
                             records the node (shapes must be known)",
                            g.names[*v]
                        ));
                    }
                }
            }
        }
        for reason in reasons {
            out.push(Unsupported {
                node: node.name.clone(),
                domain: node.domain.clone(),
                op: node.op.clone(),
                opset,
                reason,
            });
        }
    }
}

/// The protobuf bytes of a model (to write one built in memory).
pub fn encode_model(m: &proto::ModelProto) -> Vec<u8> {
    m.encode_to_vec()
}
