//! Tests of `model.rs`: safetensors headers, folders and indexes.

use super::*;
use crate::files::dtype_size;

/// A safetensors file of `entries` (name, dtype, shape), with `data` bytes after the
/// header (`None`: all of them).
fn file(
    dir: &Path,
    name: &str,
    entries: &[(&str, &str, Vec<usize>)],
    data: Option<u64>,
) -> PathBuf {
    let mut header = serde_json::Map::new();
    let mut off = 0u64;
    for (n, dtype, shape) in entries {
        let b = shape.iter().product::<usize>() as u64 * dtype_size(dtype).unwrap();
        header.insert(
            n.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + b]}),
        );
        off += b;
    }
    let text = serde_json::to_vec(&Value::Object(header)).unwrap();
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend(text);
    bytes.extend(vec![0u8; data.unwrap_or(off) as usize]);
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn raw(dir: &Path, name: &str, header: &str, data: usize) -> PathBuf {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    bytes.extend(vec![0u8; data]);
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn headers_are_read_with_or_without_their_data() {
    let dir = tempfile::tempdir().unwrap();
    let entries = [
        ("b.weight", "BF16", vec![3, 4]),
        ("a.bias", "F32", vec![4]),
        ("ids", "I64", vec![7]),
    ];
    let full = file(dir.path(), "full.safetensors", &entries, None);
    let (t, header_only) = read_safetensors_header(&full).unwrap();
    assert!(!header_only);
    assert_eq!(t.len(), 3);
    assert_eq!((t[0].name.as_str(), t[0].elem_count()), ("b.weight", 12));
    let spec = ModelSpec::read(&full).unwrap();
    assert_eq!(spec.parameter_count(), 16); // the I64 buffer is not a parameter
    for data in [0, 5] {
        let part = file(dir.path(), "part.safetensors", &entries, Some(data));
        let (t2, header_only) = read_safetensors_header(&part).unwrap();
        assert!(header_only);
        assert_eq!(t2, t);
    }
}

#[test]
fn bad_headers_are_errors_naming_the_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cases: Vec<(PathBuf, &str)> = vec![
        (raw(d, "short.safetensors", "", 0), "not a valid JSON"),
        (
            raw(
                d,
                "dtype.safetensors",
                r#"{"w":{"dtype":"F17","shape":[2],"data_offsets":[0,8]}}"#,
                8,
            ),
            "unknown dtype `F17`",
        ),
        (
            raw(
                d,
                "size.safetensors",
                r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
                8,
            ),
            "needs 12",
        ),
        (
            raw(
                d,
                "gap.safetensors",
                r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
                12,
            ),
            "gap or an overlap",
        ),
        (
            raw(
                d,
                "trail.safetensors",
                r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
                9,
            ),
            "1 bytes follow the data section",
        ),
        (
            raw(
                d,
                "shape.safetensors",
                r#"{"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}"#,
                8,
            ),
            "`shape` is not a list",
        ),
        (
            raw(d, "list.safetensors", "[1, 2]", 0),
            "expected a JSON object",
        ),
    ];
    for (p, want) in cases {
        let e = read_safetensors_header(&p).unwrap_err().to_string();
        assert!(
            e.contains(want) && e.contains(&p.display().to_string()),
            "{e}"
        );
    }
    // A length that runs past the end of the file, and one absurdly large.
    let p = d.join("len.safetensors");
    std::fs::write(&p, [200u8, 0, 0, 0, 0, 0, 0, 0, b'{']).unwrap();
    let e = read_safetensors_header(&p).unwrap_err().to_string();
    assert!(e.contains("truncated"), "{e}");
    std::fs::write(&p, [255u8; 9]).unwrap();
    let e = read_safetensors_header(&p).unwrap_err().to_string();
    assert!(e.contains("not a safetensors file"), "{e}");
    std::fs::write(&p, [1u8, 2]).unwrap();
    let e = read_safetensors_header(&p).unwrap_err().to_string();
    assert!(e.contains("too short"), "{e}");
}

#[test]
fn folders_and_indexes_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Only config.json: nothing to count here (the architecture is read by whoever knows it).
    std::fs::write(d.join("config.json"), r#"{"model_type": "gpt2"}"#).unwrap();
    let e = ModelSpec::read(d).unwrap_err().to_string();
    assert!(e.contains("no safetensors file"), "{e}");
    let e = ModelSpec::read(&d.join("config.json"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("config.json") && e.contains("weight_map"), "{e}");
    // A sharded checkpoint: its tensors.
    file(
        d,
        "s1.safetensors",
        &[("wte.weight", "F32", vec![10, 8])],
        Some(0),
    );
    file(
        d,
        "s2.safetensors",
        &[("h.0.ln_1.weight", "F32", vec![8])],
        None,
    );
    let index = serde_json::json!({"weight_map": {"wte.weight": "s1.safetensors", "h.0.ln_1.weight": "s2.safetensors"}});
    std::fs::write(d.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let spec = ModelSpec::read(d).unwrap();
    assert_eq!(spec.parameter_count(), 88);
    assert_eq!(
        spec.tensors_from,
        TensorSource::Safetensors {
            files: 2,
            header_only: true
        }
    );
    assert!(spec.architecture.is_none());
    let spec = ModelSpec::read(&d.join("model.safetensors.index.json")).unwrap();
    assert_eq!(spec.parameter_count(), 88);
    // An index naming a tensor its shard lacks, or a shard outside the folder.
    let bad = serde_json::json!({"weight_map": {"lm_head.weight": "s1.safetensors"}});
    std::fs::write(d.join("bad.index.json"), bad.to_string()).unwrap();
    let e = ModelSpec::read(&d.join("bad.index.json"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("lm_head.weight") && e.contains("s1.safetensors"),
        "{e}"
    );
    let out = serde_json::json!({"weight_map": {"w": "../w.safetensors"}});
    std::fs::write(d.join("out.index.json"), out.to_string()).unwrap();
    let e = ModelSpec::read(&d.join("out.index.json"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("beside the index"), "{e}");
}
