//! Windows of rows. A rank decodes a band of the frame's rows, and within it one tile at a
//! time; every convolution reads one row more on each side than it writes, so each layer's
//! window is the next one's grown by its reach (the halo), clipped to the frame. The decoder
//! computes exactly the rows a window needs, zero-padding only at the frame's true edges, so a
//! band decodes to the same values as the whole frame does.

use std::ops::Range;

/// Rows `start..end` of a frame `height` rows tall.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rows {
    pub start: usize,
    pub end: usize,
    pub height: usize,
}

impl Rows {
    /// Every row of a frame `height` rows tall.
    pub fn all(height: usize) -> Self {
        Self {
            start: 0,
            end: height,
            height,
        }
    }

    pub fn len(&self) -> usize {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }

    pub fn range(&self) -> Range<usize> {
        self.start..self.end
    }

    /// The rows a convolution `reach` rows to each side reads to write these.
    pub fn grown(self, reach: usize) -> Self {
        Self {
            start: self.start.saturating_sub(reach),
            end: (self.end + reach).min(self.height),
            height: self.height,
        }
    }

    /// The rows of a frame half as tall that a nearest-neighbour 2× upsampling of them covers.
    pub fn halved(self) -> Self {
        Self {
            start: self.start / 2,
            end: self.end.div_ceil(2),
            height: self.height / 2,
        }
    }

    /// These rows' zero padding when a convolution `reach` rows to each side writes them:
    /// rows above the frame's top and below its bottom, which no window holds.
    pub fn edge_padding(&self, reach: usize) -> (usize, usize) {
        (
            reach.saturating_sub(self.start),
            (self.end + reach).saturating_sub(self.height),
        )
    }

    /// Whether `self` lies within `outer` (of the same frame).
    pub fn within(&self, outer: &Rows) -> bool {
        self.height == outer.height && outer.start <= self.start && self.end <= outer.end
    }
}

/// `height` rows split into `parts` bands of whole `unit`-row steps, as evenly as they go, the
/// larger bands first. Fails, naming the limit, when there are fewer steps than parts.
pub fn split_rows(height: usize, unit: usize, parts: usize) -> Result<Vec<Rows>, String> {
    let steps = height / unit.max(1);
    if parts == 0 || steps < parts || !height.is_multiple_of(unit.max(1)) {
        return Err(format!(
            "{height} rows in steps of {unit} cannot be split {parts} ways: at most {steps} parts"
        ));
    }
    let (each, extra) = (steps / parts, steps % parts);
    let mut start = 0;
    Ok((0..parts)
        .map(|p| {
            let len = (each + usize::from(p < extra)) * unit;
            let rows = Rows {
                start,
                end: start + len,
                height,
            };
            start += len;
            rows
        })
        .collect())
}

/// `band` cut into tiles of at most `rows` rows, as even as whole rows allow.
pub fn tiles(band: Rows, rows: usize) -> Vec<Rows> {
    let count = band.len().div_ceil(rows.max(1)).max(1);
    let (each, extra) = (band.len() / count, band.len() % count);
    let mut start = band.start;
    (0..count)
        .map(|i| {
            let len = each + usize::from(i < extra);
            let tile = Rows {
                start,
                end: start + len,
                height: band.height,
            };
            start += len;
            tile
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grown_and_halved_stay_in_the_frame() {
        let r = Rows {
            start: 0,
            end: 5,
            height: 12,
        };
        assert_eq!(r.grown(2).range(), 0..7);
        assert_eq!(r.edge_padding(1), (1, 0));
        let bottom = Rows {
            start: 9,
            end: 12,
            height: 12,
        };
        assert_eq!(bottom.grown(1).range(), 8..12);
        assert_eq!(bottom.edge_padding(1), (0, 1));
        assert_eq!(
            bottom.halved(),
            Rows {
                start: 4,
                end: 6,
                height: 6
            }
        );
        let odd = Rows {
            start: 3,
            end: 7,
            height: 12,
        };
        assert_eq!(odd.halved().range(), 1..4);
    }

    #[test]
    fn bands_cover_the_frame_in_steps() {
        let bands = split_rows(48, 8, 4).expect("split");
        let lens: Vec<usize> = bands.iter().map(Rows::len).collect();
        assert_eq!(lens, [16, 16, 8, 8]);
        assert_eq!(bands[3].end, 48);
        assert!(split_rows(48, 8, 7).is_err());
    }
}
