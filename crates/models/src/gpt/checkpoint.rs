//! Checkpoints: the model as safetensors plus a JSON config, and, for resuming, the optimizer state —
//! every file written atomically (temp file in the same directory, fsync, rename), so a crash or a full
//! disk mid-save leaves the previous checkpoint intact.
//!
//! ```text
//!   DIR/config.json          GptConfig + vocabulary + training metadata
//!   DIR/model.safetensors    one tensor per parameter, nanoGPT names, f32 or f16
//!   DIR/optimizer.safetensors  flat "m" and "v" (f32), only in training checkpoints
//!   DIR/train_state.json     step, losses so far, best validation loss
//! ```

use super::config::GptConfig;
use super::data::CharVocab;
use super::layout::Layout;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Why a checkpoint could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The OS's error on a path (said once: it is the message, not a source to repeat).
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{path}: not a valid checkpoint file: {msg}")]
    Invalid { path: PathBuf, msg: String },
    #[error(
        "{path}: tensor {name} has shape {found:?} but this config needs {want:?} (the checkpoint is from another config)"
    )]
    Shape {
        path: PathBuf,
        name: String,
        found: Vec<usize>,
        want: Vec<usize>,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |err| CheckpointError::Io {
        path: path.to_path_buf(),
        err,
    }
}

/// What `config.json` holds.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CheckpointConfig {
    pub model: GptConfig,
    pub vocab: CharVocab,
    /// Where the text came from and how the model was trained (free-form, for people).
    #[serde(default)]
    pub provenance: serde_json::Value,
}

/// Training progress saved beside the weights.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TrainState {
    pub step: u32,
    pub seed: u64,
    pub max_iters: usize,
    /// (iteration, train loss) points.
    pub train_losses: Vec<(usize, f32)>,
    /// (iteration, val loss) points.
    pub val_losses: Vec<(usize, f32)>,
    pub best_val: Option<f32>,
    pub best_iter: Option<usize>,
}

/// Storage precision of the weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    F16,
}

/// Writes `bytes` to `path` atomically: a temp file in the same directory, flushed and synced, then
/// renamed over the target. On error the temp file is removed and the old file is untouched.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("checkpoint");
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(io(path))
}

fn to_bytes(v: &[f32], dtype: WeightDtype) -> Vec<u8> {
    match dtype {
        WeightDtype::F32 => bytemuck_f32(v),
        WeightDtype::F16 => v
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect(),
    }
}

fn bytemuck_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn serialize(
    tensors: Vec<(String, Vec<usize>, Vec<u8>, Dtype)>,
    path: &Path,
) -> Result<Vec<u8>, CheckpointError> {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, shape, b, dt)| {
            TensorView::new(*dt, shape.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| CheckpointError::Invalid {
                    path: path.to_path_buf(),
                    msg: e.to_string(),
                })
        })
        .collect::<Result<_, _>>()?;
    safetensors::serialize(views, None).map_err(|e| CheckpointError::Invalid {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })
}

/// A checkpoint's files as bytes: what [`save`] writes into a directory, and what the web playground
/// downloads (and uploads back).
#[derive(Clone, Debug, Default)]
pub struct CheckpointFiles {
    /// config.json
    pub config: Vec<u8>,
    /// model.safetensors
    pub model: Vec<u8>,
    /// optimizer.safetensors (training checkpoints)
    pub optimizer: Option<Vec<u8>>,
    /// train_state.json
    pub state: Option<Vec<u8>>,
}

impl CheckpointFiles {
    /// (file name, bytes) of every file present.
    pub fn named(&self) -> Vec<(&'static str, &[u8])> {
        let mut v = vec![
            ("config.json", self.config.as_slice()),
            ("model.safetensors", self.model.as_slice()),
        ];
        if let Some(o) = &self.optimizer {
            v.push(("optimizer.safetensors", o));
        }
        if let Some(s) = &self.state {
            v.push(("train_state.json", s));
        }
        v
    }
}

