//! Safetensors headers, read and checked before any data is touched (see [the module](super)).

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;

use super::regular::open_regular;
use crate::error::{Error, Result};

/// The largest safetensors header read: the format's own limit, 100 MB.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Bytes per element of a safetensors dtype name (`F32`, `BF16`, `I64`, ...), or `None` for a
/// name the format does not have.
pub fn dtype_size(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" => 1,
        "I16" | "U16" | "F16" | "BF16" => 2,
        "I32" | "U32" | "F32" => 4,
        "I64" | "U64" | "F64" => 8,
        _ => return None,
    })
}

/// One tensor of a safetensors header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderTensor {
    /// Its name.
    pub name: String,
    /// Its dtype's safetensors name (`F32`, `BF16`, `I64`, ...).
    pub dtype: String,
    /// Its dimensions.
    pub shape: Vec<usize>,
    /// Its byte range in the data section (after the header).
    pub offsets: (u64, u64),
}

/// The checked header of one safetensors file: its tensors in offset order, the header's length
/// and the file's.
#[derive(Clone, Debug)]
pub struct SafetensorsHeader {
    /// The file, as named in errors.
    pub path: PathBuf,
    /// The tensors, in the order of their bytes in the data section.
    pub tensors: Vec<HeaderTensor>,
    /// The JSON header's length in bytes (after the 8-byte length).
    pub header_len: u64,
    /// The file's length in bytes.
    pub file_len: u64,
}

fn bad(path: &Path, tensor: Option<&str>, reason: impl Into<String>) -> Error {
    Error::ModelFile {
        path: path.to_path_buf(),
        tensor: tensor.map(str::to_string),
        reason: reason.into(),
        source: None,
    }
}

/// A JSON object's entries in the file's order, repeated keys kept (serde_json's map keeps only
/// the last of them).
struct Entries(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Entries, A::Error> {
                let mut out = Vec::new();
                while let Some(entry) = map.next_entry::<String, Value>()? {
                    out.push(entry);
                }
                Ok(Entries(out))
            }
        }
        d.deserialize_map(V)
    }
}

impl SafetensorsHeader {
    /// Reads and checks the header of the safetensors file `path` (a regular file, links
    /// followed): its first 8 bytes and the JSON header they announce, nothing more. A data
    /// section shorter than the header says is allowed here (a header-only file, see
    /// [`is_complete`](Self::is_complete)); bytes beyond it are not.
    pub fn read(path: &Path) -> Result<Self> {
        let (file, meta) = open_regular(path)?;
        let file_len = meta.len();
        let mut f = file;
        let mut len = [0u8; 8];
        f.read_exact(&mut len).map_err(|_| {
            bad(
                path,
                None,
                format!("{file_len} bytes: too short for a safetensors header"),
            )
        })?;
        let n = Self::header_length(path, len, file_len)?;
        let mut header = vec![0u8; n as usize];
        f.read_exact(&mut header).map_err(|e| Error::ModelFile {
            path: path.to_path_buf(),
            tensor: None,
            reason: "could not read its header".into(),
            source: Some(e),
        })?;
        Self::parse_json(path, &header, file_len)
    }

