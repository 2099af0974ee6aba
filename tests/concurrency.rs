//! Concurrency stress: 8 threads build and sync graphs on one shared
//! device, 200 syncs each, while another thread calls `mark_step` in a
//! loop. No deadlock (the body runs on a thread and must finish within a
//! time limit), and every result is checked against a value computed on
//! the host. Runs on the CPU device and on the wgpu device.
//! `LAZULI_HEAVY=1` multiplies the syncs per thread by 5.

mod common;
use lazuli::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const THREADS: usize = 8;

fn syncs_per_thread() -> usize {
    if std::env::var("LAZULI_HEAVY").is_ok_and(|v| v == "1") {
        1000
    } else {
        200
    }
}

/// Runs `f` on a thread; panics if it does not finish within `limit`.
fn with_timeout(what: &str, limit: Duration, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(limit) {
        Ok(()) => h.join().unwrap(),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            // The body panicked: surface its panic.
            if let Err(p) = h.join() {
                std::panic::resume_unwind(p);
            }
        }
        Err(_) => panic!("{what}: no result after {limit:?}: deadlock?"),
    }
}

/// One worker thread: a small mixed graph per iteration (elementwise,
/// broadcast, reduction, matmul, an in-place update of a thread-local
/// accumulator), synced in various ways, every value checked.
fn worker(dev: &Device, id: usize, syncs: usize, done: &AtomicUsize) {
    let base: Vec<f32> = (0..12).map(|i| (i as f32 + id as f32) * 0.25).collect();
    let x = Tensor::from_slice(&base, [3, 4], dev).unwrap();
    let acc = Tensor::zeros([4], DType::F32, dev).unwrap();
    let mut acc_host = [0.0f32; 4];
    for step in 0..syncs {
        let k = (step % 7) as f32 + 1.0;
        // y = relu(x * k - 1) summed over rows, then added into acc.
        let y = x.mul_scalar(k).unwrap().sub_scalar(1.0).unwrap().relu().unwrap().sum(&[0], false).unwrap();
        let want: Vec<f32> = (0..4).map(|c| (0..3).map(|r| (base[r * 4 + c] * k - 1.0).max(0.0)).sum()).collect();
        acc.add_(&y).unwrap();
        for (a, w) in acc_host.iter_mut().zip(&want) {
            *a += w;
        }
        match step % 4 {
            0 => {
                let got = y.to_vec::<f32>().unwrap();
                common::assert_close(&got, &want, 1e-5, 1e-5, &format!("thread {id} step {step}: y"));
            }
            1 => {
                // matmul against a ones vector = row sums of relu(...)
                let m = x.matmul(&Tensor::ones([4, 1], DType::F32, dev).unwrap()).unwrap();
                lazuli::sync(&[&m, &y]).unwrap();
                let rows: Vec<f32> = (0..3).map(|r| base[r * 4..r * 4 + 4].iter().sum()).collect();
                common::assert_close(&m.to_vec::<f32>().unwrap(), &rows, 1e-5, 1e-5, &format!("thread {id}: matmul"));
            }
            2 => {
                let s = acc.sum(&[], false).unwrap().item::<f32>().unwrap();
                let w: f32 = acc_host.iter().sum();
                assert!((s - w).abs() <= 1e-3 * w.abs().max(1.0), "thread {id} step {step}: acc sum {s} != {w}");
            }
            _ => {
                y.sync().unwrap();
                let am = y.argmax(0, false).unwrap().item::<i32>().unwrap();
                let wm = want.iter().enumerate().fold(0, |b, (i, v)| if *v > want[b] { i } else { b });
                assert_eq!(am as usize, wm, "thread {id} step {step}: argmax of {want:?}");
            }
        }
        done.fetch_add(1, Ordering::Relaxed);
    }
    common::assert_close(&acc.to_vec::<f32>().unwrap(), &acc_host, 1e-4, 1e-3, &format!("thread {id}: accumulator"));
}

fn stress(dev: Device, limit: Duration) {
    let syncs = syncs_per_thread();
    let name = dev.name();
    let started = Instant::now();
    with_timeout(&format!("{THREADS} threads x {syncs} syncs on {name}"), limit, move || {
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicUsize::new(0));
        let steps = Arc::new(AtomicUsize::new(0));
        let marker = {
            let (dev, stop, steps) = (dev.clone(), stop.clone(), steps.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    dev.mark_step().unwrap();
                    steps.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
        };
        let workers: Vec<_> = (0..THREADS)
            .map(|id| {
                let (dev, done) = (dev.clone(), done.clone());
                std::thread::spawn(move || worker(&dev, id, syncs, &done))
            })
            .collect();
        let mut panics = Vec::new();
        for w in workers {
            if let Err(p) = w.join() {
                panics.push(p);
            }
        }
        stop.store(true, Ordering::Relaxed);
        marker.join().unwrap();
        if let Some(p) = panics.pop() {
            std::panic::resume_unwind(p);
        }
        dev.wait().unwrap();
        assert_eq!(done.load(Ordering::Relaxed), THREADS * syncs);
        assert!(steps.load(Ordering::Relaxed) > 0, "mark_step ran concurrently");
    });
    eprintln!("{THREADS} threads x {syncs} syncs on {name}: {:?}", started.elapsed());
}

#[test]
fn eight_threads_share_a_cpu_device() {
    stress(Device::cpu(), Duration::from_secs(120));
}

#[test]
fn eight_threads_share_a_wgpu_device() {
    let Some(dev) = common::wgpu() else { return };
    stress(dev, Duration::from_secs(240));
}
