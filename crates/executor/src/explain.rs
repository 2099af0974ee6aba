//! The recompile explainer: on a compile-cache miss, find the most similar
//! graph compiled before on the device and say why this one differs — the
//! first differing node, what differs (op, shape, dtype, a baked constant,
//! an attribute), the user source lines of both, and which sync point
//! triggered the compile. Entries are kept for `debug::compile_log()` and
//! shown in the metrics report; a call site that keeps recompiling logs a
//! `tracing` warning.

use crate::metrics;
use lazuli_ir::{describe, Graph, Op};
use std::collections::{HashMap, VecDeque};
use std::panic::Location;
use std::sync::Mutex;

/// One compile-cache miss.
#[derive(Clone, Debug)]
pub struct CompileEntry {
    /// Hash of the compiled graph.
    pub hash: u64,
    /// Nodes in the graph.
    pub nodes: usize,
    /// The sync point that triggered the compile (e.g. `to_vec at src/main.rs:10`).
    pub trigger: String,
    /// Why it did not hit the cache, when a similar graph was compiled before.
    pub reason: Option<String>,
}

/// What the explainer remembers of a compiled graph.
pub(crate) struct Seen {
    graph: Graph,
    locations: Vec<&'static Location<'static>>,
    trigger: String,
}

/// Per-device history of compiled graphs (bounded).
#[derive(Default)]
pub(crate) struct Explainer {
    recent: VecDeque<Seen>,
    per_trigger: HashMap<String, Misses>,
}

/// What one sync point's compiles looked like.
#[derive(Default)]
struct Misses {
    /// Explained recompiles (a similar graph was compiled before).
    explained: usize,
    /// The node count of the last graph it compiled.
    last_nodes: usize,
    /// Compiles in a row each of a larger graph than the one before.
    growing: usize,
}

const KEEP: usize = 16;
const WARN_AFTER: usize = 3;
/// Compiles in a row of an ever larger graph at one sync point after which
/// the explainer warns that the graph grows across iterations.
const GROWING_AFTER: usize = 4;
/// Triggers remembered at most (a program whose sync points are all new
/// forgets the oldest).
const TRIGGERS: usize = 1024;

static LOG: Mutex<Vec<CompileEntry>> = Mutex::new(Vec::new());

