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

/// Bytes of every file under `dir` (links read through), by relative path.
fn contents(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().display().to_string();
                out.insert(rel, fs::read(&p).unwrap());
            }
        }
    }
    out
}

#[test]
fn a_save_replaces_the_folder_whole_and_never_with_non_finite_weights() {
    use std::os::unix::fs::MetadataExt;
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("model");
    users_folder(&out);
    let p = params(0.3, HIDDEN);
    write_model_folder(&out, &p, 1 << 30, Some(&serde_json::json!({"a": 1}))).unwrap();
    // A reader that opened the old weights keeps reading them whole while a new save lands.
    let held = fs::File::open(out.join("model.safetensors")).unwrap();
    let old_weights = fs::read(out.join("model.safetensors")).unwrap();
    let before_ino = fs::metadata(&out).unwrap().ino();
    write_model_folder(&out, &params(0.7, HIDDEN), 1 << 30, None).unwrap();
    // The folder was swapped in one step: a new folder under the same name, the user's files
    // (and subfolders) in it, the earlier config kept.
    assert_ne!(fs::metadata(&out).unwrap().ino(), before_ino);
    users_files_intact(&out);
    assert!(out.join("config.json").is_file());
    let mut old = Vec::new();
    std::io::Read::read_to_end(&mut &held, &mut old).unwrap();
    assert_eq!(old, old_weights);
    no_leftovers(tmp.path());

    // NaN or infinite weights: an error naming the tensor, the folder untouched.
    let snapshot_before = contents(&out);
    let bad = params(0.3, HIDDEN);
    let w = bad[0].1.as_tensor();
    let mut v = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    v[3] = f32::NAN;
    v[5] = f32::INFINITY;
    bad[0]
        .1
        .set(&candle_core::Tensor::from_vec(v, w.shape(), w.device()).unwrap())
        .unwrap();
    for e in [
        write_model_folder(&out, &bad, 1 << 30, None).unwrap_err(),
        single().save_model_sharded(&out, &bad, 600).unwrap_err(),
        save_adapter(&out, &serde_json::json!({"r": 2}), &bad).unwrap_err(),
    ] {
        let msg = e.to_string();
        assert!(msg.contains(&format!("{}`", bad[0].0)), "{msg}");
        assert!(msg.contains("1 NaN and 1 infinite"), "{msg}");
    }
    assert_eq!(contents(&out), snapshot_before);
    no_leftovers(tmp.path());
}

#[test]
fn links_to_folders_are_saved_through_and_dangling_links_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let real = tmp.path().join("real");
    users_folder(&real);
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let p = params(0.3, HIDDEN);
    write_model_folder(&link, &p, 1 << 30, None).unwrap();
    assert!(fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    users_files_intact(&real);
    loads_back(&real, &p);
    no_leftovers(tmp.path());

    let dangling = tmp.path().join("dangling");
    std::os::unix::fs::symlink(tmp.path().join("nowhere"), &dangling).unwrap();
    let msg = write_model_folder(&dangling, &p, 1 << 30, None)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("leads nowhere"), "{msg}");
    assert!(!tmp.path().join("nowhere").exists());
}

#[test]
fn output_folders_are_checked_before_a_run() {
    use accelerate_rs::checkpoint::check_output_dir;
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("base");
    users_folder(&input);
    let refused = |dir: &Path, overwrite: bool, says: &str| {
        let e = check_output_dir(dir, &[&input], overwrite).unwrap_err();
        assert!(
            matches!(&e, Error::OutputFolder { path, .. } if path == dir),
            "{e:?}"
        );
        assert!(e.to_string().contains(says), "{e}");
    };
    // Absent (its parents are created), or empty: fine.
    let new = tmp.path().join("runs/a/out");
    check_output_dir(&new, &[&input], false).unwrap();
    assert!(new.parent().unwrap().is_dir() && !new.exists());
    // The input folder, under any spelling.
    refused(&input, true, "input folder");
    refused(&tmp.path().join("runs/../base"), true, "input folder");
    // A folder with files: refused unless overwrite is asked for.
    let used = tmp.path().join("used");
    users_folder(&used);
    refused(
        &used,
        false,
        "already holds 3 entries (notes.txt, runs, tokenizer.json)",
    );
    check_output_dir(&used, &[&input], true).unwrap();
    users_files_intact(&used);
    // A file; a path under a file; a dangling link.
    let file = tmp.path().join("file");
    fs::write(&file, b"mine").unwrap();
    refused(&file, true, "not a folder");
    refused(&file.join("out"), true, "cannot be created");
    let dangling = tmp.path().join("dangling");
    std::os::unix::fs::symlink(tmp.path().join("nowhere"), &dangling).unwrap();
    refused(&dangling, true, "leads nowhere");
    assert_eq!(fs::read(&file).unwrap(), b"mine");
}
