//! Label-side bookkeeping for the per-sequence losses: where the digits are, which maximal
//! runs of digits form numbers, and each digit's place. Nothing here carries a gradient, so
//! any standard op may be used (CumSum, Range, TopK, ...) — as long as ORT's CUDA and ROCm
//! providers have kernels for it (no ReduceMax: ROCm lacks it from opset 18).
//!
//! Runs never cross sequences: everything is computed on `[B, T]` labels, along T.

use crate::losses::SeqInputs;
use crate::onnx::{int_attr, FLOAT, INT64};
use crate::Builder;

/// Digits of the labels, `[B, T]` (and `[B, T, 10]` for the one-hot).
pub struct Digits {
    /// `[B, T, 10]` float one-hot of the label digit (all zero where the label is no digit).
    pub onehot: String,
    /// `[B, T]` float: 1 where the label is a digit.
    pub is_digit: String,
    /// `[B, T]` float: the label digit's value (0 elsewhere).
    pub value: String,
    /// `[10]` float: 0..9.
    pub arange: String,
}

/// The numbers (maximal digit runs) of each sequence.
pub struct Runs {
    /// `[B, R, T]` float: 1 where position t belongs to run r of sequence b (R = most runs
    /// in any sequence, at least 1; sequences with fewer runs have all-zero rows).
    pub membership: String,
    /// `[B, T]` float: number of digits after t in its run (0 for the units digit and for
    /// positions outside runs).
    pub digits_after: String,
    /// `[B]` float: runs per sequence.
    pub count: String,
    /// `[B, R]` float: 1 for the runs that exist.
    pub exists: String,
    /// `[B, T]` float: 1 at the first digit of each run.
    pub first_digit: String,
    /// `[B, R]` float: digits in each run.
    pub digit_count: String,
}

pub fn digits(b: &mut Builder, seq: &SeqInputs, digit_ids: &[i64; 10]) -> Digits {
    let ids = b.const_i64("digit_ids", &[10], digit_ids);
    let arange: Vec<f32> = (0..10).map(|d| d as f32).collect();
    let arange = b.const_f32("digit_values", &[10], &arange);
    let labels = b.unsqueeze(&seq.labels, &[2], "labels_bt1");
    let onehot = b.equal(&labels, &ids, "label_digit_match");
    let onehot = b.cast(&onehot, FLOAT, "label_digit_onehot");
    let is_digit = b.reduce_sum(&onehot, &[2], false, "label_is_digit");
    let value = b.binary("Mul", &onehot, &arange, "label_digit_parts");
    let value = b.reduce_sum(&value, &[2], false, "label_digit_value");
    Digits {
        onehot,
        is_digit,
        value,
        arange,
    }
}

