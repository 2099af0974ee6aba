//! No silent cliff: a loop that never marks its step is warned about,
//! through `tracing` when the program has a subscriber and on stderr when
//! it has none, naming the program's own line and the fix; and an
//! optimizer's `step()` marks the step for a PyTorch-style loop that
//! calls no `mark_step`, but never for one that does.

mod common;

use lazuli::nn::{self, Linear, Module, ModuleExt};
use lazuli::optim::{Optimizer, Sgd};
use lazuli::prelude::*;
use std::io::Write;
use std::sync::{Arc, Mutex};

/// A `tracing` subscriber that keeps every event's text, for `f`'s run.
fn captured<R>(f: impl FnOnce() -> R) -> (R, String) {
    #[derive(Clone)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let sink = Sink(Arc::default());
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN);
    let r = tracing::subscriber::with_default(subscriber.finish(), f);
    let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
    (r, text)
}

/// A value carried across iterations with no sync point: every op at one
/// line, so whichever crosses the graph size limit names it. Returns that
/// line.
fn loop_without_mark_step(dev: &Device) -> u32 {
    let mut x = Tensor::ones([4], DType::F32, dev).unwrap();
    let line = line!() + 2;
    for _ in 0..7000 {
        x = x.mul_scalar(0.999).unwrap().add_scalar(0.5).unwrap();
    }
    assert!(x.to_vec::<f32>().unwrap()[0] > 1.0);
    line
}

#[test]
fn a_loop_without_mark_step_is_warned_about_at_its_line() {
    let dev = Device::cpu();
    let (line, text) = captured(|| loop_without_mark_step(&dev));
    let at = format!("{}:{line}", file!());
    let warning =
        text.lines().find(|l| l.contains("graph size limit")).unwrap_or_else(|| panic!("no warning in {text:?}"));
    assert!(warning.contains("WARN") && warning.contains("Device::mark_step()") && warning.contains(&at), "{warning}");
    assert!(lazuli::warn::given().iter().any(|w| w.contains(&at)), "kept among the warnings given");
    assert!(lazuli::metrics::report().contains("graph size limit"), "and in the metrics report's notes");
}

/// The same loop in a child process with no subscriber: the warning is
/// printed once on stderr.
#[test]
fn without_a_subscriber_the_warning_is_printed_once_on_stderr() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_loop_without_mark_step", "--ignored", "--nocapture", "--test-threads=1"])
        .env("LAZULI_WARNINGS_CHILD", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed: {stderr}");
    assert_eq!(stderr.matches("lazuli: warning: the pending graph").count(), 1, "{stderr}");
    assert!(stderr.contains("Device::mark_step()") && stderr.contains(file!()), "{stderr}");
}

/// Run by the test above, in a process of its own.
#[test]
#[ignore = "run by without_a_subscriber_the_warning_is_printed_once_on_stderr"]
fn child_loop_without_mark_step() {
    if std::env::var("LAZULI_WARNINGS_CHILD").is_err() {
        return;
    }
    let dev = Device::cpu();
    loop_without_mark_step(&dev);
    loop_without_mark_step(&dev);
}

#[test]
fn a_graph_that_grows_at_every_read_is_warned_about() {
    let dev = Device::cpu();
    let w = Tensor::ones([3], DType::F32, &dev).unwrap();
    let ((), text) = captured(|| {
        for _ in 0..8 {
            // A hand-written update and a read, but no mark_step: the
            // update's history stays pending and the read's graph grows.
            w.assign(&w.mul_scalar(0.5).unwrap().add_scalar(0.25).unwrap()).unwrap();
            let _ = w.sum_all().unwrap().item::<f32>().unwrap();
        }
    });
    assert!(text.contains("larger at each of its last") && text.contains("Device::mark_step()"), "{text}");
    assert!(text.contains(file!()), "the read's line: {text}");
}

/// A two-layer regression in PyTorch's habits; `mark` calls `mark_step`.
fn train(dev: &Device, steps: usize, mark: bool) -> (Vec<f32>, f32) {
    dev.manual_seed(3);
    let (l1, l2) = (Linear::new(2, 8, dev).unwrap(), Linear::new(8, 1, dev).unwrap());
    let mut params = l1.parameters();
    params.extend(l2.parameters());
    let mut opt = Sgd::new(params, 0.1).momentum(0.9);
    let x = Tensor::from_slice(&[0f32, 0., 0., 1., 1., 0., 1., 1.], [4, 2], dev).unwrap();
    let y = Tensor::from_slice(&[0f32, 1., 1., 2.], [4, 1], dev).unwrap();
    let mut last = f32::NAN;
    for _ in 0..steps {
        opt.zero_grad();
        let loss = nn::mse(&l2.forward(&nn::relu(&l1.forward(&x).unwrap()).unwrap()).unwrap(), &y).unwrap();
        loss.backward().unwrap();
        opt.step().unwrap();
        if mark {
            dev.mark_step().unwrap();
        }
        last = loss.item::<f32>().unwrap();
    }
    (l2.weight.to_vec::<f32>().unwrap(), last)
}

#[test]
fn the_optimizer_marks_the_step_when_the_program_does_not() {
    for dev in common::devices() {
        let steps = 40;
        let unmarked = dev.clone();
        let (w, loss) = train(&unmarked, steps, false);
        // Marked at the end of every step but the first (where it cannot
        // know yet whether the program marks its own steps).
        assert_eq!(unmarked.rng_state().step, steps as u64 - 1, "{}", dev.name());
        let (compiled, _) = unmarked.compile_counts();
        assert!(compiled <= 8, "{}: {compiled} plans compiled for {steps} steps", dev.name());
        assert!(loss < 0.1, "{}: it trains: loss {loss}", dev.name());
        // The same loop marking its own steps: never marked for, and the
        // same result.
        let marked = match dev.kind() {
            lazuli::BackendKind::Cpu => Device::cpu(),
            _ => Device::wgpu().unwrap(),
        };
        let (w2, loss2) = train(&marked, steps, true);
        assert_eq!(marked.rng_state().step, steps as u64, "{}: one mark per step, the program's", dev.name());
        common::assert_close(&w, &w2, 1e-5, 1e-6, &format!("{}: weights", dev.name()));
        assert!((loss - loss2).abs() < 1e-5, "{}: {loss} vs {loss2}", dev.name());
    }
}

#[test]
fn auto_mark_step_can_be_turned_off() {
    let dev = Device::cpu();
    let p = Tensor::ones([2], DType::F32, &dev).unwrap().requires_grad_(true).unwrap();
    let mut opt = Sgd::new(vec![p.clone()], 0.1).auto_mark_step(false);
    for _ in 0..3 {
        opt.zero_grad();
        p.mul(&p).unwrap().sum_all().unwrap().backward().unwrap();
        opt.step().unwrap();
    }
    assert_eq!(dev.rng_state().step, 0);
    assert!(p.to_vec::<f32>().unwrap()[0] < 1.0);
}
