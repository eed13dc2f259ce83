//! A sequential (baseline or extended Huffman) JPEG decoded one output row at a time: MCU rows are
//! entropy-decoded as the rows they hold are asked for, each block through libjpeg's islow IDCT,
//! chroma upsampled as libjpeg's fancy upsampling does; only the MCU rows that the next output rows
//! need (and one row of context above) are held, so memory is bounded by the image width.
use std::collections::VecDeque;
use std::io::Read;

use super::bits::{extend, Bits, Source};
use super::header::{self, Header, Kind, ZIGZAG};
use super::idct::idct;
use super::upsample::{h2v1, h2v2};

/// How a stream opened.
pub(crate) enum Opened {
    /// A sequential stream, ready to hand out rows.
    Sequential(Box<Decoder>),
    /// A progressive stream (not decoded here).
    Progressive,
    /// Another kind, or a sampling layout libjpeg's fancy upsampling does not cover here.
    Unsupported(String),
}

/// One component's decoded rows.
struct Plane {
    /// Rows `first..first + rows.len()` of the component, each `stride` samples.
    rows: VecDeque<Vec<u8>>,
    first: usize,
    stride: usize,
    /// Real width and height of the component (`ceil(W·h/hmax)`, `ceil(H·v/vmax)`).
    dw: usize,
    dh: usize,
    /// Upsampling factors: 1 or 2 across, 1 or 2 down.
    up: (usize, usize),
}

/// A sequential JPEG decoder handing out rows.
pub(crate) struct Decoder {
    src: Source,
    bits: Bits,
    header: Header,
    mcus_across: usize,
    mcus_down: usize,
    mcu_row: usize,
    restart_left: usize,
    preds: Vec<i32>,
    planes: Vec<Plane>,
    next_out: usize,
    scratch: Vec<u8>,
}

impl Decoder {
    /// Reads the headers of the JPEG in `reader`; `max` bounds its width and height.
    pub(crate) fn open(reader: Box<dyn Read>, max: (usize, usize)) -> Result<Opened, String> {
        let mut src = Source::new(reader);
        let mut header = header::read(&mut src, max)?;
        match header.kind {
            Kind::Sequential => {}
            Kind::Progressive => return Ok(Opened::Progressive),
            Kind::Other => return Ok(Opened::Unsupported("a lossless, arithmetic-coded or hierarchical JPEG".into())),
        }
        if header.components.len() == 1 {
            // A single-component scan is not interleaved: its MCU is one block.
            header.components[0].h = 1;
            header.components[0].v = 1;
        }
        let hmax = header.components.iter().map(|c| c.h).max().unwrap_or(1);
        let vmax = header.components.iter().map(|c| c.v).max().unwrap_or(1);
        let (w, h) = (header.width, header.height);
        let mcus_across = w.div_ceil(8 * hmax);
        let mut planes = Vec::new();
        for c in &header.components {
            let up = (hmax / c.h, vmax / c.v);
            if hmax % c.h != 0 || vmax % c.v != 0 || !matches!(up, (1, 1) | (2, 1) | (2, 2)) {
                return Ok(Opened::Unsupported(format!("JPEG chroma subsampling {hmax}×{vmax} to {}×{}", c.h, c.v)));
            }
            let (dw, dh) = ((w * c.h).div_ceil(hmax), (h * c.v).div_ceil(vmax));
            planes.push(Plane { rows: VecDeque::new(), first: 0, stride: mcus_across * c.h * 8, dw, dh, up });
        }
        let restart_left = header.restart;
        let preds = vec![0; header.components.len()];
        Ok(Opened::Sequential(Box::new(Decoder {
            src,
            bits: Bits::new(),
            mcus_across,
            mcus_down: h.div_ceil(8 * vmax),
            mcu_row: 0,
            restart_left,
            preds,
            planes,
            next_out: 0,
            scratch: vec![0; 2 * mcus_across * hmax * 8],
            header,
        })))
    }

    /// `(width, height)`.
    pub(crate) fn dimensions(&self) -> (usize, usize) {
        (self.header.width, self.header.height)
    }

    /// Components per pixel (1 or 3).
    pub(crate) fn components(&self) -> usize {
        self.header.components.len()
    }

    /// The stream's headers.
    pub(crate) fn header(&self) -> &Header {
        &self.header
    }

