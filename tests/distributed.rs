//! Data-parallel training across processes (cargo feature `mpi`): each
//! test launches this test binary's `rank_worker` under `mpirun -np N
//! --oversubscribe` (with `--allow-run-as-root` as root), with a scenario
//! in `DP_SCENARIO`; every rank writes what it saw as JSON into `DP_OUT`
//! and the test compares the ranks' files. Run with `cargo test
//! --features mpi --test distributed`; on wgpu with
//! `WGPU_BACKEND=vulkan LAZULI_REQUIRE_ADAPTER=1` (lavapipe in CI).
//!
//! Each scenario runs in two modes (`DP_MODE`): `host` averages the
//! gradients on the host between backward and the optimizer
//! (`DataParallel::finish_step`), `graph` records the all-reduce into the
//! step (`DataParallel::reduce_in_graph`, the executor's collective
//! segments) and checks that nothing compiles after step 2.
//!
//! Scenarios: `train` (N ranks with batch B/N reach the parameters one
//! process reaches with batch B; broadcast makes the initial parameters
//! equal), `mismatch` (different parameter lists: the same clear error on
//! every rank), `fail` (a rank's bad shape reaches every rank as an
//! error), `device` (a rank's device fails during backward: every rank
//! gets the error), `stall` (a stalled rank: its peer times out, the job ends),
//! `die` (a rank exits: mpirun ends the job).

mod common;

use lazuli::distributed::{data_parallel, device_for, DistError, ProcessGroup};
use lazuli::nn::{cross_entropy, Module, ModuleExt};
use lazuli::optim::{Optimizer, Sgd};
use lazuli::{Device, Tensor};
use lazuli_models::digits::Mlp;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Rows of the global batch.
const GLOBAL_BATCH: usize = 12;
/// Training steps compared.
const STEPS: usize = 4;
const FEATURES: usize = 6;
const CLASSES: usize = 3;

/// The global batch of `step`: deterministic rows and labels.
fn global_batch(step: usize) -> (Vec<f32>, Vec<i32>) {
    let x = (0..GLOBAL_BATCH * FEATURES).map(|i| ((i * 7 + step * 13) as f32 * 0.37).sin()).collect();
    let y = (0..GLOBAL_BATCH).map(|i| ((i * 5 + step) % CLASSES) as i32).collect();
    (x, y)
}

fn values(params: &[(String, Tensor)]) -> Result<BTreeMap<String, Vec<f32>>, lazuli::ExecError> {
    params.iter().map(|(n, t)| Ok((n.clone(), t.to_vec::<f32>()?))).collect()
}

