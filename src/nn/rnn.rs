//! Recurrent layers, [`Lstm`] and [`Gru`]: PyTorch's `nn.LSTM` and
//! `nn.GRU` with their gate order (LSTM: input, forget, cell, output; GRU:
//! reset, update, new), parameter names (`weight_ih_l0`, `weight_hh_l0`,
//! `bias_ih_l0`, `bias_hh_l0`, then `_l1`...), shapes, initialization
//! (every parameter `U(+-1/sqrt(hidden_size))`) and options
//! ([`RnnOptions`]: layers, bias, `batch_first`, dropout between layers,
//! bidirectional).
//!
//! Inputs are `[t, batch, input]` (`[batch, t, input]` with `batch_first`)
//! or unbatched `[t, input]`; [`Lstm::forward_with`] and
//! [`Gru::forward_with`] take optional initial states (`[layers *
//! directions, batch, hidden]`, zeros by default) and return the last
//! layer's outputs at every step with the final states, as PyTorch does;
//! [`Module::forward`] returns the outputs only. Each layer projects its whole input sequence
//! with one matmul, then records one small step per time step (the hidden
//! projection and the gates, fused by the engine); gradients are
//! backpropagation through time by autodiff. Not supported (errors or
//! absent options): `proj_size`, packed sequences.

use super::init::{parameter, Init};
use super::{invalid_at, Mode, Module};
use crate::{Device, Result, Tensor};
use std::panic::Location;

/// Options of [`Lstm`] and [`Gru`], PyTorch's defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct RnnOptions {
    /// Stacked layers (default 1).
    pub num_layers: usize,
    /// Input and hidden biases (default true).
    pub bias: bool,
    /// Inputs and outputs are `[batch, t, features]` (default false:
    /// `[t, batch, features]`); states stay `[layers, batch, hidden]`.
    pub batch_first: bool,
    /// Dropout on the outputs of every layer but the last, in training
    /// mode (default 0).
    pub dropout: f64,
    /// A second direction per layer reading the sequence backwards
    /// (default false): outputs `2 * hidden` wide (forward, then
    /// reverse), states `[2 * layers, batch, hidden]`, parameters
    /// `weight_ih_l0_reverse`... after each layer's forward ones.
    pub bidirectional: bool,
}

impl Default for RnnOptions {
    fn default() -> Self {
        RnnOptions { num_layers: 1, bias: true, batch_first: false, dropout: 0.0, bidirectional: false }
    }
}

/// The parameters of one layer of an [`Lstm`] (`G = 4`) or a [`Gru`]
/// (`G = 3`), PyTorch's names without the `_l{k}` suffix.
#[derive(Clone, Debug)]
pub struct RnnLayer {
    /// `[G * hidden, input]` (`input` is `hidden` above the first layer).
    pub weight_ih: Tensor,
    /// `[G * hidden, hidden]`.
    pub weight_hh: Tensor,
    /// `[G * hidden]`.
    pub bias_ih: Option<Tensor>,
    /// `[G * hidden]`.
    pub bias_hh: Option<Tensor>,
}

/// What the two layers share: parameters per layer, options, mode.
#[derive(Clone, Debug)]
struct Stack {
    op: &'static str,
    cells: Vec<RnnLayer>,
    input_size: usize,
    hidden_size: usize,
    gates: usize,
    options: RnnOptions,
    training: Mode,
}

impl Stack {
    fn new(
        op: &'static str,
        gates: usize,
        input_size: usize,
        hidden_size: usize,
        options: RnnOptions,
        device: &Device,
        at: &Location<'_>,
    ) -> Result<Stack> {
        if input_size == 0 || hidden_size == 0 || options.num_layers == 0 || !(0.0..1.0).contains(&options.dropout) {
            return Err(invalid_at(
                op,
                format!(
                    "input_size {input_size}, hidden_size {hidden_size} and num_layers {} must be positive and \
                     dropout {} in [0, 1)",
                    options.num_layers, options.dropout
                ),
                at,
            ));
        }
        let b = 1.0 / (hidden_size as f64).sqrt();
        let init = Init::Uniform(-b, b);
        let h = hidden_size;
        let dirs = if options.bidirectional { 2 } else { 1 };
        let mut cells = Vec::new();
        for l in 0..options.num_layers {
            let inp = if l == 0 { input_size } else { dirs * h };
            let p = |shape: &[usize]| parameter(init, shape, inp, gates * h, device);
            for _ in 0..dirs {
                cells.push(RnnLayer {
                    weight_ih: p(&[gates * h, inp])?,
                    weight_hh: p(&[gates * h, h])?,
                    bias_ih: if options.bias { Some(p(&[gates * h])?) } else { None },
                    bias_hh: if options.bias { Some(p(&[gates * h])?) } else { None },
                });
            }
        }
        Ok(Stack { op, cells, input_size, hidden_size, gates, options, training: Mode::new(true) })
    }

