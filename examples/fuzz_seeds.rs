//! Writes the fuzzers' seed corpus (tiny valid safetensors and GGUF files, one folder per fuzz target):
//! `cargo run --example fuzz_seeds [DIR]`, DIR defaulting to `fuzz/corpus-seeds`. `tests/malformed.rs`
//! checks that the committed corpus equals what this writes.
#[path = "../tests/common/weight_files.rs"]
mod weight_files;

use std::path::PathBuf;

fn main() -> std::io::Result<()> {
    let root = std::env::args_os().nth(1).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("fuzz/corpus-seeds"));
    let seeds = weight_files::fuzz_seeds();
    for (target, name, bytes) in &seeds {
        let dir = root.join(target);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(name), bytes)?;
    }
    println!("wrote {} seeds under {}", seeds.len(), root.display());
    Ok(())
}
