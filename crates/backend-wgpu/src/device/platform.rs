//! What the wgpu backend does differently on the browser's WebGPU
//! (`wasm32`), in one place (see `lazuli_executor::platform` for the
//! executor's side).
//!
//! A browser tab cannot block: WebGPU's promises (adapter and device
//! requests, buffer mappings, popped error scopes) settle only when
//! control returns to the event loop. So on `wasm32`:
//!
//! - the device is opened asynchronously (`Context::open_async`; the blocking
//!   `WgpuBackend::new` is `BackendError::WouldBlock` there);
//! - an execution submits its work and returns without waiting ([`wait`]
//!   is a no-op: WebGPU orders every later submission, copy and mapping
//!   after it), and reads map their staging buffers asynchronously
//!   ([`download_async`]);
//! - errors are not caught by error scopes, which would need their
//!   promise awaited ([`Scope`] is empty there): WebGPU reports them to
//!   the device's uncaptured-error handler, which stores the first in the
//!   context's [`Deferred`] slot, returned by the next asynchronous read
//!   or wait; index errors of checking kernels are found the same way
//!   (`execute`'s error slots are read when their mapping settles);
//! - pipelines are created on the calling thread ([`THREADS`]), nothing
//!   is written to disk ([`DISK_CACHE`]: caches stay in memory), matmul
//!   forms are not autotuned and kernels are not timed ([`CAN_BLOCK`]:
//!   both read results back synchronously), and kernels use no subgroup
//!   operations ([`SUBGROUPS`]);
//! - shader modules are made from their WGSL ([`shader_source`]): the
//!   browser compiles WGSL, where natively wgpu takes the naga module
//!   the backend already parsed.
//!
//! Natively every function here is the blocking code the backend always
//! ran.

use lazuli_executor::BackendError;
use std::sync::{Arc, Mutex};

/// True where pipelines may be created on several threads.
pub(crate) const THREADS: bool = cfg!(not(target_arch = "wasm32"));

/// What a shader module is made from: natively the naga module parsed
/// and validated from `wgsl` (wgpu then neither lexes nor parses it
/// again); in a browser, where WebGPU compiles WGSL itself, the source.
pub(crate) fn shader_source(wgsl: &str, module: naga::Module) -> wgpu::ShaderSource<'_> {
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = wgsl;
        wgpu::ShaderSource::Naga(std::borrow::Cow::Owned(module))
    }
    #[cfg(target_arch = "wasm32")]
    {
        let _ = module;
        wgpu::ShaderSource::Wgsl(wgsl.into())
    }
}

/// True where a thread may block on the device (reads inside autotuning
/// and profiling).
pub(crate) const CAN_BLOCK: bool = cfg!(not(target_arch = "wasm32"));

/// True where kernels proven in bounds may get unchecked (trusted) shader
/// modules; a browser's WebGPU checks every module anyway.
pub(crate) const TRUSTED_SHADERS: bool = cfg!(not(target_arch = "wasm32"));

/// True where the persistent compile cache may be written.
pub(crate) const DISK_CACHE: bool = cfg!(not(target_arch = "wasm32"));

/// True where kernels may use subgroup operations (on a device with
/// `wgpu::Features::SUBGROUP`): a browser compiles the WGSL itself and
/// wants `enable subgroups;`, which naga 30, our validator, rejects.
pub(crate) const SUBGROUPS: bool = cfg!(not(target_arch = "wasm32"));

/// The first asynchronous error of a device that nothing has reported yet
/// (on the web; natively errors are returned where they happen and this
/// stays empty), and the checks still running that may report one.
#[derive(Clone, Default)]
pub(crate) struct Deferred(Arc<Mutex<DeferredState>>);

#[derive(Default)]
struct DeferredState {
    error: Option<BackendError>,
    /// Checks started ([`Deferred::begin`]) and not yet ended.
    running: usize,
    /// Who waits for the running checks to end.
    waiting: Vec<std::task::Waker>,
}

impl Deferred {
    fn lock(&self) -> std::sync::MutexGuard<'_, DeferredState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `e` unless an earlier error is waiting.
    pub fn report(&self, e: BackendError) {
        self.lock().error.get_or_insert(e);
    }

    /// The waiting error, if any, which is then reported.
    pub fn take(&self) -> Result<(), BackendError> {
        self.lock().error.take().map_or(Ok(()), Err)
    }

    /// Notes a check that will report its finding later (an execution's
    /// error slots); [`Deferred::end`] when it has.
    #[cfg_attr(not(target_arch = "wasm32"), allow(dead_code, reason = "only the web checks later"))]
    pub fn begin(&self) {
        self.lock().running += 1;
    }

    /// Ends a check [`Deferred::begin`] started.
    #[cfg_attr(not(target_arch = "wasm32"), allow(dead_code, reason = "only the web checks later"))]
    pub fn end(&self) {
        let waiting = {
            let mut st = self.lock();
            st.running -= 1;
            if st.running == 0 {
                std::mem::take(&mut st.waiting)
            } else {
                Vec::new()
            }
        };
        waiting.into_iter().for_each(std::task::Waker::wake);
    }