/// What a rank ran: the scenario's outcome, or the error it ended with.
fn run_rank(scenario: &str, group: ProcessGroup, dev: &Device) -> Result<Value, String> {
    let in_graph = std::env::var("DP_MODE").as_deref() == Ok("graph");
    let (world, rank) = (group.world_size(), group.rank());
    let mut out = json!({
        "world": world,
        "rank": rank,
        "transport": format!("{:?}", group.transport()),
        "device": dev.name(),
    });
    // Each rank draws different initial values: only the broadcast makes
    // them equal.
    dev.manual_seed(100 + rank as u64);
    let hidden = if scenario == "mismatch" && rank == world - 1 { 9 } else { 8 };
    let model = Mlp::new(FEATURES, hidden, CLASSES, dev).map_err(|e| e.to_string())?;
    out["before"] = json!(values(&model.named_parameters()).map_err(|e| e.to_string())?);
    let mut dp = data_parallel(group, &model).map_err(|e| e.to_string())?;
    out["init"] = json!(values(&model.named_parameters()).map_err(|e| e.to_string())?);
    if scenario == "die" && rank == 1 {
        // Gone without a word: mpirun must end the job.
        std::process::exit(3);
    }
    let mut opt = Sgd::new(model.parameters(), 0.5).momentum(0.9);
    let per_rank = GLOBAL_BATCH / world;
    for step in 0..STEPS {
        if scenario == "stall" && rank == 1 {
            std::thread::sleep(Duration::from_secs(120));
        }
        if scenario == "device" && rank == 1 && step == 1 {
            // The backward pass fails on the device, asynchronously (as an
            // out-of-memory would): the error surfaces at the gradients'
            // sync, inside the all-reduce.
            dev.fail_next_executions(1);
        }
        let (x, y) = global_batch(step);
        let rows = rank * per_rank..(rank + 1) * per_rank;
        let local = (|| -> lazuli::Result<()> {
            // Rank 1 of `fail` feeds rows of the wrong width: a typed error
            // at the matmul, on this rank only.
            let width = if scenario == "fail" && rank == 1 && step == 1 { FEATURES - 1 } else { FEATURES };
            let xs = &x[rows.start * FEATURES..rows.start * FEATURES + per_rank * width];
            let xt = Tensor::from_slice(xs, [per_rank, width], dev)?;
            let yt = Tensor::from_slice(&y[rows.clone()], [per_rank], dev)?;
            cross_entropy(&model.forward(&xt)?, &yt)?.backward()
        })();
        if in_graph {
            match local {
                Ok(()) => dp.reduce_in_graph().map_err(|e| e.to_string())?,
                Err(e) => return Err(dp.abandon_step(e).to_string()),
            }
            out["bytes_per_step"] = json!(dp.bytes_per_step());
        } else {
            let stats = dp.finish_step(local).map_err(|e| e.to_string())?;
            out["bytes_per_step"] = json!(stats.bytes);
        }
        opt.step().map_err(|e| e.to_string())?;
        opt.zero_grad();
        dev.mark_step().map_err(|e| e.to_string())?;
        if in_graph {
            // The step's errors (a peer's failure, a timeout) surface here.
            dev.wait().map_err(|e| e.to_string())?;
            if step == 1 {
                out["uncached_at_step_2"] = json!(dev.compile_counts().0);
            }
        }
    }
    if in_graph {
        let after = dev.compile_counts().0 - out["uncached_at_step_2"].as_u64().unwrap_or(0);
        out["uncached_after_step_2"] = json!(after);
        out["reduces"] = json!(dp.take_stats().buckets);
    }
    out["final"] = json!(values(&model.named_parameters()).map_err(|e| e.to_string())?);
    Ok(out)
}

/// The entry point of each rank (not a test of its own: the tests below
/// launch it under mpirun with `--ignored --exact rank_worker`).
#[test]
#[ignore = "run by the other tests under mpirun, one process per rank"]
fn rank_worker() {
    let scenario = std::env::var("DP_SCENARIO").expect("DP_SCENARIO names the scenario");
    let out_dir = PathBuf::from(std::env::var("DP_OUT").expect("DP_OUT names the output folder"));
    let result = ProcessGroup::init().map_err(|e| e.to_string()).and_then(|group| {
        let rank = group.rank();
        let dev = device_for(&group).map_err(|e| e.to_string())?;
        Ok((rank, run_rank(&scenario, group, &dev)))
    });
    let (rank, value) = match result {
        Ok((rank, Ok(v))) => (rank, v),
        Ok((rank, Err(e))) => (rank, json!({ "rank": rank, "error": e })),
        Err(e) => (usize::MAX, json!({ "error": e })),
    };
    std::fs::write(out_dir.join(format!("rank{rank}.json")), value.to_string()).expect("write the rank's result");
}

/// `mpirun` with the flags CI needs, or the worker alone for `ranks == 0`.
fn launch(ranks: usize, scenario: &str, env: &[(&str, &str)], limit: Duration) -> (Output, Duration, PathBuf) {
    launch_in(Mode::Host, ranks, scenario, env, limit)
}

/// Where the gradients are averaged (`DP_MODE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// `DataParallel::finish_step`.
    Host,
    /// `DataParallel::reduce_in_graph`.
    Graph,
}

