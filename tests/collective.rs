//! The in-graph collective (`Op::AllReduce`) with an in-process fake
//! `Collective` (two identical ranks: a sum doubles, a mean keeps): the
//! executor runs its segment, starts it before independent work and waits
//! only where its result is read, reports a collective's failure at the
//! barrier, joins the collectives of a failed plan with the failure flag,
//! and refuses a step with a collective on a device without one. Every
//! test runs on each device `common::devices` gives (CPU, and wgpu when
//! an adapter exists).

mod common;

use lazuli::ir::CollectiveOp;
use lazuli::prelude::*;
use lazuli::{metrics, Collective, CollectiveError, PendingCollective};
use std::sync::{Arc, Mutex};

/// What the fake saw, in order.
#[derive(Clone, Debug, PartialEq)]
enum Event {
    /// A start: bucket, length, failed, native segments run so far.
    Start(u32, usize, bool, u64),
    /// A wait: bucket, native segments run so far.
    Wait(u32, u64),
}

/// Two identical ranks in one process.
#[derive(Default)]
struct Doubling {
    events: Mutex<Vec<Event>>,
    /// Every wait fails with this message.
    fail: Option<String>,
}

fn segments_run() -> u64 {
    let n = |name: &str| metrics::timer(name).map_or(0, |s| s.count);
    n("ExecuteSegment") + n("ExecuteFallback")
}

struct Pending {
    owner: Arc<Doubling>,
    bucket: u32,
    result: Vec<f32>,
}

impl PendingCollective for Pending {
    fn wait(self: Box<Self>) -> Result<Vec<f32>, CollectiveError> {
        self.owner.events.lock().unwrap().push(Event::Wait(self.bucket, segments_run()));
        match &self.owner.fail {
            Some(m) => Err(CollectiveError::new(m.clone())),
            None => Ok(self.result),
        }
    }
}

/// The fake, shared by the device and the test.
struct Fake(Arc<Doubling>);

impl Collective for Fake {
    fn start_all_reduce(
        &self,
        bucket: u32,
        op: CollectiveOp,
        data: Vec<f32>,
        failed: bool,
    ) -> Result<Box<dyn PendingCollective>, CollectiveError> {
        self.0.events.lock().unwrap().push(Event::Start(bucket, data.len(), failed, segments_run()));
        let k = match op {
            CollectiveOp::Sum => 2.0,
            CollectiveOp::Mean => 1.0,
        };
        let result = data.iter().map(|v| v * k).collect();
        Ok(Box::new(Pending { owner: self.0.clone(), bucket, result }))
    }
}

fn register(dev: &Device, fail: Option<&str>) -> Arc<Doubling> {
    let d = Arc::new(Doubling { events: Mutex::new(Vec::new()), fail: fail.map(str::to_string) });
    dev.set_collective(Arc::new(Fake(d.clone())));
    d
}

#[test]
fn the_collective_segment_runs_and_its_result_is_uploaded() {
    let _l = common::metrics_lock();
    for dev in common::devices() {
        let fake = register(&dev, None);
        let x = Tensor::from_slice(&[1.0f32, -2.0, 3.5, 0.25], [2, 2], &dev).unwrap();
        let y = (&x * 3.0).unwrap().all_reduce(CollectiveOp::Sum, 7).unwrap();
        let z = (&y + 1.0).unwrap();
        let m = x.all_reduce(CollectiveOp::Mean, 8).unwrap();
        assert_eq!(z.to_vec::<f32>().unwrap(), vec![7.0, -11.0, 22.0, 2.5], "on {}", dev.name());
        assert_eq!(m.to_vec::<f32>().unwrap(), vec![1.0, -2.0, 3.5, 0.25], "on {}", dev.name());
        let starts: Vec<(u32, usize, bool)> = fake
            .events
            .lock()
            .unwrap()
            .iter()
            .filter_map(|e| match e {
                Event::Start(b, n, f, _) => Some((*b, *n, *f)),
                Event::Wait(..) => None,
            })
            .collect();
        assert_eq!(starts, vec![(7, 4, false), (8, 4, false)], "on {}", dev.name());
    }
}

