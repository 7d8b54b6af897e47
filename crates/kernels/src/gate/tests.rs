use super::*;
use crate::testing::gpu_backend;

fn case() -> GateCase {
    GateCase::new("t", 2, 3, 4)
}

#[test]
fn metric_passes_rounding_and_fails_real_errors() {
    let r: Vec<f32> = (0..1000).map(|i| ((i as f32) * 0.37).sin()).collect();
    assert!(measure(&case(), &r, &r, true).pass);
    let tiny: Vec<f32> = r.iter().map(|v| v * (1.0 + 1e-4)).collect();
    assert!(measure(&case(), &r, &tiny, true).pass);
    // 2% relative error everywhere: mean_rel 2% > 0.5%.
    let off: Vec<f32> = r.iter().map(|v| v * 1.02).collect();
    let m = measure(&case(), &r, &off, true);
    assert!(!m.pass && (m.mean_rel - 0.02).abs() < 1e-3, "{m:?}");
    // One element badly wrong: max_abs over 1% of mean|ref| rejects even though mean_rel is small.
    let mut one = r.clone();
    one[10] += 0.5;
    let m = measure(&case(), &r, &one, true);
    assert!(!m.pass && m.mean_rel < MEAN_REL_LIMIT, "{m:?}");
    let mut nan = r.clone();
    nan[3] = f32::NAN;
    assert!(!measure(&case(), &r, &nan, true).pass);
    assert!(
        !measure(&case(), &r, &r, false).pass,
        "a broken guard fails the gate"
    );
    // Near-zero references use the 1% floor: tiny absolute errors there do not explode the relative error.
    let mut z = r.clone();
    z[0] = 0.0;
    let mut zf = z.clone();
    zf[0] = 1e-5;
    assert!(measure(&case(), &z, &zf, true).pass);
}

#[test]
fn token_gate_finds_the_first_divergence() {
    assert_eq!(first_divergence(&[1, 2, 3], &[1, 2, 3]), None);
    assert_eq!(first_divergence(&[1, 2, 3], &[1, 5, 3]), Some(1));
    assert_eq!(first_divergence(&[1, 2, 3], &[1, 2]), Some(2));
}

fn gate(
    paths: &[PathId],
    fault: Option<Fault>,
    cases: Option<Vec<GateCase>>,
) -> Option<GateSummary> {
    let be = gpu_backend(None)?;
    let g = be.as_gpu().expect("gpu");
    g.plant_fault(fault);
    let opts = GateOptions {
        only: Some(paths.to_vec()),
        replace_cases: cases.is_some(),
        extra_cases: cases.unwrap_or_default(),
        seed: 7,
        ..GateOptions::default()
    };
    Some(run_gates(&be, &opts))
}

fn status(s: &GateSummary, p: PathId) -> Status {
    s.reports
        .iter()
        .find(|r| r.path == p)
        .map(|r| r.status)
        .expect("path was gated")
}

#[test]
fn every_healthy_path_passes_on_this_adapter() {
    let Some(s) = gate(&PathId::ALL, None, None) else {
        return;
    };
    let g = gpu_backend(None).expect("opened above");
    let gpu = g.as_gpu().expect("gpu");
    for r in &s.reports {
        eprintln!("{}", r.log_line());
        let supported = (paths::def(r.path).detect)(gpu).is_ok();
        if supported && r.path != PathId::CoopMatrix {
            assert_eq!(
                r.status,
                Status::Active,
                "{} should pass: {:?}",
                r.name,
                r.reason
            );
            assert_eq!(r.shapes.len(), default_cases().len());
            assert!(
                r.log_line().ends_with(paths::def(r.path).active_text),
                "{}",
                r.log_line()
            );
        }
        if !supported {
            assert_eq!(r.status, Status::Unsupported);
        }
    }
    assert!(s.active_pills().contains("+f16 storage") && s.active_pills().contains("+q8 matmul"));
}

/// Which paths each planted fault breaks (the kernels it is planted into).
fn victims(f: Fault) -> Vec<PathId> {
    match f {
        Fault::SignExtensionDropped | Fault::BlockIndexAtK2048 => vec![PathId::QuantMatmul],
        Fault::F16Accumulation => vec![PathId::F16Storage],
        Fault::OutOfBoundsWrite | Fault::NanOutput => {
            vec![PathId::F16Storage, PathId::Subgroups, PathId::QuantMatmul]
        }
    }
}

