//! Loading a model's weights from safetensors files into its parameters: one `model.safetensors`,
//! or a sharded checkpoint (`model.safetensors.index.json` and the files its `weight_map` names),
//! as Hugging Face tooling and [`save_model_sharded`](crate::Accelerator::save_model_sharded)
//! write them.
//!
//! All or nothing: every file's header is read and every tensor checked against the model (name,
//! shape, dtype family) before any data is read, and every tensor is read and converted before
//! any parameter changes. An error names the file and the tensor.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::safetensors::Load;
use candle_core::{DType, Tensor, Var};
use safetensors::SafeTensors;

use crate::files::SafetensorsHeader;

use crate::error::{Error, Result};
use crate::train::params::Parameters;

/// The single-file checkpoint of a model folder.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint (`weight_map`: tensor name → file).
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// A model folder's Hugging Face configuration.
pub const CONFIG_FILE: &str = "config.json";

fn file_err(path: &Path, tensor: Option<&str>, reason: impl Into<String>) -> Error {
    Error::ModelFile {
        path: path.to_path_buf(),
        tensor: tensor.map(str::to_string),
        reason: reason.into(),
        source: None,
    }
}

fn io_file_err(path: &Path, reason: impl Into<String>, source: std::io::Error) -> Error {
    Error::ModelFile {
        path: path.to_path_buf(),
        tensor: None,
        reason: reason.into(),
        source: Some(source),
    }
}

/// The safetensors files of a model checkpoint, found from a folder, a `.safetensors` file or an
/// index file.
#[derive(Debug, Clone)]
pub struct WeightFiles {
    /// The files, in order.
    files: Vec<PathBuf>,
    /// With a sharded checkpoint: the index file, and each tensor's file (an index into `files`).
    index: Option<(PathBuf, BTreeMap<String, usize>)>,
}

impl WeightFiles {
    /// Finds the weight files at `path`: a folder holding `model.safetensors` (taken first, as
    /// `transformers` does) or `model.safetensors.index.json`, a `.json` index, or a single
    /// safetensors file. An index naming a file that is absent is an error naming the index, the
    /// file and a tensor it should hold; file names in an index may not leave its folder.
    pub fn find(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if path.is_dir() {
            let single = path.join(SINGLE_FILE);
            // Anything at the name, a link to nothing too (a broken download): read, and its
            // error told, rather than the index taken in its place.
            if std::fs::symlink_metadata(&single).is_ok() {
                crate::files::check_regular(&single)?;
                return Ok(WeightFiles {
                    files: vec![single],
                    index: None,
                });
            }
            let index = path.join(INDEX_FILE);
            if index.exists() {
                return Self::from_index(&index);
            }
            return Err(file_err(
                path,
                None,
                format!("the folder holds neither {SINGLE_FILE} nor {INDEX_FILE}"),
            ));
        }
        if !path.is_file() {
            if path.exists() {
                crate::files::check_regular(path)?;
            }
            return Err(file_err(path, None, "no such file or folder"));
        }
        if path.extension().is_some_and(|e| e == "json") {
            return Self::from_index(path);
        }
        Ok(WeightFiles {
            files: vec![path.to_path_buf()],
            index: None,
        })
    }