/// The files of a checkpoint of `params` (and optionally the optimizer state and training progress).
pub fn encode(
    config: &CheckpointConfig,
    params: &[f32],
    dtype: WeightDtype,
    optimizer: Option<(&[f32], &[f32])>,
    state: Option<&TrainState>,
) -> Result<CheckpointFiles, CheckpointError> {
    let layout = Layout::new(&config.model);
    let st_dtype = match dtype {
        WeightDtype::F32 => Dtype::F32,
        WeightDtype::F16 => Dtype::F16,
    };
    let tensors = layout
        .entries
        .iter()
        .map(|e| {
            let v = &params[e.offset..e.offset + e.len()];
            (
                e.name.clone(),
                e.shape.clone(),
                to_bytes(v, dtype),
                st_dtype,
            )
        })
        .collect();
    let model = serialize(tensors, Path::new("model.safetensors"))?;
    let optimizer = optimizer
        .map(|(m, v)| {
            let t = vec![
                ("m".to_string(), vec![m.len()], bytemuck_f32(m), Dtype::F32),
                ("v".to_string(), vec![v.len()], bytemuck_f32(v), Dtype::F32),
            ];
            serialize(t, Path::new("optimizer.safetensors"))
        })
        .transpose()?;
    Ok(CheckpointFiles {
        config: serde_json::to_vec_pretty(config).expect("config serializes"),
        model,
        optimizer,
        state: state.map(|s| serde_json::to_vec_pretty(s).expect("train state serializes")),
    })
}

/// The commit record of a save in progress. A save writes every new file to a temp name beside its
/// target and syncs it; then it writes this record (atomically), which from then on says the new
/// checkpoint is complete; then it renames the temp files into place and removes the record. A save
/// killed before the record exists leaves the old checkpoint (and temp files, which the next save or
/// load removes); killed after, the next save or load finishes the renames. Either way the directory
/// holds one whole checkpoint, never a mix of two.
const JOURNAL: &str = ".checkpoint-commit.json";

/// The files a checkpoint directory may hold.
const FILES: [&str; 4] = [
    "config.json",
    "model.safetensors",
    "optimizer.safetensors",
    "train_state.json",
];

#[derive(Debug, Serialize, Deserialize)]
struct Journal {
    /// (temp file, target) pairs, file names inside the directory.
    rename: Vec<(String, String)>,
    /// Files of the old checkpoint that the new one does not have.
    remove: Vec<String>,
}

/// The places where a save can be cut short (each a syscall boundary). Tests stop a save at every one
/// of them in turn, as a kill -9 or a power cut there would, and check what the directory then holds.
pub trait SaveHook {
    /// Called before step `n` of a save (counting from 0); `false` stops the save there, leaving
    /// everything as a killed process would (no clean-up).
    fn proceed(&mut self, n: usize) -> bool;
}

/// The hook of a normal save: every step runs.
struct Always;
impl SaveHook for Always {
    fn proceed(&mut self, _: usize) -> bool {
        true
    }
}

/// Why a save stopped: an I/O error (cleaned up) or the hook (left as a kill leaves it).
enum Stop {
    Io(PathBuf, std::io::Error),
    Killed,
}

struct Steps<'a> {
    hook: &'a mut dyn SaveHook,
    n: usize,
}

impl Steps<'_> {
    /// Runs one step of a save, unless the hook cuts the save short before it.
    fn run<T>(&mut self, path: &Path, f: impl FnOnce() -> std::io::Result<T>) -> Result<T, Stop> {
        let n = self.n;
        self.n += 1;
        if !self.hook.proceed(n) {
            return Err(Stop::Killed);
        }
        f().map_err(|e| Stop::Io(path.to_path_buf(), e))
    }
}

fn tmp_name(name: &str) -> String {
    format!(".{name}.{}.tmp", std::process::id())
}

/// Whether `name` is a temp file a save of this module writes (by any process).
fn is_temp(name: &str) -> bool {
    name.starts_with('.')
        && name.ends_with(".tmp")
        && (FILES.iter().any(|f| name.starts_with(&format!(".{f}.")))
            || name.starts_with(&format!(".{JOURNAL}.")))
}

/// Syncs a directory, so renames in it are on disk (a no-op where directories cannot be opened).
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::fs::File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}

