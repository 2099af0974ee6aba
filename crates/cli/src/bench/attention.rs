//! A1: causal scaled dot-product attention, the fused op beside its
//! unfused composition on the same inputs, forward alone and forward +
//! backward ([`AttnSizes`], [`AttnStep`]).

use super::{on_device, time_iterations, uniform_data, BenchConfig, BenchDevice, BenchResult};
use lazuli::nn;
use lazuli::{Device, ExecError, Result, Tensor};

/// The sizes of the attention workload: q, k, v f32 `[batch, heads, t, d]`,
/// causal, the default scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnSizes {
    /// Sequences.
    pub batch: usize,
    /// Heads.
    pub heads: usize,
    /// Sequence length (queries and keys).
    pub t: usize,
    /// Head dim.
    pub d: usize,
}

impl AttnSizes {
    /// A1: batch 4, 8 heads, 1024 tokens, head dim 64 (the target
    /// size for the fused forward: at least 2x the unfused on a GPU).
    pub const A1: AttnSizes = AttnSizes { batch: 4, heads: 8, t: 1024, d: 64 };

    /// FLOPs of the forward as counted for a causal mask: the two products
    /// (`2 t t d` each per head) over the half of the scores a query sees.
    pub fn forward_flops(self) -> f64 {
        2.0 * (self.batch * self.heads) as f64 * (self.t * self.t * self.d) as f64
    }

    /// FLOPs of forward + backward: the backward's four products (dV, dP,
    /// dQ, dK) on top of the forward's two, all causal halves.
    pub fn training_flops(self) -> f64 {
        3.0 * self.forward_flops()
    }

    /// "[B4 H8 T1024 D64] causal".
    pub fn describe(self) -> String {
        format!("[B{} H{} T{} D{}] causal", self.batch, self.heads, self.t, self.d)
    }
}

/// One A1 iteration's state: q, k, v (leaves that require grad) and the
/// output gradient, on the device.
pub struct AttnStep {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    r: Tensor,
}

impl AttnStep {
    /// Inputs uniform in [-1, 1], uploaded outside any timed loop.
    pub fn new(dev: &Device, sizes: AttnSizes) -> Result<AttnStep> {
        let AttnSizes { batch, heads, t, d } = sizes;
        let n = batch * heads * t * d;
        let leaf = |seed| on_device(Tensor::from_slice(&uniform_data(n, seed), [batch, heads, t, d], dev)?);
        Ok(AttnStep {
            q: leaf(41)?.requires_grad_(true)?,
            k: leaf(42)?.requires_grad_(true)?,
            v: leaf(43)?.requires_grad_(true)?,
            r: leaf(44)?,
        })
    }

    /// One iteration: the output (`fused`: `nn::scaled_dot_product_attention`,
    /// else its unfused composition), and with `backward` the gradients of
    /// `sum(O * r)`; one sync, wait.
    pub fn step(&mut self, fused: bool, backward: bool) -> Result<()> {
        let f = if fused { nn::scaled_dot_product_attention } else { nn::scaled_dot_product_attention_unfused };
        let opts = nn::AttentionOptions::causal();
        if !backward {
            let o = lazuli::no_grad(|| f(&self.q, &self.k, &self.v, &opts))?;
            o.sync()?;
            return self.q.device().wait();
        }
        let loss = f(&self.q, &self.k, &self.v, &opts)?.mul(&self.r)?.sum(&[], false)?;
        loss.backward()?;
        let grads: Vec<Tensor> = [&self.q, &self.k, &self.v].iter().filter_map(|t| t.grad()).collect();
        for t in [&self.q, &self.k, &self.v] {
            t.zero_grad();
        }
        if grads.len() != 3 {
            return Err(ExecError::Invalid { op: "bench A1".into(), detail: "no gradient".into() });
        }
        lazuli::sync(&[&loss, &grads[0], &grads[1], &grads[2]])?;
        self.q.device().wait()
    }
}

/// The four A1 rows on `bd`: fused and unfused, forward and forward +
/// backward.
pub(super) fn attention_rows(bd: &BenchDevice, cfg: &BenchConfig, sizes: AttnSizes) -> Result<Vec<BenchResult>> {
    let mut step = AttnStep::new(&bd.device, sizes)?;
    let mut rows = Vec::new();
    for (backward, flops, what) in
        [(false, sizes.forward_flops(), "forward"), (true, sizes.training_flops(), "forward+backward")]
    {
        for fused in [true, false] {
            let (times, kernels, _) = time_iterations(cfg, || step.step(fused, backward))?;
            let name = format!("A1 attention {what} {}", if fused { "fused" } else { "unfused" });
            let mut r = BenchResult::from_times(&name, bd.label, &times).with_flops(flops);
            r.kernels = Some(kernels);
            rows.push(BenchResult { note: Some(sizes.describe()), ..r });
        }
    }
    Ok(rows)
}
