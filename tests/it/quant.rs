//! 4-bit weights (`accelerate_rs::quant`) against bitsandbytes' golden files
//! (`tests/fixtures/bnb4bit/golden.safetensors`, written by `scripts/bnb_reference.py`): the
//! packed bytes, block scales, nested statistics and quant-state JSON of `quantize_4bit` equal
//! bit for bit, the dequantized values too; a `transformers` 4-bit folder's tensors read by
//! prefix; every malformed state refused with an error naming the tensor.

use std::collections::HashMap;
use std::path::PathBuf;

use accelerate_rs::quant::{Quant4bitConfig, QuantType, Scales, Weight4bit};
use accelerate_rs::Error;
use candle_core::{DType, Device, Tensor};

const DEV: Device = Device::Cpu;

/// The golden file's cases: name and how it was quantized.
const CASES: [(&str, QuantType, bool); 8] = [
    ("llama_q", QuantType::Nf4, true),
    ("llama_down_bf16", QuantType::Nf4, true),
    ("odd_f32", QuantType::Nf4, true),
    ("fp4_k", QuantType::Fp4, true),
    ("plain_v", QuantType::Nf4, false),
    ("edge", QuantType::Nf4, true),
    ("small_f16", QuantType::Nf4, true),
    ("big_bf16", QuantType::Nf4, true),
];

fn golden() -> HashMap<String, Tensor> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bnb4bit/golden.safetensors");
    candle_core::safetensors::load(&path, &DEV).unwrap()
}

fn config(quant_type: QuantType, double_quant: bool) -> Quant4bitConfig {
    Quant4bitConfig {
        quant_type,
        blocksize: 64,
        double_quant,
    }
}

/// The `big_bf16` weight, computed as `scripts/bnb_reference.py`'s `big_input` does.
fn big_input() -> Tensor {
    let v: Vec<f32> = (0..127u64 * 130)
        .map(|i| {
            let h = (i * 2_654_435_761) % (1 << 32);
            ((h >> 20) as i64 - 2048) as f32 * 2f32.powi(-14)
        })
        .collect();
    Tensor::from_vec(v, (127, 130), &DEV)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
}

fn input(g: &HashMap<String, Tensor>, case: &str) -> Tensor {
    if case == "big_bf16" {
        big_input()
    } else {
        g[&format!("{case}.input")].clone()
    }
}

/// The raw bytes of a tensor (its dtype's little-endian layout), for bitwise comparisons.
fn bytes(t: &Tensor) -> Vec<u8> {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::U8 => t.to_vec1::<u8>().unwrap(),
        DType::F32 => t
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect(),
        d => panic!("unexpected dtype {d:?}"),
    }
}

fn same(a: &Tensor, b: &Tensor, what: &str) {
    assert_eq!(a.dtype(), b.dtype(), "{what}: dtype");
    assert_eq!(a.dims(), b.dims(), "{what}: shape");
    let (x, y) = (bytes(a), bytes(b));
    if x != y {
        let first = x.iter().zip(&y).position(|(p, q)| p != q).unwrap_or(0);
        panic!("{what}: bytes differ, first at byte {first} of {}", x.len());
    }
}

#[test]
fn quantize_gives_bitsandbytes_bytes() {
    let g = golden();
    for (case, quant_type, nested) in CASES {
        let q = Weight4bit::quantize(&input(&g, case), &config(quant_type, nested)).unwrap();
        let ours = q.tensors(case).unwrap();
        let theirs: Vec<&String> = g
            .keys()
            .filter(|k| k.starts_with(&format!("{case}.weight")))
            .collect();
        assert_eq!(ours.len(), theirs.len(), "{case}: tensors {theirs:?}");
        for (name, t) in &ours {
            same(t, &g[name], name);
        }
        let json = &g[&format!(
            "{case}.weight.quant_state.bitsandbytes__{}",
            quant_type.name()
        )];
        assert_eq!(q.state().to_json().as_bytes(), bytes(json), "{case}: JSON");
    }
}

