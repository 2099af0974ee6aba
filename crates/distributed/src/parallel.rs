//! `DataParallel`: the same parameters on every rank, and gradients
//! averaged across ranks before the optimizer.
//!
//! At construction every rank's parameter list (names, dtypes, shapes) is
//! compared with rank 0's, and rank 0's values are broadcast. Gradients
//! are averaged in buckets of about
//! [`DistOptions::bucket_bytes`](crate::DistOptions) each (last layer
//! first, as backward produces them; the first bucket at most
//! [`FIRST_BUCKET_BYTES`], as PyTorch's DDP), one of two ways:
//!
//! - **In the recorded step** ([`DataParallel::reduce_in_graph`], what
//!   the demo and `examples/allreduce.rs` use): after `backward`, each
//!   bucket's gradients are flattened and concatenated into one tensor,
//!   an `Op::AllReduce` node (mean) is recorded over it, and its slices
//!   become the new gradients; nothing runs yet. At the step's sync the
//!   executor's plan starts each bucket's all-reduce as soon as the
//!   segment that computes its gradients has run, through the collective
//!   this type registers on the device (`collective`: the group's
//!   communication thread), while the rest of the backward pass runs;
//!   the optimizer's segments wait for the buckets they read. The step's
//!   graph keeps its structure from step to step, so it stays one cached
//!   plan. [`DataParallel::take_stats`] says how much of the all-reduce
//!   time the step hid (`ReduceStats::wait_seconds` against `seconds`).
//! - **On the host** ([`DataParallel::average_gradients`] /
//!   [`DataParallel::finish_step`]): the gradients are synced (one
//!   graph), downloaded bucket by bucket with each bucket's all-reduce
//!   started as soon as it is on the host, then uploaded and installed
//!   with `Tensor::set_grad`. Communication overlaps the downloads only.
//!
//! Every bucket carries one extra element, this rank's failure flag: a
//! rank whose step failed still runs every collective, with zeros, so its
//! peers never wait for it, and all ranks then learn of its failure. On
//! the host path every rank returns the same [`DistError::RankFailed`]; in
//! the recorded step a plan that fails joins its remaining all-reduces
//! with its flag (the executor does it), a rank that fails before its
//! step is recorded joins them with [`DataParallel::abandon_step`], and
//! the peers' step fails at its next barrier naming the failed rank. A
//! rank that stalls is bounded by the group's timeout either way.
//!
//! The communication thread runs collectives in the order they reach it,
//! and every rank must run them in the same order: while a step with
//! all-reduces may still run on the device, call none of the group's host
//! collectives (`agree`, `barrier`, the host path) without
//! `Device::wait` first ([`DataParallel::abandon_step`] waits itself).

use crate::collective::{GroupCollective, InGraphTotals};
use crate::{DistError, ProcessGroup};
use lazuli_executor::{no_grad, sync, Tensor};
use lazuli_ir::{CollectiveOp, DType, ValueType};
use std::fmt::Display;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// What gradient averaging moved and cost on this rank.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReduceStats {
    /// Gradient bytes this rank contributed (each rank receives as many).
    pub bytes: u64,
    /// All-reduce buckets.
    pub buckets: usize,
    /// Host path: time waiting for this rank's gradients to be computed
    /// (the backward pass still running on the device), seconds. Zero in
    /// the recorded step, where that wait does not exist.
    pub backward_seconds: f64,
    /// Host path: time of the exchange once the gradients existed
    /// (downloads, all-reduces, uploads). Recorded step: time the
    /// communication thread spent in the all-reduces. Seconds.
    pub seconds: f64,
    /// Of that, time something waited for all-reduces: the host path's
    /// caller, or the device's worker in the recorded step (the part the
    /// rest of the step did not hide). Seconds.
    pub wait_seconds: f64,
}

impl ReduceStats {
    /// The part of the all-reduce time not spent waiting (hidden behind
    /// other work), from 0 to 1; 0 without all-reduce time.
    pub fn hidden_fraction(&self) -> f64 {
        if self.seconds > 0.0 {
            (1.0 - self.wait_seconds / self.seconds).clamp(0.0, 1.0)
        } else {
            0.0
        }
    }
}

