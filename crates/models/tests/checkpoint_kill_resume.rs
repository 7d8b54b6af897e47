//! A training run whose checkpoint save is killed at any step, then resumed from what the directory
//! holds, ends bit-exactly where an uninterrupted run ends (CPU backend).

use std::path::Path;

use tinygpt_kernels::PathSet;
use tinygpt_kernels::testing::cpu_backend;
use tinygpt_models::gpt::checkpoint::{
    self, CheckpointConfig, SaveHook, TrainState, WeightDtype, encode, write_files_with,
};
use tinygpt_models::gpt::{Dataset, GptConfig, Layout, OptimConfig, Trainer, learning_rate};

const SEED: u64 = 5;
const BATCH: usize = 2;
const ITERS: usize = 9;

/// Where training stands: parameters, the AdamW moments (none before the first step), the step.
type Start = (Vec<f32>, Option<(Vec<f32>, Vec<f32>)>, u32);
/// Where training ends: parameters, first and second moments, the step.
type End = (Vec<f32>, Vec<f32>, Vec<f32>, u32);

struct KillAt(usize);
impl SaveHook for KillAt {
    fn proceed(&mut self, n: usize) -> bool {
        n < self.0
    }
}

fn setup() -> (GptConfig, Dataset) {
    let text = "It is a truth universally acknowledged, that a single man. ".repeat(20);
    let data = Dataset::from_bytes(text.as_bytes(), 8).unwrap();
    let cfg = GptConfig {
        vocab_size: data.vocab.len(),
        block_size: 8,
        n_layer: 1,
        n_head: 2,
        n_embd: 8,
        dropout: 0.0,
    };
    (cfg, data)
}

/// Runs iterations `from..to` starting from `state` (params, m, v, step).
fn train(cfg: &GptConfig, data: &Dataset, state: Start, from: usize, to: usize) -> End {
    let be = cpu_backend();
    let (p, mv, step) = state;
    let moments = mv.as_ref().map(|(m, v)| (m.as_slice(), v.as_slice(), step));
    let mut tr = Trainer::new(
        &be,
        cfg,
        BATCH,
        &p,
        moments,
        OptimConfig::default(),
        PathSet::F32,
    )
    .unwrap();
    for it in from..to {
        let (x, y) = data.batch(false, SEED, it as u64, BATCH, cfg.block_size);
        let lr = learning_rate(it, 2, ITERS, 1e-2, 1e-3);
        tr.train_step(&be, &x, &y, lr, SEED as u32).unwrap();
    }
    let (p, m, v) = tr.state(&be).unwrap();
    (p, m, v, tr.step)
}

/// Saves `s` into `dir`, stopped before step `hook` of the save; whether the save ran to its end.
fn save(dir: &Path, cfg: &CheckpointConfig, s: &End, hook: usize) -> bool {
    let state = TrainState {
        step: s.3,
        seed: SEED,
        max_iters: ITERS,
        ..Default::default()
    };
    let files = encode(
        cfg,
        &s.0,
        WeightDtype::F32,
        Some((&s.1, &s.2)),
        Some(&state),
    )
    .unwrap();
    write_files_with(dir, &files, &mut KillAt(hook)).unwrap()
}

#[test]
fn a_run_killed_at_any_step_of_a_save_resumes_to_the_uninterrupted_result() {
    let (cfg, data) = setup();
    let init = Layout::new(&cfg).init(&cfg, SEED);
    let ck = CheckpointConfig {
        model: cfg.clone(),
        vocab: data.vocab.clone(),
        provenance: serde_json::Value::Null,
    };
    let whole = train(&cfg, &data, (init.clone(), None, 0), 0, ITERS);
    let at3 = train(&cfg, &data, (init.clone(), None, 0), 0, 3);
    let at6 = train(
        &cfg,
        &data,
        (at3.0.clone(), Some((at3.1.clone(), at3.2.clone())), at3.3),
        3,
        6,
    );
    let mut kills = 0;
    for hook in 0.. {
        let dir =
            std::env::temp_dir().join(format!("tinygpt-kill-resume-{}-{hook}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        save(&dir, &ck, &at3, usize::MAX);
        // The save of step 6, cut short before its step `hook` (as a kill -9 there would).
        let finished = save(&dir, &ck, &at6, hook);
        checkpoint::recover(&dir).unwrap();
        let l = checkpoint::load(&dir).unwrap();
        let step = l.state.unwrap().step as usize;
        assert!(step == 3 || step == 6, "kill at {hook}: step {step}");
        let resumed = train(
            &cfg,
            &data,
            (l.params, l.optimizer, step as u32),
            step,
            ITERS,
        );
        assert_eq!(
            resumed.0, whole.0,
            "kill at {hook}: resumed from step {step}, other weights"
        );
        assert_eq!(resumed.1, whole.1);
        std::fs::remove_dir_all(&dir).unwrap();
        if finished {
            break;
        }
        kills += 1;
    }
    assert!(kills > 10);
}

/// A GPU lost in the middle of training (here destroyed, as a driver reset loses it): the next step that
/// reads anything back fails with an error that says the device was lost, promptly, and neither that
/// nor an attempt to save afterwards touches the checkpoint saved before.
#[test]
fn a_lost_device_stops_training_and_leaves_the_checkpoint_as_it_was() {
    if tinygpt_kernels::testing::skip_gpu() {
        return;
    }
    let (cfg, data) = setup();
    let init = Layout::new(&cfg).init(&cfg, SEED);
    let ck = CheckpointConfig {
        model: cfg.clone(),
        vocab: data.vocab.clone(),
        provenance: serde_json::Value::Null,
    };
    let dir = std::env::temp_dir().join(format!("tinygpt-lost-device-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (tx, rx) = std::sync::mpsc::channel();
    let d = dir.clone();
    std::thread::spawn(move || {
        let be = tinygpt_kernels::testing::gpu_backend(None).expect("a GPU");
        let mut tr = Trainer::new(
            &be,
            &cfg,
            BATCH,
            &init,
            None,
            OptimConfig::default(),
            PathSet::F32,
        )
        .unwrap();
        let step = |tr: &mut Trainer, it: usize| -> Result<f32, tinygpt_kernels::Error> {
            let (x, y) = data.batch(false, SEED, it as u64, BATCH, cfg.block_size);
            tr.train_step(&be, &x, &y, 1e-3, SEED as u32)?;
            tr.last_loss(&be)
        };
        for it in 0..3 {
            step(&mut tr, it).unwrap();
        }
        let (p, m, v) = tr.state(&be).unwrap();
        let saved = (p, m, v, tr.step);
        save(&d, &ck, &saved, usize::MAX);
        be.as_gpu().unwrap().destroy_device();
        let lost = step(&mut tr, 3).and_then(|_| tr.state(&be).map(|_| ()));
        let _ = tx.send((lost, saved));
    });
    let (lost, saved) = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("training on a lost device hangs");
    let e = lost.expect_err("training went on after the device was lost");
    assert!(e.to_string().contains("lost"), "unclear error: {e}");
    let l = checkpoint::load(&dir).unwrap();
    assert_eq!(
        l.params, saved.0,
        "the checkpoint saved before the loss changed"
    );
    assert_eq!(l.state.unwrap().step, saved.3);
    std::fs::remove_dir_all(&dir).unwrap();
}
