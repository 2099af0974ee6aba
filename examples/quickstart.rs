//! The README example: record a small fused computation, sync it as one
//! graph, read the values and print the metrics report.

use lazuli::prelude::*;

fn main() -> lazuli::Result<()> {
    let dev = Device::default();
    let x = Tensor::from_slice(&[1.0f32, -2.0, 3.0, -4.0], [2, 2], &dev)?;
    let y = ((&x * 1.5)? + 0.5)?.relu()?.tanh()?;
    let s = y.sum(&[1], false)?;
    lazuli::sync(&[&y, &s])?;
    println!("{:?} {:?}", y.to_vec::<f32>()?, s.to_vec::<f32>()?);
    println!("{}", lazuli::metrics::report());
    Ok(())
}