    fn parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = Vec::new();
        let dirs = self.directions();
        for (k, c) in self.cells.iter().enumerate() {
            let (l, suffix) = (k / dirs, if k % dirs == 1 { "_reverse" } else { "" });
            v.push((format!("weight_ih_l{l}{suffix}"), c.weight_ih.clone()));
            v.push((format!("weight_hh_l{l}{suffix}"), c.weight_hh.clone()));
            v.extend(c.bias_ih.iter().map(|b| (format!("bias_ih_l{l}{suffix}"), b.clone())));
            v.extend(c.bias_hh.iter().map(|b| (format!("bias_hh_l{l}{suffix}"), b.clone())));
        }
        v
    }

    /// Every parameter, mutably.
    fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        let mut v = Vec::new();
        for c in &mut self.cells {
            v.push(&mut c.weight_ih);
            v.push(&mut c.weight_hh);
            v.extend(c.bias_ih.as_mut());
            v.extend(c.bias_hh.as_mut());
        }
        v
    }

    /// Checks `x` and gives it as `[t, batch, input]`, with whether it was
    /// unbatched.
    fn time_major(&self, x: &Tensor, at: &Location<'_>) -> Result<(Tensor, bool)> {
        let ok = (x.rank() == 3 || x.rank() == 2) && x.dims()[x.rank() - 1] == self.input_size && x.dtype().is_float();
        let t = if x.rank() == 3 && self.options.batch_first { x.dims().get(1) } else { x.dims().first() };
        if !ok || t == Some(&0) {
            return Err(invalid_at(
                self.op,
                format!(
                    "expected a float [t, batch, {i}] ([batch, t, {i}] with batch_first) or [t, {i}] input with \
                     t > 0, got {} {}",
                    x.dtype(),
                    x.shape(),
                    i = self.input_size
                ),
                at,
            ));
        }
        match (x.rank(), self.options.batch_first) {
            (2, _) => Ok((x.unsqueeze(1)?, true)),
            (_, true) => Ok((x.transpose(0, 1)?, false)),
            _ => Ok((x.clone(), false)),
        }
    }

    /// An initial state: given (`[layers * directions, batch, hidden]`,
    /// or without the batch dim for an unbatched input), checked and made
    /// batched, or zeros.
    fn state(&self, s: Option<&Tensor>, what: &str, x: &Tensor, unbatched: bool, at: &Location<'_>) -> Result<Tensor> {
        let (l, n, h) = (self.cells.len(), x.dims()[1], self.hidden_size);
        let Some(s) = s else { return Tensor::zeros([l, n, h], x.dtype(), x.device()) };
        let want: Vec<usize> = if unbatched { vec![l, h] } else { vec![l, n, h] };
        if s.dims() != want || s.dtype() != x.dtype() {
            return Err(invalid_at(
                self.op,
                format!("{what} must be {} {want:?}, got {} {}", x.dtype(), s.dtype(), s.shape()),
                at,
            ));
        }
        if unbatched {
            s.unsqueeze(1)
        } else {
            Ok(s.clone())
        }
    }

    /// Runs every layer (both directions of it when bidirectional) with
    /// `step(gi_t, gh_t, h, c) -> (h, c)` over the input gates `gi_t` and
    /// hidden gates `gh_t`; returns the outputs (`[t, batch, directions *
    /// hidden]`) and the final `h` and `c` per layer and direction.
    fn run(
        &self,
        x: &Tensor,
        h0: Tensor,
        c0: Option<Tensor>,
        step: impl Fn(&Tensor, &Tensor, &Tensor, Option<&Tensor>) -> Result<(Tensor, Option<Tensor>)>,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let (t_len, n) = (x.dims()[0], x.dims()[1]);
        let h = self.hidden_size;
        let dirs = self.directions();
        let mut input = x.clone();
        let (mut hs, mut cs) = (Vec::new(), Vec::new());
        for l in 0..self.options.num_layers {
            let mut outputs = Vec::with_capacity(dirs);
            for d in 0..dirs {
                let k = l * dirs + d;
                let cell = &self.cells[k];
                let mut gi = input.matmul(&cell.weight_ih.t()?)?; // [t, n, G h]
                if let Some(b) = &cell.bias_ih {
                    gi = gi.add(b)?;
                }
                let whh = cell.weight_hh.t()?;
                let mut hl = h0.narrow(0, k, 1)?.reshape([n, h])?;
                let mut cl = match &c0 {
                    Some(c) => Some(c.narrow(0, k, 1)?.reshape([n, h])?),
                    None => None,
                };
                let mut outs = Vec::with_capacity(t_len);
                for i in 0..t_len {
                    // The reverse direction reads the sequence backwards.
                    let t = if d == 0 { i } else { t_len - 1 - i };
                    let git = gi.narrow(0, t, 1)?.reshape([n, self.gates * h])?;
                    let mut ght = hl.matmul(&whh)?;
                    if let Some(b) = &cell.bias_hh {
                        ght = ght.add(b)?;
                    }
                    let (hn, cn) = step(&git, &ght, &hl, cl.as_ref())?;
                    outs.push(hn.clone());
                    hl = hn;
                    cl = cn;
                }
                if d == 1 {
                    outs.reverse();
                }
                outputs.push(Tensor::stack(&outs.iter().collect::<Vec<_>>(), 0)?);
                hs.push(hl);
                cs.extend(cl);
            }
            input = Tensor::concat(&outputs.iter().collect::<Vec<_>>(), -1)?;
            if l + 1 < self.options.num_layers && self.options.dropout > 0.0 {
                input = input.dropout(self.options.dropout, self.training.get())?;
            }
        }
        let hn = Tensor::stack(&hs.iter().collect::<Vec<_>>(), 0)?;
        let cn = if cs.is_empty() { None } else { Some(Tensor::stack(&cs.iter().collect::<Vec<_>>(), 0)?) };
        Ok((input, hn, cn))
    }

    /// 2 when bidirectional, else 1.
    fn directions(&self) -> usize {
        if self.options.bidirectional {
            2
        } else {
            1
        }
    }

    /// The outputs in the caller's layout and the states unbatched if the
    /// input was.
    fn finish(&self, out: Tensor, unbatched: bool) -> Result<Tensor> {
        if unbatched {
            out.squeeze(&[1])
        } else if self.options.batch_first {
            out.transpose(0, 1)
        } else {
            Ok(out)
        }
    }
}

