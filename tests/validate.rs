//! Shadow validation (`LAZULI_VALIDATE=cpu`, `Device::set_validate`): with
//! a deliberately wrong wgpu kernel (fault injection through
//! `WgpuOptions::fault_kernel`), the barrier returns an error naming that
//! kernel, its IR nodes with their source locations and its WGSL; without
//! a fault, validated programs give the same results as unvalidated ones.

mod common;
use lazuli::prelude::*;
use lazuli::{ExecError, WgpuDeviceOptions};

fn faulty(pattern: &str) -> Option<Device> {
    common::wgpu()?;
    Some(Device::wgpu_with(WgpuDeviceOptions { fault_kernel: Some(pattern.into()), ..Default::default() }).unwrap())
}

/// A small MLP-like program: matmul, then an elementwise epilogue, then a
/// softmax; returns the output and the source line of the matmul.
fn program(d: &Device) -> (Tensor, u32) {
    let x = Tensor::from_slice(&common::rand_vec(12, 1, -1.0, 1.0), [3, 4], d).unwrap();
    let w = Tensor::from_slice(&common::rand_vec(20, 2, -1.0, 1.0), [4, 5], d).unwrap();
    let b = Tensor::from_slice(&common::rand_vec(5, 3, -1.0, 1.0), [5], d).unwrap();
    let line = line!() + 1;
    let h = x.matmul(&w).unwrap();
    let y = h.add(&b).unwrap().tanh().unwrap().softmax(-1).unwrap();
    (y, line)
}

#[test]
fn validation_names_a_wrong_kernel_its_nodes_locations_and_wgsl() {
    let Some(dev) = faulty("MatMul") else { return };
    // Unvalidated, the fault silently gives a wrong answer.
    let (y, _) = program(&dev);
    let wrong = y.to_vec::<f32>().unwrap();
    let (reference, _) = program(&Device::cpu());
    let want = reference.to_vec::<f32>().unwrap();
    assert!(wrong.iter().zip(&want).any(|(a, b)| (a - b).abs() > 1e-3), "the injected fault changes the result");

    dev.set_validate(true);
    let (y, line) = program(&dev);
    let err = y.to_vec::<f32>().unwrap_err();
    let ExecError::Failed { cause, .. } = &err else { panic!("expected the failed read, got {err}") };
    let ExecError::Validation { kernel, report } = cause.as_ref() else {
        panic!("expected a validation error, got {cause}")
    };
    assert!(kernel.contains("MatMul"), "names the faulty kernel: {kernel}");
    let msg = err.to_string();
    assert!(msg.contains("shadow validation") && msg.contains(kernel.as_str()), "{msg}");
    assert!(report.contains("MatMul"), "lists the IR nodes of the kernel:\n{report}");
    assert!(
        report.contains(&format!("tests/validate.rs:{line}:")),
        "points at the matmul's source line {line}:\n{report}"
    );
    assert!(report.contains("@compute") && report.contains("out0[0] = out0[0] + 1.0"), "includes the WGSL:\n{report}");
    assert!(report.contains("differ"), "{report}");
    // The read reported the failure: the device does not report it again,
    // and it keeps working.
    dev.wait().unwrap();
    dev.set_validate(false);
    let z = Tensor::from_slice(&[1.0f32, 2.0], [2], &dev).unwrap().mul_scalar(3.0).unwrap();
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![3.0, 6.0]);
}

#[test]
fn validation_names_the_first_wrong_kernel_not_its_users() {
    // The elementwise epilogue is faulty; the softmax after it disagrees
    // too, but the report must name the epilogue (first in launch order).
    let Some(dev) = faulty("Elementwise") else { return };
    dev.set_validate(true);
    let x = Tensor::from_slice(&common::rand_vec(12, 1, -1.0, 1.0), [3, 4], &dev).unwrap();
    let h = x.mul_scalar(0.5).unwrap().tanh().unwrap();
    let y = h.softmax(-1).unwrap().sum(&[0], false).unwrap();
    lazuli::sync(&[&h, &y]).unwrap();
    match y.to_vec::<f32>() {
        Err(ExecError::Failed { cause, .. }) => match *cause {
            ExecError::Validation { kernel, .. } => assert!(kernel.contains("Elementwise"), "{kernel}"),
            other => panic!("expected a validation error, got {other}"),
        },
        other => panic!("expected a validation error, got {other:?}"),
    }
}

#[test]
fn validated_programs_match_unvalidated_ones() {
    let Some(dev) = common::wgpu() else { return };
    let _g = common::metrics_lock();
    dev.set_validate(true);
    assert!(dev.validating());
    let before = lazuli::metrics::counter("ValidatedSegments");
    let (y, _) = program(&dev);
    let got = y.to_vec::<f32>().unwrap();
    let (reference, _) = program(&Device::cpu());
    common::assert_close(&got, &reference.to_vec::<f32>().unwrap(), 1e-4, 1e-5, "validated");
    // A plan with a CPU fallback segment (f64) and a reduction and gather.
    let a = Tensor::from_slice(&common::rand_vec(30, 5, -2.0, 2.0), [5, 6], &dev).unwrap();
    let idx = Tensor::from_slice(&[4i32, 0, -1], [3], &dev).unwrap();
    let r = a.exp().unwrap().cast(DType::F64).unwrap().sqrt().unwrap().cast(DType::F32).unwrap();
    let s = r.gather(0, &idx).unwrap().sum(&[1], true).unwrap().argmax(0, false).unwrap();
    s.to_vec::<i32>().unwrap();
    dev.wait().unwrap();
    assert!(lazuli::metrics::counter("ValidatedSegments") >= before + 2);
}

/// `LAZULI_VALIDATE=cpu` turns validation on for new devices (checked in a
/// child process so the variable does not leak into other tests).
#[test]
fn env_variable_turns_validation_on() {
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args(["--exact", "validation_from_env_child", "--ignored", "--nocapture"])
        .env("LAZULI_VALIDATE", "cpu")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("1 passed"), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
#[ignore = "run by env_variable_turns_validation_on with LAZULI_VALIDATE=cpu"]
fn validation_from_env_child() {
    assert!(Device::cpu().validating(), "LAZULI_VALIDATE=cpu must turn validation on");
    if let Some(dev) = faulty("MatMul") {
        let (y, _) = program(&dev);
        assert!(matches!(y.to_vec::<f32>(), Err(ExecError::Failed { .. })));
    }
}