fn read_journal(dir: &Path) -> Result<Option<Journal>, CheckpointError> {
    let p = dir.join(JOURNAL);
    match std::fs::read(&p) {
        Ok(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(|e| CheckpointError::Invalid {
                path: p,
                msg: format!("the record of an unfinished save is unreadable: {e}"),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(&p)(e)),
    }
}

/// Brings `dir` to one whole checkpoint after a save that was cut short: finishes a save that had
/// committed, and removes the temp files of one that had not. A directory without a checkpoint, or
/// one that does not exist, is left as it is.
pub fn recover(dir: &Path) -> Result<(), CheckpointError> {
    if !dir.is_dir() {
        return Ok(());
    }
    if let Some(j) = read_journal(dir)? {
        for (tmp, target) in &j.rename {
            let (t, p) = (dir.join(tmp), dir.join(target));
            if t.exists() {
                std::fs::rename(&t, &p).map_err(io(&p))?;
            }
        }
        for name in &j.remove {
            let p = dir.join(name);
            if p.exists() {
                std::fs::remove_file(&p).map_err(io(&p))?;
            }
        }
        sync_dir(dir).map_err(io(dir))?;
        let p = dir.join(JOURNAL);
        std::fs::remove_file(&p).map_err(io(&p))?;
        sync_dir(dir).map_err(io(dir))?;
    }
    for e in std::fs::read_dir(dir).map_err(io(dir))?.flatten() {
        let name = e.file_name();
        if is_temp(&name.to_string_lossy()) {
            let _ = std::fs::remove_file(e.path());
        }
    }
    Ok(())
}

/// Writes the files of a checkpoint into `dir` (created if missing) so that they switch as a whole.
pub fn write_files(dir: &Path, files: &CheckpointFiles) -> Result<(), CheckpointError> {
    write_files_with(dir, files, &mut Always).map(|_| ())
}

/// [`write_files`], with a hook that can cut the save short at any step (see [`SaveHook`]). Returns
/// `Ok(false)` when the hook stopped it.
pub fn write_files_with(
    dir: &Path,
    files: &CheckpointFiles,
    hook: &mut dyn SaveHook,
) -> Result<bool, CheckpointError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    recover(dir)?;
    let named = files.named();
    let mut steps = Steps { hook, n: 0 };
    let mut written = Vec::new();
    let result = (|| -> Result<(), Stop> {
        for (name, bytes) in &named {
            let tmp = dir.join(tmp_name(name));
            let mut f = steps.run(&tmp, || std::fs::File::create(&tmp))?;
            written.push(tmp.clone());
            steps.run(&tmp, || f.write_all(bytes))?;
            steps.run(&tmp, || f.sync_all())?;
        }
        let journal = Journal {
            rename: named
                .iter()
                .map(|(n, _)| (tmp_name(n), n.to_string()))
                .collect(),
            remove: FILES
                .iter()
                .filter(|f| !named.iter().any(|(n, _)| n == *f) && dir.join(f).exists())
                .map(|f| f.to_string())
                .collect(),
        };
        let jbytes = serde_json::to_vec(&journal).expect("journal serializes");
        let jtmp = dir.join(tmp_name(JOURNAL));
        let mut f = steps.run(&jtmp, || std::fs::File::create(&jtmp))?;
        written.push(jtmp.clone());
        steps.run(&jtmp, || f.write_all(&jbytes))?;
        steps.run(&jtmp, || f.sync_all())?;
        drop(f);
        // The commit point: from here on the new checkpoint is the one in the directory.
        let jp = dir.join(JOURNAL);
        steps.run(&jp, || std::fs::rename(&jtmp, &jp))?;
        written.clear();
        steps.run(dir, || sync_dir(dir))?;
        for (tmp, target) in &journal.rename {
            let (t, p) = (dir.join(tmp), dir.join(target));
            steps.run(&p, || std::fs::rename(&t, &p))?;
        }
        for name in &journal.remove {
            let p = dir.join(name);
            steps.run(&p, || std::fs::remove_file(&p))?;
        }
        steps.run(dir, || sync_dir(dir))?;
        steps.run(&jp, || std::fs::remove_file(&jp))?;
        steps.run(dir, || sync_dir(dir))?;
        Ok(())
    })();
    match result {
        Ok(()) => Ok(true),
        Err(Stop::Killed) => Ok(false),
        Err(Stop::Io(path, source)) => {
            // Before the commit point the old checkpoint stands: remove what this save wrote. After
            // it, the next save or load finishes this one.
            for t in written {
                let _ = std::fs::remove_file(t);
            }
            Err(CheckpointError::Io { path, err: source })
        }
    }
}

/// Saves the model (and optionally the optimizer state and training progress) into `dir`.
pub fn save(
    dir: &Path,
    config: &CheckpointConfig,
    params: &[f32],
    dtype: WeightDtype,
    optimizer: Option<(&[f32], &[f32])>,
    state: Option<&TrainState>,
) -> Result<(), CheckpointError> {
    let files = encode(config, params, dtype, optimizer, state)?;
    write_files(dir, &files)
}

/// A loaded checkpoint.
pub struct Loaded {
    pub config: CheckpointConfig,
    /// Parameters in [`Layout`] order, f32.
    pub params: Vec<f32>,
    /// First and second moments, when the checkpoint has them.
    pub optimizer: Option<(Vec<f32>, Vec<f32>)>,
    pub state: Option<TrainState>,
}

pub(crate) fn read(path: &Path) -> Result<Vec<u8>, CheckpointError> {
    std::fs::read(path).map_err(io(path))
}

pub(crate) fn tensor_f32(path: &Path, view: &TensorView<'_>) -> Result<Vec<f32>, CheckpointError> {
    let d = view.data();
    match view.dtype() {
        Dtype::F32 => Ok(d
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()),
        Dtype::F16 => Ok(d
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect()),
        Dtype::BF16 => Ok(d
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect()),
        other => Err(CheckpointError::Invalid {
            path: path.to_path_buf(),
            msg: format!("tensor type {other:?} is not supported (f32, f16 or bf16)"),
        }),
    }
}

/// Loads a checkpoint directory written by [`save`].
pub fn load(dir: &Path) -> Result<Loaded, CheckpointError> {
    decode(dir, &read_files(dir, true)?)
}

/// The files of the checkpoint in `dir` (the optimizer and training state only `with_training`). A
/// save that committed but was cut short before its renames: the new files are read where they are
/// (the next save finishes the renames; a load changes nothing, so it never races a running save).
fn read_files(dir: &Path, with_training: bool) -> Result<CheckpointFiles, CheckpointError> {
    let journal = read_journal(dir)?;
    // Where the checkpoint's `name` is: its committed temp file, nowhere (the save removes it), or
    // its own name.
    let where_is = |name: &str| -> Option<PathBuf> {
        if let Some(j) = &journal {
            if let Some((tmp, _)) = j.rename.iter().find(|(_, t)| t == name) {
                let t = dir.join(tmp);
                if t.exists() {
                    return Some(t);
                }
            }
            if j.remove.iter().any(|r| r == name) {
                return None;
            }
        }
        Some(dir.join(name))
    };
    let required = |name: &str| -> Result<Vec<u8>, CheckpointError> {
        read(&where_is(name).unwrap_or_else(|| dir.join(name)))
    };
    let optional = |name: &str| -> Result<Option<Vec<u8>>, CheckpointError> {
        match where_is(name) {
            Some(p) if with_training && p.exists() => read(&p).map(Some),
            _ => Ok(None),
        }
    };
    Ok(CheckpointFiles {
        config: required("config.json")?,
        model: required("model.safetensors")?,
        optimizer: optional("optimizer.safetensors")?,
        state: optional("train_state.json")?,
    })
}

/// Loads only what running a model needs (config.json and model.safetensors), so a damaged optimizer
/// or training state never stops `generate` or `eval`. A Hugging Face GPT-2 directory (see
/// [`super::hf`]) loads too.
pub fn load_model(dir: &Path) -> Result<Loaded, CheckpointError> {
    if dir.exists() && !dir.is_dir() {
        return Err(CheckpointError::Io {
            path: dir.to_path_buf(),
            err: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "is a file, not a checkpoint directory (config.json + model.safetensors); \
                 a .gguf model runs with `tinygpt run`",
            ),
        });
    }
    if let Ok(config) = std::fs::read(dir.join("config.json"))
        && super::hf::is_hf_config(&config)
    {
        return super::hf::load_hf(dir);
    }
    decode(dir, &read_files(dir, false)?)
}

