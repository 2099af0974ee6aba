//! The host's fast paths of a sync: replaying the trace of a pending graph
//! whose structure was synced before (instead of tracing, hashing and
//! comparing it anew), and running small CPU plans on the syncing thread
//! when the device is idle. Both must keep every rule of a sync: a
//! different graph is never taken for a cached one, and a failure is still
//! stored in the cells and reported at the next barrier.

mod common;
use lazuli::metrics;
use lazuli::prelude::*;

fn counter(name: &str) -> u64 {
    metrics::counter(name)
}

#[test]
fn a_repeated_structure_replays_its_trace_and_other_sharing_does_not() {
    let _g = common::metrics_lock();
    for dev in common::devices() {
        let t = |v: &[f32]| Tensor::from_slice(v, [3], &dev).unwrap();
        let (a, b) = (t(&[1.0, 2.0, 3.0]), t(&[10.0, 20.0, 30.0]));
        // The same structure with new data and new scalar values replays.
        let mut replays = Vec::new();
        for k in 0..4 {
            let before = counter("TraceReplays");
            let y = a.add(&b).unwrap().mul_scalar(k as f64 + 0.5).unwrap();
            let got = y.to_vec::<f32>().unwrap();
            replays.push(counter("TraceReplays") - before);
            let s = k as f32 + 0.5;
            assert_eq!(got, vec![11.0 * s, 22.0 * s, 33.0 * s], "{}", dev.name());
        }
        assert_eq!(replays, vec![0, 1, 1, 1], "{}", dev.name());
        // `a + a` has the node hashes of `a + b` but reads one parameter:
        // never replayed against the graph of `a + b`.
        let (uncached, _) = dev.compile_counts();
        let before = counter("TraceReplays");
        let y = a.add(&a).unwrap().mul_scalar(2.0).unwrap();
        assert_eq!(y.to_vec::<f32>().unwrap(), vec![4.0, 8.0, 12.0], "{}", dev.name());
        assert_eq!(counter("TraceReplays"), before, "{}", dev.name());
        assert_eq!(dev.compile_counts().0, uncached + 1, "{}: a graph of its own", dev.name());
        // And back: `a + b` again replays, with the right values.
        let y = a.add(&b).unwrap().mul_scalar(1.0).unwrap();
        assert_eq!(y.to_vec::<f32>().unwrap(), vec![11.0, 22.0, 33.0], "{}", dev.name());
    }
}

#[test]
fn small_cpu_plans_run_inline_and_failures_still_surface_at_the_barrier() {
    let _g = common::metrics_lock();
    let dev = Device::cpu_with(Default::default());
    let x = Tensor::from_slice(&[1.0f32, 2.0], [2], &dev).unwrap();
    let inline = counter("InlineExecutions");
    let y = x.mul_scalar(3.0).unwrap();
    y.sync().unwrap();
    assert_eq!(counter("InlineExecutions"), inline + 1, "a tiny plan on an idle CPU device runs inline");
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![3.0, 6.0]);
    // A failing execution: the sync itself succeeds, the read reports it
    // (once), and the device stays usable.
    dev.fail_next_executions(1);
    let z = x.add_scalar(1.0).unwrap();
    z.sync().expect("an execution failure is not the sync's error");
    let e = z.to_vec::<f32>().unwrap_err().to_string();
    assert!(e.contains("injected device failure"), "{e}");
    dev.wait().expect("reported by the read");
    // A panicking backend becomes an error at the barrier, not a panic in
    // the syncing thread.
    dev.panic_next_execution();
    let w = x.add_scalar(2.0).unwrap();
    w.sync().unwrap();
    assert!(dev.wait().unwrap_err().to_string().contains("panicked"));
    assert_eq!(x.add_scalar(2.0).unwrap().to_vec::<f32>().unwrap(), vec![3.0, 4.0]);
    // Large plans still go to the worker.
    let big = Tensor::zeros([1 << 20], DType::F32, &dev).unwrap();
    let before = counter("InlineExecutions");
    big.add_scalar(1.0).unwrap().sync().unwrap();
    dev.wait().unwrap();
    assert_eq!(counter("InlineExecutions"), before, "a large plan is handed to the worker");
}
