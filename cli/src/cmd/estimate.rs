//! `accelerate-rs estimate-memory MODEL`: what training a model takes on each rank, from its
//! `config.json` and safetensors headers (never the weights), for each precision and ZeRO stage,
//! with and without activation checkpointing. The numbers come from
//! [`accelerate_rs::memory`], the architecture from `accelerate_rs_models` (which knows them);
//! this module reads the flags and prints the table.

use std::fmt::Write as _;
use std::path::PathBuf;

use clap::{Args, ValueEnum};

use accelerate_rs::memory::{
    estimate, estimate_4bit, Estimate, Lora, ModelSpec, OptimizerKind, Plan, TensorSource,
    NOT_COUNTED,
};
use accelerate_rs::{Error, MixedPrecision};

#[derive(Debug, Args)]
pub(crate) struct EstimateArgs {
    /// A Hugging Face model folder (config.json and safetensors files), a config.json, a
    /// safetensors file or a sharded checkpoint's index (*.safetensors.index.json). Only
    /// headers are read: a header-only safetensors file (no data section) is enough.
    #[arg(value_name = "MODEL")]
    model: PathBuf,
    /// Processes the ZeRO stages shard over (per-rank numbers; the batch is per rank).
    #[arg(long, short = 'n', default_value_t = 1, value_name = "N")]
    world_size: usize,
    /// Sequences per rank per step.
    #[arg(long, default_value_t = 1, value_name = "B")]
    batch_size: usize,
    /// Tokens per sequence (default: the model's longest, at most 2048).
    #[arg(long, value_name = "T")]
    seq_len: Option<usize>,
    /// Precisions to show (default all): fp32, or bf16/fp16 mixed precision (f32 masters).
    #[arg(long, value_enum, value_delimiter = ',', value_name = "P")]
    precision: Vec<Precision>,
    /// ZeRO stages to show (default 0 with one process, 0,1,2,3 with several).
    #[arg(long, value_delimiter = ',', value_name = "S")]
    zero_stage: Vec<usize>,
    /// ZeRO-3 offload: the shards' optimizer state, f32 masters and f32 gradients in host
    /// memory (an "offloaded" column; not in the device totals). Needs --zero-stage 3.
    #[arg(long)]
    offload_optimizer: bool,
    /// The optimizer whose state is counted.
    #[arg(long, value_enum, default_value_t = Opt::Adamw)]
    optimizer: Opt,
    /// Train LoRA adapters of this rank instead of the whole model (the base frozen in the
    /// compute dtype).
    #[arg(long, value_name = "R")]
    lora_r: Option<usize>,
    /// The Linear layers LoRA adapts (module names such as q_proj,v_proj, or all-linear;
    /// default: peft's defaults for the architecture).
    #[arg(long, value_delimiter = ',', value_name = "NAMES", requires = "lora_r")]
    lora_targets: Vec<String>,
    /// QLoRA: the frozen base's Linear layers in 4 bits (NF4 with double quantization, blocks
    /// of 64: half a byte a weight plus the scales), the rest of the model in the compute
    /// dtype. Needs --lora-r; ZeRO stages 0-2.
    #[arg(long, requires = "lora_r")]
    load_in_4bit: bool,
    /// The model's output layer and loss are composed (a Linear, then a cross-entropy on its
    /// logits) rather than one fused op (`nn::linear_cross_entropy`, as accelerate-rs-models'
    /// loss): the backward pass then starts with three logits-sized f32 tensors.
    #[arg(long)]
    composed_head: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Precision {
    Fp32,
    Bf16,
    Fp16,
}

impl Precision {
    fn mode(self) -> MixedPrecision {
        match self {
            Precision::Fp32 => MixedPrecision::No,
            Precision::Bf16 => MixedPrecision::Bf16,
            Precision::Fp16 => MixedPrecision::Fp16,
        }
    }
    fn label(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16 mixed",
            Precision::Fp16 => "fp16 mixed",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Opt {
    Adamw,
    SgdMomentum,
    Sgd,
}

pub(crate) fn run(args: EstimateArgs) -> crate::error::Result<()> {
    let model = accelerate_rs_models::model_spec(&args.model)?;
    print!("{}", report(&args, &model)?);
    Ok(())
}

/// `1.23 GiB`, `456.0 MiB`.
fn size(b: u64) -> String {
    let gib = b as f64 / (1u64 << 30) as f64;
    if gib >= 1.0 {
        format!("{gib:.2} GiB")
    } else {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

/// `6,738,415,616`.
fn grouped(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// One row of the table: a precision and a ZeRO stage, the plan without and with checkpointing.
type Row = (Precision, usize, Estimate, Estimate);

/// The whole report (a function of the arguments and the model, for tests).
fn report(args: &EstimateArgs, model: &ModelSpec) -> accelerate_rs::Result<String> {
    if args.world_size == 0 {
        return Err(Error::invalid("--world-size", "must be at least 1"));
    }
    let base = base_plan(args, model);
    let rows = estimate_rows(args, model, &base)?;
    let mut out = String::new();
    write_model(&mut out, args, model);
    write_per_rank(&mut out, args, &base, &rows);
    write_table(&mut out, args, &rows);
    write_notes(&mut out, args, base.optimizer);
    Ok(out)
}

/// The plan the flags describe, before a precision and a stage are chosen: fp32, stage 0.
fn base_plan(args: &EstimateArgs, model: &ModelSpec) -> Plan {
    let seq_len = args.seq_len.unwrap_or_else(|| {
        model
            .architecture
            .as_ref()
            .map_or(2048, |a| a.max_positions.min(2048))
    });
    let optimizer = match args.optimizer {
        Opt::Adamw => OptimizerKind::AdamW,
        Opt::SgdMomentum => OptimizerKind::SgdMomentum,
        Opt::Sgd => OptimizerKind::Sgd,
    };
    let lora = args.lora_r.map(|r| Lora {
        r,
        targets: args.lora_targets.clone(),
    });
    Plan {
        precision: MixedPrecision::No,
        zero_stage: 0,
        world_size: args.world_size,
        optimizer,
        lora,
        batch_size: args.batch_size,
        seq_len,
        checkpointing: false,
        fused_head: !args.composed_head,
        offload_optimizer: args.offload_optimizer,
    }
}

/// One row per precision and stage the flags ask for (the defaults when they ask for none):
/// the plan without and with checkpointing.
fn estimate_rows(
    args: &EstimateArgs,
    model: &ModelSpec,
    base: &Plan,
) -> accelerate_rs::Result<Vec<Row>> {
    let precisions = if args.precision.is_empty() {
        vec![Precision::Fp32, Precision::Bf16, Precision::Fp16]
    } else {
        args.precision.clone()
    };
    let stages = if !args.zero_stage.is_empty() {
        args.zero_stage.clone()
    } else if args.world_size > 1 && args.load_in_4bit {
        vec![0, 1, 2]
    } else if args.world_size > 1 {
        vec![0, 1, 2, 3]
    } else {
        vec![0]
    };
    let run = |plan: &Plan| match args.load_in_4bit {
        true => estimate_4bit(model, plan, 64, true),
        false => estimate(model, plan),
    };
    let mut rows = Vec::new();
    for &p in &precisions {
        for &s in &stages {
            let plan = Plan {
                precision: p.mode(),
                zero_stage: s,
                ..base.clone()
            };
            let plain = run(&plan)?;
            let ckpt = run(&Plan {
                checkpointing: true,
                ..plan
            })?;
            rows.push((p, s, plain, ckpt));
        }
    }
    Ok(rows)
}

/// The model's lines: its architecture (or why it is unknown) and its parameter count.
fn write_model(w: &mut String, args: &EstimateArgs, model: &ModelSpec) {
    let _ = writeln!(w, "Model: {}", args.model.display());
    match &model.architecture {
        Some(a) => {
            let _ = writeln!(
                w,
                "  {} (config.json): hidden {}, intermediate {}, {} layers, {} heads ({} key/value, {} wide), vocab {}",
                a.name,
                a.hidden,
                a.intermediate,
                a.layers,
                a.heads,
                a.kv_heads,
                a.head_dim,
                a.vocab
            );
        }
        None => {
            let why = match &model.unknown_model_type {
                Some(t) => format!(
                    "its model_type {t} is not one the estimate knows ({})",
                    accelerate_rs_models::model_types().join(", ")
                ),
                None => {
                    "no config.json was read (give the model's folder or its config.json)".into()
                }
            };
            let _ = writeln!(
                w,
                "  architecture unknown: {why}; activations are not estimated"
            );
        }
    }
    let params = model.parameter_count();
    let from = match &model.tensors_from {
        TensorSource::Config => "computed from config.json".to_string(),
        TensorSource::Safetensors { files, header_only } => format!(
            "from the headers of {files} safetensors file{}{}",
            if *files == 1 { "" } else { "s" },
            if *header_only {
                " (header only: no data section, no weights read)"
            } else {
                " (no weights read)"
            }
        ),
    };
    let _ = writeln!(
        w,
        "  {} parameters ({:.2} B), {}",
        grouped(params),
        params as f64 / 1e9,
        from
    );
}

/// The per-rank line: processes, optimizer, what is trained, batch.
fn write_per_rank(w: &mut String, args: &EstimateArgs, base: &Plan, rows: &[Row]) {
    let training = match (&base.lora, rows.first()) {
        (Some(l), Some((_, _, first, _))) => format!(
            "LoRA r={} on {} Linear layers: {} trainable parameters, {} frozen{}",
            l.r,
            first.lora_layers,
            grouped(first.trainable_params),
            grouped(first.frozen_params),
            if args.load_in_4bit {
                " (QLoRA: the Linear layers in 4 bits, NF4 with double quantization)"
            } else {
                ""
            }
        ),
        _ => "full fine-tuning".to_string(),
    };
    let _ = writeln!(
        w,
        "\nPer rank: {} process{}, {}, {}; batch {} x {} tokens per rank",
        args.world_size,
        if args.world_size == 1 { "" } else { "es" },
        base.optimizer.name(),
        training,
        args.batch_size,
        base.seq_len
    );
}

/// The table: one line per row, sizes right-aligned under a header and a rule.
fn write_table(w: &mut String, args: &EstimateArgs, rows: &[Row]) {
    let mut head = vec![
        "precision",
        "ZeRO",
        "parameters",
        "gradients",
        "optimizer",
        "f32 masters",
        "activations",
        "total",
        "activations (ckpt)",
        "total (ckpt)",
    ];
    if args.offload_optimizer {
        head.push("offloaded (host)");
    }
    let mut table: Vec<Vec<String>> = vec![head.iter().map(|s| s.to_string()).collect()];
    let act = |e: &Estimate| {
        e.activations
            .map_or("unknown".to_string(), |a| size(a.kept + a.backward))
    };
    let total = |e: &Estimate| {
        if e.activations.is_some() {
            size(e.total())
        } else {
            format!("{} + activations", size(e.total()))
        }
    };
    for (p, s, plain, ckpt) in rows {
        let mut row = vec![
            p.label().to_string(),
            s.to_string(),
            size(plain.parameters),
            size(plain.gradients),
            size(plain.optimizer_state),
            if plain.masters == 0 {
                "-".to_string()
            } else {
                size(plain.masters)
            },
            act(plain),
            total(plain),
            act(ckpt),
            total(ckpt),
        ];
        if args.offload_optimizer {
            row.push(size(plain.offloaded));
        }
        table.push(row);
    }
    let widths: Vec<usize> = (0..head.len())
        .map(|c| table.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    for (i, row) in table.iter().enumerate() {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(c, (cell, &wd))| {
                if c < 2 {
                    format!("{cell:<wd$}")
                } else {
                    format!("{cell:>wd$}")
                }
            })
            .collect();
        let _ = writeln!(w, "| {} |", cells.join(" | "));
        if i == 0 {
            let rule: Vec<String> = widths.iter().map(|&wd| "-".repeat(wd)).collect();
            let _ = writeln!(w, "|-{}-|", rule.join("-|-"));
        }
    }
}

/// What is counted and what is not, wrapped.
fn write_notes(w: &mut String, args: &EstimateArgs, optimizer: OptimizerKind) {
    let counted = format!(
        "Counted: parameters (bf16/fp16: the working copies; LoRA: the frozen base in the compute dtype plus the adapters; --load-in-4bit: its Linear layers in 4 bits, half a byte a weight plus the double-quantized scales, and the largest of them dequantized in the compute dtype), gradients of the trainable parameters (mixed precision: the half-precision ones and their f32 copies), {} state, f32 masters, and activations: what the backward pass keeps per block as accelerate-rs's nn layers keep it (attention weights of heads x sequence length included: no flash attention), the logits, and the backward pass's working set ({}); \"ckpt\": every block checkpointed (nn::checkpoint). ZeRO as accelerate-rs implements it: stage 1 shards the optimizer state over the ranks, stage 2 also the averaged gradients, stage 3 also the parameters (f32 masters under mixed precision), with the embeddings and head gathered for the whole step, about two blocks gathered at a time and every block recomputed (its \"activations\" are the checkpointed ones; LoRA: the frozen base sharded, the adapters whole on every rank).",
        optimizer.name(),
        if args.composed_head {
            "a composed output layer and loss: three logits-sized f32 tensors at its start"
        } else {
            "the output layer and loss fused as nn::linear_cross_entropy, as accelerate-rs-models' loss; --composed-head for a Linear then a cross-entropy"
        }
    );
    let _ = writeln!(w, "\n{}", wrap(&counted, 100, ""));
    let _ = writeln!(w, "Not counted:");
    for n in NOT_COUNTED {
        let _ = writeln!(w, "  - {}", wrap(n, 96, "    "));
    }
}

/// `text` broken into lines of at most `width` characters at spaces, continuation lines
/// starting with `indent`.
fn wrap(text: &str, width: usize, indent: &str) -> String {
    let mut out = String::new();
    let mut line = 0;
    for word in text.split(' ') {
        if line > 0 && line + 1 + word.len() > width {
            out.push('\n');
            out.push_str(indent);
            line = indent.len();
        } else if line > 0 {
            out.push(' ');
            line += 1;
        }
        out.push_str(word);
        line += word.len();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_groups_print_as_people_read_them() {
        assert_eq!(grouped(6_738_415_616), "6,738,415,616");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(1000), "1,000");
        assert_eq!(size(3 << 30), "3.00 GiB");
        assert_eq!(size(512 << 20), "512.0 MiB");
        assert_eq!(wrap("aa bb cc dd", 5, "  "), "aa bb\n  cc\n  dd");
    }
}
