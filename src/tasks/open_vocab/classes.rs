//! The class list of an open-vocabulary segmentation: SegEarth-OV-3's class-file format (one class
//! per line, its synonyms comma-separated, each synonym a prompt; a `background` line is a prompt like
//! any other) or the command line's `--prompts "building,roof;tree;…"`.
use std::path::Path;

use crate::error::{Error, Result};
use crate::models::sam3::prompts::MAX_PROMPTS;
use crate::tasks::segment::MAX_UINT8_CLASSES;

/// Classes and the prompts that name them.
#[derive(Debug, Clone, PartialEq)]
pub struct ClassList {
    /// Each class's synonyms, in class-id order.
    pub classes: Vec<Vec<String>>,
    /// Every distinct prompt, in order of first appearance (each is grounded once).
    pub prompts: Vec<String>,
    /// For each class, the indices into `prompts` of its synonyms.
    pub members: Vec<Vec<usize>>,
}

impl ClassList {
    /// Parses a class file's text: one class per line (lines trimmed, trailing blank lines
    /// ignored), synonyms separated by commas. An empty line between classes, an empty synonym,
    /// more than [`MAX_UINT8_CLASSES`] classes or [`MAX_PROMPTS`] prompts are errors.
    pub fn parse_lines(text: &str) -> std::result::Result<Self, String> {
        let lines: Vec<&str> = text.trim_end().lines().collect();
        Self::from_entries(lines.iter().enumerate().map(|(i, l)| (format!("line {}", i + 1), *l)))
    }

    /// Parses `--prompts`: classes separated by `;`, synonyms by `,`.
    pub fn parse_inline(text: &str) -> std::result::Result<Self, String> {
        let parts: Vec<&str> = text.trim().trim_end_matches(';').split(';').collect();
        Self::from_entries(parts.iter().enumerate().map(|(i, p)| (format!("class {}", i + 1), *p)))
    }

    /// Reads a class file (UTF-8); errors name it.
    pub fn read(path: &Path) -> Result<Self> {
        let text = crate::fsutil::read_input_text(path, crate::fsutil::MAX_TEXT_INPUT)?;
        Self::parse_lines(&text).map_err(|m| Error::bad_file(path, m))
    }

    fn from_entries<'a>(entries: impl Iterator<Item = (String, &'a str)>) -> std::result::Result<Self, String> {
        let mut list = ClassList { classes: Vec::new(), prompts: Vec::new(), members: Vec::new() };
        for (place, entry) in entries {
            if entry.trim().is_empty() {
                return Err(format!("{place}: an empty class (every class needs at least one prompt)"));
            }
            let mut synonyms = Vec::new();
            let mut members = Vec::new();
            for s in entry.split(',') {
                let s = s.trim();
                if s.is_empty() {
                    return Err(format!("{place}: an empty synonym in `{}`", entry.trim()));
                }
                let at = match list.prompts.iter().position(|p| p == s) {
                    Some(at) => at,
                    None => {
                        list.prompts.push(s.to_string());
                        list.prompts.len() - 1
                    }
                };
                if !members.contains(&at) {
                    members.push(at);
                }
                synonyms.push(s.to_string());
            }
            list.classes.push(synonyms);
            list.members.push(members);
            if list.classes.len() > MAX_UINT8_CLASSES {
                return Err(format!("more than {MAX_UINT8_CLASSES} classes: a uint8 class map holds ids 0-254 (255 = no data)"));
            }
            if list.prompts.len() > MAX_PROMPTS {
                return Err(format!("more than {MAX_PROMPTS} prompts"));
            }
        }
        if list.classes.is_empty() {
            return Err("no classes".into());
        }
        Ok(list)
    }

    /// Each class's name: its first synonym.
    pub fn names(&self) -> Vec<String> {
        self.classes.iter().map(|s| s[0].clone()).collect()
    }

    /// The class count.
    pub fn len(&self) -> usize {
        self.classes.len()
    }

    /// Whether there are no classes (never, once parsed).
    pub fn is_empty(&self) -> bool {
        self.classes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synonyms_share_a_class_and_prompts_are_grounded_once() {
        let l = ClassList::parse_lines("background\r\nbuilding, roof ,house\ntree,forest\nroof\n\n").unwrap();
        assert_eq!(l.names(), ["background", "building", "tree", "roof"]);
        assert_eq!(l.prompts, ["background", "building", "roof", "house", "tree", "forest"]);
        assert_eq!(l.members, vec![vec![0], vec![1, 2, 3], vec![4, 5], vec![2]]);
        assert_eq!(ClassList::parse_inline("background;building,roof,house;tree,forest;roof;").unwrap().prompts, l.prompts);
    }

    #[test]
    fn empty_classes_and_synonyms_are_refused() {
        assert!(ClassList::parse_lines("").unwrap_err().contains("no classes"));
        assert!(ClassList::parse_lines("a\n\nb").unwrap_err().contains("line 2: an empty class"));
        assert!(ClassList::parse_lines("a\nb,,c").unwrap_err().contains("line 2: an empty synonym"));
        assert!(ClassList::parse_inline("a;;b").unwrap_err().contains("class 2"));
        let many: String = (0..256).map(|i| format!("c{i}\n")).collect();
        assert!(ClassList::parse_lines(&many).unwrap_err().contains("uint8"));
    }
}
