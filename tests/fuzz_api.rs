//! API fuzzing: random sequences of public API calls with random, often
//! invalid, arguments — bad and repeated axes, mismatched shapes and
//! dtypes, zero and huge dims, zero and negative steps, empty concat,
//! reading with the wrong element type, operands of two devices, extreme
//! integers, out-of-range gather and scatter-add indices, injected device
//! failures, `assign`, `mark_step` and drops in between, sorting, `einsum`
//! and printing, and tensors of huge and
//! near-limit sizes computed and read (1 TiB, beyond the address space,
//! exactly at and just over a CPU device's memory budget, beyond u32
//! element indexing, and on a wgpu device binding 64 KiB windows just
//! over one window and just within and over the storage bindings of one
//! kernel): each must be a typed error or a value, never an abort. Every call runs inside
//! `catch_unwind`: a panic is a failure; every refusal must be an `Err`
//! with a message. A watchdog fails the test if a sequence hangs (a
//! deadlock at a barrier).
//!
//! The sequence is a choice list (see `fuzz_differential.rs`), so proptest
//! shrinks failures to a short call list, persisted in
//! `tests/fuzz_api.proptest-regressions`. `LAZULI_FUZZ_CASES=N` sets the
//! number of sequences (default 1000).

mod common;
use lazuli::ir::{ArgReduceOp, BinaryOp, Op, PadMode, ReduceOp, ScalarValue, UnaryOp};
use lazuli::prelude::*;
use lazuli::CpuDeviceOptions;
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

/// One call: which API (`op`) and four free choices.
#[derive(Clone, Copy, Debug)]
struct Call {
    op: u8,
    a: u8,
    b: u8,
    c: i16,
    d: i16,
}

/// Elements above which a tensor is only recorded, never kept or read (so
/// the fuzzer never asks a backend for gigabytes).
const MAX_KEPT: usize = 1 << 16;

/// The memory budget of the fuzzer's budgeted CPU device.
const BUDGET: usize = 1 << 20;

struct Api {
    devs: Vec<Device>,
    pool: Vec<Tensor>,
    errors: usize,
    log: Vec<String>,
}

/// Dims for shape arguments: small, zero, and huge (overflowing products).
fn dim(k: i16) -> usize {
    match k.rem_euclid(16) {
        0 => 0,
        1..=3 => 1,
        4..=6 => 2,
        7 | 8 => 3,
        9 => 5,
        10 => 7,
        11 => 1 << 20,
        12 => usize::MAX,
        13 => 1 << 33,
        14 => 4,
        _ => 6,
    }
}

/// The binding window of the fuzzer's windowed wgpu device.
const WINDOW: u64 = 64 << 10;

/// lavapipe's storage buffers per shader stage (31 per kernel: one is kept
/// for generic sizes), forced on the windowed device so the kernels near
/// the limit are within and over it on any adapter.
const STORAGE_BUFFERS: u32 = 32;

/// A wgpu device binding at most [`WINDOW`] bytes per storage binding (see
/// `lazuli_wgpu::window`) and [`STORAGE_BUFFERS`] per stage, made once
/// (pipelines stay cached).
fn windowed() -> Option<Device> {
    static DEV: std::sync::OnceLock<Option<Device>> = std::sync::OnceLock::new();
    DEV.get_or_init(|| {
        common::wgpu()?;
        let opts = lazuli::WgpuDeviceOptions {
            binding_window: Some(WINDOW),
            max_storage_buffers: Some(STORAGE_BUFFERS),
            ..Default::default()
        };
        Some(Device::wgpu_with(opts).expect("a second device on the adapter"))
    })
    .clone()
}

