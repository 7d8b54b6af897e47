use super::*;
use crate::ops::matmul::{Gemm, Kernel, QMatrix, choose, quant::quantize_q8_32};
use crate::testing::{cpu_backend, gpu_backend};

fn case() -> GateCase {
    GateCase::new("t", 2, 3, 4)
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    pollster::block_on(f)
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

/// The paths to gate so that `p` can be evaluated: its prerequisites, then itself.
fn with_requirements(p: PathId) -> Vec<PathId> {
    p.with_prerequisites().iter().collect()
}

#[test]
fn a_path_comes_with_its_prerequisites_and_theirs() {
    let s = PathId::CoopQuant.with_prerequisites();
    let want = [
        PathId::F16Storage,
        PathId::CoopMatrix,
        PathId::QuantMatmul,
        PathId::CoopQuant,
    ];
    assert_eq!(s, PathSet::of(&want));
    assert_eq!(PathId::Subgroups.with_prerequisites().len(), 1);
}

/// Gates `paths` on a fresh GPU backend (a fresh store: nothing cached), with `fault` planted into the
/// kernels of one of them.
fn gate(
    paths: &[PathId],
    fault: Option<(Fault, PathId)>,
    cases: Option<Vec<GateCase>>,
) -> Option<GateSummary> {
    let be = gpu_backend(None)?;
    let opts = GateOptions {
        only: Some(paths.to_vec()),
        replace_cases: cases.is_some(),
        extra_cases: cases.unwrap_or_default(),
        seed: 7,
        ..GateOptions::default()
    };
    let mut store = MemoryStore::default();
    Some(block_on(match fault {
        Some((f, victim)) => futures_either(run_gates_planted(&be, &opts, &mut store, f, victim)),
        None => futures_either(run_gates(&be, &opts, &mut store)),
    }))
}

/// Boxes either future so both arms of a match have one type.
fn futures_either<'a>(
    f: impl std::future::Future<Output = GateSummary> + 'a,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = GateSummary> + 'a>> {
    Box::pin(f)
}

fn report(s: &GateSummary, p: PathId) -> &PathReport {
    s.reports
        .iter()
        .find(|r| r.path == p)
        .expect("path was gated")
}

#[test]
fn every_healthy_path_passes_on_this_adapter() {
    let Some(s) = gate(&PathId::ALL, None, None) else {
        return;
    };
    let g = gpu_backend(None).expect("opened above");
    for r in &s.reports {
        eprintln!("{}", r.log_line());
        let supported = (registry::def(r.path).detect)(&g).is_ok();
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
                r.log_line().ends_with(r.path.active_text()),
                "{}",
                r.log_line()
            );
        }
        if !supported {
            assert_eq!(r.status, Status::Unsupported);
        }
    }
    assert!(s.active_pills().contains("+f16 storage") && s.active_pills().contains("+q8 matmul"));
    assert!(s.active().has(PathId::F16Storage) && s.active().has(PathId::QuantMatmul));
}

/// Which paths each planted fault breaks (the kernels it is planted into).
fn victims(f: Fault) -> Vec<PathId> {
    match f {
        Fault::SignExtensionDropped | Fault::BlockIndexAtK2048 => {
            vec![PathId::QuantMatmul, PathId::CoopQuant]
        }
        Fault::F16Accumulation => vec![PathId::F16Storage, PathId::ShaderF16],
        // Faults of one model's run, which the drift guard and the training gate catch.
        Fault::RopePast500
        | Fault::PositionsPast200
        | Fault::WeightGradF16Accumulation
        | Fault::CausalMaskPast128 => vec![],
        // A CPU path's fault (the CPU gate's tests plant it).
        Fault::EightBitActivations => vec![],
        Fault::OutOfBoundsWrite | Fault::NanOutput => vec![
            PathId::F16Storage,
            PathId::Subgroups,
            PathId::CoopMatrix,
            PathId::QuantMatmul,
            PathId::CoopQuant,
            PathId::MixedTraining,
        ],
    }
}

