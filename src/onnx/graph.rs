//! The checked graph of a model: values numbered, nodes in topological
//! order, initializers and `Constant` nodes decoded, inputs and outputs
//! typed, and every value classified by what it depends on ([`Class`]):
//! constants (initializers only), shapes (the inputs' shapes, through
//! `Shape`/`Size`) or tensor data. The first two are folded on the host;
//! only data reaches the device.
//!
//! Building checks what a malformed file could get wrong: a cycle, a node
//! input nothing produces, a value produced twice, a graph output nothing
//! produces. Each is an [`OnnxError::Invalid`] naming the node or value.
//! Load-time rewrites live here too: a `BatchNormalization` after a `Conv`
//! with constant weights becomes new constant weights of the `Conv`
//! ([`fold_batch_norms`]).

use super::data::{decode_attr, decode_tensor, dtype_of_code, Attr, ExternalFiles, HostTensor};
use super::error::OnnxError;
use super::proto;
use lazuli_ir::DType;
use std::collections::{BTreeMap, HashMap};

/// What a value depends on, in increasing order: the maximum over a
/// node's inputs is the class of its outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Class {
    /// Initializers and constants only: folded once per model.
    Const,
    /// The inputs' shapes (and constants): folded once per input shapes.
    Shape,
    /// Tensor data: recorded on the device every run.
    Data,
}

/// One dimension of a declared input or output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dim {
    /// A fixed size.
    Fixed(usize),
    /// A named size (`batch`, `seq`...), bound by the inputs of a run.
    Symbolic(String),
    /// Neither fixed nor named.
    Unknown,
}

impl std::fmt::Display for Dim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dim::Fixed(n) => write!(f, "{n}"),
            Dim::Symbolic(s) => f.write_str(s),
            Dim::Unknown => f.write_str("?"),
        }
    }
}

/// A declared graph input or output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValueInfo {
    /// The value's name.
    pub name: String,
    /// The element type (`None`: not a tensor, or a dtype Lazuli lacks).
    pub dtype: Option<DType>,
    /// The dims (`None`: the rank is not declared).
    pub dims: Option<Vec<Dim>>,
}

impl std::fmt::Display for ValueInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dt = self.dtype.map(|d| d.to_string()).unwrap_or_else(|| "?".into());
        match &self.dims {
            Some(d) => {
                write!(f, "{}: {dt}[{}]", self.name, d.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", "))
            }
            None => write!(f, "{}: {dt}[..]", self.name),
        }
    }
}

/// A node with its inputs and outputs as value ids (`None`: an omitted
/// optional slot).
#[derive(Clone, Debug)]
pub struct Node {
    /// The node's name, or `#index` when the file gives none.
    pub name: String,
    /// The operator's domain (`""` for the default domain).
    pub domain: String,
    /// The operator type.
    pub op: String,
    /// Attributes by name.
    pub attrs: BTreeMap<String, Attr>,
    /// Input value ids in slot order.
    pub inputs: Vec<Option<usize>>,
    /// Output value ids in slot order.
    pub outputs: Vec<Option<usize>>,
    /// `If`: the then and else branches (the node's inputs after the
    /// condition are the outer values the branches read).
    pub branches: Vec<Branch>,
}

/// A branch of an `If`: its nodes in file order (values numbered in the
/// model's one table; its initializers and `Constant` nodes are among the
/// graph's constants) and its outputs.
#[derive(Clone, Debug)]
pub struct Branch {
    /// The branch's nodes.
    pub nodes: Vec<Node>,
    /// The values the branch returns, in the `If`'s output order.
    pub outputs: Vec<usize>,
}

/// A checked graph.
pub struct Graph {
    /// Value names by id.
    pub names: Vec<String>,
    /// Nodes in topological order (operands before users).
    pub nodes: Vec<Node>,
    /// Initializers and `Constant` nodes by value id.
    pub consts: HashMap<usize, HostTensor>,
    /// The graph inputs that are not initializers, with their ids.
    pub inputs: Vec<(usize, ValueInfo)>,
    /// The graph outputs with their ids.
    pub outputs: Vec<(usize, ValueInfo)>,
    /// Each value's class.
    pub class: Vec<Class>,
    /// The default domain's opset.
    pub opset: i64,
}