#[test]
fn a_started_all_reduce_overlaps_independent_work_and_is_waited_for_where_read() {
    let _l = common::metrics_lock();
    for dev in common::devices() {
        let fake = register(&dev, None);
        let x = Tensor::from_slice(&(0..64).map(|i| i as f32 / 64.0).collect::<Vec<_>>(), [8, 8], &dev).unwrap();
        // Bucket 0 needs little (the last layer's gradient); bucket 1 needs
        // a longer chain that does not depend on bucket 0.
        let early = (&x * 2.0).unwrap().all_reduce(CollectiveOp::Sum, 0).unwrap();
        let chain = x.matmul(&x).unwrap().exp().unwrap().matmul(&x).unwrap();
        let late = chain.all_reduce(CollectiveOp::Sum, 1).unwrap();
        let out = (&early + &late).unwrap();
        let want: Vec<f32> = {
            // The same chain recorded again (reading `chain` itself would
            // compute it before the step).
            let c = x.matmul(&x).unwrap().exp().unwrap().matmul(&x).unwrap().to_vec::<f32>().unwrap();
            x.to_vec::<f32>().unwrap().iter().zip(&c).map(|(a, c)| 4.0 * a + 2.0 * c).collect()
        };
        fake.events.lock().unwrap().clear();
        let out = out.to_vec::<f32>().unwrap();
        for (g, w) in out.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "on {}: {g} vs {w}", dev.name());
        }
        let events = fake.events.lock().unwrap().clone();
        let at = |want: &dyn Fn(&Event) -> bool| events.iter().position(want).expect("the event happened");
        let start0 = at(&|e| matches!(e, Event::Start(0, ..)));
        let start1 = at(&|e| matches!(e, Event::Start(1, ..)));
        let wait0 = at(&|e| matches!(e, Event::Wait(0, _)));
        assert!(start0 < start1 && start1 < wait0, "on {}: {events:?}", dev.name());
        // Native work (the chain) ran after bucket 0 started.
        let (Event::Start(_, _, _, before), Event::Start(_, _, _, after)) = (&events[start0], &events[start1]) else {
            unreachable!()
        };
        assert!(after > before, "on {}: no segment ran between the starts: {events:?}", dev.name());
    }
}

#[test]
fn a_failed_collective_surfaces_at_the_barrier_and_the_device_stays_usable() {
    for dev in common::devices() {
        register(&dev, Some("rank 1 of 2 failed: out of memory"));
        let x = Tensor::from_slice(&[1.0f32, 2.0], [2], &dev).unwrap();
        let y = (&x + 1.0).unwrap().all_reduce(CollectiveOp::Mean, 0).unwrap();
        let z = (&y * 2.0).unwrap();
        sync(&[&z]).expect("the sync itself returns before the collective ran");
        let err = z.to_vec::<f32>().unwrap_err();
        let text = err.to_string();
        assert!(text.contains("all_reduce_mean") && text.contains("rank 1 of 2 failed"), "{text}");
        let w = (&x * 3.0).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(w, vec![3.0, 6.0]);
    }
}

#[test]
fn a_failed_plan_still_joins_its_collectives_with_the_failure_flag() {
    for dev in common::devices() {
        let fake = register(&dev, None);
        let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0], [3], &dev).unwrap();
        let y = (&x + 1.0).unwrap().all_reduce(CollectiveOp::Sum, 0).unwrap();
        let z = (&x * 5.0).unwrap().all_reduce(CollectiveOp::Sum, 1).unwrap();
        let out = (&y + &z).unwrap();
        dev.fail_next_executions(1);
        assert!(out.to_vec::<f32>().is_err(), "on {}", dev.name());
        let starts: Vec<(u32, usize, bool)> = fake
            .events
            .lock()
            .unwrap()
            .iter()
            .filter_map(|e| match e {
                Event::Start(b, n, f, _) => Some((*b, *n, *f)),
                Event::Wait(..) => None,
            })
            .collect();
        assert_eq!(starts, vec![(0, 3, true), (1, 3, true)], "on {}", dev.name());
    }
}

#[test]
fn a_step_with_a_collective_on_a_device_without_one_is_a_clear_error() {
    for dev in common::devices() {
        let x = Tensor::from_slice(&[1.0f32, 2.0], [2], &dev).unwrap();
        let y = x.all_reduce(CollectiveOp::Sum, 3).unwrap();
        let err = sync(&[&y]).unwrap_err().to_string();
        assert!(err.contains("no Collective is registered") && err.contains("bucket 3"), "{err}");
        // Only f32 is reduced.
        let i = Tensor::from_slice(&[1i32, 2], [2], &dev).unwrap();
        let err = i.all_reduce(CollectiveOp::Sum, 0).unwrap_err().to_string();
        assert!(err.contains("all_reduce_sum") && err.contains("f32"), "{err}");
    }
}

#[test]
fn a_steady_step_with_collectives_compiles_once() {
    let dev = Device::cpu();
    let fake = register(&dev, None);
    let w = Tensor::from_slice(&[0.5f32; 6], [2, 3], &dev).unwrap();
    let mut compiles = Vec::new();
    for step in 0..4 {
        let before = dev.compile_counts();
        let g = (&w * (1.0 + step as f64 * 0.1)).unwrap().all_reduce(CollectiveOp::Mean, 0).unwrap();
        w.assign(&(&w - &(&g * 0.01).unwrap()).unwrap()).unwrap();
        w.to_vec::<f32>().unwrap();
        compiles.push(dev.compile_counts().0 - before.0);
    }
    assert_eq!(&compiles[2..], &[0, 0], "{compiles:?}");
    assert_eq!(fake.events.lock().unwrap().iter().filter(|e| matches!(e, Event::Start(..))).count(), 4);
}
