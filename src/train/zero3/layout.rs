//! ZeRO-3's arithmetic, and nothing else: which unit each parameter belongs to
//! ([`WrapPolicy`]), where it lies in its unit's flat vector ([`UnitLayout`]), and which part of
//! it each rank owns ([`Piece`]). A unit's parameters, in name order, are laid end to end in one
//! flat vector of `len` elements; rank `r` of `n` owns elements
//! [`chunk_range`]`(len, n, r)` of it, its *shard*.

use std::ops::Range;

use candle_core::DType;

use crate::collective::chunk_range;
use crate::error::{Error, Result};
use crate::train::weights::ParamSpec;

/// How a model is cut into ZeRO-3 units (FSDP's auto-wrap policy, by variable name): each
/// prefix is a unit holding the parameters whose names are the prefix or start with
/// `prefix.` (the longest matching prefix wins); the parameters no prefix matches form one more
/// unit, the *root* (named `""`). [`one_unit`](Self::one_unit) makes the whole model one unit.
///
/// ```
/// use accelerate_rs::WrapPolicy;
/// // Each decoder layer a unit; the embeddings and the head in the root unit.
/// let policy = WrapPolicy::prefixes((0..4).map(|i| format!("model.layers.{i}")));
/// assert_eq!(policy.unit_of("model.layers.2.mlp.up_proj.weight"), Some("model.layers.2"));
/// assert_eq!(policy.unit_of("lm_head.weight"), None); // the root unit
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WrapPolicy {
    prefixes: Vec<String>,
}

impl WrapPolicy {
    /// The whole model as one unit (every parameter in the root unit).
    pub fn one_unit() -> Self {
        WrapPolicy::default()
    }

    /// One unit per prefix, in the order given, plus the root unit for the rest.
    pub fn prefixes<I, S>(prefixes: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        WrapPolicy {
            prefixes: prefixes.into_iter().map(Into::into).collect(),
        }
    }

    /// The prefixes, in order.
    pub fn units(&self) -> &[String] {
        &self.prefixes
    }

    /// The prefix whose unit holds parameter `name` (the longest that matches), or `None` for
    /// the root unit.
    pub fn unit_of(&self, name: &str) -> Option<&str> {
        self.index_of(name).map(|i| self.prefixes[i].as_str())
    }

    fn index_of(&self, name: &str) -> Option<usize> {
        self.prefixes
            .iter()
            .enumerate()
            .filter(|(_, p)| {
                name == p.as_str()
                    || (name.len() > p.len() && name.starts_with(p.as_str()))
                        && name.as_bytes()[p.len()] == b'.'
            })
            .max_by_key(|(_, p)| p.len())
            .map(|(i, _)| i)
    }
}

/// One parameter inside its unit's flat vector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Member {
    /// The parameter's name.
    pub(crate) name: String,
    /// Its dimensions.
    pub(crate) shape: Vec<usize>,
    /// Its first element in the unit's flat vector.
    pub(crate) offset: usize,
    /// Its number of elements.
    pub(crate) len: usize,
}

/// The part of one parameter a rank owns: elements `in_param` of the flattened parameter,
/// which are elements `in_shard` of that rank's shard of the unit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    /// Index of the parameter among its unit's members.
    pub(crate) member: usize,
    /// Elements of the flattened parameter.
    pub(crate) in_param: Range<usize>,
    /// The same elements, in the rank's shard.
    pub(crate) in_shard: Range<usize>,
}

/// One unit: its name (a prefix of the policy, or `""` for the root), dtype and members.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct UnitLayout {
    /// The unit's name.
    pub(crate) name: String,
    /// The dtype of every member.
    pub(crate) dtype: DType,
    /// Its parameters, in name order, end to end.
    pub(crate) members: Vec<Member>,
    /// Elements of the flat vector.
    pub(crate) len: usize,
}

impl UnitLayout {
    /// The elements of the flat vector rank `rank` of `world` owns.
    pub(crate) fn own(&self, world: usize, rank: usize) -> Range<usize> {
        chunk_range(self.len, world, rank)
    }