/// Parameters kept equal across the ranks of a [`ProcessGroup`].
pub struct DataParallel {
    group: ProcessGroup,
    params: Vec<(String, Tensor)>,
    /// Ranges of `params` (in reverse order) per bucket.
    buckets: Vec<Range<usize>>,
    last: ReduceStats,
    /// The collective registered on the parameters' device (in-graph mode),
    /// and what its all-reduces cost since [`DataParallel::take_stats`].
    collective: Option<Arc<GroupCollective>>,
    totals: Arc<Mutex<InGraphTotals>>,
}

impl DataParallel {
    /// Checks that every rank holds the same parameters (names, dtypes and
    /// shapes, in order) and gives every rank rank 0's values. Every rank
    /// gets the same error when they differ.
    pub fn new(group: ProcessGroup, params: Vec<(String, Tensor)>) -> Result<DataParallel, DistError> {
        check_same_parameters(&group, &params)?;
        if let Some((name, t)) = params.iter().find(|(_, t)| t.dtype() != DType::F32) {
            return Err(DistError::UnsupportedDType { name: name.clone(), dtype: t.dtype() });
        }
        broadcast_parameters(&group, &params)?;
        let buckets = make_buckets(&params, group.options().bucket_bytes);
        Ok(DataParallel {
            group,
            params,
            buckets,
            last: ReduceStats::default(),
            collective: None,
            totals: Arc::default(),
        })
    }

    /// The process group.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The parameters, by name.
    pub fn parameters(&self) -> &[(String, Tensor)] {
        &self.params
    }