fn gate(g: &Tensor, i: usize, h: usize) -> Result<Tensor> {
    g.narrow(1, i * h, h)
}

/// A multi-layer LSTM, PyTorch's `nn.LSTM` (see the module documentation):
/// per step `i, f, g, o` = the four `hidden`-wide chunks of `W_ih x + b_ih
/// + W_hh h + b_hh` (sigmoid, sigmoid, tanh, sigmoid), `c' = f c + i g`,
/// `h' = o tanh(c')`.
#[derive(Clone, Debug)]
pub struct Lstm {
    stack: Stack,
}

impl Lstm {
    /// One layer, PyTorch's defaults.
    #[track_caller]
    pub fn new(input_size: usize, hidden_size: usize, device: &Device) -> Result<Lstm> {
        Lstm::with_options(input_size, hidden_size, RnnOptions::default(), device)
    }

    /// With [`RnnOptions`].
    #[track_caller]
    pub fn with_options(input_size: usize, hidden_size: usize, options: RnnOptions, device: &Device) -> Result<Lstm> {
        Ok(Lstm { stack: Stack::new("LSTM", 4, input_size, hidden_size, options, device, Location::caller())? })
    }

    /// The options.
    pub fn options(&self) -> &RnnOptions {
        &self.stack.options
    }

    /// The layers' parameters, first layer first (its reverse direction
    /// right after it when bidirectional).
    pub fn layers(&self) -> &[RnnLayer] {
        &self.stack.cells
    }

    /// The layers' parameters, to replace (e.g. by loaded or converted
    /// tensors of the same shapes).
    pub fn layers_mut(&mut self) -> &mut [RnnLayer] {
        &mut self.stack.cells
    }

