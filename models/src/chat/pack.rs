//! [`Packer`]: tokenized examples packed into rows of a fixed length without padding, with the
//! position ids and document ids that keep the documents apart ([`PackedRow`]), and
//! [`PackedBatch`], rows stacked into the tensors of a forward pass.

use candle_core::{Device, Result, Tensor};

use super::encoder::ChatExample;
use crate::arch::Inputs;
use crate::layers::IGNORE_INDEX;

/// One row of `seq_len` tokens holding several documents (examples) one after the other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedRow {
    /// The token ids.
    pub input_ids: Vec<u32>,
    /// The labels (unshifted, as the models take them): the examples' labels, except
    /// [`IGNORE_INDEX`] at the first token of each document after the first (nothing of a
    /// document is predicted from the one before it) and on padding.
    pub labels: Vec<i64>,
    /// Each token's position in its document (0 at a document's first token; a document
    /// continued from the row before goes on counting).
    pub position_ids: Vec<u32>,
    /// Each token's document in the row: 0, 1, ... (padding is a document of its own).
    pub document_ids: Vec<u32>,
    /// 1 for a token, 0 for padding (only the last row of a stream has padding).
    pub attention_mask: Vec<u32>,
}

impl PackedRow {
    fn new(capacity: usize) -> Self {
        PackedRow {
            input_ids: Vec::with_capacity(capacity),
            labels: Vec::with_capacity(capacity),
            position_ids: Vec::with_capacity(capacity),
            document_ids: Vec::with_capacity(capacity),
            attention_mask: Vec::with_capacity(capacity),
        }
    }

    /// The number of tokens (padding included).
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    /// Whether the row holds nothing.
    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }

    /// The tokens a causal language-model loss predicts in this row: the labels after the
    /// first position that are not [`IGNORE_INDEX`] (the weight of the row in a token-weighted
    /// loss).
    pub fn num_targets(&self) -> usize {
        self.labels
            .iter()
            .skip(1)
            .filter(|&&l| l != IGNORE_INDEX)
            .count()
    }

    /// The number of documents in the row (padding not counted).
    pub fn documents(&self) -> usize {
        let mut ids: Vec<u32> = self
            .document_ids
            .iter()
            .zip(&self.attention_mask)
            .filter(|(_, &m)| m == 1)
            .map(|(&d, _)| d)
            .collect();
        ids.dedup();
        ids.len()
    }
}

/// Packs tokenized examples (ids and labels, such as [`ChatExample`]s) into rows of exactly
/// `seq_len` tokens, padding-free: the examples are laid end to end, an example that does not
/// fit the rest of a row continues at the start of the next one (its positions counting on),
/// and only the last row of the stream ([`finish`](Self::finish)) is padded. In a row, position
/// ids restart at 0 with each document and the document ids tell the models to attend within a
/// document only ([`Inputs::position_ids`], [`Inputs::document_ids`]): the packed forward pass
/// of a row equals each document run alone. The first token of each document after the first
/// gets the label -100, so that no loss crosses a boundary.
///
/// ```
/// use accelerate_rs_models::chat::Packer;
///
/// let mut packer = Packer::new(8).unwrap();
/// let mut rows = packer.push(&[1, 2, 3], &[1, 2, 3]).unwrap();
/// rows.extend(packer.push(&[4, 5, 6, 7], &[-100, -100, 6, 7]).unwrap());
/// rows.extend(packer.push(&[8, 9, 10], &[8, 9, 10]).unwrap());
/// rows.extend(packer.finish());
/// assert_eq!(rows.len(), 2);
/// assert_eq!(rows[0].input_ids, [1, 2, 3, 4, 5, 6, 7, 8]);
/// assert_eq!(rows[0].position_ids, [0, 1, 2, 0, 1, 2, 3, 0]);
/// assert_eq!(rows[0].document_ids, [0, 0, 0, 1, 1, 1, 1, 2]);
/// assert_eq!(rows[0].labels, [1, 2, 3, -100, -100, 6, 7, -100]);
/// // The third example goes on in the second row, which is padded (pad id 0).
/// assert_eq!(rows[1].input_ids, [9, 10, 0, 0, 0, 0, 0, 0]);
/// assert_eq!(rows[1].position_ids, [1, 2, 0, 1, 2, 3, 4, 5]);
/// assert_eq!(rows[1].attention_mask, [1, 1, 0, 0, 0, 0, 0, 0]);
/// ```
#[derive(Debug, Clone)]
pub struct Packer {
    seq_len: usize,
    pad_id: u32,
    row: PackedRow,
    /// The document id of the next document in the row.
    next_doc: u32,
    /// Examples packed.
    examples: u64,
}

impl Packer {
    /// Rows of `seq_len` tokens (at least 1), padded with id 0 (see [`pad_id`](Self::pad_id)).
    pub fn new(seq_len: usize) -> Result<Self> {
        if seq_len == 0 {
            candle_core::bail!("Packer: seq_len must be at least 1 token");
        }
        Ok(Packer {
            seq_len,
            pad_id: 0,
            row: PackedRow::new(seq_len),
            next_doc: 0,
            examples: 0,
        })
    }

    /// The token id the last row is padded with.
    pub fn pad_id(mut self, id: u32) -> Self {
        self.pad_id = id;
        self
    }