    /// Decodes the next MCU row into the planes.
    fn decode_mcu_row(&mut self) -> Result<(), String> {
        for (p, c) in self.planes.iter_mut().zip(&self.header.components) {
            for _ in 0..c.v * 8 {
                p.rows.push_back(vec![0; p.stride]);
            }
        }
        let mut coefs = [0i64; 64];
        for mx in 0..self.mcus_across {
            if self.header.restart > 0 {
                if self.restart_left == 0 {
                    self.bits.restart(&mut self.src)?;
                    self.preds.iter_mut().for_each(|p| *p = 0);
                    self.restart_left = self.header.restart;
                }
                self.restart_left -= 1;
            }
            for ci in 0..self.planes.len() {
                let (h, v) = (self.header.components[ci].h, self.header.components[ci].v);
                for by in 0..v {
                    for bx in 0..h {
                        self.decode_block(ci, &mut coefs)?;
                        let p = &mut self.planes[ci];
                        let top = p.rows.len() - v * 8 + by * 8;
                        let x = (mx * h + bx) * 8;
                        let mut block = [0u8; 64];
                        idct(&coefs, &mut block, 8);
                        for (r, line) in block.chunks_exact(8).enumerate() {
                            p.rows[top + r][x..x + 8].copy_from_slice(line);
                        }
                    }
                }
            }
        }
        self.mcu_row += 1;
        Ok(())
    }

    /// Entropy-decodes and dequantises one block of component `ci` into `coefs` (natural order).
    fn decode_block(&mut self, ci: usize, coefs: &mut [i64; 64]) -> Result<(), String> {
        let c = &self.header.components[ci];
        let (dc, ac) = (self.header.dc[c.tables.0].as_ref(), self.header.ac[c.tables.1].as_ref());
        let (Some(dc), Some(ac)) = (dc, ac) else { return Err("the JPEG scan names a Huffman table that is not defined".into()) };
        coefs.fill(0);
        let s = self.bits.symbol(&mut self.src, dc)? as u32;
        if s > 15 {
            return Err("the JPEG scan is corrupt (a DC difference of more than 15 bits)".into());
        }
        let diff = extend(self.bits.bits(&mut self.src, s)?, s);
        self.preds[ci] = self.preds[ci].wrapping_add(diff);
        // Coefficients are held in 16 bits as libjpeg's JCOEF is, which also bounds the IDCT's sums.
        coefs[0] = self.preds[ci] as i16 as i64 * c.quant[0] as i64;
        let mut k = 1;
        while k < 64 {
            let rs = self.bits.symbol(&mut self.src, ac)?;
            let (r, s) = ((rs >> 4) as usize, (rs & 15) as u32);
            if s == 0 {
                if r != 15 {
                    break;
                }
                k += 16;
                continue;
            }
            k += r;
            if k > 63 {
                return Err("the JPEG scan is corrupt (a coefficient past the end of a block)".into());
            }
            let z = ZIGZAG[k];
            coefs[z] = extend(self.bits.bits(&mut self.src, s)?, s) as i64 * c.quant[z] as i64;
            k += 1;
        }
        Ok(())
    }

    /// Writes the next output row's components (upsampled, not colour-converted) into `out`
    /// (`width × components` bytes, interleaved).
    pub(crate) fn next_row(&mut self, out: &mut [u8]) -> Result<(), String> {
        let (w, h) = self.dimensions();
        let y = self.next_out;
        if y >= h {
            return Err("read past the JPEG's last row".into());
        }
        // Decode until every plane holds the rows this output row needs.
        loop {
            let ready = self.planes.iter().all(|p| {
                let (near, far) = needed(p, y);
                p.first + p.rows.len() > near.max(far)
            });
            if ready {
                break;
            }
            if self.mcu_row >= self.mcus_down {
                return Err("the JPEG has fewer MCU rows than its height needs".into());
            }
            self.decode_mcu_row()?;
        }
        let n = self.planes.len();
        for (ci, p) in self.planes.iter_mut().enumerate() {
            let (near, far) = needed(p, y);
            let row = |i: usize| &p.rows[i - p.first][..p.dw];
            let up = &mut self.scratch[..2 * p.dw];
            match p.up {
                (1, 1) => up[..p.dw].copy_from_slice(row(near)),
                (2, 1) => h2v1(row(near), up),
                _ => h2v2(row(near), row(far), up),
            }
            for x in 0..w {
                out[x * n + ci] = up[x];
            }
            // Keep one row above the next output row's for context.
            let keep = (y + 1) / p.up.1;
            while p.first + 1 < keep {
                p.rows.pop_front();
                p.first += 1;
            }
        }
        self.next_out += 1;
        Ok(())
    }
}

/// The plane rows output row `y` uses: the row it lies in and the next nearest (for 2×2).
fn needed(p: &Plane, y: usize) -> (usize, usize) {
    let r = y / p.up.1;
    let far = match (p.up.1, y % 2) {
        (2, 0) => r.saturating_sub(1),
        (2, _) => (r + 1).min(p.dh - 1),
        _ => r,
    };
    (r, far)
}
