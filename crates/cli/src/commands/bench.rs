//! `lazuli bench`: the command line over the workloads of the benchmark
//! harness (`crate::bench`): the options ([`Args`], with the `--scale`
//! sets and the iteration defaults of large workloads on slow devices),
//! the run over the chosen devices with a progress bar on stderr, and the
//! output: a text [`table`] with the [`ratios`] the targets are stated in,
//! or a JSON array, and with `--profile` a roofline per workload and device
//! ([`profile_table`], or a `profile` object on the workload's first JSON
//! row): each kernel's workgroups, FLOPs and bytes, and where the adapter
//! has timestamp queries its GPU time, achieved GB/s and TFLOP/s.

use super::DevicesChoice;
use crate::bench::{
    conv_gemm_baseline, matmul_naive_baseline, memcpy, profile, run_amp_workload, run_workload, w1_vec4_baseline,
    BenchConfig, BenchDevice, BenchResult, ConvSizes, GpuSizes, Profile, Workload, AMP_DTYPES,
};
use std::num::NonZeroUsize;

/// Which set of workloads `lazuli bench` runs when none is named.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Scale {
    /// W1–W6 and H1 (host cost per op, by phase), sized for a 2-core box.
    #[default]
    Small,
    /// G1–G8 of docs/workloads.md, sized for a GPU (G8: the GPT training step,
    /// with host and device ms per step).
    Gpu,
}

impl Scale {
    /// The workloads of the set, in order.
    pub fn workloads(self) -> Vec<Workload> {
        match self {
            Scale::Small => Workload::SMALL.to_vec(),
            Scale::Gpu => Workload::GPU.to_vec(),
        }
    }
}

/// The sizes of the G workloads and A1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Size {
    /// docs/workloads.md's sizes.
    #[default]
    Full,
    /// Sizes for a small box ([`GpuSizes::small`]).
    Small,
}

/// Timed iterations of a G workload on the CPU device when `--iterations`
/// is not given: a 4096³ matmul takes about a second there.
pub const GPU_SCALE_CPU_ITERATIONS: usize = 3;

/// Timed iterations of a G workload on a software adapter (lavapipe) when
/// `--iterations` is not given: a G3 or G7 iteration takes about 22 s there.
pub const GPU_SCALE_SOFTWARE_ITERATIONS: usize = 1;

/// A workload named on the command line: "W1" .. "W6", "G1" .. "G8",
/// "H1", "C1", "A1", in any case.
fn parse_workload(s: &str) -> Result<Workload, String> {
    Workload::parse(s).ok_or_else(|| format!("unknown workload {s:?} (W1-W6, G1-G8, H1, C1, A1)"))
}

/// The options of `lazuli bench`: runs the benchmark workloads and their
/// baselines and prints a table. Full-size G workloads time 10 iterations
/// on a GPU, 3 on cpu and 1 on a software adapter unless --iterations is
/// given; one that cannot run on a device (e.g. a tensor over the
/// adapter's binding limit) gives a row with NaN times and the error (key
/// "error" in --json), and the run goes on.
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
pub struct Args {
    /// The workloads to run, in order (default: the --scale set). Besides
    /// W1-W6, H1 and G1-G8, only when named: C1, a conv 3x3 forward +
    /// backward on x [32,32,32,32], w [64,32,3,3], with the gemm crate on
    /// the same three products as its baseline; A1, causal attention on
    /// [4, 8, 1024, 64], the fused op beside the unfused composition,
    /// forward and forward + backward, with the unfused / fused ratios.
    #[arg(value_parser = parse_workload, value_name = "WORKLOAD")]
    pub workloads: Vec<Workload>,
    /// The set run when no workload is named.
    #[arg(long, value_enum, default_value_t = Scale::Small)]
    pub scale: Scale,
    /// The sizes of the G workloads and A1.
    #[arg(long, value_enum, default_value_t = Size::Full)]
    pub size: Size,
    /// The devices to run on.
    #[arg(long, value_enum, default_value_t = DevicesChoice::All)]
    pub device: DevicesChoice,
    /// Print a JSON array instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Add the roofline of each workload on wgpu over --iterations runs
    /// (default 3): per kernel its workgroups, FLOPs and bytes and, with
    /// timestamp queries, its GPU time and achieved rates.
    #[arg(long)]
    pub profile: bool,
    /// After G3 and G8, their mixed-precision rows (f16 inputs: "G3
    /// matmul 4096^3 f16"; G8 under autocast f16 with a grad scaler: "G8
    /// GPT train step autocast f16"), named as the PyTorch twin's amp
    /// engine names its rows.
    #[arg(long)]
    pub amp: bool,
    /// Timed iterations (default: see above).
    #[arg(long, value_name = "N")]
    pub iterations: Option<NonZeroUsize>,
}