    /// The row length.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The examples packed so far.
    pub fn examples(&self) -> u64 {
        self.examples
    }

    /// Adds one example (`input_ids` and its `labels`, as many, unshifted); returns the rows it
    /// completed (none, one, or several for an example longer than a row). An empty example or
    /// one whose ids and labels differ in length is an error.
    pub fn push(&mut self, input_ids: &[u32], labels: &[i64]) -> Result<Vec<PackedRow>> {
        if input_ids.len() != labels.len() {
            candle_core::bail!(
                "Packer: an example of {} token ids has {} labels (one per token expected)",
                input_ids.len(),
                labels.len()
            );
        }
        if input_ids.is_empty() {
            candle_core::bail!("Packer: an empty example (no token) cannot be packed");
        }
        self.examples += 1;
        let mut done = Vec::new();
        let doc = self.next_doc;
        self.next_doc += 1;
        for (p, (&id, &label)) in input_ids.iter().zip(labels).enumerate() {
            // The first token of a document is not predicted from the document before it.
            let label = if p == 0 && !self.row.is_empty() {
                IGNORE_INDEX
            } else {
                label
            };
            self.row.input_ids.push(id);
            self.row.labels.push(label);
            self.row.position_ids.push(p as u32);
            self.row.document_ids.push(doc);
            self.row.attention_mask.push(1);
            if self.row.len() == self.seq_len {
                done.push(std::mem::replace(
                    &mut self.row,
                    PackedRow::new(self.seq_len),
                ));
            }
        }
        if self.row.is_empty() {
            self.next_doc = 0;
        }
        Ok(done)
    }

    /// [`push`](Self::push) of a [`ChatExample`].
    pub fn push_example(&mut self, example: &ChatExample) -> Result<Vec<PackedRow>> {
        self.push(&example.input_ids, &example.labels)
    }

    /// The end of the stream: the row in progress, padded to `seq_len` (pad id, label -100,
    /// attention mask 0, a document of its own), or `None` if it is empty.
    pub fn finish(&mut self) -> Option<PackedRow> {
        if self.row.is_empty() {
            return None;
        }
        let mut row = std::mem::replace(&mut self.row, PackedRow::new(self.seq_len));
        let pad_doc = self.next_doc;
        self.next_doc = 0;
        for p in 0..self.seq_len - row.len() {
            row.input_ids.push(self.pad_id);
            row.labels.push(IGNORE_INDEX);
            row.position_ids.push(p as u32);
            row.document_ids.push(pad_doc);
            row.attention_mask.push(0);
        }
        Some(row)
    }

    /// Every row of `examples` (ids and labels), the last one padded.
    pub fn pack_all<'a>(
        mut self,
        examples: impl IntoIterator<Item = (&'a [u32], &'a [i64])>,
    ) -> Result<Vec<PackedRow>> {
        let mut rows = Vec::new();
        for (ids, labels) in examples {
            rows.extend(self.push(ids, labels)?);
        }
        rows.extend(self.finish());
        Ok(rows)
    }
}

/// Packed rows stacked: every tensor `[B, seq_len]`, for [`inputs`](Self::inputs) and the loss.
#[derive(Debug, Clone)]
pub struct PackedBatch {
    /// Token ids (u32).
    pub input_ids: Tensor,
    /// Labels (i64, -100 where nothing is predicted).
    pub labels: Tensor,
    /// Position ids (u32).
    pub position_ids: Tensor,
    /// Document ids (u32).
    pub document_ids: Tensor,
    /// 1 token, 0 padding (u32).
    pub attention_mask: Tensor,
}

impl PackedBatch {
    /// `rows` (one length) stacked on `device`. No row, or rows of different lengths, is an
    /// error.
    pub fn new(rows: &[PackedRow], device: &Device) -> Result<Self> {
        let Some(first) = rows.first() else {
            candle_core::bail!("PackedBatch: no row");
        };
        let t = first.len();
        if let Some(bad) = rows.iter().find(|r| r.len() != t) {
            candle_core::bail!(
                "PackedBatch: rows of {t} and {} tokens (one length expected)",
                bad.len()
            );
        }
        let shape = (rows.len(), t);
        fn stack<T: candle_core::WithDType>(
            rows: &[PackedRow],
            field: impl Fn(&PackedRow) -> &[T],
            shape: (usize, usize),
            device: &Device,
        ) -> Result<Tensor> {
            let flat: Vec<T> = rows.iter().flat_map(|r| field(r).iter().copied()).collect();
            Tensor::from_vec(flat, shape, device)
        }
        Ok(PackedBatch {
            input_ids: stack(rows, |r| &r.input_ids, shape, device)?,
            labels: stack(rows, |r| &r.labels, shape, device)?,
            position_ids: stack(rows, |r| &r.position_ids, shape, device)?,
            document_ids: stack(rows, |r| &r.document_ids, shape, device)?,
            attention_mask: stack(rows, |r| &r.attention_mask, shape, device)?,
        })
    }

    /// The model's inputs: the ids, the padding mask, the position ids and the document ids.
    pub fn inputs(&self) -> Inputs<'_> {
        Inputs::new(&self.input_ids)
            .attention_mask(Some(&self.attention_mask))
            .position_ids(Some(&self.position_ids))
            .document_ids(Some(&self.document_ids))
    }
}
