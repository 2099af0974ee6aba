//! `lazuli-web`: Lazuli in a browser tab, on the browser's WebGPU
//! (`wasm32-unknown-unknown`, built by `scripts/web`).
//!
//! The page (`www/index.html`) calls three exports: `run_demo` trains
//! the digits MLP with a progress bar per epoch, the loss curve on a
//! canvas, the test accuracy, the time per step and the adapter's name
//! (`demo`); `run_fused` runs the fused-kernel example and shows its
//! generated WGSL; `run_checks` runs the in-page differential checks
//! of the WebGPU device against the CPU backend (`checks`), which
//! `scripts/test-web` drives in headless Chromium. Every read is an
//! `_async` one (the tab never blocks, see `lazuli::platform`), every
//! failure (no adapter, a lost device, out of memory, a panic) is shown
//! on the page (`page`) and returned to the caller as a rejected promise.
//!
//! Natively the crate is empty: everything here needs a browser.
#![cfg(target_arch = "wasm32")]

mod checks;
mod demo;
mod page;

use lazuli::{BackendError, Device, DeviceExt, ExecError};
use wasm_bindgen::prelude::*;

/// What can go wrong on the page.
#[derive(Debug, thiserror::Error)]
pub enum WebError {
    /// The engine failed.
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// Opening the device failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The embedded dataset is malformed.
    #[error(transparent)]
    Train(#[from] lazuli_models::digits::TrainError),
    /// The page lacks an element the code draws into.
    #[error("the page has no element #{0}")]
    Dom(String),
}

impl From<WebError> for JsValue {
    fn from(e: WebError) -> JsValue {
        JsValue::from_str(&e.to_string())
    }
}

/// Installs the panic hook that shows a panic on the page (a panic is a
/// bug; the tab stays responsive and says so).
#[wasm_bindgen(start)]
pub fn start() {
    page::install_panic_hook();
}

/// The WebGPU device, or the CPU backend with the reason on the page when
/// the browser offers no adapter.
async fn device() -> Device {
    match lazuli::wgpu_async(Default::default()).await {
        Ok(d) => d,
        Err(e) => {
            page::error(&format!("no WebGPU device ({e}); running on the CPU backend instead"));
            Device::cpu()
        }
    }
}

/// Trains the digits MLP for `epochs` epochs, drawing progress on the
/// page; resolves to a JSON summary (device, test accuracy, median ms
/// per step, steps, ...).
#[wasm_bindgen]
pub async fn run_demo(epochs: u32) -> Result<JsValue, JsValue> {
    let dev = device().await;
    page::set_text("adapter", &dev.name());
    let result = demo::train(&dev, epochs as usize).await;
    page::report(result).map(|v| JsValue::from_str(&v.to_string()))
}

/// Runs the fused-kernel example, showing its WGSL; resolves to a JSON
/// summary (kernels, the first row sums).
#[wasm_bindgen]
pub async fn run_fused() -> Result<JsValue, JsValue> {
    let dev = device().await;
    let result = demo::fused(&dev).await;
    page::report(result).map(|v| JsValue::from_str(&v.to_string()))
}

/// The differential checks (WebGPU against the CPU backend); resolves to
/// a JSON list of `{name, ok, max_error, detail}`.
#[wasm_bindgen]
pub async fn run_checks() -> Result<JsValue, JsValue> {
    let dev = device().await;
    let result = checks::run(&dev).await;
    page::report(result).map(|v| JsValue::from_str(&v.to_string()))
}
