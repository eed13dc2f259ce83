//! The markers of a JPEG stream up to its first scan: quantisation and Huffman tables, the frame
//! (size, components, sampling), the restart interval, the scan's components, and what the JFIF
//! and Adobe markers say about colour. Every length is checked against the bytes that remain.
use super::bits::Source;
use super::huffman::Table;

/// The JPEG zigzag order: `ZIGZAG[k]` is the natural (row-major) index of the k-th coefficient.
pub(crate) const ZIGZAG: [usize; 64] = [
    0, 1, 8, 16, 9, 2, 3, 10, 17, 24, 32, 25, 18, 11, 4, 5, 12, 19, 26, 33, 40, 48, 41, 34, 27, 20, 13, 6, 7, 14, 21, 28, 35, 42, 49, 56, 57, 50, 43, 36,
    29, 22, 15, 23, 30, 37, 44, 51, 58, 59, 52, 45, 38, 31, 39, 46, 53, 60, 61, 54, 47, 55, 62, 63,
];

/// One frame component.
#[derive(Debug, Clone)]
pub(crate) struct Component {
    /// Component identifier.
    pub(crate) id: u8,
    /// Horizontal sampling factor.
    pub(crate) h: usize,
    /// Vertical sampling factor.
    pub(crate) v: usize,
    /// Quantisation table index.
    qid: usize,
    /// Quantisation table (natural order), set when the scan starts.
    pub(crate) quant: [u16; 64],
    /// DC and AC Huffman table indices of the scan.
    pub(crate) tables: (usize, usize),
}

/// What kind of frame a stream has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Baseline or extended sequential Huffman (SOF0, SOF1): decoded here.
    Sequential,
    /// Progressive (SOF2).
    Progressive,
    /// Lossless, arithmetic-coded or hierarchical.
    Other,
}

/// The headers of a JPEG stream up to its first scan.
pub(crate) struct Header {
    /// Frame kind.
    pub(crate) kind: Kind,
    /// Width in pixels.
    pub(crate) width: usize,
    /// Height in pixels.
    pub(crate) height: usize,
    /// Components, in frame order.
    pub(crate) components: Vec<Component>,
    /// DC Huffman tables 0..4.
    pub(crate) dc: [Option<Table>; 4],
    /// AC Huffman tables 0..4.
    pub(crate) ac: [Option<Table>; 4],
    /// MCUs between restart markers (0: none).
    pub(crate) restart: usize,
    /// A JFIF marker was seen.
    pub(crate) jfif: bool,
    /// The Adobe marker's colour transform, if any.
    pub(crate) adobe: Option<u8>,
}

impl Header {
    /// Whether three components hold RGB rather than YCbCr, as libjpeg decides it: an Adobe
    /// transform of 0, or component ids 'R', 'G', 'B' without JFIF or Adobe markers.
    pub(crate) fn is_rgb(&self) -> bool {
        match (self.jfif, self.adobe) {
            (_, Some(t)) => t == 0,
            (true, None) => false,
            (false, None) => self.components.iter().map(|c| c.id).eq([b'R', b'G', b'B']),
        }
    }
}

/// Reads the markers from SOI up to and including the first SOS. `max` bounds the frame size.
pub(crate) fn read(src: &mut Source, max: (usize, usize)) -> Result<Header, String> {
    if src.byte()? != 0xFF || src.byte()? != 0xD8 {
        return Err("not a JPEG stream (no SOI marker)".into());
    }
    let mut quant: [Option<[u16; 64]>; 4] = [None; 4];
    let mut h = Header { kind: Kind::Other, width: 0, height: 0, components: Vec::new(), dc: Default::default(), ac: Default::default(), restart: 0, jfif: false, adobe: None };
    let mut frame = false;
    loop {
        let marker = next_marker(src)?;
        if matches!(marker, 0x01 | 0xD0..=0xD7) {
            continue;
        }
        if marker == 0xD9 {
            return Err("the JPEG stream ends before its image data".into());
        }
        let len = src.u16()? as usize;
        if len < 2 {
            return Err(format!("marker 0xFF{marker:02X} has a length of {len}"));
        }
        let body = src.take(len - 2)?;
        match marker {
            0xDB => read_quant(&body, &mut quant)?,
            0xC4 => read_huffman(&body, &mut h)?,
            0xDD if body.len() >= 2 => h.restart = u16::from_be_bytes([body[0], body[1]]) as usize,
            0xE0 => h.jfif |= body.starts_with(b"JFIF\0"),
            0xEE if body.starts_with(b"Adobe") && body.len() >= 12 => h.adobe = Some(body[11]),
            0xC0..=0xCF if !matches!(marker, 0xC4 | 0xC8 | 0xCC) => {
                if frame {
                    return Err("the JPEG stream has two frame headers".into());
                }
                frame = true;
                h.kind = match marker {
                    0xC0 | 0xC1 => Kind::Sequential,
                    0xC2 => Kind::Progressive,
                    _ => Kind::Other,
                };
                read_frame(&body, &mut h, max)?;
                if h.kind != Kind::Sequential {
                    return Ok(h);
                }
            }
            0xDA => {
                if !frame {
                    return Err("the JPEG scan comes before its frame header".into());
                }
                read_scan(&body, &mut h, &quant)?;
                return Ok(h);
            }
            _ => {}
        }
    }
}

