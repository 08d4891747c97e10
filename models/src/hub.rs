//! Downloads a model folder from the Hugging Face Hub (`hub` feature), into the Hub's cache.

use std::path::PathBuf;

use crate::error::{Error, Result};

/// Downloads `config.json`, the weights (`model.safetensors`, or the sharded index and every
/// shard it names) and, if the repository has one, `tokenizer.json` of `repo` (`owner/name`) at
/// `revision` (`main` if `None`), and returns the local folder that holds them, ready for
/// `from_pretrained`. The token, cache and endpoint come from the usual `HF_*` variables.
pub fn download(repo: &str, revision: Option<&str>) -> Result<PathBuf> {
    use hf_hub::api::sync::ApiBuilder;
    use hf_hub::{Repo, RepoType};

    let fail = |reason: String| Error::Hub {
        repo: repo.to_string(),
        reason,
    };
    let api = ApiBuilder::from_env()
        .build()
        .map_err(|e| fail(format!("could not set up the client: {e}")))?;
    let revision = revision.unwrap_or("main").to_string();
    let remote = api.repo(Repo::with_revision(
        repo.to_string(),
        RepoType::Model,
        revision,
    ));
    let config = remote
        .get("config.json")
        .map_err(|e| fail(format!("config.json: {e}")))?;
    let folder = config
        .parent()
        .map(PathBuf::from)
        .ok_or_else(|| fail("the cache gave a file without a folder".into()))?;
    match remote.get(accelerate_rs::checkpoint::SINGLE_FILE) {
        Ok(_) => {}
        Err(single) => {
            let index = remote
                .get(accelerate_rs::checkpoint::INDEX_FILE)
                .map_err(|e| {
                    fail(format!(
                        "neither model.safetensors ({single}) nor model.safetensors.index.json \
                         ({e})"
                    ))
                })?;
            let text = std::fs::read_to_string(&index)
                .map_err(|e| fail(format!("{}: {e}", index.display())))?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| fail(format!("{}: not valid JSON: {e}", index.display())))?;
            let mut files: Vec<String> = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .map(|m| {
                    m.values()
                        .filter_map(|v| v.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default();
            files.sort();
            files.dedup();
            for f in files {
                remote.get(&f).map_err(|e| fail(format!("{f}: {e}")))?;
            }
        }
    }
    if let Err(e) = remote.get(crate::tokenizer::TOKENIZER_FILE) {
        log::info!("{repo}: no tokenizer.json downloaded ({e})");
    }
    Ok(folder)
}