#[test]
fn every_planted_fault_is_rejected() {
    for f in Fault::ALL {
        for p in victims(f) {
            let Some(s) = gate(&[p], Some(f), None) else {
                return;
            };
            let r = &s.reports[0];
            if r.status == Status::Unsupported {
                continue;
            }
            assert_eq!(
                r.status,
                Status::Rejected,
                "{f:?} planted into {} slipped through: {}",
                r.name,
                r.log_line()
            );
            // Rejected for what the kernel computed, not because the broken variant failed to build.
            assert!(
                !r.reason
                    .as_deref()
                    .unwrap_or("")
                    .contains("could not be built"),
                "{:?}",
                r.reason
            );
            assert!(r.log_line().contains("FAIL"), "{}", r.log_line());
            assert!(r.pill_text().starts_with('-'));
        }
    }
}

#[test]
fn shader_f16_with_f16_accumulation_is_rejected() {
    let Some(be) = gpu_backend(None) else { return };
    let g = be.as_gpu().expect("gpu");
    if !g.has_feature(wgpu::Features::SHADER_F16) {
        return;
    }
    // shader-f16 needs f16-storage to pass first (healthy), then is gated with the fault planted.
    let opts = GateOptions {
        only: Some(vec![PathId::F16Storage]),
        seed: 7,
        ..GateOptions::default()
    };
    assert_eq!(run_gates(&be, &opts).reports[0].status, Status::Active);
    g.plant_fault(Some(Fault::F16Accumulation));
    let opts = GateOptions {
        only: Some(vec![PathId::ShaderF16]),
        seed: 7,
        ..GateOptions::default()
    };
    let s = run_gates(&be, &opts);
    assert_eq!(
        s.reports[0].status,
        Status::Rejected,
        "{}",
        s.reports[0].log_line()
    );
    assert!(
        s.reports[0]
            .reason
            .as_deref()
            .unwrap_or("")
            .contains("error limits"),
        "{:?}",
        s.reports[0].reason
    );
}

#[test]
fn a_single_small_gate_misses_the_block_index_fault_that_the_multi_shape_gate_catches() {
    let small = vec![GateCase::new("K=128", 4, 64, 128)];
    let Some(s) = gate(
        &[PathId::QuantMatmul],
        Some(Fault::BlockIndexAtK2048),
        Some(small),
    ) else {
        return;
    };
    assert_eq!(
        status(&s, PathId::QuantMatmul),
        Status::Active,
        "the fault only shows at K >= 2048"
    );
    let s = gate(&[PathId::QuantMatmul], Some(Fault::BlockIndexAtK2048), None).expect("gpu");
    assert_eq!(status(&s, PathId::QuantMatmul), Status::Rejected);
    assert!(
        s.reports[0]
            .reason
            .as_deref()
            .unwrap_or("")
            .contains("K=49152"),
        "{:?}",
        s.reports[0].reason
    );
}

#[test]
fn passed_gates_are_cached_and_regate_reruns_them() {
    let Some(be) = gpu_backend(None) else { return };
    let opts = GateOptions {
        only: Some(vec![PathId::F16Storage]),
        seed: 7,
        ..GateOptions::default()
    };
    let first = run_gates(&be, &opts);
    assert_eq!(first.reports[0].status, Status::Active);
    let cached: HashMap<String, PathReport> = first
        .reports
        .iter()
        .map(|r| (r.cache_key.clone(), r.clone()))
        .collect();
    let again = run_gates(
        &be,
        &GateOptions {
            cached: cached.clone(),
            ..opts
        },
    );
    assert!(again.reports[0].from_cache && again.reports[0].status == Status::Active);
    assert!(be.as_gpu().expect("gpu").path_active(PathId::F16Storage));
    let forced = run_gates(
        &be,
        &GateOptions {
            cached,
            regate: true,
            only: Some(vec![PathId::F16Storage]),
            seed: 7,
            ..GateOptions::default()
        },
    );
    assert!(!forced.reports[0].from_cache);
}

#[test]
fn the_cpu_backend_has_nothing_to_gate() {
    let s = run_gates(&crate::testing::cpu_backend(), &GateOptions::default());
    assert!(s.reports.is_empty());
    assert_eq!(s.active_pills(), "f32 path");
}
