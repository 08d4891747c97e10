//! Model weights: `save_model` / `save_model_sharded` / `save_model_with_config` and the
//! all-or-nothing loader (`load_model`, `checkpoint::load_weights*`) on single and sharded
//! folders, with dtype conversion and errors that name the file and the tensor.

use std::collections::HashMap;
use std::path::Path;

use accelerate_rs::checkpoint::{load_weights, load_weights_mapped, write_model_folder};
use accelerate_rs::Error;
use candle_core::{DType, Device, Tensor, Var};

use crate::common::single;
use crate::common::tiny::{params, snapshot, HIDDEN};

/// The tiny model's parameters, all set to `v`, in `dtype`.
fn filled(v: f32, dtype: DType) -> Vec<(String, Var)> {
    params(0.0, HIDDEN)
        .into_iter()
        .map(|(n, var)| {
            let t = (var.as_tensor().zeros_like().unwrap() + v as f64)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            (n, Var::from_tensor(&t).unwrap())
        })
        .collect()
}

fn max_diff(a: &HashMap<String, Tensor>, b: &[(String, Var)]) -> f32 {
    b.iter()
        .map(|(n, v)| {
            let x = v.as_tensor().to_dtype(DType::F32).unwrap();
            let y = a[n].to_dtype(DType::F32).unwrap();
            (x - y)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        })
        .fold(0.0, f32::max)
}

/// Saves `p` sharded (one big tensor per shard) into `dir/model`.
fn save_sharded(dir: &Path, p: &[(String, Var)]) -> std::path::PathBuf {
    let out = dir.join("model");
    single().save_model_sharded(&out, &p.to_vec(), 600).unwrap();
    assert!(out.join("model.safetensors.index.json").is_file());
    out
}

/// The message of an error that must be `ModelFile`, checked to name `file` and `tensor`.
fn model_file_err(e: Error, file: &str, tensor: Option<&str>) -> String {
    let msg = e.to_string();
    match &e {
        Error::ModelFile {
            path, tensor: t, ..
        } => {
            assert!(
                path.to_string_lossy().ends_with(file),
                "{msg}: expected the file {file}"
            );
            assert_eq!(t.as_deref(), tensor, "{msg}");
        }
        other => panic!("expected ModelFile, got {other:?}"),
    }
    msg
}

#[test]
fn round_trip_single_and_sharded_with_dtype_conversion() {
    let dir = tempfile::tempdir().unwrap();
    let saved = params(0.3, HIDDEN);
    let reference = snapshot(&saved);
    let sharded = save_sharded(dir.path(), &saved);
    let one = dir.path().join("one");
    single().save_model_sharded(&one, &saved, 1 << 30).unwrap();
    let file = dir.path().join("nested/deeper/plain.safetensors");
    single().save_model(&file, &saved).unwrap(); // creates its folders
    for src in [
        &sharded,
        &one,
        &file,
        &sharded.join("model.safetensors.index.json"),
    ] {
        let fresh = filled(0.0, DType::F32);
        single().load_model(src, &fresh).unwrap();
        assert_eq!(max_diff(&reference, &fresh), 0.0, "{}", src.display());
        // Into bf16 parameters: converted.
        let half = filled(0.0, DType::BF16);
        load_weights(src, &half).unwrap();
        assert!(half.iter().all(|(_, v)| v.dtype() == DType::BF16));
        assert!(max_diff(&reference, &half) < 1e-2, "{}", src.display());
    }
    // A bf16 checkpoint into f32 parameters.
    let bf = filled(0.5, DType::BF16);
    let bf_dir = dir.path().join("bf16");
    single().save_model_sharded(&bf_dir, &bf, 1 << 30).unwrap();
    let fresh = filled(0.0, DType::F32);
    load_weights(&bf_dir, &fresh).unwrap();
    assert_eq!(max_diff(&snapshot(&filled(0.5, DType::F32)), &fresh), 0.0);
}

#[test]
fn save_model_with_config_writes_config_json_beside_the_weights() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("a/b/model");
    let config = serde_json::json!({"model_type": "tiny", "hidden_size": HIDDEN});
    single()
        .save_model_with_config(&out, &params(0.1, HIDDEN), &config, 1 << 30)
        .unwrap();
    let back: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(back, config);
    assert!(out.join("model.safetensors").is_file());
    // The plain writer, on one process.
    let plain = dir.path().join("plain");
    write_model_folder(&plain, &params(0.1, HIDDEN), 600, Some(&config)).unwrap();
    assert!(plain.join("config.json").is_file());
    assert!(plain.join("model.safetensors.index.json").is_file());
}

