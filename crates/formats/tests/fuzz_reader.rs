//! Property-based fuzzing of the reader: random, mutated and truncated files must give `Ok` or `Err`,
//! never a panic, and parsing must never allocate more than a small multiple of the input's size (a
//! corrupt length field must not turn into a huge allocation).
//!
//! A counting global allocator measures the peak heap growth while parsing, per thread: the test
//! harness runs tests (and formats their failures) on other threads at the same time, and their
//! allocations must not count against the parse being measured.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::OnceLock;

use proptest::prelude::*;
use tinygpt_formats::{
    GgmlType, GgufHeader, GgufWriter, MetadataArray, dequantize_row, dequantize_tensor, load_matrix,
};

struct CountingAlloc;

thread_local! {
    // Bytes this thread holds (negative when it frees memory another thread allocated), and the peak.
    static CURRENT: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn account(delta: isize) {
    // `try_with`: allocations can happen while a thread's locals are being torn down.
    let _ = CURRENT.try_with(|c| {
        let now = c.get() + delta;
        c.set(now);
        let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
    });
}

// SAFETY: defers to the system allocator; the counters are thread-local cells that never allocate.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            account(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        account(-(layout.size() as isize));
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            account(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Parsed structures may take more memory than their encoding (a `String` is 24 bytes, its encoding
/// at least 8; a metadata entry is also indexed by key), so allow a constant factor over the input size,
/// plus slack for small fixed allocations.
const FACTOR: usize = 16;
const SLACK: usize = 64 * 1024;

/// Runs `f` and returns its result with the peak heap growth of this thread while it ran.
fn measure<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = CURRENT.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let out = f();
    (out, (PEAK.with(Cell::get) - base).max(0) as usize)
}

/// Parses `bytes`, exercises every tensor of a successful parse, and checks the allocation bound.
fn check(bytes: &[u8]) {
    let (parsed, peak) = measure(|| GgufHeader::parse(bytes));
    assert!(
        peak <= FACTOR * bytes.len() + SLACK,
        "parsing {} bytes allocated {peak} bytes at peak",
        bytes.len()
    );
    if let Ok(header) = parsed {
        for info in &header.tensors {
            // Ranges were validated, so slicing cannot fail; conversions may still refuse the type.
            let start = info.data_start as usize;
            let data = &bytes[start..start + info.n_bytes as usize];
            let _ = load_matrix(info, data);
            let _ = dequantize_tensor(info, data);
            let mut row = vec![0.0; info.cols() as usize];
            let _ = dequantize_row(info, data, 0, &mut row);
        }
    }
}

/// Valid files to mutate: assorted metadata and one tensor of each decodable type.
fn seeds() -> &'static [Vec<u8>] {
    static SEEDS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        let mut out = Vec::new();
        for variant in 0..3 {
            let mut w = GgufWriter::new();
            if variant == 1 {
                w.set_alignment(64).unwrap();
            }
            w.add_metadata("general.architecture", "llama").unwrap();
            w.add_metadata("llama.block_count", 2u32).unwrap();
            w.add_metadata(
                "tokenizer.ggml.tokens",
                vec!["<s>".to_string(), "a".into(), "bc".into()],
            )
            .unwrap();
            w.add_metadata("tokenizer.ggml.scores", vec![0.5f32, -1.0, 2.0])
                .unwrap();
            w.add_metadata(
                "nested",
                MetadataArray::Array(vec![
                    MetadataArray::I32(vec![1, -2]),
                    MetadataArray::Bool(vec![true]),
                ]),
            )
            .unwrap();
            if variant == 2 {
                w.add_metadata("f64", 2.5f64).unwrap();
                w.add_metadata("flag", true).unwrap();
            }
            let types = [
                GgmlType::F32,
                GgmlType::F16,
                GgmlType::BF16,
                GgmlType::Q8_0,
                GgmlType::Q4_0,
                GgmlType::Q4_1,
                GgmlType::Q5_0,
                GgmlType::Q4_K,
                GgmlType::Q6_K,
            ];
            for (i, ty) in types.into_iter().enumerate() {
                let cols = ty.block_size().max(8) as u64;
                let values: Vec<f32> = (0..cols * 2).map(|j| (j as f32 * 0.7).cos()).collect();
                w.add_tensor_f32(format!("t{i}"), &[cols, 2], ty, &values)
                    .unwrap();
            }
            out.push(w.to_bytes().unwrap());
        }
        out
    })
}

#[derive(Debug, Clone)]
enum Mutation {
    /// Overwrite one byte.
    Byte(usize, u8),
    /// Overwrite 8 bytes with an extreme u64 (a length, count, dim or offset field hit this way).
    Word(usize, u64),
    /// Cut the file.
    Truncate(usize),
    /// Insert bytes.
    Insert(usize, Vec<u8>),
    /// Remove a range.
    Remove(usize, usize),
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    let n = bytes.len();
    match m {
        Mutation::Byte(at, v) => {
            if n > 0 {
                bytes[at % n] = *v;
            }
        }
        Mutation::Word(at, v) => {
            if n >= 8 {
                let at = at % (n - 7);
                bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
            }
        }
        Mutation::Truncate(len) => bytes.truncate(len % (n + 1)),
        Mutation::Insert(at, extra) => {
            let at = at % (n + 1);
            bytes.splice(at..at, extra.iter().copied());
        }
        Mutation::Remove(at, len) => {
            if n > 0 {
                let at = at % n;
                let end = (at + len).min(n);
                bytes.drain(at..end);
            }
        }
    }
}