/// Imports of opsets: the default domain's version, and every domain's.
pub fn opsets(model: &proto::ModelProto) -> (i64, BTreeMap<String, i64>) {
    let mut all = BTreeMap::new();
    for o in &model.opset_import {
        let d = o.domain.clone().unwrap_or_default();
        let d = if d == "ai.onnx" { String::new() } else { d };
        all.insert(d, o.version.unwrap_or(0));
    }
    // IR version 2 files may omit the import: opset 1.
    (all.get("").copied().unwrap_or(1), all)
}

fn value_info(v: &proto::ValueInfoProto) -> ValueInfo {
    let name = v.name.clone().unwrap_or_default();
    let tensor = v.r#type.as_ref().and_then(|t| match &t.value {
        Some(proto::type_proto::Value::TensorType(tt)) => Some(tt),
        _ => None,
    });
    let dtype = tensor.and_then(|t| dtype_of_code(t.elem_type.unwrap_or(0)).ok());
    let dims = tensor.and_then(|t| t.shape.as_ref()).map(|s| {
        s.dim
            .iter()
            .map(|d| match &d.value {
                Some(proto::tensor_shape_proto::dimension::Value::DimValue(n)) if *n >= 0 => Dim::Fixed(*n as usize),
                Some(proto::tensor_shape_proto::dimension::Value::DimParam(p)) if !p.is_empty() => {
                    Dim::Symbolic(p.clone())
                }
                _ => Dim::Unknown,
            })
            .collect()
    });
    ValueInfo { name, dtype, dims }
}

/// The value of a `Constant` node.
fn constant_value(node: &Node) -> Result<HostTensor, String> {
    let [(key, attr)] = node.attrs.iter().collect::<Vec<_>>()[..] else {
        return Err(format!("Constant needs exactly one value attribute, has {:?}", node.attrs.keys()));
    };
    Ok(match (key.as_str(), attr) {
        ("value", Attr::Tensor(t)) => t.clone(),
        ("value_float", Attr::Float(f)) => HostTensor::from_scalars(&[(*f).into()], DType::F32, vec![]),
        ("value_floats", Attr::Floats(v)) => {
            let s: Vec<_> = v.iter().map(|&f| f.into()).collect();
            HostTensor::from_scalars(&s, DType::F32, vec![v.len()])
        }
        ("value_int", Attr::Int(i)) => HostTensor::from_i64s(&[*i], vec![]),
        ("value_ints", Attr::Ints(v)) => HostTensor::from_i64s(v, vec![v.len()]),
        (k, a) => return Err(format!("Constant attribute {k} ({}) is not supported", a.kind())),
    })
}

struct Names {
    ids: HashMap<String, usize>,
    names: Vec<String>,
}

impl Names {
    fn id(&mut self, name: &str) -> usize {
        if let Some(&i) = self.ids.get(name) {
            return i;
        }
        self.names.push(name.to_string());
        self.ids.insert(name.to_string(), self.names.len() - 1);
        self.names.len() - 1
    }
}