/// Runs of digits; with `dot` (ntloss float-level), a `"."` between two digits joins them.
pub fn runs(b: &mut Builder, seq: &SeqInputs, digits: &Digits, dot: Option<i64>) -> Runs {
    let d = b.cast(&digits.is_digit, INT64, "run_digit");
    let zero_col = zero_column(b, &d);
    let prev = shift(b, &d, &zero_col, 1, "run_prev_digit");
    let (in_run, continues) = match dot {
        None => (d.clone(), prev.clone()),
        Some(dot) => {
            let dot_id = b.const_i64("dot_id", &[], &[dot]);
            let is_dot = b.equal(&seq.labels, &dot_id, "run_is_dot_b");
            let is_dot = b.cast(&is_dot, INT64, "run_is_dot");
            let next = shift(b, &d, &zero_col, -1, "run_next_digit");
            let between = b.binary("Mul", &is_dot, &prev, "run_dot_after_digit");
            let between = b.binary("Mul", &between, &next, "run_dot_between_digits");
            let in_run = b.binary("Add", &d, &between, "run_member");
            let dot_prev = shift(b, &is_dot, &zero_col, 1, "run_prev_dot");
            let prev2 = shift(b, &d, &zero_col, 2, "run_prev2_digit");
            let bridged = b.binary("Mul", &dot_prev, &prev2, "run_bridged");
            let continues = b.binary("Add", &prev, &bridged, "run_continues");
            (in_run, continues)
        }
    };
    let one = b.const_i64("run_one", &[], &[1]);
    let not_cont = b.binary("Sub", &one, &continues, "run_not_continued");
    let start = b.binary("Mul", &in_run, &not_cont, "run_start");
    let axis = b.const_i64("run_axis", &[], &[1]);
    let run_id = b.node("CumSum", &[&start, &axis], "run_index_all", vec![]);
    let run_id = b.binary("Mul", &run_id, &in_run, "run_index");

    // R = max(1, most runs in a sequence); membership[b, r, t] = (run_id[b, t] == r + 1).
    let per_row = b.reduce_sum(&start, &[1], false, "run_per_row");
    let per_row = b.cast(&per_row, FLOAT, "run_per_row_f");
    let per_row = b.unsqueeze(&per_row, &[0], "run_per_row_1b");
    let (most, _) = b.top1(&per_row, "run_busiest_row");
    let most = b.reshape(&most, &[], "run_most_f");
    let one_f = b.scalar_f32("run_one_f", 1.0);
    let most = b.binary("Max", &most, &one_f, "run_most_at_least_1_f");
    let most = b.cast(&most, INT64, "run_most_at_least_1");
    let limit = b.binary("Add", &most, &one, "run_limit");
    let ids = b.node("Range", &[&one, &limit, &one], "run_ids", vec![]);
    let ids = b.reshape(&ids, &[1, -1, 1], "run_ids_col");
    let run_id_row = b.unsqueeze(&run_id, &[1], "run_index_row");
    let member = b.equal(&run_id_row, &ids, "run_member_b");
    let membership = b.cast(&member, FLOAT, "run_membership");

    let start_f = b.cast(&start, FLOAT, "run_start_f");
    // A run starts with a digit: a joining dot always has a digit before it.
    let first_digit = b.binary("Mul", &start_f, &digits.is_digit, "run_first_digit");
    let digit_row = b.unsqueeze(&digits.is_digit, &[1], "run_digit_row");
    let run_digits = b.binary("Mul", &membership, &digit_row, "run_digit_members");
    let digit_count = b.reduce_sum(&run_digits, &[2], false, "run_digit_count_per_run");

    // digits after t = (digit count at the run's end) − (digit count at t), where the count at
    // the end is the count at the run's first digit − 1 + the run's digits.
    let counted = b.node("CumSum", &[&d, &axis], "run_digit_count_i", vec![]);
    let counted = b.cast(&counted, FLOAT, "run_digit_count");
    let at_first = b.binary("Mul", &counted, &first_digit, "run_count_at_first_t");
    let at_first = b.unsqueeze(&at_first, &[1], "run_count_at_first_row");
    let at_first = b.binary("Mul", &membership, &at_first, "run_count_at_first_spread");
    let at_first = b.reduce_sum(&at_first, &[2], false, "run_count_at_first");
    let at_end = b.binary("Add", &at_first, &digit_count, "run_count_at_end_plus_1");
    let at_end = b.binary("Sub", &at_end, &one_f, "run_count_at_end");
    let at_end = b.unsqueeze(&at_end, &[2], "run_count_at_end_col");
    let end_at_t = b.binary("Mul", &membership, &at_end, "run_end_spread");
    let end_at_t = b.reduce_sum(&end_at_t, &[1], false, "run_end_at_t");
    let after = b.binary("Sub", &end_at_t, &counted, "run_after_raw");
    let digits_after = b.binary("Mul", &after, &digits.is_digit, "run_digits_after");

    // Every run holds at least one digit.
    let half = b.scalar_f32("run_half", 0.5);
    let exists = b.binary("Greater", &digit_count, &half, "run_exists_b");
    let exists = b.cast(&exists, FLOAT, "run_exists");
    let count = b.reduce_sum(&exists, &[1], false, "run_count");
    Runs {
        membership,
        digits_after,
        count,
        exists,
        first_digit,
        digit_count,
    }
}

/// `[3]` int64 `[B, -1, 10]`: the gathered `[B·T, 10]` digit logits regrouped by sequence.
/// `[N, 10]` logits of the digits 0..9 (`digit_ids` in that order), gathered from the flat
/// logits. `loss` prefixes the ids constant's name, so each loss keeps its own names.
pub fn digit_logits(b: &mut Builder, seq: &SeqInputs, digit_ids: &[i64; 10], loss: &str) -> String {
    let ids = b.const_i64(&format!("{loss}_digit_ids"), &[10], digit_ids);
    b.gather(&seq.logits, &ids, 1, "digit_logits")
}

/// The digit logits regrouped by sequence, `[B, T, 10]`.
pub fn digit_logits_btk(
    b: &mut Builder,
    seq: &SeqInputs,
    digit_ids: &[i64; 10],
    loss: &str,
) -> String {
    let z = digit_logits(b, seq, digit_ids, loss);
    let shape = digit_shape(b, seq);
    b.node("Reshape", &[&z, &shape], "digit_logits_btk", vec![])
}