/// Reads a checkpoint from its files' bytes (`base` names where they came from, in errors).
pub fn decode(base: &Path, files: &CheckpointFiles) -> Result<Loaded, CheckpointError> {
    let cp = base.join("config.json");
    let config: CheckpointConfig =
        serde_json::from_slice(&files.config).map_err(|e| CheckpointError::Invalid {
            path: cp.clone(),
            msg: e.to_string(),
        })?;
    config
        .model
        .validate()
        .map_err(|msg| CheckpointError::Invalid {
            path: cp.clone(),
            msg,
        })?;
    if config.vocab.len() != config.model.vocab_size {
        return Err(CheckpointError::Invalid {
            path: cp,
            msg: format!(
                "vocabulary has {} characters but the model {}",
                config.vocab.len(),
                config.model.vocab_size
            ),
        });
    }
    if let Some(w) = config.vocab.chars.windows(2).find(|w| w[0] >= w[1]) {
        return Err(CheckpointError::Invalid {
            path: cp,
            msg: format!(
                "the vocabulary is not a sorted list of distinct characters ({:?} before {:?})",
                w[0], w[1]
            ),
        });
    }
    let layout = Layout::new(&config.model);
    let mp = base.join("model.safetensors");
    // Every parameter takes at least two bytes (f16): a config that describes far more than the
    // weights file could hold is refused before its parameters are allocated (smaller mismatches
    // reach the per-tensor shape check, which names the tensor).
    if layout.total > 1 << 24 && (layout.total as u64).saturating_mul(2) > files.model.len() as u64
    {
        return Err(CheckpointError::Invalid {
            path: mp,
            msg: format!(
                "the config describes {} parameters but the file has {} bytes: config.json and the weights disagree",
                layout.total,
                files.model.len()
            ),
        });
    }
    let st = SafeTensors::deserialize(&files.model).map_err(|e| CheckpointError::Invalid {
        path: mp.clone(),
        msg: e.to_string(),
    })?;
    let mut params = vec![0.0f32; layout.total];
    for e in &layout.entries {
        let view = st.tensor(&e.name).map_err(|_| CheckpointError::Invalid {
            path: mp.clone(),
            msg: format!("tensor {} is missing", e.name),
        })?;
        if view.shape() != e.shape.as_slice() {
            return Err(CheckpointError::Shape {
                path: mp.clone(),
                name: e.name.clone(),
                found: view.shape().to_vec(),
                want: e.shape.clone(),
            });
        }
        let values = tensor_f32(&mp, &view)?;
        if let Some(bad) = values.iter().find(|x| !x.is_finite()) {
            return Err(CheckpointError::Invalid {
                path: mp.clone(),
                msg: format!(
                    "tensor {} holds {bad}: the weights are corrupt (or the training that wrote them diverged)",
                    e.name
                ),
            });
        }
        params[e.offset..e.offset + e.len()].copy_from_slice(&values);
    }
    if st.len() != layout.entries.len() {
        let want = tensor_names(&layout);
        let mut extra: Vec<String> = st
            .names()
            .into_iter()
            .filter(|n| !want.contains_key(*n))
            .map(str::to_string)
            .collect();
        extra.sort();
        return Err(CheckpointError::Invalid {
            path: mp,
            msg: format!(
                "it holds tensors the config does not describe ({}; the config says {} layers): config.json and the weights disagree",
                extra.join(", "),
                config.model.n_layer
            ),
        });
    }
    let op = base.join("optimizer.safetensors");
    let optimizer = match &files.optimizer {
        Some(b) => {
            let st = SafeTensors::deserialize(b).map_err(|e| CheckpointError::Invalid {
                path: op.clone(),
                msg: e.to_string(),
            })?;
            let get = |n: &str| -> Result<Vec<f32>, CheckpointError> {
                let v = st.tensor(n).map_err(|_| CheckpointError::Invalid {
                    path: op.clone(),
                    msg: format!("tensor {n} is missing"),
                })?;
                let f = tensor_f32(&op, &v)?;
                if f.len() != layout.total {
                    return Err(CheckpointError::Invalid {
                        path: op.clone(),
                        msg: format!("{n} has {} values; the model has {}", f.len(), layout.total),
                    });
                }
                Ok(f)
            };
            Some((get("m")?, get("v")?))
        }
        None => None,
    };
    let sp = base.join("train_state.json");
    let state = match &files.state {
        Some(b) => Some(
            serde_json::from_slice(b).map_err(|e| CheckpointError::Invalid {
                path: sp.clone(),
                msg: e.to_string(),
            })?,
        ),
        None => None,
    };
    Ok(Loaded {
        config,
        params,
        optimizer,
        state,
    })
}

