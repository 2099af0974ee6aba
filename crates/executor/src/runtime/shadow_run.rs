//! Shadow validation (`LAZULI_VALIDATE=cpu`, `Device::set_validate`):
//! every plan also runs on the CPU reference backend, and the outputs of
//! every kernel of the main backend are compared with the reference
//! evaluation of the same nodes. The first disagreeing kernel, in launch
//! order, becomes an [`ExecError::Validation`] returned at the barrier,
//! naming the kernel, its IR nodes with the source locations that recorded
//! them, and its generated source (WGSL). Fusion bugs no longer need
//! bisecting by hand.
//!
//! How: a native segment is compiled once more as its *shadow*
//! (`crate::runtime::shadow`, which a plan's segments hold): the same
//! graph with every kernel output also made a graph output (those nodes are
//! materialized anyway, so the backend plans the same kernels), once for
//! the main backend and once for the CPU. Under validation the shadow runs
//! instead of the segment, so the intermediate buffers come back without
//! any backend hook beyond [`Executable::kernels`]; the CPU shadow runs on
//! the same inputs. A backend that lists no kernels is compared per
//! segment. Comparing against the reference evaluation of the whole
//! segment (rather than of each kernel on the main backend's inputs) means
//! a wrong kernel also makes its users disagree; reporting the first
//! disagreement in launch order names the culprit.
//!
//! Rejected alternative: asking the backend to copy every kernel output
//! aside during a normal run. It would need a second `execute` entry point
//! in every backend; the shadow graph needs only the kernel list.
//!
//! Tolerance: floats agree when `|main - cpu| <= 1e-4 + 1e-3 * |cpu|`
//! (NaN equals NaN); integers and bools must be equal. Kernels that feed
//! rounded values into discontinuous ops (floor, comparisons) can report a
//! flip that is not a bug; the report shows the values.

use crate::api::element;
use crate::runtime::plan::{transfer, Plan};
use crate::runtime::shadow::Shadow;
use crate::{Backend, BackendError, Buffer, ExecError, KernelInfo};
use lazuli_ir::{stable_hash, DType, Graph, NodeId, ScalarValue};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::panic::Location;

/// Runs `plan` like [`Plan::run`], validating every native segment
/// against the CPU backend. `locations` are the source locations of the
/// traced graph's nodes (`plan.graph`).
// Plan::run's arguments plus the validation report's context; a struct
// would be built for this one call and taken apart at once.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_validated(
    plan: &Plan,
    inputs: Vec<Buffer>,
    scalars: &[ScalarValue],
    main: &dyn Backend,
    cpu: &dyn Backend,
    locations: &[&'static Location<'static>],
    context: &str,
    collective: Option<&dyn crate::Collective>,
) -> Result<Vec<Buffer>, ExecError> {
    if main.kind() == cpu.kind() || plan.has_collectives() {
        // The main backend is the reference: nothing to compare. A plan
        // with collectives runs as it is (its native segments are not
        // compared: a collective is run once per step, by every rank).
        return plan
            .run(inputs, scalars, main, cpu, collective)
            .map_err(|source| ExecError::Backend { context: context.to_string(), source });
    }
    let backend_err = |source: BackendError| ExecError::Backend { context: context.to_string(), source };
    let mut values: HashMap<NodeId, Buffer> = HashMap::new();
    let mut sources: Option<Vec<Option<&'static Location<'static>>>> = None;
    for (k, s) in plan.segments.iter().enumerate() {
        let backend = if s.on_cpu { cpu } else { main };
        let args = s.arguments(&inputs, &values, backend, main, cpu).map_err(backend_err)?;
        if s.on_cpu {
            let outs = cpu.execute(s.exe.as_ref(), args, scalars).map_err(backend_err)?;
            values.extend(s.outputs.iter().copied().zip(outs));
            continue;
        }
        let shadow = s.shadow.get_or_compile(&s.graph, s.exe.as_ref(), main, cpu).map_err(backend_err)?;
        let cpu_args = args.iter().map(|b| transfer(b.clone(), cpu, main, cpu)).collect::<Result<Vec<_>, _>>();
        let outs = main.execute(shadow.main.as_ref(), args, scalars).map_err(backend_err)?;
        let want = cpu.execute(shadow.cpu.as_ref(), cpu_args.map_err(backend_err)?, scalars).map_err(backend_err)?;
        crate::metrics::inc("ValidatedSegments", 1);
        let position: HashMap<NodeId, usize> = shadow.graph.outputs.iter().enumerate().map(|(i, o)| (*o, i)).collect();
        // The CPU runs the whole segment: a float output downstream of f16
        // or bf16 values carries their rounding differences, so it is
        // compared within the least precise of them.
        let has = |d: DType| shadow.graph.nodes().iter().any(|n| n.dtype == d);
        let loosest = [DType::BF16, DType::F16].into_iter().find(|&d| has(d));
        let tolerance_dtype = |d: DType| if d.is_float() { loosest.unwrap_or(d) } else { d };
        for (ki, kernel) in shadow.kernels.iter().enumerate() {
            for o in &kernel.outputs {
                let Some(&p) = position.get(o) else { continue };
                let got = main.download(&outs[p]).map_err(backend_err)?;
                let exp = cpu.download(&want[p]).map_err(backend_err)?;
                let d = shadow.graph.node(*o).dtype;
                let Some(diff) = compare(&got, &exp, d, tolerance_dtype(d)) else { continue };
                let locs = sources.get_or_insert_with(|| source_locations(plan, locations));
                let report = report(
                    &ReportCtx {
                        plan,
                        segment: k,
                        shadow,
                        kernel,
                        index: ki,
                        node: *o,
                        diff,
                        main,
                        locs,
                        origin: &s.origin,
                    },
                    context,
                );
                return Err(ExecError::Validation { kernel: kernel.name.clone(), report });
            }
        }
        values.extend(s.outputs.iter().copied().zip(outs));
    }
    Ok(plan.collect_outputs(&inputs, &values))
}