fn digit_shape(b: &mut Builder, seq: &SeqInputs) -> String {
    let rest = b.const_i64("digit_shape_rest", &[2], &[-1, 10]);
    b.concat(&[&seq.batch, &rest], 0, "digit_shape")
}

/// `[B, 1]` int64 zeros shaped like the first column of `x`.
fn zero_column(b: &mut Builder, x: &str) -> String {
    let first = b.slice(x, 0, 1, 1, "zero_col_src");
    let zero = b.const_i64("zero", &[], &[0]);
    b.binary("Mul", &first, &zero, "zero_col")
}

/// `x` shifted along T by `k` (k > 0: `out[t] = x[t−k]`; k < 0: `out[t] = x[t+|k|]`), zero-filled.
fn shift(b: &mut Builder, x: &str, zero_col: &str, k: i64, hint: &str) -> String {
    let pad: Vec<&str> = std::iter::repeat_n(zero_col, k.unsigned_abs() as usize).collect();
    if k > 0 {
        let mut parts = pad;
        parts.push(x);
        let padded = b.concat(&parts, 1, &format!("{hint}_padded"));
        let shape = b.node("Shape", &[x], &format!("{hint}_shape"), vec![]);
        let t = b.slice(&shape, 1, 2, 0, &format!("{hint}_len"));
        let zero = b.const_i64(&format!("{hint}_begin"), &[1], &[0]);
        let axis = b.const_i64(&format!("{hint}_axis"), &[1], &[1]);
        b.node("Slice", &[&padded, &zero, &t, &axis], hint, vec![])
    } else {
        let mut parts = vec![x];
        parts.extend(pad);
        let padded = b.concat(&parts, 1, &format!("{hint}_padded"));
        b.slice(&padded, -k, i64::MAX, 1, hint)
    }
}

/// `10^min(e, max_exp)` as float32, looked up in a table of correctly rounded powers so the
/// place values equal the reference's `float32(10.0 ** e)` exactly.
pub fn place_values(b: &mut Builder, exponent: &str, max_exp: i64) -> String {
    let table: Vec<f32> = (0..=max_exp).map(|e| 10f64.powi(e as i32) as f32).collect();
    let table = b.const_f32("place_table", &[max_exp + 1], &table);
    let hi = b.scalar_f32("place_max_exp", max_exp as f32);
    let e = b.binary("Min", exponent, &hi, "place_exponent");
    let e = b.cast(&e, INT64, "place_index");
    b.gather(&table, &e, 0, "place_value")
}

/// `[B, R]` float: `10^(−n/2)` for a run of n digits (n clamped at `max_exp + 1`), divided by
/// `√(n − max_exp)` for longer runs.
///
/// ORT's `DivGrad` squares the denominator, which overflows float32 beyond ~1.8e19 (a
/// 20-digit number) and silently drops a gradient term. Multiplying numerator and denominator
/// of a ratio of whole numbers by this label-side factor keeps every denominator's square
/// finite; the ratio's value is unchanged. A run longer than `max_exp + 1` digits has
/// `n − max_exp` places clamped at `10^max_exp`, so its number grows with that count (a
/// 7000-digit run of 9s is 6.3e34 at `max_exp` 30): the square root keeps the scaled square
/// within about `(n − max_exp)·10^(max_exp+1)`, finite for runs of up to ~4·10^7 digits.
pub fn magnitude_scale(b: &mut Builder, runs: &Runs, max_exp: i64) -> String {
    let table: Vec<f32> = (0..=max_exp + 1)
        .map(|n| 10f64.powf(-(n as f64) / 2.0) as f32)
        .collect();
    let table = b.const_f32("magnitude_scale_table", &[max_exp + 2], &table);
    let hi = b.scalar_f32("magnitude_max_digits", (max_exp + 1) as f32);
    let n = b.binary("Min", &runs.digit_count, &hi, "magnitude_digits");
    let n = b.cast(&n, INT64, "magnitude_index");
    let scale = b.gather(&table, &n, 0, "magnitude_scale_places");
    let max_exp = b.scalar_f32("magnitude_max_exponent", max_exp as f32);
    let clamped = b.binary(
        "Sub",
        &runs.digit_count,
        &max_exp,
        "magnitude_clamped_places",
    );
    let one = b.scalar_f32("magnitude_one", 1.0);
    let clamped = b.binary("Max", &clamped, &one, "magnitude_clamped_at_least_1");
    let root = b.unary("Sqrt", &clamped, "magnitude_clamped_root");
    b.binary("Div", &scale, &root, "magnitude_scale")
}

