//! TinyGPT's own model: a character-level GPT-2-style transformer, trained and sampled with the same
//! code on the CPU and GPU backends.

mod block;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod export;
pub mod hf;
pub mod infer;
pub mod layout;
pub mod train;
pub mod train_gate;

pub use config::GptConfig;
pub use data::{CharVocab, DataError, Dataset};
pub use infer::{GptRunner, GptSequence};
pub use layout::Layout;
pub use train::{OptimConfig, Trainer, learning_rate};