#[test]
fn dequantize_gives_bitsandbytes_values() {
    let g = golden();
    for (case, _, nested) in CASES {
        let q = Weight4bit::read(case, |n| g.get(n).cloned()).unwrap();
        assert_eq!(
            matches!(q.state().scales(), Scales::Nested(_)),
            nested,
            "{case}"
        );
        let absmax = Tensor::new(q.state().absmax().as_slice(), &DEV).unwrap();
        same(
            &absmax,
            &g[&format!("{case}.absmax_f32")],
            &format!("{case}: scales"),
        );
        let dq = q.dequantize().unwrap();
        assert_eq!(dq.dtype(), input(&g, case).dtype(), "{case}");
        if let Some(want) = g.get(&format!("{case}.dequant")) {
            same(&dq, want, &format!("{case}: dequantized"));
        }
        // And quantizing gives the same weight as reading.
        let cfg = config(q.state().quant_type(), nested);
        assert_eq!(
            Weight4bit::quantize(&input(&g, case), &cfg).unwrap(),
            q,
            "{case}"
        );
    }
}

#[test]
fn reads_a_transformers_4bit_folder_by_prefix() {
    let g = golden();
    // q_proj as `transformers` saved it is the `llama_q` case under another prefix.
    let hf = Weight4bit::read("model.layers.0.self_attn.q_proj", |n| g.get(n).cloned()).unwrap();
    let ours = Weight4bit::read("llama_q", |n| g.get(n).cloned()).unwrap();
    assert_eq!(hf, ours);
    same(
        &hf.dequantize().unwrap(),
        &g["llama_q.dequant"],
        "q_proj dequantized",
    );
    // down_proj of layer 1, quantized here from the f32 folder as `load_in_4bit` would.
    let tiny = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("models/examples/tiny-llama/model.safetensors");
    let tiny = candle_core::safetensors::load(tiny, &DEV).unwrap();
    let prefix = "model.layers.1.mlp.down_proj";
    let w = &tiny[&format!("{prefix}.weight")];
    let q = Weight4bit::quantize(w, &Quant4bitConfig::nf4()).unwrap();
    for (name, t) in q.tensors(prefix).unwrap() {
        same(&t, &g[&name], &name);
    }
    let read = Weight4bit::read(prefix, |n| g.get(n).cloned()).unwrap();
    assert_eq!(read, q);
    assert_eq!(read.shape(), &[32, 96]);
    // 4 bits a weight, 8-bit scales for every 64, 4 bytes for every 256 blocks, the map.
    assert_eq!(read.nbytes(), 32 * 96 / 2 + 48 + 4 + 1024);
}

#[test]
fn quantized_weights_round_trip_through_their_tensors() {
    for (config, dtype, shape) in [
        (Quant4bitConfig::nf4(), DType::F32, vec![5usize, 77]),
        (Quant4bitConfig::fp4(), DType::BF16, vec![300, 70]),
        (
            Quant4bitConfig::nf4().double_quant(false).blocksize(128),
            DType::F16,
            vec![33],
        ),
        (
            Quant4bitConfig::nf4().blocksize(32),
            DType::F32,
            vec![2, 3, 65],
        ),
    ] {
        let w = Tensor::randn(0f32, 0.05, shape.as_slice(), &DEV)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let q = Weight4bit::quantize(&w, &config).unwrap();
        let map: HashMap<String, Tensor> = q.tensors("m").unwrap().into_iter().collect();
        let back = Weight4bit::read("m", |n| map.get(n).cloned()).unwrap();
        assert_eq!(back, q);
        let dq = back.dequantize().unwrap();
        assert_eq!((dq.dims(), dq.dtype()), (w.dims(), dtype));
        // Within one step of the table times the block's scale.
        let err = (dq.to_dtype(DType::F32).unwrap() - w.to_dtype(DType::F32).unwrap())
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(err < 0.05, "{config:?}: {err}");
    }
}

