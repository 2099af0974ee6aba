//! Fusion: W1 is one kernel launch; an expression over 12 distinct inputs
//! runs correctly on a device limited to 8 storage buffers per stage.

mod common;
use lazuli::metrics;
use lazuli::prelude::*;
use lazuli::WgpuDeviceOptions;

#[test]
fn w1_is_one_kernel_launch() {
    let _g = common::metrics_lock();
    let Some(dev) = common::wgpu() else { return };
    let n = 256 * 300 + 7; // not a multiple of the workgroup size
    let data = common::rand_vec(n, 7, -1.0, 1.0);
    let x = Tensor::from_slice(&data, [n], &dev).unwrap();
    let y =
        (((&x * 1.5).unwrap() + 0.5).unwrap().relu().unwrap() - 0.25).unwrap().tanh().unwrap().mul_scalar(2.0).unwrap();
    assert_eq!(lazuli::debug::backend_code(&[&y]).unwrap().len(), 1, "W1 lowers to one kernel");
    y.sync().unwrap();
    dev.wait().unwrap();
    let k0 = metrics::counter("KernelLaunches");
    let got = y.to_vec::<f32>().unwrap();
    assert_eq!(metrics::counter("KernelLaunches") - k0, 0, "reading launches nothing");
    let x2 = Tensor::from_slice(&data, [n], &dev).unwrap();
    let y2 = (((&x2 * 1.5).unwrap() + 0.5).unwrap().relu().unwrap() - 0.25)
        .unwrap()
        .tanh()
        .unwrap()
        .mul_scalar(2.0)
        .unwrap();
    let k1 = metrics::counter("KernelLaunches");
    y2.sync().unwrap();
    dev.wait().unwrap();
    assert_eq!(metrics::counter("KernelLaunches") - k1, 1, "W1 is exactly one launch");
    let want: Vec<f32> = data.iter().map(|v| ((v * 1.5 + 0.5).max(0.0) - 0.25).tanh() * 2.0).collect();
    common::assert_close(&got, &want, 1e-5, 1e-6, "W1 values");
}

#[test]
fn twelve_inputs_with_eight_storage_buffers() {
    let _metrics = common::metrics_lock();
    let Some(_) = common::wgpu() else { return };
    let dev = Device::wgpu_with(WgpuDeviceOptions { max_storage_buffers: Some(8), ..Default::default() }).unwrap();
    let n = 1000;
    let datas: Vec<Vec<f32>> = (0..12).map(|k| common::rand_vec(n, 100 + k, -1.0, 1.0)).collect();
    let ts: Vec<Tensor> = datas.iter().map(|d| Tensor::from_slice(d, [n], &dev).unwrap()).collect();
    // A mix of ops so that every input matters in a different way.
    let mut acc = ts[0].clone();
    for (k, t) in ts.iter().enumerate().skip(1) {
        acc = if k % 3 == 0 { acc.mul(t).unwrap() } else { acc.add(t).unwrap() };
    }
    let y = acc.tanh().unwrap();
    let code = lazuli::debug::backend_code(&[&y]).unwrap();
    assert!(code.len() >= 2, "12 inputs + 1 output cannot fit 8 bindings in one kernel");
    for (name, src) in &code {
        let bindings = src.matches("var<storage").count();
        assert!(bindings <= 8, "{name} binds {bindings} storage buffers:\n{src}");
    }
    let got = y.to_vec::<f32>().unwrap();
    let want: Vec<f32> = (0..n)
        .map(|i| {
            let mut a = datas[0][i];
            for (k, d) in datas.iter().enumerate().skip(1) {
                a = if k % 3 == 0 { a * d[i] } else { a + d[i] };
            }
            a.tanh()
        })
        .collect();
    common::assert_close(&got, &want, 1e-5, 1e-6, "12-input expression");
}

#[test]
fn lowering_is_deterministic() {
    let _metrics = common::metrics_lock();
    let Some(_) = common::wgpu() else { return };
    // Two separate devices (separate backends and caches) lower the same
    // program to byte-identical WGSL.
    let build = |dev: &Device| {
        let x = Tensor::from_slice(&common::rand_vec(60, 11, -1.0, 1.0), [6, 10], dev).unwrap();
        let w = Tensor::from_slice(&common::rand_vec(40, 12, -1.0, 1.0), [10, 4], dev).unwrap();
        let h = x.matmul(&w).unwrap().relu().unwrap();
        let y = h.log_softmax(-1).unwrap().sum(&[0], false).unwrap();
        lazuli::debug::backend_code(&[&h, &y]).unwrap()
    };
    let a = build(&Device::wgpu_with(WgpuDeviceOptions::default()).unwrap());
    let b = build(&Device::wgpu_with(WgpuDeviceOptions::default()).unwrap());
    assert!(!a.is_empty());
    assert_eq!(a, b);
}