/// One `NodeProto` with its value names numbered; an `If`'s branches
/// converted too (their constants join `consts`).
fn convert_node(
    n: &proto::NodeProto,
    default_name: &str,
    names: &mut Names,
    consts: &mut HashMap<usize, HostTensor>,
    files: &ExternalFiles,
) -> Result<Node, OnnxError> {
    let name = n.name.clone().filter(|s| !s.is_empty()).unwrap_or_else(|| default_name.to_string());
    let mut attrs = BTreeMap::new();
    for a in &n.attribute {
        let key = a.name.clone().unwrap_or_default();
        let value = decode_attr(a, files).map_err(|e| match e {
            OnnxError::Tensor { tensor, detail } => {
                OnnxError::Tensor { tensor: format!("{tensor} (attribute {key} of node {name})"), detail }
            }
            other => other,
        })?;
        attrs.insert(key, value);
    }
    let slot = |s: &String, names: &mut Names| if s.is_empty() { None } else { Some(names.id(s)) };
    let domain = n.domain.clone().filter(|d| d != "ai.onnx").unwrap_or_default();
    let op = n.op_type.clone().unwrap_or_default();
    let mut node = Node {
        inputs: n.input.iter().map(|s| slot(s, names)).collect(),
        outputs: n.output.iter().map(|s| slot(s, names)).collect(),
        name,
        domain,
        op,
        attrs,
        branches: vec![],
    };
    if node.op == "If" && node.domain.is_empty() {
        for key in ["then_branch", "else_branch"] {
            let Some(Attr::Graph(g)) = node.attrs.get(key) else {
                return Err(OnnxError::Invalid(format!("If node {:?} has no {key}", node.name)));
            };
            let g = g.clone();
            let branch = convert_branch(&g, &node.name, names, consts, files)?;
            node.branches.push(branch);
        }
        node.attrs.remove("then_branch");
        node.attrs.remove("else_branch");
        // The outer values the branches read become inputs after the
        // condition, so that sorting places the `If` after them.
        let mut inner = std::collections::HashSet::new();
        let mut outer = vec![];
        fn walk(nodes: &[Node], inner: &mut std::collections::HashSet<usize>, outer: &mut Vec<usize>) {
            for n in nodes {
                for &v in n.inputs.iter().flatten() {
                    if !inner.contains(&v) && !outer.contains(&v) {
                        outer.push(v);
                    }
                }
                for b in &n.branches {
                    walk(&b.nodes, inner, outer);
                }
                inner.extend(n.outputs.iter().flatten().copied());
            }
        }
        for b in &node.branches {
            let mut inside = inner.clone();
            walk(&b.nodes, &mut inside, &mut outer);
            for &o in &b.outputs {
                if !inside.contains(&o) && !outer.contains(&o) {
                    outer.push(o);
                }
            }
        }
        inner.clear();
        outer.retain(|v| !consts.contains_key(v));
        node.inputs.truncate(1);
        node.inputs.extend(outer.into_iter().map(Some));
    }
    Ok(node)
}

fn convert_branch(
    g: &proto::GraphProto,
    parent: &str,
    names: &mut Names,
    consts: &mut HashMap<usize, HostTensor>,
    files: &ExternalFiles,
) -> Result<Branch, OnnxError> {
    for t in &g.initializer {
        let id = names.id(t.name.as_deref().unwrap_or_default());
        consts.insert(id, decode_tensor(t, files)?);
    }
    let mut nodes = vec![];
    for (i, n) in g.node.iter().enumerate() {
        let node = convert_node(n, &format!("{parent}/#{i}"), names, consts, files)?;
        if node.op == "Constant" && node.domain.is_empty() {
            let value = constant_value(&node).map_err(|d| OnnxError::Node {
                node: node.name.clone(),
                op: node.op.clone(),
                detail: d,
            })?;
            if let Some(Some(out)) = node.outputs.first() {
                consts.insert(*out, value);
            }
        } else {
            nodes.push(node);
        }
    }
    let outputs = g.output.iter().map(|v| names.id(v.name.as_deref().unwrap_or_default())).collect();
    Ok(Branch { nodes, outputs })
}

impl Graph {
    /// Checks and numbers `g`; `ops` answers, per node, which input slots
    /// must be known on the host (see [`super::map::host_slots`]).
    pub fn build(g: &proto::GraphProto, opset: i64, files: &ExternalFiles) -> Result<Graph, OnnxError> {
        let mut names = Names { ids: HashMap::new(), names: vec![] };
        let mut consts = HashMap::new();
        for t in &g.initializer {
            let name = t.name.clone().unwrap_or_default();
            let id = names.id(&name);
            if consts.insert(id, decode_tensor(t, files)?).is_some() {
                return Err(OnnxError::Invalid(format!("initializer {name:?} is given twice")));
            }
        }
        if !g.sparse_initializer.is_empty() {
            return Err(OnnxError::Invalid("sparse initializers are not supported".into()));
        }
        let mut inputs = vec![];
        for v in &g.input {
            let info = value_info(v);
            let id = names.id(&info.name);
            // Older exporters list initializers among the inputs too; an
            // initializer is a constant unless the caller overrides it,
            // which Lazuli does not offer.
            if !consts.contains_key(&id) {
                inputs.push((id, info));
            }
        }
        let mut nodes = Vec::with_capacity(g.node.len());
        for (i, n) in g.node.iter().enumerate() {
            nodes.push(convert_node(n, &format!("#{i}"), &mut names, &mut consts, files)?);
        }
        let outputs: Vec<(usize, ValueInfo)> = g
            .output
            .iter()
            .map(|v| {
                let info = value_info(v);
                (names.id(&info.name), info)
            })
            .collect();
        let mut graph = Graph { names: names.names, nodes, consts, inputs, outputs, class: vec![], opset };
        // `Constant` nodes become initializers.
        let mut kept = Vec::with_capacity(graph.nodes.len());
        for node in std::mem::take(&mut graph.nodes) {
            if node.op == "Constant" && node.domain.is_empty() {
                let value = constant_value(&node).map_err(|d| OnnxError::Node {
                    node: node.name.clone(),
                    op: node.op.clone(),
                    detail: d,
                })?;
                let Some(Some(out)) = node.outputs.first().copied() else {
                    return Err(OnnxError::Invalid(format!("Constant node {:?} has no output", node.name)));
                };
                if graph.consts.insert(out, value).is_some() {
                    return Err(OnnxError::Invalid(format!("value {:?} is produced twice", graph.names[out])));
                }
            } else {
                kept.push(node);
            }
        }
        graph.nodes = kept;
        graph.sort()?;
        fold_batch_norms(&mut graph);
        transpose_gemm_weights(&mut graph);
        graph.sort()?;
        graph.classify();
        Ok(graph)
    }