    /// Checks the header of a whole safetensors file held in `bytes` (a mapped file).
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<Self> {
        let file_len = bytes.len() as u64;
        let len: [u8; 8] = bytes
            .get(..8)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| {
                bad(
                    path,
                    None,
                    format!("{file_len} bytes: too short for a safetensors header"),
                )
            })?;
        let n = Self::header_length(path, len, file_len)?;
        let header = bytes.get(8..8 + n as usize).unwrap_or(&[]);
        Self::parse_json(path, header, file_len)
    }

    /// The header length the first 8 bytes announce, checked against the bound and the file.
    fn header_length(path: &Path, len: [u8; 8], file_len: u64) -> Result<u64> {
        let n = u64::from_le_bytes(len);
        if n > MAX_HEADER_BYTES {
            return Err(bad(
                path,
                None,
                format!(
                    "not a safetensors file: its first 8 bytes announce a header of {n} bytes \
                     (the format allows {MAX_HEADER_BYTES})"
                ),
            ));
        }
        if 8 + n > file_len {
            return Err(bad(
                path,
                None,
                format!(
                    "its first 8 bytes announce a header of {n} bytes but the file has \
                     {file_len}: truncated, or not a safetensors file"
                ),
            ));
        }
        Ok(n)
    }

    fn parse_json(path: &Path, header: &[u8], file_len: u64) -> Result<Self> {
        let text = std::str::from_utf8(header)
            .map_err(|e| bad(path, None, format!("the header is not UTF-8: {e}")))?;
        let Entries(entries) = serde_json::from_str(text).map_err(|e| {
            bad(
                path,
                None,
                format!("the header is not a valid JSON object: {e}"),
            )
        })?;
        let mut seen = std::collections::HashSet::new();
        let mut tensors = Vec::with_capacity(entries.len());
        for (name, entry) in entries {
            if !seen.insert(name.clone()) {
                return Err(bad(
                    path,
                    Some(&name),
                    "named twice in the header (two tensors cannot share a name)",
                ));
            }
            if name == "__metadata__" {
                continue;
            }
            tensors.push(Self::entry(path, name, &entry)?);
        }
        tensors.sort_by_key(|t| t.offsets);
        // The tensors tile the data section, in order, without gaps or overlaps.
        let mut end = 0u64;
        for t in &tensors {
            if t.offsets.0 != end {
                return Err(bad(
                    path,
                    Some(&t.name),
                    format!(
                        "starts at byte {} of the data section, expected {end} (a gap or an \
                         overlap)",
                        t.offsets.0
                    ),
                ));
            }
            end = t.offsets.1;
        }
        let header = SafetensorsHeader {
            path: path.to_path_buf(),
            tensors,
            header_len: header.len() as u64,
            file_len,
        };
        let data_end = header.data_end();
        if file_len > data_end {
            return Err(bad(
                path,
                None,
                format!(
                    "{} bytes follow the data section the header describes ({data_end} bytes \
                     in all): not a safetensors file, or a damaged one",
                    file_len - data_end
                ),
            ));
        }
        Ok(header)
    }

    /// One tensor's entry, checked: a known dtype, a shape whose byte size does not overflow and
    /// equals its byte range.
    fn entry(path: &Path, name: String, entry: &Value) -> Result<HeaderTensor> {
        let field = |key: &str| {
            entry.get(key).ok_or_else(|| {
                bad(
                    path,
                    Some(&name),
                    format!("no `{key}` in the tensor's entry"),
                )
            })
        };
        let dtype = field("dtype")?
            .as_str()
            .ok_or_else(|| bad(path, Some(&name), "`dtype` is not a string"))?
            .to_string();
        let size = dtype_size(&dtype)
            .ok_or_else(|| bad(path, Some(&name), format!("unknown dtype `{dtype}`")))?;
        let shape = field("shape")?
            .as_array()
            .and_then(|dims| {
                dims.iter()
                    .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                    .collect::<Option<Vec<usize>>>()
            })
            .ok_or_else(|| {
                bad(
                    path,
                    Some(&name),
                    "`shape` is not a list of non-negative integers",
                )
            })?;
        let offsets = field("data_offsets")?
            .as_array()
            .filter(|o| o.len() == 2)
            .and_then(|o| Some((o[0].as_u64()?, o[1].as_u64()?)))
            .ok_or_else(|| {
                bad(
                    path,
                    Some(&name),
                    "`data_offsets` is not a pair of integers",
                )
            })?;
        let bytes = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
            .and_then(|e| e.checked_mul(size));
        if offsets.1 < offsets.0 || Some(offsets.1 - offsets.0) != bytes {
            return Err(bad(
                path,
                Some(&name),
                format!(
                    "data_offsets {offsets:?} hold {} bytes, but {dtype} {shape:?} needs {}",
                    offsets.1.saturating_sub(offsets.0),
                    bytes.map_or("more than 2^64".to_string(), |w| w.to_string())
                ),
            ));
        }
        Ok(HeaderTensor {
            name,
            dtype,
            shape,
            offsets,
        })
    }

    /// Where the data section ends, as the header describes it.
    pub fn data_end(&self) -> u64 {
        let data = self.tensors.last().map_or(0, |t| t.offsets.1);
        (8 + self.header_len).saturating_add(data)
    }

    /// Whether the file holds every byte the header describes (false: a header-only or
    /// truncated file).
    pub fn is_complete(&self) -> bool {
        self.file_len >= self.data_end()
    }

    /// The first tensor (in file order) whose bytes the file does not hold, for a truncated
    /// file: the tensor, and how many bytes of the data section the file has.
    pub fn first_cut(&self) -> Option<(&HeaderTensor, u64)> {
        let data_len = self.file_len.saturating_sub(8 + self.header_len);
        self.tensors
            .iter()
            .find(|t| t.offsets.1 > data_len)
            .map(|t| (t, data_len))
    }

    /// The tensor named `name`.
    pub fn get(&self, name: &str) -> Option<&HeaderTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(header: &str, data: usize) -> Vec<u8> {
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(header.as_bytes());
        b.extend(std::iter::repeat_n(0u8, data));
        b
    }

    #[test]
    fn headers_are_checked() {
        let p = Path::new("m.safetensors");
        let good =
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"x":"y"}}"#;
        let h = SafetensorsHeader::parse(p, &file(good, 8)).unwrap();
        assert_eq!(h.tensors.len(), 1);
        assert!(h.is_complete());
        let h = SafetensorsHeader::parse(p, &file(good, 4)).unwrap();
        assert_eq!(
            h.first_cut().map(|(t, n)| (t.name.as_str(), n)),
            Some(("a", 4))
        );
        let err = |header: &str, data: usize| {
            SafetensorsHeader::parse(p, &file(header, data))
                .unwrap_err()
                .to_string()
        };
        let twice = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#;
        assert!(err(twice, 16).contains("tensor `a`: named twice"));
        let mis = r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
        let e = err(mis, 8);
        assert!(e.contains("tensor `w`") && e.contains("needs 12"), "{e}");
        let huge = r#"{"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}}"#;
        assert!(err(huge, 8).contains("more than 2^64"));
        assert!(err(good, 9).contains("1 bytes follow"));
        let gap = r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
        assert!(err(gap, 8).contains("a gap or an overlap"));
        let mut junk = u64::MAX.to_le_bytes().to_vec();
        junk.extend_from_slice(b"hello");
        let e = SafetensorsHeader::parse(p, &junk).unwrap_err().to_string();
        assert!(e.contains("not a safetensors file"), "{e}");
    }
}
