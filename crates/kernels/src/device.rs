//! The device layer: which adapter to run on, which features and limits to ask it for, and the profile
//! that makes a big GPU behave like the weakest WebGPU adapter.

use crate::backend::Backend;
use crate::cpu::CpuBackend;
use crate::error::{Error, Result};
use crate::gpu::GpuBackend;

/// Where the ops run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// A GPU adapter when one opens, else the CPU backend (saying so).
    #[default]
    Auto,
    /// Always the CPU backend.
    Cpu,
    /// A GPU adapter or an error.
    Gpu,
}

impl std::str::FromStr for BackendChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "gpu" => Ok(Self::Gpu),
            other => Err(format!(
                "unknown backend {other:?}: expected cpu, gpu or auto"
            )),
        }
    }
}

/// How to open a device.
#[derive(Clone, Debug, Default)]
pub struct DeviceOptions {
    pub backend: BackendChoice,
    /// An adapter's index in [`list_adapters`], or a case-insensitive part of its name.
    pub adapter: Option<String>,
    /// Request only WebGPU's default limits (128 MiB storage binding, 256 MiB buffer, 8 storage buffers per
    /// stage, 16 KiB workgroup memory), whatever the adapter could give.
    pub low_end: bool,
    /// Split tensors at this many bytes instead of the device's binding limit (tests use it to exercise
    /// splitting at small sizes). Never above the device's limit.
    pub max_binding_override: Option<u64>,
    /// Compile the kernels with naga's runtime checks (indices clamped into range, loops bounded,
    /// divisions guarded), as WebGPU in a browser does. Off by default: every kernel guards its own
    /// indices, and the checks cost 8–14% of decode and training time on an H100. For finding a kernel
    /// that reads out of range on some driver.
    pub shader_checks: bool,
    /// Number of CPU threads for the CPU backend (None: all cores).
    pub cpu_threads: Option<usize>,
}

/// One adapter as the user sees it in listings and in the `--adapter` choice.
#[derive(Clone, Debug, serde::Serialize)]
pub struct AdapterSummary {
    pub index: usize,
    pub name: String,
    pub backend: String,
    pub device_type: String,
    pub driver: String,
    pub driver_info: String,
}

fn instance(backends: wgpu::Backends) -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = backends;
    // WGPU_BACKEND and friends still apply, as wgpu documents.
    wgpu::Instance::new(desc.with_env())
}

fn summary(index: usize, a: &wgpu::Adapter) -> AdapterSummary {
    let i = a.get_info();
    AdapterSummary {
        index,
        name: i.name,
        backend: format!("{:?}", i.backend),
        device_type: format!("{:?}", i.device_type),
        driver: i.driver,
        driver_info: i.driver_info,
    }
}

/// Rank used to pick an adapter when the user did not: discrete > integrated > virtual > software.
/// Vulkan and Metal/DX12 ahead of GL, which lacks compute features we use.
fn preference(a: &wgpu::Adapter) -> (u8, u8) {
    let i = a.get_info();
    let kind = match i.device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    };
    let api = match i.backend {
        wgpu::Backend::Vulkan | wgpu::Backend::Metal | wgpu::Backend::Dx12 => 0,
        wgpu::Backend::BrowserWebGpu => 0,
        _ => 1,
    };
    (kind, api)
}

async fn adapters() -> Vec<wgpu::Adapter> {
    // GL adapters lack compute limits we rely on (and probing them makes Mesa print warnings on headless
    // machines), so they are looked at only when no Vulkan/Metal/DX12/WebGPU adapter exists.
    let primary = instance(wgpu::Backends::PRIMARY)
        .enumerate_adapters(wgpu::Backends::all())
        .await;
    if !primary.is_empty() {
        return primary;
    }
    instance(wgpu::Backends::GL)
        .enumerate_adapters(wgpu::Backends::all())
        .await
}

/// Every adapter wgpu can open on this machine, in the order `--adapter INDEX` refers to.
pub async fn list_adapters() -> Vec<AdapterSummary> {
    adapters()
        .await
        .iter()
        .enumerate()
        .map(|(i, a)| summary(i, a))
        .collect()
}