    /// The waiting error once every running check has ended (the checks
    /// of earlier submissions settle before a later read's mapping, so
    /// this waits little after one).
    #[cfg_attr(not(target_arch = "wasm32"), allow(dead_code, reason = "only the web checks later"))]
    pub async fn settled(&self) -> Result<(), BackendError> {
        std::future::poll_fn(|cx| {
            let mut st = self.lock();
            if st.running == 0 {
                std::task::Poll::Ready(())
            } else {
                st.waiting.push(cx.waker().clone());
                std::task::Poll::Pending
            }
        })
        .await;
        self.take()
    }
}

/// An error scope: natively pushed on the device and popped (waiting for
/// its result) by [`Scope::pop`]; on the web nothing, and errors go to the
/// uncaptured-error handler (see the module docs).
pub(crate) struct Scope(#[cfg(not(target_arch = "wasm32"))] wgpu::ErrorScopeGuard);

impl Scope {
    /// Pushes a scope catching `filter` errors.
    pub fn push(device: &wgpu::Device, filter: wgpu::ErrorFilter) -> Scope {
        #[cfg(not(target_arch = "wasm32"))]
        return Scope(device.push_error_scope(filter));
        #[cfg(target_arch = "wasm32")]
        {
            let _ = (device, filter);
            Scope()
        }
    }

    /// Pops the scope: the error it caught (always `None` on the web).
    pub fn pop(self) -> Option<wgpu::Error> {
        #[cfg(not(target_arch = "wasm32"))]
        return pollster::block_on(self.0.pop());
        #[cfg(target_arch = "wasm32")]
        None
    }
}

/// Waits until `device` has finished all submitted work (natively); on
/// the web returns at once (see the module docs).
pub(crate) fn wait(device: &wgpu::Device) -> Result<(), wgpu::PollError> {
    #[cfg(not(target_arch = "wasm32"))]
    return device.poll(wgpu::PollType::Wait { submission_index: None, timeout: None }).map(|_| ());
    #[cfg(target_arch = "wasm32")]
    {
        let _ = device;
        Ok(())
    }
}

/// Waits until `device` has finished the submission `index` (later ones
/// may still run; natively; on the web returns at once).
pub(crate) fn wait_for(device: &wgpu::Device, index: wgpu::SubmissionIndex) -> Result<(), wgpu::PollError> {
    #[cfg(not(target_arch = "wasm32"))]
    return device.poll(wgpu::PollType::Wait { submission_index: Some(index), timeout: None }).map(|_| ());
    #[cfg(target_arch = "wasm32")]
    {
        let _ = (device, index);
        Ok(())
    }
}

/// Requests `adapter`'s device with `desc`, blocking (natively only).
#[cfg(not(target_arch = "wasm32"))]
pub(crate) fn request_device(
    adapter: &wgpu::Adapter,
    desc: &wgpu::DeviceDescriptor<'_>,
) -> Result<(wgpu::Device, wgpu::Queue), wgpu::RequestDeviceError> {
    pollster::block_on(adapter.request_device(desc))
}

/// The browser's WebGPU adapter (high performance preferred), or `None`
/// when the browser offers none.
#[cfg(target_arch = "wasm32")]
pub(crate) async fn web_adapter() -> Option<wgpu::Adapter> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::BROWSER_WEBGPU,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let options =
        wgpu::RequestAdapterOptions { power_preference: wgpu::PowerPreference::HighPerformance, ..Default::default() };
    instance.request_adapter(&options).await.ok()
}

/// A one-shot channel for a wgpu callback: the callback sends, the future
/// receives (the callback runs from the browser's event loop).
#[cfg(target_arch = "wasm32")]
pub(crate) fn oneshot<T: Send + 'static>() -> (impl FnOnce(T) + Send + 'static, impl std::future::Future<Output = T>) {
    use std::future::poll_fn;
    use std::task::{Poll, Waker};
    type Slot<T> = Arc<Mutex<(Option<T>, Option<Waker>)>>;
    let slot: Slot<T> = Arc::new(Mutex::new((None, None)));
    let tx = slot.clone();
    let send = move |v: T| {
        let waker = {
            let mut s = tx.lock().unwrap_or_else(|p| p.into_inner());
            s.0 = Some(v);
            s.1.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    };
    let recv = poll_fn(move |cx| {
        let mut s = slot.lock().unwrap_or_else(|p| p.into_inner());
        match s.0.take() {
            Some(v) => Poll::Ready(v),
            None => {
                s.1 = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    });
    (send, recv)
}

/// Maps `buffer`'s first `len` bytes for reading, waiting without
/// blocking.
#[cfg(target_arch = "wasm32")]
pub(crate) async fn map_read(buffer: &wgpu::Buffer, len: u64) -> Result<(), wgpu::BufferAsyncError> {
    let (send, recv) = oneshot();
    buffer.map_async(wgpu::MapMode::Read, 0..len, send);
    recv.await
}

/// Runs `fut` to completion on the browser's event loop.
#[cfg(target_arch = "wasm32")]
pub(crate) fn spawn(fut: impl std::future::Future<Output = ()> + 'static) {
    wasm_bindgen_futures::spawn_local(fut);
}

/// The adapters this process can list without blocking: none in a browser
/// tab, whose one adapter is asked for asynchronously (its name is in the
/// device's name once opened).
#[cfg(target_arch = "wasm32")]
pub fn list_adapters() -> Vec<String> {
    Vec::new()
}
