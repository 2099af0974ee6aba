//! One configuration step: a malformed `LAZULI_*` value is an error naming
//! the variable (from a device, from the options types) and devices report
//! each variable's effective value and its source. What the `lazuli`
//! binary makes of them (`lazuli info`) is tested in crates/cli.

mod common;

use lazuli::prelude::*;
use lazuli::{Backend, CpuDeviceOptions, ExecError, WgpuDeviceOptions};
use lazuli_cpu::CpuBackend;
use lazuli_executor::config::Source;
use std::sync::Arc;

fn cpu() -> Arc<dyn Backend> {
    Arc::new(CpuBackend::new())
}

#[test]
fn a_device_with_a_malformed_value_fails_every_compilation_naming_it() {
    fn lookup(name: &str) -> Option<String> {
        (name == "LAZULI_COMPILE_CACHE_SIZE").then(|| "0".to_string())
    }
    let dev = Device::with_env(cpu(), cpu(), lookup);
    let x = Tensor::from_slice(&[1.0f32, 2.0], [2], &dev).unwrap();
    for _ in 0..2 {
        let err = (&x * 2.0).unwrap().to_vec::<f32>().unwrap_err();
        let ExecError::Config(e) = &err else { panic!("{err:?}") };
        assert_eq!((e.variable.as_str(), e.value.as_str()), ("LAZULI_COMPILE_CACHE_SIZE", "0"));
        assert!(err.to_string().contains("LAZULI_COMPILE_CACHE_SIZE=\"0\""), "{err}");
    }
    assert!(dev.configuration().check().is_err());
}

#[test]
fn a_device_reports_code_settings_as_code() {
    fn lookup(name: &str) -> Option<String> {
        (name == "LAZULI_FORCE_FALLBACK").then(|| "exp".to_string())
    }
    let dev = Device::with_env(cpu(), cpu(), lookup);
    let setting = |dev: &Device, name: &str| {
        dev.configuration().settings.into_iter().find(|s| s.variable == name).expect("a row per library variable")
    };
    assert_eq!(setting(&dev, "LAZULI_VALIDATE").source, Source::Default);
    let forced = setting(&dev, "LAZULI_FORCE_FALLBACK");
    assert_eq!((forced.value.as_str(), forced.source), ("exp", Source::Environment));
    dev.set_validate(true);
    dev.set_force_fallback(&["matmul"]);
    let validate = setting(&dev, "LAZULI_VALIDATE");
    assert_eq!((validate.value.as_str(), validate.source), ("cpu", Source::Code));
    assert_eq!(setting(&dev, "LAZULI_FORCE_FALLBACK").source, Source::Code);
    let x = Tensor::from_slice(&[1.0f32, 2.0], [2], &dev).unwrap();
    assert_eq!((&x * 2.0).unwrap().to_vec::<f32>().unwrap(), vec![2.0, 4.0], "a well-formed device computes");
}

#[test]
fn options_take_code_over_environment_over_default() {
    let env = |name: &str| match name {
        "LAZULI_CPU_MEMORY_BYTES" => Some("4096".to_string()),
        "LAZULI_AUTOTUNE" => Some("OFF".to_string()),
        "LAZULI_AUTOTUNE_MIN_FLOPS" => Some("1000".to_string()),
        "LAZULI_POOL_BYTES" => Some("1024".to_string()),
        _ => None,
    };
    let (cpu, sources) = CpuDeviceOptions::default().resolve(&env).unwrap();
    assert_eq!((cpu.memory_budget, sources.memory_budget), (Some(4096), Source::Environment));
    let (cpu, sources) = CpuDeviceOptions { memory_budget: Some(8), ..Default::default() }.resolve(&env).unwrap();
    assert_eq!((cpu.memory_budget, sources.memory_budget), (Some(8), Source::Code));
    let (cpu, sources) = CpuDeviceOptions::default().resolve(&|_: &str| None).unwrap();
    assert_eq!((cpu.memory_budget, sources.memory_budget), (None, Source::Default));
    assert_eq!((cpu.threads, sources.threads), (None, Source::Default));

    let code = WgpuDeviceOptions { pool_max_free_bytes: Some(7), ..Default::default() };
    let (wgpu, sources) = code.resolve(&env).unwrap();
    assert_eq!(wgpu.autotune, Some(false));
    assert_eq!(wgpu.autotune_min_flops, Some(1000));
    assert_eq!(wgpu.pool_max_free_bytes, Some(7));
    assert_eq!(wgpu.multi_tensor, None);
    let source = |name| sources.iter().find(|(n, _)| *n == name).unwrap().1;
    assert_eq!(source("LAZULI_AUTOTUNE"), Source::Environment);
    assert_eq!(source("LAZULI_AUTOTUNE_MIN_FLOPS"), Source::Environment);
    assert_eq!(source("LAZULI_POOL_BYTES"), Source::Code);
    assert_eq!(source("LAZULI_MULTI_TENSOR"), Source::Default);
}