fn arb_mutation() -> impl Strategy<Value = Mutation> {
    let extreme = prop_oneof![
        Just(u64::MAX),
        Just(1u64 << 60),
        Just(1u64 << 32),
        Just(i64::MAX as u64),
        Just(0u64),
        Just(13u64),
        any::<u64>(),
    ];
    prop_oneof![
        4 => (any::<usize>(), any::<u8>()).prop_map(|(a, v)| Mutation::Byte(a, v)),
        3 => (any::<usize>(), extreme).prop_map(|(a, v)| Mutation::Word(a, v)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16)).prop_map(|(a, v)| Mutation::Insert(a, v)),
        1 => (any::<usize>(), 1usize..16).prop_map(|(a, l)| Mutation::Remove(a, l)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1500))]

    #[test]
    fn mutated_valid_files_never_panic(
        seed in 0usize..3,
        mutations in prop::collection::vec(arb_mutation(), 1..6),
    ) {
        let mut bytes = seeds()[seed].clone();
        for m in &mutations {
            apply(&mut bytes, m);
        }
        check(&bytes);
    }

    #[test]
    fn random_bytes_after_a_valid_preamble_never_panic(
        version in prop_oneof![Just(2u32), Just(3u32), any::<u32>()],
        tensor_count in prop_oneof![0u64..4, any::<u64>()],
        kv_count in prop_oneof![0u64..4, any::<u64>()],
        body in prop::collection::vec(any::<u8>(), 0..400),
    ) {
        let mut bytes = b"GGUF".to_vec();
        bytes.extend_from_slice(&version.to_le_bytes());
        bytes.extend_from_slice(&tensor_count.to_le_bytes());
        bytes.extend_from_slice(&kv_count.to_le_bytes());
        bytes.extend_from_slice(&body);
        check(&bytes);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        check(&bytes);
    }
}

/// Peak heap growth while parsing `bytes` (which must parse).
fn parse_peak(bytes: &[u8]) -> usize {
    let (header, peak) = measure(|| GgufHeader::parse(bytes).expect("the crafted file parses"));
    drop(header);
    peak
}

fn le(v: u64) -> [u8; 8] {
    v.to_le_bytes()
}

#[test]
fn files_of_many_tiny_records_stay_within_the_factor() {
    // The worst cases for memory per file byte: the smallest possible records, in files large enough
    // that the slack does not matter.
    let n = 60_000u64;
    let key = |i: u64| format!("{:x}", i); // unique keys of 1..4 bytes

    // Many key/value pairs with one-byte values.
    let mut kv = b"GGUF".to_vec();
    kv.extend(3u32.to_le_bytes());
    kv.extend(le(0));
    kv.extend(le(n));
    for i in 0..n {
        let k = key(i);
        kv.extend(le(k.len() as u64));
        kv.extend(k.as_bytes());
        kv.extend(0u32.to_le_bytes()); // u8
        kv.push(7);
    }

    // Arrays of empty strings and of empty arrays.
    let mut arrays = b"GGUF".to_vec();
    arrays.extend(3u32.to_le_bytes());
    arrays.extend(le(0));
    arrays.extend(le(2));
    arrays.extend(le(1));
    arrays.extend(b"s");
    arrays.extend(9u32.to_le_bytes());
    arrays.extend(8u32.to_le_bytes());
    arrays.extend(le(n));
    for _ in 0..n {
        arrays.extend(le(0));
    }
    arrays.extend(le(1));
    arrays.extend(b"a");
    arrays.extend(9u32.to_le_bytes());
    arrays.extend(9u32.to_le_bytes());
    arrays.extend(le(n));
    for _ in 0..n {
        arrays.extend(0u32.to_le_bytes());
        arrays.extend(le(0));
    }

    // Many tensor infos of one F32 value each, all pointing at the same data.
    let mut tensors = b"GGUF".to_vec();
    tensors.extend(3u32.to_le_bytes());
    tensors.extend(le(n));
    tensors.extend(le(0));
    for i in 0..n {
        let k = key(i);
        tensors.extend(le(k.len() as u64));
        tensors.extend(k.as_bytes());
        tensors.extend(1u32.to_le_bytes());
        tensors.extend(le(1));
        tensors.extend(0u32.to_le_bytes());
        tensors.extend(le(0));
    }
    while !tensors.len().is_multiple_of(32) {
        tensors.push(0);
    }
    tensors.extend([0; 4]);

    for (what, bytes) in [
        ("key/values", &kv),
        ("arrays", &arrays),
        ("tensor infos", &tensors),
    ] {
        let peak = parse_peak(bytes);
        let ratio = peak as f64 / bytes.len() as f64;
        eprintln!(
            "{what}: {} bytes parsed with a peak of {peak} bytes ({ratio:.1}x)",
            bytes.len()
        );
        assert!(
            peak <= FACTOR * bytes.len(),
            "{what}: {} bytes took {peak} bytes ({ratio:.1}x)",
            bytes.len()
        );
    }
}

#[test]
fn the_allocation_bound_catches_a_length_driven_allocation() {
    // Guards the guard: a deliberate capacity taken from a "length field" must trip the same check.
    let (v, peak) = measure(|| Vec::<u64>::with_capacity(1 << 20));
    drop(v);
    assert!(
        peak > FACTOR * 1000 + SLACK,
        "a 8 MiB allocation was not counted ({peak})"
    );
}

#[test]
fn the_seeds_are_valid_and_exercise_every_type() {
    for s in seeds() {
        let h = GgufHeader::parse(s).unwrap();
        assert_eq!(h.tensors.len(), 9);
        for info in &h.tensors {
            let start = info.data_start as usize;
            load_matrix(info, &s[start..start + info.n_bytes as usize]).unwrap();
        }
    }
}