#[test]
fn every_planted_fault_is_rejected() {
    for f in Fault::ALL {
        for p in victims(f) {
            let Some(s) = gate(&with_requirements(p), Some((f, p)), None) else {
                return;
            };
            let r = report(&s, p);
            if r.status == Status::Unsupported
                || r.reason.as_deref().is_some_and(|w| w.starts_with("needs"))
            {
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
            assert!(!s.active().has(p));
            // The fault stays where it was planted: the prerequisites it was gated with still pass.
            for q in registry::def(p).requires {
                assert_eq!(report(&s, *q).status, Status::Active);
            }
        }
    }
}

#[test]
fn shader_f16_with_f16_accumulation_is_rejected_for_its_numbers() {
    let Some(be) = gpu_backend(None) else { return };
    if !be
        .as_gpu()
        .expect("gpu")
        .has_feature(wgpu::Features::SHADER_F16)
    {
        return;
    }
    let s = gate(
        &with_requirements(PathId::ShaderF16),
        Some((Fault::F16Accumulation, PathId::ShaderF16)),
        None,
    )
    .expect("gpu");
    let r = report(&s, PathId::ShaderF16);
    assert_eq!(r.status, Status::Rejected, "{}", r.log_line());
    assert!(
        r.reason.as_deref().unwrap_or("").contains("error limits"),
        "{:?}",
        r.reason
    );
}

#[test]
fn a_single_small_gate_misses_the_block_index_fault_that_the_multi_shape_gate_catches() {
    let small = vec![GateCase::new("K=128", 4, 64, 128)];
    let planted = Some((Fault::BlockIndexAtK2048, PathId::QuantMatmul));
    let Some(s) = gate(&[PathId::QuantMatmul], planted, Some(small)) else {
        return;
    };
    assert_eq!(
        report(&s, PathId::QuantMatmul).status,
        Status::Active,
        "the fault only shows at K >= 2048"
    );
    let s = gate(&[PathId::QuantMatmul], planted, None).expect("gpu");
    let r = report(&s, PathId::QuantMatmul);
    assert_eq!(r.status, Status::Rejected);
    assert!(
        r.reason.as_deref().unwrap_or("").contains("K=49152"),
        "{:?}",
        r.reason
    );
}

/// Gate options for the f16-storage path alone: a quick gate whose pass is stored.
fn f16_storage_only() -> GateOptions {
    GateOptions {
        only: Some(vec![PathId::F16Storage]),
        seed: 7,
        ..GateOptions::default()
    }
}

/// A verdict is stored under the digest of the kernels' sources (build.rs): one stored by a build whose
/// kernels differ (the same key but another digest) is not reused, however its kernel version reads;
/// this build's own is.
#[test]
fn verdicts_of_other_kernel_sources_are_not_reused() {
    let Some(be) = gpu_backend(None) else { return };
    let digest = kernels_digest();
    assert!(
        digest.len() == 16 && digest.chars().all(|c| c.is_ascii_hexdigit()),
        "{digest}"
    );
    let opts = f16_storage_only();
    let mut store = MemoryStore::default();
    let first = block_on(run_gates(&be, &opts, &mut store));
    assert_eq!(first.reports[0].status, Status::Active);
    let key = first.reports[0].cache_key.clone();
    assert!(key.contains(&format!("|k{digest}|")), "{key}");
    // The same verdict as an earlier build (other kernel sources) would have stored it.
    let verdict = store.verdicts.remove(&key).expect("the pass is stored");
    let other = key.replace(digest, "0123456789abcdef");
    store.verdicts.insert(other, verdict);
    let again = block_on(run_gates(&be, &opts, &mut store));
    assert!(
        !again.reports[0].from_cache,
        "another build's verdict was reused"
    );
    assert_eq!(again.reports[0].status, Status::Active);
    // This build's own verdict is.
    let cached = block_on(run_gates(&be, &opts, &mut store));
    assert!(cached.reports[0].from_cache);
}

#[test]
fn passed_gates_are_stored_and_regate_reruns_them() {
    let Some(be) = gpu_backend(None) else { return };
    let opts = f16_storage_only();
    let mut store = MemoryStore::default();
    let first = block_on(run_gates(&be, &opts, &mut store));
    assert_eq!(first.reports[0].status, Status::Active);
    assert!(!first.reports[0].from_cache);
    assert_eq!(store.verdicts.len(), 1, "the pass is stored");
    let again = block_on(run_gates(&be, &opts, &mut store));
    assert!(again.reports[0].from_cache && again.reports[0].status == Status::Active);
    assert!(again.all_cached() && again.active().has(PathId::F16Storage));
    let forced = block_on(run_gates(
        &be,
        &GateOptions {
            regate: true,
            ..opts.clone()
        },
        &mut store,
    ));
    assert!(!forced.reports[0].from_cache);
    // A failure forgets what was stored, so it is checked again next time.
    let failed = block_on(run_gates_planted(
        &be,
        &GateOptions {
            regate: true,
            ..opts
        },
        &mut store,
        Fault::NanOutput,
        PathId::F16Storage,
    ));
    assert_eq!(failed.reports[0].status, Status::Rejected);
    assert!(store.verdicts.is_empty());
}

/// The kernel choice is a function of the path set handed in: gating (which runs every fast kernel on
/// the device) changes nothing for a caller that holds the f32 set.
#[test]
fn what_runs_depends_only_on_the_path_set_held() {
    let Some(be) = gpu_backend(None) else { return };
    let mut store = MemoryStore::default();
    let s = block_on(run_gates(&be, &GateOptions::default(), &mut store));
    let x = be.zeros(64, 1).unwrap();
    let w = be.zeros(64 * 8, 1).unwrap();
    let mut y = be.zeros(8, 1).unwrap();
    let g = Gemm::nt(1, 8, 64);
    let yv: crate::TMut<'_> = (&mut y).into();
    let f32_choice = choose(&be, (&x).into(), (&w).into(), &yv, &g, PathSet::F32);
    assert_eq!(
        f32_choice.kernel,
        Kernel::Gemv {
            shader_f16: false,
            subgroups: false
        }
    );
    let fast = choose(&be, (&x).into(), (&w).into(), &yv, &g, s.active());
    if s.active().has(PathId::Subgroups) {
        assert_eq!(
            fast.kernel,
            Kernel::Gemv {
                shader_f16: false,
                subgroups: true
            }
        );
    }
    // A quantized matrix is held as blocks only for a set with the quantized kernels.
    let src = quantize_q8_32(&vec![0.1; 8 * 64], 8, 64);
    assert!(
        !QMatrix::upload(&be, src.clone(), PathSet::F32)
            .unwrap()
            .is_quantized()
    );
    let q = PathSet::of(&[PathId::QuantMatmul]);
    assert!(QMatrix::upload(&be, src, q).unwrap().is_quantized());
}

#[test]
fn the_cpu_backend_gates_none_of_the_gpu_paths() {
    let mut store = MemoryStore::default();
    let gpu_paths: Vec<PathId> = PathId::ALL
        .into_iter()
        .filter(|&p| !registry::def(p).on_cpu)
        .collect();
    let opts = GateOptions {
        only: Some(gpu_paths),
        ..GateOptions::default()
    };
    let s = block_on(run_gates(&cpu_backend(), &opts, &mut store));
    assert!(s.reports.is_empty());
    assert_eq!(s.active_pills(), "f32 path");
}

/// The token gate keeps the paths whose greedy tokens equal the f32 path's, drops the others (and what
/// needs them), stores its verdict and reuses it.
#[test]
fn token_gate_drops_exactly_the_paths_that_diverge() {
    let be = cpu_backend();
    let mut store = MemoryStore::default();
    let active = PathSet::of(&[PathId::F16Storage, PathId::ShaderF16, PathId::Subgroups]);
    let reference = vec![5u32, 6, 7, 8];
    let mut calls = Vec::new();
    let run = |store: &mut MemoryStore, regate: bool, calls: &mut Vec<PathSet>| {
        let mut log = Vec::new();
        let out = block_on(token_gate(
            &be,
            store,
            "model",
            active,
            regate,
            async |p: PathSet| -> std::result::Result<Vec<u32>, String> {
                calls.push(p);
                let mut t = reference.clone();
                if p.has(PathId::F16Storage) {
                    t[2] = 0; // f16 weights change the third token
                }
                Ok(t)
            },
            &mut |l| log.push(l.to_string()),
        ))
        .unwrap();
        (out, log)
    };
    let (out, log) = run(&mut store, false, &mut calls);
    assert_eq!(out.kept, vec![PathId::Subgroups]);
    assert_eq!(out.dropped[0], (PathId::F16Storage, 2));
    assert_eq!(out.dropped[1].0, PathId::ShaderF16, "it needs f16-storage");
    assert_eq!(out.kept_set(active), PathSet::of(&[PathId::Subgroups]));
    assert!(
        log.iter()
            .any(|l| l.contains("diverge from the f32 path at token 2")),
        "{log:?}"
    );
    assert_eq!(calls[0], PathSet::F32, "the reference runs on the f32 path");
    assert!(
        out.key.contains(&format!("|k{}|", kernels_digest())),
        "the verdict is stored under the kernels' digest: {}",
        out.key
    );
    let (again, log) = run(&mut store, false, &mut calls);
    assert!(again.from_cache && again.kept == out.kept, "{log:?}");
    assert_eq!(calls.len(), 4, "a stored verdict runs nothing");
    let (forced, _) = run(&mut store, true, &mut calls);
    assert!(!forced.from_cache && calls.len() > 4);
}

/// A model whose greedy tokens are fixed (its key names it).
struct FixedModel(&'static str);

impl GateModel for FixedModel {
    type Error = String;

    fn gate_cases(&self) -> Vec<GateCase> {
        vec![GateCase::new("model", 2, 96, 160)]
    }

    fn model_key(&self) -> String {
        self.0.to_string()
    }

    async fn greedy(&self, _: &Backend, _: PathSet) -> std::result::Result<Vec<u32>, String> {
        Ok(vec![1, 2, 3])
    }
}

/// `stored_verdict` tells, without running a kernel, whether gating a model will come entirely from
/// the store (and what it will give), so a caller can start on the f32 path and gate in the
/// background only when something must be measured.
#[test]
fn a_stored_verdict_says_whether_gating_a_model_is_instant() {
    let cpu = cpu_backend();
    let gpu_only = GateOptions {
        only: Some(vec![PathId::F16Storage]),
        ..GateOptions::default()
    };
    assert_eq!(
        stored_verdict(
            &cpu,
            &mut MemoryStore::default(),
            &FixedModel("m"),
            &gpu_only
        ),
        Some(PathSet::F32),
        "no path of the CPU backend to gate"
    );
    if crate::ops::matmul::quant::cpu_int::int_dot_available() {
        let (mut store, all) = (MemoryStore::default(), GateOptions::default());
        let model = FixedModel("m");
        assert_eq!(stored_verdict(&cpu, &mut store, &model, &all), None);
        let gated = block_on(gate_for_model(&cpu, &mut store, &model, &all, &mut |_| {})).unwrap();
        assert_eq!(gated.paths, PathSet::of(&[PathId::IntDot]));
        assert_eq!(
            stored_verdict(&cpu, &mut store, &model, &all),
            Some(gated.paths)
        );
    }
    let Some(be) = gpu_backend(None) else { return };
    let opts = GateOptions {
        only: Some(vec![PathId::F16Storage]),
        seed: 7,
        ..GateOptions::default()
    };
    let mut store = MemoryStore::default();
    let model = FixedModel("m");
    assert_eq!(stored_verdict(&be, &mut store, &model, &opts), None);
    let gated = block_on(gate_for_model(&be, &mut store, &model, &opts, &mut |_| {})).unwrap();
    assert!(gated.paths.has(PathId::F16Storage), "{:?}", gated.paths);
    assert_eq!(
        stored_verdict(&be, &mut store, &model, &opts),
        Some(gated.paths)
    );
    // Another model needs its own token gate; --regate trusts nothing stored.
    assert_eq!(
        stored_verdict(&be, &mut store, &FixedModel("other"), &opts),
        None
    );
    let regate = GateOptions {
        regate: true,
        ..opts.clone()
    };
    assert_eq!(stored_verdict(&be, &mut store, &model, &regate), None);
    // Without the op gates' verdicts (another shape's key), the token verdict alone is not enough.
    let wider = GateOptions {
        extra_cases: vec![GateCase::new("wider", 1, 64, 320)],
        ..opts
    };
    assert_eq!(stored_verdict(&be, &mut store, &model, &wider), None);
}

/// The CPU backend gates its own paths and only those: `int-dot` passes where the CPU has AVX-512 VNNI
/// (and is unsupported, with the reason, elsewhere), and eight-bit activations planted into its
/// kernels (llama.cpp's precision) fail the gate.
#[test]
fn cpu_backend_gates_int_dot_and_rejects_eight_bit_activations() {
    use crate::ops::matmul::quant::cpu_int::int_dot_available;
    let be = cpu_backend();
    let all = block_on(run_gates(
        &be,
        &GateOptions::default(),
        &mut MemoryStore::default(),
    ));
    let names: Vec<PathId> = all.reports.iter().map(|r| r.path).collect();
    assert_eq!(names, [PathId::IntDot], "the CPU backend's paths only");
    assert!(all.adapter.starts_with("CPU backend"), "{}", all.adapter);
    let r = &all.reports[0];
    eprintln!("{}", r.log_line());
    if !int_dot_available() {
        assert_eq!(r.status, Status::Unsupported);
        assert!(r.reason.as_deref().unwrap_or("").contains("VNNI"));
        return;
    }
    assert_eq!(r.status, Status::Active, "{}", r.log_line());
    assert_eq!(r.shapes.len(), default_cases().len());
    let opts = GateOptions {
        only: Some(vec![PathId::IntDot]),
        ..GateOptions::default()
    };
    let bad = block_on(run_gates_planted(
        &be,
        &opts,
        &mut MemoryStore::default(),
        Fault::EightBitActivations,
        PathId::IntDot,
    ));
    let r = &bad.reports[0];
    eprintln!("{}", r.log_line());
    assert_eq!(r.status, Status::Rejected, "{}", r.log_line());
    assert!(
        r.reason
            .as_deref()
            .unwrap_or("")
            .contains("outside the error limits"),
        "{:?}",
        r.reason
    );
}
