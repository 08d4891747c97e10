//! ZeRO-3 models in checkpoints: the per-rank files of a sharded model
//! (`model.rank-0000R-of-0000N.safetensors`, each rank's pieces named
//! `<parameter>@<first element>`), read back whole into an unsharded model, or, into a sharded
//! model, only the elements this rank keeps (from those files or from a whole
//! `model.safetensors`), whatever the world size that wrote them.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;

use candle_core::{Device, Tensor};

use crate::error::Result;
use crate::train::pieces::ShardedParameters;
use crate::train::weights::{read_piece_overlaps, read_slices, ParamSpec};

use super::io::read_safetensors;
use super::io::{checkpoint_err, corrupt};
use super::manifest::{model_shard_file, Manifest};
use super::names::{MANIFEST_FILE, MODEL_FILE};

/// The model of a checkpoint written by `n` ZeRO-3 ranks, whole: every parameter of the
/// manifest put together from its pieces, which must cover it exactly once.
pub(super) fn read_whole(
    dir: &Path,
    manifest: &Manifest,
    n: usize,
    device: &Device,
) -> Result<HashMap<String, Tensor>> {
    let mpath = dir.join(MANIFEST_FILE);
    if manifest.model_shapes.len() != manifest.parameters.len() {
        return Err(corrupt(
            &mpath,
            format!(
                "it lists {} parameter(s) but {} shape(s)",
                manifest.parameters.len(),
                manifest.model_shapes.len()
            ),
        ));
    }
    let mut pieces: HashMap<String, Vec<(usize, Tensor)>> = HashMap::new();
    for r in 0..n {
        let path = dir.join(model_shard_file(r, n));
        for (key, t) in read_safetensors(&path, device)? {
            let parsed = key
                .rsplit_once('@')
                .and_then(|(name, start)| Some((name, start.parse::<usize>().ok()?)))
                .filter(|(name, _)| manifest.parameters.iter().any(|p| p == name));
            let Some((name, start)) = parsed else {
                return Err(corrupt(
                    &path,
                    format!("tensor `{key}` is not `<parameter>@<first element>` of a parameter the manifest lists"),
                ));
            };
            pieces.entry(name.to_string()).or_default().push((start, t));
        }
    }
    let mut out = HashMap::with_capacity(manifest.parameters.len());
    for (name, shape) in manifest.parameters.iter().zip(&manifest.model_shapes) {
        let total: usize = shape.iter().product();
        let mut list = pieces.remove(name).unwrap_or_default();
        list.sort_by_key(|(start, _)| *start);
        let (mut at, mut flat) = (0, Vec::with_capacity(list.len()));
        for (start, t) in list {
            if start != at || t.rank() != 1 {
                return Err(corrupt(
                    &dir.join(model_shard_file(0, n)),
                    format!("parameter `{name}`: a piece at element {start} does not follow element {at} in the ranks' files"),
                ));
            }
            at += t.elem_count();
            flat.push(t);
        }
        if at != total {
            return Err(corrupt(
                &dir.join(format!("model.rank-*-of-{n:05}.safetensors")),
                format!("parameter `{name}` has {at} of its {total} elements in the ranks' files"),
            ));
        }
        let whole = Tensor::cat(&flat, 0)?.reshape(shape.as_slice())?;
        out.insert(name.clone(), whole);
    }
    Ok(out)
}

/// Into a sharded model: the elements of each parameter this rank keeps, as `(parameter, first
/// element, values)`, read from the checkpoint in `dir` (one whole `model.safetensors`, or the
/// per-rank files of any world size). The checkpoint's parameters must be the model's, with
/// the same shapes; every element this rank keeps must be found exactly once, and finite.
pub(super) fn read_local(
    dir: &Path,
    manifest: &Manifest,
    target: &dyn ShardedParameters,
) -> Result<Vec<(String, usize, Tensor)>> {
    let mut specs = Vec::new();
    for (_, dtype, members) in target.unit_specs() {
        for (name, shape) in members {
            specs.push(ParamSpec { name, shape, dtype });
        }
    }
    let ranges = target.local_ranges();
    let Some(n) = manifest.model_shards else {
        let path = dir.join(MODEL_FILE);
        let keep = |name: &str| Some(name.to_string());
        let mut values = Vec::with_capacity(ranges.len());
        read_slices(&path, &specs, &keep, &ranges, &mut |k, t| {
            values.push((ranges[k].0.clone(), ranges[k].1.start, t));
            Ok(())
        })?;
        return Ok(values);
    };
    check_parameters(dir, manifest, &specs)?;
    let mut want: HashMap<String, Vec<Range<usize>>> = HashMap::new();
    for (name, r) in &ranges {
        want.entry(name.clone()).or_default().push(r.clone());
    }
    let mut got = Vec::new();
    for r in 0..n {
        got.extend(read_piece_overlaps(
            &dir.join(model_shard_file(r, n)),
            &want,
        )?);
    }
    check_covered(dir, n, &ranges, &got)?;
    for (name, _, t) in &got {
        if let Some(what) = crate::train::clip::non_finite(t)? {
            return Err(corrupt(
                &dir.join(format!("model.rank-*-of-{n:05}.safetensors")),
                format!("parameter `{name}` holds {what}"),
            ));
        }
    }
    Ok(got)
}

/// The checkpoint's parameters (names, shapes) against the model's.
fn check_parameters(dir: &Path, manifest: &Manifest, specs: &[ParamSpec]) -> Result<()> {
    let path = dir.join(MANIFEST_FILE);
    let saved: HashMap<&str, &Vec<usize>> = manifest
        .parameters
        .iter()
        .map(String::as_str)
        .zip(&manifest.model_shapes)
        .collect();
    for s in specs {
        match saved.get(s.name.as_str()) {
            None => {
                return Err(checkpoint_err(
                    &path,
                    format!(
                        "parameter `{}` is missing (the model has it, the checkpoint does not)",
                        s.name
                    ),
                ))
            }
            Some(shape) if **shape != s.shape => {
                return Err(checkpoint_err(
                    &path,
                    format!(
                    "parameter `{}` has shape {shape:?} in the checkpoint, but {:?} in the model",
                    s.name, s.shape
                ),
                ))
            }
            Some(_) => {}
        }
    }
    if let Some(extra) = manifest
        .parameters
        .iter()
        .find(|p| !specs.iter().any(|s| &s.name == *p))
    {
        return Err(checkpoint_err(
            &path,
            format!("parameter `{extra}` is in the checkpoint but not in the model"),
        ));
    }
    Ok(())
}

/// Every range this rank keeps covered exactly once by the pieces read.
fn check_covered(
    dir: &Path,
    n: usize,
    ranges: &[(String, Range<usize>)],
    got: &[(String, usize, Tensor)],
) -> Result<()> {
    for (name, r) in ranges {
        let mut parts: Vec<(usize, usize)> = got
            .iter()
            .filter(|(g, start, _)| g == name && *start >= r.start && *start < r.end)
            .map(|(_, start, t)| (*start, t.elem_count()))
            .collect();
        parts.sort();
        let mut at = r.start;
        for (start, len) in parts {
            if start != at {
                break;
            }
            at += len;
        }
        if at != r.end {
            return Err(corrupt(
                &dir.join(format!("model.rank-*-of-{n:05}.safetensors")),
                format!(
                    "parameter `{name}`: elements {at}..{} are not in the ranks' files exactly once",
                    r.end
                ),
            ));
        }
    }
    Ok(())
}
