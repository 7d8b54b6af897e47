//! The digest of this crate's sources (`TINYGPT_KERNELS_DIGEST`): the numerics gate stores its verdicts
//! under it beside each path's kernel version, so a build whose kernels changed in any way proves them
//! again on the user's device instead of trusting a verdict an earlier build earned (a kernel edited
//! without its version bumped included). Test-only files (`tests.rs`, `testing.rs`) are left out.

use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            sources(&path, out);
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("rs" | "wgsl")
        ) && !matches!(
            path.file_name().and_then(|n| n.to_str()),
            Some("tests.rs" | "testing.rs")
        ) {
            out.push(path);
        }
    }
}

fn main() {
    let root = Path::new("src");
    println!("cargo:rerun-if-changed=src");
    let mut files = Vec::new();
    sources(root, &mut files);
    files.sort();
    let mut h = Sha256::new();
    for f in &files {
        // Paths relative to src/ with '/' separators, so the digest is the same on every host.
        let rel = f.strip_prefix(root).unwrap_or(f);
        let name: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        h.update(name.join("/").as_bytes());
        h.update([0]);
        h.update(std::fs::read(f).unwrap_or_default());
        h.update([0]);
    }
    let digest: String = h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    println!("cargo:rustc-env=TINYGPT_KERNELS_DIGEST={digest}");
}