    fn from_index(index: &Path) -> Result<Self> {
        let json = crate::files::read_json(index)?;
        if json.get("weight_map").is_none() && json.get("model_type").is_some() {
            return Err(file_err(
                index,
                None,
                format!(
                    "this is a model's {CONFIG_FILE}, not a weights index: pass the model's \
                     folder ({})",
                    index.parent().unwrap_or(Path::new(".")).display()
                ),
            ));
        }
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| {
                file_err(
                    index,
                    None,
                    "has no `weight_map` object (tensor name → file name)",
                )
            })?;
        let folder = index.parent().unwrap_or_else(|| Path::new("."));
        let mut files: Vec<PathBuf> = Vec::new();
        let mut by_name: HashMap<String, usize> = HashMap::new();
        let mut tensors = BTreeMap::new();
        for (tensor, file) in map {
            let Some(file) = file.as_str() else {
                return Err(file_err(
                    index,
                    Some(tensor),
                    format!("its file in `weight_map` is {file}, not a file name"),
                ));
            };
            let plain = Path::new(file)
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_)));
            if !plain || file.is_empty() {
                return Err(file_err(
                    index,
                    Some(tensor),
                    format!("its file `{file}` is not a plain file name in the index's folder"),
                ));
            }
            let i = match by_name.get(file) {
                Some(&i) => i,
                None => {
                    let full = folder.join(file);
                    if !full.exists() {
                        return Err(file_err(
                            index,
                            Some(tensor),
                            format!(
                                "the shard `{file}` that should hold it is missing ({} not found)",
                                full.display()
                            ),
                        ));
                    }
                    files.push(full);
                    by_name.insert(file.to_string(), files.len() - 1);
                    files.len() - 1
                }
            };
            tensors.insert(tensor.clone(), i);
        }
        if files.is_empty() {
            return Err(file_err(index, None, "its `weight_map` is empty"));
        }
        Ok(WeightFiles {
            files,
            index: Some((index.to_path_buf(), tensors)),
        })
    }

    /// The safetensors files, in order.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// The index file of a sharded checkpoint.
    pub fn index_file(&self) -> Option<&Path> {
        self.index.as_ref().map(|(p, _)| p.as_path())
    }
}

/// A mapped safetensors file, its header checked.
struct Mapped {
    path: PathBuf,
    mmap: memmap2::Mmap,
}

impl Mapped {
    fn open(path: &Path) -> Result<Self> {
        let (file, _) = crate::files::open_regular(path)?;
        // SAFETY: the map is read-only and lives as long as this value. Another process
        // truncating the file while it is mapped would fault the reader; that is the contract of
        // every memory-mapped checkpoint loader (Candle's `MmapedSafetensors` included), and
        // model files are not modified while a model loads.
        let mmap = unsafe { memmap2::Mmap::map(&file) }
            .map_err(|e| io_file_err(path, "could not map it into memory", e))?;
        Ok(Mapped {
            path: path.to_path_buf(),
            mmap,
        })
    }

    fn tensors(&self) -> Result<SafeTensors<'_>> {
        SafeTensors::deserialize(&self.mmap).map_err(|e| {
            file_err(
                &self.path,
                None,
                format!("not a valid safetensors file: {e}"),
            )
        })
    }
}

/// The checked header of a weight file that must hold every byte it describes: a truncated file
/// is an error naming the first tensor it cuts off.
fn complete_header(path: &Path) -> Result<SafetensorsHeader> {
    let header = SafetensorsHeader::read(path)?;
    if let Some((t, data_len)) = header.first_cut() {
        return Err(file_err(
            path,
            Some(&t.name),
            format!(
                "the file is truncated: this {} tensor {:?} needs bytes {}..{} of the data, \
                 which has only {data_len} ({} bytes in all; an interrupted download or copy?)",
                t.dtype, t.shape, t.offsets.0, t.offsets.1, header.file_len
            ),
        ));
    }
    Ok(header)
}

fn st_dtype_is_float(d: &str) -> bool {
    matches!(d, "F16" | "BF16" | "F32" | "F64")
}