#[test]
fn save_model_error_names_the_model_file_not_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    // A file where the folder should be: the folder cannot be created.
    let blocker = dir.path().join("blocker");
    std::fs::write(&blocker, b"x").unwrap();
    let e = single()
        .save_model(blocker.join("model.safetensors"), &params(0.1, HIDDEN))
        .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::ModelFile { .. }), "{e:?}");
    assert!(msg.starts_with("model file"), "{msg}");
    assert!(!msg.contains("checkpoint"), "{msg}");
}

#[test]
fn missing_tensor_names_the_file_and_the_tensor_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut saved = params(0.3, HIDDEN);
    saved.retain(|(n, _)| n != "fc2.bias");
    let out = dir.path().join("m");
    single().save_model_sharded(&out, &saved, 1 << 30).unwrap();
    let target = filled(7.0, DType::F32);
    let before = snapshot(&target);
    let e = load_weights(&out, &target).unwrap_err();
    let msg = model_file_err(e, "model.safetensors", Some("fc2.bias"));
    assert!(msg.contains("missing"), "{msg}");
    assert_eq!(max_diff(&before, &target), 0.0);
}

#[test]
fn unexpected_and_mis_shaped_tensors_are_errors_naming_the_shard() {
    let dir = tempfile::tempdir().unwrap();
    let mut saved = params(0.3, HIDDEN);
    saved.push((
        "extra.weight".into(),
        Var::from_tensor(&Tensor::ones((3, 2), DType::F32, &Device::Cpu).unwrap()).unwrap(),
    ));
    let out = save_sharded(dir.path(), &saved);
    let target = filled(7.0, DType::F32);
    let before = snapshot(&target);
    let e = load_weights(&out, &target).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("extra.weight") && msg.contains("unexpected"),
        "{msg}"
    );
    assert!(msg.contains("model-0000"), "{msg}");
    assert_eq!(max_diff(&before, &target), 0.0);
    // The same checkpoint loads when the mapping skips the tensor.
    load_weights_mapped(&out, &target, |n| {
        (n != "extra.weight").then(|| n.to_string())
    })
    .unwrap();
    assert_eq!(max_diff(&snapshot(&params(0.3, HIDDEN)), &target), 0.0);

    // Mis-shaped: fc1.weight is [16, 8] in the model.
    let mut wrong = params(0.3, HIDDEN);
    for (n, v) in wrong.iter_mut() {
        if n == "fc1.weight" {
            *v = Var::from_tensor(&Tensor::ones((8, 16), DType::F32, &Device::Cpu).unwrap())
                .unwrap();
        }
    }
    let out = dir.path().join("wrong");
    single().save_model_sharded(&out, &wrong, 600).unwrap();
    let target = filled(7.0, DType::F32);
    let e = load_weights(&out, &target).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("tensor `fc1.weight`"), "{msg}");
    assert!(msg.contains("[8, 16]") && msg.contains("[16, 8]"), "{msg}");
    assert!(msg.contains("model-0000"), "{msg}");
    assert_eq!(max_diff(&before, &target), 0.0);
}

#[test]
fn truncated_shard_names_the_file_and_the_cut_tensor_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = save_sharded(dir.path(), &params(0.3, HIDDEN));
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let shard = index["weight_map"]["fc1.weight"]
        .as_str()
        .unwrap()
        .to_string();
    let path = out.join(&shard);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
    let target = filled(7.0, DType::F32);
    let before = snapshot(&target);
    let e = load_weights(&out, &target).unwrap_err();
    // The tensor named is the shard's last one (the one the cut reaches into).
    let cut = match &e {
        Error::ModelFile { tensor, .. } => tensor.clone().unwrap(),
        other => panic!("{other:?}"),
    };
    assert_eq!(index["weight_map"][&cut].as_str(), Some(shard.as_str()));
    let msg = model_file_err(e, &shard, Some(&cut));
    assert!(msg.contains("truncated"), "{msg}");
    assert_eq!(max_diff(&before, &target), 0.0);
}

