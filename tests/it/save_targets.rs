//! Saving never deletes what it did not write. Model and adapter folders are written into an
//! existing folder, whose other files stay (as with `transformers`' `save_pretrained`); only
//! the weight files of an earlier, differently sharded save there are replaced. A checkpoint
//! replaces its folder whole, so it refuses a folder that is not a checkpoint. A file where a
//! folder belongs, or a folder where a file belongs, is an error naming it and stays as it was.
//! Weight files get the permissions any new file gets.

use std::fs;
use std::path::Path;

use accelerate_rs::checkpoint::{
    load_weights, read_manifest, save_adapter, write_model_folder, CheckpointParts,
};
use accelerate_rs::Error;
use candle_core::Var;

use crate::common::single;
use crate::common::tiny::{max_abs_diff, params, snapshot, HIDDEN};

/// The names in `dir`, sorted (folders end with `/`).
fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let slash = if e.path().is_dir() { "/" } else { "" };
            format!("{}{slash}", e.file_name().to_string_lossy())
        })
        .collect();
    names.sort();
    names
}

/// No `<x>.tmp-<pid>` left in `parent`.
fn no_leftovers(parent: &Path) {
    let left: Vec<_> = names(parent)
        .into_iter()
        .filter(|n| n.contains(".tmp-"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// A folder holding the user's own files: `notes.txt`, `tokenizer.json` and `runs/log.txt`.
fn users_folder(dir: &Path) {
    fs::create_dir_all(dir.join("runs")).unwrap();
    fs::write(dir.join("notes.txt"), b"mine").unwrap();
    fs::write(dir.join("tokenizer.json"), b"{}").unwrap();
    fs::write(dir.join("runs/log.txt"), b"step 1").unwrap();
}

fn users_files_intact(dir: &Path) {
    assert_eq!(fs::read(dir.join("notes.txt")).unwrap(), b"mine");
    assert_eq!(fs::read(dir.join("tokenizer.json")).unwrap(), b"{}");
    assert_eq!(fs::read(dir.join("runs/log.txt")).unwrap(), b"step 1");
}

fn loads_back(dir: &Path, saved: &[(String, Var)]) {
    let fresh = params(9.0, HIDDEN);
    load_weights(dir, &fresh).unwrap();
    let d = max_abs_diff(&snapshot(&fresh), &snapshot(saved));
    assert_eq!(d, 0.0, "{}", dir.display());
}

#[test]
fn a_model_folder_keeps_the_other_files_of_its_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("model");
    users_folder(&out);
    let p = params(0.3, HIDDEN);
    let shards = |dir: &Path| -> Vec<String> {
        names(dir)
            .into_iter()
            .filter(|n| n.starts_with("model-"))
            .collect()
    };

    single().save_model_sharded(&out, &p, 600).unwrap();
    users_files_intact(&out);
    assert!(shards(&out).len() > 1, "{:?}", names(&out));
    assert!(out.join("model.safetensors.index.json").is_file());
    loads_back(&out, &p);

    // Unsharded over it: the shards and their index go, everything else stays.
    let config = serde_json::json!({"model_type": "tiny"});
    let q = params(0.5, HIDDEN);
    single()
        .save_model_with_config(&out, &q, &config, 1 << 30)
        .unwrap();
    users_files_intact(&out);
    assert_eq!(
        names(&out),
        [
            "config.json",
            "model.safetensors",
            "notes.txt",
            "runs/",
            "tokenizer.json"
        ]
    );
    loads_back(&out, &q);

    // Sharded again, by the one-process writer: `model.safetensors` goes.
    write_model_folder(&out, &p, 600, None).unwrap();
    users_files_intact(&out);
    assert!(!out.join("model.safetensors").exists());
    assert!(out.join("config.json").is_file(), "not a weight file: kept");
    loads_back(&out, &p);
    no_leftovers(tmp.path());
}

#[test]
fn an_adapter_folder_keeps_the_other_files_of_its_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("adapter");
    users_folder(&out);
    let config = serde_json::json!({"peft_type": "LORA", "r": 2});
    for v in [0.1, 0.2] {
        save_adapter(&out, &config, &params(v, HIDDEN)).unwrap();
        users_files_intact(&out);
        assert_eq!(
            names(&out),
            [
                "adapter_config.json",
                "adapter_model.safetensors",
                "notes.txt",
                "runs/",
                "tokenizer.json"
            ]
        );
    }
    no_leftovers(tmp.path());
}

#[test]
fn a_file_where_a_folder_belongs_and_the_reverse_are_errors_that_change_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("taken");
    fs::write(&file, b"mine").unwrap();
    let p = params(0.3, HIDDEN);
    let config = serde_json::json!({"r": 2});
    let errors = [
        single().save_model_sharded(&file, &p, 1 << 30).unwrap_err(),
        write_model_folder(&file, &p, 600, None).unwrap_err(),
        save_adapter(&file, &config, &p).unwrap_err(),
    ];
    for e in errors {
        let msg = e.to_string();
        assert!(
            matches!(&e, Error::ModelFile { path, .. } if path == &file),
            "{e:?}"
        );
        assert!(msg.contains("not a folder"), "{msg}");
        assert_eq!(fs::read(&file).unwrap(), b"mine");
    }

    // save_model writes one file: a folder there is an error, and stays as it was.
    let folder = tmp.path().join("folder");
    users_folder(&folder);
    let e = single().save_model(&folder, &p).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(&e, Error::ModelFile { path, .. } if path == &folder),
        "{e:?}"
    );
    assert!(msg.contains("is a folder"), "{msg}");
    users_files_intact(&folder);
    assert_eq!(names(&folder), ["notes.txt", "runs/", "tokenizer.json"]);
    no_leftovers(tmp.path());
}