/// The first disagreement between two buffers' canonical bytes.
struct Diff {
    index: usize,
    got: ScalarValue,
    want: ScalarValue,
    count: usize,
    numel: usize,
}

/// The first and the number of elements of `got` and `want` (of `dtype`)
/// that differ: floats beyond the tolerance of `tolerance` (a float
/// dtype at most as precise as `dtype`), others at all.
fn compare(got: &[u8], want: &[u8], dtype: DType, tolerance: DType) -> Option<Diff> {
    let numel = want.len() / dtype.size_bytes().max(1);
    let mut first = None;
    let mut count = 0;
    for i in 0..numel {
        let (g, w) = (element::read_scalar(got, dtype, i), element::read_scalar(want, dtype, i));
        let same = if dtype.is_float() {
            let (g, w) = (g.as_f64(), w.as_f64());
            // f16 and bf16 kernels round once per fused chain, the CPU after
            // every op: a few roundings of the dtype apart.
            let (atol, rtol) = match tolerance {
                DType::F16 => (1e-3, 4e-3),
                DType::BF16 => (1e-2, 3e-2),
                _ => (1e-4, 1e-3),
            };
            (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= atol + rtol * w.abs()
        } else {
            let b = dtype.size_bytes();
            got.get(i * b..(i + 1) * b) == want.get(i * b..(i + 1) * b)
        };
        if !same {
            count += 1;
            first.get_or_insert((i, g, w));
        }
    }
    first.map(|(index, got, want)| Diff { index, got, want, count, numel })
}

/// For each node of the optimized graph, the source location of the traced
/// node it comes from, matched by structure (op, type and operands; the
/// passes keep parameter and scalar numbering). Nodes a pass created have
/// none.
fn source_locations(plan: &Plan, locations: &[&'static Location<'static>]) -> Vec<Option<&'static Location<'static>>> {
    let keys = |g: &Graph| -> Vec<u64> {
        let mut k: Vec<u64> = Vec::with_capacity(g.len());
        for n in g.nodes() {
            let ins: Vec<u64> = n.inputs.iter().map(|i| k[i.index()]).collect();
            k.push(stable_hash(&(&n.op, ins, &n.shape, n.dtype)));
        }
        k
    };
    let mut traced: HashMap<u64, usize> = HashMap::new();
    for (i, k) in keys(&plan.graph).into_iter().enumerate() {
        traced.entry(k).or_insert(i);
    }
    keys(&plan.optimized).into_iter().map(|k| traced.get(&k).and_then(|&i| locations.get(i).copied())).collect()
}

struct ReportCtx<'a> {
    plan: &'a Plan,
    segment: usize,
    shadow: &'a Shadow,
    kernel: &'a KernelInfo,
    index: usize,
    node: NodeId,
    diff: Diff,
    main: &'a dyn Backend,
    locs: &'a [Option<&'static Location<'static>>],
    origin: &'a [NodeId],
}

fn report(r: &ReportCtx<'_>, context: &str) -> String {
    let g = &r.shadow.graph;
    let mut s = String::new();
    let d = &r.diff;
    let n = g.node(r.node);
    let _ = writeln!(
        s,
        "{context}\nsegment {} of {}, on {}; kernel {} ({} of {} in launch order)",
        r.segment,
        r.plan.segments.len(),
        r.main.name(),
        r.kernel.name,
        r.index + 1,
        r.shadow.kernels.len()
    );
    let _ = writeln!(
        s,
        "output %{} ({} {}{}): {} of {} elements differ; first at flat index {}: {} gives {:?}, the CPU reference {:?}",
        r.node.0,
        n.op.name(),
        n.dtype,
        n.shape,
        d.count,
        d.numel,
        d.index,
        r.main.kind(),
        d.got,
        d.want
    );
    let _ = writeln!(s, "IR nodes of the kernel:");
    for id in &r.kernel.nodes {
        let n = g.node(*id);
        let args: Vec<String> = n.inputs.iter().map(|i| format!("%{}", i.0)).collect();
        let loc = r
            .origin
            .get(id.index())
            .and_then(|o| r.locs.get(o.index()).copied().flatten())
            .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()))
            .unwrap_or_else(|| "(no source location: made by an optimization pass)".into());
        let _ = writeln!(s, "  %{} = {:?}({}) : {}{}    at {loc}", id.0, n.op, args.join(", "), n.dtype, n.shape);
    }
    let _ = writeln!(s, "kernel source:\n{}", r.kernel.source);
    s
}
