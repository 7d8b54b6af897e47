//! Where the gate's verdicts persist between runs: an interface small enough to implement over files
//! (the CLI keeps them in the user's cache directory) or browser storage (the web build). Verdicts are
//! JSON text under string keys that name the adapter, driver, kernel versions and shapes, so a verdict
//! is only ever reused on the device and kernels it was earned on. Nothing leaves the machine.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::{PathReport, TokenOutcome};

/// Persistent verdicts and the local telemetry record.
pub trait VerdictStore {
    /// The verdict stored under `key`, if any.
    fn load(&self, key: &str) -> Option<String>;
    /// Stores `verdict` under `key`, or forgets the key with `None`. A store that cannot write says so
    /// itself (once); the gate carries on, it only gates again next time.
    fn store(&mut self, key: &str, verdict: Option<&str>);
    /// Appends one gating run to the local telemetry.
    fn record(&mut self, record: &GateRecord);
}

/// One gating run, as the telemetry keeps it (and `tinygpt gates --json` prints it).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GateRecord {
    /// Seconds since the Unix epoch.
    pub time_unix: u64,
    pub adapter: String,
    pub driver: String,
    /// What was gated for: a model's key, or "device" for the op gates alone.
    pub subject: String,
    pub gate_ms: f64,
    pub paths: Vec<PathReport>,
    pub token: Option<TokenOutcome>,
}

/// Verdicts kept in memory only: the default for a library user, and the tests' store.
#[derive(Clone, Debug, Default)]
pub struct MemoryStore {
    pub verdicts: HashMap<String, String>,
    pub records: Vec<GateRecord>,
}

impl VerdictStore for MemoryStore {
    fn load(&self, key: &str) -> Option<String> {
        self.verdicts.get(key).cloned()
    }

    fn store(&mut self, key: &str, verdict: Option<&str>) {
        match verdict {
            Some(v) => {
                self.verdicts.insert(key.to_string(), v.to_string());
            }
            None => {
                self.verdicts.remove(key);
            }
        }
    }

    fn record(&mut self, record: &GateRecord) {
        self.records.push(record.clone());
    }
}