#[test]
fn a_checkpoint_refuses_a_folder_that_is_not_a_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let acc = single();
    let p = params(0.3, HIDDEN);
    let save = |dir: &Path, step: u64| acc.save_state(dir, &CheckpointParts::new(&p).step(step));
    let refused = |e: Error, dir: &Path, says: &str| {
        let msg = e.to_string();
        assert!(
            matches!(&e, Error::CheckpointWrite { path, .. } if path == dir),
            "{e:?}"
        );
        assert!(msg.contains(says), "{msg}");
    };

    let work = tmp.path().join("work");
    users_folder(&work);
    refused(save(&work, 1).unwrap_err(), &work, "`notes.txt`");
    users_files_intact(&work);
    assert_eq!(names(&work), ["notes.txt", "runs/", "tokenizer.json"]);

    let file = tmp.path().join("file");
    fs::write(&file, b"mine").unwrap();
    refused(save(&file, 1).unwrap_err(), &file, "not a folder");
    assert_eq!(fs::read(&file).unwrap(), b"mine");

    // An empty folder is fine, and a checkpoint replaces the previous one in it.
    let ck = tmp.path().join("ck");
    fs::create_dir(&ck).unwrap();
    save(&ck, 1).unwrap();
    save(&ck, 2).unwrap();
    assert_eq!(read_manifest(&ck).unwrap().step, 2);

    // A folder of the user's named `<dir>.old` is not taken for a stale copy.
    let old = tmp.path().join("ck.old");
    users_folder(&old);
    refused(save(&ck, 3).unwrap_err(), &old, "not a checkpoint");
    users_files_intact(&old);
    assert_eq!(read_manifest(&ck).unwrap().step, 2);
    no_leftovers(tmp.path());
}

#[test]
fn weight_files_get_the_permissions_of_any_new_file() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let probe = tmp.path().join("probe");
    fs::write(&probe, b"").unwrap();
    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let want = mode(&probe);
    let p = params(0.3, HIDDEN);
    let out = tmp.path().join("m");
    single().save_model_sharded(&out, &p, 1 << 30).unwrap();
    let file = tmp.path().join("one.safetensors");
    single().save_model(&file, &p).unwrap();
    for f in [out.join("model.safetensors"), file] {
        assert_eq!(
            mode(&f),
            want,
            "{}: {:o} vs {want:o}",
            f.display(),
            mode(&f)
        );
    }
}