    /// The number of all-reduce buckets a step runs.
    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }

    /// What the latest average moved and cost.
    pub fn last_stats(&self) -> ReduceStats {
        self.last
    }

    /// Replaces every parameter's gradient with its mean over the ranks (a
    /// parameter without a gradient counts as zeros). Call it on every rank
    /// after `backward` and before the optimizer.
    pub fn average_gradients(&mut self) -> Result<ReduceStats, DistError> {
        self.finish_step(Ok::<(), DistError>(()))
    }

    /// [`DataParallel::average_gradients`] after this rank's step so far
    /// ended as `local`: a failed rank still takes part (with zeros) and
    /// every rank returns [`DistError::RankFailed`] naming the lowest
    /// failing rank and its error. Use it where a rank can fail before its
    /// gradients exist, so that its peers do not wait for it.
    pub fn finish_step<E: Display>(&mut self, local: Result<(), E>) -> Result<ReduceStats, DistError> {
        let started = Instant::now();
        const OP: &str = "all-reduce of gradients";
        let mut failure: Option<String> = local.err().map(|e| e.to_string());
        let grads: Vec<Option<Tensor>> = self.params.iter().map(|(_, p)| p.grad()).collect();
        if failure.is_none() {
            let present: Vec<&Tensor> = grads.iter().flatten().collect();
            // Sync the gradients as one graph and wait for it, so that the
            // time below is the exchange's alone.
            let synced = sync(&present).and_then(|()| present.first().map_or(Ok(()), |g| g.device().wait()));
            if let Err(e) = synced {
                failure = Some(e.to_string());
            }
        }
        let backward_seconds = started.elapsed().as_secs_f64();
        let started = Instant::now();
        if self.buckets.is_empty() {
            self.group.agree(OP, failure.map_or(Ok(()), Err))?;
            self.last =
                ReduceStats { backward_seconds, seconds: started.elapsed().as_secs_f64(), ..ReduceStats::default() };
            return Ok(self.last);
        }
        let mut bytes = 0u64;
        let mut pending = Vec::with_capacity(self.buckets.len());
        for range in &self.buckets {
            let numel: usize = range.clone().map(|i| self.params[self.params.len() - 1 - i].1.numel()).sum();
            let mut buf: Vec<f32> = Vec::new();
            if buf.try_reserve_exact(numel + 1).is_err() {
                failure.get_or_insert_with(|| format!("cannot allocate a {numel}-element gradient bucket on the host"));
            }
            for i in range.clone() {
                let j = self.params.len() - 1 - i;
                let n = self.params[j].1.numel();
                match (&failure, &grads[j]) {
                    // Decoded straight from the canonical little-endian
                    // bytes into the bucket (one copy).
                    (None, Some(g)) => match g.to_bytes() {
                        Ok(b) => buf.extend(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
                        Err(e) => {
                            failure = Some(e.to_string());
                            buf.resize(buf.len() + n, 0.0);
                        }
                    },
                    _ => buf.resize(buf.len() + n, 0.0),
                }
            }
            buf.push(if failure.is_some() { 1.0 } else { 0.0 });
            bytes += 4 * numel as u64;
            pending.push(self.group.start_all_reduce_sum(OP, buf)?);
        }
        let waiting = Instant::now();
        let mut sums = Vec::with_capacity(pending.len());
        for p in pending {
            sums.push(p.wait()?);
        }
        let wait_seconds = waiting.elapsed().as_secs_f64();
        if sums.iter().any(|s| s.last().is_some_and(|&flag| flag > 0.5)) {
            self.group.agree(OP, failure.map_or(Ok(()), Err))?;
            // Every rank agreed it succeeded, yet a flag was set: impossible
            // unless the transport corrupted the flag.
            unreachable!("a failure flag was set but no rank reported a failure");
        }
        let scale = 1.0 / self.group.world_size() as f32;
        for (range, sum) in self.buckets.iter().zip(&sums) {
            let mut at = 0;
            for i in range.clone() {
                let p = &self.params[self.params.len() - 1 - i].1;
                let n = p.numel();
                // Scaled straight into the new gradient's bytes.
                let mut bytes = Vec::new();
                if bytes.try_reserve_exact(4 * n).is_err() {
                    return Err(DistError::Invalid {
                        op: OP,
                        detail: format!("cannot allocate {} bytes for the averaged gradient on the host", 4 * n),
                    });
                }
                bytes.extend(sum[at..at + n].iter().flat_map(|v| (v * scale).to_le_bytes()));
                at += n;
                let g = Tensor::from_bytes(bytes, ValueType::new(p.shape().clone(), DType::F32), p.device())?;
                p.set_grad(Some(g))?;
            }
        }
        self.last = ReduceStats {
            bytes,
            buckets: self.buckets.len(),
            backward_seconds,
            seconds: started.elapsed().as_secs_f64(),
            wait_seconds,
        };
        Ok(self.last)
    }
}

impl DataParallel {
    /// Records the average of every parameter's gradient over the ranks
    /// into the step (a parameter without a gradient counts as zeros) and
    /// installs the averaged gradients; nothing runs until the step syncs
    /// (the optimizer's step, `mark_step`). Call it on every rank after
    /// `backward` and before the optimizer. The first call registers this
    /// group's collective on the parameters' device
    /// (`Device::set_collective`). Errors of the exchange (a failed or
    /// stalled peer) surface at the device's next barrier.
    pub fn reduce_in_graph(&mut self) -> Result<(), DistError> {
        let Some((_, first)) = self.params.first() else { return Ok(()) };
        let device = first.device().clone();
        if self.collective.is_none() {
            let c = Arc::new(GroupCollective { link: self.group.link(), totals: self.totals.clone() });
            device.set_collective(c.clone());
            self.collective = Some(c);
        }
        // The average is no computation to differentiate.
        no_grad(|| -> Result<(), DistError> {
            for (b, range) in self.buckets.iter().enumerate() {
                let members: Vec<&Tensor> = range.clone().map(|i| &self.params[self.params.len() - 1 - i].1).collect();
                let flat: Vec<Tensor> = members
                    .iter()
                    .map(|p| match p.grad() {
                        Some(g) => g.reshape([p.numel()]),
                        None => Tensor::zeros([p.numel()], DType::F32, &device),
                    })
                    .collect::<Result<_, _>>()?;
                let refs: Vec<&Tensor> = flat.iter().collect();
                let bucket = if refs.len() == 1 { refs[0].clone() } else { Tensor::concat(&refs, 0)? };
                let reduced = bucket.all_reduce(CollectiveOp::Mean, b as u32)?;
                let mut at = 0usize;
                for p in members {
                    let n = p.numel();
                    let g = if n == reduced.numel() { reduced.clone() } else { reduced.narrow(0, at, n)? };
                    p.set_grad(Some(g.reshape_to(p.shape().clone())?))?;
                    at += n;
                }
            }
            Ok(())
        })
    }

