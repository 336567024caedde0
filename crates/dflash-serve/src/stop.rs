//! Stop strings over streamed text: pieces go out as soon as no stop string can still begin in
//! them, and the text ends right before the first stop string that appears.
//!
//! Invariant: the concatenation of everything [`StopFilter::push`] and [`StopFilter::finish`]
//! return is the input's concatenation cut before the earliest occurrence of any stop string.

pub(crate) struct StopFilter {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopFilter {
    pub(crate) fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Whether a stop string has been seen (later pieces are dropped).
    pub(crate) fn stopped(&self) -> bool {
        self.stopped
    }

    /// Adds a piece; returns the text now safe to send.
    pub(crate) fn push(&mut self, piece: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.held.push_str(piece);
        if let Some(cut) = self.stops.iter().filter_map(|s| self.held.find(s)).min() {
            self.stopped = true;
            let out = self.held[..cut].to_string();
            self.held.clear();
            return out;
        }
        // hold back the longest tail that could still grow into a stop string
        let hold = self
            .stops
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&k| s.is_char_boundary(k) && self.held.ends_with(&s[..k]))
                    .max()
            })
            .max()
            .unwrap_or(0);
        let keep_from = self.held.len() - hold;
        let out = self.held[..keep_from].to_string();
        self.held.drain(..keep_from);
        out
    }

    /// The text still held at the end of the answer.
    pub(crate) fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::StopFilter;

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool) {
        let mut f = StopFilter::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out: Vec<String> = pieces.iter().map(|p| f.push(p)).collect();
        out.push(f.finish());
        (out, f.stopped())
    }

    #[test]
    fn cuts_before_a_stop_string_split_over_pieces() {
        let (out, stopped) = run(&["\n\nUser:"], &["Hi", " there\n", "\nUs", "er: more", "x"]);
        assert!(stopped);
        assert_eq!(out.concat(), "Hi there");
        // the newline that could begin the stop string was held back
        assert_eq!(out[1], " there");
    }

    #[test]
    fn releases_held_text_that_did_not_become_a_stop_string() {
        let (out, stopped) = run(&["END", "é!"], &["ab E", "N", "x é", "?"]);
        assert!(!stopped);
        assert_eq!(out.concat(), "ab ENx é?");
        let (out, _) = run(&[], &["a", "b"]);
        assert_eq!(out, ["a", "b", ""]);
    }

    #[test]
    fn the_earliest_of_several_stop_strings_wins() {
        let (out, _) = run(&["cd", "b"], &["abcd"]);
        assert_eq!(out.concat(), "a");
    }
}