/// Element counts of huge and near-limit tensors, which are computed and
/// read: each is refused before any allocation (budget, index range or
/// record-time check), fits a small budget exactly, or is small enough to
/// compute in milliseconds.
fn huge_len(k: u8, dev: &Device) -> usize {
    let window = WINDOW as usize / 4;
    match k % 6 {
        // 1 TiB of f32: over any host's memory and any binding.
        0 => 1 << 38,
        // 4 EiB of f32: beyond the address space.
        1 => 1 << 60,
        // More bytes than any allocation may have: refused when recorded.
        2 => isize::MAX as usize / 2,
        // Exactly the budgeted device's budget of f32, and one over.
        3 => BUDGET / 4,
        4 => BUDGET / 4 + 1,
        // On the windowed device: one f32 over a window, and an
        // elementwise kernel (input and output) just within and just over
        // the device's 31 storage bindings per kernel (lavapipe's, forced).
        _ if windowed().is_some_and(|w| w.same(dev)) => [window + 1, 15 * window, 16 * window][(k / 6 % 3) as usize],
        // One f32 beyond u32 element indexing: refused when compiling.
        _ if dev.kind() == lazuli::BackendKind::Wgpu => (1 << 32) + 1,
        _ => BUDGET / 4 - 1,
    }
}

fn dims(a: u8, c: i16) -> Vec<usize> {
    (0..(a % 5) as usize).map(|i| dim(c.wrapping_mul(7).wrapping_add(i as i16 * 5))).collect()
}

fn axis(c: i16) -> isize {
    (c % 7) as isize
}

fn dtype(k: u8) -> DType {
    DType::ALL[k as usize % DType::ALL.len()]
}

fn small(t: &Tensor) -> bool {
    t.dims().iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).is_some_and(|n| n <= MAX_KEPT)
}

impl Api {
    fn t(&self, k: u8) -> Tensor {
        self.pool[k as usize % self.pool.len()].clone()
    }

    fn keep(&mut self, what: &str, r: lazuli::Result<Tensor>) {
        match r {
            Ok(t) => {
                self.log.push(format!("{what} -> {}{}", t.dtype(), t.shape()));
                if small(&t) {
                    self.pool.push(t);
                }
            }
            Err(e) => self.err(what, e),
        }
    }

    fn err(&mut self, what: &str, e: lazuli::ExecError) {
        let msg = e.to_string();
        assert!(!msg.trim().is_empty(), "{what}: an error with an empty message");
        self.log.push(format!("{what} -> Err({msg})"));
        self.errors += 1;
    }

    fn unit(&mut self, what: &str, r: lazuli::Result<()>) {
        match r {
            Ok(()) => self.log.push(format!("{what} -> ok")),
            Err(e) => self.err(what, e),
        }
    }