    /// For a rank whose step failed before [`DataParallel::reduce_in_graph`]
    /// recorded it (`local`, e.g. a bad shape in forward): joins every
    /// bucket's all-reduce with zeros and this rank's failure flag, so
    /// that the peers' steps fail (naming this rank) instead of waiting,
    /// and returns this rank's [`DistError::RankFailed`]. Use it only in
    /// the in-graph mode.
    pub fn abandon_step<E: Display>(&mut self, local: E) -> DistError {
        // The device's earlier steps first: their all-reduces reach the
        // communication thread before these, on every rank alike.
        let mut message = local.to_string();
        if let Some(Err(e)) = self.params.first().map(|(_, p)| p.device().wait()) {
            message = format!("{message} (and before it: {e})");
        }
        let collective = self
            .collective
            .get_or_insert_with(|| Arc::new(GroupCollective { link: self.group.link(), totals: self.totals.clone() }));
        for (b, range) in self.buckets.iter().enumerate() {
            let numel: usize = range.clone().map(|i| self.params[self.params.len() - 1 - i].1.numel()).sum();
            let mut zeros = Vec::new();
            if zeros.try_reserve_exact(numel).is_err() {
                break;
            }
            zeros.resize(numel, 0.0);
            match collective.start(b as u32, CollectiveOp::Mean, zeros, true) {
                // Waited for, so that the next collective of the group
                // starts after it; its result is this rank's own failure.
                Ok(p) => drop(p.wait_result()),
                Err(_) => break,
            }
        }
        DistError::RankFailed {
            rank: self.group.rank(),
            world: self.group.world_size(),
            op: "in-graph all-reduce of gradients",
            message,
        }
    }

    /// What the in-graph all-reduces moved and cost since the last call
    /// (every step's buckets that were waited for), read after the steps
    /// synced: `seconds` is the time in MPI, `wait_seconds` the time the
    /// device waited for results; `buckets` counts all-reduces.
    pub fn take_stats(&mut self) -> ReduceStats {
        let t = std::mem::take(&mut *self.totals.lock().unwrap_or_else(|e| e.into_inner()));
        ReduceStats {
            bytes: t.bytes,
            buckets: t.reduces,
            backward_seconds: 0.0,
            seconds: t.reduce.as_secs_f64(),
            wait_seconds: t.wait.as_secs_f64(),
        }
    }

    /// The bytes of gradients one step's all-reduces carry on this rank.
    pub fn bytes_per_step(&self) -> u64 {
        self.params.iter().map(|(_, p)| 4 * p.numel() as u64).sum()
    }
}

/// One line per parameter: `name dtype shape`.
fn signature(params: &[(String, Tensor)]) -> Vec<String> {
    params.iter().map(|(name, t)| format!("{name} {}{}", t.dtype(), t.shape())).collect()
}

fn check_same_parameters(group: &ProcessGroup, params: &[(String, Tensor)]) -> Result<(), DistError> {
    let mine = signature(params).join("\n");
    let all = group.all_gather_bytes("parameter check", mine.as_bytes())?;
    let lines = |r: usize| String::from_utf8_lossy(&all[r]).lines().map(str::to_string).collect::<Vec<_>>();
    let root = lines(0);
    for rank in 1..all.len() {
        let other = lines(rank);
        if other == root {
            continue;
        }
        let detail = match root.iter().zip(&other).position(|(a, b)| a != b) {
            Some(i) => format!("parameter {i} is {} on rank 0 but {} on rank {rank}", root[i], other[i]),
            None => {
                let (longer, r) = if root.len() > other.len() { (&root, 0) } else { (&other, rank) };
                format!(
                    "rank 0 has {} parameters, rank {rank} has {}; the first extra one is {} on rank {r}",
                    root.len(),
                    other.len(),
                    longer[root.len().min(other.len())]
                )
            }
        };
        return Err(DistError::ParameterMismatch { rank, detail });
    }
    Ok(())
}