impl Args {
    /// The workloads to run, in order: those named, or else the `--scale`
    /// set.
    pub fn workloads(&self) -> Vec<Workload> {
        if self.workloads.is_empty() {
            self.scale.workloads()
        } else {
            self.workloads.clone()
        }
    }

    /// The sizes of the G workloads: `docs/workloads.md`'s, or with `--size
    /// small` [`GpuSizes::small`].
    pub fn sizes(&self) -> GpuSizes {
        match self.size {
            Size::Full => GpuSizes::default(),
            Size::Small => GpuSizes::small(),
        }
    }

    /// `--iterations N`, if given.
    pub fn iterations(&self) -> Option<usize> {
        self.iterations.map(NonZeroUsize::get)
    }

    /// The iterations of workload `w` on the device labelled `device`
    /// ("cpu", "wgpu" or "wgpu (software)"): `--iterations` if given, else
    /// 10, except for G workloads at full size on the CPU device
    /// ([`GPU_SCALE_CPU_ITERATIONS`]) and on software adapters
    /// ([`GPU_SCALE_SOFTWARE_ITERATIONS`]).
    pub fn config(&self, w: Workload, device: &str) -> BenchConfig {
        let default = BenchConfig::default();
        let fallback = match device {
            _ if !(w.is_gpu_scale() || w == Workload::A1) || self.size == Size::Small => default.iterations,
            "cpu" => GPU_SCALE_CPU_ITERATIONS,
            "wgpu (software)" => GPU_SCALE_SOFTWARE_ITERATIONS,
            _ => default.iterations,
        };
        BenchConfig { iterations: self.iterations().unwrap_or(fallback), ..default }
    }
}