    fn call(&mut self, c: Call) {
        let x = self.t(c.a);
        let y = self.t(c.b);
        let dev = self.devs[(c.a as usize / 7) % self.devs.len()].clone();
        match c.op % 42 {
            // Every elementwise op, from the IR's lists: a new op is fuzzed
            // here without a change.
            0 => {
                let op = UnaryOp::ALL[c.b as usize % UnaryOp::ALL.len()];
                self.keep(op.name(), Tensor::record(Op::Unary(op), &[&x]));
            }
            1 => {
                let op = BinaryOp::ALL[c.c.unsigned_abs() as usize % BinaryOp::ALL.len()];
                self.keep(op.name(), Tensor::record(Op::Binary(op), &[&x, &y]));
            }
            2 => {
                let z = self.t(c.d as u8);
                self.keep("where", x.where_(&y, &z));
            }
            3 => self.keep("cast", x.cast(dtype(c.b))),
            4 => {
                let ops = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod];
                let axes: Vec<isize> = (0..(c.b % 4)).map(|i| axis(c.c.wrapping_add(i as i16 * 3))).collect();
                let op = ops[c.d.unsigned_abs() as usize % ops.len()];
                self.keep("reduce", x.reduce_axes(op, &axes, c.d % 2 == 0));
            }
            5 => {
                let op = if c.b.is_multiple_of(2) { ArgReduceOp::ArgMax } else { ArgReduceOp::ArgMin };
                self.keep("arg_reduce", x.arg_reduce(op, axis(c.c), c.d % 2 == 0, c.b % 4 < 2));
            }
            6 => self
                .keep("softmax", if c.b.is_multiple_of(2) { x.softmax(axis(c.c)) } else { x.log_softmax(axis(c.c)) }),
            7 => self.keep("cumsum", x.cumsum(axis(c.c), c.b.is_multiple_of(2), c.b % 4 < 2)),
            8 => self.keep("matmul", x.matmul(&y)),
            9 => {
                let d: Vec<isize> = (0..(c.b % 5))
                    .map(|i| match c.c.wrapping_add(i as i16 * 11).rem_euclid(9) {
                        0 => -1,
                        1 => -2,
                        2 => 0,
                        3 => isize::MAX,
                        k => k as isize - 2,
                    })
                    .collect();
                self.keep("reshape", x.reshape(&d));
            }
            10 => {
                let p: Vec<isize> = (0..(c.b % 5)).map(|i| axis(c.c.wrapping_add(i as i16 * 5))).collect();
                self.keep("permute", x.permute(&p));
            }
            11 => self.keep("expand", x.expand(dims(c.b, c.c))),
            12 => {
                let big = |v: i16| match v % 13 {
                    11 => i64::MAX,
                    12 => i64::MIN,
                    -12 => i64::MIN + 1,
                    k => k as i64,
                };
                let step = match c.b % 7 {
                    0 => 0,
                    1 => i64::MIN,
                    2 => i64::MAX,
                    k => k as i64 - 4,
                };
                self.keep("slice", x.slice(axis(c.c), big(c.c / 7), big(c.d), step));
            }
            13 => self.keep("narrow", x.narrow(axis(c.c), dim(c.d), dim(c.d / 16))),
            14 => {
                let list: Vec<Tensor> = (0..(c.b % 4)).map(|i| self.t(c.a.wrapping_add(i))).collect();
                let refs: Vec<&Tensor> = list.iter().collect();
                if c.d % 2 == 0 {
                    self.keep("concat", Tensor::concat(&refs, axis(c.c)));
                } else {
                    self.keep("stack", Tensor::stack(&refs, axis(c.c)));
                }
            }
            15 => {
                let pads: Vec<(usize, usize)> = (0..(c.b % 5))
                    .map(|i| (dim(c.c.wrapping_add(i as i16)) % 4, dim(c.d.wrapping_add(i as i16))))
                    .collect();
                let r = match c.b % 3 {
                    0 => x.pad(&pads, 1.5),
                    1 => x.pad_mode(&pads, PadMode::Reflect),
                    _ => x.pad_mode(&pads, PadMode::Edge),
                };
                self.keep("pad", r);
            }
            16 if c.b.is_multiple_of(2) => self.keep("gather", x.gather(axis(c.c), &y)),
            16 => {
                let z = self.t(c.d as u8);
                self.keep("scatter_add", x.scatter_add(axis(c.c), &y, &z));
            }
            17 => {
                // Index tensors with out-of-range and extreme values.
                let v: Vec<i32> = [c.c as i32, c.d as i32, i32::MAX, i32::MIN, -1, 0]
                    .into_iter()
                    .take(1 + c.b as usize % 6)
                    .collect();
                let n = v.len();
                self.keep("from_slice(indices)", Tensor::from_slice(&v, [n], &dev));
            }
            18 => self.keep("squeeze", x.squeeze(&[axis(c.c)])),
            19 => self.keep("unsqueeze", x.unsqueeze(axis(c.c))),
            20 => self.keep("flatten", x.flatten(axis(c.c), axis(c.d))),
            21 => self.keep("transpose", x.transpose(axis(c.c), axis(c.d))),
            22 => {
                // Creation with random shapes: huge ones are only recorded.
                let s = dims(c.b, c.c);
                let r = match c.d.rem_euclid(4) {
                    0 => Tensor::zeros(s, dtype(c.b / 5), &dev),
                    1 => Tensor::full(s, c.c as f64 * 0.37, dtype(c.b / 5), &dev),
                    2 => Tensor::iota(s, c.a as usize % 4, dtype(c.b / 5), &dev),
                    _ => Tensor::ones(s, dtype(c.b / 5), &dev),
                };
                self.keep("create", r);
            }
            23 => {
                let (s, e, st) = match c.b % 6 {
                    0 => (0.0, c.c as f64, 1.0),
                    1 => (0.0, 1e30, 1e-30),
                    2 => (f64::NAN, 1.0, 1.0),
                    3 => (0.0, 1.0, 0.0),
                    4 => (c.c as f64, c.d as f64, -0.5),
                    _ => (0.0, f64::INFINITY, 1.0),
                };
                let r = Tensor::arange(s, e, st, dtype(c.a), &dev);
                self.keep("arange", r);
            }
            24 => {
                // from_slice with a wrong length, extreme values.
                let v = [f32::NAN, f32::INFINITY, -0.0, f32::MAX, f32::MIN_POSITIVE, 3.5];
                let n = 1 + c.b as usize % 6;
                self.keep("from_slice", Tensor::from_slice(&v[..n], dims(c.b / 6, c.c), &dev));
            }
            25 => {
                let v = [i32::MAX, i32::MIN, -1, 0, 7, i32::MIN + 1];
                let n = 1 + c.b as usize % 6;
                self.keep("from_slice_i32", Tensor::from_slice(&v[..n], [n], &dev));
            }
            26 => {
                let r = match c.b % 8 {
                    0 => x.to_vec::<f32>().map(|_| ()),
                    1 => x.to_vec::<i32>().map(|_| ()),
                    2 => x.to_vec::<bool>().map(|_| ()),
                    3 => x.to_vec::<f64>().map(|_| ()),
                    4 => x.item::<f32>().map(|_| ()),
                    5 => x.to_scalars().map(|_| ()),
                    6 => x.to_vec::<u8>().map(|_| ()),
                    _ => x.to_bytes().map(|_| ()),
                };
                self.unit("read", r);
            }
            27 => self.unit("assign", x.assign(&y)),
            28 => self.unit("sync", lazuli::sync(&[&x, &y])),
            29 => {
                let d = x.device().clone();
                self.unit("mark_step", d.mark_step());
            }
            30 => {
                let d = x.device().clone();
                self.unit("wait", d.wait());
            }
            31 => {
                // Fault injection: the next execution on x's device fails.
                x.device().fail_next_executions(1 + c.b as usize % 2);
                self.log.push("fail_next_executions".into());
            }
            32 => {
                if self.pool.len() > 4 {
                    let i = c.a as usize % self.pool.len();
                    self.pool.swap_remove(i);
                    self.log.push("drop".into());
                }
            }
            33 => self.keep("scalar_op", x.add_scalar(ScalarValue::Float(c.c as f64 / 3.0))),
            34 => self.keep("clamp", x.clamp(Some(c.c as f64), Some(c.d as f64))),
            35 => {
                let v = match c.b % 4 {
                    0 => ScalarValue::Float(f64::NAN),
                    1 => ScalarValue::Int(i64::MIN),
                    2 => ScalarValue::UInt(u64::MAX),
                    _ => ScalarValue::Bool(true),
                };
                self.keep("scalar", Ok(Tensor::scalar(v, dtype(c.a), &dev)));
            }
            36 => self.keep("detach", Ok(x.detach())),
            37 => {
                let pool_attrs = lazuli::ir::PoolAttrs {
                    kind: lazuli::ir::PoolKind::Max,
                    kernel: vec![dim(c.c); 1 + c.b as usize % 3],
                    strides: vec![dim(c.d); 1 + c.b as usize % 2],
                    pads_begin: vec![0; 1 + c.b as usize % 3],
                    pads_end: vec![0; 1 + c.b as usize % 3],
                    dilations: vec![1; 1 + c.b as usize % 3],
                    ceil_mode: c.b.is_multiple_of(2),
                };
                self.keep("pool", x.pool(pool_attrs));
            }
            38 => {
                let attrs = lazuli::ir::ConvAttrs {
                    strides: [dim(c.c), 1],
                    pads: [0, dim(c.d) % 3, 0, 0],
                    dilations: [1, dim(c.c / 3)],
                    groups: dim(c.d / 5),
                };
                self.keep("conv2d", x.conv2d(&y, attrs));
            }
            39 => {
                // Huge and near-limit sizes, materialized: a typed error
                // or a value. Never kept (a pending huge tensor could make
                // a later reduction fuse and run for hours on lavapipe).
                let n = huge_len(c.b, &dev);
                let dt = [DType::F32, DType::I32, DType::U8][c.a as usize % 3];
                let r = match c.d.rem_euclid(3) {
                    0 => Tensor::rand([n], DType::F32, &dev).and_then(|t| t.to_vec::<f32>().map(|_| ())),
                    1 => Tensor::ones([n], dt, &dev)
                        .and_then(|t| t.mul_scalar(2.0))
                        .and_then(|t| t.to_bytes().map(|_| ())),
                    _ => Tensor::rand([n], DType::F32, &dev).and_then(|t| {
                        // Live during a step, with whatever else is pending.
                        let u = t.add_scalar(1.0)?;
                        let r = dev.mark_step();
                        drop((t, u));
                        r
                    }),
                };
                self.unit("huge", r);
            }
            40 => {
                // Sorting, einsum and printing: typed errors for bad axes,
                // k, specs and operands; printing never fails or panics.
                match c.b % 4 {
                    0 => self.keep("sort", x.sort(axis(c.c), c.d % 2 == 0).map(|(v, _)| v)),
                    1 => {
                        let k = c.d.unsigned_abs() as usize % 6;
                        self.keep("topk", x.topk(k, axis(c.c), c.b % 8 < 4).map(|(_, i)| i))
                    }
                    2 => {
                        let specs: [(&str, usize); 8] = [
                            ("ij,jk->ik", 2),
                            ("ij->ji", 1),
                            ("i,i->", 2),
                            ("ij,j->i", 2),
                            ("bij->b", 1),
                            ("ii->i", 1),
                            ("i,j->ij", 2),
                            ("ij,jk", 3),
                        ];
                        let (spec, n) = specs[c.d.rem_euclid(8) as usize];
                        let ops = [&x, &y, &x];
                        self.keep("einsum", lazuli::einsum(spec, &ops[..n]))
                    }
                    _ => {
                        let text = if c.d % 2 == 0 { x.to_string() } else { format!("{x:.2?}") };
                        assert!(text.starts_with("tensor(") && text.ends_with(')'), "printing gave {text:?}");
                        self.log.push(format!("print -> {} chars", text.len()));
                    }
                }
            }
            _ => {
                // Operator sugar.
                let r = match c.b % 4 {
                    0 => &x + &y,
                    1 => &x * 2.5,
                    2 => &x / &y,
                    _ => -&x,
                };
                self.keep("sugar", r);
            }
        }
    }
}