fn launch_in(
    mode: Mode,
    ranks: usize,
    scenario: &str,
    env: &[(&str, &str)],
    limit: Duration,
) -> (Output, Duration, PathBuf) {
    let exe = std::env::current_exe().expect("the test binary");
    let out =
        std::env::temp_dir().join(format!("lazuli-dp-{}-{mode:?}-{scenario}-{ranks}-{}", std::process::id(), unique()));
    std::fs::create_dir_all(&out).expect("output folder");
    let worker = [exe.to_str().expect("a UTF-8 path"), "--ignored", "--exact", "rank_worker", "--test-threads=1"];
    let mut cmd = if ranks == 0 {
        let mut c = Command::new(worker[0]);
        c.args(&worker[1..]);
        c
    } else {
        let mut c = Command::new("mpirun");
        if is_root() {
            c.arg("--allow-run-as-root");
        }
        c.args(["--oversubscribe", "-np", &ranks.to_string()]).args(worker);
        c
    };
    cmd.env("DP_MODE", if mode == Mode::Graph { "graph" } else { "host" });
    cmd.env("DP_SCENARIO", scenario).env("DP_OUT", &out).stdout(Stdio::piped()).stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let started = Instant::now();
    let mut child = cmd.spawn().expect("mpirun (Open MPI) on PATH");
    loop {
        if child.try_wait().expect("wait for mpirun").is_some() {
            break;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let o = child.wait_with_output().expect("output");
            panic!(
                "{scenario} on {ranks} rank(s) hung past {limit:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let elapsed = started.elapsed();
    (child.wait_with_output().expect("output"), elapsed, out)
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0").unwrap_or(false)
}

fn describe(o: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Each rank's JSON, by rank.
fn results(dir: &Path, ranks: usize, o: &Output) -> Vec<Value> {
    (0..ranks.max(1))
        .map(|r| {
            let text = std::fs::read_to_string(dir.join(format!("rank{r}.json")))
                .unwrap_or_else(|e| panic!("rank {r} wrote nothing ({e})\n{}", describe(o)));
            serde_json::from_str(&text).expect("JSON")
        })
        .collect()
}

fn params(v: &Value, key: &str) -> BTreeMap<String, Vec<f32>> {
    serde_json::from_value(v[key].clone()).unwrap_or_else(|e| panic!("{key} of {v}: {e}"))
}

fn assert_close(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>, what: &str) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "{what}");
    for (name, x) in a {
        for (i, (p, q)) in x.iter().zip(&b[name]).enumerate() {
            assert!((p - q).abs() <= 1e-5 + 1e-4 * q.abs(), "{what}: {name}[{i}] = {p} vs {q}");
        }
    }
}

/// One process with the global batch, then 2 and 3 ranks with a third and
/// a half of it: the same parameters after the steps; every rank starts
/// from rank 0's values, which differ from what it drew itself.
fn ranks_match_one_process(device: &str, mode: Mode) {
    // Small buckets in the recorded step: several all-reduces per step.
    let env = [("LAZULI_DEVICE", device), ("LAZULI_DIST_BUCKET_BYTES", "200")];
    let limit = Duration::from_secs(300);
    let (o, _, dir) = launch_in(mode, 0, "train", &env, limit);
    assert!(o.status.success(), "{}", describe(&o));
    let alone = &results(&dir, 1, &o)[0];
    assert_eq!((alone["world"].as_u64(), alone["transport"].as_str()), (Some(1), Some("Local")), "{alone}");
    let reference = params(alone, "final");
    assert_ne!(reference, params(alone, "init"), "training changed the parameters");
    for ranks in [2, 3] {
        let (o, _, dir) = launch_in(mode, ranks, "train", &env, limit);
        assert!(o.status.success(), "{}", describe(&o));
        let all = results(&dir, ranks, &o);
        let root_before = params(&all[0], "before");
        assert_eq!(params(&all[0], "init"), params(alone, "init"), "rank 0 draws what one process draws");
        for (r, v) in all.iter().enumerate() {
            assert_eq!((v["world"].as_u64(), v["transport"].as_str()), (Some(ranks as u64), Some("Mpi")), "{v}");
            let name = v["device"].as_str().unwrap_or_default();
            assert!(name.to_lowercase().starts_with(device), "LAZULI_DEVICE={device} runs there: {name}");
            if r > 0 {
                assert_ne!(params(v, "before"), root_before, "rank {r} drew its own values");
            }
            assert_eq!(params(v, "init"), root_before, "rank {r} holds rank 0's values after the broadcast");
            assert_eq!(params(v, "final"), params(&all[0], "final"), "rank {r} ends with rank 0's parameters");
            assert_close(&params(v, "final"), &reference, &format!("{ranks} ranks, rank {r}, vs one process"));
            // fc1 (8x6 + 8) and fc2 (3x8 + 3), f32.
            assert_eq!(v["bytes_per_step"].as_u64(), Some(4 * (48 + 8 + 24 + 3)), "{v}");
            if mode == Mode::Graph {
                assert_eq!(v["uncached_after_step_2"].as_u64(), Some(0), "one cached plan per step: {v}");
                // Buckets of 200 bytes, last layer first: fc2.bias, fc2.weight
                // and fc1.bias (140 bytes), then fc1.weight (192 bytes).
                assert_eq!(v["reduces"].as_u64(), Some(2 * STEPS as u64), "{v}");
            }
        }
    }
}

#[test]
fn cpu_ranks_with_a_share_of_the_batch_match_one_process() {
    ranks_match_one_process("cpu", Mode::Host);
}

#[test]
fn wgpu_ranks_with_a_share_of_the_batch_match_one_process() {
    if common::wgpu().is_none() {
        return;
    }
    ranks_match_one_process("wgpu", Mode::Host);
}

#[test]
fn cpu_ranks_reducing_in_the_step_match_one_process() {
    ranks_match_one_process("cpu", Mode::Graph);
}

#[test]
fn wgpu_ranks_reducing_in_the_step_match_one_process() {
    if common::wgpu().is_none() {
        return;
    }
    ranks_match_one_process("wgpu", Mode::Graph);
}

#[test]
fn in_the_step_a_failing_rank_is_an_error_on_every_rank() {
    let (o, elapsed, dir) = launch_in(Mode::Graph, 3, "fail", &[("LAZULI_DEVICE", "cpu")], Duration::from_secs(120));
    assert!(o.status.success(), "{}", describe(&o));
    let all = results(&dir, 3, &o);
    for (r, v) in all.iter().enumerate() {
        let e = v["error"].as_str().unwrap_or_else(|| panic!("{v}"));
        assert!(e.contains("rank 1 of 3 failed"), "rank {r}: {e}");
        if r == 1 {
            // The failing layer names itself and the shapes (issue 50's
            // layer errors): `Linear(in_features=6, ...) at ...: input of
            // shape [4, 5] has 5 features ...`.
            assert!(e.contains("Linear(in_features=6") && e.contains("[4, 5]"), "names the failing op: {e}");
        }
    }
    eprintln!("in the step, a failing rank: every rank knew within {elapsed:?}");
}

#[test]
fn in_the_step_a_device_failure_on_one_rank_is_an_error_on_every_rank() {
    for ranks in [2, 3] {
        let (o, _, dir) =
            launch_in(Mode::Graph, ranks, "device", &[("LAZULI_DEVICE", "cpu")], Duration::from_secs(120));
        assert!(o.status.success(), "{}", describe(&o));
        for (r, v) in results(&dir, ranks, &o).iter().enumerate() {
            let e = v["error"].as_str().unwrap_or_else(|| panic!("{v}"));
            let want = if r == 1 { "fault injection".to_string() } else { format!("rank 1 of {ranks} failed") };
            assert!(e.contains(&want), "rank {r}: {e}");
        }
    }
}

#[test]
fn in_the_step_a_stalled_rank_makes_its_peer_time_out_and_the_job_end() {
    let env = [("LAZULI_DEVICE", "cpu"), ("LAZULI_DIST_TIMEOUT_SECS", "3")];
    let (o, elapsed, dir) = launch_in(Mode::Graph, 2, "stall", &env, Duration::from_secs(100));
    assert!(elapsed < Duration::from_secs(60), "took {elapsed:?}");
    assert!(!o.status.success(), "a rank that timed out ends the job with a failure\n{}", describe(&o));
    let text = std::fs::read_to_string(dir.join("rank0.json")).unwrap_or_else(|e| panic!("{e}\n{}", describe(&o)));
    let v: Value = serde_json::from_str(&text).expect("JSON");
    let e = v["error"].as_str().unwrap_or_else(|| panic!("{v}"));
    assert!(e.contains("no result from every rank within 3 s"), "{e}");
}

#[test]
fn mismatched_parameters_are_the_same_clear_error_on_every_rank() {
    let (o, _, dir) = launch(3, "mismatch", &[("LAZULI_DEVICE", "cpu")], Duration::from_secs(120));
    assert!(o.status.success(), "{}", describe(&o));
    let all = results(&dir, 3, &o);
    let first = all[0]["error"].as_str().unwrap_or_else(|| panic!("{}", all[0])).to_string();
    for v in &all {
        assert_eq!(v["error"].as_str(), Some(first.as_str()), "{v}");
    }
    assert!(first.contains("parameters differ between ranks"), "{first}");
    assert!(first.contains("fc1.weight f32[8, 6] on rank 0 but fc1.weight f32[9, 6] on rank 2"), "{first}");
}

#[test]
fn a_failing_rank_is_an_error_on_every_rank() {
    let (o, elapsed, dir) = launch(3, "fail", &[("LAZULI_DEVICE", "cpu")], Duration::from_secs(120));
    assert!(o.status.success(), "{}", describe(&o));
    let all = results(&dir, 3, &o);
    for v in &all {
        let e = v["error"].as_str().unwrap_or_else(|| panic!("{v}"));
        assert!(e.starts_with("rank 1 of 3 failed during all-reduce of gradients: "), "{e}");
        assert!(e.contains("Linear(in_features=6") && e.contains("[4, 5]"), "names the failing op: {e}");
    }
    eprintln!("a failing rank: every rank knew within {elapsed:?}");
}

#[test]
fn a_device_failure_on_one_rank_is_an_error_on_every_rank() {
    let (o, _, dir) = launch(2, "device", &[("LAZULI_DEVICE", "cpu")], Duration::from_secs(120));
    assert!(o.status.success(), "{}", describe(&o));
    for v in results(&dir, 2, &o) {
        let e = v["error"].as_str().unwrap_or_else(|| panic!("{v}"));
        assert!(e.starts_with("rank 1 of 2 failed during all-reduce of gradients: "), "{e}");
        assert!(e.contains("fault injection"), "carries the device's error: {e}");
    }
}

#[test]
fn a_stalled_rank_makes_its_peer_time_out_and_the_job_end() {
    let env = [("LAZULI_DEVICE", "cpu"), ("LAZULI_DIST_TIMEOUT_SECS", "3")];
    let (o, elapsed, dir) = launch(2, "stall", &env, Duration::from_secs(100));
    // Rank 1 sleeps 120 s: the job must end long before.
    assert!(elapsed < Duration::from_secs(60), "took {elapsed:?}");
    assert!(!o.status.success(), "a rank that timed out ends the job with a failure\n{}", describe(&o));
    let text = std::fs::read_to_string(dir.join("rank0.json")).unwrap_or_else(|e| panic!("{e}\n{}", describe(&o)));
    let v: Value = serde_json::from_str(&text).expect("JSON");
    let e = v["error"].as_str().unwrap_or_else(|| panic!("{v}"));
    assert!(e.contains("no result from every rank within 3 s"), "{e}");
}

#[test]
fn a_dying_rank_ends_the_job() {
    let env = [("LAZULI_DEVICE", "cpu"), ("LAZULI_DIST_TIMEOUT_SECS", "200")];
    let (o, elapsed, _) = launch(2, "die", &env, Duration::from_secs(100));
    assert!(elapsed < Duration::from_secs(60), "took {elapsed:?}");
    assert!(!o.status.success(), "{}", describe(&o));
    let stderr = String::from_utf8_lossy(&o.stderr);
    // Open MPI: "mpirun detected that one or more processes exited with
    // non-zero status ... Process name: [[job,1],1] Exit code: 3".
    assert!(
        stderr.contains("non-zero status") && stderr.contains("],1]") && stderr.contains("Exit code:    3"),
        "mpirun names the rank that died and its exit code:\n{stderr}"
    );
}

#[test]
fn a_process_not_launched_by_mpi_is_a_group_of_one() {
    let group = ProcessGroup::init().expect("a local group");
    assert_eq!((group.world_size(), group.rank(), group.local_rank()), (1, 0, 0));
    assert_eq!(group.all_gather_bytes("test", b"abc").unwrap(), vec![b"abc".to_vec()]);
    assert_eq!(group.all_reduce_sum("test", vec![1.0, 2.0]).unwrap(), vec![1.0, 2.0]);
    let err = group.agree("test", Err("boom")).unwrap_err();
    assert!(matches!(err, DistError::RankFailed { rank: 0, .. }), "{err:?}");
}

/// A rank's GPU: `adapter_index` counts among the adapters of the best
/// type, modulo their number; index 0 is the adapter `Device::wgpu()`
/// picks.
#[test]
fn adapter_index_picks_among_the_best_adapters() {
    use lazuli::{DeviceExt, WgpuDeviceOptions};
    let Some(default) = common::wgpu() else { return };
    for index in [0, 1, 7, usize::MAX] {
        let dev = Device::wgpu_with(WgpuDeviceOptions { adapter_index: Some(index), ..Default::default() })
            .unwrap_or_else(|e| panic!("adapter_index {index}: {e}"));
        if index == 0 {
            assert_eq!(dev.name(), default.name());
        }
    }
}
