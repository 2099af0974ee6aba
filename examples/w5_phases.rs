//! W5 phase timing: how much of one iteration is recording, sync (trace,
//! cache lookup, submit) and waiting for the device.

use lazuli::prelude::*;
use std::time::Instant;

fn main() -> lazuli::Result<()> {
    for dev in [Device::cpu(), Device::wgpu().expect("adapter")] {
        let x = Tensor::from_slice(&vec![0.5f32; 1024], [1024], &dev)?;
        x.relu()?.sync()?;
        dev.wait()?;
        let (mut rec, mut syn, mut wai) = (0.0, 0.0, 0.0);
        let n = 200;
        for i in 0..n + 3 {
            let t0 = Instant::now();
            let mut y = x.clone();
            for _ in 0..100 {
                y = y.mul_scalar(1.0001)?.add_scalar(0.0001)?;
            }
            let t1 = Instant::now();
            y.sync()?;
            let t2 = Instant::now();
            dev.wait()?;
            let t3 = Instant::now();
            if i >= 3 {
                rec += (t1 - t0).as_secs_f64();
                syn += (t2 - t1).as_secs_f64();
                wai += (t3 - t2).as_secs_f64();
            }
        }
        let us = |v: f64| v / n as f64 * 1e6;
        println!(
            "{}: record {:.1} µs, sync {:.1} µs, wait {:.1} µs per iteration",
            dev.name(),
            us(rec),
            us(syn),
            us(wai)
        );
    }
    Ok(())
}