fn initial(devs: &[Device]) -> Vec<Tensor> {
    let mut pool = Vec::new();
    for d in devs {
        pool.push(Tensor::from_slice(&[1.0f32, -2.0, 3.5, 0.0, f32::NAN, 6.0], [2, 3], d).unwrap());
        pool.push(Tensor::from_slice(&[3i32, -1, 0], [3], d).unwrap());
        pool.push(Tensor::from_slice(&[true, false], [2, 1], d).unwrap());
        pool.push(Tensor::scalar(2.5f32, DType::F32, d));
        pool.push(Tensor::zeros([0, 4], DType::F32, d).unwrap());
        pool.push(Tensor::from_slice(&[1.5f64, -2.0], [2], d).unwrap());
        pool.push(Tensor::from_slice(&[200u8, 7], [2, 1], d).unwrap());
        pool.push(Tensor::ones([1, 2, 3, 4], DType::F32, d).unwrap());
    }
    pool
}

/// Runs one sequence; Err describes a panic.
fn run(calls: &[Call], use_wgpu: bool) -> Result<usize, String> {
    let budgeted =
        Device::cpu_with(CpuDeviceOptions { memory_budget: Some(BUDGET as u64), ..CpuDeviceOptions::default() });
    let mut devs = vec![Device::cpu(), Device::cpu(), budgeted];
    if use_wgpu {
        if let Some(g) = common::wgpu() {
            devs.push(g);
        }
        devs.extend(windowed());
    }
    let mut api = Api { pool: initial(&devs), devs, errors: 0, log: Vec::new() };
    for (i, c) in calls.iter().enumerate() {
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| api.call(*c))) {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            return Err(format!("call {i} ({c:?}) panicked: {msg}\ncalls so far:\n{}", api.log.join("\n")));
        }
    }
    // Whatever happened, the devices still answer (errors are fine).
    for d in &api.devs {
        d.fail_next_executions(0);
        let _ = d.wait();
        let t = Tensor::from_slice(&[1.0f32, 2.0], [2], d).unwrap();
        let v = t.mul_scalar(2.0).and_then(|t| t.to_vec::<f32>());
        if !v.as_deref().is_ok_and(|v| v == [2.0f32, 4.0]) {
            return Err(format!("device {} unusable after the sequence: {v:?}\n{}", d.name(), api.log.join("\n")));
        }
    }
    Ok(api.errors)
}