/// Every compile-cache miss so far in this process (most recent last, at
/// most 256 kept).
pub fn compile_log() -> Vec<CompileEntry> {
    LOG.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Clears the compile log.
pub fn clear_compile_log() {
    LOG.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

impl Explainer {
    /// Records a miss and explains it against the most similar earlier graph.
    pub fn on_miss(&mut self, graph: &Graph, locations: &[&'static Location<'static>], trigger: &str) -> CompileEntry {
        let reason = self.best_match(graph).map(|seen| explain(seen, graph, locations, trigger));
        let hash = graph.structural_hash();
        let entry = CompileEntry { hash, nodes: graph.len(), trigger: trigger.to_string(), reason };
        if self.per_trigger.len() >= TRIGGERS && !self.per_trigger.contains_key(trigger) {
            self.per_trigger.clear();
        }
        let misses = self.per_trigger.entry(trigger.to_string()).or_default();
        misses.growing = if graph.len() > misses.last_nodes && misses.last_nodes > 0 { misses.growing + 1 } else { 0 };
        misses.last_nodes = graph.len();
        if misses.growing == GROWING_AFTER {
            crate::warn::once(
                &format!("growing graph {trigger}"),
                &format!(
                    "the graph synced by {trigger} was larger at each of its last {} compiles (now {} nodes): \
                     values carried from one iteration to the next keep their whole history pending, and \
                     every sync compiles a new graph. Does the loop call Device::mark_step() once per \
                     iteration (an optimizer's step() does it for a training loop)?",
                    GROWING_AFTER + 1,
                    graph.len()
                ),
            );
        }
        if let Some(r) = &entry.reason {
            metrics::note(format!("recompiled graph {hash:016x} ({} nodes), {r}", graph.len()));
            misses.explained += 1;
            let n = misses.explained;
            // Warn once (per sync point) at its 3rd explained recompile;
            // the log then says it again at every power of two.
            if n == WARN_AFTER {
                crate::warn::once(
                    &format!("recompiling {trigger}"),
                    &format!("a steady loop keeps recompiling ({n} compiles of similar graphs by one sync point): {r}"),
                );
            } else if n > WARN_AFTER && n.is_power_of_two() {
                tracing::warn!(target: "lazuli", count = n, trigger, "a steady loop keeps recompiling: {r}");
            }
        }
        self.recent.push_back(Seen {
            graph: graph.clone(),
            locations: locations.to_vec(),
            trigger: trigger.to_string(),
        });
        if self.recent.len() > KEEP {
            self.recent.pop_front();
        }
        let mut log = LOG.lock().unwrap_or_else(|e| e.into_inner());
        if log.len() >= 256 {
            log.remove(0);
        }
        log.push(entry.clone());
        entry
    }

    /// The most recent earlier graph that resembles `graph`: the same
    /// number of nodes and outputs, and the same op at every position but at
    /// most one (a changed shape, dtype, constant or attribute keeps the op;
    /// a swapped op is the one allowed difference).
    fn best_match(&self, graph: &Graph) -> Option<&Seen> {
        self.recent.iter().rev().find(|seen| {
            seen.graph.len() == graph.len()
                && seen.graph.outputs.len() == graph.outputs.len()
                && seen
                    .graph
                    .nodes()
                    .iter()
                    .zip(graph.nodes())
                    .filter(|(a, b)| std::mem::discriminant(&a.op) != std::mem::discriminant(&b.op))
                    .count()
                    <= 1
        })
    }
}

fn explain(seen: &Seen, graph: &Graph, locations: &[&'static Location<'static>], trigger: &str) -> String {
    let loc = |l: &Location| format!("{}:{}", l.file(), l.line());
    let first = graph.nodes().iter().zip(seen.graph.nodes()).position(|(a, b)| a != b || a.inputs != b.inputs);
    let what = match first {
        Some(i) => {
            let (now, was) = (&graph.nodes()[i], &seen.graph.nodes()[i]);
            let kind = if std::mem::discriminant(&now.op) != std::mem::discriminant(&was.op) {
                format!("op {} (was {})", now.op.name(), was.op.name())
            } else if now.shape != was.shape {
                format!("{} shape {} (was {})", now.op.name(), now.shape, was.shape)
            } else if now.dtype != was.dtype {
                format!("{} dtype {} (was {})", now.op.name(), now.dtype, was.dtype)
            } else if matches!(now.op, Op::Constant(..)) {
                format!("baked constant {} (was {})", describe(&now.op), describe(&was.op))
            } else if now.op != was.op {
                format!("attributes {} (was {})", describe(&now.op), describe(&was.op))
            } else {
                format!("{} operands {:?} (was {:?})", now.op.name(), now.inputs, was.inputs)
            };
            format!(
                "first difference at node %{i}: {kind}; recorded at {} (was {})",
                loc(locations[i]),
                loc(seen.locations[i])
            )
        }
        None if graph.len() != seen.graph.len() => format!(
            "the graph has {} nodes (was {}); the first {} agree",
            graph.len(),
            seen.graph.len(),
            graph.len().min(seen.graph.len())
        ),
        None if graph.params != seen.graph.params => {
            let i = graph.params.iter().zip(&seen.graph.params).position(|(a, b)| a != b).unwrap_or(0);
            format!("input #{i} has type {:?} (was {:?})", graph.params.get(i), seen.graph.params.get(i))
        }
        None => "outputs or scalar slots differ".to_string(),
    };
    format!("{what}; compile triggered by {trigger} (previous compile by {})", seen.trigger)
}