/// The error of reading `llama_q` (or `plain_v`) after `edit` changes its tensors.
fn read_error(case: &str, edit: impl FnOnce(&mut HashMap<String, Tensor>)) -> String {
    let mut g = golden();
    edit(&mut g);
    match Weight4bit::read(case, |n| g.get(n).cloned()) {
        Ok(_) => panic!("{case}: a malformed state was read"),
        Err(e @ Error::Quantized { .. }) => e.to_string(),
        Err(e) => panic!("{case}: not a quantized-weight error: {e}"),
    }
}

/// A change to the golden tensors.
type Edit = Box<dyn FnOnce(&mut HashMap<String, Tensor>)>;

fn edit(f: impl FnOnce(&mut HashMap<String, Tensor>) + 'static) -> Edit {
    Box::new(f)
}

fn json_tensor(text: &str) -> Tensor {
    Tensor::new(text.as_bytes(), &DEV).unwrap()
}

#[test]
fn missing_tensors_are_refused_naming_them() {
    let q = "llama_q.weight";
    let js = "llama_q.weight.quant_state.bitsandbytes__nf4";
    // Each tensor missing.
    for suffix in [
        "",
        ".absmax",
        ".quant_map",
        ".nested_absmax",
        ".nested_quant_map",
    ] {
        let name = format!("{q}{suffix}");
        let e = read_error("llama_q", |g| {
            g.remove(&name);
        });
        assert!(
            e.contains(&format!("`{name}`")) && e.contains("missing"),
            "{e}"
        );
    }
    let e = read_error("llama_q", |g| {
        g.remove(js);
    });
    assert!(e.contains(js) && e.contains("not a 4-bit weight"), "{e}");
}

const JS: &str = "llama_q.weight.quant_state.bitsandbytes__nf4";
const GOOD_STATE: &str = r#"{"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [32, 32], "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.1}"#;

/// Each case's edit of the golden `llama_q` tensors must be refused naming the tensor and
/// saying the reason.
fn refused(cases: Vec<(&str, Edit, &str)>) {
    for (tensor, edit, reason) in cases {
        let e = read_error("llama_q", edit);
        assert!(
            e.contains(&format!("`{tensor}`")) && e.contains(reason),
            "{tensor}: {reason}: {e}"
        );
    }
}

/// Replaces `tensor` of the golden tensors by `f` of it.
fn replace(tensor: &'static str, f: impl FnOnce(&Tensor) -> Tensor + 'static) -> Edit {
    edit(move |g| {
        let t = f(&g[tensor]);
        g.insert(tensor.into(), t);
    })
}

#[test]
fn malformed_tensors_are_refused_naming_the_tensor() {
    refused(vec![
        // Wrong dtypes and sizes.
        (
            "llama_q.weight.absmax",
            replace("llama_q.weight.absmax", |t| t.to_dtype(DType::F32).unwrap()),
            "F32, U8 expected",
        ),
        (
            "llama_q.weight",
            replace("llama_q.weight", |t| t.narrow(0, 0, 511).unwrap()),
            "512 elements expected",
        ),
        (
            "llama_q.weight.nested_quant_map",
            replace("llama_q.weight.nested_quant_map", |t| {
                t.narrow(0, 0, 255).unwrap()
            }),
            "256 elements expected",
        ),
        (
            "llama_q.weight.nested_absmax",
            replace("llama_q.weight.nested_absmax", |_| {
                Tensor::new(&[1f32, 2.0], &DEV).unwrap()
            }),
            "1 elements expected",
        ),
        // A table other than bitsandbytes' NF4.
        (
            "llama_q.weight.quant_map",
            replace("llama_q.weight.quant_map", |t| (t.clone() * 0.5).unwrap()),
            "not bitsandbytes' nf4 table",
        ),
        // Both types' states.
        (
            JS,
            edit(|g| {
                let t = g[JS].clone();
                g.insert("llama_q.weight.quant_state.bitsandbytes__fp4".into(), t);
            }),
            "both it and",
        ),
    ]);
    // Nested tensors beside a state without double quantization.
    let e = read_error("plain_v", |g| {
        let t = g["llama_q.weight.nested_absmax"].clone();
        g.insert("plain_v.weight.nested_absmax".into(), t);
    });
    assert!(
        e.contains("`plain_v.weight.nested_absmax`") && e.contains("no nested_* keys"),
        "{e}"
    );
    // A plain state's absmax must be f32.
    let e = read_error("plain_v", |g| {
        let t = g["llama_q.weight.absmax"].narrow(0, 0, 8).unwrap();
        g.insert("plain_v.weight.absmax".into(), t);
    });
    assert!(
        e.contains("`plain_v.weight.absmax`") && e.contains("U8, F32 expected"),
        "{e}"
    );
}