fn call() -> impl Strategy<Value = Call> {
    (any::<u8>(), any::<u8>(), any::<u8>(), any::<i16>(), any::<i16>()).prop_map(|(op, a, b, c, d)| Call {
        op,
        a,
        b,
        c,
        d,
    })
}

fn cases() -> u32 {
    std::env::var("LAZULI_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(1000)
}

/// Runs the fuzzer on another thread and fails if it does not finish in
/// time (a hang at a barrier is a bug too).
#[test]
fn random_api_sequences_never_panic() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let config = Config {
            cases: cases(),
            source_file: Some(file!()),
            failure_persistence: Some(Box::new(FileFailurePersistence::SourceParallel("proptest-regressions"))),
            max_shrink_iters: 4000,
            ..Config::default()
        };
        let mut runner = TestRunner::new(config);
        let errors = std::sync::atomic::AtomicUsize::new(0);
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let strategy = (prop::collection::vec(call(), 1..=40), any::<bool>());
        let r = runner.run(&strategy, |(seq, use_wgpu)| {
            calls.fetch_add(seq.len(), std::sync::atomic::Ordering::Relaxed);
            let n = run(&seq, use_wgpu).map_err(TestCaseError::fail)?;
            errors.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        });
        eprintln!(
            "fuzz_api: {} sequences, {} calls, {} errors returned",
            cases(),
            calls.into_inner(),
            errors.into_inner()
        );
        let _ = tx.send(r.map_err(|e| e.to_string()));
    });
    let limit = Duration::from_secs(60 + cases() as u64);
    match rx.recv_timeout(limit) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("{e}"),
        Err(_) => panic!("the API fuzzer did not finish in {limit:?}: a call sequence hangs (deadlock at a barrier?)"),
    }
}