    /// The parts of the members that rank `rank` of `world` owns, in order.
    pub(crate) fn pieces(&self, world: usize, rank: usize) -> Vec<Piece> {
        let own = self.own(world, rank);
        self.members
            .iter()
            .enumerate()
            .filter_map(|(i, m)| {
                let (lo, hi) = (own.start.max(m.offset), own.end.min(m.offset + m.len));
                (lo < hi).then(|| Piece {
                    member: i,
                    in_param: lo - m.offset..hi - m.offset,
                    in_shard: lo - own.start..hi - own.start,
                })
            })
            .collect()
    }

    /// The member named `name`, if the unit holds it.
    pub(crate) fn member(&self, name: &str) -> Option<usize> {
        self.members.iter().position(|m| m.name == name)
    }
}

/// Every unit of a model, in the policy's order, the root unit last (when it holds anything).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ShardLayout {
    pub(crate) units: Vec<UnitLayout>,
}

impl ShardLayout {
    /// Cuts `specs` into units by `policy`. Errors name the parameter: a name used twice, a
    /// non-float parameter, a unit mixing dtypes, a prefix matching no parameter, a size that
    /// does not fit in memory's address space.
    pub(crate) fn new(specs: &[ParamSpec], policy: &WrapPolicy) -> Result<Self> {
        let mut sorted: Vec<&ParamSpec> = specs.iter().collect();
        sorted.sort_by(|a, b| a.name.cmp(&b.name));
        if let Some(w) = sorted.windows(2).find(|w| w[0].name == w[1].name) {
            return Err(Error::invalid(
                "model parameters",
                format!("the name `{}` is used twice", w[0].name),
            ));
        }
        let n = policy.prefixes.len();
        let mut groups: Vec<Vec<&ParamSpec>> = vec![Vec::new(); n + 1];
        for spec in sorted {
            if !spec.dtype.is_float() {
                return Err(Error::invalid(
                    "zero_stage",
                    format!(
                        "stage 3 shards float parameters; `{}` is {:?}",
                        spec.name, spec.dtype
                    ),
                ));
            }
            groups[policy.index_of(&spec.name).unwrap_or(n)].push(spec);
        }
        let mut units = Vec::with_capacity(n + 1);
        for (i, group) in groups.into_iter().enumerate() {
            let name = policy.prefixes.get(i).cloned().unwrap_or_default();
            if group.is_empty() {
                if i < n {
                    return Err(Error::invalid(
                        "wrap policy",
                        format!("the unit `{name}` matches no parameter of the model"),
                    ));
                }
                continue;
            }
            units.push(unit(name, &group)?);
        }
        Ok(ShardLayout { units })
    }

    /// The unit named `name`.
    pub(crate) fn unit_index(&self, name: &str) -> Result<usize> {
        self.units
            .iter()
            .position(|u| u.name == name)
            .ok_or_else(|| {
                let names: Vec<String> =
                    self.units.iter().map(|u| format!("`{}`", u.name)).collect();
                Error::invalid(
                    format!("ZeRO-3 unit `{name}`"),
                    format!(
                        "the model has no such unit (its units: {})",
                        names.join(", ")
                    ),
                )
            })
    }

    /// `(unit, member)` of parameter `name`.
    pub(crate) fn find(&self, name: &str) -> Option<(usize, usize)> {
        self.units
            .iter()
            .enumerate()
            .find_map(|(u, unit)| unit.member(name).map(|m| (u, m)))
    }

