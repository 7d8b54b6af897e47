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
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
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
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
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

/// Saves the model (and optionally the optimizer state and training progress) into `dir`.
pub fn save(
    dir: &Path,
    config: &CheckpointConfig,
    params: &[f32],
    dtype: WeightDtype,
    optimizer: Option<(&[f32], &[f32])>,
    state: Option<&TrainState>,
) -> Result<(), CheckpointError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let layout = Layout::new(&config.model);
    let st_dtype = match dtype {
        WeightDtype::F32 => Dtype::F32,
        WeightDtype::F16 => Dtype::F16,
    };
    let model_path = dir.join("model.safetensors");
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
    let model = serialize(tensors, &model_path)?;
    if let Some((m, v)) = optimizer {
        let p = dir.join("optimizer.safetensors");
        let t = vec![
            ("m".to_string(), vec![m.len()], bytemuck_f32(m), Dtype::F32),
            ("v".to_string(), vec![v.len()], bytemuck_f32(v), Dtype::F32),
        ];
        let bytes = serialize(t, &p)?;
        write_atomic(&p, &bytes)?;
    }
    if let Some(s) = state {
        let p = dir.join("train_state.json");
        write_atomic(
            &p,
            &serde_json::to_vec_pretty(s).expect("train state serializes"),
        )?;
    }
    write_atomic(&model_path, &model)?;
    let cp = dir.join("config.json");
    write_atomic(
        &cp,
        &serde_json::to_vec_pretty(config).expect("config serializes"),
    )?;
    Ok(())
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

fn read(path: &Path) -> Result<Vec<u8>, CheckpointError> {
    std::fs::read(path).map_err(io(path))
}

fn tensor_f32(path: &Path, view: &TensorView<'_>) -> Result<Vec<f32>, CheckpointError> {
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
    let cp = dir.join("config.json");
    let config: CheckpointConfig =
        serde_json::from_slice(&read(&cp)?).map_err(|e| CheckpointError::Invalid {
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
    let layout = Layout::new(&config.model);
    let mp = dir.join("model.safetensors");
    let bytes = read(&mp)?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| CheckpointError::Invalid {
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
        params[e.offset..e.offset + e.len()].copy_from_slice(&tensor_f32(&mp, &view)?);
    }
    let op = dir.join("optimizer.safetensors");
    let optimizer = if op.exists() {
        let b = read(&op)?;
        let st = SafeTensors::deserialize(&b).map_err(|e| CheckpointError::Invalid {
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
    } else {
        None
    };
    let sp = dir.join("train_state.json");
    let state = if sp.exists() {
        Some(
            serde_json::from_slice(&read(&sp)?).map_err(|e| CheckpointError::Invalid {
                path: sp.clone(),
                msg: e.to_string(),
            })?,
        )
    } else {
        None
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