#[test]
fn options_fail_on_malformed_values_naming_them() {
    let bad_cpu = |_: &str| Some("12 GB".to_string());
    let e = CpuDeviceOptions::default().resolve(&bad_cpu).unwrap_err();
    assert_eq!(e.variable, "LAZULI_CPU_MEMORY_BYTES");
    let bad_forms = |name: &str| (name == "LAZULI_KERNEL_FORMS").then(|| "fast".to_string());
    let e = WgpuDeviceOptions::default().resolve(&bad_forms).unwrap_err();
    assert_eq!((e.variable.as_str(), e.expected.as_str()), ("LAZULI_KERNEL_FORMS", "one of gpu, software"));
    let bad_threads = |name: &str| (name == "LAZULI_COMPILE_THREADS").then(|| "many".to_string());
    let e = WgpuDeviceOptions::default().resolve(&bad_threads).unwrap_err();
    assert_eq!(e.variable, "LAZULI_COMPILE_THREADS");
}

#[test]
fn a_wgpu_device_reports_its_effective_values_and_code_settings() {
    if common::wgpu().is_none() {
        return;
    }
    let options = WgpuDeviceOptions {
        autotune: Some(true),
        multi_tensor: Some(false),
        cache_dir: Some(None),
        tiled_matmul: Some(false),
        ..Default::default()
    };
    let dev = Device::wgpu_with(options).unwrap();
    let report = dev.configuration();
    let row = |name: &str| {
        let s = report.settings.iter().find(|s| s.variable == name).unwrap_or_else(|| panic!("{name}: {report}"));
        (s.value.as_str(), s.source)
    };
    assert_eq!(row("LAZULI_AUTOTUNE"), ("on", Source::Code), "{report}");
    assert_eq!(row("LAZULI_MULTI_TENSOR"), ("off", Source::Code), "{report}");
    assert_eq!(row("LAZULI_CACHE_DIR"), ("off", Source::Code), "{report}");
    assert_eq!(row("LAZULI_KERNEL_FORMS").1, Source::Code, "{report}");
    let threads: usize = row("LAZULI_COMPILE_THREADS").0.parse().expect("a resolved thread count");
    assert!(threads >= 1);
    let idle: u64 = row("LAZULI_POOL_BYTES").0.split(' ').next().unwrap().parse().expect("a resolved byte count");
    assert!(idle > 0, "{report}");
}

#[test]
fn device_settings_come_from_the_environment_or_fail_naming_the_variable() {
    use lazuli_executor::DeviceSettings;
    let env = |name: &str| match name {
        "LAZULI_VALIDATE" => Some("CPU".to_string()),
        "LAZULI_COMPILE_CACHE_SIZE" => Some("16".to_string()),
        "LAZULI_FORCE_FALLBACK" => Some(" exp, matmul ,".to_string()),
        "LAZULI_DUMP_DIR" => Some("/tmp/dump".to_string()),
        _ => None,
    };
    let s = DeviceSettings::from_env(&env).unwrap();
    assert!(s.validate);
    assert_eq!(s.compile_cache_size.get(), 16);
    assert_eq!(s.force_fallback.iter().map(String::as_str).collect::<Vec<_>>(), vec!["exp", "matmul"]);
    assert_eq!(s.dump_dir.as_deref(), Some(std::path::Path::new("/tmp/dump")));
    assert_eq!(DeviceSettings::from_env(&|_: &str| None).unwrap(), DeviceSettings::default());
    let bad = |name: &str| (name == "LAZULI_VALIDATE").then(|| "yes".to_string());
    let e = DeviceSettings::from_env(&bad).unwrap_err();
    assert_eq!((e.variable.as_str(), e.expected.as_str()), ("LAZULI_VALIDATE", "one of cpu, off"));
}

/// The guide's environment tables (docs/guide.md, "Devices and
/// environment") list every variable of `config::VARS`: the library's in
/// the first table, the test harness's in the second, and no name the
/// library does not know.
#[test]
fn the_guide_lists_every_configuration_variable() {
    use lazuli_executor::config::{Scope, VARS};
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/guide.md");
    let guide = std::fs::read_to_string(&path).expect("docs/guide.md");
    let start = guide.find("## Devices and environment").expect("the environment chapter");
    let end = guide[start + 3..].find("\n## ").map_or(guide.len(), |i| start + 3 + i);
    // The names in each table's first column, table by table.
    let mut tables: Vec<Vec<String>> = Vec::new();
    let mut in_table = false;
    for line in guide[start..end].lines() {
        if !line.starts_with('|') {
            in_table = false;
            continue;
        }
        if !in_table {
            tables.push(Vec::new());
            in_table = true;
        }
        let first = line.split('|').nth(1).unwrap_or_default();
        let names =
            first.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).filter(|w| w.starts_with("LAZULI_"));
        tables.last_mut().expect("a table").extend(names.map(str::to_string));
    }
    assert_eq!(tables.len(), 2, "a table of the library's variables and one of the test harness's");
    for v in VARS {
        let table = match v.scope {
            Scope::Library => &tables[0],
            Scope::Test => &tables[1],
            Scope::Build => continue,
        };
        assert!(table.iter().any(|n| n == v.name), "{} ({:?}) has no row in docs/guide.md", v.name, v.scope);
    }
    for name in tables.iter().flatten() {
        assert!(VARS.iter().any(|v| v.name == name), "docs/guide.md lists {name}, which config::VARS does not know");
    }
}