/// Loads the weights at `path` (a folder, a `.safetensors` file or a sharded index; see
/// [`WeightFiles::find`]) into `model`'s parameters (a `candle_nn::VarMap` or any
/// [`Parameters`]), under the same names. Every parameter must be in the files and every tensor
/// of the files must be a parameter, of the same shape; float tensors are converted to the
/// parameter's dtype (a bf16 checkpoint into f32 parameters, or the reverse) and moved to its
/// device. All or nothing: on any error nothing has changed, and the error names the file and
/// the tensor. Memory: the converted tensors are all held until the parameters are set (a
/// second copy of the model, briefly).
///
/// ```
/// # fn main() -> accelerate_rs::Result<()> {
/// use accelerate_rs::checkpoint::{load_weights, write_model_folder};
/// use candle_core::{DType, Device};
/// use candle_nn::{VarBuilder, VarMap};
///
/// let dir = tempfile::tempdir().unwrap();
/// let saved = VarMap::new();
/// candle_nn::linear(4, 2, VarBuilder::from_varmap(&saved, DType::F32, &Device::Cpu).pp("fc"))?;
/// write_model_folder(dir.path().join("model"), &saved, 5 << 30, None)?;
///
/// let fresh = VarMap::new();
/// candle_nn::linear(4, 2, VarBuilder::from_varmap(&fresh, DType::BF16, &Device::Cpu).pp("fc"))?;
/// load_weights(dir.path().join("model"), &fresh)?; // f32 file into bf16 parameters
/// # Ok(()) }
/// ```
pub fn load_weights(path: impl AsRef<Path>, model: &dyn Parameters) -> Result<()> {
    load_weights_mapped(path, model, |name| Some(name.to_string()))
}

/// A parameter as a model will hold it: its name, shape and dtype. What
/// [`check_weights_mapped`] compares weight files with before a model is allocated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSpec {
    /// The parameter's name.
    pub name: String,
    /// Its dimensions.
    pub shape: Vec<usize>,
    /// Its dtype.
    pub dtype: DType,
}

/// [`load_weights`] with the files' tensor names mapped to parameter names: `map(name)` gives
/// the parameter a tensor loads into, or `None` to skip the tensor (a buffer the model does not
/// keep, a head it does not have). Two tensors mapped to one parameter are an error. A tensor
/// holding a NaN or an infinity is an error naming it (one reduction per tensor, on its device).
pub fn load_weights_mapped(
    path: impl AsRef<Path>,
    model: &dyn Parameters,
    map: impl Fn(&str) -> Option<String>,
) -> Result<()> {
    let params: BTreeMap<String, Var> = model.named_parameters().into_iter().collect();
    let specs: Vec<ParamSpec> = params
        .iter()
        .map(|(name, v)| ParamSpec {
            name: name.clone(),
            shape: v.dims().to_vec(),
            dtype: v.dtype(),
        })
        .collect();
    let (found, plan) = plan_load(path.as_ref(), &specs, &map)?;
    let mapped: Vec<Mapped> = found
        .files
        .iter()
        .map(|p| Mapped::open(p))
        .collect::<Result<_>>()?;
    let views: Vec<SafeTensors<'_>> = mapped.iter().map(|m| m.tensors()).collect::<Result<_>>()?;

    // Read, convert and check everything, then set.
    let mut values: Vec<(Var, Tensor)> = Vec::with_capacity(plan.len());
    for (param, i, tensor) in plan {
        let Some(var) = params.get(&param) else {
            continue; // every planned parameter is one of `params`
        };
        let file = &found.files[i];
        let read = || -> candle_core::Result<Tensor> {
            let view = views[i]
                .tensor(&tensor)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            view.load(var.device())?.to_dtype(var.dtype())
        };
        let t =
            read().map_err(|e| file_err(file, Some(&tensor), format!("could not read: {e}")))?;
        if let Some(what) = crate::train::clip::non_finite(&t)? {
            return Err(file_err(
                file,
                Some(&tensor),
                format!(
                    "it holds {what}: a model is never loaded with non-finite weights (a damaged \
                     file, or a model saved after its training diverged)"
                ),
            ));
        }
        values.push((var.clone(), t));
    }
    for (var, t) in values {
        var.set(&t)?;
    }
    Ok(())
}

/// The float dtypes a ZeRO-3 slice is read in, from a header's dtype string.
fn slice_dtype(path: &Path, tensor: &str, dtype: &str) -> Result<safetensors::Dtype> {
    Ok(match dtype {
        "F32" => safetensors::Dtype::F32,
        "F64" => safetensors::Dtype::F64,
        "BF16" => safetensors::Dtype::BF16,
        "F16" => safetensors::Dtype::F16,
        d => {
            return Err(file_err(
                path,
                Some(tensor),
                format!("dtype {d}: a sharded model is read from float tensors"),
            ))
        }
    })
}