/// Names of the tensors in a checkpoint (for error messages and tools).
pub fn tensor_names(layout: &Layout) -> HashMap<String, Vec<usize>> {
    layout
        .entries
        .iter()
        .map(|e| (e.name.clone(), e.shape.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> CheckpointConfig {
        CheckpointConfig {
            model: GptConfig {
                vocab_size: 3,
                block_size: 4,
                n_layer: 1,
                n_head: 1,
                n_embd: 4,
                dropout: 0.0,
            },
            vocab: CharVocab::from_text("abc"),
            provenance: serde_json::json!({"text": "test"}),
        }
    }

    #[test]
    fn save_load_round_trips_in_f32_and_f16() {
        let dir = std::env::temp_dir().join(format!("tinygpt-ckpt-{}", std::process::id()));
        let c = cfg();
        let layout = Layout::new(&c.model);
        let p = layout.init(&c.model, 1);
        let m: Vec<f32> = (0..layout.total).map(|i| i as f32).collect();
        let st = TrainState {
            step: 7,
            ..Default::default()
        };
        save(&dir, &c, &p, WeightDtype::F32, Some((&m, &m)), Some(&st)).unwrap();
        let l = load(&dir).unwrap();
        assert_eq!(l.params, p);
        assert_eq!(l.optimizer.unwrap().0, m);
        assert_eq!(l.state.unwrap().step, 7);
        save(&dir, &c, &p, WeightDtype::F16, None, None).unwrap();
        let l = load(&dir).unwrap();
        for (a, b) in l.params.iter().zip(&p) {
            assert!((a - b).abs() <= 1e-3 * b.abs().max(1e-2));
        }
        // No temp files are left behind.
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(left.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn checkpoint_of_another_config_is_refused_by_shape() {
        let dir = std::env::temp_dir().join(format!("tinygpt-ckpt-other-{}", std::process::id()));
        let c = cfg();
        let p = Layout::new(&c.model).init(&c.model, 1);
        save(&dir, &c, &p, WeightDtype::F32, None, None).unwrap();
        // Rewrite the config to claim a wider model.
        let mut other = c.clone();
        other.model.n_embd = 8;
        std::fs::write(dir.join("config.json"), serde_json::to_vec(&other).unwrap()).unwrap();
        assert!(matches!(load(&dir), Err(CheckpointError::Shape { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Stops a save before step `at`.
    struct KillAt(usize);
    impl SaveHook for KillAt {
        fn proceed(&mut self, n: usize) -> bool {
            n < self.0
        }
    }

    fn temp_files(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with('.'))
            .collect()
    }

    #[test]
    fn a_save_killed_at_any_step_leaves_the_old_checkpoint_or_the_new_one() {
        let c = cfg();
        let layout = Layout::new(&c.model);
        let old_p = layout.init(&c.model, 1);
        let old_m: Vec<f32> = vec![0.5; layout.total];
        let old_state = TrainState {
            step: 100,
            ..Default::default()
        };
        // The new checkpoint is of another shape, and without the old one's optimizer state: the
        // hardest switch (nothing of the old one may survive beside the new one).
        let mut c2 = c.clone();
        c2.model.n_embd = 8;
        c2.model.n_head = 2;
        let l2 = Layout::new(&c2.model);
        let new_p = l2.init(&c2.model, 2);
        let new_state = TrainState {
            step: 200,
            ..Default::default()
        };
        let new_files = encode(&c2, &new_p, WeightDtype::F32, None, Some(&new_state)).unwrap();
        let mut saw_old = false;
        let mut saw_new = false;
        for at in 0.. {
            let dir =
                std::env::temp_dir().join(format!("tinygpt-kill-{}-{at}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            save(
                &dir,
                &c,
                &old_p,
                WeightDtype::F32,
                Some((&old_m, &old_m)),
                Some(&old_state),
            )
            .unwrap();
            let finished = write_files_with(&dir, &new_files, &mut KillAt(at)).unwrap();
            // As the next process finds it: a load sees one whole checkpoint...
            let l = load(&dir).unwrap();
            match l.state.as_ref().map(|s| s.step) {
                Some(100) => {
                    assert!(!finished);
                    assert_eq!(l.params, old_p);
                    assert_eq!(l.optimizer.unwrap().0, old_m);
                    saw_old = true;
                }
                Some(200) => {
                    assert_eq!(l.params, new_p);
                    assert!(
                        l.optimizer.is_none(),
                        "the old optimizer state survived (kill at {at})"
                    );
                    saw_new = true;
                }
                other => panic!("kill at step {at}: a mixed checkpoint (state {other:?})"),
            }
            // ...and the next save tidies up what the killed one left, then switches as a whole.
            recover(&dir).unwrap();
            assert!(
                temp_files(&dir).is_empty(),
                "kill at {at}: left {:?}",
                temp_files(&dir)
            );
            assert_eq!(
                load(&dir).unwrap().state.unwrap().step,
                l.state.unwrap().step
            );
            std::fs::remove_dir_all(&dir).unwrap();
            if finished {
                break;
            }
        }
        assert!(saw_old && saw_new);
    }

    #[test]
    fn damaged_weights_and_configs_are_refused_at_load() {
        let dir = std::env::temp_dir().join(format!("tinygpt-ckpt-bad-{}", std::process::id()));
        let c = cfg();
        let layout = Layout::new(&c.model);
        let mut p = layout.init(&c.model, 1);
        p[3] = f32::NAN;
        save(&dir, &c, &p, WeightDtype::F32, None, None).unwrap();
        let e = load(&dir).err().unwrap().to_string();
        assert!(e.contains("NaN") && e.contains("corrupt"), "{e}");
        // A config with fewer layers than the weights hold.
        let mut two = c.clone();
        two.model.n_layer = 2;
        let p2 = Layout::new(&two.model).init(&two.model, 1);
        save(&dir, &two, &p2, WeightDtype::F32, None, None).unwrap();
        std::fs::write(dir.join("config.json"), serde_json::to_vec(&c).unwrap()).unwrap();
        let e = load(&dir).err().unwrap().to_string();
        assert!(e.contains("disagree") && e.contains("h.1."), "{e}");
        // A vocabulary with a duplicate character.
        let mut dup = c.clone();
        dup.vocab.chars = vec!['a', 'a', 'c'];
        std::fs::write(dir.join("config.json"), serde_json::to_vec(&dup).unwrap()).unwrap();
        let e = load(&dir).err().unwrap().to_string();
        assert!(e.contains("distinct"), "{e}");
        // A damaged training state does not stop loading the model to run it.
        save(
            &dir,
            &c,
            &layout.init(&c.model, 1),
            WeightDtype::F32,
            None,
            None,
        )
        .unwrap();
        std::fs::write(dir.join("train_state.json"), b"{ not json").unwrap();
        assert!(load(&dir).is_err());
        assert!(load_model(&dir).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn failed_write_leaves_the_old_file_and_no_temp() {
        let dir = std::env::temp_dir().join(format!("tinygpt-atomic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("x.json");
        write_atomic(&f, b"old").unwrap();
        // Writing into a missing directory fails; the target elsewhere is untouched.
        assert!(write_atomic(&dir.join("missing/x.json"), b"new").is_err());
        assert_eq!(std::fs::read(&f).unwrap(), b"old");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
