//! A checkpoint as one file to download and upload: a zip of its files, stored without compression
//! (the weights do not compress), readable by any unzip tool. Reading also takes deflated archives,
//! as a user's zip tool may write them.

use std::io::{Cursor, Read, Write};

use tinygpt_models::gpt::checkpoint::CheckpointFiles;
use zip::write::SimpleFileOptions;

/// The archive of `files`, under a `checkpoint/` folder.
pub fn write(files: &CheckpointFiles) -> Result<Vec<u8>, String> {
    let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
    let opts = SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Stored)
        .large_file(true);
    for (name, bytes) in files.named() {
        w.start_file(format!("checkpoint/{name}"), opts)
            .map_err(|e| e.to_string())?;
        w.write_all(bytes).map_err(|e| e.to_string())?;
    }
    Ok(w.finish().map_err(|e| e.to_string())?.into_inner())
}

/// The checkpoint files inside an archive (at its top or in one folder).
pub fn read(bytes: &[u8]) -> Result<CheckpointFiles, String> {
    let mut z = zip::ZipArchive::new(Cursor::new(bytes)).map_err(|e| {
        format!("not a checkpoint archive (a .zip of config.json and model.safetensors): {e}")
    })?;
    let mut files = CheckpointFiles::default();
    let (mut config, mut model) = (false, false);
    for i in 0..z.len() {
        let mut f = z.by_index(i).map_err(|e| e.to_string())?;
        let name = f.name().rsplit('/').next().unwrap_or("").to_string();
        let mut buf = Vec::new();
        match name.as_str() {
            "config.json" | "model.safetensors" | "optimizer.safetensors" | "train_state.json" => {
                f.read_to_end(&mut buf).map_err(|e| e.to_string())?;
            }
            _ => continue,
        }
        match name.as_str() {
            "config.json" => {
                files.config = buf;
                config = true;
            }
            "model.safetensors" => {
                files.model = buf;
                model = true;
            }
            "optimizer.safetensors" => files.optimizer = Some(buf),
            _ => files.state = Some(buf),
        }
    }
    if !config || !model {
        return Err("the archive lacks config.json or model.safetensors".into());
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_archive_round_trips_and_a_wrong_one_is_refused() {
        let files = CheckpointFiles {
            config: b"{}".to_vec(),
            model: vec![7; 1000],
            optimizer: None,
            state: Some(b"{\"step\": 3}".to_vec()),
        };
        let back = read(&write(&files).unwrap()).unwrap();
        assert_eq!(back.config, files.config);
        assert_eq!(back.model, files.model);
        assert_eq!(back.state, files.state);
        assert!(back.optimizer.is_none());
        assert!(
            read(b"not a zip")
                .unwrap_err()
                .contains("not a checkpoint archive")
        );
    }
}