/// Elements `range` of the tensor `t` of the file `file` (whose header is `header`), read with
/// one positioned read (no memory map: only the slice is ever resident), as a 1-D CPU tensor
/// in `dtype`, checked finite.
fn read_range(
    file: &std::fs::File,
    header: &SafetensorsHeader,
    t: &crate::files::HeaderTensor,
    range: std::ops::Range<usize>,
    dtype: DType,
) -> Result<Tensor> {
    use std::os::unix::fs::FileExt;
    let path = &header.path;
    let st = slice_dtype(path, &t.name, &t.dtype)?;
    let size = (st.bitsize() / 8) as u64;
    let at = 8 + header.header_len + t.offsets.0 + range.start as u64 * size;
    let mut bytes = vec![0u8; range.len() * size as usize];
    file.read_exact_at(&mut bytes, at)
        .map_err(|e| io_file_err(path, format!("could not read `{}`", t.name), e))?;
    let view = safetensors::tensor::TensorView::new(st, vec![range.len()], &bytes)
        .map_err(|e| file_err(path, Some(&t.name), format!("could not read: {e}")))?;
    let out = view
        .load(&candle_core::Device::Cpu)
        .and_then(|v| v.to_dtype(dtype))
        .map_err(|e| file_err(path, Some(&t.name), format!("could not read: {e}")))?;
    if let Some(what) = crate::train::clip::non_finite(&out)? {
        return Err(file_err(
            path,
            Some(&t.name),
            format!("it holds {what}: a model is never loaded with non-finite weights"),
        ));
    }
    Ok(out)
}

/// ZeRO-3: reads only `wanted` elements of parameters from the weight files at `path` (the
/// checks of [`check_weights_mapped`] first, on the headers) and hands each slice to `sink`
/// (its index in `wanted`, and the values as a 1-D CPU tensor in the parameter's dtype of
/// `params`) as soon as it is read: only one slice is held at a time. A slice holding a NaN
/// or an infinity is an error naming the file and tensor.
pub(crate) fn read_slices(
    path: &Path,
    params: &[ParamSpec],
    map: &dyn Fn(&str) -> Option<String>,
    wanted: &[(String, std::ops::Range<usize>)],
    sink: &mut dyn FnMut(usize, Tensor) -> Result<()>,
) -> Result<()> {
    let (found, plan) = plan_load(path, params, map)?;
    let sources: HashMap<&str, (usize, &str)> = plan
        .iter()
        .map(|(p, i, t)| (p.as_str(), (*i, t.as_str())))
        .collect();
    let dtypes: HashMap<&str, DType> = params.iter().map(|p| (p.name.as_str(), p.dtype)).collect();
    let headers: Vec<SafetensorsHeader> = found
        .files
        .iter()
        .map(|p| complete_header(p))
        .collect::<Result<_>>()?;
    let files: Vec<std::fs::File> = found
        .files
        .iter()
        .map(|p| crate::files::open_regular(p).map(|(f, _)| f))
        .collect::<Result<_>>()?;
    for (k, (param, range)) in wanted.iter().enumerate() {
        let (Some(&(i, tensor)), Some(&dtype)) =
            (sources.get(param.as_str()), dtypes.get(param.as_str()))
        else {
            return Err(Error::invalid(
                format!("parameter `{param}`"),
                "is not among the parameters to load",
            ));
        };
        let Some(t) = headers[i].get(tensor) else {
            return Err(file_err(
                &found.files[i],
                Some(tensor),
                "not in the file's header",
            ));
        };
        let len: usize = t.shape.iter().product();
        if range.end > len {
            return Err(file_err(
                &found.files[i],
                Some(tensor),
                format!("elements {range:?} are outside its {len}"),
            ));
        }
        sink(
            k,
            read_range(&files[i], &headers[i], t, range.clone(), dtype)?,
        )?;
    }
    Ok(())
}