#[test]
fn shard_named_in_the_index_but_absent_is_an_error_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let out = save_sharded(dir.path(), &params(0.3, HIDDEN));
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let shard = index["weight_map"]["fc2.weight"]
        .as_str()
        .unwrap()
        .to_string();
    std::fs::remove_file(out.join(&shard)).unwrap();
    let target = filled(7.0, DType::F32);
    let e = load_weights(&out, &target).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains(&shard) && msg.contains("missing"), "{msg}");
    match e {
        Error::ModelFile { path, tensor, .. } => {
            assert!(path.ends_with("model.safetensors.index.json"), "{msg}");
            assert!(tensor.is_some(), "{msg}");
        }
        other => panic!("{other:?}"),
    }
    // A folder with no weights at all.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let msg = load_weights(&empty, &target).unwrap_err().to_string();
    assert!(msg.contains("model.safetensors"), "{msg}");
}

/// A `model.safetensors` link that leads nowhere (a broken download into a cache's `blobs/`),
/// beside a sound index, is an error naming it: before, the folder's index was loaded in its
/// place without a word.
#[test]
fn a_single_file_link_to_nothing_is_named_not_passed_over_for_the_index() {
    let dir = tempfile::tempdir().unwrap();
    let out = save_sharded(dir.path(), &params(0.3, HIDDEN));
    std::os::unix::fs::symlink(dir.path().join("blobs/gone"), out.join("model.safetensors"))
        .unwrap();
    let msg = load_weights(&out, &filled(7.0, DType::F32))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("model.safetensors") && msg.contains("does not exist"),
        "{msg}"
    );
}

#[test]
fn an_index_may_not_point_outside_its_folder() {
    let dir = tempfile::tempdir().unwrap();
    let out = save_sharded(dir.path(), &params(0.3, HIDDEN));
    let path = out.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replacen("model-00001", "../model-00001", 1);
    std::fs::write(&path, text).unwrap();
    let msg = load_weights(&out, &filled(0.0, DType::F32))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("not a plain file name"), "{msg}");
}

/// A safetensors file of raw `header` JSON followed by `data` zero bytes.
fn raw_file(path: &Path, header: &str, data: usize) {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.extend(std::iter::repeat_n(0u8, data));
    std::fs::write(path, b).unwrap();
}

#[test]
fn hostile_headers_and_values_are_errors_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let model = vec![(
        "w".to_string(),
        Var::from_tensor(&Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap()).unwrap(),
    )];
    let file = dir.path().join("m.safetensors");
    let name = file.display().to_string();
    // Two tensors of one name: the JSON object keeps only the last; refused.
    raw_file(
        &file,
        r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#,
        16,
    );
    let msg = model_file_err(load_weights(&file, &model).unwrap_err(), &name, Some("w"));
    assert!(msg.contains("named twice"), "{msg}");
    // A shape that its bytes do not match: named.
    raw_file(
        &file,
        r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
        8,
    );
    let msg = model_file_err(load_weights(&file, &model).unwrap_err(), &name, Some("w"));
    assert!(msg.contains("needs 12"), "{msg}");
    // NaN and infinite weights: refused, the model unchanged.
    let bad: HashMap<String, Tensor> = [(
        "w".to_string(),
        Tensor::new(&[f32::NAN, f32::NEG_INFINITY], &Device::Cpu).unwrap(),
    )]
    .into_iter()
    .collect();
    candle_core::safetensors::save(&bad, &file).unwrap();
    let msg = model_file_err(load_weights(&file, &model).unwrap_err(), &name, Some("w"));
    assert!(msg.contains("1 NaN and 1 infinite values of 2"), "{msg}");
    assert_eq!(model[0].1.as_tensor().to_vec1::<f32>().unwrap(), [0.0, 0.0]);
    // Not a regular file: a FIFO is refused without blocking, a device without reading it.
    let fifo = dir.path().join("fifo.safetensors");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let msg = load_weights(&fifo, &model).unwrap_err().to_string();
    assert!(msg.contains("FIFO"), "{msg}");
    let msg = load_weights(Path::new("/dev/zero"), &model)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("character device"), "{msg}");
    // A model's config.json given as the weights: said so.
    let config = dir.path().join("config.json");
    std::fs::write(&config, r#"{"model_type": "llama"}"#).unwrap();
    let msg = load_weights(&config, &model).unwrap_err().to_string();
    assert!(msg.contains("pass the model's folder"), "{msg}");
}