/// `lazuli bench [W1 ... G1 ...] [--scale small|gpu] [--size full|small]
/// [--device cpu|wgpu|all] [--json] [--profile] [--amp] [--iterations N]`: runs the
/// workloads (the `--scale` set by default: W1–W6 and H1, or G1–G8 with
/// `--scale gpu`; G workloads at `--size`) and
/// the baselines on the chosen devices (default all), with a progress bar
/// on stderr, and prints a table, or a JSON array with `--json`.
/// `--profile` adds the roofline of each workload on wgpu over
/// `--iterations` runs (default 3): per kernel its workgroups, FLOPs and
/// bytes and, with timestamp queries, its GPU time and achieved rates.
pub fn run(args: Args) -> Result<(), String> {
    let workloads = &args.workloads();
    let sizes = args.sizes();
    let cfg = BenchConfig {
        iterations: args.iterations().unwrap_or(BenchConfig::default().iterations),
        ..BenchConfig::default()
    };
    let (cpu, wgpu) = (args.device.cpu(), args.device.wgpu());
    let mut devices = Vec::new();
    if cpu {
        devices.push(BenchDevice::cpu());
    }
    if wgpu {
        match BenchDevice::wgpu() {
            Ok(d) => devices.push(d),
            Err(e) if cpu => eprintln!("lazuli bench: no wgpu device ({e}); CPU only"),
            Err(e) => return Err(e.to_string()),
        }
    }
    let has = |w: Workload| workloads.contains(&w);
    let wgpu_dev = devices.iter().find_map(|d| d.wgpu.clone());
    let steps = 1
        + has(Workload::C1) as usize
        + workloads.len() * devices.len()
        + wgpu_dev.as_ref().map_or(0, |_| has(Workload::W1) as usize + has(Workload::W2) as usize);
    let bar = indicatif::ProgressBar::new(steps as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut rows = Vec::new();
    bar.set_message("memcpy");
    rows.push(memcpy(&cfg));
    bar.inc(1);
    if has(Workload::C1) {
        bar.set_message("C1 gemm baseline");
        rows.push(conv_gemm_baseline(&cfg, ConvSizes::C1));
        bar.inc(1);
    }
    if let Some(b) = &wgpu_dev {
        if has(Workload::W1) {
            bar.set_message("W1 vec4 baseline (wgpu)");
            rows.push(w1_vec4_baseline(b, &cfg).map_err(|e| e.to_string())?);
            bar.inc(1);
        }
        if has(Workload::W2) {
            bar.set_message("W2 naive baseline (wgpu)");
            rows.push(matmul_naive_baseline(b, &cfg).map_err(|e| e.to_string())?);
            bar.inc(1);
        }
    }
    // (workload, index of its first row if it has one, profile or why
    // there is none).
    let mut profiles: Vec<(Workload, Option<usize>, ProfileOutcome)> = Vec::new();
    let profile_iterations = args.iterations().unwrap_or(3);
    for d in &devices {
        for &w in workloads {
            bar.set_message(format!("{} ({})", w.name(), d.label));
            let kind = if d.wgpu.as_ref().is_some_and(|b| b.is_software()) { "wgpu (software)" } else { d.label };
            let measured = run_workload(w, d, &args.config(w, kind), &sizes)
                .map_err(|e| format!("{} on {}: {e}", w.name(), d.label))?;
            let ran = measured.iter().all(|r| r.error.is_none());
            let first_row = (!measured.is_empty()).then_some(rows.len());
            rows.extend(measured);
            if args.amp {
                for &dtype in AMP_DTYPES {
                    bar.set_message(format!("{} {dtype} ({})", w.name(), d.label));
                    rows.extend(run_amp_workload(w, d, &args.config(w, kind), &sizes, dtype));
                }
            }
            if args.profile && w != Workload::W6 {
                let p = if !w.is_gpu_scale() {
                    Ok(profile(w, d, &sizes, profile_iterations).map_err(|e| e.to_string())?)
                } else if !ran {
                    Err("not profiled: the workload did not run".to_string())
                } else {
                    let p = profile(w, d, &sizes, profile_iterations).map_err(|e| e.to_string());
                    if p.is_err() {
                        let _ = d.device.wait();
                    }
                    p
                };
                profiles.push((w, first_row, p));
            }
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    if args.json {
        let mut arr: Vec<serde_json::Value> = rows.iter().map(BenchResult::to_json).collect();
        for (_, row, p) in &profiles {
            let value = match p {
                Ok(Some(p)) => p.to_json(),
                Ok(None) => continue,
                Err(e) => serde_json::json!({ "error": e }),
            };
            if let Some(serde_json::Value::Object(o)) = row.and_then(|r| arr.get_mut(r)) {
                o.insert("profile".into(), value);
            }
        }
        println!("{}", serde_json::Value::Array(arr));
        return Ok(());
    }
    if let Some(b) = &wgpu_dev {
        println!("wgpu adapter: {}", lazuli_executor::Backend::name(b.as_ref()));
    }
    print!("{}", table(&rows));
    print!("{}", ratios(&rows));
    if args.profile {
        for (w, _, p) in profiles {
            match p {
                Err(e) => println!("profile {}: {e}", w.name()),
                Ok(None) => println!("profile {}: the device collects no launches", w.name()),
                Ok(Some(p)) => print!("{}", profile_table(w.name(), &p)),
            }
        }
    }
    Ok(())
}

/// A workload's profile, `None` where the device collects no launches,
/// or why it has none.
type ProfileOutcome = Result<Option<Profile>, String>;

/// Workload `name`'s profile as a text table: per kernel its time (GPU
/// time on wgpu, wall time on the CPU backend) and share of the
/// workload's (where timed), launches, workgroups (threads on the CPU
/// backend), GFLOP and MB of one launch, and achieved GB/s and TFLOP/s
/// (where timed).
pub fn profile_table(name: &str, p: &Profile) -> String {
    let cpu = p.device == "cpu";
    let mut s = match (p.timed, cpu) {
        (true, true) => format!("profile {name} (CPU wall time over {} iterations):\n", p.iterations),
        (true, false) => format!("profile {name} (GPU time over {} iterations):\n", p.iterations),
        (false, _) => {
            format!(
                "profile {name} ({} iterations; no timestamp queries on this adapter, counts only):\n",
                p.iterations
            )
        }
    };
    s.push_str(&format!(
        "  {:>10} {:>8} {:>6} {:>8} {:>10} {:>10} {:>10} {:>9} {:>8}  kernel\n",
        "ms",
        if cpu { "cpu ms" } else { "" },
        "share",
        "launches",
        if cpu { "threads" } else { "workgroups" },
        "GFLOP",
        "MB",
        "GB/s",
        "TFLOP/s"
    ));
    let opt = |v: Option<f64>, digits: usize| v.map(|v| format!("{v:.digits$}")).unwrap_or_default();
    for k in &p.kernels {
        s.push_str(&format!(
            "  {:>10} {:>8} {:>6} {:>8} {:>10} {:>10.3} {:>10.3} {:>9} {:>8}  {}\n",
            opt(k.ms, 3),
            opt(k.cpu_ms, 3),
            k.share.map(|f| format!("{:.1}%", f * 100.0)).unwrap_or_default(),
            k.launches,
            if cpu { k.threads.unwrap_or(1) as u64 } else { k.workgroups },
            k.flops as f64 / 1e9,
            k.bytes as f64 / 1e6,
            opt(k.gbps(), 2),
            opt(k.tflops(), 3),
            k.name
        ));
    }
    s
}

/// The rows as an aligned text table (the workload column at least 20
/// wide; a row that could not run shows its error as the note).
pub fn table(rows: &[BenchResult]) -> String {
    let width = rows.iter().map(|r| r.workload.chars().count()).max().unwrap_or(0).max(20);
    let mut s = format!(
        "{:<width$} {:<6} {:>11} {:>11} {:>11} {:>16} {:>8}  {}\n",
        "workload", "device", "median ms", "min ms", "max ms", "throughput", "kernels", "note"
    );
    for r in rows {
        let tp = match (r.gbps, r.gflops) {
            (Some(g), _) => format!("{g:.2} GB/s"),
            (_, Some(f)) => format!("{f:.2} GFLOP/s"),
            _ => String::new(),
        };
        let k = r.kernels.map(|k| format!("{k:.1}")).unwrap_or_default();
        let note = match (&r.error, r.cpu_ms) {
            (Some(e), _) => format!("error: {e}"),
            // The process's CPU time per iteration: the work, whatever
            // share of the cores a busy host gave the process.
            (None, Some(cpu)) => {
                let rest = r.note.as_deref().map(|n| format!("; {n}")).unwrap_or_default();
                format!("cpu {cpu:.3} ms{rest}")
            }
            (None, None) => r.note.clone().unwrap_or_default(),
        };
        s.push_str(&format!(
            "{:<width$} {:<6} {:>11.3} {:>11.3} {:>11.3} {:>16} {:>8}  {}\n",
            r.workload, r.device, r.median_ms, r.min_ms, r.max_ms, tp, k, note
        ));
    }
    s
}

/// The ratios the targets are stated in, for the rows present.
pub fn ratios(rows: &[BenchResult]) -> String {
    let find = |w: &str, d: &str| rows.iter().find(|r| r.workload == w && r.device == d);
    let mut s = String::new();
    let mut line = |name: &str, v: Option<f64>| {
        if let Some(v) = v {
            s.push_str(&format!("{name:<32} {v:.2}x\n"));
        }
    };
    let memcpy = find("memcpy 64 MiB", "host").and_then(|r| r.gbps);
    for d in ["wgpu", "cpu"] {
        let w1 = find("W1", d).and_then(|r| r.gbps);
        line(&format!("W1 {d} / memcpy"), w1.zip(memcpy).map(|(a, b)| a / b));
        let w3 = find("W3", d).and_then(|r| r.gbps);
        line(&format!("W3 {d} / W1 {d} (GB/s)"), w3.zip(w1).map(|(a, b)| a / b));
    }
    let vec4 = find("W1 vec4 baseline", "wgpu").and_then(|r| r.gbps);
    line("W1 wgpu / vec4 baseline", find("W1", "wgpu").and_then(|r| r.gbps).zip(vec4).map(|(a, b)| a / b));
    let gemm = find("C1 gemm baseline", "host").and_then(|r| r.gflops);
    for d in ["cpu", "wgpu"] {
        line(&format!("C1 {d} / gemm baseline"), find("C1", d).and_then(|r| r.gflops).zip(gemm).map(|(a, b)| a / b));
    }
    for d in ["cpu", "wgpu"] {
        for what in ["forward", "forward+backward"] {
            let ms = |kind: &str| find(&format!("A1 attention {what} {kind}"), d).map(|r| r.median_ms);
            line(&format!("A1 {d} {what}: unfused / fused"), ms("unfused").zip(ms("fused")).map(|(u, f)| u / f));
        }
    }
    let naive = find("W2 naive baseline", "wgpu").and_then(|r| r.gflops);
    line("W2 wgpu / naive baseline", find("W2", "wgpu").and_then(|r| r.gflops).zip(naive).map(|(a, b)| a / b));
    s
}

/// Argument parsing, iteration defaults, the table and the ratios, with
/// the workloads they report run at tiny sizes on the CPU device.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::{run_gpu_workload, ConvStep, KernelProfile};
    use clap::Parser;
    use lazuli_models::gpt::GptSizes;

    /// The options alone, as `lazuli` parses them (a repeated option's
    /// last value wins).
    #[derive(Parser)]
    #[command(args_override_self = true)]
    struct Bench {
        #[command(flatten)]
        args: Args,
    }

    /// `lazuli bench S` parsed, or clap's message.
    fn parse(s: &str) -> Result<Args, String> {
        let argv = ["bench"].into_iter().chain(s.split_whitespace());
        Bench::try_parse_from(argv).map(|b| b.args).map_err(|e| e.to_string())
    }

    #[test]
    fn scale_selects_the_workload_set() {
        assert_eq!(parse("").unwrap().workloads(), Workload::SMALL.to_vec());
        assert_eq!(parse("--scale small").unwrap().workloads(), Workload::SMALL.to_vec());
        let gpu = parse("--scale gpu --device cpu --json --profile --iterations 2").unwrap();
        assert_eq!(gpu.workloads(), Workload::GPU.to_vec());
        assert!(gpu.device.cpu() && !gpu.device.wgpu() && gpu.json && gpu.profile);
        assert_eq!(gpu.iterations(), Some(2));
        let all = parse("").unwrap();
        assert!(all.device.cpu() && all.device.wgpu(), "both devices by default");
        // Named workloads win over the set.
        assert_eq!(parse("--scale gpu W3").unwrap().workloads(), vec![Workload::W3]);
        // Options may come before, between and after the workloads.
        assert_eq!(parse("W3 --device wgpu G8 --json").unwrap().workloads(), vec![Workload::W3, Workload::G8]);
    }

    #[test]
    fn g_workloads_parse_by_name() {
        let all = parse("G1 g2 G3 G4 G5 G6 G7 G8").unwrap();
        assert_eq!(all.workloads(), Workload::GPU.to_vec());
        assert!(Workload::GPU.iter().all(|w| w.is_gpu_scale()));
        assert!(Workload::SMALL.iter().all(|w| !w.is_gpu_scale()));
        assert_eq!(parse("h1").unwrap().workloads(), vec![Workload::H1]);
        assert!(parse("G9").unwrap_err().contains("unknown workload \"G9\""));
    }

    #[test]
    fn size_selects_the_g_workload_sizes() {
        assert_eq!(parse("G8").unwrap().sizes(), GpuSizes::default());
        assert_eq!(parse("G8 --size small").unwrap().sizes(), GpuSizes::small());
        // The last of a repeated option wins.
        assert_eq!(parse("G8 --size small --size full").unwrap().sizes(), GpuSizes::default());
        let huge = parse("--size huge").unwrap_err();
        assert!(huge.contains("'huge'") && huge.contains("[possible values: full, small]"), "{huge}");
        // Small sizes take the ordinary iteration count everywhere.
        let small = parse("G8 --size small").unwrap();
        assert_eq!(small.config(Workload::G8, "wgpu (software)").iterations, 10);
        assert_eq!(small.config(Workload::G8, "cpu").iterations, 10);
        assert_eq!(GpuSizes::small().gpt.parameter_tensors(), 28);
        assert_eq!(GptSizes::G8.parameter_tensors(), 52);
    }

    #[test]
    fn amp_adds_the_mixed_precision_rows() {
        assert!(!parse("G3 G8").unwrap().amp);
        let a = parse("G3 G8 --amp").unwrap();
        assert!(a.amp);
        assert_eq!(a.workloads(), vec![Workload::G3, Workload::G8]);
    }

    #[test]
    fn bad_scale_is_rejected() {
        let huge = parse("--scale huge").unwrap_err();
        assert!(huge.contains("'huge'") && huge.contains("[possible values: small, gpu]"), "{huge}");
        assert!(parse("--scale").is_err());
        assert!(parse("--iterations 0").is_err());
    }

    #[test]
    fn iteration_defaults_are_small_for_g_on_cpu() {
        let a = parse("--scale gpu").unwrap();
        assert_eq!(a.config(Workload::G3, "cpu").iterations, GPU_SCALE_CPU_ITERATIONS);
        assert_eq!(a.config(Workload::G3, "wgpu").iterations, 10);
        assert_eq!(a.config(Workload::G3, "wgpu (software)").iterations, GPU_SCALE_SOFTWARE_ITERATIONS);
        assert_eq!(a.config(Workload::W1, "wgpu (software)").iterations, 10);
        assert_eq!(a.config(Workload::W2, "cpu").iterations, 10);
        assert_eq!(a.config(Workload::G3, "cpu").warmup, 3);
        let n = parse("--scale gpu --iterations 1").unwrap();
        assert_eq!(n.config(Workload::G3, "cpu").iterations, 1);
        assert_eq!(n.config(Workload::G3, "wgpu").iterations, 1);
    }

    #[test]
    fn a_failing_workload_is_an_error_row_and_the_run_goes_on() {
        let bd = BenchDevice::cpu();
        let cfg = BenchConfig { warmup: 1, iterations: 1 };
        let sizes = GpuSizes::tiny();
        bd.device.fail_next_executions(1);
        let failed = run_gpu_workload(Workload::G5, &bd, &cfg, &sizes);
        assert!(failed.median_ms.is_nan() && failed.gbps.is_none());
        assert!(failed.error.as_deref().is_some_and(|e| e.contains("injected")), "{failed:?}");
        let json = failed.to_json();
        assert!(json["error"].as_str().is_some_and(|e| e.contains("injected")));
        assert!(json["median_ms"].is_null());
        assert!(table(std::slice::from_ref(&failed)).contains("error: "));
        // The same device runs the next workload.
        let next = run_gpu_workload(Workload::G1, &bd, &cfg, &sizes);
        assert_eq!(next.error, None);
        assert!(next.median_ms.is_finite());
    }

    /// C1 parses by name (outside both sets), runs at a tiny size through the
    /// same step, and its ratio to the gemm baseline is printed.
    #[test]
    fn c1_conv_workload_and_its_gemm_baseline() {
        assert_eq!(parse("c1").unwrap().workloads(), vec![Workload::C1]);
        assert!(!Workload::SMALL.contains(&Workload::C1) && !Workload::GPU.contains(&Workload::C1));
        let tiny = ConvSizes { batch: 2, channels: 3, size: 6, out_channels: 4, kernel: 3 };
        assert_eq!(tiny.gemm_dims(), (4, 27, 72));
        assert_eq!(tiny.flops(), 6.0 * 4.0 * 27.0 * 72.0);
        let dev = BenchDevice::cpu().device;
        let mut step = ConvStep::new(&dev, tiny).unwrap();
        step.step().unwrap();
        step.step().unwrap();
        let cfg = BenchConfig { warmup: 1, iterations: 2 };
        let base = conv_gemm_baseline(&cfg, tiny);
        assert_eq!((base.workload.as_str(), base.device.as_str()), ("C1 gemm baseline", "host"));
        assert!(base.gflops.is_some_and(|g| g > 0.0), "{base:?}");
        let mut c1 = base.clone();
        (c1.workload, c1.device, c1.gflops) = ("C1".into(), "cpu".into(), base.gflops.map(|g| g / 2.0));
        assert!(ratios(&[base, c1]).contains("C1 cpu / gemm baseline           0.50x"));
    }

    /// A1 parses by name (outside both sets), runs at the tiny size on the
    /// CPU (the fused op and the composition, forward and forward +
    /// backward), and prints the unfused / fused ratios.
    #[test]
    fn a1_attention_workload_fused_beside_unfused() {
        assert_eq!(parse("a1").unwrap().workloads(), vec![Workload::A1]);
        assert!(!Workload::SMALL.contains(&Workload::A1) && !Workload::GPU.contains(&Workload::A1));
        let sizes = GpuSizes::tiny();
        let bd = BenchDevice::cpu();
        let cfg = BenchConfig { warmup: 1, iterations: 2 };
        let rows = run_workload(Workload::A1, &bd, &cfg, &sizes).unwrap();
        let names: Vec<&str> = rows.iter().map(|r| r.workload.as_str()).collect();
        assert_eq!(
            names,
            [
                "A1 attention forward fused",
                "A1 attention forward unfused",
                "A1 attention forward+backward fused",
                "A1 attention forward+backward unfused"
            ]
        );
        assert!(rows.iter().all(|r| r.median_ms.is_finite() && r.gflops.is_some_and(|g| g > 0.0)), "{rows:?}");
        assert!(rows[0].note.as_deref() == Some("[B1 H2 T24 D8] causal"), "{rows:?}");
        let mut fused = rows[0].clone();
        let mut unfused = rows[1].clone();
        (fused.median_ms, unfused.median_ms) = (1.0, 2.5);
        fused.device = "wgpu".into();
        unfused.device = "wgpu".into();
        assert!(ratios(&[fused, unfused]).contains("A1 wgpu forward: unfused / fused 2.50x"), "{}", ratios(&rows));
    }

    #[test]
    fn the_profile_table_prints_counts_untimed_and_rates_timed() {
        let kernel = KernelProfile {
            name: "k0_MatMul_matmul".into(),
            launches: 2,
            workgroups: 256,
            flops: 2_000_000_000,
            bytes: 12_000_000,
            ms: None,
            threads: None,
            cpu_ms: None,
            share: None,
        };
        let untimed = Profile { device: "wgpu".into(), iterations: 2, timed: false, kernels: vec![kernel.clone()] };
        let text = profile_table("W2", &untimed);
        assert!(text.starts_with("profile W2 (2 iterations; no timestamp queries"), "{text}");
        let row = text.lines().nth(2).unwrap();
        assert_eq!(row.split_whitespace().collect::<Vec<_>>(), ["2", "256", "2.000", "12.000", "k0_MatMul_matmul"]);
        // Two launches of 12 MB and 2 GFLOP in 10 ms: 2.4 GB/s, 0.4 TFLOP/s.
        let timed = Profile {
            device: "wgpu".into(),
            iterations: 2,
            timed: true,
            kernels: vec![KernelProfile { ms: Some(10.0), share: Some(1.0), ..kernel.clone() }],
        };
        let text = profile_table("W2", &timed);
        let row = text.lines().nth(2).unwrap();
        assert_eq!(
            row.split_whitespace().collect::<Vec<_>>(),
            ["10.000", "100.0%", "2", "256", "2.000", "12.000", "2.40", "0.400", "k0_MatMul_matmul"]
        );
        // On the CPU backend: wall time, and threads where wgpu has workgroups.
        let cpu = Profile {
            device: "cpu".into(),
            iterations: 2,
            timed: true,
            kernels: vec![KernelProfile {
                ms: Some(10.0),
                cpu_ms: Some(9.0),
                share: Some(1.0),
                threads: Some(2),
                ..kernel
            }],
        };
        let text = profile_table("W2", &cpu);
        assert!(text.starts_with("profile W2 (CPU wall time over 2 iterations)"), "{text}");
        assert!(text.lines().nth(1).unwrap().contains("threads"), "{text}");
        let row = text.lines().nth(2).unwrap();
        assert_eq!(row.split_whitespace().take(4).collect::<Vec<_>>(), ["10.000", "9.000", "100.0%", "2"], "{text}");
    }
}
