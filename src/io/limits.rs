//! Caps on what input-controlled numbers may make ntl-patch allocate or loop over, each with a
//! clear error where it is enforced.

/// The largest logits width (vocabulary size) accepted: 2^24 ids, 64× the largest
/// vocabularies in use; the number table and validate's inputs are this wide.
pub const MAX_VOCAB: u64 = 1 << 24;

/// The largest tokenizer file read (Hugging Face `tokenizer.json` files are ≤ ~50 MB).
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// The largest recorded tensor file (`--reference DIR`) validate reads.
pub const MAX_REFERENCE_BYTES: u64 = 1 << 30;

/// The most elements validate generates for one input, or lets the `[B·T, V]` logits have.
pub const MAX_GENERATED_ELEMENTS: u64 = 1 << 28;

/// `validate --batch`/`--seq` at most.
pub const MAX_BATCH_OR_SEQ: u64 = 1 << 20;
