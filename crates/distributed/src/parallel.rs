//! `DataParallel`: the same parameters on every rank, and gradients
//! averaged across ranks before the optimizer.
//!
//! At construction every rank's parameter list (names, dtypes, shapes) is
//! compared with rank 0's, and rank 0's values are broadcast. Each step,
//! after `backward`, [`DataParallel::average_gradients`] syncs the
//! gradients (one graph), then downloads them bucket by bucket (about
//! [`DistOptions::bucket_bytes`](crate::DistOptions) each, last layer
//! first as backward produces them), starting each bucket's all-reduce as
//! soon as it is on the host, so that the communication of one bucket
//! overlaps the download of the next; the averaged gradients are uploaded
//! and installed with `Tensor::set_grad`. The step's graphs keep their
//! structure from step to step, so nothing recompiles.
//!
//! Every bucket carries one extra element, this rank's failure flag: a
//! rank whose step failed (an error before the all-reduce, or while
//! reading its gradients) still runs every collective, with zeros, so its
//! peers never wait for it, and all ranks then learn its error
//! ([`DistError::RankFailed`]).
//!
//! Not yet done: overlap with the backward pass. The exchange starts once
//! the whole backward graph has run, because a plan's outputs become
//! readable together. Overlap needs the all-reduce inside the recorded
//! step: a vocabulary-only IR op that no backend supports, a collective
//! segment that the executor's plan cuts out like a CPU fallback segment
//! and runs through a `Collective` trait object registered on the
//! `Device` (implemented here, on the communication thread), and a
//! partition that splits backward into native segments between which the
//! started all-reduces run, waited for only where the optimizer reads
//! them. BENCHMARKS.md measures what that would win.

use crate::{DistError, ProcessGroup};
use lazuli_executor::{sync, Tensor};
use lazuli_ir::{DType, ValueType};
use std::fmt::Display;
use std::ops::Range;
use std::time::Instant;

/// What one gradient average moved and cost on this rank.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReduceStats {
    /// Gradient bytes this rank contributed (each rank receives as many).
    pub bytes: u64,
    /// All-reduce buckets.
    pub buckets: usize,
    /// Time waiting for this rank's gradients to be computed (the
    /// backward pass still running on the device), seconds.
    pub backward_seconds: f64,
    /// Time of the exchange once the gradients existed: downloads,
    /// all-reduces, uploads, seconds.
    pub seconds: f64,
    /// Of that, time spent waiting for all-reduces not hidden behind
    /// downloads, seconds.
    pub wait_seconds: f64,
}

/// Parameters kept equal across the ranks of a [`ProcessGroup`].
pub struct DataParallel {
    group: ProcessGroup,
    params: Vec<(String, Tensor)>,
    /// Ranges of `params` (in reverse order) per bucket.
    buckets: Vec<Range<usize>>,
    last: ReduceStats,
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
        Ok(DataParallel { group, params, buckets, last: ReduceStats::default() })
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

/// Buckets of about `bucket_bytes` over the parameters in reverse order
/// (indices into the reversed list); a parameter larger than a bucket is a
/// bucket of its own.
fn make_buckets(params: &[(String, Tensor)], bucket_bytes: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut bytes = 0usize;
    for (i, (_, t)) in params.iter().rev().enumerate() {
        let b = 4 * t.numel();
        if i > start && bytes + b > bucket_bytes {
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
    }

    #[test]
    fn one_rank_keeps_its_gradients_and_counts_the_bytes() {
        let dev = device();
        let w = param(3, &dev);
        let b = param(2, &dev);
        let loss = (w.sum(&[0], false).unwrap() * 2.0).unwrap().add(&b.sum(&[0], false).unwrap()).unwrap();
        loss.backward().unwrap();
        let options = DistOptions { bucket_bytes: 8, ..DistOptions::default() };
        let mut dp =
            DataParallel::new(ProcessGroup::local(options), vec![("w".into(), w.clone()), ("b".into(), b.clone())])
                .unwrap();
        assert_eq!(dp.buckets(), 2);
        let stats = dp.average_gradients().unwrap();
        assert_eq!((stats.bytes, stats.buckets), (20, 2));
        assert_eq!(w.grad().unwrap().to_vec::<f32>().unwrap(), vec![2.0; 3]);
        assert_eq!(b.grad().unwrap().to_vec::<f32>().unwrap(), vec![1.0; 2]);
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