/// Maximal groups of consecutive member positions of each sequence (DIST2's digit runs, DEL's
/// numbers of digits and dots), indexed in O(B·T): per-group facts are written at one chosen
/// position of each group and read back at every member (`spread`), with ScatterElements and
/// GatherElements rather than NTIL's `[B, R, T]` membership matrix.
pub struct Groups {
    /// `[B, T]` int64: 1..G for the members of group g of the sequence, 0 elsewhere.
    id: String,
    /// `[B, T]` int64: t.
    pos: String,
    /// `[B, T]` float: t.
    pub pos_f: String,
    /// `[B, T]` int64: T + 1 + t, a slot of its own for every position (no collisions).
    spare: String,
    /// `[B, 2T + 1]` float zeros: slot 0 for non-members, 1..T for groups, then the spares.
    slots: String,
    /// `[B, T]` int64 (0/1): the first and the last member of each group.
    pub first: String,
    pub last: String,
}

/// Groups of `member` (`[B, T]` int64, 0/1).
pub fn groups(b: &mut Builder, member: &str) -> Groups {
    let zero_col = zero_column(b, member);
    let prev = shift(b, member, &zero_col, 1, "group_prev");
    let next = shift(b, member, &zero_col, -1, "group_next");
    let one = b.const_i64("group_one", &[], &[1]);
    let not_prev = b.binary("Sub", &one, &prev, "group_not_prev");
    let not_next = b.binary("Sub", &one, &next, "group_not_next");
    let first = b.binary("Mul", member, &not_prev, "group_first");
    let last = b.binary("Mul", member, &not_next, "group_last");
    let axis = b.const_i64("group_axis", &[], &[1]);
    let id = b.node("CumSum", &[&first, &axis], "group_count", vec![]);
    let id = b.binary("Mul", &id, member, "group_id");

    let zero = b.const_i64("group_zero", &[], &[0]);
    let zeros = b.binary("Mul", member, &zero, "group_zeros");
    let ones = b.binary("Add", &zeros, &one, "group_ones");
    let counted = b.node("CumSum", &[&ones, &axis], "group_counted", vec![]);
    let pos = b.binary("Sub", &counted, &one, "group_pos");
    let pos_f = b.cast(&pos, FLOAT, "group_pos_f");
    let shape = b.node("Shape", &[member], "group_shape", vec![]);
    let len = b.slice(&shape, 1, 2, 0, "group_len");
    let spare = b.binary("Add", &counted, &len, "group_spare");
    let zeros_f = b.cast(&zeros, FLOAT, "group_zeros_f");
    let zero_col_f = b.cast(&zero_col, FLOAT, "group_zero_col_f");
    let slots = b.concat(&[&zeros_f, &zeros_f, &zero_col_f], 1, "group_slots");
    Groups {
        id,
        pos,
        pos_f,
        spare,
        slots,
        first,
        last,
    }
}

impl Groups {
    /// `[B, T]` float: at every member of a group, `value` (float `[B, T]`) at the group's
    /// position where `chosen` (int64 0/1, at most one per group) is 1; 0 at non-members and
    /// in groups with no chosen position.
    pub fn spread(&self, b: &mut Builder, value: &str, chosen: &str, hint: &str) -> String {
        let one = b.const_i64(&format!("{hint}_one"), &[], &[1]);
        let not_chosen = b.binary("Sub", &one, chosen, &format!("{hint}_not_chosen"));
        let own = b.binary("Mul", chosen, &self.id, &format!("{hint}_own"));
        let spare = b.binary("Mul", &not_chosen, &self.spare, &format!("{hint}_spare"));
        let slot = b.binary("Add", &own, &spare, &format!("{hint}_slot"));
        let axis = vec![int_attr("axis", 1)];
        let table = b.node(
            "ScatterElements",
            &[&self.slots, &slot, value],
            &format!("{hint}_table"),
            axis.clone(),
        );
        b.node(
            "GatherElements",
            &[&table, &self.id],
            &format!("{hint}_spread"),
            axis,
        )
    }

    /// `[B, T]` float: the position of the group's last member, at every member.
    pub fn last_pos(&self, b: &mut Builder, hint: &str) -> String {
        self.spread(b, &self.pos_f, &self.last, hint)
    }

    /// `[B, T]` int64 positions (for label-side arithmetic in integers).
    pub fn pos(&self) -> &str {
        &self.pos
    }
}
