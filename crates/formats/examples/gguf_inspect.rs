//! Prints a GGUF file's metadata and tensors, and times opening it and converting every tensor to its
//! kernel layout.
//!
//! cargo run --release -p tinygpt-formats --example gguf_inspect -- FILE.gguf [--tensors]

use std::collections::BTreeMap;
use std::time::Instant;

use tinygpt_formats::{GgufFile, MetadataArray, MetadataValue};

fn describe(value: &MetadataValue) -> String {
    match value {
        MetadataValue::String(s) if s.len() > 80 => format!(
            "{:?}... ({} bytes)",
            &s[..s.floor_char_boundary(60)],
            s.len()
        ),
        MetadataValue::String(s) => format!("{s:?}"),
        MetadataValue::Array(a) => describe_array(a),
        other => format!("{other:?}"),
    }
}

fn describe_array(a: &MetadataArray) -> String {
    let head = match a {
        MetadataArray::String(v) => format!("{:?}", &v[..v.len().min(3)]),
        MetadataArray::F32(v) => format!("{:?}", &v[..v.len().min(3)]),
        MetadataArray::I32(v) => format!("{:?}", &v[..v.len().min(3)]),
        MetadataArray::U32(v) => format!("{:?}", &v[..v.len().min(3)]),
        _ => String::new(),
    };
    format!("[{}; {}] {head}", a.type_description(), a.len())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(path) = args.iter().find(|a| !a.starts_with("--")) else {
        eprintln!("usage: gguf_inspect FILE.gguf [--tensors]");
        std::process::exit(2);
    };
    let t = Instant::now();
    let file = GgufFile::open(path)?;
    let open = t.elapsed();
    println!(
        "{path}: GGUF v{}, {} bytes, alignment {}, data at {}, {} metadata keys, {} tensors",
        file.version(),
        file.bytes().len(),
        file.alignment(),
        file.header().data_offset,
        file.metadata().len(),
        file.tensors().len()
    );
    for (key, value) in file.metadata().iter() {
        println!("  {key} = {}", describe(value));
    }
    let mut by_type: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    for info in file.tensors() {
        let e = by_type.entry(info.ggml_type.name()).or_default();
        e.0 += 1;
        e.1 += info.n_elements();
        if args.iter().any(|a| a == "--tensors") {
            println!(
                "  {:<40} {:<5} {:?} at {}",
                info.name,
                info.ggml_type.name(),
                info.dims,
                info.data_start
            );
        }
    }
    for (ty, (n, values)) in &by_type {
        println!("  {ty}: {n} tensors, {values} values");
    }
    let t = Instant::now();
    let mut kernel_bytes = 0;
    for info in file.tensors() {
        kernel_bytes += file.load_matrix(&info.name)?.size_bytes();
    }
    let load = t.elapsed();
    println!(
        "open+parse {:.1} ms; load_matrix of every tensor {:.0} ms ({} MB in kernel layouts)",
        open.as_secs_f64() * 1e3,
        load.as_secs_f64() * 1e3,
        kernel_bytes / 1_000_000
    );
    Ok(())
}
