//! Default locations of the bundled files, found from the working directory or, failing that, from
//! the source tree the binary was built in (so `tinygpt generate` works from anywhere in a clone).

use std::path::{Path, PathBuf};

/// The workspace root this binary was built from.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `rel` under the working directory if it exists there, else under the workspace root.
pub fn bundled(rel: &str) -> PathBuf {
    let here = PathBuf::from(rel);
    if here.exists() {
        return here;
    }
    let there = workspace_root().join(rel);
    if there.exists() { there } else { here }
}

pub const DEFAULT_DATA: &str = "data/shakespeare.txt";
pub const DEFAULT_MODEL: &str = "models/shakespeare-char";

/// The playground's built files: `dir` when given, else web/dist as [`bundled`] finds it.
pub fn web_dir(dir: Option<&Path>) -> PathBuf {
    dir.map_or_else(|| bundled("web/dist"), Path::to_path_buf)
}