fn choose(list: Vec<wgpu::Adapter>, query: Option<&str>) -> Result<wgpu::Adapter> {
    if list.is_empty() {
        return Err(Error::NoAdapter(
            "wgpu found no adapter on any backend".into(),
        ));
    }
    let Some(q) = query else {
        let mut list = list;
        list.sort_by_key(preference);
        return Ok(list.swap_remove(0));
    };
    let available = list
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let s = summary(i, a);
            format!(
                "  [{}] {} ({}, {})",
                s.index, s.name, s.backend, s.device_type
            )
        })
        .collect::<Vec<_>>()
        .join("\n");
    if let Ok(idx) = q.parse::<usize>() {
        return list
            .into_iter()
            .nth(idx)
            .ok_or_else(|| Error::AdapterNotFound {
                query: q.into(),
                available,
            });
    }
    let ql = q.to_lowercase();
    list.into_iter()
        .find(|a| a.get_info().name.to_lowercase().contains(&ql))
        .ok_or(Error::AdapterNotFound {
            query: q.into(),
            available,
        })
}

/// The features we use when the adapter has them; nothing else is requested.
pub(crate) fn wanted_features() -> wgpu::Features {
    wgpu::Features::SHADER_F16
        | wgpu::Features::SUBGROUP
        | wgpu::Features::TIMESTAMP_QUERY
        | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES
        | wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
}

/// Opens the backend `opts` asks for. With [`BackendChoice::Auto`] and no usable adapter, returns the CPU
/// backend and the reason the GPU was not used (the caller prints it in one line).
pub async fn open(opts: &DeviceOptions) -> Result<(Backend, Option<String>)> {
    if opts.backend == BackendChoice::Cpu {
        return Ok((Backend::Cpu(CpuBackend::new(opts.cpu_threads)), None));
    }
    if opts.backend == BackendChoice::Auto && opts.adapter.is_none() {
        // A software rasterizer (lavapipe, llvmpipe, WARP) runs our kernels correctly but several
        // times slower than the CPU backend's SIMD code, so `auto` takes it only when asked by name.
        let list = adapters().await;
        if !list.is_empty()
            && list
                .iter()
                .all(|a| a.get_info().device_type == wgpu::DeviceType::Cpu)
        {
            let names: Vec<String> = list.iter().map(|a| a.get_info().name).collect();
            return Ok((
                Backend::Cpu(CpuBackend::new(opts.cpu_threads)),
                Some(format!(
                    "only a software GPU adapter is available ({}); the CPU backend is faster, so it is \
                     used (pass --backend gpu to run the WGSL kernels on the software adapter)",
                    names.join(", ")
                )),
            ));
        }
    }
    match open_gpu(opts).await {
        Ok(g) => Ok((Backend::Gpu(g), None)),
        Err(e) if opts.backend == BackendChoice::Auto && opts.adapter.is_none() => Ok((
            Backend::Cpu(CpuBackend::new(opts.cpu_threads)),
            Some(format!(
                "no usable GPU adapter ({e}); running on the CPU backend"
            )),
        )),
        Err(e) => Err(e),
    }
}

/// Opens a GPU device on the adapter `opts` selects.
pub async fn open_gpu(opts: &DeviceOptions) -> Result<GpuBackend> {
    let adapter = choose(adapters().await, opts.adapter.as_deref())?;
    let info = adapter.get_info();
    let features = adapter.features() & wanted_features();
    let limits = if opts.low_end {
        let d = wgpu::Limits::defaults();
        let a = adapter.limits();
        if !d.check_limits(&a) {
            return Err(Error::Limits(format!(
                "adapter {:?} cannot give even WebGPU's default limits, which the low-end profile requests",
                info.name
            )));
        }
        d
    } else {
        adapter.limits()
    };
    let experimental = if features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
        // SAFETY: cooperative-matrix pipelines are only built behind the numerics gate, which catches
        // shader-compiler panics and checks every result against the f32 path before use.
        unsafe { wgpu::ExperimentalFeatures::enabled() }
    } else {
        wgpu::ExperimentalFeatures::disabled()
    };
    let (device, queue) = adapter
        .request_device(&wgpu::DeviceDescriptor {
            label: Some("tinygpt"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: experimental,
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        })
        .await
        .map_err(|e| Error::RequestDevice {
            adapter: info.name.clone(),
            reason: e.to_string(),
        })?;
    let coop = if features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
        adapter.cooperative_matrix_properties()
    } else {
        Vec::new()
    };
    GpuBackend::new(device, queue, info, limits, opts, coop)
}