/// The next marker code, skipping fill bytes; anything else between segments is an error.
fn next_marker(src: &mut Source) -> Result<u8, String> {
    if src.byte()? != 0xFF {
        return Err("the JPEG headers are corrupt (expected a marker)".into());
    }
    loop {
        match src.byte()? {
            0xFF => continue,
            0 => return Err("the JPEG headers are corrupt (a stuffed byte between markers)".into()),
            m => return Ok(m),
        }
    }
}

fn read_quant(mut b: &[u8], quant: &mut [Option<[u16; 64]>; 4]) -> Result<(), String> {
    while let Some((&pq_tq, rest)) = b.split_first() {
        let (precision, id) = ((pq_tq >> 4) as usize, (pq_tq & 15) as usize);
        let n = if precision == 0 { 64 } else { 128 };
        if id > 3 || precision > 1 || rest.len() < n {
            return Err("a JPEG quantisation table is corrupt or truncated".into());
        }
        let mut t = [0u16; 64];
        for (k, &z) in ZIGZAG.iter().enumerate() {
            t[z] = if precision == 0 { rest[k] as u16 } else { u16::from_be_bytes([rest[2 * k], rest[2 * k + 1]]) };
        }
        quant[id] = Some(t);
        b = &rest[n..];
    }
    Ok(())
}

fn read_huffman(mut b: &[u8], h: &mut Header) -> Result<(), String> {
    while b.len() >= 17 {
        let (class, id) = ((b[0] >> 4) as usize, (b[0] & 15) as usize);
        let counts: [u8; 16] = b[1..17].try_into().map_err(|_| "a JPEG Huffman table is truncated")?;
        let n: usize = counts.iter().map(|&c| c as usize).sum();
        if class > 1 || id > 3 || n > 256 || b.len() < 17 + n {
            return Err("a JPEG Huffman table is corrupt or truncated".into());
        }
        let table = Table::new(&counts, &b[17..17 + n])?;
        if class == 0 {
            h.dc[id] = Some(table);
        } else {
            h.ac[id] = Some(table);
        }
        b = &b[17 + n..];
    }
    if b.is_empty() {
        Ok(())
    } else {
        Err("a JPEG Huffman table is truncated".into())
    }
}

fn read_frame(b: &[u8], h: &mut Header, max: (usize, usize)) -> Result<(), String> {
    if b.len() < 6 {
        return Err("the JPEG frame header is truncated".into());
    }
    if b[0] != 8 {
        return Err(format!("{}-bit JPEG samples (8-bit are read)", b[0]));
    }
    h.height = u16::from_be_bytes([b[1], b[2]]) as usize;
    h.width = u16::from_be_bytes([b[3], b[4]]) as usize;
    if h.width == 0 || h.height == 0 {
        return Err(format!("the JPEG frame is {}×{} pixels (a height defined later by a DNL marker is not read)", h.width, h.height));
    }
    if h.width > max.0 || h.height > max.1 {
        return Err(format!("the JPEG frame is {}×{} pixels, more than the {}×{} expected", h.width, h.height, max.0, max.1));
    }
    let n = b[5] as usize;
    if b.len() < 6 + 3 * n || !(n == 1 || n == 3) {
        return Err(format!("a JPEG frame of {n} components (gray or three-component colour is read)"));
    }
    for c in b[6..6 + 3 * n].chunks_exact(3) {
        let (hs, vs) = ((c[1] >> 4) as usize, (c[1] & 15) as usize);
        if !(1..=4).contains(&hs) || !(1..=4).contains(&vs) || c[2] > 3 {
            return Err("the JPEG frame header is corrupt".into());
        }
        h.components.push(Component { id: c[0], h: hs, v: vs, qid: c[2] as usize, quant: [0; 64], tables: (0, 0) });
    }
    Ok(())
}

fn read_scan(b: &[u8], h: &mut Header, quant: &[Option<[u16; 64]>; 4]) -> Result<(), String> {
    let n = *b.first().ok_or("the JPEG scan header is truncated")? as usize;
    if b.len() < 4 + 2 * n {
        return Err("the JPEG scan header is truncated".into());
    }
    if n != h.components.len() {
        return Err("a sequential JPEG in several scans (one scan of all components is read)".into());
    }
    for (i, c) in h.components.iter_mut().enumerate() {
        let (id, tables) = (b[1 + 2 * i], b[2 + 2 * i]);
        if id != c.id {
            return Err("the JPEG scan's components differ from the frame's".into());
        }
        let (td, ta) = ((tables >> 4) as usize, (tables & 15) as usize);
        if td > 3 || ta > 3 || h.dc[td].is_none() || h.ac[ta].is_none() {
            return Err("the JPEG scan names a Huffman table that is not defined".into());
        }
        c.tables = (td, ta);
        c.quant = quant[c.qid].ok_or("the JPEG frame names a quantisation table that is not defined")?;
    }
    Ok(())
}