/// ZeRO-3 checkpoints: from the safetensors file `path` of one rank's pieces (tensors named
/// `<parameter>@<first element>`, 1-D), the elements of each piece that fall in `want`
/// (parameter → element ranges), each read with one positioned read: `(parameter, first
/// element, values)`. A tensor name that is not `<name>@<number>` is an error naming the file.
pub(crate) fn read_piece_overlaps(
    path: &Path,
    want: &HashMap<String, Vec<std::ops::Range<usize>>>,
) -> Result<Vec<(String, usize, Tensor)>> {
    let header = complete_header(path)?;
    let (file, _) = crate::files::open_regular(path)?;
    let mut out = Vec::new();
    for t in &header.tensors {
        let parsed = t
            .name
            .rsplit_once('@')
            .and_then(|(name, start)| Some((name, start.parse::<usize>().ok()?)));
        let Some((name, start)) = parsed.filter(|_| t.shape.len() == 1) else {
            return Err(file_err(
                path,
                Some(&t.name),
                "not a 1-D `<parameter>@<first element>` (a ZeRO-3 model shard)",
            ));
        };
        let Some(ranges) = want.get(name) else {
            continue;
        };
        let len = t.shape[0];
        for r in ranges {
            let (lo, hi) = (r.start.max(start), r.end.min(start + len));
            if lo < hi {
                let dtype = match slice_dtype(path, &t.name, &t.dtype)? {
                    safetensors::Dtype::F64 => DType::F64,
                    safetensors::Dtype::BF16 => DType::BF16,
                    safetensors::Dtype::F16 => DType::F16,
                    _ => DType::F32,
                };
                let piece = read_range(&file, &header, t, lo - start..hi - start, dtype)?;
                out.push((name.to_string(), lo, piece));
            }
        }
    }
    Ok(out)
}

/// Checks the weight files at `path` against the parameters a model will have, reading headers
/// only (nothing is allocated for the weights): every parameter in the files under its name
/// after `map` (see [`load_weights_mapped`]), no unexpected tensor, every shape equal, float
/// tensors for float parameters, no file truncated, no tensor named twice. What a model loader
/// calls before it allocates the model, so that a `config.json` claiming sizes its files do not
/// hold is an error naming the tensor rather than an allocation of whatever size it claims.
pub fn check_weights_mapped(
    path: impl AsRef<Path>,
    params: &[ParamSpec],
    map: impl Fn(&str) -> Option<String>,
) -> Result<()> {
    plan_load(path.as_ref(), params, &map).map(drop)
}

/// For each parameter: its name, the file (an index into `WeightFiles::files`) and the tensor.
type LoadPlan = Vec<(String, usize, String)>;

/// The files at `path` and, for each parameter of `params`, the file (an index into
/// `WeightFiles::files`) and tensor it loads from, every check of [`check_weights_mapped`] done
/// on the headers.
fn plan_load(
    path: &Path,
    params: &[ParamSpec],
    map: &dyn Fn(&str) -> Option<String>,
) -> Result<(WeightFiles, LoadPlan)> {
    let found = WeightFiles::find(path)?;
    let headers: Vec<SafetensorsHeader> = found
        .files
        .iter()
        .map(|p| complete_header(p))
        .collect::<Result<_>>()?;
    let sources = tensor_sources(&found, &headers, map)?;
    let params: BTreeMap<&str, &ParamSpec> = params.iter().map(|p| (p.name.as_str(), p)).collect();
    check_coverage(&found, &params, &sources)?;
    let mut plan = Vec::with_capacity(params.len());
    for (name, spec) in &params {
        let Some((i, tensor)) = sources.get(*name) else {
            continue; // reported above
        };
        check_entry(&found.files[*i], &headers[*i], tensor, spec)?;
        plan.push((name.to_string(), *i, tensor.clone()));
    }
    Ok((found, plan))
}

