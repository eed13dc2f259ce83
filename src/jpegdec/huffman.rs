//! Canonical Huffman tables of a JPEG stream, decoded by a 16-bit window: a direct table for codes
//! of up to 9 bits, the per-length code limits beyond.
/// Bits looked up directly.
const FAST: u32 = 9;

/// One Huffman table.
#[derive(Debug, Clone)]
pub(crate) struct Table {
    /// `(length, symbol)` for each 9-bit prefix whose code is at most 9 bits (length 0: longer).
    fast: Vec<(u8, u8)>,
    /// Largest code of each length 1..=16 (left-aligned in 16 bits, exclusive), or 0.
    max: [u32; 17],
    /// Index into `symbols` of the first code of each length, less that code.
    delta: [i32; 17],
    symbols: Vec<u8>,
}

impl Table {
    /// Builds the table from the 16 code counts and the symbols of a DHT segment.
    pub(crate) fn new(counts: &[u8; 16], symbols: &[u8]) -> Result<Self, String> {
        let mut t = Table { fast: vec![(0, 0); 1 << FAST], max: [0; 17], delta: [0; 17], symbols: symbols.to_vec() };
        let (mut code, mut k) = (0u32, 0usize);
        for len in 1..=16u32 {
            let n = counts[len as usize - 1] as usize;
            t.delta[len as usize] = k as i32 - code as i32;
            for _ in 0..n {
                if code >= 1 << len {
                    return Err("a JPEG Huffman table is corrupt (too many codes)".into());
                }
                if len <= FAST {
                    let first = (code << (FAST - len)) as usize;
                    for e in &mut t.fast[first..first + (1 << (FAST - len))] {
                        *e = (len as u8, symbols[k]);
                    }
                }
                code += 1;
                k += 1;
            }
            t.max[len as usize] = code << (16 - len);
            code <<= 1;
        }
        Ok(t)
    }

    /// `(length, symbol)` of the code at the top of `window` (16 bits), or `None` for a bad code.
    pub(crate) fn decode(&self, window: u16) -> Option<(u32, u8)> {
        let (len, sym) = self.fast[(window >> (16 - FAST)) as usize];
        if len > 0 {
            return Some((len as u32, sym));
        }
        let w = window as u32;
        for len in FAST + 1..=16 {
            if w < self.max[len as usize] {
                let code = (w >> (16 - len)) as i32;
                return self.symbols.get((code + self.delta[len as usize]) as usize).map(|&s| (len, s));
            }
        }
        None
    }
}