// Regression tests for panics the fuzzer found (docs/reliability-findings.md).

/// Finding 4: `slice` with a step of `i64::MIN` or `i64::MAX` overflowed
/// (`-step`, `+ step - 1`) and panicked instead of slicing.
#[test]
fn slice_with_extreme_steps() {
    let d = Device::cpu();
    let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0], [3], &d).unwrap();
    assert_eq!(x.slice(0, -1, i64::MIN, i64::MIN).unwrap().to_vec::<f32>().unwrap(), vec![3.0]);
    assert_eq!(x.slice(0, 0, i64::MAX, i64::MAX).unwrap().to_vec::<f32>().unwrap(), vec![1.0]);
    assert_eq!(x.slice(0, i64::MIN, i64::MAX, 1).unwrap().to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
}

/// Finding 5: a shape whose element count overflows `usize` panicked in
/// `Shape::numel` (from_slice, zeros, expand ...); now an error.
#[test]
fn shapes_with_overflowing_element_counts() {
    let d = Device::cpu();
    let e = Tensor::from_slice(&[1.0f32], [usize::MAX, 2], &d).unwrap_err().to_string();
    assert!(e.contains("from_slice"), "{e}");
    let e = Tensor::zeros([usize::MAX, 3], DType::F32, &d).unwrap_err().to_string();
    assert!(e.contains("expand") && e.contains("too many elements"), "{e}");
    let x = Tensor::ones([2], DType::F32, &d).unwrap();
    let e = x.expand([1 << 62, 2]).unwrap_err().to_string();
    assert!(e.contains("expand") && e.contains("too many elements"), "{e}");
    assert!(Tensor::iota([1 << 40, 1 << 40], 0, DType::I32, &d).is_err());
    let e = x.reshape([isize::MAX, 4, -1]).unwrap_err().to_string();
    assert!(e.contains("reshape"), "{e}");
    let e = x.pad(&[(3, usize::MAX)], 0.0).unwrap_err().to_string();
    assert!(e.contains("pad") && e.contains("too many elements"), "{e}");
}