    /// Orders the nodes topologically (Kahn's algorithm, stable), checking
    /// that every input is produced once and that there is no cycle.
    fn sort(&mut self) -> Result<(), OnnxError> {
        let n = self.names.len();
        let mut producer: Vec<Option<usize>> = vec![None; n];
        let mut available = vec![false; n];
        for &id in self.consts.keys() {
            available[id] = true;
        }
        for (id, _) in &self.inputs {
            available[*id] = true;
        }
        for (i, node) in self.nodes.iter().enumerate() {
            for &o in node.outputs.iter().flatten() {
                if available[o] || producer[o].is_some() {
                    return Err(OnnxError::Invalid(format!(
                        "value {:?} is produced twice (again by node {:?})",
                        self.names[o], node.name
                    )));
                }
                producer[o] = Some(i);
            }
        }
        let mut waiting = vec![0usize; self.nodes.len()];
        let mut users: Vec<Vec<usize>> = vec![vec![]; n];
        for (i, node) in self.nodes.iter().enumerate() {
            for &v in node.inputs.iter().flatten() {
                if available[v] {
                    continue;
                }
                if producer[v].is_none() {
                    return Err(OnnxError::Invalid(format!(
                        "node {:?} ({}) reads {:?}, which no node, initializer or input provides",
                        node.name, node.op, self.names[v]
                    )));
                }
                waiting[i] += 1;
                users[v].push(i);
            }
        }
        let mut ready: std::collections::VecDeque<usize> = (0..self.nodes.len()).filter(|&i| waiting[i] == 0).collect();
        let mut order = Vec::with_capacity(self.nodes.len());
        while let Some(i) = ready.pop_front() {
            order.push(i);
            for &o in self.nodes[i].outputs.iter().flatten() {
                for &u in &users[o] {
                    waiting[u] -= 1;
                    if waiting[u] == 0 {
                        ready.push_back(u);
                    }
                }
            }
        }
        if order.len() != self.nodes.len() {
            let stuck: Vec<&str> = (0..self.nodes.len())
                .filter(|i| waiting[*i] > 0)
                .take(5)
                .map(|i| self.nodes[i].name.as_str())
                .collect();
            return Err(OnnxError::Invalid(format!("the graph has a cycle through node(s) {stuck:?}")));
        }
        for (id, info) in &self.outputs {
            if !available[*id] && producer[*id].is_none() {
                return Err(OnnxError::Invalid(format!("graph output {:?} is produced by no node", info.name)));
            }
        }
        let mut nodes: Vec<Option<Node>> = std::mem::take(&mut self.nodes).into_iter().map(Some).collect();
        self.nodes = order.into_iter().filter_map(|i| nodes[i].take()).collect();
        Ok(())
    }

