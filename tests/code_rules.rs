//! Rules about the source itself, checked on every test run: where `unsafe` may stand and how it
//! is documented, and that model families keep their architecture names to themselves.
use std::path::{Path, PathBuf};

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn src_files() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    sources(&root.join("src"), &mut files);
    files.sort();
    files
        .into_iter()
        .map(|p| (p.strip_prefix(root).unwrap().to_string_lossy().replace('\\', "/"), std::fs::read_to_string(&p).unwrap()))
        .collect()
}

/// Whether `line` (trimmed) uses the `unsafe` keyword in code, not in a comment or a string.
fn code_mentions_unsafe(line: &str) -> bool {
    let code = line.split("//").next().unwrap_or("");
    let mut in_str = false;
    let mut words = String::new();
    for c in code.chars() {
        if c == '"' {
            in_str = !in_str;
        } else if !in_str {
            words.push(c);
        }
    }
    words.split(|c: char| !(c.is_alphanumeric() || c == '_')).any(|w| w == "unsafe")
}

/// Files where `unsafe` may stand: the compute kernels, the weight store's typed reads and the
/// static builds' allocator.
fn may_hold_unsafe(path: &str) -> bool {
    path.starts_with("src/kernels/") || path == "src/weights/store.rs" || path == "src/weights/mapped.rs" || path == "src/alloc.rs"
}

#[test]
fn unsafe_lives_in_the_kernels_and_is_documented() {
    let mut problems = Vec::new();
    for (path, text) in src_files() {
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let t = line.trim();
            if t.starts_with("//") || !code_mentions_unsafe(t) {
                continue;
            }
            let at = format!("{path}:{}", i + 1);
            if !may_hold_unsafe(&path) {
                problems.push(format!("{at}: `unsafe` outside src/kernels/ (and the weight store and allocator)"));
            }
            // Comments and attributes directly above.
            let above: Vec<&str> = lines[..i].iter().rev().map(|l| l.trim()).take_while(|l| l.starts_with("//") || l.starts_with("#[")).collect();
            if t.contains("unsafe fn") {
                if !above.iter().any(|l| l.starts_with("///") && l.contains("# Safety")) {
                    problems.push(format!("{at}: an `unsafe fn` without a `# Safety` section"));
                }
            } else if t.contains("unsafe impl") || t.contains("unsafe {") || t.ends_with("unsafe") {
                // A SAFETY comment directly above, or above the statement the block sits in.
                let near = lines[i.saturating_sub(6)..i].iter().any(|l| l.contains("SAFETY"));
                if !near {
                    problems.push(format!("{at}: an `unsafe` block without a `// SAFETY:` comment"));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Every string literal naming one of a family's architectures stands inside that family's folder
/// under `src/models/` (the registry asks the families; nothing else matches their names).
#[test]
fn architecture_names_stay_in_their_family_folder() {
    let files = src_files();
    let mut problems = Vec::new();
    for family in edgerun::models::FAMILIES {
        let mut folders = std::collections::BTreeSet::new();
        for arch in family.architectures() {
            let literal = format!("\"{arch}\"");
            for (path, text) in &files {
                // A command named like an architecture (`edgerun lgatr`) is not a match on the name.
                if text.lines().any(|l| l.contains(&literal) && !l.trim_start().starts_with("//") && !l.contains("#[argh(")) {
                    match path.strip_prefix("src/models/").and_then(|rest| rest.split_once('/')) {
                        Some((folder, _)) => {
                            folders.insert(folder.to_string());
                        }
                        None => problems.push(format!("{path}: names architecture {literal} of {} outside its family folder", family.name())),
                    }
                }
            }
        }
        if folders.len() > 1 {
            problems.push(format!("{}: its architecture names stand in several folders: {folders:?}", family.name()));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Calls that open, read whole, create or rename files: outside `src/fsutil.rs` (and test modules)
/// every file goes through its helpers, which refuse FIFOs, devices, links and inputs before any
/// read or write ([`open_input`, `read_input`, `open_in_place`, `AtomicFile`, `DirSwap`]).
const FILE_CALLS: [&str; 8] = ["File::open", "File::create", "OpenOptions", "fs::read(", "fs::read_to_string(", "fs::write(", "fs::rename(", "fs::copy("];

/// Whether `code` calls `call` itself (`File::create`, not `AtomicFile::create`).
fn calls(code: &str, call: &str) -> bool {
    code.match_indices(call).any(|(i, _)| !code[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_'))
}

#[test]
fn files_are_opened_through_fsutil() {
    let mut problems = Vec::new();
    for (path, text) in src_files() {
        if path == "src/fsutil.rs" {
            continue;
        }
        for (i, line) in text.lines().enumerate() {
            let t = line.trim();
            if t.starts_with("#[cfg(test)]") {
                break;
            }
            let code = t.split("//").next().unwrap_or("");
            if let Some(call) = FILE_CALLS.iter().find(|c| calls(code, c)) {
                problems.push(format!("{path}:{}: `{call}` outside src/fsutil.rs: use fsutil's open_input / read_input / open_in_place / AtomicFile / DirSwap", i + 1));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