    /// Every parameter, in name order: `(name, shape, dtype)`.
    pub(crate) fn specs(&self) -> Vec<ParamSpec> {
        let mut out: Vec<ParamSpec> = self
            .units
            .iter()
            .flat_map(|u| {
                u.members.iter().map(|m| ParamSpec {
                    name: m.name.clone(),
                    shape: m.shape.clone(),
                    dtype: u.dtype,
                })
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }
}

/// One unit from its (name-ordered, non-empty) parameters.
fn unit(name: String, group: &[&ParamSpec]) -> Result<UnitLayout> {
    let dtype = group[0].dtype;
    if let Some(other) = group.iter().find(|s| s.dtype != dtype) {
        return Err(Error::invalid(
            format!("ZeRO-3 unit `{name}`"),
            format!(
                "mixes dtypes: `{}` is {dtype:?}, `{}` {:?} (a unit is one flat vector of one dtype: cut it with the wrap policy)",
                group[0].name, other.name, other.dtype
            ),
        ));
    }
    let mut members = Vec::with_capacity(group.len());
    let mut offset = 0usize;
    for spec in group {
        let len = spec
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .filter(|&l| offset.checked_add(l).is_some())
            .ok_or_else(|| {
                Error::invalid(
                    format!("parameter `{}`", spec.name),
                    format!(
                        "its shape {:?} has more elements than memory can address",
                        spec.shape
                    ),
                )
            })?;
        members.push(Member {
            name: spec.name.clone(),
            shape: spec.shape.clone(),
            offset,
            len,
        });
        offset += len;
    }
    Ok(UnitLayout {
        name,
        dtype,
        members,
        len: offset,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, shape: &[usize]) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
            dtype: DType::F32,
        }
    }

    #[test]
    fn units_by_longest_prefix_and_the_root_last() {
        let specs = [
            spec("head.weight", &[3, 2]),
            spec("layers.1.w", &[2, 2]),
            spec("layers.10.w", &[5]),
            spec("layers.1.b", &[2]),
        ];
        let policy = WrapPolicy::prefixes(["layers.1", "layers.10"]);
        let l = ShardLayout::new(&specs, &policy).unwrap();
        let names: Vec<&str> = l.units.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names, ["layers.1", "layers.10", ""]);
        assert_eq!(l.units[0].members[0].name, "layers.1.b");
        assert_eq!(l.units[0].members[1].offset, 2);
        assert_eq!(l.units[0].len, 6);
        assert_eq!(l.find("layers.10.w"), Some((1, 0)));
        assert_eq!(policy.unit_of("layers.100.w"), None);
        assert_eq!(policy.unit_of("layers.1"), Some("layers.1"));
    }

    #[test]
    fn the_ranks_pieces_tile_every_parameter_once() {
        let specs = [spec("a", &[7]), spec("b", &[3, 3]), spec("c", &[1])];
        let l = ShardLayout::new(&specs, &WrapPolicy::one_unit()).unwrap();
        let u = &l.units[0];
        for world in 1..=6 {
            let mut covered = vec![vec![0u8; 9]; 3];
            for rank in 0..world {
                let own = u.own(world, rank);
                for p in u.pieces(world, rank) {
                    assert_eq!(p.in_param.len(), p.in_shard.len());
                    assert!(p.in_shard.end <= own.len());
                    for e in p.in_param {
                        covered[p.member][e] += 1;
                    }
                }
            }
            for (m, member) in u.members.iter().enumerate() {
                assert!(
                    covered[m][..member.len].iter().all(|&c| c == 1),
                    "world {world}"
                );
            }
        }
    }

    #[test]
    fn bad_layouts_are_named() {
        let e = ShardLayout::new(&[spec("a", &[1])], &WrapPolicy::prefixes(["b"]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`b`") && e.contains("matches no parameter"),
            "{e}"
        );
        let mut half = spec("a.y", &[2]);
        half.dtype = DType::BF16;
        let e = ShardLayout::new(&[spec("a.x", &[2]), half], &WrapPolicy::prefixes(["a"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("mixes dtypes") && e.contains("a.y"), "{e}");
        let mut int = spec("i", &[2]);
        int.dtype = DType::U32;
        let e = ShardLayout::new(&[int], &WrapPolicy::one_unit())
            .unwrap_err()
            .to_string();
        assert!(e.contains("`i`") && e.contains("U32"), "{e}");
        let l = ShardLayout::new(&[spec("a", &[1])], &WrapPolicy::one_unit()).unwrap();
        let e = l.unit_index("x").unwrap_err().to_string();
        assert!(e.contains("`x`") && e.contains("``"), "{e}");
    }
}