    /// Sets each value's [`Class`] (the graph is sorted).
    fn classify(&mut self) {
        let mut class = vec![Class::Data; self.names.len()];
        for &id in self.consts.keys() {
            class[id] = Class::Const;
        }
        fn visit(nodes: &[Node], class: &mut [Class]) {
            for node in nodes {
                for b in &node.branches {
                    visit(&b.nodes, class);
                }
                let inputs = node.inputs.iter().flatten().map(|&v| class[v]).max().unwrap_or(Class::Const);
                let from_branches = node
                    .branches
                    .iter()
                    .flat_map(|b| b.outputs.iter())
                    .map(|&v| class[v])
                    .max()
                    .unwrap_or(Class::Const);
                let c = if !node.domain.is_empty() || super::map::is_random(&node.op) {
                    Class::Data
                } else if matches!(node.op.as_str(), "Shape" | "Size") {
                    inputs.min(Class::Shape)
                } else {
                    inputs.max(from_branches)
                };
                for &o in node.outputs.iter().flatten() {
                    class[o] = c;
                }
            }
        }
        visit(&self.nodes, &mut class);
        self.class = class;
    }

    /// How many nodes read each value (graph outputs count as readers).
    pub fn readers(&self) -> Vec<usize> {
        let mut r = vec![0usize; self.names.len()];
        for node in &self.nodes {
            for &v in node.inputs.iter().flatten() {
                r[v] += 1;
            }
        }
        for (id, _) in &self.outputs {
            r[*id] += 1;
        }
        r
    }

    /// A new value id with `name` made unique.
    fn fresh(&mut self, base: &str) -> usize {
        self.names.push(format!("{base}#lazuli{}", self.names.len()));
        self.names.len() - 1
    }

    fn constant(&mut self, base: &str, t: HostTensor) -> usize {
        let id = self.fresh(base);
        self.consts.insert(id, t);
        id
    }
}

/// Whether a value is constant before classification (an initializer, or
/// produced from constants only by deterministic default-domain nodes).
fn constant_values(g: &Graph) -> Vec<bool> {
    let mut c = vec![false; g.names.len()];
    for &id in g.consts.keys() {
        c[id] = true;
    }
    for node in &g.nodes {
        let k = node.domain.is_empty()
            && !super::map::is_random(&node.op)
            && !matches!(node.op.as_str(), "Shape" | "Size")
            && node.inputs.iter().flatten().all(|&v| c[v]);
        for &o in node.outputs.iter().flatten() {
            c[o] = k;
        }
    }
    c
}

/// A `Gemm` with `transB = 1` whose `B` is constant reads `B` transposed
/// once, at load, instead of through a transposed view every run (a
/// classifier's weights are the largest tensors of a CNN, and a product
/// reading its right operand across rows is many times slower on the CPU
/// backend: AlexNet ran 11x faster with this). The new `Transpose` node is
/// constant: folded once per device like every constant subgraph.
pub fn transpose_gemm_weights(g: &mut Graph) {
    let constant = constant_values(g);
    for i in 0..g.nodes.len() {
        let n = &g.nodes[i];
        let trans_b = matches!(n.attrs.get("transB"), Some(Attr::Int(t)) if *t != 0);
        let Some(Some(b)) = n.inputs.get(1).copied() else { continue };
        if n.op != "Gemm" || !n.domain.is_empty() || !trans_b || !constant[b] {
            continue;
        }
        let name = format!("{}/weight_transposed", n.name);
        let out = g.fresh(&name);
        let mut attrs = BTreeMap::new();
        attrs.insert("perm".to_string(), Attr::Ints(vec![1, 0]));
        g.nodes.push(Node {
            name,
            domain: String::new(),
            op: "Transpose".into(),
            attrs,
            inputs: vec![Some(b)],
            outputs: vec![Some(out)],
            branches: vec![],
        });
        let gemm = &mut g.nodes[i];
        gemm.inputs[1] = Some(out);
        gemm.attrs.insert("transB".into(), Attr::Int(0));
    }
}