#[test]
fn malformed_quant_states_are_refused_naming_the_tensor() {
    let raw = |bytes: Tensor| edit(move |g| drop(g.insert(JS.into(), bytes)));
    let mut cases: Vec<(&str, Edit, &str)> = vec![
        (
            JS,
            raw(json_tensor("{\"quant_type\": \"nf4\", ")),
            "not valid JSON",
        ),
        (
            JS,
            raw(Tensor::new(&[0xffu8, 0xfe, 0x7b], &DEV).unwrap()),
            "not UTF-8",
        ),
        (JS, raw(json_tensor("[1, 2]")), "not a JSON object"),
    ];
    // (text of the good state, its replacement, the tensor blamed, the reason).
    let edits: [(&str, &str, &str, &str); 9] = [
        (
            "\"nested_offset\"",
            "\"extra\": 1, \"nested_offset\"",
            JS,
            "unknown key `extra`",
        ),
        (
            "\"quant_type\": \"nf4\"",
            "\"quant_type\": \"fp4\"",
            JS,
            "disagrees with the tensor's name",
        ),
        (
            "\"float32\", \"shape\"",
            "\"int8\", \"shape\"",
            JS,
            "dtype \"int8\"",
        ),
        ("64", "48", JS, "blocksize 48"),
        ("[32, 32]", "[32, -1]", JS, "`shape` is not a list"),
        (
            ", \"nested_offset\": 0.1",
            "",
            JS,
            "nested_offset is missing",
        ),
        (
            "\"blocksize\": 64",
            "\"blocksize\": \"64\"",
            JS,
            "`blocksize` is not a non-negative integer",
        ),
        ("\"quant_type\": \"nf4\", ", "", JS, "lacks `quant_type`"),
        // The JSON's shape disagrees with the packed codes: the codes are blamed.
        (
            "[32, 32]",
            "[32, 33]",
            "llama_q.weight",
            "528 elements expected",
        ),
    ];
    for (from, to, tensor, reason) in edits {
        cases.push((
            tensor,
            raw(json_tensor(&GOOD_STATE.replace(from, to))),
            reason,
        ));
    }
    refused(cases);
}

#[test]
fn bad_weights_are_refused() {
    let nan = Tensor::new(&[[1f32, f32::NAN], [0.5, 0.25]], &DEV).unwrap();
    let e = Weight4bit::quantize(&nan, &Quant4bitConfig::nf4())
        .unwrap_err()
        .to_string();
    assert!(e.contains("element 1") && e.contains("NaN"), "{e}");
    let f64w = Tensor::new(&[1f64, 2.0], &DEV).unwrap();
    let e = Weight4bit::quantize(&f64w, &Quant4bitConfig::nf4())
        .unwrap_err()
        .to_string();
    assert!(e.contains("F64"), "{e}");
    let w = Tensor::new(&[1f32, 2.0], &DEV).unwrap();
    let e = Weight4bit::quantize(&w, &Quant4bitConfig::nf4().blocksize(48))
        .unwrap_err()
        .to_string();
    assert!(e.contains("48"), "{e}");
    let scalar = Tensor::new(1f32, &DEV).unwrap();
    assert!(Weight4bit::quantize(&scalar, &Quant4bitConfig::nf4()).is_err());
}