    /// The outputs (`[t, batch, hidden]`, `[batch, t, hidden]` with
    /// `batch_first`, `[t, hidden]` unbatched; `2 * hidden` wide when
    /// bidirectional) and the final `(h, c)` (`[layers * directions,
    /// batch, hidden]`), from the initial `state` (zeros when `None`).
    #[track_caller]
    pub fn forward_with(&self, x: &Tensor, state: Option<(&Tensor, &Tensor)>) -> Result<(Tensor, (Tensor, Tensor))> {
        let at = Location::caller();
        let s = &self.stack;
        let (xt, unbatched) = s.time_major(x, at)?;
        let h0 = s.state(state.map(|p| p.0), "h_0", &xt, unbatched, at)?;
        let c0 = s.state(state.map(|p| p.1), "c_0", &xt, unbatched, at)?;
        let h = s.hidden_size;
        let (out, hn, cn) = s.run(&xt, h0, Some(c0), |gi, gh, _h, c| {
            let g = gi.add(gh)?;
            let (i, f) = (gate(&g, 0, h)?.sigmoid()?, gate(&g, 1, h)?.sigmoid()?);
            let (gg, o) = (gate(&g, 2, h)?.tanh()?, gate(&g, 3, h)?.sigmoid()?);
            let c = c.expect("an LSTM step has a cell state");
            let c2 = f.mul(c)?.add(&i.mul(&gg)?)?;
            Ok((o.mul(&c2.tanh()?)?, Some(c2)))
        })?;
        let cn = cn.expect("an LSTM has cell states");
        let (hn, cn) = if unbatched { (hn.squeeze(&[1])?, cn.squeeze(&[1])?) } else { (hn, cn) };
        Ok((s.finish(out, unbatched)?, (hn, cn)))
    }
}

impl Module for Lstm {
    #[track_caller]
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        Ok(self.forward_with(x, None)?.0)
    }

    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        self.stack.parameters()
    }

    fn own_tensors_mut(&mut self) -> Vec<&mut Tensor> {
        self.stack.tensors_mut()
    }

    fn set_own_training(&self, training: bool) {
        self.stack.training.set(training)
    }
}

/// A multi-layer GRU, PyTorch's `nn.GRU` (see the module documentation):
/// per step `r = sigmoid(W_ir x + b_ir + W_hr h + b_hr)`, `z` likewise,
/// `n = tanh(W_in x + b_in + r (W_hn h + b_hn))`, `h' = (1 - z) n + z h`.
#[derive(Clone, Debug)]
pub struct Gru {
    stack: Stack,
}

impl Gru {
    /// One layer, PyTorch's defaults.
    #[track_caller]
    pub fn new(input_size: usize, hidden_size: usize, device: &Device) -> Result<Gru> {
        Gru::with_options(input_size, hidden_size, RnnOptions::default(), device)
    }

    /// With [`RnnOptions`].
    #[track_caller]
    pub fn with_options(input_size: usize, hidden_size: usize, options: RnnOptions, device: &Device) -> Result<Gru> {
        Ok(Gru { stack: Stack::new("GRU", 3, input_size, hidden_size, options, device, Location::caller())? })
    }

    /// The options.
    pub fn options(&self) -> &RnnOptions {
        &self.stack.options
    }

    /// The layers' parameters, first layer first (its reverse direction
    /// right after it when bidirectional).
    pub fn layers(&self) -> &[RnnLayer] {
        &self.stack.cells
    }

    /// The layers' parameters, to replace (e.g. by loaded or converted
    /// tensors of the same shapes).
    pub fn layers_mut(&mut self) -> &mut [RnnLayer] {
        &mut self.stack.cells
    }

    /// The outputs (laid out as the input, `2 * hidden` wide when
    /// bidirectional) and the final `h` (`[layers * directions, batch,
    /// hidden]`), from the initial `h0` (zeros when `None`).
    #[track_caller]
    pub fn forward_with(&self, x: &Tensor, h0: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let at = Location::caller();
        let s = &self.stack;
        let (xt, unbatched) = s.time_major(x, at)?;
        let h0 = s.state(h0, "h_0", &xt, unbatched, at)?;
        let h = s.hidden_size;
        let (out, hn, _) = s.run(&xt, h0, None, |gi, gh, hp, _| {
            let r = gate(gi, 0, h)?.add(&gate(gh, 0, h)?)?.sigmoid()?;
            let z = gate(gi, 1, h)?.add(&gate(gh, 1, h)?)?.sigmoid()?;
            let n = gate(gi, 2, h)?.add(&r.mul(&gate(gh, 2, h)?)?)?.tanh()?;
            // (1 - z) n + z h = n + z (h - n)
            Ok((n.add(&z.mul(&hp.sub(&n)?)?)?, None))
        })?;
        let hn = if unbatched { hn.squeeze(&[1])? } else { hn };
        Ok((s.finish(out, unbatched)?, hn))
    }
}

impl Module for Gru {
    #[track_caller]
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        Ok(self.forward_with(x, None)?.0)
    }

    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        self.stack.parameters()
    }

    fn own_tensors_mut(&mut self) -> Vec<&mut Tensor> {
        self.stack.tensors_mut()
    }

    fn set_own_training(&self, training: bool) {
        self.stack.training.set(training)
    }
}
