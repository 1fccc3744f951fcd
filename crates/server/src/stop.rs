//! Stop strings matched across token boundaries: text that could still become a stop string
//! is held back until it cannot, so a stream never shows a stop string or a piece of one.

/// The text of one generation, cut at the first stop string.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet released: the end of it may begin a stop string.
    held: String,
}

/// What to emit after a piece of text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Matched {
    /// Text that can be shown; the generation goes on.
    Text(String),
    /// The text before the stop string: the generation ends here.
    Stop(String),
}

impl StopMatcher {
    /// Empty stop strings are ignored.
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    pub fn push(&mut self, piece: &str) -> Matched {
        self.held.push_str(piece);
        let first = self.stops.iter().filter_map(|stop| self.held.find(stop.as_str())).min();
        if let Some(at) = first {
            let text = self.held[..at].to_string();
            self.held.clear();
            return Matched::Stop(text);
        }
        // Keep the longest end of the text that some stop string begins with.
        let keep = self
            .stops
            .iter()
            .map(|stop| {
                (1..stop.len().min(self.held.len() + 1))
                    .rev()
                    .find(|&n| stop.is_char_boundary(n) && self.held.ends_with(&stop[..n]))
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0);
        let release = self.held.len() - keep;
        let text = self.held[..release].to_string();
        self.held.drain(..release);
        Matched::Text(text)
    }

    /// What is still held when the generation ends without a stop string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for piece in pieces {
            match m.push(piece) {
                Matched::Text(t) => out.push_str(&t),
                Matched::Stop(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn a_stop_string_split_over_tokens_ends_the_text_before_it() {
        assert_eq!(run(&["END"], &["hello E", "N", "D more"]), ("hello ".into(), true));
        assert_eq!(run(&["\n\n"], &["a\n", "\nb"]), ("a".into(), true));
    }

    #[test]
    fn a_false_start_is_released_once_it_cannot_match() {
        let mut m = StopMatcher::new(vec!["STOP".into()]);
        assert_eq!(m.push("go ST"), Matched::Text("go ".into()));
        assert_eq!(m.push("ART"), Matched::Text("START".into()));
        assert_eq!(run(&["STOP"], &["ST", "A"]), ("STA".into(), false));
    }

    #[test]
    fn the_earliest_of_several_stops_wins_and_empty_ones_are_ignored() {
        assert_eq!(run(&["b", "", "a"], &["xyab"]), ("xy".into(), true));
        assert_eq!(run(&[""], &["text"]), ("text".into(), false));
    }

    #[test]
    fn multibyte_stop_strings_hold_whole_characters() {
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), true));
        assert_eq!(run(&["é!"], &["café", "?"]), ("café?".into(), false));
    }
}
