//! Building compute pipelines so that a bad shader is an `Err`, never a crash.

use crate::error::{Error, Result};

/// How a kernel uses one storage binding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    ReadWrite,
}

/// A compute pipeline with its bind-group layout: binding 0 is the kernel's uniform parameter block
/// (dynamic offset into the per-submit parameter buffer), bindings 1.. its storage buffers.
pub struct Pipeline {
    pub name: String,
    pub id: u64,
    pub storage: usize,
    /// Which storage bindings the kernel writes (WebGPU forbids binding a buffer a dispatch writes to
    /// a second binding of the same dispatch).
    pub writable: Vec<bool>,
    pub pipeline: wgpu::ComputePipeline,
    pub layout: wgpu::BindGroupLayout,
}

/// Builds a pipeline; validation errors and shader-compiler panics both come back as
/// [`Error::Pipeline`] (naga can panic on experimental features instead of returning an error).
///
/// Without `checks` the kernel is compiled without naga's runtime checks: no clamping of indices into
/// workgroup and storage arrays, no counters bounding loops, no guards around integer division. Every
/// kernel keeps its indices in range by its own guards (the kernels' tests run this same compile, with
/// poisoned guard regions and split bindings), and the checks cost 8–14% of decode and training time
/// on an H100 (docs/perf.md). Where the driver has robust buffer access (Vulkan's
/// robustBufferAccess2, which wgpu asks for), a storage access out of range still cannot leave the
/// binding; browsers' WebGPU keeps its own checks whatever is asked here.
pub(crate) fn build(
    device: &wgpu::Device,
    name: &str,
    id: u64,
    bindings: &[Access],
    checks: bool,
    source: &str,
) -> Result<Pipeline> {
    let fail = |msg: String| Error::Pipeline {
        name: name.to_string(),
        msg,
    };
    let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // Natively the error scope turns a validation error into this call's Err. On the web it could
        // only be read asynchronously: there the error goes to the device's uncaptured-error handler,
        // which the next flush or read reports.
        #[cfg(not(target_arch = "wasm32"))]
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        #[cfg(target_arch = "wasm32")]
        let scope = ();
        let mut entries = vec![wgpu::BindGroupLayoutEntry {
            binding: 0,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Uniform,
                has_dynamic_offset: true,
                min_binding_size: None,
            },
            count: None,
        }];
        for (i, a) in bindings.iter().enumerate() {
            entries.push(wgpu::BindGroupLayoutEntry {
                binding: i as u32 + 1,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage {
                        read_only: *a == Access::Read,
                    },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            });
        }
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some(name),
            entries: &entries,
        });
        let pl = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(name),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(name),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        };
        let module = if checks {
            device.create_shader_module(desc)
        } else {
            // SAFETY: every kernel guards its own indices (see above); the op tests run them against
            // poisoned guard regions and split bindings, compiled this way.
            unsafe {
                device.create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
            }
        };
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(name),
            layout: Some(&pl),
            module: &module,
            entry_point: Some("main"),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants: &[],
                // Every kernel writes its workgroup memory before reading it.
                zero_initialize_workgroup_memory: false,
            },
            cache: None,
        });
        (scope, layout, pipeline)
    }));
    let (scope, layout, pipeline) = built.map_err(|panic| {
        let msg = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "the shader compiler panicked".into());
        fail(format!("shader compiler panicked: {msg}"))
    })?;
    #[cfg(not(target_arch = "wasm32"))]
    if let Some(e) = pollster::block_on(scope.pop()) {
        return Err(fail(e.to_string()));
    }
    #[cfg(target_arch = "wasm32")]
    let () = scope;
    Ok(Pipeline {
        name: name.to_string(),
        id,
        storage: bindings.len(),
        writable: bindings.iter().map(|a| *a != Access::Read).collect(),
        pipeline,
        layout,
    })
}