/// Folds inference `BatchNormalization` into the `Conv` before it where
/// the convolution's weights and the norm's parameters are constants and
/// nothing else reads the convolution's output: `W' = W * s` per output
/// channel and `b' = (b - mean) * s + bias` with `s = scale / sqrt(var +
/// eps)`, the same value in exact arithmetic (rounding differs by an ulp
/// or two). The new weights are constant nodes, folded once per model
/// like every constant subgraph.
pub fn fold_batch_norms(g: &mut Graph) {
    let constant = constant_values(g);
    let readers = g.readers();
    let mut producer: HashMap<usize, usize> = HashMap::new();
    for (i, n) in g.nodes.iter().enumerate() {
        for &o in n.outputs.iter().flatten() {
            producer.insert(o, i);
        }
    }
    let mut folds = vec![];
    for (bi, bn) in g.nodes.iter().enumerate() {
        let inference = match bn.attrs.get("training_mode") {
            Some(Attr::Int(t)) => *t == 0,
            _ => true,
        } && !matches!(bn.attrs.get("spatial"), Some(Attr::Int(0)))
            && !matches!(bn.attrs.get("is_test"), Some(Attr::Int(0)) if g.opset < 7);
        if bn.op != "BatchNormalization"
            || !bn.domain.is_empty()
            || !inference
            || bn.outputs.iter().skip(1).any(Option::is_some)
        {
            continue;
        }
        let (Some(Some(x)), Some(Some(y))) = (bn.inputs.first(), bn.outputs.first()) else { continue };
        if bn.inputs.len() < 5 || !bn.inputs[1..5].iter().all(|v| v.is_some_and(|v| constant[v])) {
            continue;
        }
        let Some(&ci) = producer.get(x) else { continue };
        let conv = &g.nodes[ci];
        if conv.op != "Conv" || !conv.domain.is_empty() || readers[*x] != 1 {
            continue;
        }
        let w_const = conv.inputs.get(1).copied().flatten().is_some_and(|w| constant[w]);
        let b_const = conv.inputs.get(2).copied().flatten().is_none_or(|b| constant[b]);
        if !w_const || !b_const {
            continue;
        }
        // The weight's rank: from the initializer, else from `kernel_shape`.
        let w = conv.inputs[1].unwrap_or(0);
        let rank = match (g.consts.get(&w), conv.attrs.get("kernel_shape")) {
            (Some(t), _) => t.dims.len(),
            (None, Some(Attr::Ints(k))) => k.len() + 2,
            _ => continue,
        };
        if rank < 3 {
            continue;
        }
        folds.push((ci, bi, *y, rank));
    }
    let mut remove = vec![];
    for (ci, bi, y, rank) in folds {
        let bn = g.nodes[bi].clone();
        let conv = g.nodes[ci].clone();
        let eps = match bn.attrs.get("epsilon") {
            Some(Attr::Float(e)) => *e,
            _ => 1e-5,
        };
        let [scale, bias, mean, var] = [1, 2, 3, 4].map(|i| bn.inputs[i].unwrap_or(0));
        let w = conv.inputs[1].unwrap_or(0);
        let base = bn.name.clone();
        let eps_v = g.constant(&base, HostTensor::from_scalars(&[eps.into()], DType::F32, vec![]));
        let node = |g: &mut Graph, op: &str, inputs: Vec<usize>, attrs: BTreeMap<String, Attr>| {
            let out = g.fresh(&base);
            g.nodes.push(Node {
                name: format!("{base}/fold/{op}"),
                domain: String::new(),
                op: op.to_string(),
                attrs,
                inputs: inputs.into_iter().map(Some).collect(),
                outputs: vec![Some(out)],
                branches: vec![],
            });
            out
        };
        let none = BTreeMap::new;
        let shifted = node(g, "Add", vec![var, eps_v], none());
        let root = node(g, "Sqrt", vec![shifted], none());
        let s = node(g, "Div", vec![scale, root], none());
        // `s` as a column `[O, 1, ...]` of the weight's rank.
        let dims: Vec<i64> = std::iter::once(-1).chain(std::iter::repeat_n(1, rank - 1)).collect();
        let shape_v = g.constant(&base, HostTensor::from_i64s(&dims, vec![dims.len()]));
        let s_col = node(g, "Reshape", vec![s, shape_v], none());
        let w2 = node(g, "Mul", vec![w, s_col], none());
        let centered = match conv.inputs.get(2).copied().flatten() {
            Some(b) => node(g, "Sub", vec![b, mean], none()),
            None => node(g, "Neg", vec![mean], none()),
        };
        let scaled = node(g, "Mul", vec![centered, s], none());
        let b2 = node(g, "Add", vec![scaled, bias], none());
        let c = &mut g.nodes[ci];
        c.inputs = vec![c.inputs[0], Some(w2), Some(b2)];
        c.outputs = vec![Some(y)];
        remove.push(bi);
    }
    remove.sort_unstable();
    for bi in remove.into_iter().rev() {
        g.nodes.remove(bi);
    }
}