fn broadcast_parameters(group: &ProcessGroup, params: &[(String, Tensor)]) -> Result<(), DistError> {
    const OP: &str = "parameter broadcast";
    if group.world_size() == 1 {
        return Ok(());
    }
    let total: usize = params.iter().map(|(_, t)| 4 * t.numel()).sum();
    let mut buf = Vec::new();
    let mut local: Result<(), String> = Ok(());
    if group.rank() == 0 {
        // One sync for all of them (freshly initialized parameters are
        // pending), then plain reads.
        let all: Vec<&Tensor> = params.iter().map(|(_, t)| t).collect();
        if let Err(e) = sync(&all) {
            local = Err(e.to_string());
        }
        for (_, t) in params.iter().filter(|_| local.is_ok()) {
            match t.to_bytes() {
                Ok(b) => buf.extend_from_slice(&b),
                Err(e) => {
                    local = Err(e.to_string());
                    break;
                }
            }
        }
    }
    group.agree(OP, local)?;
    buf.resize(total, 0);
    let buf = group.broadcast_bytes(OP, buf)?;
    if group.rank() != 0 {
        let mut at = 0;
        for (_, p) in params {
            let n = p.numel();
            let bytes = buf[at..at + 4 * n].to_vec();
            at += 4 * n;
            p.assign(&Tensor::from_bytes(bytes, ValueType::new(p.shape().clone(), DType::F32), p.device())?)?;
        }
    }
    Ok(())
}

/// The first bucket's size limit, PyTorch DDP's (`_DEFAULT_FIRST_BUCKET_BYTES`,
/// 1 MiB): the last layers' gradients, ready first, start their all-reduce
/// while the rest of the backward pass runs, even when the whole model
/// fits one bucket of `bucket_bytes`.
pub const FIRST_BUCKET_BYTES: usize = 1 << 20;

