//! A tensor read as slices along one axis (RoPE's `rotate_half` reads `x[..., :d/2]` and
//! `x[..., d/2:]`) gets each slice's gradient padded back to its shape with zeros (`Pad`), and
//! the padded parts summed: three passes over the whole tensor. Where the slices tile the axis,
//! the gradient is their gradients concatenated in order: one pass, and the same values (each
//! sum adds zeros; only the sign of a zero may differ).

use std::collections::HashMap;

/// One slice's gradient before it was padded back: `of` fills `[start, end)` of `axis` (of
/// `dim` elements), zeros elsewhere.
pub struct SlicePart {
    pub of: String,
    pub axis: usize,
    pub start: i64,
    pub end: i64,
    pub dim: i64,
    /// The `Pad` node's pads constant.
    pub pads: String,
}

/// The padded slice gradients a rule wrote, by the `Pad`'s output.
#[derive(Default)]
pub struct SliceParts(HashMap<String, SlicePart>);

impl SliceParts {
    pub fn record(&mut self, padded: &str, part: SlicePart) {
        self.0.insert(padded.to_string(), part);
    }

    pub fn contains(&self, padded: &str) -> bool {
        self.0.contains_key(padded)
    }

    /// Where every one of `parts` is a padded slice gradient and together they tile one axis
    /// (no gap, no overlap), those slices in the axis' order.
    pub fn tiling(&self, parts: &[String]) -> Option<Vec<&SlicePart>> {
        let mut pieces: Vec<&SlicePart> =
            parts.iter().map(|p| self.0.get(p)).collect::<Option<_>>()?;
        let first = pieces.first()?;
        let (axis, dim) = (first.axis, first.dim);
        if pieces.iter().any(|p| p.axis != axis || p.dim != dim) {
            return None;
        }
        pieces.sort_by_key(|p| p.start);
        let mut at = 0;
        for p in &pieces {
            if p.start != at || p.end <= p.start {
                return None;
            }
            at = p.end;
        }
        (at == dim).then_some(pieces)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(ranges: &[(i64, i64)]) -> (SliceParts, Vec<String>) {
        let mut s = SliceParts::default();
        let mut names = Vec::new();
        for (k, &(start, end)) in ranges.iter().enumerate() {
            let name = format!("p{k}");
            let part = SlicePart {
                of: format!("g{k}"),
                axis: 3,
                start,
                end,
                dim: 32,
                pads: format!("c{k}"),
            };
            s.record(&name, part);
            names.push(name);
        }
        (s, names)
    }

    #[test]
    fn halves_in_either_order_tile_the_axis() {
        let (s, names) = parts(&[(16, 32), (0, 16)]);
        let order: Vec<&str> = s
            .tiling(&names)
            .unwrap()
            .iter()
            .map(|p| p.of.as_str())
            .collect();
        assert_eq!(order, ["g1", "g0"]);
    }

    #[test]
    fn a_gap_an_overlap_or_a_repeat_does_not() {
        for ranges in [
            &[(0, 16), (17, 32)][..],
            &[(0, 17), (16, 32)],
            &[(0, 16), (0, 16)],
            &[(0, 16)],
            &[(0, 16), (16, 31)],
        ] {
            let (s, names) = parts(ranges);
            assert!(s.tiling(&names).is_none(), "{ranges:?}");
        }
    }

    #[test]
    fn a_part_that_is_not_a_slice_gradient_stops_it() {
        let (s, mut names) = parts(&[(0, 16), (16, 32)]);
        names.push("other".into());
        assert!(s.tiling(&names).is_none());
    }
}
