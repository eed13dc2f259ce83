//! `edgerun edges --depth DIR --out DIR`: Sobel edges of existing `.depth.npy` maps.
use std::path::PathBuf;

use argh::FromArgs;
use candle_core::{Device, Tensor};
use edgerun::edges::sobel_magnitude;
use edgerun::imageio::{colormap::colorize, npy::read_npy_2d, write_npy_f16, write_png_rgb8};
use edgerun::inputs::collect_inputs;
use edgerun::runner::{BatchSetting, MemoryBudget};

use super::run_inputs::{create_out_dir, output_path, progress_mode, run_items, RunSpec};

/// Sobel edges of existing depth maps: `<stem>.edges.npy` for each `<stem>.depth.npy`, mirroring the tree.
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "edges")]
pub struct Args {
    /// directory of `<stem>.depth.npy` files, searched recursively (required)
    #[argh(option)]
    depth: PathBuf,
    /// output directory for `<stem>.edges.npy` (required; may be the --depth directory)
    #[argh(option)]
    out: PathBuf,
    /// also write colour-mapped `<stem>.edges.png`
    #[argh(switch)]
    png: bool,
    /// stop at the first map that fails (default: report it, go on, exit 2 at the end)
    #[argh(switch)]
    fail_fast: bool,
    /// progress display: auto (a bar on a terminal, else lines), bar, lines or none
    #[argh(option, default = "String::from(\"auto\")")]
    progress: String,
}

/// Runs `edges`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let (batch, device) = (BatchSetting::Fixed(1), Device::Cpu);
    let budget = MemoryBudget::FALLBACK;
    let spec = RunSpec { command: "edges", batch, budget, device, fail_fast: a.fail_fast, progress: progress_mode(&a.progress)?, state: None };
    anyhow::ensure!(a.depth.is_dir(), edgerun::Error::Input(format!("--depth {} is not a directory", a.depth.display())));
    // Edge maps can never be taken for depth maps, so --out may be (or lie inside) --depth.
    let items = collect_inputs(std::slice::from_ref(&a.depth), &[".depth.npy"], None)?;
    anyhow::ensure!(!items.is_empty(), edgerun::Error::Input(format!("no .depth.npy files in {}", a.depth.display())));
    create_out_dir(&a.out)?;
    run_items(
        &spec,
        &items,
        |it| Ok(read_npy_2d(&it.path)?),
        |_| None,
        |_, maps| {
            maps.iter()
                .map(|((h, w), v)| {
                    let t = Tensor::from_slice(v, (1, 1, *h, *w), &Device::Cpu)?;
                    Ok(sobel_magnitude(&t)?.flatten_all()?.to_vec1::<f32>()?)
                })
                .collect()
        },
        |it, ((h, w), _), e| {
            write_npy_f16(&output_path(&a.out, it, ".edges.npy")?, &[*h, *w], &e)?;
            if a.png {
                write_png_rgb8(&output_path(&a.out, it, ".edges.png")?, *w as u32, *h as u32, &colorize(&e))?;
            }
            Ok(())
        },
    )
}