/// Every parameter has a tensor and every tensor a parameter: the first one missing or
/// unexpected is an error naming it, its file and the count.
fn check_coverage(
    found: &WeightFiles,
    params: &BTreeMap<&str, &ParamSpec>,
    sources: &BTreeMap<String, (usize, String)>,
) -> Result<()> {
    let file_list = || {
        found
            .files
            .iter()
            .map(|f| f.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let missing: Vec<&&str> = params
        .keys()
        .filter(|n| !sources.contains_key(**n))
        .collect();
    if let Some(first) = missing.first() {
        let at = found.index_file().unwrap_or(&found.files[0]);
        return Err(file_err(
            at,
            Some(first),
            format!(
                "missing: the model has this parameter, no file holds it ({} missing in all; \
                 files: {})",
                missing.len(),
                file_list()
            ),
        ));
    }
    let unexpected: Vec<(&String, &(usize, String))> = sources
        .iter()
        .filter(|(p, _)| !params.contains_key(p.as_str()))
        .collect();
    if let Some((param, (i, tensor))) = unexpected.first() {
        let renamed = if *param != tensor {
            format!(" (as parameter `{param}`)")
        } else {
            String::new()
        };
        return Err(file_err(
            &found.files[*i],
            Some(tensor),
            format!(
                "unexpected: the file holds this tensor{renamed}, the model has no such \
                 parameter ({} unexpected in all)",
                unexpected.len()
            ),
        ));
    }
    Ok(())
}

/// The header entry of `tensor` in `file` matches `spec`: its shape, and float or not.
fn check_entry(
    file: &Path,
    header: &SafetensorsHeader,
    tensor: &str,
    spec: &ParamSpec,
) -> Result<()> {
    let name = &spec.name;
    let Some(entry) = header.get(tensor) else {
        return Err(file_err(file, Some(tensor), "not in the file's header"));
    };
    if entry.shape != spec.shape {
        return Err(file_err(
            file,
            Some(tensor),
            format!(
                "shape {:?} in the file, but the model's parameter `{name}` is {:?}",
                entry.shape, spec.shape
            ),
        ));
    }
    if st_dtype_is_float(&entry.dtype) != spec.dtype.is_float() {
        return Err(file_err(
            file,
            Some(tensor),
            format!(
                "dtype {} in the file, but the model's parameter `{name}` is {:?}",
                entry.dtype, spec.dtype
            ),
        ));
    }
    Ok(())
}

/// Which file and tensor each parameter comes from (parameter → (file, tensor)), checked
/// against the index of a sharded checkpoint.
fn tensor_sources(
    found: &WeightFiles,
    headers: &[SafetensorsHeader],
    map: &dyn Fn(&str) -> Option<String>,
) -> Result<BTreeMap<String, (usize, String)>> {
    let mut sources: BTreeMap<String, (usize, String)> = BTreeMap::new();
    for (i, header) in headers.iter().enumerate() {
        let file = &found.files[i];
        let mut names: Vec<&str> = header.tensors.iter().map(|t| t.name.as_str()).collect();
        names.sort_unstable();
        for tensor in names {
            if let Some((index, tensors)) = &found.index {
                match tensors.get(tensor) {
                    Some(&j) if j == i => {}
                    Some(&j) => {
                        return Err(file_err(
                            file,
                            Some(tensor),
                            format!(
                                "the tensor is also in this shard, but the index {} puts it in {}",
                                index.display(),
                                found.files[j].display()
                            ),
                        ))
                    }
                    None => {
                        return Err(file_err(
                            file,
                            Some(tensor),
                            format!(
                                "the tensor is in this shard but not in the index {}",
                                index.display()
                            ),
                        ))
                    }
                }
            }
            let Some(param) = map(tensor) else { continue };
            if let Some((j, other)) = sources.get(&param) {
                return Err(file_err(
                    file,
                    Some(tensor),
                    format!(
                        "loads into parameter `{param}`, as `{other}` of {} does",
                        found.files[*j].display()
                    ),
                ));
            }
            sources.insert(param, (i, tensor.to_string()));
        }
    }
    if let Some((index, tensors)) = &found.index {
        for (tensor, &i) in tensors {
            if headers[i].get(tensor).is_none() {
                return Err(file_err(
                    &found.files[i],
                    Some(tensor),
                    format!(
                        "the index {} puts the tensor in this shard, but the shard does not hold it",
                        index.display()
                    ),
                ));
            }
        }
    }
    Ok(sources)
}