/// Buckets over the parameters in reverse order (indices into the reversed
/// list): the first of at most `min(FIRST_BUCKET_BYTES, bucket_bytes)`, the
/// others of about `bucket_bytes`; a parameter larger than a bucket is a
/// bucket of its own.
fn make_buckets(params: &[(String, Tensor)], bucket_bytes: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut bytes = 0usize;
    for (i, (_, t)) in params.iter().rev().enumerate() {
        let b = 4 * t.numel();
        let cap = if out.is_empty() { bucket_bytes.min(FIRST_BUCKET_BYTES) } else { bucket_bytes };
        if i > start && bytes + b > cap {
            out.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes += b;
    }
    if start < params.len() {
        out.push(start..params.len());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DistOptions;
    use lazuli_executor::Device;
    use std::sync::Arc;

    fn device() -> Device {
        let cpu: Arc<dyn lazuli_executor::Backend> = Arc::new(lazuli_cpu::CpuBackend::new());
        Device::new(cpu.clone(), cpu)
    }

    fn param(n: usize, dev: &Device) -> Tensor {
        Tensor::from_slice(&vec![1.0f32; n], [n], dev).unwrap().requires_grad_(true).unwrap()
    }

    #[test]
    fn buckets_follow_the_reverse_order_and_the_size_bound() {
        let dev = device();
        let params: Vec<(String, Tensor)> =
            [10, 20, 5, 100, 1].iter().enumerate().map(|(i, &n)| (format!("p{i}"), param(n, &dev))).collect();
        // Reversed sizes: 1, 100, 5, 20, 10 elements (4 bytes each).
        assert_eq!(make_buckets(&params, 100), vec![0..1, 1..2, 2..4, 4..5]);
        assert_eq!(make_buckets(&params, 1 << 20), vec![0..5]);
        assert_eq!(make_buckets(&[], 100), Vec::<Range<usize>>::new());
        // The first bucket stops at FIRST_BUCKET_BYTES, later ones at
        // bucket_bytes: 3 x 0.75 MiB gives [0.75] then [0.75, 0.75].
        let quarter = FIRST_BUCKET_BYTES / 4 / 4;
        let big: Vec<(String, Tensor)> = (0..3).map(|i| (format!("q{i}"), param(3 * quarter, &dev))).collect();
        assert_eq!(make_buckets(&big, 25 << 20), vec![0..1, 1..3]);
    }

    /// One rank's `DataParallel` over `w` (3 elements, gradient 2) and `b`
    /// (2 elements, gradient 1), one 8-byte bucket each, after backward.
    fn two_parameters() -> (Device, Tensor, Tensor, DataParallel) {
        let dev = device();
        let w = param(3, &dev);
        let b = param(2, &dev);
        let loss = (w.sum(&[0], false).unwrap() * 2.0).unwrap().add(&b.sum(&[0], false).unwrap()).unwrap();
        loss.backward().unwrap();
        let options = DistOptions { bucket_bytes: 8, ..DistOptions::default() };
        let dp =
            DataParallel::new(ProcessGroup::local(options), vec![("w".into(), w.clone()), ("b".into(), b.clone())])
                .unwrap();
        (dev, w, b, dp)
    }

    #[test]
    fn one_rank_keeps_its_gradients_and_counts_the_bytes() {
        let (_, w, b, mut dp) = two_parameters();
        assert_eq!(dp.buckets(), 2);
        let stats = dp.average_gradients().unwrap();
        assert_eq!((stats.bytes, stats.buckets), (20, 2));
        assert_eq!(w.grad().unwrap().to_vec::<f32>().unwrap(), vec![2.0; 3]);
        assert_eq!(b.grad().unwrap().to_vec::<f32>().unwrap(), vec![1.0; 2]);
    }

    #[test]
    fn in_the_step_one_rank_keeps_its_gradients_and_counts_the_all_reduces() {
        let (dev, w, b, mut dp) = two_parameters();
        assert!(!dev.has_collective());
        dp.reduce_in_graph().unwrap();
        assert!(dev.has_collective(), "the collective is registered on the parameters' device");
        assert_eq!(w.grad().unwrap().to_vec::<f32>().unwrap(), vec![2.0; 3]);
        assert_eq!(b.grad().unwrap().to_vec::<f32>().unwrap(), vec![1.0; 2]);
        let stats = dp.take_stats();
        assert_eq!((stats.bytes, stats.buckets), (20, 2));
        assert_eq!(dp.take_stats(), ReduceStats::default(), "taken once");
    }

    #[test]
    fn abandoning_a_step_is_this_ranks_failure() {
        let dev = device();
        let mut dp =
            DataParallel::new(ProcessGroup::local(DistOptions::default()), vec![("w".into(), param(4, &dev))]).unwrap();
        let err = dp.abandon_step("bad shape in forward");
        let DistError::RankFailed { rank, world, message, .. } = &err else { panic!("{err:?}") };
        assert_eq!((*rank, *world, message.as_str()), (0, 1, "bad shape in forward"));
    }

    #[test]
    fn a_local_failure_is_reported_as_a_failed_rank() {
        let dev = device();
        let mut dp =
            DataParallel::new(ProcessGroup::local(DistOptions::default()), vec![("w".into(), param(4, &dev))]).unwrap();
        let err = dp.finish_step(Err("bad shape in forward")).unwrap_err();
        let DistError::RankFailed { rank, world, message, .. } = &err else { panic!("{err:?}") };
        assert_eq!((*rank, *world, message.as_str()), (0, 1, "bad shape in forward"));
    }

    #[test]
    fn a_non_f32_parameter_is_a_typed_error() {
        let dev = device();
        let t = Tensor::from_slice(&[1.0f64, 2.0], [2], &dev).unwrap();
        let err = DataParallel::new(ProcessGroup::local(DistOptions::default()), vec![("h".into(), t)])
            .err()
            .expect("an error");
        assert!(matches!(err, DistError::UnsupportedDType { ref name, dtype: DType::F64 } if name == "h"), "{err:?}");
    }
}
