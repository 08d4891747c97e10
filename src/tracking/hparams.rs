//! [`HParams`]: a run's settings and hyperparameters, recorded once by the trackers
//! ([`Trackers::log_hparams`](super::Trackers::log_hparams)): a JSON Lines record, TensorBoard's
//! hparams plugin format.

use crate::settings::ProcessState;

/// One hyperparameter value: a number, a string or a flag.
#[derive(Clone, Debug, PartialEq)]
pub enum HParamValue {
    /// A number (integers too, as TensorBoard stores them).
    Number(f64),
    /// A string.
    Text(String),
    /// A flag.
    Bool(bool),
}

macro_rules! number_from {
    ($($t:ty),*) => {$(
        impl From<$t> for HParamValue {
            fn from(v: $t) -> Self {
                HParamValue::Number(v as f64)
            }
        }
    )*};
}
number_from!(f64, f32, i64, i32, u64, u32, usize);

impl From<bool> for HParamValue {
    fn from(v: bool) -> Self {
        HParamValue::Bool(v)
    }
}

impl From<&str> for HParamValue {
    fn from(v: &str) -> Self {
        HParamValue::Text(v.to_string())
    }
}

impl From<String> for HParamValue {
    fn from(v: String) -> Self {
        HParamValue::Text(v)
    }
}

/// A run's hyperparameters, in the order they were set (setting a name again replaces its
/// value). Start from [`HParams::of_run`] to include the accelerator's settings.
///
/// ```
/// use accelerate_rs::tracking::HParams;
///
/// let hp = HParams::new().set("lr", 3e-4).set("batch_size", 8usize).set("model", "gpt-4l");
/// assert_eq!(hp.len(), 3);
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HParams {
    values: Vec<(String, HParamValue)>,
}

impl HParams {
    /// No hyperparameters.
    pub fn new() -> Self {
        Self::default()
    }

    /// The settings in force for `accelerator`'s run: `world_size`, `distributed_type`,
    /// `device`, `mixed_precision`, `gradient_accumulation_steps`, `split_batches`,
    /// `zero_stage`, `bucket_cap_mb` and `transport`. Takes `&accelerator` (or its
    /// [`ProcessState`]).
    pub fn of_run(run: impl AsRef<ProcessState>) -> Self {
        let s = run.as_ref();
        HParams::new()
            .set("world_size", s.world_size())
            .set("distributed_type", format!("{:?}", s.distributed_type()))
            .set("device", format!("{:?}", s.device().location()))
            .set("mixed_precision", s.mixed_precision().as_str())
            .set(
                "gradient_accumulation_steps",
                s.gradient_accumulation_steps(),
            )
            .set("split_batches", s.split_batches())
            .set("zero_stage", s.zero_stage())
            .set(
                "bucket_cap_mb",
                s.bucket_cap_bytes() as f64 / (1024.0 * 1024.0),
            )
            .set("transport", format!("{:?}", s.transport()).to_lowercase())
    }

    /// Sets `name` to `value` (replacing an earlier value of the same name, in its place).
    pub fn set(mut self, name: impl Into<String>, value: impl Into<HParamValue>) -> Self {
        self.insert(name, value);
        self
    }

    /// [`set`](Self::set) in place.
    pub fn insert(&mut self, name: impl Into<String>, value: impl Into<HParamValue>) {
        let (name, value) = (name.into(), value.into());
        match self.values.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = value,
            None => self.values.push((name, value)),
        }
    }

    /// The value of `name`.
    pub fn get(&self, name: &str) -> Option<&HParamValue> {
        self.values.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    /// The names and values, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &HParamValue)> {
        self.values.iter().map(|(n, v)| (n.as_str(), v))
    }

    /// How many there are.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// As a JSON object (numbers that are not finite become `null`).
    pub fn to_json(&self) -> serde_json::Value {
        let map = self
            .values
            .iter()
            .map(|(n, v)| {
                let v = match v {
                    HParamValue::Number(x) => serde_json::Value::from(*x),
                    HParamValue::Text(t) => serde_json::Value::from(t.as_str()),
                    HParamValue::Bool(b) => serde_json::Value::from(*b),
                };
                (n.clone(), v)
            })
            .collect();
        serde_json::Value::Object(map)
    }
}
