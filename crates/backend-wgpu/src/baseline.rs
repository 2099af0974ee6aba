//! Hand-written baseline kernels, run on the backend's own device so that
//! benchmarks compare generated code with a plain WGSL kernel on the same
//! adapter. [`Baseline`] creates a pipeline from a WGSL source (the files
//! in `shaders/`, included as [`W1_VEC4`] and [`MATMUL_NAIVE`]), binds
//! buffers it owns, and times dispatches, each ending at a device wait.
//!
//! This is measurement tooling, not part of the execution path: sources
//! are validated by naga like generated ones, but nothing is cached.

use crate::compile::validate::validate_wgsl;
use crate::runtime::WgpuBackend;
use lazuli_executor::platform::Instant;
use lazuli_executor::BackendError;
use std::time::Duration;
use wgpu::util::DeviceExt as _;

/// W1 by hand: `y = tanh(relu(x * a + b) - c) * d`, one vec4 per
/// invocation. Bindings: uniform `{n4: u32, a, b, c, d: f32}`, `x`, `y`.
pub const W1_VEC4: &str = include_str!("../../../shaders/w1_vec4.wgsl");

/// Naive matmul: one invocation per output, workgroup 16 x 16. Bindings:
/// uniform `{m, n, k, pad: u32}`, `a`, `b`, `c`.
pub const MATMUL_NAIVE: &str = include_str!("../../../shaders/matmul_naive.wgsl");

/// One binding of a baseline kernel, in binding order from 0.
#[derive(Clone, Debug)]
pub enum BaselineBinding {
    /// A uniform buffer with these bytes.
    Uniform(Vec<u8>),
    /// A read-only storage buffer with these bytes.
    Input(Vec<u8>),
    /// A read-write storage buffer of this many bytes (zeroed).
    Output(u64),
}

/// A compiled hand-written kernel with its buffers and dispatch size.
pub struct Baseline {
    device: wgpu::Device,
    queue: wgpu::Queue,
    pipeline: wgpu::ComputePipeline,
    bind_group: wgpu::BindGroup,
    buffers: Vec<wgpu::Buffer>,
    workgroups: [u32; 3],
}

impl Baseline {
    /// Validates `source`, creates its pipeline (entry `main`) on the
    /// backend's device and the buffers of `bindings`.
    pub fn new(
        backend: &WgpuBackend,
        source: &str,
        bindings: &[BaselineBinding],
        workgroups: [u32; 3],
    ) -> Result<Baseline, BackendError> {
        let compile_err = |message: String| BackendError::Compile { kernel: "baseline".into(), message };
        validate_wgsl(source).map_err(compile_err)?;
        let device = backend.wgpu_device().clone();
        let queue = backend.wgpu_queue().clone();
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("baseline"),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("baseline"),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
        let storage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
        let buffers: Vec<wgpu::Buffer> = bindings
            .iter()
            .map(|b| match b {
                BaselineBinding::Uniform(bytes) => device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("baseline uniform"),
                    contents: bytes,
                    usage: wgpu::BufferUsages::UNIFORM,
                }),
                BaselineBinding::Input(bytes) => device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("baseline input"),
                    contents: bytes,
                    usage: storage,
                }),
                BaselineBinding::Output(size) => device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("baseline output"),
                    size: (*size).max(4),
                    usage: storage,
                    mapped_at_creation: false,
                }),
            })
            .collect();
        let layout = pipeline.get_bind_group_layout(0);
        let entries: Vec<wgpu::BindGroupEntry> = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry { binding: i as u32, resource: b.as_entire_binding() })
            .collect();
        let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("baseline"),
            layout: &layout,
            entries: &entries,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(compile_err(e.to_string()));
        }
        Ok(Baseline { device, queue, pipeline, bind_group, buffers, workgroups })
    }

    /// One dispatch, submitted and waited for.
    pub fn run(&self) -> Result<(), BackendError> {
        let mut enc = self.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(&self.pipeline);
            pass.set_bind_group(0, &self.bind_group, &[]);
            let [x, y, z] = self.workgroups;
            pass.dispatch_workgroups(x, y, z);
        }
        self.queue.submit([enc.finish()]);
        self.device
            .poll(wgpu::PollType::Wait { submission_index: None, timeout: None })
            .map(|_| ())
            .map_err(|e| BackendError::Device { device: "baseline".into(), message: e.to_string() })
    }

    /// `warmup` untimed runs, then the durations of `iterations` timed runs.
    pub fn time(&self, warmup: usize, iterations: usize) -> Result<Vec<Duration>, BackendError> {
        for _ in 0..warmup {
            self.run()?;
        }
        let mut out = Vec::with_capacity(iterations);
        for _ in 0..iterations {
            let t = Instant::now();
            self.run()?;
            out.push(t.elapsed());
        }
        Ok(out)
    }

    /// Reads binding `binding` back as f32 (for checking results).
    pub fn read_f32(&self, binding: usize) -> Result<Vec<f32>, BackendError> {
        let src = &self.buffers[binding];
        let size = src.size();
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("baseline readback"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(src, 0, &staging, 0, size);
        self.queue.submit([enc.finish()]);
        staging.slice(..).map_async(wgpu::MapMode::Read, |_| {});
        let dev_err = |e: String| BackendError::Device { device: "baseline".into(), message: e };
        self.device
            .poll(wgpu::PollType::Wait { submission_index: None, timeout: None })
            .map_err(|e| dev_err(e.to_string()))?;
        let view = staging.slice(..).get_mapped_range().map_err(|e| dev_err(e.to_string()))?;
        Ok(bytemuck::cast_slice::<u8, f32>(&view).to_vec())
    }
}
